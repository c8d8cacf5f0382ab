"""Making a warm worker look, to the command it runs, like a fresh `python` process.

`enter(spec)` puts the command's world in place (fds 0/1/2, cwd, environment, session, signals, stdio
objects, sys.argv / sys.path / sys.executable, a new `__main__`); `run(form, spec)` runs `__main__` the
way python's main does and returns the exit code python would have exited with, having printed what
python would have printed (SystemExit message, uncaught exception through sys.excepthook with the same
frames). `Baseline` remembers the worker's own world, so a reused worker can be put back.

Imported by the worker: standard library only.
"""

from __future__ import annotations

import atexit
import builtins
import io
import linecache
import os
import runpy
import signal
import sys
import threading
import types
import warnings
from importlib.machinery import BuiltinImporter, SourceFileLoader
from typing import Any

from krex_async.ctxpool import homes
from krex_async.ctxpool.adopted import apply as apply_adopted
from krex_async.ctxpool.adopted import seen_parent
from krex_async.ctxpool.forms import Form, executable_for

_PYTHON_DEFAULTS: dict[int, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}

# Signals the worker was started with ignored (its daemon's, such as SIGHUP under nohup, or SIGINT
# too under `krex serve &` in a script): exec keeps them ignored for a plain command, so a pooled one
# gets them ignored too. SIGINT among them: Python installs its handler only over SIG_DFL. Not
# SIGPIPE or SIGXFSZ, which Python ignores itself at start. Read at import, before the worker
# installs any handler of its own.
_INHERITED_IGNORED = frozenset(
    s
    for s in signal.valid_signals()
    if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ)
    and signal.getsignal(s) == signal.SIG_IGN
)


class Baseline:
    """What the worker looked like once warm, taken before its first command."""

    def __init__(self, path_rest: list[str]) -> None:
        self.path_rest = list(path_rest)  # sys.path after entry 0, as a fresh interpreter builds it
        self.modules = set(sys.modules)
        self.main = sys.modules["__main__"]
        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.stdio = (sys.stdin, sys.stdout, sys.stderr)
        self.like = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
        self.sys_attrs = {
            k: getattr(sys, k)
            for k in (
                "argv",
                "executable",
                "orig_argv",
                "excepthook",
                "displayhook",
                "breakpointhook",
                "dont_write_bytecode",
                "pycache_prefix",
            )
        }
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.importer_cache = dict(sys.path_importer_cache)
        self.recursion_limit = sys.getrecursionlimit()
        self.warning_filters = list(warnings.filters)
        self.stdlib_ext = os.path.dirname(getattr(sys.modules.get("_json"), "__file__", "") or "")
        # site.py ran these at the worker's start; a fresh interpreter runs them with the command's env
        self.logging = _logging_state()
        # where a reused worker goes back to after a command: each hierarchy's cgroup.procs
        self.cgroups = homes.cgroups()
        self.cgroup_home: dict[str, str | None] = homes.cgroup_homes()
        self.customize: list[tuple[str, str]] = [
            (n, sys.modules[n].__file__ or "")
            for n in ("sitecustomize", "usercustomize")
            if getattr(sys.modules.get(n), "__file__", None)
        ]


def _logging_state() -> tuple[Any, ...] | None:
    """The logging configuration where logging is baseline (asyncio imports it), to put back."""
    logging = sys.modules.get("logging")
    if logging is None:
        return None
    root = logging.getLogger()
    return (
        list(root.handlers),
        root.level,
        set(logging.Logger.manager.loggerDict),
        logging.root.manager.disable,
    )


def _restore_logging(state: tuple[Any, ...] | None) -> None:
    logging = sys.modules.get("logging")
    if state is None or logging is None:
        return
    handlers, level, names, disable = state
    root = logging.getLogger()
    for h in root.handlers:
        if h not in handlers:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - a handler of the command's; it is gone either way
                pass
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.disable(disable)
    for name in set(logging.Logger.manager.loggerDict) - names:
        del logging.Logger.manager.loggerDict[name]


def _stdio(fd: int, name: str, like: Any, unbuffered: bool | None = None) -> io.TextIOWrapper:
    """A stdio stream as pylifecycle.c's create_stdio builds it, with the worker's encoding settings
    (and buffering, unless the adopting interpreter said: -u / PYTHONUNBUFFERED)."""
    write = fd != 0
    buffered = not (like.write_through if unbuffered is None else unbuffered)
    buffering = 0 if (write and not buffered) else -1
    buf: Any = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)
    raw = buf.raw if buffering else buf
    raw.name = name
    line = buffered and (raw.isatty() or fd == 2)
    stream = io.TextIOWrapper(
        buf,
        encoding=like.encoding,
        errors=like.errors,
        newline="\n",
        line_buffering=line,
        write_through=not buffered,
    )
    stream.mode = "w" if write else "r"  # type: ignore[misc]
    return stream


def enter(
    spec: dict[str, Any], form: Form, fds: list[int], base: Baseline, lc_ctype: str | None
) -> types.ModuleType:
    """Give this process the command's fds, cwd, env, session, signals and sys state.

    Closes the received fds after dup2. Raises OSError (chdir, cgroup write) with the state partly
    entered: the caller reports the error on the command's stderr and exits. An adopted interpreter
    (spec["adopt"], adopted.py) brings its own sys.path, executable, signals and settings.
    """
    adopt = spec.get("adopt")
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(spec["cwd"])
    env = dict(spec["env"])
    if lc_ctype is not None and adopt is None and not {"LC_ALL", "LC_CTYPE", "LANG"} & env.keys():
        env["LC_CTYPE"] = lc_ctype  # PEP 538 coercion, as a fresh interpreter does it with this env
    os.environ.clear()  # unsetenv/putenv: the C environ follows
    os.environ.update(env)
    if os.getsid(0) != os.getpid():
        os.setsid()
    if spec.get("cgroup_procs"):
        with open(spec["cgroup_procs"], "w") as f:
            f.write(str(os.getpid()))
    signal.set_wakeup_fd(-1)
    ignored = _INHERITED_IGNORED if adopt is None else frozenset(adopt.get("ignored", ()))
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(
                sig, signal.SIG_IGN if sig in ignored else _PYTHON_DEFAULTS.get(sig, signal.SIG_DFL)
            )
        except (OSError, ValueError):
            pass  # signals glibc reserves
    signal.pthread_sigmask(signal.SIG_SETMASK, [] if adopt is None else adopt.get("mask", []))
    unbuffered = None if adopt is None else bool(adopt.get("unbuffered"))
    sys.stdin, sys.stdout, sys.stderr = (
        _stdio(i, n, lk, unbuffered)
        for i, n, lk in zip((0, 1, 2), ("<stdin>", "<stdout>", "<stderr>"), base.like)
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore
    argv = spec["argv"]
    sys.orig_argv = list(spec.get("orig_argv") or argv)
    sys.executable = adopt["executable"] if adopt else executable_for(argv[0], env, spec["cwd"])
    if form.kind == "script":
        sys.argv = [form.target] + form.args
        path0 = os.path.dirname(os.path.realpath(os.path.join(spec["cwd"], form.target)))
    elif form.kind == "module":
        sys.argv = ["-m"] + form.args
        path0 = os.getcwd()
    else:
        sys.argv = ["-c"] + form.args
        path0 = ""
    sys.path[:] = base.path_rest if adopt is None else adopt["sys_path"]
    seen_parent(int(adopt.get("adopter", 0)) if adopt else 0)
    if adopt is not None:
        apply_adopted(adopt)
    for name, path in base.customize:
        _customize(name, path)
    sys.path.insert(0, path0)
    main = types.ModuleType("__main__")
    main.__dict__["__annotations__"] = {}
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


def _customize(name: str, path: str) -> None:
    """Run site's sitecustomize/usercustomize again, as site.py does, errors reported its way."""
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod
    try:
        with open(path, "rb") as f:
            exec(compile(f.read(), path, "exec"), mod.__dict__)
    except Exception as err:  # noqa: BLE001 - site.py reports and goes on
        sys.stderr.write(
            f"Error in {name}; set PYTHONVERBOSE for traceback:\n{err.__class__.__name__}: {err}\n"
        )


def run(form: Form, spec: dict[str, Any], main: types.ModuleType) -> tuple[int, bool]:
    """Run `__main__`; returns (exit code, ended by KeyboardInterrupt) as python's main would exit.

    Frames of the worker are cut from the traceback, so what sys.excepthook prints is what python
    prints: the script's frames for a script or -c, runpy's two frames and the module's for -m.
    """
    g = main.__dict__
    try:
        if form.kind == "module":
            runpy._run_module_as_main(form.target, alter_argv=True)  # type: ignore[attr-defined]
        elif form.kind == "code":
            g["__loader__"] = BuiltinImporter
            exec(compile(form.target, "<string>", "exec"), g)
        else:
            _run_script(form.target, spec, g)
    except SystemExit as e:
        return _system_exit(e), False
    except BaseException as e:  # noqa: BLE001 - whatever python's main would print
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # this module's frames: not part of a fresh process's traceback
        _print_uncaught(type(e), e.with_traceback(tb), tb)
        return 1, isinstance(e, KeyboardInterrupt)
    return 0, False


def _run_script(target: str, spec: dict[str, Any], g: dict[str, Any]) -> None:
    path = os.path.normpath(os.path.join(spec["cwd"], target))
    if os.path.isdir(path) or is_zip(path):
        sys.path[0] = path  # python runs the directory's (or archive's) __main__ module
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        sys.stderr.write(f"{spec['argv'][0]}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}\n")
        raise SystemExit(2) from None
    g["__file__"] = path
    g["__cached__"] = None
    g["__loader__"] = SourceFileLoader("__main__", path)
    exec(compile(source, path, "exec"), g)


def is_zip(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _system_exit(e: SystemExit) -> int:
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:  # noqa: BLE001 - python ignores a failing stderr here too
        pass
    return 1


def _print_uncaught(tp: type[BaseException], e: BaseException, tb: Any) -> None:
    sys.last_type, sys.last_value, sys.last_traceback = tp, e, tb  # as PyErr_Print sets them
    if sys.version_info >= (3, 12):
        sys.last_exc = e  # type: ignore[attr-defined]
    try:
        sys.excepthook(tp, e, tb)
    except BaseException as hook_error:  # noqa: BLE001 - as PyErr_Print reports it
        sys.stderr.write("Error in sys.excepthook:\n")
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(tp, e, tb)


# True while a worker that stays (it serves another command next) runs a program's exit handlers:
# the krex runtime's exit hook then need not wait out a region that holds it (runtime/quiesce.py:
# nothing is torn down, its context stays)
staying = False


def finish(code: int, stay: bool = False) -> None:
    """Interpreter exit without exiting: join non-daemon threads, run atexit handlers, flush stdio.
    `stay`: the worker serves again afterwards (its context is not torn down)."""
    global staying
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    staying = stay
    try:
        atexit._run_exitfuncs()
    finally:
        staying = False
    atexit._clear()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001 - python would exit 120; the command is over either way
            pass


def leave(base: Baseline, devnull: int, spec: dict[str, Any], go_home: bool = True) -> str | None:
    """Put a reused worker back to its baseline; returns why it must retire instead, or None.
    `go_home` False: the pool moves it back to its own cgroups once it reports the command's end
    (a worker of an unprivileged user cannot leave a cgroup the root daemon put it in)."""
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # the command's pipes see EOF once its own children are done
    sys.stdin, sys.stdout, sys.stderr = base.stdio
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = base.like  # type: ignore[misc]
    os.environ.clear()
    os.environ.update(base.env)
    os.chdir(base.cwd)
    os.umask(base.umask)
    for k, v in base.sys_attrs.items():
        setattr(sys, k, v)
    sys.path[:] = base.path_rest
    sys.meta_path[:] = base.meta_path
    sys.path_hooks[:] = base.path_hooks
    sys.path_importer_cache.clear()
    sys.path_importer_cache.update(base.importer_cache)
    sys.setrecursionlimit(base.recursion_limit)
    warnings.filters[:] = base.warning_filters  # type: ignore[index]
    getattr(warnings, "_filters_mutated", lambda: None)()  # drops the per-module "once" caches
    linecache.clearcache()
    for k in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, k):
            delattr(sys, k)  # they hold the command's frames, and with them its device memory
    sys.modules["__main__"] = base.main
    _reset_region_client()
    _restore_logging(base.logging)
    sys.settrace(None)
    sys.setprofile(None)
    threading.settrace(None)  # type: ignore[arg-type]
    threading.setprofile(None)  # type: ignore[arg-type]
    reason = (homes.go_home(base.cgroups, base.cgroup_home) if go_home else None) or _drop_modules(base)
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        reason = reason or f"threads left running: {', '.join(alive)}"
    return reason


def _reset_region_client() -> None:
    """krex_async.client.region is baseline (the worker imports krex_async): drop the command's
    connection, and the kernel devicework keeps for the idle check."""
    mod = sys.modules.get("krex_async.client.region")
    if mod is not None:
        mod.reset()
    work = sys.modules.get("krex_async.runtime.devicework")
    if work is not None:  # the idle check's kept kernel holds device memory
        work.forget_probe()


def _drop_modules(base: Baseline) -> str | None:
    new = [name for name in sys.modules if name not in base.modules]
    ext = [n for n in new if _foreign_extension(sys.modules[n], base)]
    for name in new:
        mod = sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent and parent in sys.modules and getattr(sys.modules[parent], child, None) is mod:
            try:
                delattr(sys.modules[parent], child)
            except AttributeError:
                pass
    if ext:
        return f"extension modules cannot be unloaded: {', '.join(sorted(ext)[:5])}"
    return None


def _foreign_extension(mod: Any, base: Baseline) -> bool:
    f = getattr(mod, "__file__", None) or ""
    return f.endswith(".so") and os.path.dirname(f) != base.stdlib_ext
