"""The daemon's options, one Struct, shared by the command line and the config file (configfile.py)."""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

from .scheduler import Policy

Positive = Annotated[float, msgspec.Meta(gt=0)]


def default_socket() -> str:
    """$KREX_SOCKET, else /run/krex/krex.sock as root, else $XDG_RUNTIME_DIR/krex.sock."""
    if os.environ.get("KREX_SOCKET"):
        return os.environ["KREX_SOCKET"]
    if os.geteuid() == 0:
        return "/run/krex/krex.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/krex-{os.getuid()}"
    return os.path.join(runtime, "krex.sock")


def comma_list(text: str) -> list[str]:
    """The items of a comma-separated option, stripped, empty ones dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def default_region_cores() -> int:
    return 1 if len(os.sched_getaffinity(0)) <= 2 else 2


class ServeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    socket: str = ""
    socket_group: str = ""
    policy: Policy = Policy.REGION
    isolation: Literal["auto", "cgroup", "signal"] = "auto"
    cgroup_root: str = ""  # a delegated v2 cgroup to create command cgroups under ("" = find one)
    devices: str = "auto"  # auto, none, cpu:N, nvidia, amd
    # who a region holds: every sibling on the device, those holding a GPU device file, or auto
    # (device-holders where the hold locks and the probes see GPU opens, all otherwise; hold.py)
    freeze: Literal["all", "device-holders", "auto"] = "auto"
    # how: the CUDA driver's process lock (freezer fallback per sibling), the freezer, or auto (the
    # lock where the driver offers it)
    hold: Literal["auto", "lock", "freeze"] = "auto"
    # bound of one cuCheckpointProcessLock (0.4-2.1 ms unloaded); a sibling not locked by then
    # (inside a long CUDA call: context creation, a large allocation) is frozen instead, so a region
    # entry stays within the 5 ms goal
    lock_timeout: Annotated[float, msgspec.Meta(gt=0, le=10)] = 0.005
    # auto: quiesce the runtimes whose process holds a GPU device file (none on the cpu device,
    # which has no queued work to synchronise: freezing is enough); all: every runtime
    quiesce: Literal["auto", "all"] = "auto"
    region_timeout: Positive = 60.0
    region_cores: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: 1 on a 2-core machine, 2 otherwise
    quiesce_timeout: Annotated[float, msgspec.Meta(ge=0)] = 0.02
    drain_timeout: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    freeze_timeout: Positive = 1.0
    warm_ms: Annotated[float, msgspec.Meta(ge=-1, le=60_000)] = -1.0  # -1: as the clock needs
    settle_ms: Annotated[float, msgspec.Meta(ge=0, le=10_000)] = 300.0  # wait for clocks to recover
    # settled: SM clock >= this fraction of its target; 0.9 let a 1 ms kernel run more than 1% slow
    # (bench/gpu/check_drain.py, bench/RESULTS.md)
    settle_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.97
    kill_grace: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    retention: Positive = 600.0  # seconds an ended command's result is kept for its agent
    max_frame: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024
    max_conn_buffer: Annotated[int, msgspec.Meta(ge=1 << 16)] = 64 * 1024 * 1024
    # bytes of frame bodies being read at once over all connections (a frame beyond waits for room)
    max_inbound_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 256 * 1024 * 1024
    # Node-wide bounds, so many peers cannot add up what one may not: unsent bytes over all
    # connections, open connections, and commands known (queued, running, or results kept).
    max_buffered_total: Annotated[int, msgspec.Meta(ge=1 << 16)] = 512 * 1024 * 1024
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 4096
    max_commands: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 4096
    # Each user's share of those, so one user cannot take all of them; root and --admin-group are
    # held only to the node-wide ones.
    max_connections_per_user: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1024
    max_commands_per_user: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1024
    output_tail: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20  # bytes of each stream kept per command
    spool_limit: Annotated[int, msgspec.Meta(ge=0)] = 64 << 20  # bytes of each stream spooled (0: off)
    read_timeout: Positive = 30.0
    state_dir: str = ""
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    probes: Literal["auto", "off", "ioctl", "launches", "tracefs"] = "auto"
    probe_prefixes: str = ""  # comma-separated device path prefixes ("" = the GPU defaults)
    launch_libs: str = ""  # comma-separated libcuda / libhsa-runtime64 paths for --probes launches
    # who the launch uprobes trap: outsiders (per process, only processes outside krex's commands:
    # a command's launches run untrapped) or all (every process mapping the library)
    launch_scope: Literal["outsiders", "all"] = "outsiders"
    admin_group: str = ""
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0  # warm workers per device (0: off)
    pool_max_uses: Annotated[int, msgspec.Meta(ge=1)] = 1
    pool_preload: str = ""  # comma-separated modules every worker imports, e.g. "torch"
    pool_init: str = ""  # modules a worker imports after its context, holding the node lock
    # the user (name or uid) warm workers run as ("" = the daemon's): a pool serves that user's
    # commands only, e.g. the gateway's --run-as user
    pool_user: str = ""
    # seconds an adopting interpreter waits for a warming worker before it runs plainly (its own
    # import and context cost more than the rest of a warm-up already under way)
    pool_wait: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0
    metrics: str = ""  # HOST:PORT of the Prometheus endpoint ("" = off), e.g. 127.0.0.1:9464

    # The comma-separated options as lists: they stay strings in the Struct (how the command line,
    # KREX_* variables and the config file spell them), and are split here alone.
    @property
    def probe_prefix_list(self) -> list[str]:
        return comma_list(self.probe_prefixes)

    @property
    def launch_lib_list(self) -> list[str]:
        return comma_list(self.launch_libs)

    @property
    def pool_preload_list(self) -> list[str]:
        return comma_list(self.pool_preload)

    @property
    def pool_init_list(self) -> list[str]:
        return comma_list(self.pool_init)

    def resolved(self) -> ServeConfig:
        """A copy with defaults that depend on the machine filled in."""
        socket = self.socket or default_socket()
        cores = self.region_cores if self.region_cores >= 0 else default_region_cores()
        state = self.state_dir or ("/run/krex" if os.geteuid() == 0 else
                                   os.path.join(os.path.dirname(socket), "krex-state"))
        return msgspec.structs.replace(self, socket=socket, region_cores=cores, state_dir=state)
