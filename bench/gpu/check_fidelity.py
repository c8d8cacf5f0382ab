"""Which explains a kernel timed slower under region than alone: the held siblings' CPU work, the
core fence, or the clock? (issue 38, item 4; one NVIDIA GPU, torch, triton)

    python3 -m bench.gpu.check_fidelity [--configs NAME:SERVE ARGS ...] [--siblings 7] [--rounds 6]
                                        [--reps 3] [--size 8192] [--deadline 240] [--out DIR]

The lead: on an H100 a 1.5 ms matmul (triton.testing.do_bench, 8192^2 fp16) ran +4.6% slower at
the median under region than alone, its siblings held by the driver lock with their CPU threads
running. Here, per daemon configuration (default: `lock` --hold lock; `freeze` --hold freeze, the
siblings' CPU threads stopped too; `lock-nofence` --region-cores 0, no cores of its own for the
owner and no fence; `lock-nosettle` --settle-ms 0 --warm-ms 0, no wait for the clock and no
warm-up), a fresh `krex serve --policy region` runs N sibling commands (each loops: --sibling-cpu-ms
of torch CPU matmuls on all cores, as a job builds its inputs, then GPU matmuls and a synchronise)
and one owner command, which in each round times the matmul in three blocks, in a rotating order:

- `alone`: the siblings idle (told so through a file, acknowledged), no region: the baseline;
- `idle-region`: the siblings idle, the timing in a region: what the region does to its owner
  (cores, fence, settle, drain, warm-up) with nothing to hold back;
- `region`: the siblings working, the timing in a region: held as the configuration holds them.

Each block is --reps do_bench calls (return_mode="all"); its median and p95 are over their samples.
Per configuration: each mode's median over blocks and its inflation against `alone`, with the alone
blocks' own spread, and whether the difference exceeds it (every block of one beat every block of
the other: bench/steady_report.compare). Then, paired by round (region over alone of the same
round, so drift cancels), lock against freeze (the siblings' CPU work), against lock-nofence (the
fence) and against lock-nosettle (the clock): the VERDICT lines say which moved the inflation beyond
the spread. The SM clock (pynvml, where importable) is read at each block's start and end.

--device cpu runs the same protocol on the cpu device (pure-Python kernel and siblings, the host
clock): the pipeline's test on a machine without a GPU. Results: DIR/check_fidelity.json and .txt,
rewritten after every configuration; configurations that would pass --deadline are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, write_json
from bench.harness.stats import pct
from bench.steady_report import compare

MODES = ("alone", "idle-region", "region")
DEFAULT_CONFIGS = (
    "lock:--hold lock",
    "freeze:--hold freeze",
    "lock-nofence:--hold lock --region-cores 0",
    "lock-nosettle:--hold lock --settle-ms 0 --warm-ms 0",
)
# what each pair of configurations tells apart: (A, B, what differs)
PAIRS = (
    ("lock", "freeze", "the held siblings' CPU threads running (lock) or stopped (freeze)"),
    ("lock", "lock-nofence", "the core fence (--region-cores 0: none)"),
    ("lock", "lock-nosettle", "the clock settle and warm-up (--settle-ms 0 --warm-ms 0)"),
)
CONFIG_S = 45.0  # one configuration with the defaults: start, siblings, 6 rounds, stop (planned)


# ----------------------------------------------------------------------------- the krex commands


def _state(ctl: Path, idx: int, state: str) -> None:
    tmp = ctl / f".state-{idx}"
    tmp.write_text(state)
    tmp.replace(ctl / f"state-{idx}")


def sibling(ctl: Path, idx: int, device: str, size: int, cpu_ms: float) -> None:
    """Loop until ctl/stop: with ctl/work present, --sibling-cpu-ms of CPU work then GPU matmuls and
    a synchronise; else idle. Each change of state is written to ctl/state-IDX."""
    if device == "gpu":
        import torch

        a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        o = torch.empty_like(a)
        h = torch.randn(1024, 1024)
        torch.cuda.synchronize()

        def cpu() -> None:
            torch.mm(h, h)

        def gpu() -> None:
            for _ in range(10):
                torch.matmul(a, a, out=o)
            torch.cuda.synchronize()
    else:

        def cpu() -> None:
            sum(i * i for i in range(20_000))

        def gpu() -> None:
            pass

    state = ""
    while not (ctl / "stop").exists():
        want = "work" if (ctl / "work").exists() else "idle"
        if want != state:
            state = want
            _state(ctl, idx, state)
        if state == "idle":
            time.sleep(0.005)
            continue
        end = time.perf_counter() + cpu_ms / 1e3
        while time.perf_counter() < end:
            cpu()
        gpu()


def _timer(device: str, size: int) -> Any:
    """The kernel's do_bench: a list of ms samples per call."""
    if device == "gpu":
        import torch
        import triton.testing

        a = torch.randn(size, size, device="cuda", dtype=torch.float16)
        b = torch.randn(size, size, device="cuda", dtype=torch.float16)
        return lambda: list(triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="all"))

    def bench() -> list[float]:  # do_bench's shape on the host clock: ~100 ms of calls
        out: list[float] = []
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end or len(out) < 5:
            t = time.perf_counter()
            sum(i * i for i in range(20_000))
            out.append((time.perf_counter() - t) * 1e3)
        return out

    return bench


def _clock() -> Any:
    """The SM clock (MHz) and the clocks-event reasons, or None without pynvml or a GPU."""
    try:
        import pynvml as nv

        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return None

    def read() -> dict[str, int]:
        return {
            "sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "reasons": int(nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
        }

    return read


def _wait_state(ctl: Path, n: int, state: str, limit: float = 30.0) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        got = [(ctl / f"state-{i}").read_text() if (ctl / f"state-{i}").exists() else "" for i in range(n)]
        if all(s == state for s in got):
            return True
        time.sleep(0.01)
    return False


def owner(a: argparse.Namespace) -> None:
    """The timing command: per round the three modes in a rotating order; one JSON line."""
    import msgspec

    from krex_async import region

    ctl = Path(a.owner)
    bench = _timer(a.device, a.size)
    bench()  # compile and warm once, outside the blocks
    clock = _clock()
    blocks = []
    for r in range(a.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            work = mode == "region"
            (ctl / "work").touch() if work else (ctl / "work").unlink(missing_ok=True)
            acked = _wait_state(ctl, a.siblings, "work" if work else "idle")
            time.sleep(a.busy_s if work else a.quiet_s)  # siblings at it / the device quiet again
            b: dict[str, Any] = {"round": r, "mode": mode, "acked": acked, "clock_start": clock and clock()}
            samples: list[float] = []
            if mode == "alone":
                for _ in range(a.reps):
                    samples += bench()
            else:
                with region("timing") as g:
                    b["affinity"] = sorted(os.sched_getaffinity(0))
                    for _ in range(a.reps):
                        samples += bench()
                rep = getattr(g, "report", None)
                b["report"] = msgspec.to_builtins(rep) if rep is not None else None
            b["clock_end"] = clock and clock()
            b["n"] = len(samples)
            b["median_ms"] = statistics.median(samples)
            b["p95_ms"] = pct(samples, 0.95)
            blocks.append(b)
    (ctl / "work").unlink(missing_ok=True)
    print(json.dumps({"fidelity": 1, "blocks": blocks}), flush=True)


# ------------------------------------------------------------------------------- the controller


async def run_config(name: str, args: list[str], a: argparse.Namespace) -> dict[str, Any]:
    """One configuration: a fresh daemon, its siblings, the owner; the owner's blocks."""
    from bench.harness.stack import Daemon, bench_env, module_argv
    from krex_async import Client

    ctl = Path(tempfile.mkdtemp(prefix="krex-fidelity-"))
    ctl.chmod(0o777)
    devices = ["--devices", "cpu:1"] if a.device == "cpu" else []
    log = Path(a.out) / "check_fidelity.logs" / f"daemon-{name}.log"
    me = "bench.gpu.check_fidelity"
    common = ["--device", a.device, "--size", str(a.size)]
    t = time.monotonic()
    out: dict[str, Any] = {"config": name, "args": args}
    try:
        # No memory admission: the siblings run until the owner ends, and commands of unknown
        # footprint are admitted one at a time, so the owner would wait for ever (it is timing
        # that is checked here, not memory)
        serve = ["--log-format", "json", "--admission", "off", *devices, *args]
        async with Daemon(serve, policy="region", log=log) as d:
            async with await Client.connect(d.socket) as c:
                sibs = [
                    await c.submit(
                        module_argv(me, "--sibling", str(ctl), "--index", str(i), *common,
                                    "--sibling-cpu-ms", str(a.sibling_cpu_ms)),
                        cwd=str(Path.cwd()), env=bench_env(), device="auto", timeout=600,
                    )
                    for i in range(a.siblings)
                ]  # fmt: skip
                argv = [
                    *common,
                    "--rounds",
                    str(a.rounds),
                    "--reps",
                    str(a.reps),
                    "--siblings",
                    str(a.siblings),
                ]
                argv += ["--busy-s", str(a.busy_s), "--quiet-s", str(a.quiet_s)]
                res = await c.run(
                    module_argv(me, "--owner", str(ctl), *argv),
                    cwd=str(Path.cwd()),
                    env=bench_env(),
                    device="auto",
                    timeout=max(60.0, a.deadline),
                )
                (ctl / "stop").touch()
                ends = await asyncio.gather(*(s.wait() for s in sibs))
    except Exception as e:  # the daemon refused this configuration, or a command: a result
        out["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
        return out
    finally:
        (ctl / "stop").touch()
        shutil.rmtree(ctl, ignore_errors=True)
    out["wall_s"] = time.monotonic() - t
    out["siblings_rc"] = [e.returncode for e in ends]
    lines = [ln for ln in res.stdout.decode(errors="replace").splitlines() if ln.startswith('{"fidelity"')]
    if res.returncode != 0 or not lines:
        out["error"] = f"owner rc {res.returncode}: {res.stderr.decode(errors='replace')[-1500:]}"
        return out
    out["blocks"] = json.loads(lines[-1])["blocks"]
    return out


def analyse(cfg: dict[str, Any]) -> dict[str, Any]:
    """Per mode: medians and p95s over blocks, inflation against alone, and whether it exceeds the
    alone blocks' spread; per round, region over alone (the paired ratios the verdicts compare)."""
    blocks = cfg.get("blocks") or []
    by = {m: [b for b in blocks if b["mode"] == m] for m in MODES}
    alone_med = [b["median_ms"] for b in by["alone"]]
    alone_p95 = [b["p95_ms"] for b in by["alone"]]
    out: dict[str, Any] = {"modes": {}}
    if not alone_med:
        return out
    base_med, base_p95 = statistics.median(alone_med), statistics.median(alone_p95)
    for m, bs in by.items():
        meds, p95s = [b["median_ms"] for b in bs], [b["p95_ms"] for b in bs]
        if not meds:
            continue
        out["modes"][m] = {
            "blocks": len(bs),
            "median_ms": statistics.median(meds),
            "p95_ms": statistics.median(p95s),
            "median_range_ms": [min(meds), max(meds)],
            "inflation_median": statistics.median(meds) / base_med - 1.0,
            "inflation_p95": statistics.median(p95s) / base_p95 - 1.0,
            "vs_alone_median": compare(meds, alone_med),
            "vs_alone_p95": compare(p95s, alone_p95),
            "clock_start_mhz": [(b.get("clock_start") or {}).get("sm_mhz") for b in bs],
            "settle_s": [((b.get("report") or {}).get("settle_s")) for b in bs],
            "hold": sorted({str((b.get("report") or {}).get("hold")) for b in bs if b.get("report")}),
        }
    out["alone_spread_median"] = max(alone_med) / min(alone_med) - 1.0
    out["alone_spread_p95"] = max(alone_p95) / min(alone_p95) - 1.0
    rounds = sorted({b["round"] for b in blocks})
    for m in ("idle-region", "region"):
        out[f"paired_{m}"] = [
            x["median_ms"] / y["median_ms"] - 1.0
            for r in rounds
            for x in by[m]
            for y in by["alone"]
            if x["round"] == r and y["round"] == r
        ]
    return out


def verdicts(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, cfg in results.items():
        an = cfg.get("analysis") or {}
        for m in ("idle-region", "region"):
            x = (an.get("modes") or {}).get(m)
            if not x:
                continue
            beyond = x["vs_alone_median"]["beyond_spread"]
            out.append(
                f"VERDICT {name} {m}: median {x['inflation_median']:+.2%}, "
                f"p95 {x['inflation_p95']:+.2%} against alone "
                f"(alone blocks' spread {an['alone_spread_median']:.2%} median, "
                f"{an['alone_spread_p95']:.2%} p95): "
                + {
                    True: "beyond the alone spread",
                    False: "within the alone spread (noise)",
                    None: "too few blocks",
                }[beyond]
            )
    for a_name, b_name, what in PAIRS:
        pa = ((results.get(a_name) or {}).get("analysis") or {}).get("paired_region")
        pb = ((results.get(b_name) or {}).get("analysis") or {}).get("paired_region")
        if not pa or not pb:
            continue
        c = compare(pa, pb)
        out.append(
            f"VERDICT {what}: region over alone by round {a_name} {statistics.median(pa):+.2%} "
            f"[{min(pa):+.2%}..{max(pa):+.2%}], {b_name} {statistics.median(pb):+.2%} "
            f"[{min(pb):+.2%}..{max(pb):+.2%}]: "
            + {
                True: "they differ beyond the rounds' spread: this explains (part of) it",
                False: "within the rounds' spread: not this",
                None: "too few rounds",
            }[c["beyond_spread"]]
        )
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    out = [
        f"{'config / mode':<28} {'blocks':>6} {'median ms':>10} {'p95 ms':>9} {'infl p50':>9} {'infl p95':>9}"
    ]
    for name, cfg in results.items():
        if cfg.get("error"):
            out.append(f"{name:<28} did not run: {cfg['error'].strip().splitlines()[-1][:150]}")
            continue
        for m, x in (cfg.get("analysis") or {}).get("modes", {}).items():
            out.append(
                f"{name + ' ' + m:<28} {x['blocks']:>6} {x['median_ms']:>10.4f} {x['p95_ms']:>9.4f} "
                f"{x['inflation_median']:>+9.2%} {x['inflation_p95']:>+9.2%}"
            )
    return "\n".join(out + [""] + verdicts(results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__.split("\n")[0] if __doc__ else None
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        metavar="NAME:SERVE ARGS",
        help="configurations to run; a bare NAME is that default one (e.g. --configs lock freeze)",
    )
    ap.add_argument("--siblings", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3, help="do_bench calls per block")
    ap.add_argument("--size", type=int, default=8192, help="the matmul's n (fp16, n x n)")
    ap.add_argument("--sibling-cpu-ms", type=float, default=300.0, help="CPU work per sibling iteration")
    ap.add_argument(
        "--busy-s", type=float, default=1.0, help="seconds the siblings work before a region block"
    )
    ap.add_argument(
        "--quiet-s", type=float, default=0.5, help="seconds of idle siblings before an idle block"
    )
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--deadline", type=float, default=240.0, help="skip configurations past S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of the results")
    # the krex commands this check runs (internal)
    ap.add_argument("--sibling", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--owner", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if min(a.siblings, a.rounds, a.reps, a.size) < 1 or min(a.busy_s, a.quiet_s, a.sibling_cpu_ms) < 0:
        ap.error("--siblings, --rounds, --reps and --size must be positive, the times not negative")
    a.parsed = []
    defaults = {c.partition(":")[0]: c for c in DEFAULT_CONFIGS}
    for text in a.configs:
        name, colon, rest = defaults.get(text, text).partition(":")
        if not name.strip() or not colon:
            ap.error(f"--configs {text!r}: NAME:SERVE ARGS, or one of {', '.join(defaults)}")
        a.parsed.append((name.strip(), rest.split()))
    if len({n for n, _ in a.parsed}) != len(a.parsed):
        ap.error("--configs: names must differ")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.sibling:
        sibling(Path(a.sibling), a.index, a.device, a.size, a.sibling_cpu_ms)
        return 0
    if a.owner:
        owner(a)
        return 0
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    path = Path(a.out) / "check_fidelity.json"
    for name, args in a.parsed:
        spent = max([r["wall_s"] for r in results.values() if "wall_s" in r] or [CONFIG_S])
        if time.monotonic() - t0 + spent > a.deadline:
            results[name] = {
                "config": name,
                "args": args,
                "error": f"skipped: past --deadline {a.deadline:g} s",
            }
            continue
        cfg = asyncio.run(run_config(name, args, a))
        cfg["analysis"] = analyse(cfg)
        results[name] = cfg
        write_json(path, {"configs": results, "verdicts": verdicts(results)})
    text = table(results)
    write_json(path, {"configs": results, "verdicts": verdicts(results)})
    (Path(a.out) / "check_fidelity.txt").write_text(text + "\n")
    print(text)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
