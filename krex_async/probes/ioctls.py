"""Names for the ioctl numbers GPU user-mode drivers send, from the drivers' public headers.

An ioctl number on Linux x86 packs four fields (`_IOC`): bits 0-7 the number `nr`, 8-15 the `type`
(a letter per driver), 16-29 the argument `size`, 30-31 the direction (1 write, 2 read, 3 both).
Three families are named here:

- NVIDIA RM, type 'F', on /dev/nvidiactl and /dev/nvidia<N>: escapes 0x27.. (object and memory
  management, from nv_escape.h) and 200.. (card info, OS events, fd registration, from
  nv-ioctl-numbers.h). The size field varies with the driver's structs, so only type and nr are matched.
- NVIDIA UVM, on /dev/nvidia-uvm: plain numbers with no _IOC fields (UVM_IOCTL_BASE(i) is i on Linux),
  plus UVM_INITIALIZE 0x30000001 and UVM_DEINITIALIZE 0x30000002.
- AMDKFD, type 'K', on /dev/kfd (kfd_ioctl.h).

A plain UVM number is only claimed when the device path is unknown or names nvidia-uvm, so a small
number on another device decodes generically ("_IOC(NONE,0x00,0x05,0)").
"""

from __future__ import annotations

from typing import NamedTuple

IOC_NONE, IOC_WRITE, IOC_READ = 0, 1, 2
_DIRS = {0: "NONE", 1: "W", 2: "R", 3: "WR"}


class Ioc(NamedTuple):
    dir: int  # IOC_NONE, IOC_WRITE, IOC_READ or both
    type: int  # the driver's letter, e.g. ord('F')
    nr: int
    size: int  # bytes of the argument struct


def ioc_fields(cmd: int) -> Ioc:
    """Split an ioctl number into its _IOC fields (x86/arm64 layout)."""
    cmd &= 0xFFFFFFFF
    return Ioc(cmd >> 30, (cmd >> 8) & 0xFF, cmd & 0xFF, (cmd >> 16) & 0x3FFF)


def ioc(dir: int, type: int, nr: int, size: int) -> int:
    """Build an ioctl number from its fields (the inverse of ioc_fields)."""
    return (dir << 30) | (size << 16) | (type << 8) | nr


NV_RM: dict[int, str] = {
    0x27: "NV_ESC_RM_ALLOC_MEMORY",
    0x28: "NV_ESC_RM_ALLOC_OBJECT",
    0x29: "NV_ESC_RM_FREE",
    0x2A: "NV_ESC_RM_CONTROL",
    0x2B: "NV_ESC_RM_ALLOC",
    0x32: "NV_ESC_RM_CONFIG_GET",
    0x33: "NV_ESC_RM_CONFIG_SET",
    0x34: "NV_ESC_RM_DUP_OBJECT",
    0x35: "NV_ESC_RM_SHARE",
    0x37: "NV_ESC_RM_CONFIG_GET_EX",
    0x38: "NV_ESC_RM_CONFIG_SET_EX",
    0x39: "NV_ESC_RM_I2C_ACCESS",
    0x41: "NV_ESC_RM_IDLE_CHANNELS",
    0x4A: "NV_ESC_RM_VID_HEAP_CONTROL",
    0x4D: "NV_ESC_RM_ACCESS_REGISTRY",
    0x4E: "NV_ESC_RM_MAP_MEMORY",
    0x4F: "NV_ESC_RM_UNMAP_MEMORY",
    0x52: "NV_ESC_RM_GET_EVENT_DATA",
    0x54: "NV_ESC_RM_ALLOC_CONTEXT_DMA2",
    0x56: "NV_ESC_RM_ADD_VBLANK_CALLBACK",
    0x57: "NV_ESC_RM_MAP_MEMORY_DMA",
    0x58: "NV_ESC_RM_UNMAP_MEMORY_DMA",
    0x59: "NV_ESC_RM_BIND_CONTEXT_DMA",
    0x5C: "NV_ESC_RM_EXPORT_OBJECT_TO_FD",
    0x5D: "NV_ESC_RM_IMPORT_OBJECT_FROM_FD",
    0x5E: "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO",
    200: "NV_ESC_CARD_INFO",
    201: "NV_ESC_REGISTER_FD",
    206: "NV_ESC_ALLOC_OS_EVENT",
    207: "NV_ESC_FREE_OS_EVENT",
    209: "NV_ESC_STATUS_CODE",
    210: "NV_ESC_CHECK_VERSION_STR",
    211: "NV_ESC_IOCTL_XFER_CMD",
    212: "NV_ESC_ATTACH_GPUS_TO_FD",
    213: "NV_ESC_QUERY_DEVICE_INTR",
    214: "NV_ESC_SYS_PARAMS",
    217: "NV_ESC_EXPORT_TO_DMABUF_FD",
    218: "NV_ESC_WAIT_OPEN_COMPLETE",
}

NV_UVM: dict[int, str] = {
    0x30000001: "UVM_INITIALIZE",
    0x30000002: "UVM_DEINITIALIZE",
    1: "UVM_RESERVE_VA",
    2: "UVM_RELEASE_VA",
    3: "UVM_REGION_COMMIT",
    4: "UVM_REGION_DECOMMIT",
    5: "UVM_REGION_SET_STREAM",
    6: "UVM_SET_STREAM_RUNNING",
    7: "UVM_SET_STREAM_STOPPED",
    9: "UVM_RUN_TEST",
    10: "UVM_ADD_SESSION",
    11: "UVM_REMOVE_SESSION",
    12: "UVM_ENABLE_COUNTERS",
    13: "UVM_MAP_COUNTER",
    14: "UVM_CREATE_EVENT_QUEUE",
    15: "UVM_REMOVE_EVENT_QUEUE",
    16: "UVM_MAP_EVENT_QUEUE",
    17: "UVM_EVENT_CTRL",
    18: "UVM_REGISTER_MPS_SERVER",
    19: "UVM_REGISTER_MPS_CLIENT",
    20: "UVM_GET_GPU_UUID_TABLE",
    23: "UVM_CREATE_RANGE_GROUP",
    24: "UVM_DESTROY_RANGE_GROUP",
    25: "UVM_REGISTER_GPU_VASPACE",
    26: "UVM_UNREGISTER_GPU_VASPACE",
    27: "UVM_REGISTER_CHANNEL",
    28: "UVM_UNREGISTER_CHANNEL",
    29: "UVM_ENABLE_PEER_ACCESS",
    30: "UVM_DISABLE_PEER_ACCESS",
    31: "UVM_SET_RANGE_GROUP",
    33: "UVM_MAP_EXTERNAL_ALLOCATION",
    34: "UVM_FREE",
    35: "UVM_MEM_MAP",
    36: "UVM_DEBUG_ACCESS_MEMORY",
    37: "UVM_REGISTER_GPU",
    38: "UVM_UNREGISTER_GPU",
    39: "UVM_PAGEABLE_MEM_ACCESS",
    40: "UVM_PREVENT_MIGRATION_RANGE_GROUPS",
    41: "UVM_ALLOW_MIGRATION_RANGE_GROUPS",
    42: "UVM_SET_PREFERRED_LOCATION",
    43: "UVM_UNSET_PREFERRED_LOCATION",
    44: "UVM_ENABLE_READ_DUPLICATION",
    45: "UVM_DISABLE_READ_DUPLICATION",
    46: "UVM_SET_ACCESSED_BY",
    47: "UVM_UNSET_ACCESSED_BY",
    51: "UVM_MIGRATE",
    53: "UVM_MIGRATE_RANGE_GROUP",
    54: "UVM_ENABLE_SYSTEM_WIDE_ATOMICS",
    55: "UVM_DISABLE_SYSTEM_WIDE_ATOMICS",
    56: "UVM_TOOLS_INIT_EVENT_TRACKER",
    57: "UVM_TOOLS_SET_NOTIFICATION_THRESHOLD",
    58: "UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS",
    59: "UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS",
    60: "UVM_TOOLS_ENABLE_COUNTERS",
    61: "UVM_TOOLS_DISABLE_COUNTERS",
    62: "UVM_TOOLS_READ_PROCESS_MEMORY",
    63: "UVM_TOOLS_WRITE_PROCESS_MEMORY",
    64: "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE",
    65: "UVM_MAP_DYNAMIC_PARALLELISM_REGION",
    66: "UVM_UNMAP_EXTERNAL",
    67: "UVM_TOOLS_FLUSH_EVENTS",
    68: "UVM_ALLOC_SEMAPHORE_POOL",
    69: "UVM_CLEAN_UP_ZOMBIE_RESOURCES",
    70: "UVM_PAGEABLE_MEM_ACCESS_ON_GPU",
    71: "UVM_POPULATE_PAGEABLE",
    72: "UVM_VALIDATE_VA_RANGE",
    73: "UVM_CREATE_EXTERNAL_RANGE",
    74: "UVM_MAP_EXTERNAL_SPARSE",
    2047: "UVM_IS_8_SUPPORTED",
}

AMDKFD: dict[int, str] = {
    0x01: "AMDKFD_IOC_GET_VERSION",
    0x02: "AMDKFD_IOC_CREATE_QUEUE",
    0x03: "AMDKFD_IOC_DESTROY_QUEUE",
    0x04: "AMDKFD_IOC_SET_MEMORY_POLICY",
    0x05: "AMDKFD_IOC_GET_CLOCK_COUNTERS",
    0x06: "AMDKFD_IOC_GET_PROCESS_APERTURES",
    0x07: "AMDKFD_IOC_UPDATE_QUEUE",
    0x08: "AMDKFD_IOC_CREATE_EVENT",
    0x09: "AMDKFD_IOC_DESTROY_EVENT",
    0x0A: "AMDKFD_IOC_SET_EVENT",
    0x0B: "AMDKFD_IOC_RESET_EVENT",
    0x0C: "AMDKFD_IOC_WAIT_EVENTS",
    0x0D: "AMDKFD_IOC_DBG_REGISTER",
    0x0E: "AMDKFD_IOC_DBG_UNREGISTER",
    0x0F: "AMDKFD_IOC_DBG_ADDRESS_WATCH",
    0x10: "AMDKFD_IOC_DBG_WAVE_CONTROL",
    0x11: "AMDKFD_IOC_SET_SCRATCH_BACKING_VA",
    0x12: "AMDKFD_IOC_GET_TILE_CONFIG",
    0x13: "AMDKFD_IOC_SET_TRAP_HANDLER",
    0x14: "AMDKFD_IOC_GET_PROCESS_APERTURES_NEW",
    0x15: "AMDKFD_IOC_ACQUIRE_VM",
    0x16: "AMDKFD_IOC_ALLOC_MEMORY_OF_GPU",
    0x17: "AMDKFD_IOC_FREE_MEMORY_OF_GPU",
    0x18: "AMDKFD_IOC_MAP_MEMORY_TO_GPU",
    0x19: "AMDKFD_IOC_UNMAP_MEMORY_FROM_GPU",
    0x1A: "AMDKFD_IOC_SET_CU_MASK",
    0x1B: "AMDKFD_IOC_GET_QUEUE_WAVE_STATE",
    0x1C: "AMDKFD_IOC_GET_DMABUF_INFO",
    0x1D: "AMDKFD_IOC_IMPORT_DMABUF",
    0x1E: "AMDKFD_IOC_ALLOC_QUEUE_GWS",
    0x1F: "AMDKFD_IOC_SMI_EVENTS",
    0x20: "AMDKFD_IOC_SVM",
    0x21: "AMDKFD_IOC_SET_XNACK_MODE",
    0x22: "AMDKFD_IOC_CRIU_OP",
    0x23: "AMDKFD_IOC_AVAILABLE_MEMORY",
    0x24: "AMDKFD_IOC_EXPORT_DMABUF",
    0x25: "AMDKFD_IOC_RUNTIME_ENABLE",
    0x26: "AMDKFD_IOC_DBG_TRAP",
}

# A few generic ones that show up on any device file (handy in tests and on DRM render nodes).
GENERIC: dict[int, str] = {
    0x5401: "TCGETS",
    0x5402: "TCSETS",
    0x541B: "FIONREAD",
    0x5421: "FIONBIO",
    0x5451: "FIOCLEX",
    0x5450: "FIONCLEX",
    0x80045430: "TIOCGPTN",
    0x40045431: "TIOCSPTLCK",
}


def family(cmd: int, path: str = "") -> str:
    """The ioctl family: "nvidia-rm", "nvidia-uvm", "amdkfd", "drm" or "" when unknown."""
    f = ioc_fields(cmd)
    if f.type == ord("F") and "nvidia-uvm" not in path:
        return "nvidia-rm"
    if f.type == ord("K") and (not path or path.startswith("/dev/kfd")):
        return "amdkfd"
    if (not path or "nvidia-uvm" in path) and cmd in NV_UVM:
        return "nvidia-uvm"
    if f.type == ord("d"):
        return "drm"
    return ""


def ioctl_name(cmd: int, path: str = "") -> str:
    """A readable name for an ioctl number, using the device path to choose the family when given.

    Never raises: unknown numbers come back as `_IOC(dir,type,nr,size)` with the fields in hex.
    """
    cmd &= 0xFFFFFFFF
    f = ioc_fields(cmd)
    fam = family(cmd, path)
    name = None
    if fam == "nvidia-rm":
        name = NV_RM.get(f.nr)
    elif fam == "amdkfd":
        name = AMDKFD.get(f.nr)
    elif fam == "nvidia-uvm":
        name = NV_UVM.get(cmd)
    if name is None:
        name = GENERIC.get(cmd)
    if name is not None:
        return name
    typ = chr(f.type) if 0x20 < f.type < 0x7F else f"0x{f.type:02x}"
    return f"_IOC({_DIRS[f.dir]},{typ},0x{f.nr:02x},{f.size})"
