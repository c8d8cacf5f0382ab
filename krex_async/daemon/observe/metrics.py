"""Prometheus metrics for the daemon (`krex serve --metrics 127.0.0.1:9464`).

The daemon owns one `Metrics` and calls its methods from the event loop as things happen; each call is
a few dict lookups and a lock, cheap enough for every command and region. Without prometheus-client
installed, or before `start()`, the methods still work and only `start()` fails (MetricsUnavailable,
with the pip line that fixes it), so the daemon needs no `if metrics:` around its calls.

Exposition: prometheus-client's own HTTP server on a daemon thread (`start_http_server`) with a
dedicated CollectorRegistry. Why a thread and not an aiohttp handler on the loop: it needs no aiohttp
(an optional dependency for the gateway only), and a slow or hostile scraper costs a thread, never
event-loop time during a region. The metric objects are thread-safe, so the loop updates and the
scrape thread reads without further locking.

Every command metric carries {policy, device} and every per-device series {device, UUID,
modelName}, the labels dcgm-exporter puts on its GPU series (`device` the key, "nvidia0"), so a panel
groups or filters by GPU model with no join; `device_info` adds the GPU's index (`gpu`) and vendor. A
series of no device ("none") has empty UUID and modelName. No `_created` series are exported. The
series, their labels and meaning: docs/operating.md, "Metrics" (the Grafana dashboard's test checks
every query it makes against a live daemon's series).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

__all__ = ["Metrics", "MetricsUnavailable", "missing", "parse_addr"]

_prom: ModuleType | None
try:
    import prometheus_client as _prom
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    _no_created = getattr(_prom, "disable_created_metrics", None)  # prometheus-client >= 0.17
    if _no_created is not None:
        _no_created()
except ImportError as e:  # optional dependency: krex[metrics]
    _prom = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

# Region steps are sub-millisecond to seconds; command walls are seconds to hours.
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


# Every per-device series carries the device's UUID and model, as dcgm-exporter's do: a dashboard
# filters or groups by GPU model without a join.
_DEV = ["device", "UUID", "modelName"]


def _user(uid: int) -> str:
    """A uid as its user name (the uid where it has none)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class MetricsUnavailable(RuntimeError):
    """The endpoint cannot be served; the message says why and how to fix it."""


def missing() -> str:
    """Why no endpoint can be served here ("" when one can)."""
    if _prom is not None:
        return ""
    return (
        f"--metrics needs prometheus-client ({_IMPORT_ERROR}); install it with "
        "`pip install 'krex[metrics]'` or `pip install prometheus-client`"
    )


def parse_addr(addr: str) -> tuple[str, int]:
    """'127.0.0.1:9464', '[::1]:9464' or ':9464' (all interfaces) -> (host, port). ValueError else."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{addr!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class Metrics:
    """The daemon's counters, gauges and histograms, in a registry of their own."""

    def __init__(self) -> None:
        self.available = _prom is not None
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None
        self._retired: dict[str, int] = {}
        self._queued: dict[str, tuple[str, str]] = {}  # command -> (policy, device) while queued
        self._lost_total = 0
        self._devices: dict[str, tuple[str, str]] = {}  # device key -> (UUID, modelName)
        if _prom is None:
            return
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._commands = Gauge(
            "krex_commands", "Commands now queued or running", ["state", "policy", *_DEV], registry=r
        )
        self._started = Counter(
            "krex_commands_started", "Commands started", ["policy", *_DEV, "via"], registry=r
        )
        self._ended = Counter(
            "krex_commands_ended", "Commands ended, by final state", ["policy", *_DEV, "state"], registry=r
        )
        self._wall = Histogram(
            "krex_command_wall_seconds",
            "Command wall-clock time",
            ["policy", *_DEV],
            buckets=_SLOW,
            registry=r,
        )
        self._held = Gauge("krex_regions_held", "Regions granted and not yet released", _DEV, registry=r)
        self._enter = Histogram(
            "krex_region_enter_seconds", "Region request to grant", _DEV, buckets=_FAST, registry=r
        )
        self._freeze = Histogram(
            "krex_region_freeze_seconds",
            "Freezing a region's siblings",
            _DEV,
            buckets=_FAST,
            registry=r,
        )
        self._quiesce = Histogram(
            "krex_region_quiesce_seconds",
            "Cooperative quiesce of siblings",
            _DEV,
            buckets=_FAST,
            registry=r,
        )
        self._cores = Histogram(
            "krex_region_cores_seconds",
            "Reserving region cores and fencing",
            _DEV,
            buckets=_FAST,
            registry=r,
        )
        self._hold = Histogram(
            "krex_region_hold_seconds", "Region grant to release", _DEV, buckets=_SLOW, registry=r
        )
        self._regions = Counter("krex_regions", "Regions ended, by outcome", [*_DEV, "outcome"], registry=r)
        self._drain = Counter(
            "krex_region_drain", "How each region's drain ended", [*_DEV, "drain"], registry=r
        )
        self._strays = Counter("krex_strays", "GPU activity of non-owners during regions", _DEV, registry=r)
        self._lost = Counter("krex_probe_lost_events", "Probe events the kernel dropped", registry=r)
        self._share_wait = Counter(
            "krex_region_share_wait_seconds",
            "Seconds regions waited, their turn come, for siblings owed their share (--hold-share)",
            _DEV,
            registry=r,
        )
        self._cmd_held = Counter(
            "krex_command_held_seconds",
            "Seconds a running command was kept from running by other commands' regions (frozen: "
            "the whole hold; locked: less the CPU it used meanwhile; neither once it asked for a "
            "region of its own; docs/fairness.md)",
            [*_DEV, "command"],
            registry=r,
        )
        self._cmd_held_dev: dict[str, str] = {}  # command -> its series' device, to remove it
        self._pool = Gauge("krex_pool_workers", "Context pool workers", [*_DEV, "state"], registry=r)
        self._pool_retired = Counter("krex_pool_retired", "Context pool workers retired", _DEV, registry=r)
        self._pool_start = Histogram(
            "krex_pool_start_seconds",
            "Command start latency via the pool",
            _DEV,
            buckets=_FAST,
            registry=r,
        )
        self._util_ratio = Gauge(
            "krex_device_utilization_ratio",
            "Device utilisation, 0-1 (the vendor's recent busy fraction)",
            _DEV,
            registry=r,
        )
        self._memory = Gauge(
            "krex_device_memory_bytes",
            "Device memory: used and total (a CPU device: the host's, used as total less available)",
            [*_DEV, "state"],
            registry=r,
        )
        self._held_now = Gauge(
            "krex_commands_held",
            "Commands a region holds now, by how (frozen, locked)",
            [*_DEV, "mode"],
            registry=r,
        )
        self._held_seconds = Counter(
            "krex_held_seconds",
            "Seconds commands were held by other commands' regions (each region's grant to release), "
            "by the held command's user",
            ["user"],
            registry=r,
        )
        _prom.ProcessCollector(namespace="", registry=r)  # process_*: the daemon's CPU, memory, fds
        self._device_info = Gauge(
            "krex_device_info",
            "A device of this node, with the labels "
            "dcgm-exporter uses (gpu, UUID, modelName) to join with it",
            ["device", "gpu", "UUID", "modelName", "vendor"],
            registry=r,
        )
        self._mem_reserved = Gauge(
            "krex_device_memory_reserved_bytes",
            "Device memory admission counts as held by running commands",
            _DEV,
            registry=r,
        )
        self._mem_used = Gauge(
            "krex_device_memory_used_bytes", "Device memory used, all processes", _DEV, registry=r
        )
        self._mem_waiting = Gauge(
            "krex_commands_waiting_memory", "Commands queued for device memory", _DEV, registry=r
        )
        self._reruns = Counter(
            "krex_command_reruns",
            "Commands re-run after a CUDA out-of-memory while co-located",
            [*_DEV, "reason"],
            registry=r,
        )
        self._info = Gauge("krex_info", "This daemon", ["version", "policy", "isolation"], registry=r)
        self._disk_full = Gauge(
            "krex_state_disk_full", "1 while the state disk is full and records use its reserve", registry=r
        )

    # ------------------------------------------------------------------------------- commands

    def info(self, version: str, policy: str, isolation: str) -> None:
        if self.available:
            self._info.labels(version, policy, isolation).set(1)

    def command_submitted(self, policy: str, device: str, queued: bool, command: str = "") -> None:
        """A command was accepted; `queued` when it waits for its device (policy command). With its
        id, its later start or end takes it out of the queued gauge again."""
        if self.available and queued:
            self._commands.labels("queued", policy, *self._dev(device)).inc()
            self._queued[command] = (policy, device)

    def _unqueue(self, command: str) -> None:
        if command and command in self._queued:
            policy, device = self._queued.pop(command)
            self._commands.labels("queued", policy, *self._dev(device)).dec()

    def command_started(self, policy: str, device: str, via: str, command: str = "") -> None:
        """A command's leader was spawned (`via`: exec, or pool when a warm worker ran it)."""
        if not self.available:
            return
        self._unqueue(command)
        self._commands.labels("running", policy, *self._dev(device)).inc()
        self._started.labels(policy, *self._dev(device), via).inc()

    def command_requeued(self, policy: str, device: str, command: str) -> None:
        """A running command ended and waits to run again (a re-run): running -> queued."""
        if not self.available:
            return
        self._commands.labels("running", policy, *self._dev(device)).dec()
        self._commands.labels("queued", policy, *self._dev(device)).inc()
        self._queued[command] = (policy, device)

    def command_ended(
        self,
        policy: str,
        state: str,
        wall_s: float,
        command: str = "",
        *,
        started: bool = True,
        device: str = "none",
    ) -> None:
        """A command ended in `state` (exited, signaled, timeout, cancelled, shutdown, failed) on
        `device` ("none" for a command without one). `started=False` for one that never ran
        (cancelled while queued, failed to spawn)."""
        if not self.available:
            return
        self._unqueue(command)
        if started:
            self._commands.labels("running", policy, *self._dev(device)).dec()
            self._wall.labels(policy, *self._dev(device)).observe(max(0.0, wall_s))
        self._ended.labels(policy, *self._dev(device), state).inc()

    def memory_reserved(self, device: str, reserved: int, used: int) -> None:
        """Memory admission's view of `device`: held by its running commands, used in all."""
        if self.available:
            self._mem_reserved.labels(*self._dev(device)).set(reserved)
            self._mem_used.labels(*self._dev(device)).set(used)

    def memory_waiting(self, device: str, n: int) -> None:
        if self.available:
            self._mem_waiting.labels(*self._dev(device)).set(n)

    def rerun(self, device: str, reason: str) -> None:
        if self.available:
            self._reruns.labels(*self._dev(device), reason).inc()

    # -------------------------------------------------------------------------------- regions

    def region_entered(
        self, device: str, enter_s: float, freeze_s: float, cores_s: float, quiesce_s: float
    ) -> None:
        """A region was granted, with what each step of entering cost."""
        if not self.available:
            return
        self._held.labels(*self._dev(device)).inc()
        self._enter.labels(*self._dev(device)).observe(enter_s)
        self._freeze.labels(*self._dev(device)).observe(freeze_s)
        self._cores.labels(*self._dev(device)).observe(cores_s)
        self._quiesce.labels(*self._dev(device)).observe(quiesce_s)

    def region_released(
        self, device: str, held_s: float, outcome: str, drain: str, *, granted: bool = True
    ) -> None:
        """A region ended (every region, granted or not: `granted=False` for refused or withdrawn)."""
        if not self.available:
            return
        if granted:
            self._held.labels(*self._dev(device)).dec()
            self._hold.labels(*self._dev(device)).observe(held_s)
            self._drain.labels(*self._dev(device), drain).inc()
        self._regions.labels(*self._dev(device), outcome).inc()

    def strays(self, device: str, n: int) -> None:
        if self.available and n > 0:
            self._strays.labels(*self._dev(device)).inc(n)

    def share_waited(self, device: str, seconds: float) -> None:
        if self.available and seconds > 0:
            self._share_wait.labels(*self._dev(device)).inc(seconds)

    def command_held(self, device: str, command: str, seconds: float) -> None:
        """A region held `command` (a sibling) for `seconds`."""
        if self.available and seconds > 0:
            self._cmd_held.labels(*self._dev(device), command).inc(seconds)
            self._cmd_held_dev[command] = device

    def command_held_forget(self, command: str) -> None:
        """`command` ended: its series goes (one per command would grow without bound)."""
        device = self._cmd_held_dev.pop(command, None)
        if self.available and device is not None:
            self._cmd_held.remove(*self._dev(device), command)

    def probe_lost(self, n: int) -> None:
        """`n` more probe events were lost."""
        if self.available and n > 0:
            self._lost.inc(n)

    def probe_lost_total(self, total: int) -> None:
        """The probe backend's running count of lost events (its `lost()`); exports the increase."""
        self.probe_lost(total - self._lost_total)
        self._lost_total = max(self._lost_total, total)

    # -------------------------------------------------------------------------- pool, devices

    def pool(
        self, device: str, warm: int, busy: int, retired: int, start_latency_s: float | None = None
    ) -> None:
        """The pool's state on `device`: workers warm and busy now, `retired` its running total
        (exported as a counter from the increases), and one start latency if a command just started."""
        if not self.available:
            return
        self._pool.labels(*self._dev(device), "warm").set(warm)
        self._pool.labels(*self._dev(device), "busy").set(busy)
        delta = retired - self._retired.get(device, 0)
        if delta > 0:
            self._pool_retired.labels(*self._dev(device)).inc(delta)
            self._retired[device] = retired
        if start_latency_s is not None:
            self._pool_start.labels(*self._dev(device)).observe(start_latency_s)

    def device_util(self, device: str, pct: float) -> None:
        """The device's utilisation as the vendor reports it, in percent (exported as a ratio)."""
        if self.available:
            self._util_ratio.labels(*self._dev(device)).set(pct / 100.0)

    def device_memory(self, device: str, used: int, total: int) -> None:
        """The device's memory now, in bytes."""
        if self.available:
            self._memory.labels(*self._dev(device), "used").set(used)
            self._memory.labels(*self._dev(device), "total").set(total)

    def holding(self, device: str, frozen: int, locked: int) -> None:
        """The region on `device` holds this many commands now (0, 0 at its release)."""
        if self.available:
            self._held_now.labels(*self._dev(device), "frozen").set(frozen)
            self._held_now.labels(*self._dev(device), "locked").set(locked)

    def held_for(self, uids: list[int], seconds: float) -> None:
        """A region held the commands of these users (one uid per command) for `seconds`. Labelled
        by user, not by command: a command id per series would grow without bound."""
        if self.available:
            for uid in uids:
                self._held_seconds.labels(_user(uid)).inc(max(0.0, seconds))

    def device_info(self, device: str, index: int, uuid: str, model: str, vendor: str) -> None:
        """A device of the node, before any of its series (`gpu` is its index, as dcgm-exporter
        labels it); its UUID and model label every per-device series from then on."""
        self._devices[device] = (uuid, model)
        if self.available:
            self._device_info.labels(device, str(index), uuid, model, vendor).set(1)

    def _dev(self, device: str) -> tuple[str, str, str]:
        """The labels of a per-device series: the key, its UUID and model (dcgm-exporter's)."""
        uuid, model = self._devices.get(device, ("", ""))
        return device, uuid, model

    def state_disk_full(self, full: bool) -> None:
        if self.available:
            self._disk_full.set(1 if full else 0)

    # ------------------------------------------------------------------------------- exposing

    def start(self, addr: str) -> tuple[str, int]:
        """Serve /metrics on `addr` (HOST:PORT, port 0 picks one) from a daemon thread; returns the
        bound (host, port). Raises MetricsUnavailable without prometheus-client, ValueError for a bad
        address, OSError when the port cannot be bound."""
        if _prom is None:
            raise MetricsUnavailable(missing())
        host, port = parse_addr(addr)
        self.server, self.thread = _prom.start_http_server(port, addr=host, registry=self.registry)
        bound = self.server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        return self.address

    def stop(self) -> None:
        """Stop the endpoint (idempotent) and close its socket."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def scrape(self) -> bytes:
        """The text exposition, as a scraper would get it (b"" without prometheus-client)."""
        return _prom.generate_latest(self.registry) if _prom is not None else b""


async def serve_metrics(metrics: Metrics, addr: str) -> tuple[str, int]:
    """`metrics.start(addr)` for callers on the event loop (binding is quick; it runs inline)."""
    return metrics.start(addr)
