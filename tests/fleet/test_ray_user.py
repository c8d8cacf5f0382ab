"""As root, the local fleet runs Ray as an unprivileged user: a Ray task on a krex node (anyone's
who holds the token) runs as that user, cannot read /etc/shadow, and cannot have the node's daemon
run anything as root; the node agents (Ray actors too) still run the fleet's commands as the mapped
user, through the daemon's --run-as-peers grant."""

from __future__ import annotations

import os
import pwd
import stat

import pytest

from .conftest import NEEDS_RAY, PY, env

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason=NEEDS_RAY)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from krex_async.fleet.local import LocalFleet  # noqa: E402
from krex_async.fleet.rayuser import RayHost  # noqa: E402


@pytest.fixture(autouse=True)
def as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("a fleet started by a user runs Ray as that user: the Ray user matters as root")


@ray.remote(num_cpus=0)
def what_a_task_can(socket: str) -> dict[str, object]:
    """Who a Ray task runs as on its node, and what it gets of /etc/shadow and of the node's daemon
    when it asks for a command as root."""
    import asyncio

    from krex_async import Client, KrexError

    try:
        with open("/etc/shadow") as f:
            shadow = f"read {len(f.read())} bytes"
    except OSError as e:
        shadow = e.strerror or ""

    async def as_root() -> str:
        try:
            async with await Client.connect(socket) as c:
                res = await c.run(["/bin/sh", "-c", "id -u"], env={"PATH": "/usr/bin:/bin"}, run_as=0)
                return res.stdout.decode().strip()
        except KrexError as e:
            return f"{e.code}: {e.message}"

    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "shadow": shadow,
        "root_command": asyncio.run(as_root()),
    }


def on_node(fleet: LocalFleet, name: str) -> NodeAffinitySchedulingStrategy:
    (node,) = [n for n in ray.nodes() if n["Alive"] and f"krex_node_{name}" in n["Resources"]]
    return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)


def test_a_ray_task_on_a_krex_node_is_not_root(local_fleet: LocalFleet) -> None:
    assert local_fleet.ray_user is not None
    ray_uid = pwd.getpwnam(local_fleet.ray_user).pw_uid
    assert ray_uid != 0
    for name in ("node0", "node1", "node2"):
        socket = os.path.join(local_fleet.base_dir, name, "s")
        got = ray.get(what_a_task_can.options(scheduling_strategy=on_node(local_fleet, name)).remote(socket))
        assert got["uid"] == got["euid"] == ray_uid, got
        assert got["shadow"] == "Permission denied", got
        # The daemon grants the Ray user run_as, never for root.
        assert str(got["root_command"]).startswith("forbidden: run_as root"), got


async def test_agents_run_as_the_ray_user_and_commands_as_the_mapped_user(local_fleet: LocalFleet) -> None:
    assert local_fleet.ray_user is not None
    ray_uid = pwd.getpwnam(local_fleet.ray_user).pw_uid
    async with await local_fleet.connect() as fc:
        for name in ("node0", "node1", "node2"):  # (the package's other tests add and remove nodes)
            agent = fc.agents[name]
            pid = (await agent.hello.remote())["pid"]
            assert os.stat(f"/proc/{pid}").st_uid == ray_uid, name
            r = await fc.run([PY, "-c", "import os; print(os.getuid())"], env=env(), node=name)
            assert r.report.state == "exited", r.report
            assert int(r.stdout) == pwd.getpwnam(str(local_fleet.run_as)).pw_uid != ray_uid, r.stdout


def test_the_ray_users_token_is_its_own(local_fleet: LocalFleet) -> None:
    """Its copy of the token: its own file, 0600, in its 0700 directory (with Ray's temp dir)."""
    host = local_fleet.cluster
    assert isinstance(host, RayHost) and local_fleet.ray_user is not None
    ray_uid = pwd.getpwnam(local_fleet.ray_user).pw_uid
    st = os.stat(host.token_file)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ray_uid, 0o600)
    st = os.stat(host.dir)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ray_uid, 0o700)
    with open(host.token_file) as a, open(local_fleet.token_file) as b:
        assert a.read().strip() == b.read().strip()
