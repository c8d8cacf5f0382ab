"""The steady-state benchmark of record: a stream of real jobs per variant, submitted as agents do.

    python -m bench.steady --kernelbench ~/KernelBench [--set large] [--concurrency 8]
                           [--jobs-per-round 48] [--rounds 2] [--alone-rounds 2]
                           [--variants NAME[@C][:SERVE ARGS [-- GATEWAY ARGS]] ...] [--admit ARGS]
                           [--out results/steady.json] [--resume] [--deadline-s 540]

Each variant round is a fresh `krex serve` and `krex gateway` (bench.jobs' stack) and a stream of
--jobs-per-round jobs of the set, the same seeded order for every variant of a round: C agent loops,
each submitting its next job through the gateway when its previous one has ended (C from the
variant's @C, else --concurrency; the gateway's --max-running is C unless the variant's gateway
arguments say otherwise, e.g. `-- --max-running auto`). Rounds are interleaved: round 1 of every
variant, then round 2, ...; the alone rounds (bench.jobs' run_alone: each distinct job alone) come
before the first and after the last (others spread between). Throughput, failures, inflation, entry
and the goals: bench/steady_report.py.

A run may be split over several calls: every unit (an alone round or a variant round) is appended
to --out as it ends; `--resume` continues a file from its first unit not yet run (the file's plan
must be this command line's), and `--deadline-s` stops before a unit that would not end in time
(planned from the units measured so far), leaving it to the next call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import jobs, jobs_report, jobs_sets, steady_report
from bench.harness.output import Progress, module_prog, read_json, write_json
from bench.harness.stack import ROOT

POOL = "--pool-size 8 --pool-preload torch"
REUSE = f"{POOL} --pool-max-uses 1000"  # workers reused (1.55x the single-use pool, session 22)
UNPROTECTED = "--admission off"  # sharing as it is without krex: no memory admission either
DEFAULT_DEADLINE_S = 540.0  # one 10-minute accelerator call, less start-up and the report
ALONE_GUESS_S = 150.0  # an alone round of the large set before one was measured (H100: 124 s)
SLACK = 1.5  # a variant round against its jobs' alone seconds spread over C agents


def default_variants(device: str, concurrency: int) -> list[str]:
    """Issue 38's comparison: unprotected sharing at three widths, region, region with the pool
    (single-use, the default, and reusing its workers). Sharing is unprotected only without the
    daemon's memory admission (on by default on a GPU)."""
    out = [f"shared-{w}@{w}:{UNPROTECTED}" for w in (4, 8, 12)] + [f"region@{concurrency}"]
    if device == "gpu":
        out += [f"region-pool@{concurrency}:{POOL}", f"region-pool-reuse@{concurrency}:{REUSE}"]
    return out


@dataclasses.dataclass(frozen=True)
class Unit:
    """An alone round (variant None) or a variant's round."""

    name: str
    variant: jobs.Variant | None = None
    round: int = 0


def plan(variants: list[jobs.Variant], rounds: int, alone_rounds: int) -> list[Unit]:
    """Round 1 of every variant, then round 2, ...; the alone rounds at bench.jobs' slots."""
    vr = [Unit(f"{v.name}/r{r}", v, r) for r in range(1, rounds + 1) for v in variants]
    slots = jobs.alone_slots(len(vr), alone_rounds)
    out: list[Unit] = []
    for i in range(len(vr) + 1):
        if i in slots:
            out.append(Unit(f"alone-{sum(u.variant is None for u in out) + 1}"))
        if i < len(vr):
            out.append(vr[i])
    return out


def stream(js: list[jobs_sets.Job], n: int, seed: int, rnd: int) -> list[jobs_sets.Job]:
    """n jobs of the set in a seeded shuffle (the same for every variant of a round), cycling."""
    order = list(js)
    random.Random(f"{seed}-{rnd}").shuffle(order)
    return [order[i % len(order)] for i in range(n)]


async def agents(
    url: str, token: str | None, todo: list[jobs_sets.Job], c: int, timeout_s: float, prog: Progress
) -> tuple[float, float, list[dict[str, Any]]]:
    """C agent loops over one stream: each submits its next job when its previous one has ended.
    Returns (the unix time of the first submit, makespan s, records in completion order, each with
    its agent and stream index; their submit_s and end_s are seconds after that first submit)."""
    from krex_async.gateway.client import GatewayClient

    queue = iter(enumerate(todo))
    recs: list[dict[str, Any]] = []
    # a job may queue behind the others in the gateway (a --max-running below C) and the daemon
    wait_s = timeout_s * max(2, len(todo) / c) + 60

    async with GatewayClient(url, token, timeout=timeout_s + 120) as gw:
        t0, t0_at = time.monotonic(), time.time()

        async def agent(i: int) -> None:
            for idx, job in queue:  # one iterator: the next job goes to whichever agent is free
                rec = await jobs.submit_one(gw, [job], timeout_s, wait_s, t0, prog)
                recs.append({**rec, "agent": i, "index": idx})

        await asyncio.gather(*(agent(i) for i in range(c)))
    return t0_at, time.monotonic() - t0, recs


def width_of(v: jobs.Variant, a: argparse.Namespace) -> int:
    return v.width or a.concurrency


async def run_round(u: Unit, js: list[jobs_sets.Job], a: argparse.Namespace) -> dict[str, Any]:
    v = u.variant
    assert v is not None
    c = width_of(v, a)
    todo = jobs_sets.fresh_tags(stream(js, a.jobs_per_round, a.seed, u.round), u.name.replace("/", "-"))
    prog = Progress(u.name, len(todo))
    out: dict[str, Any] = {
        "unit": u.name,
        "variant": v.name,
        "round": u.round,
        "policy": v.policy,
        "args": v.args,
        "gateway_args": v.gateway_args,
        "width": c,
        "started_at": time.time(),
    }
    t = time.monotonic()
    try:
        async with jobs.stack(dataclasses.replace(v, name=f"{v.name}-r{u.round}"), a, c) as st:
            out["pool_warm_s"] = await jobs.pool_warm(st.daemon.socket, a.pool_warm_s)
            # stream_at: the unix time the jobs' submit_s and end_s count from, to line them up with
            # the daemon's and gateway's log times (started_at is before the stack started)
            out["stream_at"], out["makespan_s"], out["jobs"] = await agents(
                st.url, st.token, todo, c, a.job_timeout, prog
            )
            out["pools"] = await jobs.pool_counts(st.daemon.socket)
            out["memory_total"] = await jobs.device_memory(st.daemon.socket)
    except RuntimeError as e:  # the daemon or gateway refused this configuration
        out.update(error=str(e)[-3000:], jobs=[])
    out["wall_s"] = time.monotonic() - t
    prog.show(final=True)
    return out


def estimate_s(u: Unit, data: dict[str, Any], js: list[jobs_sets.Job], a: argparse.Namespace) -> float:
    """How long the unit will take, from this file's units so far: an alone round as the longest
    measured (+10%); a variant round as its own longest round, else the longest round of any
    variant, scaled up (never down) by the widths, else its stream's alone seconds over C x1.5
    plus a stack's start and stop."""
    if u.variant is None:
        walls = [r["wall_s"] for r in data["alone"] if "wall_s" in r]
        return 1.1 * max(walls) if walls else ALONE_GUESS_S
    c = width_of(u.variant, a)
    seen = [r for r in data["rounds"] if r.get("makespan_s") is not None]
    own = [r["wall_s"] for r in seen if r["variant"] == u.variant.name]
    if own:
        return float(max(own))
    if seen:
        return max(r["wall_s"] * max(1.0, r["width"] / c) for r in seen)
    per = jobs_report.alone_seconds_by_key(data)
    fallback = jobs_report.alone_job_seconds(data)
    work = sum(per.get(j.key, fallback) for j in stream(js, a.jobs_per_round, a.seed, u.round))
    return work / c * SLACK + jobs.STACK_S


def fingerprint(
    a: argparse.Namespace, variants: list[jobs.Variant], js: list[jobs_sets.Job]
) -> dict[str, Any]:
    """What a resumed file must share with this command line for its rounds to be one run."""
    return {
        "variants": [dataclasses.asdict(v) for v in variants],
        "concurrency": a.concurrency,
        "jobs_per_round": a.jobs_per_round,
        "rounds": a.rounds,
        "alone_rounds": a.alone_rounds,
        "set": a.set,
        "seed": a.seed,
        "device": a.device,
        "keys": sorted({j.key for j in js}),
    }


def load(a: argparse.Namespace, fp: dict[str, Any]) -> dict[str, Any]:
    """The file to continue (--resume and it exists), else a new one. Raises ValueError when the
    file's plan differs from this command line's."""
    if a.resume and a.out.exists():
        data: dict[str, Any] = read_json(a.out)
        old = data.get("config", {}).get("plan")
        if old != fp:
            diff = sorted(k for k in fp if (old or {}).get(k) != fp[k])
            raise ValueError(
                f"--resume: {a.out} was planned with other {', '.join(diff) or 'settings'}; "
                "give the same options, or another --out"
            )
        return data
    return {
        "config": {"plan": fp, "argv": sys.argv, "gateway_args": a.gateway_arg, "daemon_args": a.daemon_arg},
        "alone": [],
        "rounds": [],
        "calls": [],
    }


def done_units(data: dict[str, Any]) -> set[str]:
    return {r["unit"] for r in data["alone"]} | {r["unit"] for r in data["rounds"]}


def refused(data: dict[str, Any], v: jobs.Variant) -> str | None:
    """The error of an earlier round of `v` its stack refused: later rounds would be refused too."""
    return next((r["error"] for r in data["rounds"] if r["variant"] == v.name and r.get("error")), None)


async def run(a: argparse.Namespace, variants: list[jobs.Variant], js: list[jobs_sets.Job]) -> dict[str, Any]:
    t0 = time.monotonic()
    data = load(a, fingerprint(a, variants, js))
    units = plan(variants, a.rounds, a.alone_rounds)
    call: dict[str, Any] = {"started_at": time.time(), "units": [], "deadline_s": a.deadline_s}
    data["calls"].append(call)
    ran = False
    for u in units:
        if u.name in done_units(data):
            continue
        if a.units and len(call["units"]) >= a.units:
            call["stopped"] = f"--units {a.units} run"
            break
        need = estimate_s(u, data, js, a)
        left = a.deadline_s - (time.monotonic() - t0) if a.deadline_s else float("inf")
        if need > left:
            call["stopped"] = f"{u.name}: about {need:.0f} s needed, {left:.0f} s left"
            print(f"[steady] stopping before {call['stopped']} (--resume continues)", file=sys.stderr)
            break
        ran = True
        if u.variant is None:
            rnd = await jobs.run_alone(js, a, u.name)
            data["alone"].append({**rnd, "unit": u.name})
        elif (why := refused(data, u.variant)) is not None:
            data["rounds"].append(
                {
                    **_head(u, a),
                    "error": f"not started: an earlier round was refused: {why[-500:]}",
                    "jobs": [],
                }
            )
        else:
            data["rounds"].append(await run_round(u, js, a))
        call["units"].append(u.name)
        data["pending"] = [x.name for x in units if x.name not in done_units(data)]
        write_json(a.out, data)
    if not ran and "stopped" in call:
        call["note"] = "no unit fitted the deadline"
    call["ended_at"] = time.time()
    data["pending"] = [x.name for x in units if x.name not in done_units(data)]
    data["summary"] = steady_report.summarise(data)
    write_json(a.out, data)
    return data


def _head(u: Unit, a: argparse.Namespace) -> dict[str, Any]:
    v = u.variant
    assert v is not None
    return {
        "unit": u.name,
        "variant": v.name,
        "round": u.round,
        "policy": v.policy,
        "args": v.args,
        "gateway_args": v.gateway_args,
        "width": width_of(v, a),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__.split("\n")[0] if __doc__ else None
    )
    jobs.add_job_args(ap, default_set="large")
    ap.add_argument(
        "--concurrency", type=int, default=8, help="agent loops of a variant without @C (default 8)"
    )
    ap.add_argument(
        "--jobs-per-round",
        type=int,
        default=48,
        help="jobs in each variant round's stream (default 48: the large set)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds per variant, interleaved (default 2)")
    ap.add_argument(
        "--alone-rounds", type=int, default=2, help="alone rounds: before, after, between (default 2)"
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="NAME[@C][:ARGS]",
        help="variants, each NAME[@C][:krex serve args [-- krex gateway args]] (default: shared-4@4, "
        "shared-8@8 and shared-12@12 with --admission off, region@C, and region-pool@C on a GPU)",
    )
    ap.add_argument(
        "--admit",
        default=None,
        metavar="ARGS",
        help="add the variant region-admit@C:ARGS (memory-aware admission: its serve args, then "
        '`-- ` and its gateway args, e.g. "--admit-flag -- --max-running auto")',
    )
    ap.add_argument("--units", type=int, default=0, help="run at most N units in this call (0: all)")
    ap.add_argument("--resume", action="store_true", help="continue --out from its first unit not yet run")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help="stop before a unit that would not end within S seconds of this call's start "
        f"(default {DEFAULT_DEADLINE_S:.0f}; 0: none)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "steady.json")
    a = ap.parse_args(argv)
    if min(a.concurrency, a.jobs_per_round, a.rounds, a.alone_rounds) < 1 or min(a.deadline_s, a.units) < 0:
        ap.error(
            "--concurrency, --jobs-per-round, --rounds and --alone-rounds must be positive, "
            "--deadline-s and --units not negative"
        )
    jobs.check_job_args(ap, a)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        texts = a.variants or default_variants(a.device, a.concurrency)
        if a.admit is not None:
            texts = [*texts, f"region-admit@{a.concurrency}:{a.admit}"]
        variants = [jobs.parse_variant(t) for t in texts]
        if len({v.name for v in variants}) != len(variants):
            raise ValueError("variant names must differ")
        js = jobs.build_jobs(a)
        data = asyncio.run(run(a, variants, js))
    except (ValueError, FileNotFoundError) as e:
        print(f"steady: {e}", file=sys.stderr)
        return 2
    print(steady_report.table(data["summary"]))
    print(f"\nraw numbers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
