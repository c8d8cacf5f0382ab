"""`krex doctor`'s checks of tracing, BPF and GPUs (the cgroup checks are in doctor_cgroup.py, the
package checks in doctor.py).

Everything that loads a foreign library (bcc, NVML, AMD SMI, libcuda) runs in a child interpreter
with a timeout and reports one JSON line prefixed with `KREX-DOCTOR `, so a library that prints to
stdout (amdsmi without ROCm does), raises at import, hangs or crashes costs its own check only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from krex_async.linux import procfs
from krex_async.ops.doctor_check import FAIL, OK, WARN, Check

DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # Debian's python3-bpfcc lives here
MARK = "KREX-DOCTOR "


def child(code: str, timeout: float, bcc_path: bool = False) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; its `report(dict)` line is the result. On a timeout, a
    crash or no report: {"status": "error", "error": why}."""
    prelude = f"import json, sys\ndef report(d): print({MARK!r} + json.dumps(d), flush=True); sys.exit(0)\n"
    env = dict(os.environ)
    if bcc_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), DIST_PACKAGES) if p)
    try:
        p = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"did not finish within {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])  # type: ignore[no-any-return]
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"status": "error", "error": f"exit {p.returncode}: {tail}"}


def _mounted(fstype: str) -> list[str]:
    return [m.point for m in procfs.mounts(fstype)]


def check_tracing() -> list[Check]:
    tr, dbg = _mounted("tracefs"), _mounted("debugfs")
    return [
        Check(
            "tracefs",
            OK if tr else WARN,
            f"mounted at {', '.join(tr)}"
            if tr
            else "not mounted (bcc tracepoints and the tracefs probe backend need it)",
            "" if tr else "mount -t tracefs nodev /sys/kernel/tracing",
            {"mounts": tr},
        ),
        Check(
            "debugfs",
            OK if dbg else WARN,
            f"mounted at {', '.join(dbg)}"
            if dbg
            else "not mounted (older tools look for /sys/kernel/debug/tracing)",
            "" if dbg else "mount -t debugfs none /sys/kernel/debug",
            {"mounts": dbg},
        ),
    ]


def headers_release(build: str) -> str | None:
    """The kernel release the headers at `build` were made for (include/generated/utsrelease.h)."""
    try:
        with open(os.path.join(build, "include", "generated", "utsrelease.h")) as f:
            for line in f:
                if line.startswith("#define UTS_RELEASE"):
                    return line.split('"')[1]
    except (OSError, IndexError):
        pass
    name = os.path.basename(os.path.realpath(build))  # /usr/src/linux-headers-<release>
    return name[len("linux-headers-") :] if name.startswith("linux-headers-") else None


_BCC_IMPORT = """
try:
    import bcc
except Exception as e:
    report({"status": "missing", "error": f"{type(e).__name__}: {e}"})
report({"status": "ok", "version": getattr(bcc, "__version__", "?"), "file": bcc.__file__})
"""

_BPF_LOAD = """
import os, time
from bcc import BPF
if not BPF.tracepoint_exists("syscalls", "sys_enter_getppid"):
    report({"status": "error", "error": "tracepoint syscalls:sys_enter_getppid does not exist"})
t0 = time.perf_counter()
b = BPF(text='''
BPF_ARRAY(hits, u64, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) { hits.increment(0); return 0; }
''')
t1 = time.perf_counter()
for _ in range(3):
    os.getppid()
n = sum(v.value for v in b["hits"].values())
b.cleanup()
report({"status": "ok", "compile_s": t1 - t0, "hits": n})
"""


def check_bpf(timeout: float = 60.0) -> list[Check]:
    """bcc importable (with Debian's dist-packages on the path), kernel headers, a program loads."""
    out = []
    imp = child(_BCC_IMPORT, 30, bcc_path=True)
    if imp["status"] == "ok":
        out.append(Check("bcc", OK, f"bcc {imp['version']} ({imp['file']})", data=imp))
    else:
        out.append(
            Check(
                "bcc",
                WARN,
                f"not importable: {imp['error']} (probes are off without it)",
                f"apt-get install python3-bpfcc, then make {DIST_PACKAGES} visible to "
                "krex's interpreter (a .pth file in its site-packages)",
                imp,
            )
        )
    release = os.uname().release
    build = f"/lib/modules/{release}/build"
    if not os.path.exists(build):
        out.append(
            Check(
                "kernel headers",
                WARN,
                f"{build} does not exist",
                f"apt-get install linux-headers-{release}; or, where none exist for this "
                "kernel, link build and source to the nearest linux-headers-* trees "
                "(tracepoint arguments and uprobes only)",
            )
        )
    else:
        have = headers_release(build)
        if have == release:
            out.append(Check("kernel headers", OK, f"{build} matches the running kernel {release}"))
        else:
            out.append(
                Check(
                    "kernel headers",
                    WARN,
                    f"{build} holds headers for {have or '?'}, the "
                    f"kernel is {release}: programs compile, but only tracepoint arguments "
                    "and uprobes are safe to use (krex's probes use nothing else)",
                    f"install linux-headers-{release} if the distribution has them",
                    {"headers": have, "kernel": release},
                )
            )
    if imp["status"] != "ok":
        out.append(Check("bpf program", WARN, "not tried: bcc is not importable", "see `bcc`"))
        return out
    if os.geteuid() != 0:
        out.append(
            Check(
                "bpf program", WARN, "not tried: loading BPF needs root (CAP_BPF)", "run krex doctor as root"
            )
        )
        return out
    r = child(_BPF_LOAD, timeout, bcc_path=True)
    if r["status"] == "ok" and r["hits"] >= 3:
        out.append(
            Check(
                "bpf program",
                OK,
                f"a tracepoint program compiled in {r['compile_s']:.2f} s and counted {r['hits']} events",
                data=r,
            )
        )
    elif r["status"] == "ok":
        out.append(
            Check(
                "bpf program",
                FAIL,
                f"loaded, but counted {r['hits']} of 3 events",
                "report the kernel version and `krex doctor --json`",
                r,
            )
        )
    else:
        out.append(
            Check(
                "bpf program",
                FAIL,
                f"did not load: {r['error']}",
                "check kernel headers (above) and that tracefs is mounted",
                r,
            )
        )
    return out


_NVML = """
try:
    import pynvml
except ImportError as e:
    report({"status": "missing", "error": str(e)})
try:
    pynvml.nvmlInit()
except Exception as e:
    report({"status": "unavailable", "error": f"{type(e).__name__}: {e}"})
def s(x):
    return x.decode() if isinstance(x, bytes) else str(x)
gpus = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    gpus.append({"index": i, "name": s(pynvml.nvmlDeviceGetName(h)),
                 "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total)})
drv = s(pynvml.nvmlSystemGetDriverVersion())
pynvml.nvmlShutdown()
report({"status": "ok", "driver": drv, "gpus": gpus})
"""

_AMD = """
import contextlib, io
try:
    with contextlib.redirect_stdout(io.StringIO()):
        import amdsmi
except ImportError as e:
    report({"status": "missing", "error": str(e)})
except Exception as e:  # KeyError('libamd_smi.so') without ROCm
    report({"status": "unavailable", "error": f"{type(e).__name__}: {e} (no ROCm library)"})
try:
    amdsmi.amdsmi_init()
    gpus = []
    for i, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
        asic = amdsmi.amdsmi_get_gpu_asic_info(h)
        drv = amdsmi.amdsmi_get_gpu_driver_info(h)
        gpus.append({"index": i, "name": asic.get("market_name", "?"),
                     "driver": drv.get("driver_version", "?")})
    amdsmi.amdsmi_shut_down()
except Exception as e:
    report({"status": "unavailable", "error": f"{type(e).__name__}: {e}"})
report({"status": "ok", "driver": gpus[0]["driver"] if gpus else "", "gpus": gpus})
"""


def check_gpus() -> list[Check]:
    out = []
    for name, code, pkg in (("gpu nvidia", _NVML, "nvidia-ml-py"), ("gpu amd", _AMD, "amdsmi")):
        r = child(code, 30)
        if r["status"] == "ok" and r["gpus"]:
            names = "; ".join(f"{g['index']}: {g['name']}" for g in r["gpus"])
            out.append(Check(name, OK, f"driver {r['driver']}, {len(r['gpus'])} GPU(s): {names}", data=r))
        elif r["status"] == "ok":
            out.append(Check(name, WARN, f"driver {r['driver']} but no GPU", "", r))
        elif r["status"] == "missing":
            out.append(Check(name, WARN, f"{pkg} is not installed", f"pip install {pkg}", r))
        else:
            out.append(
                Check(
                    name,
                    WARN,
                    f"unavailable: {r['error']}",
                    "none needed on a node without such GPUs; else install the driver",
                    r,
                )
            )
    if not any(c.verdict == OK for c in out):
        out.append(
            Check(
                "devices",
                WARN,
                "no GPU found: commands run on the `cpu` device",
                "none needed on a CPU-only node",
            )
        )
    return out


_CUDA = """
import ctypes, time
lib = None
for n in ("libcuda.so.1", "libcuda.so"):
    try:
        lib = ctypes.CDLL(n)
        break
    except OSError:
        pass
if lib is None:
    report({"status": "missing", "error": "libcuda.so.1 not found"})
def ck(r, what):
    if r != 0:
        report({"status": "error", "error": f"{what} returned CUDA error {r}"})
t0 = time.perf_counter()
ck(lib.cuInit(0), "cuInit")
t1 = time.perf_counter()
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
ck(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ck(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ck(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)), "cuMemAlloc")
t2 = time.perf_counter()
lib.cuMemFree_v2(ptr)
lib.cuDevicePrimaryCtxRelease(dev)
report({"status": "ok", "init_s": t1 - t0, "context_s": t2 - t1, "total_s": t2 - t0})
"""


def check_cuda_context(timeout: float = 120.0) -> Check:
    """Time cuInit + primary context + a 1 MiB allocation in a fresh process (`--gpu`)."""
    r = child(_CUDA, timeout)
    if r["status"] == "missing":
        return Check("cuda context", WARN, r["error"], "install the NVIDIA driver", r)
    if r["status"] != "ok":
        return Check("cuda context", FAIL, r["error"], "check `nvidia-smi`", r)
    slow = r["total_s"] > 1.0
    return Check(
        "cuda context",
        WARN if slow else OK,
        f"{r['total_s']:.2f} s per fresh process (cuInit {r['init_s']:.2f} s, context and "
        f"1 MiB {r['context_s']:.2f} s)" + ("; slow: the ctxpool hides this" if slow else ""),
        "",
        r,
    )


_LOCK = """
from krex_async.isolation.cudalock import library_path, open_driver
drv, why = open_driver()
if drv is None:
    report({"status": "unavailable", "error": why, "library": library_path()})
report({"status": "ok", "library": drv.path, "driver_version": drv.version})
"""


def check_driver_lock(timeout: float = 60.0) -> Check:
    """Whether `--hold lock|auto` can lock siblings through the CUDA driver here, and why not."""
    r = child(_LOCK, timeout)
    if r["status"] == "ok":
        return Check(
            "driver lock",
            OK,
            f"cuCheckpointProcessLock in {r['library']} (driver API "
            f"{r['driver_version']}): --hold auto locks CUDA siblings",
            data=r,
        )
    why = r["error"]
    if "cannot load" in why:
        fix = "none needed on a node without NVIDIA GPUs (regions freeze siblings)"
    elif "predates" in why:
        fix = (
            "update the NVIDIA driver (the checkpoint API came with CUDA 12.8, driver 570); "
            "meanwhile regions freeze siblings"
        )
    else:
        fix = "check `nvidia-smi`; meanwhile regions freeze siblings"
    return Check("driver lock", WARN, f"unavailable: {why}", fix, r)


__all__ = [
    "check_bpf",
    "check_cuda_context",
    "check_driver_lock",
    "check_gpus",
    "check_tracing",
    "child",
    "headers_release",
    "FAIL",
]
