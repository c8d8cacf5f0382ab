"""krex: region-granular GPU exclusivity for benchmarking kernels concurrently on shared GPUs."""

__version__ = "0.1.0"
