"""The scheduler's pure logic: FIFO per device, parallel devices, and the three policies."""

import pytest

from krex_async.scheduler import Scheduler, SchedulerError


def test_region_fifo_per_device_and_parallel_devices():
    s = Scheduler("region", ["a", "b"])
    for c, dev in [("c1", "a"), ("c2", "a"), ("c3", "a"), ("c4", "b")]:
        assert s.add_command(c, dev)
    assert s.request_region("r1", "c1", "a") is True
    assert s.request_region("r2", "c2", "a") is False
    assert s.request_region("r3", "c3", "a") is False
    assert s.request_region("r4", "c4", "b") is True  # another device: in parallel
    assert s.queued("a") == ["r2", "r3"]
    assert s.release_region("r1") == "r2"
    assert s.release_region("r3") is None  # withdrawn while queued
    assert s.release_region("r2") is None
    assert s.holder("a") is None and s.holder("b") == "r4"
    assert s.siblings("a", "c1") == ["c2", "c3"]


def test_command_policy_holds_the_device_from_start_to_end():
    s = Scheduler("command", ["a"])
    assert s.add_command("c1", "a") is True
    assert s.add_command("c2", "a") is False
    assert s.add_command("c3", "a") is False
    assert s.request_region("r1", "c1", "a") is True  # regions are no-ops
    assert not s.isolates()
    assert s.end_command("c3", "a") == []  # cancelled while waiting
    assert s.end_command("c1", "a") == ["c2"]
    assert s.end_command("c2", "a") == []
    assert s.holder("a") is None


def test_shared_policy_never_waits():
    s = Scheduler("shared", ["a"])
    assert all(s.add_command(f"c{i}", "a") for i in range(3))
    assert s.request_region("r1", "c0", "a") and s.request_region("r2", "c1", "a")
    assert not s.isolates()


def test_errors():
    s = Scheduler("region", ["a"])
    with pytest.raises(SchedulerError):
        s.add_command("c", "zz")
    s.add_command("c", "a")
    s.request_region("r", "c", "a")
    with pytest.raises(SchedulerError):
        s.request_region("r", "c", "a")
    with pytest.raises(ValueError):
        Scheduler("nope", ["a"])
