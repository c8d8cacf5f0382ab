"""krex's in-command runtime, started by the interpreter of every Python command krex runs.

The daemon puts krex_async/runtime/ first on PYTHONPATH, so this module is the `sitecustomize`
that `site` imports at start-up. It
  0. first, where the daemon set KREX_POOL (the command's device has a warm pool for this user),
     asks for a pool worker to run this process's program (adopt.py): once adopted, the process
     only waits and exits with the worker's status. Without KREX_POOL this costs one environment
     lookup; the reason a process was not adopted rides on its quiesce_ready;
  1. chains the next sitecustomize on sys.path (a site or venv customisation keeps working);
  2. inside a command (KREX_SOCKET, KREX_COMMAND and KREX_TOKEN set), installs a handler for a
     spare real-time signal (KREX_QUIESCE_SIGNAL, default SIGRTMAX-6) and starts the quiesce
     listener (quiesce.py) on a background thread; it re-arms in children after os.fork();
  3. with KREX_AUTO_REGION=1, installs the auto-region import hook (autoregion.py);
  4. with KREX_CUDA_GATE=1 (the daemon's --mem-gate), wraps torch's CUDA start so that it first
     waits for the daemon's memory admission (cudagate.py).

The main thread pays only for this file (builtin modules, no socket or ctypes import): the listener
thread loads quiesce.py and connects. Any failure here is swallowed: an unreachable daemon, a
signal already taken by the program, or a broken runtime never prints into, or stops, the user's
program. Errors of the chained sitecustomize propagate exactly as they would without krex.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the next sitecustomize found on sys.path after this one, as `site` would have."""
    entries = []
    seen_self = False
    for entry in sys.path:
        try:
            same = os.path.abspath(entry or os.curdir) == _HERE
        except (TypeError, ValueError):
            continue
        if same:
            seen_self = True
        elif seen_self:
            entries.append(entry)
    if not entries:
        return
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", entries)
    if spec is None or spec.loader is None:
        return
    module = type(sys)("sitecustomize")
    module.__spec__ = spec
    module.__file__ = spec.origin
    module.__loader__ = spec.loader
    if spec.submodule_search_locations is not None:
        module.__path__ = list(spec.submodule_search_locations)
    spec.loader.exec_module(module)  # type: ignore[attr-defined]
    # Leave our module as sys.modules["sitecustomize"], but expose the chained one's names there.
    this = sys.modules.get(__name__)
    if this is not None:
        for name, value in vars(module).items():
            if not name.startswith("__") and not hasattr(this, name):
                setattr(this, name, value)


def _load(name: str, filename: str):  # type: ignore[no-untyped-def]
    """Load a runtime module by path under a private name (a user's `quiesce.py` cannot shadow it)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    from importlib.machinery import ModuleSpec, SourceFileLoader

    path = os.path.join(_HERE, filename)
    loader = SourceFileLoader(name, path)
    module = type(sys)(name)
    module.__spec__ = ModuleSpec(name, loader, origin=path)
    module.__file__ = path
    module.__loader__ = loader
    loader.exec_module(module)
    # Registered only once complete: a child forked while another thread was still loading it
    # (that thread does not exist in the child) loads its own copy instead of a half-run module.
    return sys.modules.setdefault(name, module)


_armed = False
_declined = ""  # why this interpreter was not adopted (reported by the quiesce listener)


def _adopt() -> None:
    global _declined
    pool = os.environ.get("KREX_POOL")
    # A worker re-runs this file for each command it serves: it is the adopter then, never adopted.
    if not pool or "krex_async.ctxpool.fresh" in sys.modules:
        return
    _declined = _load("_krex_adopt", "adopt.py").run(pool, _load)


def arm() -> bool:
    """Start the quiesce listener for the command named in the environment (from the main thread).

    Called at interpreter start; a ctxpool worker that learns its command later sets KREX_SOCKET,
    KREX_COMMAND and KREX_TOKEN in os.environ and calls `sitecustomize.arm()` itself. Idempotent;
    returns whether a listener was started (now or before). Never raises.
    """
    global _armed
    if _armed:
        return True
    try:
        _armed = _start()
    except BaseException:  # noqa: BLE001
        _armed = False
    return _armed


def _start() -> bool:
    env = os.environ
    if not (env.get("KREX_SOCKET") and env.get("KREX_COMMAND") and env.get("KREX_TOKEN")):
        return False
    import _signal
    import _thread

    try:
        signum = int(env.get("KREX_QUIESCE_SIGNAL") or _signal.SIGRTMAX - 6)
    except ValueError:
        return False
    if _signal.getsignal(signum) not in (_signal.SIG_DFL, None):
        return False  # taken by someone: stay out of the way (the daemon's timeout path covers us)
    box: dict = {"declined": _declined}

    def on_signal(signum: int, frame: object) -> None:
        q = box.get("q")
        if q is not None:
            q.on_signal()

    _signal.signal(signum, on_signal)
    main = _thread.get_ident()

    def at_exit() -> None:
        # However early the program ends (a short one ends before the listener has even loaded):
        # no listener may connect from now on, the one running is stopped, and the thread is
        # waited for (bounded), so it never wakes while the interpreter is torn down.
        box["exiting"] = True
        q = box.get("q")
        if q is not None:
            q.stop()
        if box["done"].acquire(True, 0.5):
            sentinel = box.get("sentinel")  # released once the thread's state is gone
            if sentinel is not None:
                sentinel.acquire(True, 0.1)

    def boot() -> None:
        done = box["done"]
        set_sentinel = getattr(_thread, "_set_sentinel", None)  # CPython up to 3.12
        box["sentinel"] = set_sentinel() if set_sentinel is not None else None
        try:
            if box.get("exiting"):
                return
            q = box["q"] = _load("_krex_quiesce", "quiesce.py")
            if box.get("exiting"):  # at_exit ran while it loaded: it found no listener to stop
                return
            q.run(
                env.get("KREX_SOCKET", ""),
                env.get("KREX_COMMAND", ""),
                env.get("KREX_TOKEN", ""),
                main,
                signum,
                declined=box.pop("declined", ""),
            )
        except BaseException:  # noqa: BLE001 - never disturb the user's program
            pass
        finally:
            done.release()

    # The listener thread takes no signal a process is sent: the kernel gives one to any thread
    # that does not block it, and one given to this thread (the program's main thread blocking
    # it to sigwait, or busy) ends the process (SIG_DFL) or never interrupts the main thread's
    # sleep. As in a fresh process, the program's own threads alone receive them. Faults stay.
    quiet = _signal.valid_signals() - {
        _signal.SIGKILL,
        _signal.SIGSTOP,
        _signal.SIGSEGV,
        _signal.SIGBUS,
        _signal.SIGFPE,
        _signal.SIGILL,
        _signal.SIGTRAP,
        _signal.SIGSYS,
    }

    def start_boot() -> None:
        done = box["done"] = _thread.allocate_lock()
        done.acquire()
        mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, quiet)  # the thread starts with it
        try:
            _thread.start_new_thread(boot, ())
        except BaseException:  # no thread (RLIMIT_NPROC): nothing for at_exit to wait for
            done.release()
            raise
        finally:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)

    def after_fork_in_child() -> None:
        try:
            box.pop("declined", None)  # the parent reported it: a fork is no new interpreter
            q = box.get("q")
            if q is not None:
                q.forget_parent_connection()
            nonlocal main
            main = _thread.get_ident()
            start_boot()
        except BaseException:  # noqa: BLE001
            pass

    os.register_at_fork(after_in_child=after_fork_in_child)
    import atexit  # built in: nothing to load

    atexit.register(at_exit)
    start_boot()
    return True


def _cuda_gate() -> None:
    if os.environ.get("KREX_CUDA_GATE") == "1" and os.environ.get("KREX_COMMAND"):
        _load("_krex_cudagate", "cudagate.py").install(_load)


def _auto_regions() -> None:
    if os.environ.get("KREX_AUTO_REGION") == "1":
        _load("_krex_autoregion", "autoregion.py").install()


try:
    _adopt()
except BaseException:  # noqa: BLE001 - an adoption that fails runs the program here, as before
    pass
try:
    _auto_regions()
except BaseException:  # noqa: BLE001
    pass
try:
    _cuda_gate()
except BaseException:  # noqa: BLE001
    pass
arm()
_chain()
