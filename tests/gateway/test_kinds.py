"""/v1/env with a driver and toolkit, and eval and profile jobs where an evaluator and a profiler are
installed: a stand-in Atrex-Bench checkout (scripts/run_eval.py) and a stand-in `ncu` on PATH
exercise the gateway's side (request checks, bundle layout, argv, result parsing) on real processes;
the real tools need the GPU host (bench/gateway_profile_check.py runs them there)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from .conftest import job_python, stack

RUN_EVAL = textwrap.dedent("""
    import argparse, json, pathlib, sys
    p = argparse.ArgumentParser()
    for a in ("--input", "--reference-dir", "--output", "--atol", "--rtol",
              "--num-correctness-cases", "--bench-iters"):
        p.add_argument(a, required=True)
    p.add_argument("--clock-locked", action="store_true")
    a = p.parse_args()
    ref = pathlib.Path(a.reference_dir)
    out = pathlib.Path(a.output)
    out.mkdir(parents=True)
    shapes = json.loads((ref / "shapes.json").read_text())
    cand = pathlib.Path(a.input).read_text()
    (out / "eval_result.json").write_text(json.dumps({
        "correctness": {"shapes": {k: {"status": "passed"} for k in shapes}},
        "candidate_bytes": len(cand), "bench_iters": int(a.bench_iters),
        "reference_files": sorted(x.name for x in ref.iterdir())}))
""")
# Records its options and checks that its target is the one-call driver (which needs torch and a
# GPU, so it is not run here), then writes a CSV as `ncu --csv --log-file` does.
FAKE_NCU = textwrap.dedent("""\
    #!{py}
    import json, os, sys
    args, opts, i = sys.argv[1:], {{}}, 0
    while i < len(args) and args[i].startswith("--"):
        if args[i] == "--csv":
            i += 1
            continue
        opts[args[i]] = args[i + 1]
        i += 2
    target = args[i:]
    assert target[1].endswith("/profile_driver.py") and os.path.isfile(target[1]), target
    log = opts["--log-file"]
    with open(os.path.join(os.path.dirname(log), "opts.json"), "w") as f:
        json.dump(opts, f)
    with open(log, "w") as f:
        f.write("==PROF== banner\\n")
        f.write('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\\n')
        f.write('"0","add_kernel","gpu__time_duration.sum","usecond","1.234"\\n')
        f.write('"0","add_kernel","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","61.5"\\n')
        f.write('"0","add_kernel","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","%","80"\\n')
        f.write('"1","small_kernel","gpu__time_duration.sum","nsecond","10"\\n')
    sys.exit(0)
""")


FAKE_SMI = textwrap.dedent("""\
    #!/bin/sh
    case "$1" in
      --query-gpu=compute_cap) echo 9.0 ;;
      *) echo "NVIDIA H200, 143771, 580.159.04" ;;
    esac
""")


def bundle(c: object) -> dict[str, object]:
    return {
        "spec": {"target_hardware": ["local"]},
        "candidate": "class Model: pass\n",
        "reference": {
            "operator": "add",
            "reference_py": "class Model: pass\n",
            "input_py": "def get_inputs(): return []\n",
            "shapes": {"0": {"n": 4}, "1": {"n": 8}},
        },
        "options": {"bench_iters": 7, "timeout_s": 60},
    }


def install_tools(home: Path, run_eval: str = RUN_EVAL) -> tuple[Path, dict[str, str]]:
    """A stand-in Atrex-Bench checkout and ncu/nvidia-smi/nvcc on PATH, where jobs can read them.
    Returns (the checkout, the gateway's environment)."""
    bench = home / "atrex-bench"
    (bench / "scripts").mkdir(parents=True)
    (bench / "scripts" / "run_eval.py").write_text(run_eval)
    bindir = home / "bin"
    bindir.mkdir()
    ncu = bindir / "ncu"
    ncu.write_text(FAKE_NCU.format(py=job_python()))
    ncu.chmod(0o755)
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    for tool in ("nvidia-smi", "nvcc"):
        (bindir / tool).chmod(0o755)
    for p in (bench, bench / "scripts", bindir):
        p.chmod(0o755)
    return bench, {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


async def test_eval_and_profile_with_installed_tools(tmp_path: Path, gwhome: Path) -> None:
    bench, env = install_tools(gwhome / "scratch")
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        node = await c.env("local")
        assert (node["vendor"], node["gpu_model"], node["total_memory_mb"]) == (
            "nvidia",
            "NVIDIA H200",
            143771,
        )
        assert node["driver_version"] == "580.159.04" and node["arch"] == "sm_90"
        assert node["toolchain"]["nvcc"] == "12.8" and node["probe_error"] is None
        status, job = await c.request("POST", "/v1/jobs/eval", json=bundle(c))
        assert status == 202 and job["kind"] == "eval" and job["job_id"].startswith("ev_"), job
        assert job["mode"] == "full" and job["mode_enforced"] is True
        view = await c.wait(job["job_id"], 60)
        assert view["status"] == "succeeded", view
        r = view["result"]
        assert r["bench_iters"] == 7 and set(r["correctness"]["shapes"]) == {"0", "1"}
        assert r["reference_files"] == ["input.py", "metadata.json", "reference.py", "shapes.json"]
        assert r["krex"]["state"] == "exited" and r["krex"]["regions"] == []

        status, legacy = await c.request("POST", "/v1/evals", json={**bundle(c), "mode": "correctness_only"})
        assert status == 202
        got = await c.request("GET", f"/v1/evals/{legacy['job_id']}?wait=true&timeout=30")
        assert got[0] == 200 and got[1]["result"]["bench_iters"] == 1

        status, bad = await c.request("POST", "/v1/jobs/eval", json={**bundle(c), "mode": "x"})
        assert (status, bad["reason"]) == (422, "invalid_mode")
        status, bad = await c.request(
            "POST", "/v1/jobs/eval", json={**bundle(c), "reference": {"operator": "add"}}
        )
        assert (status, bad["reason"]) == (422, "invalid_reference")

        status, prof = await c.request("POST", "/v1/jobs/profile", json={**bundle(c), "level": "sol"})
        assert status == 202 and prof["job_id"].startswith("pf_"), prof
        view = await c.wait(prof["job_id"], 60)
        assert view["status"] == "succeeded", view
        big, small = view["result"]["kernels"]  # by duration, in ns, as the reference gateway
        assert (big["name"], big["duration"], big["duration_unit"]) == ("add_kernel", 1234.0, "ns")
        assert big["metrics"]["gpu__time_duration.sum"] == 1.234
        assert (big["compute_sol_pct"], big["mem_sol_pct"], big["bound"]) == (61.5, 80.0, "memory")
        assert small == {**small, "name": "small_kernel", "duration": 10.0}
        status, bad = await c.request("POST", "/v1/jobs/profile", json={**bundle(c), "level": "everything"})
        assert (status, bad["reason"]) == (422, "invalid_level")
