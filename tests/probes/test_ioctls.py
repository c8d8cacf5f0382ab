"""Ioctl names from the drivers' public numbers."""

from __future__ import annotations

from krex_async.probes.ioctls import IOC_READ, IOC_WRITE, family, ioc, ioc_fields, ioctl_name

RW = IOC_READ | IOC_WRITE


def test_nvidia_rm() -> None:
    control = ioc(RW, ord("F"), 0x2A, 32)  # NV_ESC_RM_CONTROL with NVOS54_PARAMETERS
    assert control == 0xC020462A
    assert ioctl_name(control, "/dev/nvidiactl") == "NV_ESC_RM_CONTROL"
    assert ioctl_name(ioc(RW, ord("F"), 0x2B, 48), "/dev/nvidia0") == "NV_ESC_RM_ALLOC"
    assert ioctl_name(ioc(RW, ord("F"), 206, 16)) == "NV_ESC_ALLOC_OS_EVENT"
    assert ioctl_name(ioc(RW, ord("F"), 200, 0x900)) == "NV_ESC_CARD_INFO"
    assert ioctl_name(ioc(RW, ord("F"), 0x4E, 56)) == "NV_ESC_RM_MAP_MEMORY"


def test_nvidia_uvm_plain_numbers() -> None:
    assert ioctl_name(0x30000001, "/dev/nvidia-uvm") == "UVM_INITIALIZE"
    assert ioctl_name(37, "/dev/nvidia-uvm") == "UVM_REGISTER_GPU"
    assert ioctl_name(37) == "UVM_REGISTER_GPU"  # path unknown: the plain number is UVM's
    assert family(37, "/dev/dri/renderD128") == ""  # but not on another device
    assert ioctl_name(37, "/dev/dri/renderD128").startswith("_IOC(")


def test_amdkfd() -> None:
    assert ioctl_name(ioc(IOC_READ, ord("K"), 0x01, 8), "/dev/kfd") == "AMDKFD_IOC_GET_VERSION"
    assert ioctl_name(ioc(RW, ord("K"), 0x02, 96)) == "AMDKFD_IOC_CREATE_QUEUE"
    assert ioctl_name(ioc(RW, ord("K"), 0x16, 40)) == "AMDKFD_IOC_ALLOC_MEMORY_OF_GPU"
    assert ioctl_name(ioc(RW, ord("K"), 0x18, 24)) == "AMDKFD_IOC_MAP_MEMORY_TO_GPU"


def test_fields_roundtrip_and_unknown() -> None:
    f = ioc_fields(0xC020462A)
    assert (f.dir, chr(f.type), f.nr, f.size) == (RW, "F", 0x2A, 32)
    assert ioctl_name(ioc(IOC_WRITE, ord("Z"), 0x7, 4)) == "_IOC(W,Z,0x07,4)"
    assert ioctl_name(0x5401) == "TCGETS"
