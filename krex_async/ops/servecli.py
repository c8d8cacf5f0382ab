"""`krex serve`: its options on the command line (one flag per ServeConfig field, each help naming
the KREX_* variable that also sets it), merged with krex.toml and the environment (daemon/config.py),
checked for this node (startchecks.check_here), then the daemon (daemon/server.py).

Exit status: 2 for an option that is invalid, or valid but unusable here (naming the flag, variable
or file it came from); otherwise the daemon's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import msgspec

from krex_async.daemon.config import ServeConfig, choices
from krex_async.protocol import default_socket


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    fields = {f.name: f for f in msgspec.structs.fields(ServeConfig)}
    p.add_argument("--socket", help=f"socket path (default: {default_socket()})")
    p.add_argument("--socket-group", help="group that may connect besides the owner")
    p.add_argument(
        "--policy",
        help="what a region means: region (exclusive, default), command (a command "
        "holds its device start to end), shared (nothing protected)",
    )
    p.add_argument(
        "--isolation",
        help="how commands are frozen and fenced: auto (default: cgroup where a cgroup "
        "tree is writable, else signal), cgroup, signal (SIGSTOP, affinity)",
    )
    p.add_argument("--cgroup-root", help="a delegated cgroup v2 directory for command cgroups")
    p.add_argument("--devices", help="auto, none, cpu:N (N logical cpu devices), nvidia, amd")
    p.add_argument(
        "--freeze",
        help="who a region holds: every sibling on the device, those holding a GPU "
        "device file (the others run on, fenced, and are held when they open one), "
        "or auto (default): device-holders where the hold locks and the probes "
        "run, all otherwise",
    )
    p.add_argument(
        "--hold",
        help="how a held sibling is held: lock (its CUDA processes through the NVIDIA "
        "driver's process lock: its other threads run on; frozen where a lock "
        "cannot serve), freeze (the cgroup freezer), auto (default): lock where "
        "the driver offers it",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        help="seconds one driver lock may take before the region waits for that sibling "
        "(default 0.005; a lock takes 0.4-2.1 ms)",
    )
    p.add_argument(
        "--lock-wait",
        type=float,
        help="seconds a region waits, before its grant, for a sibling inside a CUDA call to "
        "leave it and be locked; still inside: it is frozen (default 0.05)",
    )
    p.add_argument(
        "--exit-wait",
        type=float,
        help="seconds a region waits, before its grant, for a sibling's exit to end; one still in "
        "user space after that (Python's finalisation, the CUDA library's teardown) is frozen until "
        "the region ends, one in the kernel's exit up to --exit-kernel-wait at least (default 0: freeze "
        "at once; -1: as long as --lock-wait)",
    )
    p.add_argument(
        "--exit-kernel-wait",
        type=float,
        help="seconds a region waits at most for a sibling already in the kernel's exit (freeing its GPU "
        "memory, which the freezer cannot stop) or a starved one (--exit-starve) (default 0.5)",
    )
    p.add_argument(
        "--exit-starve",
        type=float,
        help="seconds after its start an exit still in user space stops being frozen at once: the "
        "next region waits for it as for one in the kernel (default 2; back-to-back regions "
        "otherwise leave it only the gaps between them)",
    )
    p.add_argument(
        "--quiesce",
        help="whose runtime a region asks to stop and synchronise before freezing: "
        "auto (default) those holding a GPU device file, none on the cpu device; "
        "all: every runtime",
    )
    p.add_argument(
        "--hold-share",
        type=float,
        help="the most of any --share-window that other commands' regions may hold a command; "
        "one held that long runs before the next region that would hold it starts (queued, not "
        "refused) (default 0.5; 0 or 1: off)",
    )
    p.add_argument(
        "--share-window",
        type=float,
        help="seconds of the sliding window --hold-share is measured over (default 10)",
    )
    for name in (
        "region_timeout",
        "quiesce_timeout",
        "drain_timeout",
        "drain_window",
        "freeze_timeout",
        "kill_grace",
        "retention",
        "read_timeout",
    ):
        p.add_argument(
            "--" + name.replace("_", "-"), type=float, help=f"seconds (default {fields[name].default})"
        )
    p.add_argument(
        "--warm-ms",
        type=float,
        help="ms a region's owner warms its GPU before its timed loop (default: none "
        "when the clock has settled, 20 when it idles low, 200 where the clock "
        "cannot be read; 0 on cpu)",
    )
    p.add_argument(
        "--settle-fraction",
        type=float,
        help="a GPU clock counts as settled at this fraction of its applications clock "
        "(default 0.97: cleaner 1 ms timings than 0.9 for ~40 ms more per settle)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        help="at most this long before a grant, wait for a GPU clock held down by the "
        "power cap (after a heavy neighbour) to recover (default 300; 0: off)",
    )
    p.add_argument(
        "--region-cores",
        type=int,
        help="cores reserved for a region's owner (default 1 on a 2-core machine, else 2)",
    )
    p.add_argument("--max-frame", type=int, help="largest accepted frame in bytes")
    p.add_argument(
        "--max-inbound-bytes",
        type=int,
        help="bytes of frame bodies read at once over all connections; a frame beyond "
        "waits for room within --read-timeout (default 256 MiB)",
    )
    p.add_argument(
        "--max-buffered-total",
        type=int,
        help="unsent bytes over all connections after which the peer adding to them "
        "is dropped (default 512 MiB)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open connections beyond which new ones are refused (default 4096)",
    )
    p.add_argument(
        "--max-commands",
        type=int,
        help="commands queued, running or with a kept result beyond which a submit "
        "is refused with 'busy' (default 4096)",
    )
    p.add_argument(
        "--max-connections-per-user",
        type=int,
        help="open connections of one user beyond which their new ones are refused; "
        "root and --admin-group are exempt (default 1024)",
    )
    p.add_argument(
        "--max-commands-per-user",
        type=int,
        help="commands of one user queued, running or with a kept result beyond which "
        "their submit is refused with 'busy'; root and --admin-group are exempt "
        "(default 1024)",
    )
    p.add_argument("--max-conn-buffer", type=int, help="unsent bytes after which a slow client is dropped")
    p.add_argument("--output-tail", type=int, help="bytes of each output stream kept per command")
    p.add_argument(
        "--spool-limit",
        type=int,
        help="bytes of each output stream written to <state-dir>/spool (default 64 MiB; 0: off)",
    )
    p.add_argument("--admin-group", help="group whose members may act on every command")
    p.add_argument(
        "--run-as-peers",
        metavar="USERS",
        help="comma-separated users who may run commands as other users (run_as) without being root, "
        "never as root nor a system user (uid < 1000): a fleet node's Ray user",
    )
    p.add_argument(
        "--state-dir",
        help="intent records, spooled output and recovery state "
        "(default /var/lib/krex as root, which the unit's StateDirectory= keeps across "
        "restarts; else krex-state beside the socket)",
    )
    p.add_argument(
        "--log-format",
        help="auto (default): console at a terminal, JSON lines otherwise",
    )
    p.add_argument(
        "--log-level",
        help="default info: one line per command and per region",
    )
    p.add_argument(
        "--probes",
        help="GPU driver probes (default auto: bcc, else tracefs, else none)",
    )
    p.add_argument(
        "--probe-prefixes",
        help="comma-separated device path prefixes to watch (default /dev/nvidia,/dev/kfd,/dev/dri/renderD)",
    )
    p.add_argument(
        "--launch-libs",
        help="comma-separated libraries (files or glob patterns) for the launch uprobes: "
        "--probes launches, or auto where bcc runs (its fallbacks take none)",
    )
    p.add_argument(
        "--launch-scope",
        help="processes the launch uprobes trap (each trapped launch costs ~0.7 us): "
        "outsiders (default) only processes outside krex's commands, attached "
        "per process; all: every process, commands included",
    )
    p.add_argument("--pool-size", type=int, help="warm context workers per device (default 0: off)")
    p.add_argument("--pool-max-uses", type=int, help="commands a worker runs before it is replaced")
    p.add_argument(
        "--pool-keep-s",
        type=float,
        help="seconds a surplus warm worker is kept after demand falls (default 30; 0: retire at once)",
    )
    p.add_argument("--pool-preload", help="comma-separated modules workers import, e.g. torch")
    p.add_argument(
        "--pool-wait",
        type=float,
        help="seconds an interpreter waits for a warming worker before it runs without the pool (default 10)",
    )
    p.add_argument(
        "--pool-user",
        help="user (name or uid) the warm workers run as, whose commands "
        "they serve (default: the daemon's; e.g. the gateway's --run-as)",
    )
    p.add_argument(
        "--pool-init",
        help="comma-separated modules a worker imports once its context "
        "exists, as part of creating it (one at a time per node, "
        "never while a region holds the device), e.g. to warm cuBLAS",
    )
    p.add_argument(
        "--admission",
        help="memory-aware admission: a command starts only when it fits beside what runs on its "
        "device; auto (default): on GPUs, memory: every device, off",
    )
    p.add_argument(
        "--mem-default",
        type=int,
        metavar="BYTES",
        help="device memory a command of unknown footprint reserves (default 0: one such command at "
        "a time per device, until its footprint is learned)",
    )
    p.add_argument(
        "--mem-headroom",
        type=float,
        metavar="FRACTION",
        help="fraction of each device's memory admission keeps free (default 0.05)",
    )
    p.add_argument(
        "--mem-commit",
        help="what a device is taken to hold: now (its use and the needs of new commands), peak "
        "(each command's need or peak), none (first runs start, a co-located OOM is re-run), auto "
        "(default: none where a re-run is allowed, else now)",
    )
    p.add_argument(
        "--mem-guard",
        help="how a re-run after a co-located OOM keeps its room: peak (default: every command "
        "counted at its need or peak), want (the usual count plus what the re-run has still to take)",
    )
    p.add_argument(
        "--mem-backfill",
        type=float,
        metavar="SECONDS",
        help="how long a waiting command that does not fit lets later ones that fit start past it; "
        "then its device drains for it (default 10; 0: strict first in, first out)",
    )
    p.add_argument(
        "--mem-gate",
        help="on (default): a torch command starts at once and waits for memory admission only as "
        "it first initialises CUDA, so its imports overlap others' device work; off: at its start",
    )
    p.add_argument(
        "--region-backlog",
        type=int,
        metavar="N",
        help="with memory admission under policy region: a new command waits while N regions "
        "already queue on its device (default 0: off)",
    )
    p.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)")
    p.add_argument("--config", help="TOML file of options (default /etc/krex/krex.toml, if present)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged options (file < KREX_* env < flags) as TOML and exit",
    )
    _from_config(p)
    _group(p)


# `krex serve --help` in sections (an option not listed here stays under "options").
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (
        "where and who",
        (
            "config",
            "print_config",
            "socket",
            "socket_group",
            "admin_group",
            "run_as_peers",
            "state_dir",
        ),
    ),
    (
        "policy and isolation",
        ("policy", "isolation", "cgroup_root", "devices", "freeze", "hold", "quiesce", "region_cores"),
    ),
    (
        "region timing (seconds unless named)",
        (
            "lock_timeout",
            "lock_wait",
            "exit_wait",
            "exit_starve",
            "exit_kernel_wait",
            "region_timeout",
            "quiesce_timeout",
            "drain_timeout",
            "drain_window",
            "freeze_timeout",
            "kill_grace",
            "warm_ms",
            "settle_fraction",
            "settle_ms",
        ),
    ),
    (
        "sharing a device (memory admission, a held command's share)",
        (
            "admission",
            "mem_headroom",
            "mem_default",
            "mem_commit",
            "mem_guard",
            "mem_backfill",
            "mem_gate",
            "region_backlog",
            "hold_share",
            "share_window",
        ),
    ),
    ("probes", ("probes", "probe_prefixes", "launch_libs", "launch_scope")),
    (
        "warm pools",
        ("pool_size", "pool_max_uses", "pool_keep_s", "pool_preload", "pool_wait", "pool_user", "pool_init"),
    ),
    (
        "limits",
        (
            "retention",
            "read_timeout",
            "max_frame",
            "max_inbound_bytes",
            "max_buffered_total",
            "max_connections",
            "max_commands",
            "max_connections_per_user",
            "max_commands_per_user",
            "max_conn_buffer",
            "output_tail",
            "spool_limit",
        ),
    ),
    ("logs and metrics", ("log_format", "log_level", "metrics")),
]


def _group(p: argparse.ArgumentParser) -> None:
    """Move serve's options into the GROUPS sections of its help (parsing is unchanged: a group
    only decides where --help lists an option)."""
    actions = {a.dest: a for a in p._optionals._group_actions}
    for title, dests in GROUPS:
        group = p.add_argument_group(title)
        for dest in dests:
            if (a := actions.pop(dest, None)) is not None:
                p._optionals._group_actions.remove(a)
                group._group_actions.append(a)


def main(args: argparse.Namespace) -> int:
    from krex_async.daemon.commands.earlystop import EarlyStop

    # a stop signal from here on ends the start cleanly (the imports below take a while)
    early = None if args.print_config else EarlyStop().install()
    from krex_async.daemon import server
    from krex_async.daemon.config import ConfigError, load_config_with_sources, print_config
    from krex_async.daemon.startchecks import check_here

    given = {k: v for k, v in vars(args).items() if v is not None and k in ServeConfig.__struct_fields__}
    try:
        cfg, sources = load_config_with_sources(args.config, os.environ, given)
        notes = [] if args.print_config else check_here(cfg, sources)
    except ConfigError as e:
        print(f"krex serve: {e}", file=sys.stderr)
        return 2
    for note in notes:  # valid options that do nothing here
        print(f"krex serve: warning: {note}", file=sys.stderr)
    if args.print_config:
        print(print_config(cfg.resolved(), sources), end="")
        return 0
    return server.run(cfg, early)


def _from_config(p: argparse.ArgumentParser) -> None:
    """Give each serve option what ServeConfig already says of its field: an enum or Literal field's
    values as the flag's choices (spelled once, in config.py), and in its help the KREX_* variable
    that also sets it."""
    fields = set(ServeConfig.__struct_fields__)
    for a in p._actions:
        if a.dest not in fields:
            continue
        if values := choices(a.dest):
            a.choices = values
        if a.help is not argparse.SUPPRESS:
            env = f"KREX_{a.dest.upper()}"
            a.help = f"{a.help}; env {env}" if a.help else f"env {env}"
