"""The daemon: `krex serve`'s state and its answers to requests.

server.py wires a daemon from its config (backend, probes, pools, socket); daemon.py is the `Daemon`
(command life, requests, status); core.py is the narrow `Core` state that regions.py (queueing,
isolation, drain), hold.py (siblings held off the GPU), attribution.py (strays) and recovery.py
(after a crash) take instead of the daemon. commands.py, records.py, spool.py, stdinpipe.py keep
commands, their reports and their output; timeline.py and metrics.py are the trace and metrics sinks.
"""
