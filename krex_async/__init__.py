"""krex: region-granular GPU exclusivity for benchmarking kernels concurrently on shared GPUs.

Inside a command: `with region("timing"):` holds the command's device exclusively for the block.
Agents: `Client` submits commands to the daemon and streams their output and reports.

Names are imported on first use, so `import krex_async` (which every pool worker and every command's
in-process runtime does) costs neither asyncio nor the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    from krex_async.client.region import RegionError, region
    from krex_async.client.submit import Client, CommandHandle, KrexError, Result


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'krex_async' has no attribute {name!r}")
