"""What a user's commands taught memory admission serves that user alone (footprints.py): another
user's commands of the same label (or program, or mem_key) tell nothing of its need. Before, a
peer could set what a victim's commands were taken to need: a large peak held them queued or alone,
a small one started them into an out-of-memory. Real unprivileged users over the daemon's socket,
the fake vendor's device (1000 MiB) standing in for a GPU."""

from __future__ import annotations

import contextlib
import grp
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from krex_async.client.submit import Client

from ..conftest import Daemon, open_tmpdir, run_daemon, until
from ..devices.conftest import MiB, fake_gpu_env
from ..devices.test_admission import eventually, row, until_status
from .helpers import User, python_as, user_env

AGENT = r"""
import asyncio, json, sys
from krex_async import Client

async def main(path, label, release, *extra):
    async with await Client.connect(path) as c:
        argv = [sys.executable, "-m", "krex_async.devices.fake", *extra, "--release", release]
        h = await c.submit(argv, label=label, env=json.loads(sys.stdin.read()), on_disconnect="keep")
        print(json.dumps({"command": h.command}))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture
def shared_fake() -> Iterator[dict[str, str]]:
    """The fake device's directory, where every user's commands record what they allocate."""
    for env in fake_gpu_env():
        dev = Path(env["KREX_FAKE_GPU_DIR"]) / "fake0"
        dev.mkdir()
        (dev / ".lock").touch()
        for p, mode in ((dev.parent, 0o1777), (dev, 0o1777), (dev / ".lock", 0o666)):
            p.chmod(mode)
        yield env


@pytest.fixture
def releases() -> Iterator[Path]:
    """Where the test releases the users' commands: a folder they can look into."""
    with open_tmpdir("krex-release-", 0o755) as d:
        yield d


def fake_of(env: dict[str, str]) -> dict[str, str]:
    """The fake device's variables of `env`: what the users' commands are given."""
    return {k: v for k, v in env.items() if k.startswith("KREX_FAKE_GPU")}


@contextlib.asynccontextmanager
async def serving_users(env: dict[str, str], *args: str) -> AsyncIterator[tuple[Daemon, Client]]:
    """A daemon on the fake device (shared policy, no headroom, `args` after), its socket open to
    the test users (group krexg, its directory 0711), and a client of this user's."""
    group = str(grp.getgrnam("krexg").gr_gid)
    base = ("--devices", "fake:1", "--mem-headroom", "0", "--policy", "shared", *args)
    async with run_daemon(*base, "--socket-group", group, "--isolation", "signal", env=env) as d:
        os.chmod(os.path.dirname(d.socket), 0o711)
        c = await d.client()
        try:
            yield d, c
        finally:
            await c.close()


def submit_as(user: User, sock: str, label: str, release: Path, env: dict[str, str], *fake: str) -> str:
    """`user`'s own client submits a command that allocates (`fake`'s arguments: 600 MiB unless
    given) until `release` exists."""
    args = fake or ("600M",)
    out = python_as(user, AGENT, sock, label, str(release), *args, input=json.dumps({**user_env(), **env}))
    return str(json.loads(out)["command"])


async def bench_learned(d: Daemon, what: str) -> None:
    """Until the daemon's memory.json (written within footprints.WRITE_S) holds a `bench` label's
    figure, as "u<uid> label bench" (the old code's key was "label bench")."""
    state = Path(d.socket).parent / "state" / "memory.json"
    await until(lambda: state.exists() and 'label bench"' in state.read_text(), what)


async def ended(c: Client, command: str) -> None:
    async def state() -> str:
        st = await c.status()
        return next((x["state"] for x in st["commands"] if x["command"] == command), "ended")

    await eventually(state, lambda s: s == "ended", f"{command} ended")


async def test_a_peers_commands_of_the_same_label_tell_nothing_of_a_users_need(
    users: dict[str, User], shared_fake: dict[str, str], releases: Path
) -> None:
    """mallory's `bench` peaks at 600 MiB: her next `bench` is taken at 600 MiB (learned), alice's
    first `bench` knows nothing of it (unknown). The old code took alice's at mallory's 600."""
    alice, mallory = users["alice"], users["mallory"]
    fake = fake_of(shared_fake)
    async with serving_users(shared_fake, "--mem-gate", "off") as (d, c):
        taught = submit_as(mallory, d.socket, "bench", releases / "r1", fake)
        await until_status(c, taught, lambda s: s["mem_peak"] >= 600 * MiB, "mallory's 600 MiB seen")
        (releases / "r1").touch()
        await ended(c, taught)
        # learned once the daemon has finished with it (after its state says ended)
        await bench_learned(d, "mallory's peak learned")

        victim = submit_as(alice, d.socket, "bench", releases / "r2", fake)
        st = await row(c, victim)
        assert (st["mem_source"], st["mem_need"]) == ("unknown", 0), st
        (releases / "r2").touch()
        await ended(c, victim)

        again = submit_as(mallory, d.socket, "bench", releases / "r3", fake)
        st = await row(c, again)
        assert (st["mem_source"], st["mem_need"]) == ("learned", 600 * MiB), st
        (releases / "r3").touch()
        await ended(c, again)


async def test_a_peers_program_that_never_asks_is_not_measured_as_a_users_command(
    users: dict[str, User], shared_fake: dict[str, str], releases: Path
) -> None:
    """Where NVML's pids are not the daemon's (a daemon in a container), a command alone on its
    device is measured by the device's use above its idle baseline. mallory's program, started
    beside alice's and allocating 700 MiB without asking at its gate (no torch), never seen, makes
    alice's not alone: alice's `bench` is measured, and learned, at its own 50 MiB. Before, it was
    measured at 750 MiB: mallory set what alice's commands were taken to need."""
    from krex_async.devices.fake import usage

    alice, mallory = users["alice"], users["mallory"]
    daemon_env = dict(shared_fake, KREX_FAKE_GPU_PID_OFFSET="4000000")
    fake = fake_of(daemon_env)
    root = Path(fake["KREX_FAKE_GPU_DIR"]) / "fake0"
    async with serving_users(daemon_env) as (d, c):
        mine = submit_as(alice, d.socket, "bench", releases / "ra", fake, "50M")
        await until_status(c, mine, lambda s: s["mem_peak"] >= 50 * MiB, "alice's 50 MiB seen alone")
        theirs = submit_as(mallory, d.socket, "x", releases / "rm", fake, "700M", "--no-cuda-gate")
        await until(lambda: sum(usage(root).values()) >= 750 * MiB, "mallory's 700 MiB, unasked")

        async def used() -> int:
            (dev,) = (await c.status())["devices"]
            return int(dev["memory"]["used_bytes"])

        # a sample after mallory's allocation: alice's figure is set
        await eventually(used, lambda n: n >= 750 * MiB, "a sample that saw mallory's 700 MiB")
        assert (await row(c, mine))["mem_peak"] == 50 * MiB
        for name, command in (("ra", mine), ("rm", theirs)):
            (releases / name).touch()
            await ended(c, command)
        await bench_learned(d, "alice's peak learned")
        again = submit_as(alice, d.socket, "bench", releases / "r2", fake, "1M")
        st = await row(c, again)
        assert (st["mem_source"], st["mem_need"]) == ("learned", 50 * MiB), st
        (releases / "r2").touch()
        await ended(c, again)


async def test_a_floor_a_peers_out_of_memory_showed_tells_nothing_of_a_users_need(
    users: dict[str, User], shared_fake: dict[str, str], releases: Path
) -> None:
    """A command's output is its own to write: mallory's `bench` runs out of memory beside alice's
    500 MiB, its message showing a floor of 900 MiB (50 held, 850 more). That floor is learned for
    mallory's next `bench` (900, learned: the code before floors learned nothing from a failure),
    and tells nothing of alice's first `bench` (unknown)."""
    alice, mallory = users["alice"], users["mallory"]
    fake = fake_of(shared_fake)
    # --mem-commit none: mallory's unknown first run starts beside alice's
    async with serving_users(shared_fake, "--mem-gate", "off", "--mem-commit", "none") as (d, c):
        holder = submit_as(alice, d.socket, "hold", releases / "rh", fake, "500M")
        await until_status(c, holder, lambda s: s["mem_peak"] >= 500 * MiB, "alice's 500 MiB seen")
        failed = submit_as(mallory, d.socket, "bench", releases / "r1", fake, "50M", "900M")
        await ended(c, failed)
        await bench_learned(d, "mallory's floor learned")
        again = submit_as(mallory, d.socket, "bench", releases / "r2", fake, "1M")
        st = await row(c, again)
        assert (st["mem_source"], st["mem_need"]) == ("learned", 900 * MiB), st
        victim = submit_as(alice, d.socket, "bench", releases / "r3", fake, "1M")
        st = await row(c, victim)
        assert (st["mem_source"], st["mem_need"]) == ("unknown", 0), st
        for name, command in (("rh", holder), ("r2", again), ("r3", victim)):
            (releases / name).touch()
            await ended(c, command)
