"""A warm worker: `python -m krex_async.ctxpool.worker --fd N ...`, started by a Pool, never forked.

    start ── import preload ──► "imported" ──(pool holds the node lock)── "init" ──► create context,
          import --init-modules ──► "ready" ──► wait for "run" + fds ──► fresh.enter ──► "started"
          ──► run __main__
          ──► max_uses reached: exit with the command's status (atexit, flush: a normal exit)
          ──► else: finish, fresh.leave, torch's settings back (torchstate), health check, report
              "exited" (the pool may move it back to its own cgroups then) ──► "ready" again, or retire

The worker keeps its channel (a SOCK_SEQPACKET fd from the pool, close-on-exec) open while it waits;
EOF on it means the pool is gone, and the worker exits. Warming errors are sent back as a traceback
("failed") and the worker exits 3. Errors while entering the command's world (cwd gone, cgroup write
refused) are printed on the command's stderr and end the worker with status 1, as a failed exec would
end a plain start.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import signal
import socket
import sys
import time
import traceback
from typing import Any

from krex_async.ctxpool import adopted, channel, forms, fresh, homes, torchstate


class Context:
    """The device context of this worker: through torch when torch is preloaded, else the driver."""

    def __init__(self, vendor: str, ordinal: int) -> None:
        self.vendor, self.ordinal = vendor, ordinal
        self.torch: Any = None
        self.cuda: Any = None
        self.baseline_bytes = 0
        self.baseline_reserved = 0  # what torch's allocator holds from the device once cache is emptied

    def create(self) -> None:
        if self.vendor == "cpu":
            return
        if "torch" in sys.modules:
            self.torch = sys.modules["torch"]
            self.torch.ones(1, device=f"cuda:{self.ordinal}")
            self.torch.cuda.synchronize()
            self.baseline_bytes = self.torch.cuda.memory_allocated()
            self.torch.cuda.empty_cache()
            self.baseline_reserved = self.torch.cuda.memory_reserved()
            return
        if self.vendor != "nvidia":
            return  # no driver API path for this vendor without torch: warm imports only
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), self.ordinal))):
            _check(call, getattr(cuda, call)(*args))
        _check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        _check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx))
        self.cuda = cuda

    def check(self) -> str | None:
        """Why this context cannot serve another command (sticky error, memory not returned).

        With torch: tensors still allocated, or device memory the caching allocator still reserves
        after empty_cache() (a segment that cannot be freed) beyond what it held once warm. Not
        mem_get_info(): its free bytes are the device's, moved by every other process on it.
        """
        if self.torch is not None:
            cuda = self.torch.cuda
            try:
                cuda.synchronize()
                # cuBLAS keeps a workspace per handle and stream from the caching allocator: the
                # command's, not the worker's (the next command's first matmul makes its own)
                getattr(getattr(self.torch, "_C", None), "_cuda_clearCublasWorkspaces", lambda: None)()
                now = cuda.memory_allocated()
                if now > self.baseline_bytes:
                    return f"device memory not returned: {now - self.baseline_bytes} bytes"
                cuda.empty_cache()  # the command's freed blocks go back to the device
                reserved = cuda.memory_reserved()
            except Exception as e:  # noqa: BLE001 - any failure here means the context is broken
                return f"device error: {e}"
            if reserved > self.baseline_reserved:
                return (
                    f"device memory still reserved after empty_cache: "
                    f"{reserved - self.baseline_reserved} bytes"
                )
        elif self.cuda is not None:
            rc = self.cuda.cuCtxSynchronize()
            if rc != 0:
                return f"device error: cuCtxSynchronize returned {rc}"
        return None


def _check(call: str, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed: CUresult {rc}")


def _options(argv: list[str]) -> dict[str, str]:
    opts = {
        "preload": "",
        "vendor": "cpu",
        "ordinal": "0",
        "init-context": "1",
        "max-uses": "1",
        "home-by-pool": "0",
        "lc-ctype-coerced": "0",
        "init-modules": "",
    }
    it = iter(argv)
    for a in it:
        if not a.startswith("--") or a[2:] not in opts and a != "--fd":
            raise SystemExit(f"worker: unknown option {a!r}")
        opts[a[2:]] = next(it)
    return opts


def main(argv: list[str]) -> int:
    opts = _options(argv)
    sock = socket.socket(fileno=int(opts["fd"]))
    rx = channel.Receiver()
    path_rest = sys.path[1:]  # entry 0 is the directory `-m` started the worker in
    # The start-up variables as the interpreter started with them: preloads set some (torch sets
    # CUDA_MODULE_LOADING when it creates the context), which an adopter never has.
    init_env = {k: os.environ.get(k) for k in sorted(forms.INIT_VARS)}
    ctx = Context(opts["vendor"], int(opts["ordinal"]))
    t0 = time.monotonic()
    try:
        # krex's own in-command client is part of every worker's baseline: commands that use
        # region() then import nothing new, and a reused worker need not retire for it.
        for name in ["krex_async.client.region", *filter(None, opts["preload"].split(","))]:
            __import__(name)
        channel.send(sock, {"t": "imported", "pid": os.getpid(), "s": time.monotonic() - t0})
        init_modules = list(filter(None, opts["init-modules"].split(",")))
        if opts["init-context"] == "1" and ctx.vendor != "cpu" or init_modules:
            msg, _ = channel.recv(sock, rx)
            if msg["t"] != "init":
                raise RuntimeError(f"expected init, got {msg['t']!r}")
            if opts["init-context"] == "1":
                ctx.create()
            for name in init_modules:
                __import__(name)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the pool went away while we warmed
    except BaseException:  # noqa: BLE001 - carried back to the pool as text, like process.py does
        _send_quiet(sock, {"t": "failed", "error": traceback.format_exc()})
        return 3
    lc_ctype = os.environ.get("LC_CTYPE") if opts["lc-ctype-coerced"] == "1" else None
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    gc.collect()
    settings = torchstate.snapshot()  # torch's process-wide settings, put back after each command
    # put back once before the baseline, so what restoring imports (lazily, in torch) is the worker's:
    # taken after, it was new at the next command's end, and an extension module retired the worker
    torchstate.restore(settings)
    base = fresh.Baseline(path_rest)
    tops = {
        k: v
        for k, v in adopted.top_modules().items()
        if k not in ("__main__", "sitecustomize", "usercustomize")
    }
    max_uses, uses, me = int(opts["max-uses"]), 0, os.getpid()
    # can leave any cgroup a command puts it in: itself, or the pool moves it (the daemon is root)
    by_pool = opts["home-by-pool"] == "1"
    home = by_pool or homes.can_go_home(base.cgroup_home)
    channel.send(sock, {"t": "ready", "s": time.monotonic() - t0, "home": home, **_interpreter(init_env)})
    while True:
        try:
            msg, fds = channel.recv(sock, rx)
        except EOFError:
            return 0
        if msg["t"] != "run":
            continue
        uses += 1
        last = uses >= max_uses
        code, interrupted = _serve(msg["spec"], fds, sock, base, lc_ctype, last, tops)
        if last or os.getpid() != me:  # single use, or a forked child of the command finishing
            return _exit_like_python(code, interrupted)
        fresh.finish(code, stay=True)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        reason = fresh.leave(base, devnull, msg["spec"], go_home=not by_pool) or torchstate.restore(settings)
        gc.collect()  # the command's __main__ and what it held go now
        reason = reason or ctx.check()
        _send_quiet(
            sock,
            {
                "t": "exited",
                "code": -signal.SIGINT if interrupted else code,
                "retire": reason,
                "user_s": r0.ru_utime,
                "system_s": r0.ru_stime,
            },
        )
        if reason:  # retired: it goes at the pool's EOF (not in a region's timing: ctxpool/gate.py)
            return _until_eof(sock, rx)
        _send_quiet(sock, {"t": "ready", "s": 0.0, "home": home})


def _until_eof(sock: socket.socket, rx: channel.Receiver) -> int:
    """A retired worker waits for the pool to close its channel, then exits (0)."""
    try:
        while True:
            channel.recv(sock, rx)
    except (EOFError, OSError):
        return 0


def _interpreter(init_env: dict[str, str | None]) -> dict[str, Any]:
    """What an adopting interpreter must share with this worker (ctxpool/adoption.py compares)."""
    return {
        "hexversion": sys.hexversion,
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
        "flags": {n: int(getattr(sys.flags, n)) for n in type(sys.flags).__match_args__},
        "warnoptions": list(sys.warnoptions),
        "init_env": init_env,
    }


def _serve(
    spec: dict[str, Any],
    fds: list[int],
    sock: socket.socket,
    base: fresh.Baseline,
    lc_ctype: str | None,
    last: bool,
    tops: dict[str, str],
) -> tuple[int, bool]:
    form = forms.parse(spec["argv"])
    if spec.get("adopt") is not None and form is not None and len(fds) == 1:
        why, fds = _adopt(spec, form, fds[0], base, tops)
        if why is not None:  # nothing entered; but it is in the command's cgroup: leave the pool
            _send_quiet(sock, {"t": "declined", "reason": why})
            os._exit(0)
    if form is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return 1, False
    try:
        main_mod = fresh.enter(spec, form, fds, base, lc_ctype)
    except OSError as e:  # half entered: end like a failed exec, never serve again
        os.write(2, f"krex: cannot start {spec['argv'][0]!r}: {e}\n".encode(errors="replace"))
        os._exit(1)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    _send_quiet(
        sock, {"t": "started", "ts": time.monotonic(), "user_s": ru.ru_utime, "system_s": ru.ru_stime}
    )
    if last:
        sock.close()  # nothing more to say: the exit status is the process's
    return fresh.run(form, spec, main_mod)


def _adopt(
    spec: dict[str, Any], form: forms.Form, pidfd: int, base: fresh.Baseline, tops: dict[str, str]
) -> tuple[str | None, list[int]]:
    """The adopter's fds 0/1/2, or why this worker cannot run its program as a fresh start would."""
    cwd = spec["cwd"]
    path0 = cwd
    if form.kind == "script":  # as fresh.enter and _run_script put it first (a directory or zip: itself)
        target = os.path.realpath(os.path.join(cwd, form.target))
        path0 = target if os.path.isdir(target) or fresh.is_zip(target) else os.path.dirname(target)
    try:
        why = adopted.shadowed([path0, *spec["adopt"]["sys_path"]], base.path_rest, tops)
    except (OSError, ValueError, ImportError) as e:
        why = f"path check: {e}"
    if why is not None:
        os.close(pidfd)
        return why, []
    try:
        return None, adopted.take_stdio(pidfd)
    except OSError as e:
        return f"stdio: {e.strerror}", []


def _send_quiet(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        channel.send(sock, msg)
    except OSError:
        pass  # the pool is gone; the command still runs to its end


def _exit_like_python(code: int, interrupted: bool) -> int:
    if interrupted:  # python ends by SIGINT after an uncaught KeyboardInterrupt, once finalised
        fresh.finish(code)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code  # SystemExit(code) from here: threads joined, atexit run, stdio flushed by python


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
