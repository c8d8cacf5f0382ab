"""The pool interface the daemon uses: run a Python command in a warm worker, or decline it.

pool = Pool(device, config)        # one per device
await pool.start()                 # begins warming toward config.size, one context at a time
launched = await pool.launch(spec) # a Launched (krex_async.linux.spawn) or None when it cannot take it
pool.pause() / pool.resume()       # no context creation while a region is held on the device
pool.status()                      # sizes and counts for `krex status`
await pool.close()
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

# Workers start here (`-m` puts it first on their sys.path): the directory krex_async is found in.
WORKER_CWD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_MODULE = "krex_async.ctxpool.worker"  # what a worker runs (`python -m`)


@dataclass
class PoolConfig:
    size: int = 0  # warm workers per device; 0 disables the pool
    max_uses: int = 1
    keep_s: float = 30.0  # seconds a worker one too many is kept after the demand falls (0: none)
    preload: list[str] = field(default_factory=list)  # modules every worker imports, e.g. ["torch"]
    python: str = ""  # the interpreter whose commands the pool accepts (default: sys.executable)
    init_context: bool = True  # create the device context (torch.cuda.init / cuInit) when warming
    # imported after the context, as part of creating it (holding the node lock), on any device
    init_modules: list[str] = field(default_factory=list)

    def interpreter(self) -> str:
        """The Python the workers run: `python`, else the daemon's own."""
        return self.python or sys.executable

    def creates_context(self, vendor: str) -> bool:
        """Whether warming has a step that holds the node lock on a device of `vendor`."""
        return bool(self.init_context and vendor != "cpu" or self.init_modules)
