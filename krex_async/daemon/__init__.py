"""The daemon: `krex serve`'s state and its answers to requests, in layers (docs/architecture.md).

On top, the wire: server.py wires a daemon from its config (backend, probes: probing.py, pools,
socket: listener.py, start-up checks: startchecks.py) and serves its connections (connection.py:
framing, dispatch); daemon.py is the `Daemon`, which puts the parts together and hands each request
to the part that answers it. Below it, each folder one concern: observe/ (metrics, trace,
attribution, timeline, status: subscribers to the model's events), commands/ (a command's life:
access, placement, memory admission, launch, end, report, recovery), regions/ (the region engine),
model/ (the `Core` the parts share, `Command`, `Region` and its `HoldSet`, the events and their
bus), persist/ (records and spool files); config.py holds the serve options.
"""
