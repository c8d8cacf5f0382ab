"""The daemon's options: one Struct (ServeConfig), shared by the command line and krex.toml, and
how `krex serve` reads them from three layers: a TOML file, then KREX_* environment variables, then flags.

    load_config(path, os.environ, given_flags) -> ServeConfig

Layers, later ones win:

1. The file: `--config PATH`, else /etc/krex/krex.toml. A missing default file is fine (nothing is
   read); a missing explicit file is an error. Keys are ServeConfig's field names at the top level;
   `region-timeout` and `region_timeout` are the same key.
2. The environment: KREX_<FIELD> (KREX_POLICY, KREX_REGION_TIMEOUT; KREX_SOCKET is the socket). Values
   are strings converted to the field's type; an empty value counts as unset. Other KREX_* variables
   (KREX_COMMAND, KREX_TOKEN, KREX_DEVICE live inside commands) are not options and are ignored.
3. The command line: a dict of the options that were given explicitly (field name -> value).

Every layer is validated on its own, so an error names where the bad value came from:
`/etc/krex/krex.toml: region_timeout: Expected float >0, got -1`, `KREX_POLICY: ...`, `--max-frame: ...`.
Errors are raised as ConfigError; nothing here exits the process or prints.
"""

from __future__ import annotations

import enum
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from krex_async.protocol import default_socket
from krex_async.scheduler import Policy

Positive = Annotated[float, msgspec.Meta(gt=0)]
# Root's --state-dir: the unit's StateDirectory=krex, kept across stops (its RuntimeDirectory /run/krex,
# where the socket lives, is removed at each one, and with it anything recovery would need).
ROOT_STATE_DIR = "/var/lib/krex"


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
    # (device-holders where the hold locks and the probes see GPU opens, all otherwise; regions/policy.py)
    freeze: Literal["all", "device-holders", "auto"] = "auto"
    # how: the CUDA driver's process lock (freezer fallback per sibling), the freezer, or auto (the
    # lock where the driver offers it)
    hold: Literal["auto", "lock", "freeze"] = "auto"
    # bound of one cuCheckpointProcessLock (0.4-2.1 ms unloaded); a sibling not locked by then
    # (inside a long CUDA call: context creation, a large allocation) is frozen instead, so a region
    # entry stays within the 5 ms goal
    lock_timeout: Annotated[float, msgspec.Meta(gt=0, le=10)] = 0.005
    # how long a region waits, before its grant, for a sibling inside a CUDA call (the lock answered
    # NOT_READY) to leave it and be locked; still inside: frozen. On the H200 every such lock landed
    # within 0.46 s (p50 0.11 s: bench/gpu/check_lock_states.py); but waiting for them was most of a
    # region's entry, and on the H100 0.05 cut the entry's p95 to a third at the same throughput,
    # timings near the alone runs' own spread (bench/RESULTS.md, sessions 23, 24 and 27)
    lock_wait: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.05
    # how long a region waits for a sibling's exit to end before freezing what is left of it (-1:
    # --lock-wait); a process already in the kernel's exit (past the freezer) is waited for in any
    # case, up to --exit-kernel-wait at least.
    # 0: a torch exit disturbs another process's timing only once in the kernel (its files closing),
    # not in Python's finalisation or the CUDA library's teardown (bench/gpu/check_exit.py), and the
    # large set ran 1.11x shared with 0 against 0.96x waiting (bench/RESULTS.md, session 16)
    exit_wait: Annotated[float, msgspec.Meta(ge=-1, le=10)] = 0.0
    # an exit begun this long ago and still in user space is waited for like one in the kernel: under
    # back-to-back regions it runs only between them, and on the H100's large set one was frozen
    # through regions for 8 s, its job slot and GPU memory held (bench/RESULTS.md, session 17)
    exit_starve: Annotated[float, msgspec.Meta(ge=0, le=600)] = 2.0
    # how long a region waits at most for a sibling already in the kernel's exit (the freezer cannot
    # stop it; its driver frees its GPU memory beside the timing), or a starved one: its own bound,
    # so a short --lock-wait (entry latency) does not shorten it. 0.5: --lock-wait's default, which
    # bounded it until 2026-12-06 (on the H200 a torch job's exit frees in 0.4-0.7 s)
    exit_kernel_wait: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.5
    # auto: quiesce the runtimes whose process holds a GPU device file (none on the cpu device,
    # which has no queued work to synchronise: freezing is enough); all: every runtime
    quiesce: Literal["auto", "all"] = "auto"
    region_timeout: Positive = 60.0
    # the most of any share_window seconds that others' regions may hold a command (plus one region):
    # one held that long is owed the time to run before the next region that would hold it starts
    # (daemon/regions/share.py). Back to back, one user's regions left another's command 2% of its progress.
    # 0 or 1: off
    hold_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    share_window: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    region_cores: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: 1 on a 2-core machine, 2 otherwise
    quiesce_timeout: Annotated[float, msgspec.Meta(ge=0)] = 0.02
    drain_timeout: Annotated[float, msgspec.Meta(gt=0)] = 2.0  # longer than drain_window
    # the owner's drain check passes once its round trips stayed fast this long (longer than a GPU
    # time slice); bench/gpu/check_idle_window.py measures what a shorter one still catches
    drain_window: Annotated[float, msgspec.Meta(ge=0.001, le=1.0)] = 0.02
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
    # users (names or uids, comma-separated) who, though not root, may ask for run_as: a fleet
    # node's Ray user (daemon/commands/access.py says whom they may name)
    run_as_peers: str = ""
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0  # warm workers per device (0: off)
    pool_max_uses: Annotated[int, msgspec.Meta(ge=1)] = 1
    # seconds a warm worker that comes back one too many is kept after the demand fell (a command
    # ended: its agent's next job likely comes soon), so it serves that job (0: it leaves at once)
    pool_keep_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    pool_preload: str = ""  # comma-separated modules every worker imports, e.g. "torch"
    pool_init: str = ""  # modules a worker imports after its context, holding the node lock
    # the user (name or uid) warm workers run as ("" = the daemon's): a pool serves that user's
    # commands only, e.g. the gateway's --run-as user
    pool_user: str = ""
    # seconds an adopting interpreter waits for a warming worker before it runs plainly (its own
    # import and context cost more than the rest of a warm-up already under way)
    pool_wait: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0
    # memory-aware admission (daemon/commands/admission.py): auto tracks every GPU (not `cpu` devices),
    # memory every device, off none; an unknown command reserves --mem-default bytes (0: one
    # unknown at a time per device); --mem-headroom: the fraction of a device's memory kept free
    admission: Literal["auto", "memory", "off"] = "auto"
    mem_default: Annotated[int, msgspec.Meta(ge=0, le=2**60)] = 0
    mem_headroom: Annotated[float, msgspec.Meta(ge=0, le=0.5)] = 0.05
    # what a device is taken to hold: now, what it used at the last sample plus the needs of the
    # commands started since; peak, every running command's need or peak for its whole life; none,
    # nothing for a first run (only a declared need or a guarded re-run's waits): a co-located
    # out-of-memory is re-run instead; auto, none for a command that allows that re-run
    # (Submit.rerun_on_oom: the gateway's jobs), now for the others
    mem_commit: Literal["auto", "now", "peak", "none"] = "auto"
    # how a guarded re-run keeps its room: peak, the device counted at every command's whole-life
    # need or peak from its wait to its end; want, at --mem-commit's count plus what the re-run has
    # still to take (not measured on a GPU yet: docs/admission.md)
    mem_guard: Literal["peak", "want"] = "peak"
    # seconds a queue's head that does not fit lets later commands that fit start past it; then
    # nothing more starts on its device until it does (0: strict first in, first out)
    mem_backfill: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 10.0
    # on: a torch command starts at once and its admission waits for its first CUDA initialisation
    # (its runtime asks, MemGate), so its import overlaps others' device work; off: at its start
    mem_gate: Literal["on", "off"] = "on"
    # policy region: a new command (under mem_gate on: its CUDA start) waits while this many
    # regions queue on its device already: beside them it would only add to the line and to
    # the memory in use (0: off)
    region_backlog: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
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
    def run_as_peer_list(self) -> list[str]:
        return comma_list(self.run_as_peers)

    @property
    def pool_preload_list(self) -> list[str]:
        return comma_list(self.pool_preload)

    @property
    def pool_init_list(self) -> list[str]:
        return comma_list(self.pool_init)

    def conflicts(self) -> list[tuple[str, str, str]]:
        """Options that are each valid but not together: (field, other field, why). Checked once on
        the merged options (load_config), never per layer: a layer alone sees the other field at its
        default."""
        out = []
        if self.drain_timeout <= self.drain_window:
            out.append(
                (
                    "drain_timeout",
                    "drain_window",
                    f"drain_timeout ({self.drain_timeout} s) is not longer than drain_window "
                    f"({self.drain_window} s): every drain check would time out",
                )
            )
        return out

    def resolved(self) -> ServeConfig:
        """A copy with defaults that depend on the machine filled in."""
        socket = self.socket or default_socket()
        cores = self.region_cores if self.region_cores >= 0 else default_region_cores()
        state = self.state_dir or (
            ROOT_STATE_DIR if os.geteuid() == 0 else os.path.join(os.path.dirname(socket), "krex-state")
        )
        return msgspec.structs.replace(self, socket=socket, region_cores=cores, state_dir=state)


DEFAULT_PATH = "/etc/krex/krex.toml"
ENV_PREFIX = "KREX_"


class ConfigError(Exception):
    """An option could not be read or is invalid; the message starts with its source and key."""


def _fields() -> list[str]:
    return list(ServeConfig.__struct_fields__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


_PATH = re.compile(r"`\$\.([A-Za-z0-9_]+)`|\$\.([A-Za-z0-9_]+)")


def _validate(layer: dict[str, Any], where: Any, *, strict: bool) -> None:
    """Convert one layer alone; on failure raise ConfigError naming `where(key)` (or the layer)."""
    try:
        msgspec.convert(layer, ServeConfig, strict=strict)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        key = (m.group(1) or m.group(2)) if m else None
        detail = text.rsplit(" - at ", 1)[0]
        if key and detail.startswith("Invalid enum value") and (values := choices(key)):
            detail = f"{detail} (choose from {', '.join(values)})"
        raise ConfigError(f"{where(key)}: {detail}" if key else f"{where(None)}: {text}") from None


def choices(field: str) -> list[str]:
    """The values an enum or Literal option takes ([] for another type or an unknown field): the one
    spelling of them, for the file, the KREX_* variables and `krex serve`'s flags alike."""
    kind = typing.get_type_hints(ServeConfig).get(field)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [str(m.value) for m in kind]
    return [str(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is Literal else []


def read_file(path: str | None) -> tuple[str | None, dict[str, Any]]:
    """The file layer as (path read or None, {field: value}). Raises ConfigError for an unreadable or
    malformed file, a table where a value belongs, or an unknown key (with the known ones listed)."""
    explicit = path is not None
    path = path if explicit else DEFAULT_PATH
    assert path is not None
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: config file not found (given with --config)") from None
        return None, {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 (TOML is): byte {e.start}") from None
    known = set(_fields())
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            raise ConfigError(f"{path}:{key}: is a table; options are top-level `key = value` lines")
        if name not in known:
            raise ConfigError(f"{path}:{key}: unknown key (known keys: {', '.join(sorted(known))})")
        if name in out:
            raise ConfigError(f"{path}:{key}: given twice (as {name!r} and with dashes)")
        out[name] = value
    _validate(out, lambda k: f"{path}:{k}" if k else path, strict=True)
    return path, out


def read_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment layer: {field: string} for every non-empty KREX_<FIELD>."""
    out = {}
    for name in _fields():
        v = env.get(_env_name(name))
        if v is not None and v != "":
            try:
                v.encode()
            except UnicodeEncodeError:  # bytes the environment held that are not UTF-8
                raise ConfigError(f"{_env_name(name)}={v!r}: not UTF-8") from None
            out[name] = v
    for name, v in out.items():
        _validate({name: v}, lambda k, n=name, v=v: f"{_env_name(k or n)}={v!r}", strict=False)
    return out


def read_cli(cli: Mapping[str, Any]) -> dict[str, Any]:
    """The command-line layer: only options given explicitly (None values are dropped)."""
    known = set(_fields())
    out = {}
    for k, v in cli.items():
        name = k.replace("-", "_")
        if v is None:
            continue
        if name not in known:
            raise ConfigError(f"{_flag(name)}: not a serve option")
        out[name] = v
    _validate(out, lambda k: _flag(k) if k else "command line", strict=False)
    return out


def load_config_with_sources(
    path: str | None,
    env: Mapping[str, str],
    cli: Mapping[str, Any],
) -> tuple[ServeConfig, dict[str, str]]:
    """Merge file, environment and command line into a ServeConfig (not yet `.resolved()`), and say
    where each non-default option came from ({field: "file /etc/krex/krex.toml" | "env KREX_X" |
    "flag --x"}). Raises ConfigError naming the source and key of the first bad option."""
    fpath, file_layer = read_file(path)
    env_layer = read_env(env)
    cli_layer = read_cli(cli)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer, src in (
        (file_layer, lambda k: f"file {fpath}"),
        (env_layer, lambda k: f"env {_env_name(k)}"),
        (cli_layer, lambda k: f"flag {_flag(k)}"),
    ):
        for k, v in layer.items():
            merged[k] = v
            sources[k] = src(k)
    try:
        cfg = msgspec.convert(merged, ServeConfig, strict=False)
    except msgspec.ValidationError as e:  # each layer passed alone
        raise ConfigError(f"merged options: {e}") from None
    for field, other, why in cfg.conflicts():
        given = [f"{sources[k]}" for k in (field, other) if k in sources]
        raise ConfigError(f"{' and '.join(given) or 'defaults'}: {why}")
    return cfg, sources


def load_config(path: str | None, env: Mapping[str, str], cli: dict[str, Any]) -> ServeConfig:
    """The ServeConfig from the file at `path` (None: the default, optional), the KREX_* variables of
    `env`, and the explicitly given flags in `cli`. Raises ConfigError (message: source, key, why)."""
    return load_config_with_sources(path, env, cli)[0]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a JSON string is a valid TOML basic string


def print_config(cfg: ServeConfig, sources: Mapping[str, str] | None = None) -> str:
    """The options as TOML (loadable again with --config), one `key = value` per field, each with a
    comment naming where it came from when `sources` is given (default otherwise)."""
    lines = ["# krex serve: resolved options (TOML; later layers win: file < env < flags)"]
    data = msgspec.to_builtins(cfg)
    width = max(len(k) for k in data)
    for k, v in data.items():
        line = f"{k:<{width}} = {_toml_value(v)}"
        if sources is not None:
            line = f"{line:<{width + 30}}  # {sources.get(k, 'default')}"
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def environ() -> Mapping[str, str]:
    """os.environ, named here so the CLI wiring reads `load_config(args.config, environ(), given)`."""
    return os.environ
