"""bench/gpu/check_fidelity.py: the verdict arithmetic on made-up blocks, then the whole protocol
on the cpu device (real daemons, sibling commands held by real regions, an owner timing in blocks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import check_fidelity as cf
from tests.bench.conftest import run_script


def _blocks(alone: list[float], region: list[float]) -> list[dict[str, Any]]:
    out = []
    for r, (a, g) in enumerate(zip(alone, region)):
        out.append({"round": r, "mode": "alone", "median_ms": a, "p95_ms": a * 1.02})
        out.append(
            {"round": r, "mode": "region", "median_ms": g, "p95_ms": g * 1.02, "report": {"hold": "lock"}}
        )
    return out


def test_verdicts_say_which_configuration_moved_the_inflation_beyond_the_spread() -> None:
    alone = [1.50, 1.51, 1.49, 1.50]
    results = {
        "lock": {"blocks": _blocks(alone, [1.57, 1.58, 1.56, 1.57])},  # +4.6%, the lead
        "freeze": {"blocks": _blocks(alone, [1.50, 1.515, 1.495, 1.50])},  # within noise
        "lock-nofence": {"blocks": _blocks(alone, [1.565, 1.58, 1.56, 1.575])},  # as lock
    }
    for cfg in results.values():
        cfg["analysis"] = cf.analyse(cfg)
    lock = results["lock"]["analysis"]
    assert lock["modes"]["region"]["inflation_median"] == pytest.approx(1.57 / 1.50 - 1)
    assert lock["alone_spread_median"] == pytest.approx(1.51 / 1.49 - 1)
    assert lock["modes"]["region"]["vs_alone_median"]["beyond_spread"] is True
    assert results["freeze"]["analysis"]["modes"]["region"]["vs_alone_median"]["beyond_spread"] is False
    v = cf.verdicts(results)
    assert any(
        x.startswith("VERDICT lock region: median +4.67%") and "beyond the alone spread" in x for x in v
    )
    assert any(x.startswith("VERDICT freeze region") and "within the alone spread (noise)" in x for x in v)
    cpu = next(x for x in v if "CPU threads" in x)
    assert "this explains (part of) it" in cpu
    fence = next(x for x in v if "core fence" in x)
    assert "not this" in fence
    assert not any("clock settle" in x for x in v)  # not run: no verdict
    assert "lock region" in cf.table(results)


@pytest.mark.slow
def test_the_whole_protocol_on_the_cpu_device(tmp_path: Path) -> None:
    p = run_script(
        "-m", "bench.gpu.check_fidelity", "--device", "cpu", "--siblings", "2", "--rounds", "3",
        "--reps", "1", "--busy-s", "0.1", "--quiet-s", "0.05", "--sibling-cpu-ms", "30",
        "--configs", "freeze:--hold freeze", "lock-nofence:--hold freeze --region-cores 0",
        "bad:--no-such-flag",
        "--out", str(tmp_path), timeout=180, check=False,
    )  # fmt: skip
    assert p.returncode == 1, p.stderr  # the refused configuration
    data = json.loads((tmp_path / "check_fidelity.json").read_text())
    assert "no-such-flag" in data["configs"]["bad"]["error"]
    for name in ("freeze", "lock-nofence"):
        blocks = data["configs"][name]["blocks"]
        assert [b["mode"] for b in blocks[:3]] == ["alone", "idle-region", "region"]
        assert [b["mode"] for b in blocks[3:6]] == ["idle-region", "region", "alone"]  # rotated
        assert all(b["acked"] and b["n"] >= 5 for b in blocks)
        for b in blocks:
            if b["mode"] == "alone":
                assert "report" not in b
            else:  # both siblings held by every region, working or idle
                assert b["report"]["hold"] == "freeze" and len(b["report"]["frozen"]) == 2, b["report"]
        assert data["configs"][name]["siblings_rc"] == [0, 0]
    fenced = {tuple(b["affinity"]) for b in data["configs"]["freeze"]["blocks"] if "affinity" in b}
    open_ = {tuple(b["affinity"]) for b in data["configs"]["lock-nofence"]["blocks"] if "affinity" in b}
    assert all(len(a) < len(o) for a in fenced for o in open_), (fenced, open_)  # the owner's own cores
    assert "VERDICT freeze region" in p.stdout and "bad" in p.stdout
    assert (tmp_path / "check_fidelity.txt").read_text().startswith("config / mode")


def test_the_gpu_code_paths_call_what_torch_and_triton_offer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sibling's and the owner's GPU work against stand-ins that accept only the calls and
    arguments the real torch and triton.testing take, so a wrong name fails here, not on the device."""
    import sys
    import threading
    import types

    calls: list[str] = []

    def rec(name: str, result: Any = None) -> Any:
        def f(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return result

        return f

    torch = types.ModuleType("torch")
    torch.float16 = "float16"  # type: ignore[attr-defined]
    torch.randn = rec("randn", object())  # type: ignore[attr-defined]
    torch.empty_like = rec("empty_like", object())  # type: ignore[attr-defined]
    torch.mm = rec("mm")  # type: ignore[attr-defined]

    def matmul(a: Any, b: Any, *, out: Any = None) -> Any:
        calls.append("matmul")

    torch.matmul = matmul  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(synchronize=rec("synchronize"))  # type: ignore[attr-defined]
    triton = types.ModuleType("triton")
    testing = types.ModuleType("triton.testing")

    def do_bench(fn: Any, warmup: int = 25, rep: int = 100, return_mode: str = "mean") -> Any:
        assert return_mode == "all"
        fn()
        return [1.5, 1.6]

    testing.do_bench = do_bench  # type: ignore[attr-defined]
    triton.testing = testing  # type: ignore[attr-defined]
    for name, mod in (("torch", torch), ("triton", triton), ("triton.testing", testing)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert cf._timer("gpu", 64)() == [1.5, 1.6] and "matmul" in calls
    (tmp_path / "work").touch()
    t = threading.Thread(target=cf.sibling, args=(tmp_path, 0, "gpu", 64, 1.0), daemon=True)
    t.start()
    assert cf._wait_state(tmp_path, 1, "work", 10)
    (tmp_path / "work").unlink()
    assert cf._wait_state(tmp_path, 1, "idle", 10)
    (tmp_path / "stop").touch()
    t.join(10)
    assert not t.is_alive() and {"mm", "matmul", "synchronize"} <= set(calls)
