"""Whom a client talks to and what a daemon trusts on disk, with real users: user A (mallory) squats
B's (alice's) default socket directory, listens there or on a socket of its own speaking krex's
hello, and plants a driver-lock record naming a library of its own (which writes a marker file
when loaded). B's clients must send A nothing; no daemon or cleanup may serve from, or load what
is named in, a directory another user can write."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import PY, ROOT, until
from .helpers import USER_PY, User, config_daemon, run_python_as, user_env

# A listener speaking krex's hello: it welcomes whoever connects and logs every request's type (a
# Submit sent to it is the capture this file guards against); any other request ends the connection.
FAKE = r"""
import os, socket, sys, threading
from krex_async import protocol as P
path, log = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
os.chmod(path, 0o777)
srv.listen(16)
def serve(c):
    with c:
        while True:
            head = c.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            n = P.HEADER.unpack(head)[0]
            msg = P.decode_request(c.recv(n, socket.MSG_WAITALL))
            with open(log, "a") as f:
                f.write(type(msg).__name__ + "\n")
            if not isinstance(msg, P.Hello):
                return
            c.sendall(P.encode(P.Welcome(id=msg.id, version=P.PROTOCOL_VERSION, server="krex", policy="")))
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""

MARKER_LIB = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen(MARK, "w");
    if (f) { fprintf(f, "%d\n", (int)geteuid()); fclose(f); }
}
int cuInit(unsigned flags) { return 0; }
"""


def as_user(user: User) -> dict[str, object]:
    return {"user": user.uid, "group": user.gid, "extra_groups": user.groups}


@contextlib.contextmanager
def fake_daemon(user: User, path: str) -> Iterator[Path]:
    """`user` listening on `path` with FAKE; yields the file its requests are logged to."""
    log = Path(tempfile.mkdtemp(prefix="krexfake-", dir="/tmp")) / "requests"
    os.chmod(log.parent, 0o777)
    proc = subprocess.Popen(
        [USER_PY, "-c", FAKE, path, str(log)],
        env=user_env(),
        cwd="/tmp",
        stdout=subprocess.PIPE,
        text=True,
        **as_user(user),  # type: ignore[arg-type]
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield log
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(log.parent, ignore_errors=True)


def requests(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@contextlib.contextmanager
def squatted(victim: User, squatter: User) -> Iterator[str]:
    """/tmp/krex-<victim uid> made by `squatter`, mode 0777 (removed before and after)."""
    d = f"/tmp/krex-{victim.uid}"
    shutil.rmtree(d, ignore_errors=True)
    p = run_python_as(squatter, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", d)
    assert p.returncode == 0, p.stderr
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def build_marker(where: Path, mark: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing: cannot build the marker library")
    src, lib = where / "marker.c", where / "libmarker.so"
    src.write_text(MARKER_LIB)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARK="{mark}"', "-o", str(lib), str(src)], check=True)
    lib.chmod(0o755)
    return lib


def plant_record(state: Path, lib: Path, owner: User | None) -> None:
    """A locks.json naming `lib` and one live process (this test's), as another user would write it."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    rec = state / "locks.json"
    rec.write_text(
        json.dumps({"version": 1, "pid": 1, "library": str(lib), "locked": [[os.getpid(), start]]})
    )
    if owner is not None:
        os.chown(state, owner.uid, owner.gid)
        os.chown(rec, owner.uid, owner.gid)


@pytest.fixture
def marker_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="krexmark-", dir="/tmp"))
    d.chmod(0o777)  # the marker is written by whoever loads the library
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------ clients


async def test_a_squatted_default_socket_directory_gets_no_submit(users: dict[str, User]) -> None:
    """mallory makes /tmp/krex-<alice> (0777) and listens on krex.sock there; alice's `krex run -- id
    -u` (no XDG_RUNTIME_DIR, no KREX_SOCKET) refuses in one line and sends no Submit."""
    alice, mallory = users["alice"], users["mallory"]
    with squatted(alice, mallory) as d, fake_daemon(mallory, os.path.join(d, "krex.sock")) as log:
        p = await asyncio.to_thread(
            subprocess.run,
            [USER_PY, "-m", "krex_async", "run", "--", "id", "-u"],
            env=user_env(),
            cwd="/tmp",
            capture_output=True,
            text=True,
            timeout=60,
            **as_user(alice),  # type: ignore[arg-type]
        )
        assert p.returncode != 0, (p.stdout, p.stderr)
        assert "Submit" not in requests(log), (requests(log), p.stderr)
        assert requests(log) == [], requests(log)  # not even the hello
        said = p.stderr.strip()
        assert "refusing the socket" in said and f"{d}/krex.sock" in said, said
        assert "owned by" in said and "krextest2" in said and "Traceback" not in said, said


CONNECT = r"""
import asyncio, sys
from krex_async import Client, KrexError
async def main():
    try:
        async with await Client.connect(sys.argv[1], timeout=10) as c:
            print("connected", c.welcome.server)
    except KrexError as e:
        print(e.code, e.message)
asyncio.run(main())
"""

REGION = r"""
from krex_async import region, RegionError
try:
    with region("timing"):
        print("entered")
except RegionError as e:
    print(e.code, e)
"""


async def test_an_explicit_socket_served_by_another_user_is_refused_unless_named(
    users: dict[str, User],
) -> None:
    """alice names mallory's socket: Client.connect and region() refuse before the hello (so the
    command's token never goes out); KREX_SOCKET_UID=<mallory> lets alice choose that daemon."""
    alice, mallory = users["alice"], users["mallory"]
    d = tempfile.mkdtemp(prefix="krexpeer-", dir="/tmp")
    os.chown(d, mallory.uid, mallory.gid)
    os.chmod(d, 0o755)
    sock = os.path.join(d, "s")
    try:
        with fake_daemon(mallory, sock) as log:
            p = await asyncio.to_thread(run_python_as, alice, CONNECT, sock)
            assert p.stdout.startswith("untrusted refusing the socket"), (p.stdout, p.stderr)
            assert "krextest2" in p.stdout and "KREX_SOCKET_UID" in p.stdout, p.stdout
            env = {"KREX_SOCKET": sock, "KREX_COMMAND": "c1", "KREX_TOKEN": "secret"}
            p = await asyncio.to_thread(run_python_as, alice, REGION, env=env)
            assert p.stdout.startswith("unreachable untrusted") or "refusing the socket" in p.stdout, (
                p.stdout,
                p.stderr,
            )
            assert "entered" not in p.stdout and "Traceback" not in p.stderr, (p.stdout, p.stderr)
            assert requests(log) == [], requests(log)
            p = await asyncio.to_thread(
                run_python_as, alice, CONNECT, sock, env={"KREX_SOCKET_UID": str(mallory.uid)}
            )
            assert p.stdout.strip() == "connected krex", (p.stdout, p.stderr)
            p = await asyncio.to_thread(
                run_python_as, alice, CONNECT, sock, env={"KREX_SOCKET_UID": "mallory"}
            )
            assert p.stdout.startswith("bad_input KREX_SOCKET_UID"), (p.stdout, p.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------ daemons


def serve_argv(sock: str, state: str) -> list[str]:
    return [PY, "-m", "krex_async", "serve", "--socket", sock, "--state-dir", state, "--isolation", "signal"]


async def refused_at_start(argv: list[str], sock: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a `krex serve` that must refuse: its result once it exited; the test fails (the daemon
    stopped) should it serve instead."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kw.pop("env", None) or dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd="/tmp",
        **kw,  # type: ignore[call-overload]
    )
    try:
        await until(lambda: proc.poll() is not None or os.path.exists(sock), "the daemon exits or serves")
        if proc.poll() is None:
            await until(lambda: proc.poll() is not None or _answers(sock), "the daemon answers")
    finally:
        if proc.poll() is None:
            proc.terminate()
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _answers(sock: str) -> bool:
    import socket

    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sock)
        return True
    except OSError:
        return False
    finally:
        s.close()


@pytest.mark.parametrize("mode", [0o1777, 0o770])
async def test_the_daemon_refuses_a_socket_directory_others_can_write(tmp_path: Path, mode: int) -> None:
    """World-writable (sticky, as /tmp) or group-writable: exit 2 naming the directory."""
    d = Path(tempfile.mkdtemp(prefix="krexsd-", dir="/tmp"))
    d.chmod(mode)
    sock = str(d / "s")
    try:
        p = await refused_at_start(serve_argv(sock, str(tmp_path / "state")), sock)
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert f"--socket {sock}" in p.stderr and "writable by" in p.stderr, p.stderr
        assert not os.path.exists(sock)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("how", ["owned by another user", "writable by others"])
async def test_a_root_daemon_refuses_a_state_dir_another_user_could_write(
    tmp_path: Path, marker_dir: Path, how: str, users: dict[str, User]
) -> None:
    """The state dir holds a planted locks.json naming a marker library: the daemon refuses the
    directory (exit 2 naming --state-dir) and loads nothing."""
    mark = marker_dir / "loaded"
    lib = build_marker(marker_dir, mark)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    if how == "writable by others":
        plant_record(state, lib, None)
        state.chmod(0o777)
    else:
        plant_record(state, lib, users["mallory"])
    sock = str(tmp_path / "s")
    p = await refused_at_start(serve_argv(sock, str(state)), sock)
    assert not mark.exists(), f"the planted library was loaded as euid {mark.read_text().strip()}"
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert f"--state-dir {state}" in p.stderr and ("owned by" in p.stderr or "writable by" in p.stderr), (
        p.stderr
    )


async def test_a_users_serve_and_cleanup_load_nothing_from_a_squatted_directory(
    users: dict[str, User], marker_dir: Path
) -> None:
    """mallory squats /tmp/krex-<alice> and plants krex-state/locks.json naming mallory's library:
    alice's `krex serve` and `krex cleanup` (defaults only) refuse, and the library is not loaded."""
    alice, mallory = users["alice"], users["mallory"]
    mark = marker_dir / "loaded"
    lib = build_marker(marker_dir, mark)
    with squatted(alice, mallory) as d:
        state = Path(d) / "krex-state"
        state.mkdir()
        plant_record(state, lib, mallory)
        state.chmod(0o777)
        (state / "locks.json").chmod(0o666)
        env = user_env()
        sock = os.path.join(d, "krex.sock")
        p = await refused_at_start(
            [USER_PY, "-m", "krex_async", "serve", "--isolation", "signal"], sock, env=env, **as_user(alice)
        )
        assert not mark.exists(), f"alice's serve loaded mallory's library (euid {mark.read_text().strip()})"
        assert p.returncode == 2 and d in p.stderr and "krextest2" in p.stderr, (p.returncode, p.stderr)
        p = await asyncio.to_thread(
            subprocess.run,
            [USER_PY, "-m", "krex_async", "cleanup"],
            env=env,
            cwd="/tmp",
            capture_output=True,
            text=True,
            timeout=60,
            **as_user(alice),  # type: ignore[arg-type]
        )
        assert not mark.exists(), (
            f"alice's cleanup loaded mallory's library (euid {mark.read_text().strip()})"
        )
        assert p.returncode == 2 and f"--state-dir {state}" in p.stderr, (p.returncode, p.stderr)


def test_a_lock_record_cannot_name_the_library_to_load(
    tmp_path: Path, marker_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even in a state dir of the daemon's own, the record's `library` is not what is opened: the
    reader's own choice (KREX_LIBCUDA here, else libcuda.so.1) is."""
    from krex_async.isolation.cudalock import release_left

    mark = marker_dir / "loaded"
    lib = build_marker(marker_dir, mark)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    plant_record(state, lib, None)
    own = tmp_path / "own-libcuda.so"
    monkeypatch.setenv("KREX_LIBCUDA", str(own))
    lines = release_left(str(state))
    assert not mark.exists(), "the library named in locks.json was loaded"
    assert any(f"cannot load {own}" in line for line in lines), lines


# ------------------------------------------------------------------------------- region() reach

PLAIN_REGION = "from krex_async import region\nwith region('timing'):\n    print('entered')\n"


def region_as(user: User, sock: str) -> subprocess.CompletedProcess[str]:
    env = {"KREX_SOCKET": sock, "KREX_COMMAND": "c1", "KREX_TOKEN": "t"}
    return run_python_as(user, PLAIN_REGION, env=env)


async def test_region_that_cannot_reach_the_daemon_says_so_in_one_line(users: dict[str, User]) -> None:
    """A job whose user is not in the socket's group (EACCES), or with no daemon at its socket
    (ENOENT, ECONNREFUSED): one line naming the socket, why, and the fix; no traceback."""
    outsider = users["outsider"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        p = await asyncio.to_thread(region_as, outsider, d.socket)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert d.socket in lines[0] and "krextest4" in lines[0], lines
    assert "group krexg" in lines[0] and "usermod -aG krexg" in lines[0], lines
    gone = tempfile.mkdtemp(prefix="krexgone-", dir="/tmp")
    os.chmod(gone, 0o755)
    try:
        p = await asyncio.to_thread(region_as, outsider, os.path.join(gone, "s"))
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, p.stderr
        assert f"no krex daemon answers at {gone}/s" in lines[0] and "krex serve" in lines[0], lines
        import socket

        dead = socket.socket(socket.AF_UNIX)  # bound, never listening: ECONNREFUSED
        dead.bind(os.path.join(gone, "s"))
        os.chmod(os.path.join(gone, "s"), 0o777)
        try:
            p = await asyncio.to_thread(region_as, outsider, os.path.join(gone, "s"))
        finally:
            dead.close()
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1 and "Connection refused" in lines[0], p.stderr
    finally:
        shutil.rmtree(gone, ignore_errors=True)


async def test_the_in_command_runtime_sends_its_token_to_no_other_users_listener(
    users: dict[str, User],
) -> None:
    """A command's runtime (sitecustomize: the quiesce listener) whose KREX_SOCKET leads to a
    listener of another user says nothing to it, its token least of all; the program runs on."""
    alice, mallory = users["alice"], users["mallory"]
    d = tempfile.mkdtemp(prefix="krexrt-", dir="/tmp")
    os.chown(d, mallory.uid, mallory.gid)
    os.chmod(d, 0o755)
    sock = os.path.join(d, "s")
    runtime = str(ROOT / "krex_async" / "runtime")
    env = {
        "PYTHONPATH": f"{runtime}:{user_env()['PYTHONPATH']}",
        "KREX_SOCKET": sock,
        "KREX_COMMAND": "c1",
        "KREX_TOKEN": "secret",
        "KREX_DEVICE": "cpu",
    }
    try:
        with fake_daemon(mallory, sock) as log:
            p = await asyncio.to_thread(
                run_python_as, alice, "import time; time.sleep(1); print('ran')", env=env
            )
            assert p.stdout == "ran\n", (p.stdout, p.stderr)
            assert requests(log) == [], requests(log)
            # the same listener named as trusted: the runtime talks to it (the check is what held it back)
            named = {**env, "KREX_SOCKET_UID": str(mallory.uid)}
            p = await asyncio.to_thread(
                run_python_as, alice, "import time; time.sleep(1); print('ran')", env=named
            )
            assert p.stdout == "ran\n", (p.stdout, p.stderr)
            await until(
                lambda: "QuiesceReady" in requests(log), lambda: f"no QuiesceReady: {requests(log)}", 10
            )
    finally:
        shutil.rmtree(d, ignore_errors=True)


# a torch whose CUDA start (torch._C._cuda_init, through torch.cuda._lazy_init) does nothing
BARE_TORCH = {
    "torch/__init__.py": "from torch import _C\nfrom torch import cuda\n",
    "torch/_C.py": "def _cuda_init():\n    pass\n",
    "torch/cuda/__init__.py": "import torch\n\ndef _lazy_init():\n    torch._C._cuda_init()\n",
}


async def test_the_cuda_gate_sends_its_token_to_no_other_users_listener(users: dict[str, User]) -> None:
    """A command's CUDA start under --mem-gate (KREX_CUDA_GATE=1) whose KREX_SOCKET leads to a
    listener of another user asks it nothing, its token least of all, and CUDA starts; named as
    trusted (KREX_SOCKET_UID), the same listener gets the MemGate (the check is what held it back)."""
    alice, mallory = users["alice"], users["mallory"]
    d = tempfile.mkdtemp(prefix="krexgate-", dir="/tmp")
    os.chown(d, mallory.uid, mallory.gid)
    os.chmod(d, 0o755)
    torch = Path(tempfile.mkdtemp(prefix="krexgate-torch-", dir="/tmp"))
    for name, source in BARE_TORCH.items():
        (torch / name).parent.mkdir(parents=True, exist_ok=True)
        (torch / name).write_text(source)
    for p in [torch, *torch.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    sock = os.path.join(d, "s")
    env = {
        "PYTHONPATH": f"{ROOT / 'krex_async' / 'runtime'}:{torch}:{user_env()['PYTHONPATH']}",
        "KREX_SOCKET": sock,
        "KREX_COMMAND": "c1",
        "KREX_TOKEN": "secret",
        "KREX_DEVICE": "cpu",
        "KREX_CUDA_GATE": "1",
    }
    program = "import torch; torch.cuda._lazy_init(); print('ran')"
    try:
        with fake_daemon(mallory, sock) as log:
            p = await asyncio.to_thread(run_python_as, alice, program, env=env)
            assert p.stdout == "ran\n", (p.stdout, p.stderr)
            assert "MemGate" not in requests(log), requests(log)
            named = {**env, "KREX_SOCKET_UID": str(mallory.uid)}
            p = await asyncio.to_thread(run_python_as, alice, program, env=named)
            assert p.stdout == "ran\n", (p.stdout, p.stderr)
            await until(lambda: "MemGate" in requests(log), lambda: f"no MemGate: {requests(log)}", 10)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(torch, ignore_errors=True)
