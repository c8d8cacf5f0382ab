"""The fleet as a local attacker finds it: an unprivileged user with Ray of the same version (the
venv's, on their PYTHONPATH) cannot join the local fleet's cluster, so cannot run a task on a krex
node nor call its node agent; the cluster listens on loopback only; and a caller inside the cluster
whose request is not sealed with the fleet's token, or asks for root, is refused by the agent.

On the unauthenticated fleet this replaced, the same user joined, ran a task pinned to a krex node
as uid 0, and had the node agent run a command as root."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.security.helpers import USER_PY, USER_PYTHONPATH, User, make_users

from .conftest import NEEDS_RAY, PY, env

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
import ray  # noqa: E402

from krex_async.fleet.local import LocalFleet  # noqa: E402

# What the attacker runs: join, run a task pinned to a krex node, call node0's agent the way an
# unsealed client would. Each step prints what happened; nothing here may print JOINED.
ATTACK = """
import os, sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except BaseException as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
    sys.exit(0)
print("JOINED", len(ray.nodes()), flush=True)

@ray.remote(resources={"krex_node_node0": 0.001})
def where():
    try:
        shadow = len(open("/etc/shadow").read())
    except OSError as e:
        shadow = repr(e)
    return os.getuid(), shadow

print("TASK", ray.get(where.remote(), timeout=60), flush=True)
agent = ray.get_actor("krex-node-node0", namespace="krex")
spec = {"argv": ["id", "-u"], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "device": "auto"}
print("AGENT", [i for i in ray.get(list(agent.run.remote(spec, "attack")), timeout=60)], flush=True)
"""


# The attack: a Ray worker node of the attacker's own (its raylet, its temporary dir) joined
# to the fleet's GCS, named as a krex node. Ray would swap 127.0.0.1 for the host's address: not
# here (the attacker patches that out). On the unauthenticated fleet this started a node.
JOIN_NODE = """
import sys
import ray._private.services as services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts import scripts
try:
    scripts.start.main(
        ["--address", sys.argv[1], "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
         "--resources", '{"krex_node_node0": 1}', "--temp-dir", sys.argv[2], "--disable-usage-stats"],
        standalone_mode=False,
    )
    print("NODE STARTED", flush=True)
except BaseException as e:
    print("NODE REFUSED", type(e).__name__, flush=True)
"""


@pytest.fixture(scope="module")
def outsider() -> Iterator[User]:
    try:
        yield from (users["outsider"] for users in make_users())
    finally:  # the attackers' homes (attack() makes them)
        for home in glob.glob("/tmp/krex-attacker-*"):
            shutil.rmtree(home, ignore_errors=True)


def mentioning(text: str) -> list[int]:
    """Pids whose command line mentions `text`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def attack(user: User | None, address: str, *args: str, code: str = ATTACK, **extra: str) -> str:
    """ATTACK (or `code`) as `user` (None: as root, for the control), its stdout and stderr."""
    home = f"/tmp/krex-attacker-{user.name if user else 'root'}"
    os.makedirs(home, mode=0o700, exist_ok=True)
    e = {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONPATH": USER_PYTHONPATH,
        # The venv's Ray under the system Python 3.11 (another patch release than the cluster's):
        # told to accept it, or it would be refused for that and prove nothing.
        "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's switch to reach a cluster on 127.0.0.1
        **extra,
    }
    if user is not None:
        os.chown(home, user.uid, user.gid)
    r = subprocess.run(
        [USER_PY, "-c", code, address, *args],
        user=user.uid if user else None,
        group=user.gid if user else None,
        extra_groups=user.groups if user else None,
        env=e,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout + r.stderr


async def test_an_unprivileged_user_cannot_join_run_tasks_or_use_an_agent(
    local_fleet: LocalFleet, outsider: User
) -> None:
    assert local_fleet.cluster is not None
    async with await local_fleet.connect():  # the node agents exist
        pass
    address = str(local_fleet.cluster.address)
    assert address.startswith("127.0.0.1:"), address
    # The control: the same program with the fleet's token (root's, from its file) gets in, so the
    # attempts below fail for want of the token, not for how the attacker's Ray was set up.
    ok = attack(None, address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=local_fleet.token_file)
    # Its task runs as the fleet's Ray user (root only where the fleet's process is not root).
    ray_uid = pwd.getpwnam(local_fleet.ray_user).pw_uid if local_fleet.ray_user else os.geteuid()
    assert "JOINED" in ok and f"TASK ({ray_uid}," in ok, ok
    assert "AGENT [('error', 'forbidden'" in ok, ok  # and even then the agent wants a sealed request

    guess = f"/tmp/krex-attacker-{outsider.name}/guess"
    for what, extra in {
        "no auth": {},
        "token mode, no token": {"RAY_AUTH_MODE": "token"},
        "a guessed token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": guess},
        "the fleet's token file": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": local_fleet.token_file},
    }.items():
        if what == "a guessed token":
            os.makedirs(os.path.dirname(guess), exist_ok=True)
            with open(guess, "w") as f:
                f.write("0" * 64)
            os.chown(guess, outsider.uid, outsider.gid)
            os.chmod(guess, 0o600)
        out = attack(outsider, address, **extra)
        # Ray says "Connected" once the GCS took the client (the unauthenticated fleet did: its
        # driver then failed only on root's session directory, so the attacker joined a
        # raylet of their own first).
        assert "Connected to Ray cluster" not in out and "JOINED" not in out, (what, out)
        assert "TASK" not in out and "AGENT" not in out, (what, out)
        assert "REFUSED" in out, (what, out)
    own = f"/tmp/krex-attacker-{outsider.name}/ray"
    os.makedirs(own, exist_ok=True)
    os.chown(own, outsider.uid, outsider.gid)
    try:
        out = attack(outsider, address, own, code=JOIN_NODE, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1")
        assert "NODE REFUSED" in out and "NODE STARTED" not in out, out
        assert "InvalidAuthToken" in out, out  # refused by the GCS for want of the token
    finally:  # whatever of it started (nothing, unless this test fails): its processes name `own`
        for pid in mentioning(own):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    # Nothing of it listens beyond loopback: not at the host's own address.
    from ray._common.network_utils import node_ip_address_from_perspective

    host = node_ip_address_from_perspective(None)
    port = int(address.rpartition(":")[2])
    if host.startswith("127."):
        pytest.skip("this host has no address but loopback")
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=5).close()


async def items(gen: Any) -> list[Any]:
    return [await ref async for ref in gen]


async def test_a_caller_in_the_cluster_without_a_seal_cannot_make_an_agent_act(
    local_fleet: LocalFleet,
) -> None:
    """Through Ray, from this (token-holding) driver: the old unsealed run(spec, token), and a
    sealed run for root, are refused; a cancel without a seal too."""
    from krex_async.client.submit import KrexError
    from krex_async.fleet import auth

    async with await local_fleet.connect() as fc:
        agent = fc.agents["node1"]
        marker = f"/tmp/krex-unsealed-{os.getpid()}"
        spec = {"argv": [PY, "-c", f"open({marker!r}, 'w')"], "cwd": "/", "env": env(), "device": "auto"}
        before = (await fc.capacity())["node1"]["refused"]
        unsealed = await items(agent.run.remote(spec, "t-unsealed"))
        root = {"spec": spec, "token": "t-root", "user": "root"}
        as_root = await items(agent.run.remote(*auth.seal(local_fleet.key, "run", "node1", root)))
        for got in (unsealed, as_root):
            assert [i[:2] for i in got] == [("error", "forbidden")], got
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            await agent.cancel.remote("1", 9)
        assert isinstance(e.value.cause, KrexError) and e.value.cause.code == "forbidden", e.value
        assert (await fc.capacity())["node1"]["refused"] == before + 3
        assert not os.path.exists(marker)
        # A sealed run for the fleet's user runs, as that user.
        r = await fc.run([PY, "-c", "import os; print(os.getuid())"], env=env(), node="node1")
        assert r.report.state == "exited", r.report
        expect = os.getuid() if os.geteuid() else int(auth.node_uid(auth.identity(local_fleet.run_as)))
        assert r.stdout == f"{expect}\n".encode(), r
