"""Real agent jobs through a real `krex gateway` over a real `krex serve`, every policy in one run.

    python -m bench.jobs --kernelbench ~/KernelBench [--atrex ~/atrex-bench] [--triton N]
                         [--set tiny|default|large] [--width 8] [--variants NAME:ARGS ...]
                         [--device auto|gpu|cpu] [--out results/jobs.json] [--alone-rounds 2]
                         [--command-jobs distinct|all] [--budget-s 540]

What it measures: what an agent gets. Each job (bench/workload/job.py) is a dev job as an agent's
tool submits it: upload, `python job.py spec.json`, imports, inputs, a check against the reference,
then timing the way the suite's own harness times (KernelBench: its kernelbench.timing, run unchanged
as an auto-region; Triton and Atrex: do_bench, an auto-region). All jobs of a set go in at once, the
gateway runs `--width` of them at a time, no pacing: each phase does its real work and nothing else,
so a frozen import simply ends later. Per variant (a `krex serve` configuration: `NAME:ARGS`, the
policy from --policy in ARGS or the name's first word) a fresh daemon and gateway; alone rounds
(each distinct job alone, in one process per device kind) before the first variant and after the
last (more are spread between) give the timing baseline and its own spread. `command`, the serial
baseline, runs one copy of each distinct job by default. A default run budgets itself to one
10-minute accelerator call: each pass is planned from the passes measured so far and skipped when
it would not end, with the last alone round, within --budget-s.

What could hide a cost: jobs/min counts only jobs that succeeded (failures are listed); the alone
rounds share one process's imports (their phase times are not an agent's); command's jobs/min comes
from the distinct jobs only (the table says so; --command-jobs all for the whole set); the ideal of
each variant is not computed here (bench.replay does that for traces).

The JSON (written after every pass) holds every job's result line, regions and krex fields; the
table and plots come from bench/jobs_report.py (`python -m bench.jobs_report FILE` again later).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import jobs_report, jobs_sets
from bench.harness.output import Progress, module_prog, write_json
from bench.harness.stack import ROOT, Stack, bench_env

POLICIES = ("region", "command", "shared")
GATEWAY_MAX_TIMEOUT_S = 600.0  # krex gateway's default --max-timeout
DEFAULT_BUDGET_S = 540.0  # a 10-minute accelerator call less start-up (serve --help, torch) and report


@dataclass
class Variant:
    name: str
    policy: str
    args: list[str]  # krex serve's
    gateway_args: list[str] = field(default_factory=list)  # this variant's own krex gateway arguments
    width: int | None = None  # jobs at once (the gateway's --max-running); None: the run's --width


def parse_variant(text: str) -> Variant:
    """`NAME[@WIDTH][:ARGS [-- GATEWAY ARGS]]`: ARGS are `krex serve` arguments (shell words), those
    after a lone `--` the variant's `krex gateway` arguments (e.g. `--max-running auto`, which
    overrides the WIDTH the gateway is given first); WIDTH, the jobs at once, overrides --width.
    The policy is ARGS' --policy, else NAME's part before the first '-' (region-dh: region).
    Raises ValueError otherwise."""
    head, _, rest = text.partition(":")
    name, at, width_text = head.strip().partition("@")
    if not name:
        raise ValueError(f"variant {text!r}: no name")
    width = None
    if at:
        if not width_text.isdigit() or int(width_text) < 1:
            raise ValueError(f"variant {text!r}: @{width_text} is not a positive number of jobs at once")
        width = int(width_text)
    words = shlex.split(rest)
    args, gw_args = (
        (words[: words.index("--")], words[words.index("--") + 1 :]) if "--" in words else (words, [])
    )
    policy = name.split("-", 1)[0]
    for i, a in enumerate(args):
        if a == "--policy" and i + 1 < len(args):
            policy = args[i + 1]
        elif a.startswith("--policy="):
            policy = a.split("=", 1)[1]
    if policy not in POLICIES:
        raise ValueError(
            f"variant {text!r}: policy {policy!r} is not one of {', '.join(POLICIES)} "
            "(name it region-..., command-..., shared-... or pass --policy)"
        )
    return Variant(name, policy, args, gw_args, width)


def default_variants(serve_help: str, device: str) -> list[str]:
    """region in each hold/freeze mode this daemon offers (read from `krex serve --help`), the pool
    on a GPU, then shared and command."""
    out = ["region:--freeze all"]
    if "device-holders" in serve_help:
        out.append("region-dh:--freeze device-holders")
    if "--hold" in serve_help:
        out.append("region-lock:--hold lock")
    if device == "gpu" and "--pool-size" in serve_help:
        out.append("region-pool:--pool-size 8 --pool-preload torch")
    return out + ["shared", "command"]


def stack(v: Variant, a: argparse.Namespace, width: int) -> Stack:
    """The variant's daemon (JSON logs) and a gateway `width` wide over it, logs in a.logdir; as
    root, jobs run as a node runs them (harness.stack: an unprivileged user in the daemon's socket
    group, so the regions inside them reach the daemon), never as root."""
    return Stack(
        ["--log-format", "json", *strip_policy(v.args), *a.daemon_devices],
        width,
        policy=v.policy,
        gateway_args=[*a.gateway_arg, *v.gateway_args],
        python=a.python,
        logdir=a.logdir,
        name=v.name,
        token=a.gateway_token,
        prefix="krex-jobs-",
        parent=a.stack_dir,
    )


def strip_policy(args: list[str]) -> list[str]:
    """ARGS without --policy (the Daemon passes the variant's policy itself)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--policy":
            skip = True
        elif not a.startswith("--policy="):
            out.append(a)
    return out


def parse_lines(stdout: str) -> list[dict[str, Any]]:
    out = []
    for raw in stdout.splitlines():
        if raw.startswith("{") and '"krex_job"' in raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                pass
    return out


JOB_ENV = {"TRITON_CACHE_DIR": ".triton-cache", "TORCHINDUCTOR_CACHE_DIR": ".inductor-cache"}


async def submit_one(
    gw: Any, group: list[jobs_sets.Job], timeout_s: float, wait_s: float, t0: float, prog: Progress
) -> dict[str, Any]:
    """One job (a single spec, or a batch) through the gateway client `gw`, waited for up to
    `wait_s`; times relative to `t0` (monotonic). A failed or refused job is a record with ok
    False, never an exception."""
    files = jobs_sets.files_for([j.spec for j in group], [j.files for j in group])
    rec: dict[str, Any] = {"keys": [j.key for j in group], "submit_s": time.monotonic() - t0}
    try:
        job = await gw.dev("python job.py spec.json", files=files, env_vars=JOB_ENV, timeout_s=timeout_s)
        prog.running += 1
        view = await gw.wait(job["job_id"], wait_s)
        prog.running -= 1
    except Exception as e:  # a job the gateway refused is a result, not the end of the run
        rec.update(ok=False, end_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
        prog.done += 1
        prog.failed += 1
        return rec
    rec["end_s"] = time.monotonic() - t0
    res = view.get("result") or {}
    lines = parse_lines(res.get("stdout", ""))
    ok = view["status"] == "succeeded" and len(lines) == len(group) and all(ln["check"]["ok"] for ln in lines)
    rec.update(
        ok=ok,
        status=view["status"],
        lines=lines,
        regions=res.get("regions", []),
        krex=res.get("krex", {}),
        error=view.get("error"),
        exit_code=res.get("exit_code"),
    )
    if not ok:
        rec["stderr_tail"] = res.get("stderr", "")[-2000:]
        rec["stdout_tail"] = res.get("stdout", "")[-1000:]
    prog.done += 1
    prog.failed += not ok
    prog.show()
    return rec


async def submit(
    st: Stack, groups: list[list[jobs_sets.Job]], timeout_s: float, prog: Progress
) -> tuple[float, list[dict[str, Any]]]:
    """Submit every group (one job each: a single spec, or a batch) at once and wait for all.
    Returns (makespan s, records); a failed job is a record with ok False, never an exception."""
    from krex_async.gateway.client import GatewayClient

    async with GatewayClient(st.url, st.token, timeout=timeout_s + 120) as gw:
        t0 = time.monotonic()
        # each is queued behind the others (all of them, under command) before its own timeout runs
        wait_s = timeout_s * len(groups) + 60
        recs = await asyncio.gather(*(submit_one(gw, g, timeout_s, wait_s, t0, prog) for g in groups))
    return time.monotonic() - t0, list(recs)


def pass_jobs(v: Variant, jobs: list[jobs_sets.Job], command_jobs: str) -> list[jobs_sets.Job]:
    """The jobs a variant's pass submits: the whole set, except `command` under --command-jobs
    distinct: one copy of each distinct job. It is the serial baseline (its makespan is the sum of
    its jobs), so a second copy doubles its time and changes its jobs/min only by the noise."""
    if v.policy == "command" and command_jobs == "distinct":
        return jobs_sets.distinct(jobs)
    return jobs


async def run_pass(v: Variant, jobs: list[jobs_sets.Job], a: argparse.Namespace) -> dict[str, Any]:
    todo = pass_jobs(v, jobs, a.command_jobs)
    prog = Progress(v.name, len(todo))
    t = time.monotonic()
    try:
        async with stack(v, a, v.width or a.width) as st:
            warm_s = await pool_warm(st.daemon.socket, a.pool_warm_s)
            makespan, recs = await submit(
                st, [[j] for j in jobs_sets.fresh_tags(todo, v.name)], a.job_timeout, prog
            )
    except RuntimeError as e:  # the daemon or gateway refused this configuration
        return {
            "variant": v.name,
            "policy": v.policy,
            "args": v.args,
            "error": str(e)[-3000:],
            "jobs": [],
            "wall_s": time.monotonic() - t,
        }
    prog.show(final=True)
    out = {
        "variant": v.name,
        "policy": v.policy,
        "args": v.args,
        "makespan_s": makespan,
        "wall_s": time.monotonic() - t,
        "pool_warm_s": warm_s,
        "jobs": recs,
    }
    if len(todo) < len(jobs):
        out["subset"] = {"rule": "distinct", "jobs": len(todo), "of": len(jobs)}
    return out


async def pool_warm(socket: str, limit: float) -> float | None:
    """A node's pool is warm long before an agent's burst: wait (up to `limit` s, outside the
    makespan) until every pool of the daemon has its workers warm. Seconds waited; None without a
    pool. Jobs submitted into a cold pool would measure the daemon's start, not a node."""
    from krex_async import Client

    t = time.monotonic()
    async with await Client.connect(socket) as c:
        while True:
            pools = (await c.status()).get("pools") or {}
            if not pools:
                return None
            if all(p["warm"] >= p["size"] for p in pools.values()) or time.monotonic() - t > limit:
                return time.monotonic() - t
            await asyncio.sleep(0.2)


async def pool_counts(socket: str) -> dict[str, Any]:
    """Each pool's counts once a round is done: what it launched and adopted, its misses, and why
    its workers retired (a reused worker that retires after every job is no reuse)."""
    from krex_async import Client

    keys = "launched adopted misses retired retired_why retired_last declined failures max_uses keep_s"
    async with await Client.connect(socket) as c:
        pools = (await c.status()).get("pools") or {}
    return {dev: {k: p.get(k) for k in keys.split()} for dev, p in pools.items()}


async def device_memory(socket: str) -> dict[str, int]:
    """Each GPU's memory in all (bytes), as the daemon reports it: what a round's jobs' memory
    occupancy (bench.steady_report) is taken against."""
    from krex_async import Client

    async with await Client.connect(socket) as c:
        devices = (await c.status()).get("devices") or []
    return {d["key"]: d["memory_total_bytes"] for d in devices if d.get("memory_total_bytes")}


async def run_alone(jobs: list[jobs_sets.Job], a: argparse.Namespace, name: str) -> dict[str, Any]:
    """Each distinct job alone: one batch job per device kind, one at a time, under `command`."""
    batches = jobs_sets.alone_batches(jobs)
    prog = Progress(name, len(batches))
    recs = []
    t = time.monotonic()
    async with stack(Variant(name, "command", []), a, 1) as st:
        for b in batches:
            # a batch's timeout: its jobs' together, within what the gateway accepts
            _, (rec,) = await submit(
                st, [jobs_sets.fresh_tags(b, name)], min(GATEWAY_MAX_TIMEOUT_S, a.job_timeout * len(b)), prog
            )
            recs.append(rec)
    prog.show(final=True)
    return {"round": name, "jobs": recs, "wall_s": time.monotonic() - t}


# What a pass costs besides its jobs: a daemon and a gateway started and stopped (measured from
# the passes so far once there are any) and, per job under command, its process and upload.
STACK_S = 10.0
JOB_OVERHEAD_S = 1.0
CONCURRENT_SLACK = 1.5  # a concurrent pass against its jobs' alone seconds spread over the width


def alone_slots(n_variants: int, rounds: int) -> set[int]:
    """Before which variants (index; n_variants: after the last) the alone rounds run: the first
    before the first variant, the last after the last, the others spread between."""
    if rounds <= 1:
        return {0}
    return {0, n_variants} | {round(n_variants * k / (rounds - 1)) for k in range(1, rounds - 1)}


def stack_seconds(data: dict[str, Any]) -> float:
    """A stack's start and stop as measured so far (a pass's wall time beyond its makespan and pool
    warm-up), STACK_S before any pass."""
    xs = [
        p["wall_s"] - p["makespan_s"] - (p.get("pool_warm_s") or 0.0)
        for p in data["passes"].values()
        if p.get("makespan_s") is not None and "wall_s" in p
    ]
    return max(xs, default=STACK_S)


def estimate_s(
    v: Variant, data: dict[str, Any], jobs: list[jobs_sets.Job], width: int, command_jobs: str = "distinct"
) -> float:
    """How long the variant's pass will take, from what this run has measured: a concurrent pass
    as long as the slowest concurrent pass so far (the same set at the same width), else its jobs'
    alone seconds spread over the width; a command pass the sum of its jobs' alone seconds (each
    job its own import: serial) plus a process each. Both plus a stack's start and stop."""
    todo = pass_jobs(v, jobs, command_jobs)
    per = jobs_report.alone_seconds_by_key(data)
    fallback = jobs_report.alone_job_seconds(data)
    work = sum(per.get(j.key, fallback) for j in todo)
    if v.policy == "command":
        return work + JOB_OVERHEAD_S * len(todo) + stack_seconds(data)
    seen = [
        p["wall_s"]
        for p in data["passes"].values()
        if p.get("makespan_s") is not None and p["policy"] != "command" and "subset" not in p
    ]
    if seen:
        return max(seen)
    return work / width * CONCURRENT_SLACK + stack_seconds(data)


def alone_reserve_s(data: dict[str, Any]) -> float:
    """Room kept for the last alone round: the longest measured so far, plus 10%."""
    xs = [rnd["wall_s"] for rnd in data["alone"] if "wall_s" in rnd]
    return 1.1 * max(xs) if xs else jobs_report.alone_round_seconds(data)


def plan_variant(
    v: Variant,
    data: dict[str, Any],
    jobs: list[jobs_sets.Job],
    a: argparse.Namespace,
    elapsed: float,
    last_round_pending: bool,
) -> str | None:
    """Why the variant is skipped under --budget-s (None: it runs): its estimate, and the last alone
    round still to come, would not end within the budget."""
    if not a.budget_s:
        return None
    need = estimate_s(v, data, jobs, v.width or a.width, a.command_jobs)
    reserve = alone_reserve_s(data) if last_round_pending else 0.0
    left = a.budget_s - elapsed
    if need + reserve <= left:
        return None
    return (
        f"budget: about {need:.0f} s needed, {left - reserve:.0f} s left "
        f"({reserve:.0f} s kept for the last alone round)"
        if reserve
        else f"budget: about {need:.0f} s needed, {left:.0f} s left"
    )


async def run(a: argparse.Namespace, variants: list[Variant], jobs: list[jobs_sets.Job]) -> dict[str, Any]:
    t0 = time.monotonic()
    data: dict[str, Any] = {
        "config": {
            "argv": sys.argv,
            "device": a.device,
            "set": a.set,
            "width": a.width,
            "variants": [vars(v) for v in variants],
            "jobs": len(jobs),
            "keys": sorted({j.key for j in jobs}),
            "gateway_args": a.gateway_arg,
            "alone_rounds": a.alone_rounds,
            "budget_s": a.budget_s,
            "command_jobs": a.command_jobs,
            "started_at": time.time(),
            "host": os.uname().nodename,
        },
        "alone": [],
        "passes": {},
        "skipped": {},
    }
    slots = alone_slots(len(variants), a.alone_rounds)
    for i in range(len(variants) + 1):
        if i in slots:
            data["alone"].append(await run_alone(jobs, a, f"alone-{len(data['alone']) + 1}"))
            write_json(a.out, data)
        if i == len(variants):
            break
        v = variants[i]
        why = plan_variant(v, data, jobs, a, time.monotonic() - t0, len(variants) in slots)
        if why:
            data["skipped"][v.name] = why
            print(f"[{v.name}] skipped: {why}", file=sys.stderr)
            continue
        data["passes"][v.name] = await run_pass(v, jobs, a)
        write_json(a.out, data)
    data["config"]["ended_at"] = time.time()
    data["summary"] = jobs_report.summarise(data)
    write_json(a.out, data)
    return data


def add_job_args(ap: argparse.ArgumentParser, default_set: str = "default") -> None:
    """The job set, the device and what every daemon and gateway gets (bench.jobs, bench.steady)."""
    ap.add_argument("--kernelbench", type=Path, help="a KernelBench checkout (KernelBench/levelN/)")
    ap.add_argument("--atrex", type=Path, help="an Atrex-Bench checkout (data/<op>/)")
    ap.add_argument(
        "--triton",
        type=int,
        default=None,
        help="Triton do_bench jobs (default: the set's number when no suite is given)",
    )
    ap.add_argument("--cpu-jobs", type=int, default=None, help="cpu stand-in jobs (cpu device)")
    ap.add_argument("--set", "--size", dest="set", choices=sorted(jobs_sets.SIZES), default=default_set)
    ap.add_argument("--problems", type=int, default=None, help="distinct suite problems (default: the set's)")
    ap.add_argument("--levels", default="1,2,3", help="KernelBench levels to draw from")
    ap.add_argument("--seed", type=int, default=0, help="which problems are drawn")
    ap.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    ap.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="an argument every daemon gets (repeatable, e.g. --daemon-arg=--probes=off)",
    )
    ap.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="an argument every `krex gateway` gets (repeatable, e.g. --gateway-arg=--run-as=USER)",
    )
    ap.add_argument("--gateway-token", default=None, help="bearer token (default: the gateway's own)")
    ap.add_argument("--gateway-token-file", type=Path, default=None)
    ap.add_argument(
        "--pool-warm-s",
        type=float,
        default=120.0,
        help="seconds a pooled variant may take to warm its pool before the jobs (not "
        "counted in the makespan: a node's pool is warm before an agent's burst)",
    )
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job")
    ap.add_argument("--python", default=sys.executable, help="interpreter of daemon, gateway, jobs")
    ap.add_argument(
        "--stack-dir",
        type=Path,
        default=Path("/tmp"),
        help="where each stack makes its directory (sockets, state; removed when it stops): one "
        "the jobs' user can traverse (default /tmp)",
    )


def check_job_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """add_job_args' checks (ap.error on bad input) and derived fields: level_list, the token,
    the device (auto: gpu where torch sees CUDA), daemon_devices, logdir (beside a.out)."""
    if a.job_timeout <= 0:
        ap.error("--job-timeout must be positive")
    if a.job_timeout > GATEWAY_MAX_TIMEOUT_S:
        ap.error(f"--job-timeout: the gateway accepts at most {GATEWAY_MAX_TIMEOUT_S:.0f} s")
    try:
        a.level_list = [int(x) for x in a.levels.split(",") if x]
    except ValueError:
        ap.error(f"--levels {a.levels!r}: expected numbers like 1,2,3")
    for path, flag in ((a.kernelbench, "--kernelbench"), (a.atrex, "--atrex")):
        if path is not None and not path.is_dir():
            ap.error(f"{flag} {path}: not a directory")
    if a.gateway_token_file is not None:
        try:
            a.gateway_token = a.gateway_token_file.read_text().strip()
        except OSError as e:
            ap.error(f"--gateway-token-file: {e}")
    if a.device == "auto":
        a.device = "gpu" if _has_cuda(a.python) else "cpu"
    # cpu: one logical device, so every job shares it as jobs share one GPU
    a.daemon_devices = (["--devices", "cpu:1"] if a.device == "cpu" else []) + a.daemon_arg
    if not a.stack_dir.is_dir():
        ap.error(f"--stack-dir {a.stack_dir}: not a directory")
    a.logdir = a.out.parent / (a.out.stem + ".logs")
    a.logdir.mkdir(parents=True, exist_ok=True)


def build_jobs(a: argparse.Namespace) -> list[jobs_sets.Job]:
    """The run's job set from check_job_args' namespace. Raises ValueError, FileNotFoundError."""
    return jobs_sets.build(
        jobs_sets.SIZES[a.set],
        a.device,
        a.kernelbench,
        a.atrex,
        a.triton,
        a.cpu_jobs,
        a.level_list,
        a.seed,
        a.problems,
    )


def serve_help(python: str) -> str:
    """`krex serve --help` of this checkout (which options the daemon offers)."""
    return subprocess.run(
        [python, "-m", "krex_async", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=60,
        env=bench_env(),
    ).stdout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__.split("\n")[0] if __doc__ else None
    )
    add_job_args(ap)
    ap.add_argument("--width", type=int, default=8, help="jobs running at once (gateway --max-running)")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="NAME:ARGS",
        help="daemon variants, each NAME[@WIDTH][:krex serve args [-- krex gateway args]] (default: "
        "region in each freeze/hold mode this daemon offers, the pool on a GPU, shared, command)",
    )
    ap.add_argument(
        "--alone-rounds",
        type=int,
        default=2,
        help="alone rounds: the first before the variants, the last after, any others between (default 2)",
    )
    ap.add_argument(
        "--command-jobs",
        choices=["distinct", "all"],
        default="distinct",
        help="the command variant's jobs: one copy of each distinct job (default: it is "
        "the serial baseline, and its jobs/min is measured on them) or the whole set",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="skip a variant whose estimated pass (from the phases measured so far), with "
        "the last alone round, would not end within S seconds of the start "
        f"(default {DEFAULT_BUDGET_S:.0f}: one 10-minute accelerator call with room "
        "for start-up and the report; 0: no budget)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "jobs.json")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    if a.width < 1 or a.alone_rounds < 1 or a.job_timeout <= 0 or (a.budget_s or 0) < 0:
        ap.error("--width, --alone-rounds and --job-timeout must be positive, --budget-s not negative")
    check_job_args(ap, a)
    return a


def _has_cuda(python: str) -> bool:
    p = subprocess.run(
        [python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
        capture_output=True,
        timeout=120,
    )
    return p.returncode == 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    helptext = serve_help(a.python)
    try:
        variants = [parse_variant(t) for t in (a.variants or default_variants(helptext, a.device))]
        if len({v.name for v in variants}) != len(variants):
            raise ValueError("variant names must differ")
        jobs = build_jobs(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"jobs: {e}", file=sys.stderr)
        return 2
    print(
        f"jobs: {len(jobs)} jobs ({len({j.key for j in jobs})} distinct) on {a.device}, "
        f"{a.width} at once, variants {' '.join(v.name for v in variants)}",
        file=sys.stderr,
    )
    data = asyncio.run(run(a, variants, jobs))
    print(jobs_report.table(data["summary"]))
    if not a.no_plots:
        print(jobs_report.plot_or_say(data, a.out.parent, a.out.stem))
    print(f"\nraw numbers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
