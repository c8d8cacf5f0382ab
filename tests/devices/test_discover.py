"""Device discovery on this machine (no GPU): vendors say why they are unavailable, cpu fallback,
cpu:N splitting, and placement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from krex_async.devices import Device, NoDevice, Unavailable, discover, open_node, place
from krex_async.devices.amd import AmdVendor
from krex_async.devices.cpu import cpus_from_mask, parse_cpulist, pci_local_cpus, pci_numa_node, sysfs_bus_id
from krex_async.devices.nvidia import NvidiaVendor

REPO = Path(__file__).resolve().parents[2]


def _has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


needs_no_gpu = pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU; these check the fallback")


@needs_no_gpu
def test_nvidia_unavailable_with_reason() -> None:
    with pytest.raises(Unavailable) as e:
        NvidiaVendor().open()
    msg = str(e.value)
    assert "not installed" in msg or "NVML library not found" in msg or "driver" in msg, msg


@needs_no_gpu
def test_auto_falls_back_to_cpu_with_notes() -> None:
    devices, notes = discover("auto")
    assert [d.key for d in devices] == ["cpu"]
    assert devices[0].cpus == frozenset(os.sched_getaffinity(0))
    assert devices[0].memory_total_bytes > 0
    assert any(
        n.startswith("nvidia: unavailable: ") and len(n) > len("nvidia: unavailable: ") + 5 for n in notes
    ), notes
    assert any(n.startswith("amd: unavailable: ") for n in notes), notes


@needs_no_gpu
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_named_vendor_missing_is_an_error(vendor: str) -> None:
    with pytest.raises(Unavailable, match=f"^{vendor}: "):
        discover(vendor)


def _run_py(code: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@needs_no_gpu
def test_amdsmi_import_noise_is_swallowed(tmp_path: Path) -> None:
    # amdsmi as PyPI ships it behaves like this without ROCm: prints, then raises KeyError.
    pkg = tmp_path / "amdsmi"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "print('/opt/rocm/lib/libamd_smi.so: cannot open shared object file')\n"
        "print('Unable to find libamd_smi.so library try installing amd-smi-lib')\n"
        "raise KeyError('libamd_smi.so')\n"
    )
    code = (
        "from krex_async.devices import discover, Unavailable\n"
        "devs, notes = discover('auto')\n"
        "print('NOTES', [n for n in notes if n.startswith('amd')])\n"
        "try:\n    discover('amd')\nexcept Unavailable as e:\n    print('ERR', e)\n"
    )
    out = _run_py(code, [tmp_path, REPO])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["NOTES", "ERR"], out.stdout  # no stray print
    assert "libamd_smi.so not found" in lines[0] and "Unable to find" in lines[0]
    assert lines[1].startswith("ERR amd: AMD SMI library libamd_smi.so not found")
    assert out.stderr == ""


@needs_no_gpu
def test_real_vendor_packages_report_cleanly() -> None:
    """With whichever of nvidia-ml-py / amdsmi this interpreter has, nothing is printed."""
    code = (
        "from krex_async.devices import discover\n"
        "devs, notes = discover('auto')\nprint(len(devs), devs[0].key)\n"
    )
    out = _run_py(code, [REPO])
    assert out.returncode == 0, out.stderr
    assert out.stdout == "1 cpu\n" and out.stderr == ""
    try:
        AmdVendor().open()
    except Unavailable as e:
        assert str(e)
    else:
        pytest.fail("AMD SMI answered on a machine without an AMD GPU")


def test_cpu_spec_splits_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    devices, notes = discover("cpu:2")
    assert [d.key for d in devices] == ["cpu0", "cpu1"]
    assert [d.index for d in devices] == [0, 1]
    if len(allowed) >= 2:
        assert not devices[0].cpus & devices[1].cpus
        assert devices[0].cpus | devices[1].cpus == frozenset(allowed)
        assert abs(len(devices[0].cpus) - len(devices[1].cpus)) <= 1
        assert max(devices[0].cpus) < min(devices[1].cpus)  # contiguous blocks
    many = discover(f"cpu:{len(allowed) + 1}")[0]
    assert all(len(d.cpus) == 1 for d in many) and len(many) == len(allowed) + 1
    assert discover("none")[0][0].key == "cpu"


@pytest.mark.parametrize("spec", ["cpu:0", "cpu:x", "cpu:99999999", "gpu", "nvidia:0"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="bad device spec|cpu:N"):
        discover(spec)


def test_node_keeps_vendors_for_live_queries() -> None:
    node = open_node("cpu:2")
    try:
        refreshed = node.refresh()
        assert [d.key for d in refreshed] == ["cpu0", "cpu1"]
        assert node.processes(refreshed[0]) == [] and node.utilisation(refreshed[0]) is None
    finally:
        node.close()


def _dev(key: str, free_gib: float, index: int) -> Device:
    return Device(
        index=index,
        key=key,
        vendor="nvidia",
        name="g",
        memory_total_bytes=int(80 * 2**30),
        memory_free_bytes=int(free_gib * 2**30),
    )


def test_place_fewest_commands_with_memory() -> None:
    devs = [_dev("nvidia0", 70, 0), _dev("nvidia1", 10, 1), _dev("nvidia2", 40, 2)]
    assert place(devs, {}, 0).key == "nvidia0"  # tie on counts: most free
    assert place(devs, {"nvidia0": 2, "nvidia1": 0, "nvidia2": 1}, 0).key == "nvidia1"
    # nvidia1 has the fewest commands but not the memory
    assert place(devs, {"nvidia0": 2, "nvidia1": 0, "nvidia2": 1}, 20 * 2**30).key == "nvidia2"
    same = [_dev("nvidia0", 10, 0), _dev("nvidia1", 10, 1)]
    assert place(same, {}, 0).key == "nvidia0"  # then the lowest index


def test_place_errors_name_what_was_asked() -> None:
    devs = [_dev("nvidia0", 5, 0), _dev("nvidia1", 7, 1)]
    with pytest.raises(NoDevice) as e:
        place(devs, {}, 50 * 2**30)
    msg = str(e.value)
    assert "mem=53687091200" in msg and "50.0 GiB" in msg
    assert "nvidia0 has 5.0 GiB free" in msg and "nvidia1 has 7.0 GiB free" in msg
    with pytest.raises(NoDevice, match="no devices"):
        place([], {}, 0)


def test_cpu_lists_masks_and_bus_ids() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert parse_cpulist("") == frozenset()
    with pytest.raises(ValueError):
        parse_cpulist("0-a")
    assert cpus_from_mask([0b1011, 1]) == frozenset({0, 1, 3, 64})
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert sysfs_bus_id("0000:c1:00.0") == "0000:c1:00.0"


def test_pci_sysfs_fallbacks(tmp_path: Path) -> None:
    dev = tmp_path / "0000:3b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    (dev / "local_cpulist").write_text("8-11\n")
    assert pci_numa_node("00000000:3B:00.0", tmp_path) == 1
    assert pci_local_cpus("00000000:3B:00.0", tmp_path) == frozenset({8, 9, 10, 11})
    (dev / "numa_node").write_text("-1\n")
    assert pci_numa_node("0000:3b:00.0", tmp_path) is None
    assert pci_numa_node("0000:99:00.0", tmp_path) is None
    assert pci_local_cpus("0000:99:00.0", tmp_path) == frozenset()


def test_a_daemon_given_some_gpus_schedules_on_those_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES in the daemon's environment (Slurm, two daemons on one host) limits the
    GPUs it schedules on, read as CUDA reads it: indices or UUID prefixes, up to the first entry
    that names no GPU; NVML alone lists every GPU of the host."""
    from krex_async.devices.base import Device
    from krex_async.devices.nvidia import NvidiaVendor, visible_only

    gpus = [
        Device(index=i, key=f"nvidia{i}", vendor="nvidia", name="H200", uuid=f"GPU-{i}aa{i}")
        for i in range(4)
    ]
    keys = lambda spec: [d.key for d in visible_only(gpus, spec)]  # noqa: E731
    assert keys("2,3") == ["nvidia2", "nvidia3"]
    assert keys("3,0") == ["nvidia3", "nvidia0"]
    assert keys("GPU-1aa1, GPU-2") == ["nvidia1", "nvidia2"]  # a unique prefix is enough
    assert keys("1,7,2") == ["nvidia1"]  # 7 names no GPU: CUDA stops there
    assert keys("GPU-") == [] and keys("") == [] and keys("MIG-xyz") == []

    class FakeNvml:  # the few calls open() makes; every other query answers "not supported"
        class NVMLError(Exception):
            pass

        NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_CLOCK_GRAPHICS = 1, 2, 0
        nvmlShutdown = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 4)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetUUID = staticmethod(lambda h: f"GPU-{h}aa{h}")

    monkeypatch.setattr(NvidiaVendor, "_load", lambda self: FakeNvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3aa3,1")
    opened = NvidiaVendor().open()
    assert [(d.key, d.env["CUDA_VISIBLE_DEVICES"]) for d in opened] == [
        ("nvidia3", "GPU-3aa3"),
        ("nvidia1", "GPU-1aa1"),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")
    with pytest.raises(Exception, match="names none of the 4 GPU"):
        NvidiaVendor().open()


def test_nvidia_processes_fall_back_to_an_older_nvml_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-process memory (memory admission's figures): pynvml's _v3 where the driver has it, else
    _v2 (pynvml's unversioned name raises NVMLLibraryMismatchError, not an NVMLError, there); an
    NVML error means no processes, never a raise; usedGpuMemory None stays unknown."""
    pynvml = pytest.importorskip("pynvml")
    from types import SimpleNamespace

    from krex_async.devices.nvidia import NvidiaVendor

    gone = pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert isinstance(gone, pynvml.NVMLError_FunctionNotFound)

    def v3(h: object) -> list[object]:
        raise gone

    def v2(h: object) -> list[object]:
        return [SimpleNamespace(pid=41, usedGpuMemory=5 << 20), SimpleNamespace(pid=42, usedGpuMemory=None)]

    def unversioned(h: object) -> list[object]:
        raise pynvml.NVMLLibraryMismatchError("mismatch")

    fake = SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound,
        NVMLLibraryMismatchError=pynvml.NVMLLibraryMismatchError,
        nvmlDeviceGetComputeRunningProcesses_v3=v3,
        nvmlDeviceGetComputeRunningProcesses_v2=v2,
        nvmlDeviceGetComputeRunningProcesses=unversioned,
    )
    v = NvidiaVendor()
    v._nvml = fake
    v._handles["nvidia0"] = object()
    dev = Device(index=0, key="nvidia0", vendor="nvidia", name="H100")
    assert [(p.pid, p.used_memory_bytes) for p in v.processes(dev)] == [(41, 5 << 20), (42, None)]

    def broken(h: object) -> list[object]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    fake.nvmlDeviceGetComputeRunningProcesses_v3 = broken
    assert v.processes(dev) == []
    fake.nvmlDeviceGetComputeRunningProcesses_v3 = fake.nvmlDeviceGetComputeRunningProcesses_v2 = v3
    assert v.processes(dev) == []  # no version answers: unknown, not a raise
