"""`krex fleet status` (every node's capacity) and `krex fleet demo --nodes N`: a Ray cluster of N
nodes on this machine, a daemon per node, and agent-like commands with regions spread over them through
the fleet client.

Every node's daemon has its own socket, state dir and cgroup root and `--devices cpu:2`; the demo
prints which node and device ran each command and what its region cost, then stops everything it
started (agents, daemons, the Ray processes, the temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from typing import Any

from krex_async.cliargs import RAY_ADDRESS_FORMS, ray_address
from krex_async.fleet import require_ray


def add_token_file(p: argparse.ArgumentParser) -> None:
    """--ray-token-file: the Ray cluster's token (Ray's token authentication), for every command
    that joins a fleet's cluster."""
    p.add_argument(
        "--ray-token-file",
        metavar="FILE",
        help="the fleet's Ray token, a file readable only by its owner (default: $KREX_RAY_TOKEN_FILE, "
        "$RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token); never give the token itself in argv",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `fleet` verb and its `demo` subcommand."""
    p = subparsers.add_parser("fleet", help="many nodes through Ray (needs krex[fleet])")
    sub = p.add_subparsers(dest="fleet_verb", required=True)
    d = sub.add_parser(
        "demo", help="a local Ray cluster of N nodes, a daemon each, commands with regions spread over them"
    )
    d.add_argument("--nodes", type=int, default=2, help="Ray nodes on this machine (default 2)")
    d.add_argument(
        "--commands",
        type=int,
        help="commands to run (default 4 per node: two per device, so regions freeze a sibling)",
    )
    d.add_argument("--devices", default="cpu:2", help="each daemon's --devices (default cpu:2)")
    d.add_argument(
        "--run-as",
        metavar="USER",
        help="as root: the unprivileged user the commands run as (default $KREX_FLEET_RUN_AS, else nobody)",
    )
    d.add_argument(
        "--ray-user",
        metavar="USER",
        help="as root: the unprivileged user Ray (every task, every node agent) runs as "
        "(default krexray, created as a system user if missing)",
    )
    d.add_argument(
        "--ray-python",
        metavar="PATH",
        help="as root: the interpreter Ray runs as --ray-user (default this one if that user can run "
        "it, else the system's python3 of this version), with krex and Ray on its PYTHONPATH",
    )
    d.add_argument(
        "--python",
        metavar="PATH",
        default=sys.executable,
        help="the interpreter the commands run (default this one; as root it must be one --run-as can "
        "run, e.g. /usr/bin/python3 of the same version with krex on its PYTHONPATH)",
    )
    s = sub.add_parser("status", help="each node's capacity: devices, free memory, commands, regions")
    s.add_argument(
        "--address",
        default="auto",
        type=ray_address,
        help=f"the Ray cluster: {RAY_ADDRESS_FORMS} (default auto)",
    )
    s.add_argument("--json", action="store_true")
    add_token_file(s)
    return p  # type: ignore[no-any-return]


def main(args: argparse.Namespace) -> int:
    """Entry point for `krex fleet ...`; 2 on bad input or a missing Ray."""
    missing = require_ray()
    if missing:
        print(f"krex fleet: {missing}", file=sys.stderr)
        return 2
    if args.fleet_verb == "status":
        return asyncio.run(_status(args.address, args.json, args.ray_token_file))
    if args.nodes < 1 or args.nodes > 16:
        print(f"krex fleet demo: --nodes must be 1..16, not {args.nodes}", file=sys.stderr)
        return 2
    n = args.commands if args.commands is not None else 4 * args.nodes
    if n < 1:
        print(f"krex fleet demo: --commands must be at least 1, not {n}", file=sys.stderr)
        return 2
    return asyncio.run(
        _demo(args.nodes, n, args.devices, args.run_as, args.python, args.ray_user, args.ray_python)
    )


async def _status(address: str, as_json: bool, token_file: str | None) -> int:
    """Print every node's capacity report (agents are made where missing, reaching the node's
    default socket)."""
    from krex_async.client.submit import KrexError
    from krex_async.fleet.client import FleetClient

    try:
        fc = await FleetClient.connect(address, token_file=token_file)
    except KrexError as e:
        print(f"krex fleet status: {e.message}", file=sys.stderr)
        return 1
    async with fc:
        cap = await fc.capacity()
    if as_json:
        print(json.dumps(cap, indent=2))
        return 0
    print("NODE        UP    RUNNING  QUEUED  REGIONS  DEVICES (key: commands, free GiB)")
    for name, c in sorted(cap.items()):
        if not c["up"]:
            print(f"{name:<11} no    -        -       -        {c['reason']}")
            continue
        devs = ", ".join(
            f"{d['key']}: {len(d['commands'])}, {d['memory_free_bytes'] / 2**30:.1f}" for d in c["devices"]
        )
        print(f"{name:<11} yes   {c['running']:<8} {c['queued']:<7} {c['regions']:<8} {devs}")
    return 0


async def _demo(
    nodes: int,
    n: int,
    devices: str,
    run_as: str | None,
    python: str,
    ray_user: str | None = None,
    ray_python: str | None = None,
) -> int:
    import tempfile

    from krex_async.client.submit import KrexError
    from krex_async.fleet.local import LocalFleet
    from krex_async.ops.demo import WORK

    try:
        fleet = LocalFleet(
            nodes, daemon_args=("--devices", devices), run_as=run_as, ray_user=ray_user, ray_python=ray_python
        )
    except KrexError as e:
        flag = "--ray-user" if "Ray" in e.message else "--run-as"
        print(f"krex fleet demo: {flag}: {e.message}", file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if os.geteuid() == 0 and (why := _cannot_run(python, fleet.run_as, env)):
        print(
            f"krex fleet demo: the commands run as {fleet.run_as}, who cannot run {python} with krex "
            f"importable ({why}): pass --python (one they can run, of this Python version, with krex "
            "and its dependencies on PYTHONPATH) or --run-as",
            file=sys.stderr,
        )
        fleet.close()  # its directory: nothing else was started
        return 2
    work_dir = tempfile.mkdtemp(prefix="krex-fleet-work-", dir="/tmp")
    os.chmod(work_dir, 0o755)  # the commands' user reads the script there
    fc = None
    t0 = time.monotonic()
    print(f"krex fleet demo: starting a Ray cluster of {nodes} nodes on this machine ...", flush=True)
    try:
        try:
            fleet.start()
        except Exception as e:  # Ray's own start-up failures come as many types
            print(
                f"krex fleet demo: could not start a local Ray cluster: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
            return 1
        fc = await fleet.connect()
        print(
            f"  up in {time.monotonic() - t0:.1f} s: "
            + ", ".join(
                f"{name} ({len(v.devices)} devices)" if v.up else f"{name} (down: {v.reason})"
                for name, v in sorted(fc.nodes.items())
            ),
            flush=True,
        )
        if fleet.ray_user:
            print(f"  Ray runs as {fleet.ray_user}, the daemons as root, the commands as {fleet.run_as}")
        script = os.path.join(work_dir, "work.py")
        with open(script, "w") as f:
            f.write(WORK)
        os.chmod(script, 0o644)
        t1 = time.monotonic()
        handles = [
            await fc.submit([python, script, "0.3", "15"], env=env, cwd=work_dir, label=f"demo {i}")
            for i in range(n)
        ]
        results = await asyncio.gather(*(h.wait() for h in handles))
        makespan = time.monotonic() - t1
        print(f"\n{n} commands over {nodes} nodes in {makespan:.2f} s\n")
        print(
            f"  {'command':<16} {'node':<6} {'device':<12} {'state':<8} {'wall s':>6} "
            f"{'wait ms':>8} {'enter ms':>9} {'held ms':>8} {'frozen':>6} {'median ms':>10}"
        )
        failed = 0
        for h, res in zip(handles, results):
            rep = res.report
            reg = rep.regions[0] if rep.regions else None
            try:
                median = f"{json.loads(res.stdout)['median_ms']:.2f}"
            except (ValueError, KeyError):
                median, failed = "-", failed + 1
            print(
                f"  {rep.command:<16} {h.node:<6} {rep.device:<12} {rep.state:<8} "
                f"{rep.wall_s:>6.2f} "
                + (
                    f"{reg.wait_s * 1e3:>8.1f} {reg.enter_s * 1e3:>9.2f} "
                    f"{reg.held_s * 1e3:>8.1f} {len(reg.frozen):>6} "
                    if reg
                    else f"{'-':>8} {'-':>9} {'-':>8} {'-':>6} "
                )
                + f"{median:>10}"
            )
        per_node: dict[str, int] = {}
        for h in handles:
            per_node[h.node] = per_node.get(h.node, 0) + 1
        print("\n  per node: " + ", ".join(f"{k} {v}" for k, v in sorted(per_node.items())))
        return 1 if failed else 0
    except KrexError as e:
        print(f"krex fleet demo: {e.message}", file=sys.stderr)
        return 1
    finally:
        if fc is not None:
            await fc.close()
        fleet.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        print(f"  stopped the agents, daemons and Ray ({time.monotonic() - t0:.1f} s in all)")


def _cannot_run(python: str, user: str | int, env: dict[str, str]) -> str:
    """Why `user` cannot run `python` with krex_async importable ("" when they can)."""
    import pwd
    import subprocess

    try:
        pw = pwd.getpwnam(str(user)) if not str(user).isdigit() else pwd.getpwuid(int(user))
        r = subprocess.run(
            [python, "-c", "import krex_async.client.region"],
            user=pw.pw_uid,
            group=pw.pw_gid,
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, KeyError, subprocess.SubprocessError) as e:
        return str(e)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]
