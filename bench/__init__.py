"""krex's benchmarks, run from the repository root as `python -m bench.NAME` (bench/README.md).

harness/ is what they share (daemon and gateway stacks, child processes, quantiles, JSON, tables,
plots); workload/ holds the child programs they run; gpu/ the accelerator's checks; results/ the
gzipped raw files bench/RESULTS.md cites.
"""
