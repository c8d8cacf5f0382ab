"""The fleet's token goes to no other user's listener (krex_async/fleet/clustertrust.py): a Ray
client on a shared host, told to join a cluster at a loopback port or to find one (`auto`), sends
the token only where a trusted user listens.

mallory listens on a loopback port and records every byte that reaches her. alice, with a token
file of her own, joins the fleet at that port by name, and by `auto` with mallory's raylet-named
process and Ray address file in her way. Before the fix alice's Ray opened its gRPC connection to
mallory (82 bytes reached her), whose first call carries the token; now mallory gets no byte,
unless alice names her uid in KREX_RAY_UID (the control: the same client reaches mallory once told
to trust her)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import until
from tests.security.helpers import USER_PY, User, make_users, user_env

from .conftest import NEEDS_RAY

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)

from krex_async.client.submit import KrexError  # noqa: E402
from krex_async.fleet import clustertrust  # noqa: E402
from krex_async.linux import tcp  # noqa: E402

# mallory's listener: a thread per connection, each read's size appended to the file in argv[1],
# each accept() argv[2] seconds after the last; on a listening socket of her own, or on the one
# whose fd is argv[3] (handed to her, made by root: as systemd's socket activation does)
LISTENER = """
import socket, sys, threading, time
if len(sys.argv) > 3:
    s = socket.socket(fileno=int(sys.argv[3]))
else:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
print(s.getsockname()[1], flush=True)
def serve(c):
    while data := c.recv(65536):
        with open(sys.argv[1], "a") as f:
            f.write(f"{len(data)}\\n")
while True:
    time.sleep(float(sys.argv[2]))
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""

# alice's fleet client: one line, the error's code and message, or JOINED
JOIN = """
import asyncio, sys
from krex_async.client.submit import KrexError
from krex_async.fleet.client import FleetClient
async def main():
    try:
        await FleetClient.connect(sys.argv[1], token_file=sys.argv[2])
        print("JOINED", flush=True)
    except KrexError as e:
        print(e.code, e.message, flush=True)
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()


def _popen_as(
    user: User,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    executable: str | None = None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        executable=executable,
        pass_fds=pass_fds,
        user=user.uid,
        group=user.gid,
        extra_groups=user.groups,
        env={**user_env(), **env},
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


class Squat:
    """mallory's listener, its record of what reached it, and alice's home with her token."""

    def __init__(self, alice: User, mallory: User, base: Path, handed: bool = False) -> None:
        """`handed`: mallory listens on a socket root made, and accepts 3 s late."""
        self.alice, self.mallory, self.base = alice, mallory, base
        self.got = base / "mallory" / "got"
        (base / "mallory").mkdir(mode=0o755)
        os.chown(base / "mallory", mallory.uid, mallory.gid)
        argv = [USER_PY, "-c", LISTENER, str(self.got), "3" if handed else "0"]
        with socket.create_server(("127.0.0.1", 0)) as made:
            if handed:
                argv.append(str(made.fileno()))
            self.listener = _popen_as(
                mallory, argv, {}, str(base / "mallory"), pass_fds=(made.fileno(),) if handed else ()
            )
        assert self.listener.stdout is not None
        self.port = int(self.listener.stdout.readline())
        self.home = base / "alice"
        self.home.mkdir(mode=0o700)
        self.token = self.home / "token"
        self.token.write_text("alices-fleet-token\n")
        self.token.chmod(0o600)
        for p in (self.home, self.token):
            os.chown(p, alice.uid, alice.gid)

    def received(self) -> int:
        try:
            return sum(int(n) for n in self.got.read_text().split())
        except FileNotFoundError:
            return 0

    async def join_as_alice(self, address: str, **env: str) -> tuple[int, str]:
        """alice's client joining `address`: (bytes mallory got, alice's line), once alice's
        client has ended or mallory has heard from it (its Ray then waits on her for minutes)."""
        e = {"HOME": str(self.home), "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor", **env}
        proc = _popen_as(self.alice, [USER_PY, "-c", JOIN, address, str(self.token)], e, str(self.home))
        try:
            await until(lambda: proc.poll() is not None or self.received() > 0, "alice's client ends", 120)
        finally:
            _stop(proc)
        out, err = proc.communicate()
        return self.received(), (out.strip() or err.strip()[-600:])


@contextlib.contextmanager
def squatting(users: dict[str, User], handed: bool = False) -> Iterator[Squat]:
    base = Path(tempfile.mkdtemp(prefix="krex-squat-", dir="/tmp"))
    base.chmod(0o755)
    s = Squat(users["alice"], users["mallory"], base, handed)
    try:
        yield s
    finally:
        _stop(s.listener)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def squat(users: dict[str, User]) -> Iterator[Squat]:
    with squatting(users) as s:
        yield s


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "[::ffff:127.0.0.1]"])
async def test_a_named_port_that_another_user_listens_on_gets_no_token(squat: Squat, host: str) -> None:
    """Any name of the loopback listener: 0.0.0.0 and the IPv4-mapped form reach it too."""
    got, line = await squat.join_as_alice(f"{host}:{squat.port}")
    assert got == 0, (got, line)
    assert line.startswith("untrusted refusing the Ray cluster at"), line
    assert f"runs as uid {squat.mallory.uid} (krextest2)" in line and "KREX_RAY_UID" in line, line
    got, line = await squat.join_as_alice(f"{host}:{squat.port}", KREX_RAY_UID=str(squat.mallory.uid))
    assert got > 0, ("alice, told to trust mallory, should have reached her", line)


async def test_a_listener_made_by_root_and_handed_to_another_user_gets_no_token(
    users: dict[str, User],
) -> None:
    """Until a process accepts a connection, its row in /proc/net/tcp names whoever made the
    listener (root here; root for every listener before Linux 6.17): mallory, accepting 3 s late
    on a socket root made for her, was taken for root. Now the owner is read once accepted, and
    a connection nobody accepts within a second is refused."""
    with squatting(users, handed=True) as squat:
        got, line = await squat.join_as_alice(f"127.0.0.1:{squat.port}")
    assert got == 0, (got, line)
    assert line.startswith("untrusted refusing the Ray cluster at 127.0.0.1:"), line
    assert "no process on this host accepted the connection within 1 s" in line, line


def _raylet_as(user: User, gcs: str) -> subprocess.Popen[str]:
    """A process of `user`'s named raylet, naming `gcs` as its GCS as a raylet does."""
    return _popen_as(user, ["raylet", "-c", "sleep 600; :", f"--gcs-address={gcs}"], {}, "/tmp", "/bin/sh")


def _squatted_address_file(squat: Squat, address: str) -> Path:
    """A Ray temp dir whose ray/ray_current_cluster, naming `address`, mallory made: Ray's default
    one is /tmp/ray, which any user can make first."""
    tmp = squat.base / "raytmp"
    (tmp / "ray").mkdir(parents=True, mode=0o755)
    (tmp / "ray" / "ray_current_cluster").write_text(f"{address}\n")
    for p in (tmp, tmp / "ray", tmp / "ray" / "ray_current_cluster"):
        os.chown(p, squat.mallory.uid, squat.mallory.gid)
    return tmp


async def test_auto_passes_over_another_users_address_file_and_raylet(squat: Squat) -> None:
    """Ray's own `auto` takes the address file (mallory made alice's Ray temp dir) or, without
    it, mallory's process named raylet."""
    address = f"127.0.0.1:{squat.port}"
    tmp = _squatted_address_file(squat, address)
    raylet = _raylet_as(squat.mallory, address)
    try:
        got, line = await squat.join_as_alice("auto", RAY_TMPDIR=str(tmp))
        assert got == 0, (got, line)
        assert line.startswith("unreachable no Ray cluster found for 'auto' (passed over: "), line
        assert f"{tmp}/ray is owned by uid {squat.mallory.uid}" in line and address in line, line
    finally:
        _stop(raylet)


async def test_auto_takes_only_a_trusted_users_file_or_raylet(
    squat: Squat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolution itself, for a set of trusted uids: for alice (and root), mallory's file and
    raylet are passed over, and so is a setuid-root program that mallory started under a raylet's
    name (root by its effective uid alone); for mallory her file comes first, then her raylets;
    $RAY_ADDRESS before both."""
    file_address, raylet_address = f"127.0.0.1:{squat.port}", f"127.0.0.1:{squat.port}1"
    monkeypatch.setenv("RAY_TMPDIR", str(_squatted_address_file(squat, file_address)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    procs = [_raylet_as(squat.mallory, raylet_address)]
    passwd = Path("/usr/bin/passwd")
    if passwd.exists() and passwd.stat().st_mode & 0o4000 and passwd.stat().st_uid == 0:
        # a root process of mallory's: it waits for her current password on its stdin
        argv = [f"raylet --gcs-address={raylet_address}2"]
        procs.append(_popen_as(squat.mallory, argv, {}, "/tmp", str(passwd)))

    def ours() -> dict[str, frozenset[int]]:
        return {a: o for o, a in clustertrust._raylets() if a.startswith(raylet_address)}

    try:
        await until(lambda: len(ours()) == len(procs), "mallory's raylets are seen")
        assert ours()[raylet_address] == {squat.mallory.uid}
        alice, mallory = frozenset({0, squat.alice.uid}), frozenset({squat.mallory.uid})
        with pytest.raises(KrexError) as e:
            clustertrust.auto_address(alice)
        assert e.value.code == "unreachable", e.value
        assert f"ray is owned by uid {squat.mallory.uid}" in e.value.message, e.value.message
        for address in ours():
            assert address in e.value.message, (address, e.value.message)
        assert clustertrust.auto_address(mallory) == file_address
        Path(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster").unlink()
        found = clustertrust.auto_address(mallory)  # the first of hers (another run's may sort first)
        assert found == min(a for o, a in clustertrust._raylets() if o <= mallory), found
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")  # the caller's own choice
        assert clustertrust.auto_address(alice) == "10.0.0.9:6379"
    finally:
        for p in procs:
            _stop(p)


def _far_owner(c: socket.socket) -> int | None:
    return tcp.owner(c.getpeername()[:2], c.getsockname()[:2])[1]


async def test_the_owner_of_a_connections_far_end_is_the_accepting_user(squat: Squat) -> None:
    """tcp.owner: mallory's accepting end of a connection made to 127.0.0.1, 0.0.0.0 or
    ::ffff:127.0.0.1, and nothing for an end that is not on this host."""
    for family, host in (
        (socket.AF_INET, "127.0.0.1"),
        (socket.AF_INET, "0.0.0.0"),
        (socket.AF_INET6, "::ffff:127.0.0.1"),
    ):
        with socket.socket(family) as c:
            c.connect((host, squat.port))
            await until(partial(_far_owner, c), "mallory accepts")
            assert _far_owner(c) == squat.mallory.uid, host
            assert tcp.owner(c.getsockname()[:2], c.getpeername()[:2]) == (True, os.geteuid()), host  # ours
            assert tcp.owner(("192.0.2.1", squat.port), c.getsockname()[:2]) == (False, None)


async def test_a_connection_to_another_host_passes_and_one_here_that_nobody_accepts_does_not() -> None:
    """check_peer: no socket of this host at the far end and a far address not this host's is
    another host's (nothing to check here); a far address of this host with no socket here (a NAT
    into another network namespace, or one closed at once) is refused."""
    me = frozenset({os.geteuid()})
    await clustertrust.check_peer("192.0.2.1:6379", ("10.9.9.9", 40000), ("192.0.2.1", 6379), me)
    with pytest.raises(KrexError) as e:
        await clustertrust.check_peer(
            "127.0.0.1:9", ("127.0.0.1", 40000), ("127.0.0.1", 9), me, accept_s=0.05
        )
    assert e.value.code == "untrusted" and "no process on this host accepted" in e.value.message, e.value
