"""Metrics: the methods the daemon calls, read back by scraping the real HTTP endpoint."""

from __future__ import annotations

import subprocess
import urllib.request

import pytest

from krex_async.daemon.observe.metrics import Metrics, MetricsUnavailable, parse_addr

from ..conftest import PY, ROOT, py_env

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client not installed")


DEVICE_LABELS = ("UUID", "modelName")  # on every per-device series, as dcgm-exporter's


def scrape(
    addr: tuple[str, int], device_labels: bool = False
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from GET /metrics; the UUID and modelName labels of
    per-device series left out unless `device_labels` (most tests name a series by its key)."""
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {
                k: v
                for k, v in s.labels.items()
                if device_labels or k not in DEVICE_LABELS or s.name == "krex_device_info"
            }
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def L(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


@pytest.fixture
def metrics():
    m = Metrics()
    addr = m.start("127.0.0.1:0")
    assert addr[1] > 0
    yield m
    m.stop()


def test_commands_by_state_and_policy(metrics):
    m = metrics
    m.info("0.1.0", "region", "cgroup")
    m.command_submitted("region", "cpu", queued=False, command="1")
    m.command_started("region", "cpu", "exec", command="1")
    m.command_submitted("command", "cpu", queued=True, command="2")
    m.command_submitted("command", "cpu", queued=True, command="3")
    m.command_started("command", "cpu", "pool", command="2")
    got = scrape(m.address)
    assert got[("krex_commands", L(state="running", policy="region", device="cpu"))] == 1
    assert got[("krex_commands", L(state="queued", policy="command", device="cpu"))] == 1
    assert got[("krex_commands", L(state="running", policy="command", device="cpu"))] == 1
    assert got[("krex_commands_started_total", L(policy="command", device="cpu", via="pool"))] == 1
    assert got[("krex_info", L(version="0.1.0", policy="region", isolation="cgroup"))] == 1
    m.command_ended("region", "exited", 2.0, command="1", device="cpu")
    m.command_ended("command", "cancelled", 0.0, command="3", started=False, device="cpu")
    m.command_ended("command", "cancelled", 0.0, command="3", started=False, device="cpu")  # unqueued once
    got = scrape(m.address)
    assert got[("krex_commands", L(state="running", policy="region", device="cpu"))] == 0
    assert got[("krex_commands", L(state="queued", policy="command", device="cpu"))] == 0
    assert got[("krex_commands_ended_total", L(policy="region", device="cpu", state="exited"))] == 1
    assert got[("krex_commands_ended_total", L(policy="command", device="cpu", state="cancelled"))] == 2
    assert got[("krex_command_wall_seconds_count", L(policy="region", device="cpu"))] == 1
    assert got[("krex_command_wall_seconds_sum", L(policy="region", device="cpu"))] == 2.0


def test_regions_histograms_and_counters(metrics):
    m = metrics
    m.region_entered("nvidia0", enter_s=0.0015, freeze_s=0.0008, cores_s=0.0002, quiesce_s=0.0003)
    m.region_entered("nvidia0", enter_s=0.004, freeze_s=0.003, cores_s=0.0002, quiesce_s=0.0)
    got = scrape(m.address)
    assert got[("krex_regions_held", L(device="nvidia0"))] == 2
    assert got[("krex_region_enter_seconds_count", L(device="nvidia0"))] == 2
    assert got[("krex_region_enter_seconds_bucket", L(device="nvidia0", le="0.002"))] == 1
    assert got[("krex_region_enter_seconds_bucket", L(device="nvidia0", le="0.005"))] == 2
    assert got[("krex_region_freeze_seconds_sum", L(device="nvidia0"))] == pytest.approx(0.0038)
    m.region_released("nvidia0", held_s=0.5, outcome="released", drain="synced")
    m.region_released("nvidia0", held_s=60.0, outcome="expired", drain="timeout")
    m.region_released("nvidia0", held_s=0.0, outcome="refused", drain="not-needed", granted=False)
    m.strays("nvidia0", 3)
    m.strays("nvidia0", 0)
    m.probe_lost(7)
    m.probe_lost_total(5)
    m.probe_lost_total(5)
    got = scrape(m.address)
    assert got[("krex_regions_held", L(device="nvidia0"))] == 0
    assert got[("krex_region_hold_seconds_count", L(device="nvidia0"))] == 2
    assert got[("krex_region_hold_seconds_sum", L(device="nvidia0"))] == 60.5
    assert got[("krex_regions_total", L(device="nvidia0", outcome="refused"))] == 1
    assert got[("krex_region_drain_total", L(device="nvidia0", drain="synced"))] == 1
    assert got[("krex_region_drain_total", L(device="nvidia0", drain="timeout"))] == 1
    assert ("krex_region_drain_total", L(device="nvidia0", drain="not-needed")) not in got
    assert got[("krex_strays_total", L(device="nvidia0"))] == 3
    assert got[("krex_probe_lost_events_total", ())] == 12


def test_pool_and_devices(metrics):
    m = metrics
    m.pool("nvidia0", warm=2, busy=1, retired=4, start_latency_s=0.003)
    m.pool("nvidia0", warm=1, busy=2, retired=6)
    m.pool("nvidia0", warm=1, busy=2, retired=6)  # the same total again: no increase
    m.device_util("nvidia0", 37.5)
    got = scrape(m.address)
    assert got[("krex_pool_workers", L(device="nvidia0", state="warm"))] == 1
    assert got[("krex_pool_workers", L(device="nvidia0", state="busy"))] == 2
    assert got[("krex_pool_retired_total", L(device="nvidia0"))] == 6
    assert got[("krex_pool_start_seconds_count", L(device="nvidia0"))] == 1
    assert got[("krex_device_utilization_ratio", L(device="nvidia0"))] == 0.375
    assert not [k for k in got if k[0].endswith("_percent")], "the ratio only, as Prometheus has it"
    m.device_memory("nvidia0", used=3 << 30, total=140 << 30)
    m.holding("nvidia0", frozen=2, locked=1)
    m.held_for([0, 0, 2**31 - 7], 1.5)
    got = scrape(m.address)
    assert got[("krex_device_memory_bytes", L(device="nvidia0", state="used"))] == 3 << 30
    assert got[("krex_device_memory_bytes", L(device="nvidia0", state="total"))] == 140 << 30
    assert got[("krex_commands_held", L(device="nvidia0", mode="frozen"))] == 2
    assert got[("krex_commands_held", L(device="nvidia0", mode="locked"))] == 1
    assert got[("krex_held_seconds_total", L(user="root"))] == 3.0  # by user, never by command
    assert got[("krex_held_seconds_total", L(user=str(2**31 - 7)))] == 1.5  # a uid with no name
    assert got[("process_open_fds", ())] > 0 and got[("process_resident_memory_bytes", ())] > 0


def test_labels_join_with_dcgm_and_no_created_series(metrics):
    """Every command metric has the same {policy, device} labels; device_info carries what
    dcgm-exporter labels a GPU with; no `_created` samples (they double the series count)."""
    m = metrics
    m.device_info("nvidia0", 0, "GPU-1234", "NVIDIA H200", "nvidia")
    m.command_submitted("region", "nvidia0", queued=False, command="1")
    m.command_started("region", "nvidia0", "exec", command="1")
    m.command_ended("region", "exited", 1.0, command="1", device="nvidia0")
    m.region_entered("nvidia0", 0.001, 0.001, 0.0, 0.0)
    got = scrape(m.address)
    assert (
        got[
            (
                "krex_device_info",
                L(device="nvidia0", gpu="0", UUID="GPU-1234", modelName="NVIDIA H200", vendor="nvidia"),
            )
        ]
        == 1
    )
    assert not [k for k in got if k[0].endswith("_created")], [k for k in got if "created" in k[0]]
    for name in (
        "krex_commands",
        "krex_commands_started_total",
        "krex_commands_ended_total",
        "krex_command_wall_seconds_count",
    ):
        labels = {dict(k[1]).get("device") for k in got if k[0] == name}
        assert labels == {"nvidia0"}, (name, labels)
        assert all("policy" in dict(k[1]) for k in got if k[0] == name)
    # dcgm-exporter's UUID and modelName on every per-device series: no join needed
    full = scrape(m.address, device_labels=True)
    per_device = [k for k in full if "device" in dict(k[1])]
    assert len({k[0] for k in per_device}) >= 8, per_device
    for name, labels in per_device:
        assert (dict(labels)["UUID"], dict(labels)["modelName"]) == ("GPU-1234", "NVIDIA H200"), name


def test_dedicated_registry():
    import prometheus_client

    a, b = Metrics(), Metrics()  # two daemons in one process must not collide
    a.strays("cpu", 1)
    sample = b'krex_strays_total{UUID="",device="cpu",modelName=""} 1.0'
    assert sample in a.scrape() and sample not in b.scrape()
    assert b"krex_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_addresses():
    assert parse_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_addr("[::1]:9464") == ("::1", 9464)
    assert parse_addr(":9464") == ("0.0.0.0", 9464)
    for bad in ("9464", "host:", "host:http", "h:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_addr(bad)
    m = Metrics()
    port = m.start("127.0.0.1:0")[1]
    try:
        with pytest.raises(OSError):
            Metrics().start(f"127.0.0.1:{port}")  # taken
    finally:
        m.stop()
    m.stop()  # idempotent


def test_without_prometheus_client():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from krex_async.daemon.observe.metrics import Metrics, MetricsUnavailable\n"
        "m = Metrics(); m.command_started('region', 'cpu', 'exec'); m.region_entered('cpu', 1, 1, 1, 1)\n"
        "m.pool('cpu', 1, 1, 1, 0.1); assert m.scrape() == b'' and not m.available\n"
        "try:\n    m.start('127.0.0.1:0')\nexcept MetricsUnavailable as e:\n    print(e)\n"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=py_env(), cwd=ROOT, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "--metrics needs prometheus-client" in p.stdout and "pip install" in p.stdout
    assert MetricsUnavailable.__doc__
