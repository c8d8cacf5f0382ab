"""Ctrl-C while `krex` starts: held pending, not raised, until the CLI knows what it means.

The CLI's imports take ~70 ms (asyncio, msgspec, the verbs' modules), and a KeyboardInterrupt raised
in any of them printed a traceback. So the package's `__init__`, first thing when the process is the
CLI (`krex`, `python -m krex_async`), blocks SIGINT: one that comes stays pending in the kernel,
neither raised in an import nor lost. `cli.main()` then asks (`came`) and ends quietly (130; 0 for
`krex serve`, as a later stop), or unblocks it for the verb (`release`), whose own handling applies
from then on; `krex serve`'s EarlyStop unblocks it into its own handler. It is released before
anything is spawned (a blocked signal is inherited across exec). A SIGINT that reaches the
interpreter before krex's first line (its own start: site, .pth files) is beyond this.
"""

from __future__ import annotations

import signal

import krex_async


def came() -> bool:
    """Whether a SIGINT is held pending."""
    return signal.SIGINT in signal.sigpending()


def release() -> None:
    """Unblock SIGINT if the CLI's start blocked it: a pending one is delivered now, to whatever
    handler is in place (Python's default raises KeyboardInterrupt at the next line)."""
    if krex_async._sigint_held:
        krex_async._sigint_held = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
