"""The daemon: `krex serve`'s state and its answers to requests.

server.py wires a daemon from its config (backend, probes: probing.py, pools, socket: listener.py)
and serves its connections (connection.py: framing, dispatch); daemon.py is the `Daemon`, which
puts the parts together and hands each request to the part that answers it; core.py is the narrow
`Core` state the parts take instead of the daemon: lifecycle.py (a command from submit to forget),
warmpools.py (commands served by the warm pools), regions.py (queueing, isolation, drain; its
steps in entry.py, joins.py, exits.py), hold.py (siblings held off the GPU), attribution.py
(strays), recovery.py (after a crash) and status.py. access.py says who may ask and see what,
placement.py which device a command gets. commands.py, runner.py (spawning, watching),
report.py, records.py, spool.py, stdinpipe.py keep commands, their reports and their output;
tracing.py (with timeline.py) and metrics.py are the trace and metrics sinks.
"""
