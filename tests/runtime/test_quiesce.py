"""The in-command quiesce runtime, in real subprocesses, against a real unix-socket server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex_async import protocol as P

from .server import Peer, Server

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "krex_async" / "runtime"

SPIN = r"""
import os, sys, time
out = open(sys.argv[1], "a", buffering=1)
mode = sys.argv[2]
if mode == "fork":
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        sys.exit(0)
# A program that loops like this from its first instruction can keep the runtime's listener
# thread from connecting (it needs the GIL, which the loop retakes before a woken thread runs):
# give it the moment it needs.
time.sleep(0.3)
t_last = 0.0
while True:
    if mode == "sleep":
        time.sleep(0.001)
    now = time.monotonic()
    if now - t_last >= 0.001:
        out.write(f"{now:.6f}\n")
        t_last = now
"""


@pytest.fixture
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="kx") as d:  # short path: AF_UNIX stops near 108 bytes
        s = Server(Path(d) / "s")
        yield s
        s.close()


def command_env(sock: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.update(
        PYTHONPATH=str(RUNTIME), KREX_SOCKET=sock, KREX_COMMAND="c1", KREX_TOKEN="t0k", KREX_DEVICE="cpu"
    )
    env.update(extra)
    return env


def stamps(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def wait_for(pred, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def quiesce_cycle(peer: Peer, out: Path, region: str) -> None:
    """Quiesce, check the ack and silence, resume, check it writes again."""
    assert wait_for(lambda: len(stamps(out)) > 20), "the command never started writing"
    t_sent = time.monotonic()
    peer.send(P.Quiesce(id=7, region=region))
    ack = peer.recv(5)
    t_ack = time.monotonic()
    assert isinstance(ack, P.QuiesceAck), ack
    assert (ack.id, ack.region, ack.synced) == (7, region, "none")
    assert 0 <= ack.seconds < 1
    # Usually milliseconds. On the 2-core dev VM about one run in six takes 1.2-1.9 s for the
    # spinning command, with the same runtime code as before this bound was raised from 1 s
    # (cause not found; recorded in issue 5's note): the bound catches a missing ack, not speed.
    assert t_ack - t_sent < 3.0, "the ack took too long for a command in pure Python"
    n_at_ack = len(stamps(out))
    time.sleep(0.5)
    quiet = stamps(out)
    assert len(quiet) == n_at_ack, "the command wrote while quiesced"
    assert all(t <= t_ack for t in quiet)
    t_resume = time.monotonic()
    peer.send(P.Resume(id=8, region=region))
    assert wait_for(lambda: any(t > t_resume for t in stamps(out)), 2.0), "no progress after Resume"


@pytest.mark.parametrize("mode", ["spin", "sleep"])
def test_python_command_acks_blocks_and_resumes(server: Server, tmp_path: Path, mode: str) -> None:
    out = tmp_path / "stamps"
    proc = subprocess.Popen(
        [sys.executable, "-c", SPIN, str(out), mode],
        env=command_env(server.path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        peer = server.accept()
        assert peer is not None, "the runtime never connected"
        assert peer.hello.role == "command"
        assert (peer.ready.command, peer.ready.token, peer.ready.pid) == ("c1", "t0k", proc.pid)
        quiesce_cycle(peer, out, "r1")
        quiesce_cycle(peer, out, "r2")  # a second region on the same connection
        # a Resume for a region it was never asked to stop for changes nothing
        peer.send(P.Resume(id=9, region="other"))
        assert proc.poll() is None
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert err == b""


def test_connection_loss_while_quiesced_resumes(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "stamps"
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(out), "spin"], env=command_env(server.path))
    try:
        peer = server.accept()
        assert peer is not None
        assert wait_for(lambda: len(stamps(out)) > 20)
        peer.send(P.Quiesce(id=3, region="r"))
        assert isinstance(peer.recv(5), P.QuiesceAck)
        n = len(stamps(out))
        time.sleep(0.3)
        assert len(stamps(out)) == n
        t_close = time.monotonic()
        peer.close()  # the daemon died: the program must not stay stopped
        assert wait_for(lambda: any(t > t_close for t in stamps(out)), 3.0)
    finally:
        proc.kill()
        proc.wait()


def test_forked_child_rearms_with_its_own_connection(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "stamps"
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(out), "fork"], env=command_env(server.path))
    child_pid = 0
    try:
        first = server.accept()
        second = server.accept()
        assert first is not None and second is not None, "the forked child did not connect"
        peers = {p.ready.pid: p for p in (first, second)}
        assert proc.pid in peers
        child_pid = next(pid for pid in peers if pid != proc.pid)
        quiesce_cycle(peers[child_pid], out, "rc")  # only the child writes
    finally:
        if child_pid:
            os.kill(child_pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_non_python_command_never_acknowledges(server: Server) -> None:
    proc = subprocess.Popen(["sleep", "5"], env=command_env(server.path))
    try:
        # nothing connects: the daemon's quiesce timeout is what handles such commands
        assert server.accept(timeout=1.0) is None
    finally:
        proc.kill()
        proc.wait()


def test_unreachable_daemon_is_silent(tmp_path: Path) -> None:
    code = "import time, sys; time.sleep(0.3); print('ok'); sys.exit(3)"
    for sock in (str(tmp_path / "missing.sock"), "/dev/null", ""):
        out = subprocess.run(
            [sys.executable, "-c", code], env=command_env(sock), capture_output=True, timeout=30
        )
        assert (out.returncode, out.stdout, out.stderr) == (3, b"ok\n", b""), sock


def test_closed_by_daemon_right_away_is_silent(server: Server) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.5); print('ok')"],
        env=command_env(server.path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    peer = server.accept()
    assert peer is not None
    peer.send(P.Error(id=2, code="forbidden", message="bad token"))
    peer.close()
    out, err = proc.communicate(timeout=10)
    assert (proc.returncode, out, err) == (0, b"ok\n", b"")


def test_user_signal_handlers_keep_working(server: Server, tmp_path: Path) -> None:
    code = (
        "import signal, time, sys\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "signal.raise_signal(signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "print(got == [signal.SIGUSR1], signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=command_env(server.path), capture_output=True, timeout=30
    )
    assert proc.stdout == b"True True\n" and proc.stderr == b""


def test_existing_sitecustomize_is_chained(tmp_path: Path) -> None:
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nCHAINED = 'yes'\nos.environ['CHAINED_RAN'] = '1'\n")
    code = (
        "import os, sitecustomize\n"
        "print(os.environ.get('CHAINED_RAN'), sitecustomize.CHAINED, "
        "sitecustomize.__file__.endswith('krex_async/runtime/sitecustomize.py'))\n"
    )
    env = command_env(str(tmp_path / "none.sock"))
    env["PYTHONPATH"] = os.pathsep.join([str(RUNTIME), str(other)])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert out.stdout == b"1 yes True\n", out.stderr
    # a broken chained sitecustomize is reported by `site` as it would be without krex
    (other / "sitecustomize.py").write_text("raise RuntimeError('boom')\n")
    out = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, timeout=30)
    assert out.stdout == b"ran\n" and b"boom" in out.stderr


def test_the_main_thread_imports_only_builtin_modules_for_krex() -> None:
    """The main thread pays only for sitecustomize.py itself: at module level and in what it runs
    on the main thread (`_chain`, `_start`), it imports nothing but builtin modules (the listener's
    socket, ctypes and msgspec load on its own thread). What that costs in time is measured by
    bench/runtime_start.py, not here: timed start-ups failed CI on GIL contention alone."""
    import ast

    from krex_async.runtime import sitecustomize as sc

    def imports(node: ast.AST) -> set[str]:
        if isinstance(node, ast.FunctionDef) and node.name == "boot":
            return set()  # the listener thread's body
        found = set()
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            found |= imports(child)
        return found

    tree = ast.parse(Path(sc.__file__).read_text())
    imported: set[str] = set()
    for top in tree.body:  # module level, and the functions the main thread runs
        if not isinstance(top, ast.FunctionDef) or top.name in ("_chain", "_start", "arm"):
            imported |= imports(top)
    # os and importlib: `site` itself imported both before it imports sitecustomize
    allowed = set(sys.builtin_module_names) | {"os", "importlib"}
    assert imported and imported <= allowed, imported - allowed


def test_pool_worker_arms_later(server: Server, tmp_path: Path) -> None:
    """A warm worker starts without a command and arms the runtime once it is given one."""
    out = tmp_path / "stamps"
    code = (
        "import os, sys, sitecustomize\n"
        "assert sitecustomize.arm() is False\n"  # nothing to listen for yet
        f"os.environ.update(KREX_SOCKET={server.path!r}, KREX_COMMAND='c1', KREX_TOKEN='t0k')\n"
        "assert sitecustomize.arm() and sitecustomize.arm()\n"  # idempotent
        "sys.argv = ['spin', sys.argv[1], 'sleep']\n"
        f"exec(compile({SPIN!r}, 'spin', 'exec'))\n"
    )
    env = {k: v for k, v in command_env(server.path).items() if not k.startswith("KREX_")}
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], env=env)
    try:
        peer = server.accept()
        assert peer is not None and peer.ready.pid == proc.pid
        quiesce_cycle(peer, out, "rp")
        assert server.accept(timeout=0.3) is None  # armed once
    finally:
        proc.kill()
        proc.wait()


EXIT_WHEN_TOLD = r"""
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
sys.exit(5)
"""


@pytest.mark.parametrize("end", ["resume", "daemon-gone", "cap"])
def test_a_held_process_exits_after_its_region(server: Server, tmp_path: Path, end: str) -> None:
    """Told Held(region), an interpreter that exits says ExitHeld and waits for that region's
    Resume (a Resume for another region does not free it); the daemon's death or
    KREX_EXIT_HOLD_MAX_S end the wait too, and the exit status is the program's either way."""
    go = tmp_path / "go"
    extra = {"KREX_EXIT_HOLD_MAX_S": "1.0"} if end == "cap" else {}
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_WHEN_TOLD, str(go)], env=command_env(server.path, **extra)
    )
    try:
        peer = server.accept()
        assert peer is not None, "the runtime never connected"
        peer.send(P.Held(id=0, region="r1"))
        time.sleep(0.2)
        go.write_text("")
        msg = peer.recv(5)
        assert isinstance(msg, P.ExitHeld) and (msg.region, msg.pid) == ("r1", proc.pid), msg
        peer.send(P.Resume(id=0, region="other"))
        time.sleep(0.4)
        assert proc.poll() is None, "the exit did not wait for the region"
        t0 = time.monotonic()
        if end == "resume":
            peer.send(P.Resume(id=0, region="r1"))
        elif end == "daemon-gone":
            peer.close()
        assert proc.wait(5) == 5
        waited = time.monotonic() - t0
        assert waited < (1.0 if end == "cap" else 0.5), waited
        if end == "cap":
            assert waited > 0.2, "the cap ended the wait early"
    finally:
        proc.kill()
        proc.wait()


def test_an_unheld_process_exits_at_once(server: Server, tmp_path: Path) -> None:
    """Held, then resumed before the exit: the exit neither waits nor says ExitHeld."""
    go = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", EXIT_WHEN_TOLD, str(go)], env=command_env(server.path))
    try:
        peer = server.accept()
        assert peer is not None
        peer.send(P.Held(id=0, region="r1"))
        peer.send(P.Resume(id=0, region="r1"))
        time.sleep(0.2)
        t0 = time.monotonic()
        go.write_text("")
        assert proc.wait(5) == 5
        assert time.monotonic() - t0 < 0.5
        assert peer.recv(0.2) is None, "an ExitHeld without a region holding it"
    finally:
        proc.kill()
        proc.wait()


def test_a_pool_worker_that_serves_on_does_not_wait(server: Server, tmp_path: Path) -> None:
    """A program's end in a pool worker that stays warm tears nothing down: held or not, its exit
    hooks do not wait for the region (ctxpool/fresh.finish(stay=True) says so while they run)."""
    go = tmp_path / "go"
    code = (
        "import sys, types\n"
        "m = types.ModuleType('krex_async.ctxpool.fresh'); m.staying = True\n"
        "sys.modules['krex_async.ctxpool.fresh'] = m\n" + EXIT_WHEN_TOLD
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(go)], env=command_env(server.path))
    try:
        peer = server.accept()
        assert peer is not None
        peer.send(P.Held(id=0, region="r1"))
        time.sleep(0.2)
        t0 = time.monotonic()
        go.write_text("")
        assert proc.wait(5) == 5
        assert time.monotonic() - t0 < 0.5, "a worker that stays waited for the region"
        assert peer.recv(0.2) is None
    finally:
        proc.kill()
        proc.wait()


def test_fresh_finish_marks_a_staying_worker_while_exit_hooks_run() -> None:
    code = (
        "import atexit\n"
        "from krex_async.ctxpool import fresh\n"
        "atexit.register(lambda: print('hook', fresh.staying))\n"
        "fresh.finish(0, stay=True)\n"
        "print('after', fresh.staying)\n"
        "atexit.register(lambda: print('exit', fresh.staying))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.stdout.split("\n")[:3] == ["hook True", "after False", "exit False"], out
