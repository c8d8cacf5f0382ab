"""The sibling of bench/gpu/check_lock_states.py: a CUDA process that sits inside chosen driver calls
while the controller locks it. Run as a file (stdlib and ctypes only; torch only in `torch` mode):

    python3 lock_states_sibling.py SHM ops 'JSON_OPS' MAX_S   # libcuda by ctypes, one op after another
    python3 lock_states_sibling.py SHM torch SECONDS MAX_S    # a torch job's phases in a loop, labelled

SHM is a file both sides mmap (layout below). In `ops` mode each op is {"op": "NAME[:ARG]",
"gate": bool}; before a gated op the sibling waits until the controller writes go >= its index,
so the controller is ready to lock when the call starts. Each op's (enter ns, exit ns, CUresult)
is written around the call (CLOCK_MONOTONIC, the controller's clock too). Ops:

    sleep:MS    host sleep (no driver call)         init        cuInit(0)
    ctx         primary context retain + current    alloc:GIB   cuMemAlloc_v2 (clamped to 85% free)
    free        cuMemFree_v2 of the last alloc      hostbuf:GIB pageable host buffer (touched) + device dst
    h2d         cuMemcpyHtoD_v2 of hostbuf          spinmod     load the spin kernel's PTX
    bigptx:MS   build a PTX module whose JIT load takes ~MS ms (CUDA_CACHE_DISABLE=1 keeps it a JIT)
    module      cuModuleLoadData(big PTX)           unload      cuModuleUnload
    spin:MS     launch a kernel spinning MS ms      sync        cuCtxSynchronize
    release     cuDevicePrimaryCtxRelease_v2        exit        process exit, the context still live

With KREX_LOCK_STATES_DRY=1 (a CPU dry run against tests/isolation/fakecuda.py's library) every op
but sleep, init, ctx and exit is the fake's `fakeSlowCall` of a fixed length.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import time
from typing import Any

HEADER = 4096
REC = 32  # per op: t_enter ns, t_exit ns, CUresult, done flag
MAX_OPS = 256
RING = 4096  # torch mode: (t ns, label code) entries after the header
SIZE = HEADER + max(REC * MAX_OPS, 16 * RING)
PID, GO, FAILED, RING_N = 0, 8, 16, 24  # header offsets
LABELS = (
    "import",
    "ctx",
    "setup",
    "h2d",
    "first-op",
    "op",
    "alloc",
    "free",
    "gpu-sync",
    "d2h",
    "cpu",
    "idle",
    "exit",
)
NOT_RUN = -2  # an op skipped because what it needs failed earlier
DRY_MS = {
    "alloc": 80,
    "free": 30,
    "h2d": 100,
    "module": 150,
    "unload": 5,
    "release": 60,
    "hostbuf": 5,
    "spinmod": 5,
    "bigptx": 5,
}


def spin_ptx(header: str) -> str:
    """A kernel that spins until %globaltimer has advanced by its argument (ns)."""
    return (
        header
        + """
.visible .entry spin(.param .u64 ns)
{
  .reg .u64 %rd<5>;
  .reg .pred %p1;
  ld.param.u64 %rd1, [ns];
  mov.u64 %rd2, %globaltimer;
LOOP:
  mov.u64 %rd3, %globaltimer;
  sub.u64 %rd4, %rd3, %rd2;
  setp.lt.u64 %p1, %rd4, %rd1;
  @%p1 bra LOOP;
  ret;
}
"""
    )


def big_ptx(header: str, funcs: int, body: int) -> str:
    """`funcs` kernels of `body` dependent FMAs each: the JIT's time grows with their product (a chain
    read from and stored to memory, so the compiler cannot drop it)."""
    parts = [header]
    for k in range(funcs):
        parts.append(
            f".visible .entry big{k}(.param .u64 p)\n{{\n  .reg .f32 %f<{body + 2}>;\n"
            "  .reg .u64 %rd<2>;\n  ld.param.u64 %rd1, [p];\n  ld.global.f32 %f0, [%rd1];\n"
            "  add.f32 %f1, %f0, 0f3F800000;\n"
        )
        parts.append(
            "".join(f"  fma.rn.f32 %f{j}, %f{j - 1}, %f{j - 2}, 0f3F800000;\n" for j in range(2, body + 2))
        )
        parts.append(f"  st.global.f32 [%rd1], %f{body + 1};\n  ret;\n}}\n")
    return "".join(parts)


HEADERS = (
    ".version 7.0\n.target sm_75\n.address_size 64\n",
    ".version 8.0\n.target sm_90\n.address_size 64\n",
)


class Cuda:
    """The driver entry points the ops use, with argtypes (a pointer passed as a Python int would be
    truncated to 32 bits without them)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ.get("KREX_LIBCUDA") or "libcuda.so.1")
        self.dry = os.environ.get("KREX_LOCK_STATES_DRY") == "1"
        vp, u, i, sz, u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
        sigs: dict[str, list[Any]] = {
            "cuInit": [u],
            "cuDeviceGet": [ctypes.POINTER(i), i],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
            "cuCtxSetCurrent": [vp],
            "cuMemAlloc_v2": [ctypes.POINTER(u64), sz],
            "cuMemFree_v2": [u64],
            "cuMemGetInfo_v2": [ctypes.POINTER(sz), ctypes.POINTER(sz)],
            "cuMemcpyHtoD_v2": [u64, vp, sz],
            "cuModuleLoadData": [ctypes.POINTER(vp), vp],
            "cuModuleUnload": [vp],
            "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)],
            "cuCtxSynchronize": [],
            "cuDevicePrimaryCtxRelease_v2": [i],
            "fakeSlowCall": [ctypes.c_ulong],
        }
        self.fn: dict[str, Any] = {}
        for name, args in sigs.items():
            f = getattr(self.lib, name, None)
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_int
                self.fn[name] = f
        self.dev = 0
        self.ctx = ctypes.c_void_p()
        self.allocs: list[int] = []
        self.host: mmap.mmap | None = None
        self.host_addr = self.h2d_dst = self.h2d_size = 0
        self.header = HEADERS[0]
        self.spin_f = ctypes.c_void_p()
        self.big: Any = None
        self.mod = ctypes.c_void_p()
        self.pending_spin_ms = 0.0
        self.info: dict[str, Any] = {}

    def call(self, name: str, *args: Any) -> int:
        f = self.fn.get(name)
        if f is None:
            raise RuntimeError(f"{name} missing from {self.lib._name}")
        return int(f(*args))

    def slow(self, ms: float) -> int:
        return self.call("fakeSlowCall", int(ms * 1000))

    def load(self, image: Any, out: ctypes.c_void_p) -> int:
        return self.call("cuModuleLoadData", ctypes.byref(out), ctypes.cast(image, ctypes.c_void_p))

    def run(self, op: str) -> int:
        """One op; its CUresult (0 for host-only ops)."""
        name, _, arg = op.partition(":")
        if name == "sleep":
            time.sleep(float(arg) / 1000)
            return 0
        if name == "init":
            return self.call("cuInit", 0)
        if name == "ctx":
            d = ctypes.c_int(0)
            if "cuDeviceGet" in self.fn and self.call("cuDeviceGet", ctypes.byref(d), 0) == 0:
                self.dev = d.value
            rc = self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.dev)
            return rc or self.call("cuCtxSetCurrent", self.ctx)
        if name == "exit":
            sys.stdout.flush()
            sys.exit(0)  # a normal exit: Python's finalisation, then libcuda's own teardown at exit()
        if self.dry:
            if name == "spin":
                self.pending_spin_ms = float(arg)
                return 0
            if name == "sync":
                ms, self.pending_spin_ms = self.pending_spin_ms, 0.0
                return self.slow(ms)
            return self.slow(DRY_MS.get(name, 10))
        if name == "alloc":
            want = int(float(arg) * (1 << 30))
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            if self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total)) == 0:
                want = max(1 << 20, min(want, int(free.value * 0.85)))
            self.info.setdefault("alloc_bytes", []).append(want)
            p = ctypes.c_uint64()
            rc = self.call("cuMemAlloc_v2", ctypes.byref(p), want)
            if rc == 0:
                self.allocs.append(p.value)
            return rc
        if name == "free":
            return self.call("cuMemFree_v2", self.allocs.pop()) if self.allocs else NOT_RUN
        if name == "hostbuf":
            self.h2d_size = int(float(arg) * (1 << 30))
            self.host = mmap.mmap(-1, self.h2d_size)
            self.host_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.host))
            ctypes.memset(self.host_addr, 1, self.h2d_size)  # touched: a real input, not the zero page
            p = ctypes.c_uint64()
            rc = self.call("cuMemAlloc_v2", ctypes.byref(p), self.h2d_size)
            self.h2d_dst = p.value if rc == 0 else 0
            return rc
        if name == "h2d":
            if not self.h2d_dst:
                return NOT_RUN
            return self.call("cuMemcpyHtoD_v2", self.h2d_dst, self.host_addr, self.h2d_size)
        if name == "spinmod":
            rc = -1
            for header in HEADERS:  # the first PTX ISA this driver's JIT accepts
                mod = ctypes.c_void_p()
                buf = ctypes.create_string_buffer(spin_ptx(header).encode())
                rc = self.load(buf, mod)
                if rc == 0:
                    self.header = header
                    self.info["ptx_header"] = header.split("\n")[:2]
                    return self.call("cuModuleGetFunction", ctypes.byref(self.spin_f), mod, b"spin")
            return rc
        if name == "bigptx":
            return self.calibrate(float(arg))
        if name == "module":
            if self.big is None:
                return NOT_RUN
            self.mod = ctypes.c_void_p()
            return self.load(self.big, self.mod)
        if name == "unload":
            return self.call("cuModuleUnload", self.mod) if self.mod.value else NOT_RUN
        if name == "spin":
            if not self.spin_f.value:
                return NOT_RUN
            ns = ctypes.c_uint64(int(float(arg) * 1e6))
            params = (ctypes.c_void_p * 1)(ctypes.c_void_p(ctypes.addressof(ns)))
            return self.call("cuLaunchKernel", self.spin_f, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        if name == "sync":
            return self.call("cuCtxSynchronize")
        if name == "release":
            return self.call("cuDevicePrimaryCtxRelease_v2", self.dev)
        raise ValueError(f"unknown op {op!r}")

    def calibrate(self, target_ms: float) -> int:
        """Size the big module so that one JIT load takes about `target_ms` (one small load timed,
        scaled, then the final one timed for the record)."""

        def timed(funcs: int, body: int) -> tuple[int, float, Any]:
            buf = ctypes.create_string_buffer(big_ptx(self.header, funcs, body).encode())
            mod = ctypes.c_void_p()
            t0 = time.perf_counter()
            rc = self.load(buf, mod)
            dt = time.perf_counter() - t0
            if rc == 0:
                self.call("cuModuleUnload", mod)
            return rc, dt, buf

        funcs, body = 4, 400
        rc, probe_s, _ = timed(funcs, body)
        if rc != 0:
            return rc
        scale = target_ms / 1000 / max(probe_s, 1e-4)
        if scale >= 1:
            funcs = max(1, min(400, round(funcs * scale)))  # 400: ~7 MB of PTX, seconds of JIT
        else:
            funcs, body = 1, max(20, round(body * funcs * scale))
        rc, dt, buf = timed(funcs, body)
        self.info["bigptx"] = {
            "funcs": funcs,
            "body": body,
            "bytes": len(buf.raw),
            "load_s": dt,
            "probe_s": probe_s,
            "target_s": target_ms / 1000,
        }
        if rc == 0:
            self.big = buf
        return rc


def ops_main(m: mmap.mmap, ops: list[dict[str, Any]], max_s: float) -> None:
    cuda = Cuda()
    parent, end = os.getppid(), time.monotonic() + max_s
    struct.pack_into("q", m, PID, os.getpid())
    for i, o in enumerate(ops):
        if o.get("gate"):
            while struct.unpack_from("q", m, GO)[0] < i:
                if time.monotonic() > end or os.getppid() != parent:
                    struct.pack_into("q", m, FAILED, 1)  # the controller is gone or stuck: give up
                    sys.exit(3)
                time.sleep(0.0001)
        off = HEADER + REC * i
        struct.pack_into("q", m, off, time.monotonic_ns())
        if o["op"] == "exit":
            print(json.dumps({"info": cuda.info}), flush=True)
        try:
            rc = cuda.run(o["op"])
        except (RuntimeError, ValueError, OSError) as e:
            print(json.dumps({"op": i, "error": repr(e)}), flush=True)
            rc = -1
        struct.pack_into("qqq", m, off + 8, time.monotonic_ns(), rc, 1)
    print(json.dumps({"info": cuda.info}), flush=True)


def torch_main(m: mmap.mmap, seconds: float) -> None:
    """A job's phases in a loop, each labelled in the ring before it starts: the controller locks
    at random moments and reads which phase each lock landed in."""
    n = [0]

    def mark(label: str) -> None:
        k = n[0] % RING
        struct.pack_into("qq", m, HEADER + 16 * k, time.monotonic_ns(), LABELS.index(label))
        n[0] += 1
        struct.pack_into("q", m, RING_N, n[0])

    struct.pack_into("q", m, PID, os.getpid())
    mark("import")
    import torch  # the import is a phase too: no CUDA yet

    t_end = time.monotonic() + seconds
    mark("ctx")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    mark("setup")
    host = torch.ones(1 << 28)  # 1 GiB of float32, pageable
    a16 = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    firsts: list[Any] = [
        lambda: a16 @ a16,
        lambda: a16.float() @ a16.float(),
        lambda: a16.bfloat16() @ a16.bfloat16(),
        lambda: torch.nn.functional.conv2d(
            torch.randn(8, 64, 56, 56, device="cuda"), torch.randn(64, 64, 3, 3, device="cuda")
        ),
        lambda: torch.fft.fft(torch.randn(1 << 20, device="cuda")),
        lambda: torch.softmax(a16, -1),
        lambda: torch.nn.functional.layer_norm(a16.float(), (4096,)),
        lambda: torch.sort(torch.randn(1 << 20, device="cuda")),
        lambda: torch.topk(torch.randn(1 << 20, device="cuda"), 100),
        lambda: torch.cumsum(torch.randn(1 << 20, device="cuda"), 0),
        lambda: torch.linalg.qr(torch.randn(512, 512, device="cuda")),
        lambda: torch.nn.functional.scaled_dot_product_attention(
            *(torch.randn(4, 8, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        ),
    ]
    it = 0
    while time.monotonic() < t_end:
        mark("h2d")
        d = host.to("cuda")
        if it < len(firsts):
            mark("first-op")
            try:
                firsts[it]()
            except Exception as e:  # one op kind missing must not end the job
                print(json.dumps({"first_op": it, "error": repr(e)[:300]}), flush=True)
        mark("op")
        for _ in range(20):
            d.mul_(1.0001)
        mark("alloc")
        big = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        mark("free")
        del big
        torch.cuda.empty_cache()
        mark("gpu-sync")
        for _ in range(10):
            a16 @ a16
        torch.cuda.synchronize()
        mark("d2h")
        d[: 1 << 26].cpu()
        mark("cpu")
        s = 0
        for i in range(300_000):
            s += i
        mark("idle")
        time.sleep(0.03)
        it += 1
    print(json.dumps({"info": {"iterations": it, "torch": torch.__version__}}), flush=True)
    mark("exit")


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, SIZE)
    if mode == "ops":
        ops_main(m, json.loads(sys.argv[3]), float(sys.argv[4]))
    elif mode == "torch":
        torch_main(m, float(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
