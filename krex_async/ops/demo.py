"""`krex demo`: start a daemon, run a small concurrent agent-like workload with regions, print reports.

Each demo command does what a kernel agent's benchmark command does: set-up work that may overlap
with others (a compile, a warm-up), then a timed loop inside `region("timing")`. The demo runs the
workload under the `region` and `shared` policies on one daemon flag each and prints what every
region cost and how far the timings moved from the same kernel timed alone.

The baseline is made the way the commands are timed, or the verdict would measure the baseline:
each alone run is the same command, submitted alone to the region daemon (so it gets the region
cores a command's region gets: a plain process timed outside krex ran 8-10% slower than the same
loop inside a region on a busy machine, and made regions look faster than alone), warmed up and
sampled as a command is; and alone runs are interleaved with the policies (before, between, after),
so a machine that speeds up or slows down during the demo moves both. Their spread is the noise
floor the verdict is judged against; past NOISY_PCT the verdict says the machine is too noisy to
judge instead of passing whatever the policies did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

WARM_S, SAMPLES, ALONE_RUNS = 0.4, 31, 3  # ALONE_RUNS at each of the three points
NOISY_PCT = 15.0  # alone runs spread wider than this: no verdict on a few-percent effect

WORK = r"""
import json, os, sys, time
from krex_async import region

def kernel(n=60_000):              # a fixed "kernel": the same work every call
    s = 0
    for i in range(n):
        s += i * i
    return s

t = time.perf_counter()
src = "\n".join(f"def f{i}(x): return x * {i} + {i}" for i in range(3000))
compile(src, "generated", "exec")  # "compile": real CPU work that may overlap with others
while time.perf_counter() - t < float(sys.argv[1]):
    kernel()                       # warm-up, as a benchmark harness does before timing
with region("timing") as r:
    samples = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        kernel()
        samples.append(time.perf_counter() - t0)
samples.sort()
print(json.dumps({"median_ms": samples[len(samples) // 2] * 1e3}))
"""


def _env(tmp: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KREX_SOCKET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


async def _workload(
    sock: str,
    script: str,
    n: int,
    env: dict[str, str],
) -> tuple[float, list[dict[str, float]]]:
    from krex_async.client.submit import Client

    async with await Client.connect(sock) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(c.run([sys.executable, script, str(WARM_S), str(SAMPLES)], env=env) for _ in range(n))
        )
        makespan = time.monotonic() - t0
    rows = []
    for res in results:
        if res.returncode != 0:
            rep = res.report
            raise SystemExit(
                f"demo command {rep.command} failed: {rep.state}, exit {rep.exit_code}, "
                f"signal {rep.signal} {rep.error}\n{res.stderr.decode(errors='replace')}"
            )
        info = json.loads(res.stdout)
        reg = res.report.regions[0]
        rows.append(
            {
                "command": res.report.command,
                "wall_s": res.report.wall_s,
                "wait_ms": reg.wait_s * 1e3,
                "enter_ms": reg.enter_s * 1e3,
                "held_ms": reg.held_s * 1e3,
                "frozen": len(reg.frozen),
                "median_ms": info["median_ms"],
            }
        )
    return makespan, rows


async def _alone(sock: str, script: str, env: dict[str, str], runs: int) -> list[float]:
    """The kernel's median, timed alone: the same command submitted alone to the region daemon
    (nothing else of the demo running), `runs` times one after another."""
    out = []
    for _ in range(runs):
        _, rows = await _workload(sock, script, 1, env)
        out.append(rows[0]["median_ms"])
    return out


def verdict(
    alone: list[float], medians: dict[str, list[float]], load: tuple[float, int] | None = None
) -> list[str]:
    """What the numbers say, judged against the alone runs' own spread (the noise floor):
    `medians` is each policy's per-command medians (ms), `load` the load average and core count.
    Sharing shows in its worst commands (those whose timed loops overlapped), so the verdict
    compares the worst command of each policy, not only the typical one."""
    base = statistics.median(alone)
    noise = 100 * (max(alone) - min(alone)) / base
    floor = max(5.0, noise)

    def pct(x: float) -> float:
        return 100 * (x / base - 1)

    lines = [
        f"alone: {base:.2f} ms, the median of {len(alone)} runs before, between and after "
        f"(they span {noise:.1f}%)"
    ]
    busy = f"load average {load[0]:.1f} on {load[1]} cores; " if load else ""
    worst = {p: max(pct(m) for m in ms) for p, ms in medians.items()}
    typical = {p: pct(statistics.median(ms)) for p, ms in medians.items()}
    for p in medians:
        lines.append(f"{p:<7} typical command {typical[p]:+.1f}%, worst command {worst[p]:+.1f}% vs alone")
    reg, sh = worst.get("region", 0.0), worst.get("shared", 0.0)
    if noise > NOISY_PCT and sh > noise:
        lines.append(
            f"verdict: sharing moved a timing {sh:+.1f}%, beyond even this machine's noise (the same "
            f"command alone spans {noise:.0f}%; {busy.rstrip('; ') or 'load unknown'}); whether "
            f"regions kept timings within a few percent cannot be judged here (region's worst "
            f"{reg:+.1f}%): run it again on a quieter machine for that."
        )
    elif noise > NOISY_PCT:
        lines.append(
            f"verdict: none: this machine is too noisy to judge ({busy}the same command alone "
            f"spans {noise:.0f}%, over the {NOISY_PCT:.0f}% a verdict needs): region's worst "
            f"{reg:+.1f}% and sharing's worst {sh:+.1f}% cannot be told from that noise. Run it "
            f"again on a quieter machine."
        )
    elif reg > floor:
        lines.append(
            f"verdict: a timing inside a region moved {reg:+.1f}%, beyond the alone runs' "
            f"spread ({floor:.0f}%): something outside the demo competes for the CPU"
            f" ({busy.rstrip('; ') or 'load unknown'}), and krex holds back only its own commands. "
            f"On a quiet node the region column stays within the noise; `krex doctor` checks the "
            f"isolation."
        )
    elif sh > floor:
        lines.append(
            f"verdict: regions kept every timing within {floor:.0f}% of alone (worst "
            f"{reg:+.1f}%); without them the commands' timed loops overlapped (worst "
            f"{sh:+.1f}%)."
        )
    else:
        lines.append(
            f"verdict: no difference above the noise ({floor:.0f}%) this time: the timed "
            f"loops did not overlap much; run it with more commands (krex demo -n 12)."
        )
    return lines


def next_steps() -> str:
    """NEXT, saying where krex is when it is not on PATH (a fresh checkout's .venv/bin/krex), and
    with the replay only where this is a checkout with bench/."""
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), "krex")
    on_path = shutil.which("krex")
    text = NEXT
    if os.path.exists(here) and (on_path is None or os.path.realpath(on_path) != os.path.realpath(here)):
        rel = os.path.relpath(here)
        rel = here if rel.startswith("..") else rel
        text = text.replace(
            "next:", f"next (krex is {rel} here; `. {os.path.dirname(rel)}/activate` puts it on PATH):", 1
        )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, "bench", "replay.py")):
        return text[: text.index("  PYTHON -m bench.replay")].rstrip()
    py = os.path.relpath(sys.executable)
    return text.replace("PYTHON", "python" if py.startswith("..") else py)


NEXT = """next:
  krex doctor                          what this node supports, each with its fix
  krex serve &                         a daemon of your own (--policy region|command|shared)
  krex run -- python bench.py          run a command under it; wrap its timed loop in
                                       `with region("timing"):` (docs/usage.md)
  krex status --watch / krex trace     what runs and what is frozen; live events
  PYTHON -m bench.replay --profile quick --seed 1 --out /tmp/quick.json
                                       the three policies side by side on a replayed agent trace"""


def main(n: int = 6) -> int:
    """Run the demo; Ctrl-C ends it with 130 and a line (its daemon already stopped by then)."""
    tmp = tempfile.mkdtemp(prefix="krex-demo-", dir="/tmp")
    try:
        return _demo(n, tmp)
    except KeyboardInterrupt:
        print(f"\nkrex demo: interrupted; its daemon was stopped (logs in {tmp})", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _daemon(tmp: str, policy: str) -> Iterator[str]:
    """A daemon of `policy` on a socket (and state dir) of its own under `tmp`; stopped after."""
    sock = os.path.join(tmp, f"{policy}.sock")
    with open(os.path.join(tmp, f"{policy}.log"), "wb") as log:
        daemon = subprocess.Popen(
            [
                *(sys.executable, "-m", "krex_async", "serve", "--socket", sock, "--policy", policy),
                *("--log-format", "json", "--state-dir", os.path.join(tmp, f"state-{policy}")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while not os.path.exists(sock):
                if daemon.poll() is not None:
                    raise SystemExit(f"daemon failed; see {log.name}")
                time.sleep(0.02)
            yield sock
        finally:
            daemon.terminate()
            daemon.wait(20)


def _demo(n: int, tmp: str) -> int:
    script = os.path.join(tmp, "work.py")
    with open(script, "w") as f:
        f.write(WORK)
    env = _env(tmp)
    print(
        f"krex demo: {n} concurrent agent-like commands under the region and the shared policy,\n"
        f"and the same command alone (through krex, one at a time) before, between and after them\n",
        flush=True,
    )
    alone: list[float] = []
    medians: dict[str, list[float]] = {}
    with _daemon(tmp, "region") as region_sock:
        alone += asyncio.run(_alone(region_sock, script, env, ALONE_RUNS))
        for policy in ("region", "shared"):
            with contextlib.ExitStack() as stack:
                sock = region_sock if policy == "region" else stack.enter_context(_daemon(tmp, policy))
                makespan, rows = asyncio.run(_workload(sock, script, n, env))
            alone += asyncio.run(_alone(region_sock, script, env, ALONE_RUNS))
            medians[policy] = [r["median_ms"] for r in rows]
            _print_policy(policy, makespan, rows, statistics.median(alone))
    for line in verdict(alone, medians, (os.getloadavg()[0], os.cpu_count() or 1)):
        print(line)
    print(f"\nlogs and scripts in {tmp}\n")
    print(next_steps())
    return 0


def _print_policy(policy: str, makespan: float, rows: list[dict[str, float]], base: float) -> None:
    print(f"policy {policy}: makespan {makespan:.2f} s")
    print(
        f"  {'command':<12} {'wall s':>7} {'wait ms':>8} {'enter ms':>9} {'held ms':>8} "
        f"{'frozen':>6} {'median ms':>10} {'vs alone':>9}"
    )
    for r in rows:
        print(
            f"  {r['command']:<12} {r['wall_s']:>7.2f} {r['wait_ms']:>8.1f} "
            f"{r['enter_ms']:>9.2f} {r['held_ms']:>8.1f} {r['frozen']:>6} "
            f"{r['median_ms']:>10.2f} {100 * (r['median_ms'] / base - 1):>+8.1f}%"
        )
    med = statistics.median(r["median_ms"] for r in rows)
    print(f"  median timing {med:.2f} ms ({100 * (med / base - 1):+.1f}% vs alone so far)\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
