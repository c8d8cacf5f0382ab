"""Replay an agent trace through real krex daemons, one per policy, and compare them.

    python -m bench.replay trace.jsonl --policies region,command,shared --concurrency N \
        --out bench/results/NAME.json
    python -m bench.replay --profile quick --out bench/results/quick.json   # generate, then replay

For each policy it starts `python -m krex_async serve --socket S --policy P` as a subprocess, waits
for the socket, replays the sessions with N agents at once (each agent: one krex_async.Client, its
session's commands in order, sleeping each think time first), then stops the daemon (SIGTERM, then
SIGKILL after a grace period) whatever happened. Before the policies, an isolated pass times every
distinct kernel|method of the trace alone, in one command, as the inflation baseline, and (unless
--no-isolated-after) once more after them: the GPU's state drifts over a run (run F's isolated pass
timed 1-10 ms kernels 5% slower than both policies that followed), so the baseline brackets the
passes it judges. Every raw number
(command reports, result lines, samples) goes into the JSON; the summary and table come from
analysis.py. A stderr line shows progress. A daemon that does not come up fails the run with its log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import analysis
from bench.harness.output import Progress, module_prog, write_json
from bench.harness.stack import ROOT, Daemon, bench_env, module_argv
from bench.trace_format import dump_lines, kernel_key, read_trace, sessions

AGENT_CMD = "bench.workload.agent_cmd"  # run as `python -m` with the repository as cwd


def _builtins(x: Any) -> Any:
    try:
        import msgspec

        return msgspec.to_builtins(x)
    except (ImportError, TypeError):
        return x


def parse_result(stdout: bytes) -> list[dict[str, Any]]:
    """The agent command's result lines (JSON objects with "krex_bench": 1) in its stdout."""
    out = []
    for raw in stdout.decode("utf-8", "replace").splitlines():
        if raw.startswith("{") and '"krex_bench"' in raw:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(raw))
    return out


def daemon(policy: str, opts: argparse.Namespace, name: str) -> Daemon:
    """The pass's daemon (JSON logs to <out>.logs/daemon-NAME.log), with --daemon-arg."""
    return Daemon(
        ["--log-format", "json", *opts.daemon_arg],
        policy=policy,
        python=opts.python,
        log=opts.logdir / f"daemon-{name}.log",
        prefix="krex-rp-",
    )


def command_env(target: str) -> dict[str, str]:
    """The environment replayed commands get: ours, the repository on PYTHONPATH, one BLAS thread."""
    env = bench_env()
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(k, "1")
    if target == "cpu":
        env["KREX_BENCH_DEVICE"] = "cpu"
    return env


async def _submit(c: Any, argv: list[str], opts: argparse.Namespace, env: dict[str, str], label: str) -> Any:
    return await c.run(
        argv, cwd=str(ROOT), env=env, device=opts.device, timeout=opts.cmd_timeout, label=label
    )


async def replay_pass(policy: str, trace: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    """Run the trace's sessions under one policy's daemon; returns the pass's raw records."""
    by = sessions(trace)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for s in by:
        queue.put_nowait(s)
    env = command_env(trace[0]["target"])
    # Every pass compiles afresh, as the agents it replays did: the same trace line compiles the
    # same kernel source in every pass, and with one shared Triton/Inductor cache only the first
    # pass (region) would pay the compiles.
    caches = tempfile.mkdtemp(prefix=f"krex-replay-{policy}-caches-")
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    records: list[dict[str, Any]] = []
    prog = Progress(policy, len(trace))
    try:
        return await _replay(policy, by, queue, env, records, prog, opts)
    finally:
        shutil.rmtree(caches, ignore_errors=True)


async def _replay(
    policy: str,
    by: dict[str, list[dict[str, Any]]],
    queue: asyncio.Queue[str],
    env: dict[str, str],
    records: list[dict[str, Any]],
    prog: Progress,
    opts: argparse.Namespace,
) -> dict[str, Any]:
    from krex_async import Client

    async with daemon(policy, opts, policy) as d:
        t0 = time.monotonic()

        async def agent() -> None:
            while True:
                try:
                    name = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                async with await Client.connect(d.socket) as c:
                    for line in by[name]:
                        await asyncio.sleep(line["think_s"] * opts.think_scale)
                        argv = module_argv(
                            AGENT_CMD,
                            "--pace",
                            opts.pace,
                            "--spec",
                            json.dumps(line, separators=(",", ":")),
                            python=opts.command_python,
                        )
                        prog.running += 1
                        s0 = time.monotonic()
                        try:
                            res = await _submit(c, argv, opts, env, f"{name}/{line['order']}")
                            err = ""
                        except Exception as e:  # a failed command is a record, not the end of the run
                            res, err = None, f"{type(e).__name__}: {e}"
                        s1 = time.monotonic()
                        prog.running -= 1
                        results = parse_result(res.stdout) if res is not None else []
                        ok = bool(res is not None and res.returncode == 0 and results)
                        records.append(
                            {
                                "session": name,
                                "order": line["order"],
                                "key": kernel_key(line),
                                "start_s": s0 - t0,
                                "end_s": s1 - t0,
                                "client_s": s1 - s0,
                                "ok": ok,
                                "returncode": None if res is None else res.returncode,
                                "error": err,
                                "report": None if res is None else _builtins(res.report),
                                "result": results[-1] if results else None,
                                "stderr_tail": (
                                    "" if res is None or ok else res.stderr[-1500:].decode("utf-8", "replace")
                                ),
                            }
                        )
                        prog.done += 1
                        prog.failed += not ok
                        prog.show()

        async def ticker() -> None:
            while True:
                prog.show()
                await asyncio.sleep(0.5)

        tick = asyncio.create_task(ticker())
        try:
            await asyncio.gather(*(agent() for _ in range(min(opts.concurrency, len(by)))))
        finally:
            tick.cancel()
        makespan = time.monotonic() - t0
    prog.show(final=True)
    return {"policy": policy, "makespan_s": makespan, "commands": sorted(records, key=lambda r: r["start_s"])}


def isolated_lines(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per distinct kernel|method, with no host work and only the compile the kernel needs."""
    seen: dict[str, dict[str, Any]] = {}
    for line in trace:
        k = kernel_key(line)
        if k in seen:
            continue
        iso = json.loads(json.dumps(line))
        for p in iso["phases"].values():
            p["cpu_s"] = 0.0
        if iso["phases"]["compile"].get("gpu"):
            iso["phases"]["compile"]["gpu"]["count"] = 1 if line["kernel"]["kind"] == "elementwise" else 0
        iso["phases"]["compile"]["tag"] = f"isolated-{len(seen)}"
        seen[k] = iso
    return list(seen.values())


async def isolated_pass(
    trace: list[dict[str, Any]], opts: argparse.Namespace, name: str = "isolated"
) -> dict[str, Any]:
    """Every distinct kernel timed alone (one command, nothing else on the daemon), `repeats` times."""
    from krex_async import Client

    lines = isolated_lines(trace)
    spec = opts.logdir / "isolated-kernels.jsonl"
    spec.write_text("".join(dump_lines(lines)))
    prog = Progress(name, 1)
    async with daemon("command", opts, name) as d:
        async with await Client.connect(d.socket) as c:
            t0 = time.monotonic()
            prog.running = 1
            res = await _submit(
                c,
                module_argv(
                    AGENT_CMD,
                    "--isolated",
                    str(spec),
                    "--repeats",
                    str(opts.repeats),
                    python=opts.command_python,
                ),
                opts,
                command_env(trace[0]["target"]),
                "isolated",
            )
            prog.running, prog.done = 0, 1
    prog.show(final=True)
    results = parse_result(res.stdout)
    if res.returncode != 0 or not results:
        raise RuntimeError(
            f"{name} pass failed (rc {res.returncode}): {res.stderr[-2000:].decode('utf-8', 'replace')}"
        )
    return {
        "seconds": time.monotonic() - t0,
        "kernels": len(lines),
        "repeats": opts.repeats,
        "results": results,
        "report": _builtins(res.report),
    }


def _trace_from_args(a: argparse.Namespace) -> tuple[Path, list[dict[str, Any]]]:
    if a.trace:
        return Path(a.trace), read_trace(a.trace)
    from bench import gen_trace

    prof = gen_trace.load_profile(a.profile)
    lines = gen_trace.generate(prof, a.sessions or int(prof["sessions"]), a.seed)
    path = a.logdir / f"trace-{prof['name']}-{a.seed}.jsonl"
    path.write_text("".join(dump_lines(lines)))
    if a.concurrency is None:
        a.concurrency = int(prof.get("concurrency", a.sessions or prof["sessions"]))
    return path, read_trace(path)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    """The whole comparison: trace, isolated pass, each policy's pass, summary. Writes the JSON."""
    path, trace = _trace_from_args(a)
    n_sessions = len(sessions(trace))
    a.concurrency = a.concurrency or n_sessions
    a.device = a.device or ("cpu" if trace[0]["target"] == "cpu" else "auto")
    data: dict[str, Any] = {
        "config": {
            "trace": str(path),
            "commands": len(trace),
            "sessions": n_sessions,
            "concurrency": a.concurrency,
            "policies": a.policies,
            "think_scale": a.think_scale,
            "cores": a.cores,
            "device": a.device,
            "daemon_args": a.daemon_arg,
            "repeats": a.repeats,
            "isolated_after": a.isolated_after,
            "pace": a.pace,
            "started_at": time.time(),
            "argv": sys.argv,
            "host": os.uname().nodename,
        },
        "passes": {},
    }
    data["isolated"] = await isolated_pass(trace, a)
    write_json(a.out, data)
    for pol in a.policies:
        data["passes"][pol] = await replay_pass(pol, trace, a)
        data["summary"] = analysis.summarise(data, trace)
        write_json(a.out, data)  # after every pass: a run cut short still leaves what it measured
    if a.isolated_after and a.policies:
        data["isolated_after"] = await isolated_pass(trace, a, "isolated_after")
        data["summary"] = analysis.summarise(data, trace)
    data["config"]["ended_at"] = time.time()
    write_json(a.out, data)
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description="replay an agent trace through krex, per policy"
    )
    ap.add_argument("trace", nargs="?", help="trace.jsonl (or --profile to generate one)")
    ap.add_argument("--profile", default="quick", help="generate the trace from this profile")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="region,command,shared")
    ap.add_argument("--concurrency", type=int, default=None, help="agents at once (default: sessions)")
    ap.add_argument("--think-scale", type=float, default=1.0, help="multiply every think time")
    ap.add_argument("--repeats", type=int, default=3, help="isolated pass repeats per kernel")
    ap.add_argument(
        "--isolated-after",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the kernels alone again after the policies; the baseline is the "
        "median over both isolated passes (default: on)",
    )
    ap.add_argument(
        "--pace",
        choices=["trace", "wall", "none"],
        default="trace",
        help="trace (default): every phase of a command but its timing costs at least "
        "the trace's expect_s of CPU time (real work, then more host work), so each "
        "pass replays the trace's work and a frozen phase ends later, as a real one "
        "does; wall: at least expect_s of wall-clock time (before issue 21: absorbs "
        "freezes); none: the real work alone",
    )
    ap.add_argument("--device", default=None, help="device to submit to (default: cpu or auto)")
    ap.add_argument("--cmd-timeout", type=float, default=600.0)
    ap.add_argument("--python", default=sys.executable, help="interpreter of the daemon")
    ap.add_argument("--command-python", default=None, help="interpreter of the commands (default: --python)")
    ap.add_argument("--daemon-arg", action="append", default=[], help="extra `krex serve` argument")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replay.json")
    ap.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores for the ideal ratio's C/P bound (default: this machine's)",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="print sizes, ideal ratio and lower-bound pass durations of the trace, run nothing",
    )
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    a.policies = [p for p in a.policies.split(",") if p]
    bad = set(a.policies) - {"region", "command", "shared"}
    if bad:
        ap.error(f"unknown policies {sorted(bad)}")
    a.command_python = a.command_python or a.python
    a.logdir = a.out.parent / (a.out.stem + ".logs")
    a.logdir.mkdir(parents=True, exist_ok=True)
    return a


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """What a run would do, from the trace alone: sizes, the ideal ratio, rough pass durations (s)."""
    from bench import gen_trace

    path, trace = _trace_from_args(a)
    n = a.concurrency or len(sessions(trace))
    ideal = analysis.trace_ideal(trace, n, a.cores, a.think_scale)
    iso = isolated_lines(trace)
    iso_s = 5.0 + a.repeats * sum(x["phases"]["timing"]["expect_s"] + 0.5 for x in iso)
    est = {
        "isolated": iso_s * (2 if a.isolated_after else 1),
        "command": ideal["lb_command_s"],
        "region": ideal["lb_region_s"],
        "shared": ideal["lb_region_s"],
    }
    return {
        "trace": str(path),
        **gen_trace.summary(trace),
        "sessions": len(sessions(trace)),
        "concurrency": n,
        "distinct_kernels": len(iso),
        "ideal_trace": ideal,
        "estimated_s": {k: round(v, 1) for k, v in est.items() if k == "isolated" or k in a.policies},
        "estimated_total_s": round(est["isolated"] + sum(est[p] for p in a.policies), 1),
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plan:
        print(json.dumps(plan(a), indent=1))
        return 0
    data = asyncio.run(run(a))
    print(analysis.table(data["summary"]))
    print(f"\nraw numbers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
