"""krex: region-granular GPU exclusivity for benchmarking kernels concurrently on shared GPUs.

Inside a command: `with region("timing"):` holds the command's device exclusively for the block.
Agents: `Client` submits commands to the daemon and streams their output and reports.

Names are imported on first use, so `import krex_async` (which every pool worker and every command's
in-process runtime does) costs neither asyncio nor the client.
"""

import sys


def _cli_starting() -> bool:
    """Whether this process is the `krex` CLI starting (the console script, or -m krex_async)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.rpartition("/")[2] == "krex":
        return True
    # "-m" while the module named after -m is found (a package importing us on the way included)
    return argv0 == "-m" and _module_run() == "krex_async"


def _module_run() -> str:
    """The MODULE of `python [options] -m MODULE` in orig_argv, "" if none. Short options group
    (`-Im`, `-um`, `-BW error -m`); -c, -m, -W and -X take the rest of their word or the next."""
    words = iter(sys.orig_argv[1:])
    for w in words:
        if w[:1] != "-" or w == "-":  # the script: no -m
            return ""
        if w.startswith("--"):
            if w == "--check-hash-based-pycs":
                next(words, "")
            continue
        for j, c in enumerate(w[1:], 2):
            if c in "cmWX":
                arg = w[j:] or next(words, "")
                if c in "cm":
                    return arg if c == "m" else ""
                break
    return ""


# First thing, before any import: the CLI holds SIGINT pending while its modules import, so that a
# Ctrl-C there raises in none of them (linux/interrupt.py says what becomes of it). The builtin
# _signal is loaded at interpreter start; `signal` and typing would cost the window they close.
_sigint_held = False
if _cli_starting():
    import _signal

    _sigint_held = _signal.SIGINT not in _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})

import importlib  # noqa: E402

TYPE_CHECKING = False  # typing's costs ~2 ms of the CLI's start (see above)

__version__ = "0.1.0"
__all__ = ["Client", "CommandHandle", "KrexError", "RegionError", "Result", "region", "__version__"]

_WHERE = {
    "Client": "client.submit",
    "CommandHandle": "client.submit",
    "KrexError": "client.submit",
    "Result": "client.submit",
    "RegionError": "client.region",
    "region": "client.region",
}

if TYPE_CHECKING:
    from typing import Any

    from krex_async.client.region import RegionError, region
    from krex_async.client.submit import Client, CommandHandle, KrexError, Result


def __getattr__(name: str) -> "Any":
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'krex_async' has no attribute {name!r}")
