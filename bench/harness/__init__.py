"""The one harness every benchmark uses (each module small, imported on its own so a child program
pulls in only what it needs):

- stats.py: quantiles (the one implementation, with the rank rules the results were recorded with);
  standard library only, so it is also uploaded beside the gateway job script.
- stack.py: a `krex serve` (and a `krex gateway` over it) in a temporary state directory, started,
  waited for and torn down on every path; the environment and argv of child processes.
- output.py: JSON results with the machine, date and command recorded, read back whether gzipped or
  not; fixed-width tables; matplotlib when importable.
"""
