"""KREX_CUDA_GATE=1: ask the daemon for memory admission as this process first starts CUDA.

A daemon with `--mem-gate on` starts a torch command at once and counts it on its device only once
it asks here: its imports and inputs, most of a KernelBench job's life, overlap the device work of
the commands already admitted, instead of waiting in the daemon's queue for memory that it does
not touch yet (daemon/commands/admission.py).

An after-import hook (autoregion.py's) waits for `torch.cuda`. Right after that module's code has
run, `torch._C._cuda_init` is wrapped: `torch.cuda._lazy_init`, which every path into CUDA through
torch takes once per process, calls it under torch's own initialisation lock. The first call
connects to KREX_SOCKET, sends MemGate and waits for the daemon's answer, then starts CUDA.

Nothing is imported ahead of the program. The wait never raises into it: an unreachable daemon,
an untrusted socket or an error answer lets CUDA start at once. A Ctrl-C while it waits ends the
program as it would anywhere else.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

TARGET = "torch.cuda"
CONNECT_TIMEOUT_S = 2.0
_asked = False
_load: Callable[[str, str], Any] | None = None  # sitecustomize's loader of runtime modules
_sock: Any = None  # the connection while this process waits at the gate
errors: list[str] = []  # why a wait was skipped (kept for tests and debugging, never printed)


def ask() -> None:
    """Wait until the daemon lets this command use its device (once per process). What a CUDA
    start calls first; the fake test vendor's allocator calls it too, as a torch job would."""
    global _asked, _sock
    if _asked or _load is None:
        return
    _asked = True
    env = os.environ
    path, command, token = env.get("KREX_SOCKET"), env.get("KREX_COMMAND"), env.get("KREX_TOKEN")
    if not (path and command and token):
        return
    import _socket

    q = _load("_krex_quiesce", "quiesce.py")  # its msgpack framing and peer check, standard library only
    sock = _sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        q.connect_trusted(sock, path, CONNECT_TIMEOUT_S)
        pid = os.getpid()
        gate = {"type": "mem_gate", "id": 2, "command": command, "token": token, "pid": pid}
        sock.sendall(q.frame(q.hello(f"krex-gate/{pid}")) + q.frame(gate))
        msg = q.reply(sock)
        if msg is None:
            errors.append("the daemon closed the connection")
        elif msg.get("type") == "error":
            errors.append(f"{msg.get('code')}: {msg.get('message')}")
    except OSError as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        _sock = None
        sock.close()


def _after_fork_in_child() -> None:
    """Forked while another thread waited at the gate: the child's own CUDA start asks for itself,
    and it drops its copy of the parent's connection (the daemon sees the parent's end alone)."""
    global _asked, _sock
    if _sock is not None:
        try:
            _sock.close()
        except OSError:
            pass
        _sock, _asked = None, False


def _wrap() -> None:
    """Wrap torch._C._cuda_init (once) so that it asks first."""
    c = sys.modules.get("torch._C")
    real = getattr(c, "_cuda_init", None)
    if real is None or getattr(real, "_krex_gate", False):
        return  # a torch built without CUDA, or wrapped already

    def cuda_init(*args: Any, **kwargs: Any) -> Any:
        try:
            ask()
        except Exception as e:  # noqa: BLE001 - never stop the program's CUDA
            errors.append(f"{type(e).__name__}: {e}")
        return real(*args, **kwargs)

    cuda_init._krex_gate = True  # type: ignore[attr-defined]
    c._cuda_init = cuda_init  # type: ignore[union-attr]


def install(load: Callable[[str, str], Any]) -> None:
    """Wrap torch's CUDA start now if torch.cuda is imported, else when it is (idempotent).
    `load(name, file)`: sitecustomize's loader of the runtime's modules by path."""
    global _load
    if _load is None:
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _load = load
    hooks = load("_krex_autoregion", "autoregion.py")  # its after-import hook, standard library only
    hooks.after_import(TARGET, lambda module: _wrap(), key="cuda-gate")
