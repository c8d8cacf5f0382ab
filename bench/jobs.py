"""Real agent jobs through a real `krex gateway` over a real `krex serve`, every policy in one run.

    python bench/jobs.py --kernelbench ~/KernelBench [--atrex ~/atrex-bench] [--triton N]
                         [--set tiny|default|large] [--width 8] [--variants NAME:ARGS ...]
                         [--device auto|gpu|cpu] [--out results/jobs.json]
    python -m bench.jobs ...                                    # the same

What it measures: what an agent gets. Each job (bench/workload/job.py) is a dev job as an agent's
tool submits it: upload, `python job.py spec.json`, imports, inputs, a check against the reference,
then timing the way the suite's own harness times (KernelBench: its kernelbench.timing, run unchanged
as an auto-region; Triton and Atrex: do_bench, an auto-region). All jobs of a set go in at once, the
gateway runs `--width` of them at a time, no pacing: each phase does its real work and nothing else,
so a frozen import simply ends later. Per variant (a `krex serve` configuration: `NAME:ARGS`, the
policy from --policy in ARGS or the name's first word) a fresh daemon and gateway; alone rounds
(each distinct job alone, in one process per device kind) before, between and after the variants
give the timing baseline and its own spread.

What could hide a cost: jobs/min counts only jobs that succeeded (failures are listed); the alone
rounds share one process's imports (their phase times are not an agent's); the ideal of each
variant is not computed here (bench/replay.py does that for traces).

The JSON (written after every pass) holds every job's result line, regions and krex fields; the
table and plots come from bench/jobs_report.py (`python bench/jobs_report.py FILE` again later).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import jobs_report  # noqa: E402
import jobs_sets  # noqa: E402
from gwstack import ensure_job_user, job_python  # noqa: E402
from replay import Daemon, Progress  # noqa: E402

POLICIES = ("region", "command", "shared")
GATEWAY_MAX_TIMEOUT_S = 600.0  # krex gateway's default --max-timeout


@dataclass
class Variant:
    name: str
    policy: str
    args: list[str]


def parse_variant(text: str) -> Variant:
    """`NAME[:ARGS]`: ARGS are `krex serve` arguments (shell words); the policy is ARGS' --policy,
    else NAME's part before the first '-' (region-dh: region). Raises ValueError otherwise."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"variant {text!r}: no name")
    args = shlex.split(rest)
    policy = name.split("-", 1)[0]
    for i, a in enumerate(args):
        if a == "--policy" and i + 1 < len(args):
            policy = args[i + 1]
        elif a.startswith("--policy="):
            policy = a.split("=", 1)[1]
    if policy not in POLICIES:
        raise ValueError(f"variant {text!r}: policy {policy!r} is not one of {', '.join(POLICIES)} "
                         "(name it region-..., command-..., shared-... or pass --policy)")
    return Variant(name, policy, args)


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


def gateway_token(state: Path, explicit: str | None) -> str | None:
    """The bearer token to send: --gateway-token(-file), $KREX_GATEWAY_TOKEN, a "token" in the
    gateway's gateway.json, or the first file named *token* in its state dir."""
    if explicit:
        return explicit
    if os.environ.get("KREX_GATEWAY_TOKEN"):
        return os.environ["KREX_GATEWAY_TOKEN"]
    try:
        info = json.loads((state / "gateway.json").read_text())
        if info.get("token"):
            return str(info["token"])
    except (OSError, ValueError):
        pass
    for p in sorted(state.glob("*token*")):
        if p.is_file():
            return p.read_text().strip() or None
    return None


class Stack:
    """A daemon (replay.Daemon) and `krex gateway` over it, in a temporary directory; `async with`
    starts both and waits for the gateway's URL, leaving stops the gateway, then the daemon."""

    def __init__(self, v: Variant, a: argparse.Namespace, width: int, logdir: Path) -> None:
        self.v, self.a, self.width, self.logdir = v, a, width, logdir
        # As root, jobs run as a node runs them (bench/gwstack.py): an unprivileged user in the
        # daemon's socket group, so the regions inside them reach the daemon; never as root.
        self.user = ensure_job_user()
        group = ["--socket-group", self.user] if self.user else []
        if self.user and any(x.startswith("--pool-size") for x in v.args):
            group += ["--pool-user", self.user]  # a pool serves its own user's jobs only
        self.daemon = Daemon(v.policy, a.python, strip_policy(v.args) + a.daemon_devices + group,
                             logdir / f"daemon-{v.name}.log")
        self.dir = Path(tempfile.mkdtemp(prefix=f"krex-jobs-{v.name}-", dir="/tmp"))
        if self.user:
            for d in (self.dir, Path(self.daemon.dir)):
                d.chmod(0o711)  # the jobs' user passes through to its job directory and the socket
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str = ""
        self.token: str | None = None

    async def __aenter__(self) -> Stack:
        try:
            await self.daemon.__aenter__()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        try:
            state = self.dir / "gw"
            # The jobs inherit it: this package and this interpreter's packages (msgspec for regions).
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                str(ROOT), sysconfig.get_paths()["purelib"], os.environ.get("PYTHONPATH")])))
            env.pop("KREX_SOCKET", None)
            run_as = ["--run-as", self.user, "--job-python", job_python(self.user)] if self.user else []
            log = open(self.logdir / f"gateway-{self.v.name}.log", "wb")
            self.proc = subprocess.Popen(
                [self.a.python, "-m", "krex_async", "gateway", "--listen", "127.0.0.1:0",
                 "--state-dir", str(state), "--socket", self.daemon.socket,
                 "--max-running", str(self.width), *run_as, *self.a.gateway_arg],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
            log.close()
            deadline = time.monotonic() + 60
            while not (state / "gateway.json").exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("gateway did not start: " + (
                        self.logdir / f"gateway-{self.v.name}.log").read_text()[-2000:])
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)
            self.url = json.loads((state / "gateway.json").read_text())["url"]
            self.token = gateway_token(state, self.a.gateway_token)
            return self
        except BaseException:
            await self.__aexit__()
            raise

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    await asyncio.to_thread(self.proc.wait, 20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    await asyncio.to_thread(self.proc.wait)
        finally:
            await self.daemon.__aexit__()
            shutil.rmtree(self.dir, ignore_errors=True)  # the jobs' files; logs are in logdir


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


async def submit(stack: Stack, groups: list[list[jobs_sets.Job]], timeout_s: float,
                 prog: Progress) -> tuple[float, list[dict[str, Any]]]:
    """Submit every group (one job each: a single spec, or a batch) at once and wait for all.
    Returns (makespan s, records); a failed job is a record with ok False, never an exception."""
    from krex_async.gateway.client import GatewayClient
    env = {"TRITON_CACHE_DIR": ".triton-cache", "TORCHINDUCTOR_CACHE_DIR": ".inductor-cache"}
    async with GatewayClient(stack.url, stack.token, timeout=timeout_s + 120) as gw:
        t0 = time.monotonic()

        async def one(group: list[jobs_sets.Job]) -> dict[str, Any]:
            files = jobs_sets.files_for([j.spec for j in group], [j.files for j in group])
            s0 = time.monotonic() - t0
            rec: dict[str, Any] = {"keys": [j.key for j in group], "submit_s": s0}
            try:
                job = await gw.dev("python job.py spec.json", files=files, env_vars=env,
                                   timeout_s=timeout_s)
                prog.running += 1
                # queued behind the others (all of them, under command) before its own timeout runs
                view = await gw.wait(job["job_id"], timeout_s * len(groups) + 60)
                prog.running -= 1
            except Exception as e:  # a job the gateway refused is a result, not the end of the run
                rec.update(ok=False, end_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
                prog.done += 1
                prog.failed += 1
                return rec
            rec["end_s"] = time.monotonic() - t0
            res = view.get("result") or {}
            lines = parse_lines(res.get("stdout", ""))
            ok = view["status"] == "succeeded" and len(lines) == len(group) and all(
                ln["check"]["ok"] for ln in lines)
            rec.update(ok=ok, status=view["status"], lines=lines, regions=res.get("regions", []),
                       krex=res.get("krex", {}), error=view.get("error"),
                       exit_code=res.get("exit_code"))
            if not ok:
                rec["stderr_tail"] = res.get("stderr", "")[-2000:]
                rec["stdout_tail"] = res.get("stdout", "")[-1000:]
            prog.done += 1
            prog.failed += not ok
            prog.show()
            return rec
        recs = await asyncio.gather(*(one(g) for g in groups))
    return time.monotonic() - t0, list(recs)


async def run_pass(v: Variant, jobs: list[jobs_sets.Job], a: argparse.Namespace) -> dict[str, Any]:
    prog = Progress(v.name, len(jobs))
    t = time.monotonic()
    try:
        async with Stack(v, a, a.width, a.logdir) as st:
            warm_s = await pool_warm(st.daemon.socket, a.pool_warm_s)
            makespan, recs = await submit(st, [[j] for j in jobs_sets.fresh_tags(jobs, v.name)],
                                          a.job_timeout, prog)
    except RuntimeError as e:  # the daemon or gateway refused this configuration
        return {"variant": v.name, "policy": v.policy, "args": v.args, "error": str(e)[-3000:],
                "jobs": []}
    prog.show(final=True)
    return {"variant": v.name, "policy": v.policy, "args": v.args, "makespan_s": makespan,
            "wall_s": time.monotonic() - t, "pool_warm_s": warm_s, "jobs": recs}


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


async def run_alone(jobs: list[jobs_sets.Job], a: argparse.Namespace, name: str) -> dict[str, Any]:
    """Each distinct job alone: one batch job per device kind, one at a time, under `command`."""
    batches = jobs_sets.alone_batches(jobs)
    prog = Progress(name, len(batches))
    recs = []
    async with Stack(Variant(name, "command", []), a, 1, a.logdir) as st:
        for b in batches:
            # a batch's timeout: its jobs' together, within what the gateway accepts
            _, (rec,) = await submit(st, [jobs_sets.fresh_tags(b, name)],
                                     min(GATEWAY_MAX_TIMEOUT_S, a.job_timeout * len(b)), prog)
            recs.append(rec)
    prog.show(final=True)
    return {"round": name, "jobs": recs}


def estimate_s(v: Variant, data: dict[str, Any], n_jobs: int, width: int) -> float:
    """A rough duration of a pass from the alone rounds so far: serial under command, else the
    jobs spread over the width (imports dominate: one alone job's import plus its work)."""
    per = jobs_report.alone_job_seconds(data)
    total = per * n_jobs
    return total if v.policy == "command" else total / width * 1.5 + 10


def write(out: Path, data: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)


async def run(a: argparse.Namespace, variants: list[Variant], jobs: list[jobs_sets.Job]) -> dict[str, Any]:
    t0 = time.monotonic()
    data: dict[str, Any] = {
        "config": {"argv": sys.argv, "device": a.device, "set": a.set, "width": a.width,
                   "variants": [vars(v) for v in variants], "jobs": len(jobs),
                   "keys": sorted({j.key for j in jobs}), "gateway_args": a.gateway_arg,
                   "alone_rounds": a.alone_rounds, "budget_s": a.budget_s,
                   "started_at": time.time(), "host": os.uname().nodename},
        "alone": [], "passes": {}, "skipped": {}}
    # alone rounds before, between and after the variants
    slots = {0, len(variants)} | {round(len(variants) * k / (a.alone_rounds - 1))
                                  for k in range(1, a.alone_rounds - 1)} if a.alone_rounds > 1 else {0}
    for i in range(len(variants) + 1):
        if i in slots:
            data["alone"].append(await run_alone(jobs, a, f"alone-{len(data['alone']) + 1}"))
            write(a.out, data)
        if i == len(variants):
            break
        v = variants[i]
        left = a.budget_s - (time.monotonic() - t0) if a.budget_s else None
        reserve = jobs_report.alone_round_seconds(data) if len(variants) in slots else 0.0
        if left is not None and estimate_s(v, data, len(jobs), a.width) + reserve > left:
            data["skipped"][v.name] = (f"budget: about {estimate_s(v, data, len(jobs), a.width):.0f} s "
                                       f"needed, {left - reserve:.0f} s left")
            print(f"[{v.name}] skipped: {data['skipped'][v.name]}", file=sys.stderr)
            continue
        data["passes"][v.name] = await run_pass(v, jobs, a)
        write(a.out, data)
    data["config"]["ended_at"] = time.time()
    data["summary"] = jobs_report.summarise(data)
    write(a.out, data)
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--kernelbench", type=Path, help="a KernelBench checkout (KernelBench/levelN/)")
    ap.add_argument("--atrex", type=Path, help="an Atrex-Bench checkout (data/<op>/)")
    ap.add_argument("--triton", type=int, default=None,
                    help="Triton do_bench jobs (default: the set's number when no suite is given)")
    ap.add_argument("--cpu-jobs", type=int, default=None, help="cpu stand-in jobs (cpu device)")
    ap.add_argument("--set", "--size", dest="set", choices=sorted(jobs_sets.SIZES), default="default")
    ap.add_argument("--problems", type=int, default=None, help="distinct suite problems (default: the set's)")
    ap.add_argument("--levels", default="1,2,3", help="KernelBench levels to draw from")
    ap.add_argument("--seed", type=int, default=0, help="which problems are drawn")
    ap.add_argument("--width", type=int, default=8, help="jobs running at once (gateway --max-running)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME:ARGS",
                    help="daemon variants, each NAME[:krex serve args] (default: region in each "
                         "freeze/hold mode this daemon offers, the pool on a GPU, shared, command)")
    ap.add_argument("--alone-rounds", type=int, default=3, help="alone rounds (before, between, after)")
    ap.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="an argument every daemon gets (repeatable, e.g. --daemon-arg=--probes=off)")
    ap.add_argument("--gateway-arg", action="append", default=[],
                    help="an argument every `krex gateway` gets (repeatable, e.g. "
                         "--gateway-arg=--run-as=USER)")
    ap.add_argument("--gateway-token", default=None, help="bearer token (default: the gateway's own)")
    ap.add_argument("--gateway-token-file", type=Path, default=None)
    ap.add_argument("--pool-warm-s", type=float, default=120.0,
                    help="seconds a pooled variant may take to warm its pool before the jobs (not "
                         "counted in the makespan: a node's pool is warm before an agent's burst)")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds per job")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a variant that would not end (with the last alone round) in time")
    ap.add_argument("--python", default=sys.executable, help="interpreter of daemon, gateway, jobs")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "jobs.json")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    if a.width < 1 or a.alone_rounds < 1 or a.job_timeout <= 0:
        ap.error("--width, --alone-rounds and --job-timeout must be positive")
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
    a.logdir = a.out.parent / (a.out.stem + ".logs")
    a.logdir.mkdir(parents=True, exist_ok=True)
    return a


def _has_cuda(python: str) -> bool:
    p = subprocess.run([python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                       capture_output=True, timeout=120)
    return p.returncode == 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    helptext = subprocess.run([a.python, "-m", "krex_async", "serve", "--help"], capture_output=True,
                              text=True, cwd=str(ROOT), timeout=60,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))).stdout
    try:
        variants = [parse_variant(t) for t in (a.variants or default_variants(helptext, a.device))]
        if len({v.name for v in variants}) != len(variants):
            raise ValueError("variant names must differ")
        jobs = jobs_sets.build(jobs_sets.SIZES[a.set], a.device, a.kernelbench, a.atrex, a.triton,
                               a.cpu_jobs, a.level_list, a.seed, a.problems)
    except (ValueError, FileNotFoundError) as e:
        print(f"jobs: {e}", file=sys.stderr)
        return 2
    print(f"jobs: {len(jobs)} jobs ({len({j.key for j in jobs})} distinct) on {a.device}, "
          f"{a.width} at once, variants {' '.join(v.name for v in variants)}", file=sys.stderr)
    data = asyncio.run(run(a, variants, jobs))
    print(jobs_report.table(data["summary"]))
    if not a.no_plots:
        print(jobs_report.plot_or_say(data, a.out.parent, a.out.stem))
    print(f"\nraw numbers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
