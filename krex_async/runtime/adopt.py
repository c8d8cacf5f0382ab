"""Adoption, the interpreter's side: hand this process's program to a warm pool worker at start-up.

    sitecustomize (main thread, before any user code; only when the daemon set KREX_POOL)
      another interpreter or venv than the pool's, flags, fds beyond 0-2 .... return the reason
      block the forwarded signals
      connect $KREX_SOCKET ── hello, adopt(argv, cwd, env, sys.path, flags, signals) ──► daemon
          ◄── adopted(declined=why) ............. unblock (a pending SIGINT kills), return the reason
          ◄── adopted(pid=W): worker W took fds 0/1/2 (pidfd_getfd) and runs the program; the
              daemon's signals to the command since the block reached W as it started
      let go of fds 0 and 1; wait: sigwaitinfo; a signal sent by anyone but the daemon goes to W
      (the daemon's own group signals reach W themselves, it runs in the command's cgroup)
          ◄── adopt_exited(returncode): exit with it, or die of the same signal

Once adopted this process never returns to Python: it exits with the worker's status, so its parent
(a shell, a runner script, subprocess) sees what it would have seen. Before that, every failure
returns a reason and the program runs here as it always did. Standard library builtins only: this
runs in every Python process of a pooled command.
"""

from __future__ import annotations

import _signal
import _socket
import _struct
import _thread
import os
import sys
import time as _time

if False:  # for type checkers only
    from collections.abc import Callable
    from typing import Any

FORWARD = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)
_WAKE = _signal.SIGCHLD  # the reader thread's wake-up (this process has no children of its own)
# sys.flags that a worker can take over from the command (sys.dont_write_bytecode is settable);
# every other flag must equal the worker's, which the daemon checks (ctxpool/adoption.py).
_SETTABLE_FLAGS = ("dont_write_bytecode",)
_OWN_FLAGS = frozenset("uBR")
# Flags whose default is not 0 or depends on the locale: only the daemon, which knows the
# worker's values, compares them.
# -u, -B, -R are not here: the worker applies them (or they are the default anyway)
_DAEMON_CHECKS = ("hash_randomization", "utf8_mode", "int_max_str_digits", "gil")


def local_reason(pool: str) -> str:
    """Why this interpreter cannot be adopted, from what it knows alone ("" when it may ask).

    `pool` is KREX_POOL: the pool interpreter's realpath and its venv ("" outside one), one a line.
    """
    exe, _, venv = pool.partition("\n")
    if os.path.realpath(sys.executable) != exe:
        return "interpreter"
    mine = os.path.realpath(sys.prefix) if sys.prefix != sys.base_prefix else ""
    if mine != venv:
        return "interpreter venv"
    why = _form(list(getattr(sys, "orig_argv", [])))
    if why:
        return why
    for name in getattr(type(sys.flags), "__match_args__", ()):
        if name not in _SETTABLE_FLAGS and name not in _DAEMON_CHECKS and getattr(sys.flags, name):
            return f"flag {name}"
    if getattr(sys, "_xoptions", None):
        return "flag -X"
    if sys.warnoptions:
        return "flag -W"
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return "fds unreadable"
    if not {"0", "1", "2"} <= set(fds):
        return "stdio closed"
    if len(fds) > 4:  # 0, 1, 2 and the listing's own descriptor
        return "fds beyond 0-2"  # a multiprocessing child, pass_fds: the worker could not have them
    return ""


def _form(argv: list[str]) -> str:
    i = 1
    while (
        i < len(argv)
        and argv[i].startswith("-")
        and len(argv[i]) > 1
        and argv[i][1] not in "cm-"
        and set(argv[i][1:]) <= _OWN_FLAGS
    ):
        i += 1
    if i >= len(argv):
        return "interactive"
    a = argv[i]
    if a == "-" or a.startswith("--") or a.startswith("-") and a[1] not in "cm":
        return f"flag {a}" if a not in ("-", "--") else "stdin program"
    if a.endswith((".pyc", ".pyo")):
        return "compiled script"
    return ""


def request(command: str, token: str, mask: Any) -> dict[str, Any]:
    """The adopt request: everything a fresh interpreter started with that a worker must take over
    (`mask`: the signal mask it started with, before it blocked those it forwards)."""
    um = os.umask(0o022)
    os.umask(um)
    return {
        "type": "adopt",
        "id": 2,
        "command": command,
        "token": token,
        "pid": os.getpid(),
        "argv": list(sys.orig_argv),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "executable": sys.executable,
        "sys_path": list(sys.path),
        "hexversion": sys.hexversion,
        "flags": {n: int(getattr(sys.flags, n)) for n in type(sys.flags).__match_args__},
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
        "warnoptions": list(sys.warnoptions),
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
        "dont_write_bytecode": bool(sys.dont_write_bytecode),
        "pycache_prefix": sys.pycache_prefix,
        "umask": um,
        "ignored": [
            int(s)
            for s in _signal.valid_signals()
            if s not in (_signal.SIGKILL, _signal.SIGSTOP) and _signal.getsignal(s) == _signal.SIG_IGN
        ],
        "mask": [int(s) for s in mask],
    }


def run(pool: str, load: Callable[[str, str], Any]) -> str:
    """Be adopted, or say why not. Does not return once a worker runs the program."""
    why = local_reason(pool)
    if why:
        return why
    env = os.environ
    q = load("_krex_quiesce", "quiesce.py")  # its msgpack codec and framing
    waitset = set(FORWARD) | {_WAKE}
    old_mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, waitset)  # none lost once adopted
    try:
        msg = request(env.get("KREX_COMMAND", ""), env.get("KREX_TOKEN", ""), old_mask)
        msg["blocked_at"] = _time.monotonic()  # the daemon's signals from here on reach the worker
        data = q.frame(q.hello(f"krex-adopt/{os.getpid()}")) + q.frame(msg)
    except (OSError, UnicodeError, TypeError, ValueError):
        _unblock(old_mask)
        return "environment unusable"  # cwd gone, a variable not UTF-8: run here
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # No timeout once connected: a worker may already run the program (a region can hold the
        # command frozen meanwhile); giving up would run it twice. The daemon answers or closes.
        q.connect_trusted(sock, env.get("KREX_SOCKET", ""), 2.0)
        daemon_pid = _struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[0]
        sock.sendall(data)
        reply = q.reply(sock)
    except (OSError, ValueError, UnicodeError):
        reply = None
    if reply is None or reply.get("type") != "adopted" or not reply.get("pid"):
        sock.close()
        _unblock(old_mask)
        if reply is None:
            return "daemon unreachable"
        return "" if reply.get("type") == "adopted" else "refused"  # the daemon counted it
    _wait(sock, q, int(reply["pid"]), daemon_pid, waitset)
    return ""  # not reached


def _unblock(old_mask: Any) -> None:
    """Restore the signal mask of a program that runs here after all. A SIGINT that came while it
    was blocked (a cancel during the wait for a worker) ends the process as it would have ended a
    fresh interpreter before its program ran, killed by SIGINT: raised as KeyboardInterrupt here,
    it would be swallowed by the runtime's start-up (which never lets an adoption fail a program)."""
    if (
        _signal.SIGINT in _signal.sigpending()
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler
    ):
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, old_mask)


def _let_go_of_stdio() -> None:
    """The worker holds the program's stdin and stdout now (its own copies): this process's must
    not keep them open, or a program that closes stdout would not be seen to (its reader would get
    EOF only when the program ends) nor one that closes stdin (its writer would get no EPIPE).
    stderr stays, for the one message this process may have to write; /dev/null takes 0 and 1."""
    try:
        null = os.open("/dev/null", os.O_RDWR)
    except OSError:
        return
    for fd in (0, 1):
        if null != fd:
            os.dup2(null, fd)
    if null > 1:
        os.close(null)


def _wait(sock: Any, q: Any, worker: int, daemon_pid: int, waitset: set[int]) -> None:
    """Forward signals to `worker` until the daemon reports its status, then exit with it."""
    box: dict[str, Any] = {}
    main = _thread.get_ident()
    try:
        wfd: int | None = os.pidfd_open(worker)
    except OSError:
        wfd = None  # already gone: its status is on its way
    _let_go_of_stdio()

    def reader() -> None:
        try:
            sock.settimeout(None)
            reply = q.reply(sock)
            if reply is not None and reply.get("type") == "adopt_exited":
                box["rc"] = int(reply.get("returncode", 1))
        except BaseException:  # noqa: BLE001 - the daemon is gone: main decides what to do
            pass
        if "rc" not in box and wfd is not None:
            # The daemon died and the status with it, but not the order of events: this process
            # ends (and its parent goes on) once the worker did, signals forwarded meanwhile.
            try:
                import select  # this path only

                select.select([wfd], [], [])
            except BaseException:  # noqa: BLE001
                pass
        box["done"] = True
        _signal.pthread_kill(main, _WAKE)

    _thread.start_new_thread(reader, ())
    me = os.getpid()
    while "done" not in box:
        info = _signal.sigwaitinfo(waitset)
        sig = info.si_signo
        if sig == _WAKE or info.si_pid == daemon_pid:
            continue  # the daemon's group signal reached the worker itself
        if wfd is not None and sig in FORWARD and info.si_pid != me:
            try:
                _signal.pidfd_send_signal(wfd, sig)
            except OSError:
                pass
    rc = box.get("rc")
    if rc is None:  # the daemon died: the worker's status is lost with it
        os.write(
            2,
            f"krex: lost the daemon while pool worker {worker} ran this program; "
            "its exit status is unknown\n".encode(),
        )
        os._exit(1)
    if rc >= 0:
        os._exit(rc & 0xFF)
    sig = -rc
    try:
        _signal.signal(sig, _signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL: its disposition cannot be set, nor caught
    try:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [sig])
        _signal.raise_signal(sig)
    except (OSError, ValueError):
        pass
    os._exit(128 + sig)  # a signal whose default is not to end the process
