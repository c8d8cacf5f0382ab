"""krex: region-granular GPU exclusivity for benchmarking kernels concurrently on shared GPUs.

Inside a command: `with region("timing"):` holds the command's device exclusively for the block.
Agents: `Client` submits commands to the daemon and streams their output and reports.
"""

from .client import Client, CommandHandle, KrexError, Result
from .region import RegionError, region

__version__ = "0.1.0"
__all__ = ["Client", "CommandHandle", "KrexError", "RegionError", "Result", "region", "__version__"]
