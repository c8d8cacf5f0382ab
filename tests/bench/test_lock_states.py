"""bench/gpu/check_lock_states.py without a GPU: its offsets, classification and summary, and a dry
run end to end against tests/isolation/fakecuda.py's library (NOT_READY inside a call, the context's
creation included, when the timeout is shorter than what is left of it; a lock as the call ends
when it is longer; a lock on an idle process at once)."""

from __future__ import annotations

import json
import mmap
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import check_lock_states as cls
from tests.bench.conftest import run_script
from tests.isolation.fakecuda import build


def test_plan_alternates_timeouts_and_spreads_offsets() -> None:
    got = [cls.plan(j, 6, [5, 1000]) for j in range(6)]
    assert [t for t, _ in got] == [5, 1000] * 3
    assert sorted(f for t, f in got if t == 5) == [1 / 6, 0.5, 5 / 6]
    assert all(0 < f < 1 for _, f in got)
    assert cls.plan(7, 6, [5, 1000]) == cls.plan(1, 6, [5, 1000])  # wraps past n


def test_where_names_the_op_in_flight() -> None:
    recs = [
        {"op": "sleep:30", "t_enter": 100, "t_exit": 200},
        {"op": "init", "t_enter": 200, "t_exit": 300},
        {"op": "alloc:8", "t_enter": 350, "t_exit": 400},
        {"op": "exit", "t_enter": 500, "t_exit": 0},
    ]
    assert cls.where(recs, 50) == "before"
    assert cls.where(recs, 150) == "sleep"
    assert cls.where(recs, 250) == "init"
    assert cls.where(recs, 320) == "between"
    assert cls.where(recs, 360) == "alloc"
    assert cls.where(recs, 900) == "exit"  # an exit not yet reaped is still in flight


def attempt(
    scenario: str, target: str, where: str, rc: int, before_rc: int = 0, until: float | None = None
) -> dict[str, object]:
    a: dict[str, object] = {
        "scenario": scenario,
        "target": target,
        "where": where,
        "timeout_ms": 5,
        "rc": rc,
        "name": "locked" if rc == 0 else f"CUDA_ERROR_X ({rc})",
        "lock_ms": 0.5,
        "state_before_rc": before_rc,
        "state_before": "running",
        "state_after": "locked" if rc == 0 else "running",
    }
    if rc in cls.RETRY_RCS:
        a["retry"] = {
            "attempts": 3,
            "final_rc": 0 if until else rc,
            "final_name": "locked" if until else "x",
            "until_locked_ms": until,
        }
    return a


def test_summary_and_verdict_tell_context_from_no_context() -> None:
    xs = [
        attempt("warm", "alloc", "alloc", 600, 0, 12.0),
        attempt("warm", "alloc", "alloc", 0),
        attempt("lifecycle-exit", "startup", "ctx", 600, 1, 200.0),
        attempt("lifecycle-exit", "startup", "ctx", 600, 1, None),
        attempt("warm", "h2d", "h2d", 909, 0, 40.0),
    ]
    rows = cls.summarize(xs)
    alloc = next(r for r in rows if r["target"] == "alloc")
    assert alloc["n"] == 2 and alloc["retried"] == 1 and alloc["retry_locked_ms"] == "12.00/12.00"
    v = cls.verdict(xs)
    assert v["not_ready"] == 3
    assert v["not_ready_with_context"] == "warm/alloc/alloc:1"
    assert v["not_ready_without_context"] == "lifecycle-exit/startup/ctx:2"
    assert v["timeouts"] == "warm/h2d/h2d:1"
    assert v["never_locked_after_not_ready"] == 1
    assert v["not_ready_until_locked_ms"]["max"] == 200.0
    assert "alloc" in cls.table(rows)


@pytest.mark.slow  # about 6 s: two dozen sibling processes
def test_dry_run_against_the_fake_driver(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    fake = build(tmp_path / "fake")
    out = tmp_path / "out"
    p = run_script(
        "-m",
        "bench.gpu.check_lock_states",
        "--dry-run",
        "--reps",
        "2",
        "--lifecycle-reps",
        "2",
        "--kernel-ms",
        "60",
        "--deadline",
        "60",
        "--only",
        "warm,lifecycle",
        env={**fake.env(FAKE_CUDA_CTX_MS="120"), "OUT": str(out)},
        timeout=120,
    )
    assert "VERDICT" in p.stdout
    data = json.loads((out / "check_lock_states.json").read_text())
    assert not data["errors"], data["errors"]
    by = {(a["target"], a["timeout_ms"]): a for a in data["attempts"]}
    # as driver 580 on the H200: inside the context's creation a 5 ms lock answers NOT_READY and
    # a retry locks; a 1 s lock waits for the creation to end and locks
    startup = [a for a in data["attempts"] if a["target"] == "startup" and a["where"] == "ctx"]
    short = [a for a in startup if a["timeout_ms"] == 5]
    assert short and all(a["rc"] == cls.NOT_READY for a in short), startup
    assert all(a["retry"]["until_locked_ms"] is not None for a in short)
    assert all(a["rc"] == 0 for a in startup if a["timeout_ms"] == 1000), startup
    # a 5 ms lock on a process inside an 80 ms call answers NOT_READY; a 1 s one waits for its end
    assert by[("alloc", 5)]["rc"] == cls.NOT_READY and by[("alloc", 1000)]["rc"] == 0
    assert by[("idle", 5)]["rc"] == 0 and by[("idle", 5)]["lock_ms"] < 50
    assert {
        "alloc",
        "free",
        "h2d",
        "module-load",
        "kernel+sync",
        "kernel+host-idle",
        "idle",
        "teardown-exit",
        "teardown-release",
    } <= {a["target"] for a in data["attempts"]}
    assert "torch" not in data["scenarios"]
    assert (out / "check_lock_states.txt").read_text().count("VERDICT") == 1


# A libcuda stand-in for the sibling's real (not dry-run) op paths: every handle and device pointer
# is above 4 GiB (a pointer passed without argtypes would be truncated), and each call checks and
# logs what it was given, so the ctypes plumbing the H200 will run is exercised here.
ARGS_LIB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef unsigned long long u64;
static FILE *logf_;
static void lg(const char *fmt, u64 a, u64 b) {
    if (!logf_) logf_ = fopen(getenv("FAKE_LOG"), "a");
    fprintf(logf_, fmt, a, b); fputc('\n', logf_); fflush(logf_);
}
#define BASE 0x7f1200000000ULL
int cuInit(unsigned f) { lg("init %llu %llu", f, 0); return 0; }
int cuDeviceGet(int *d, int ord) { *d = ord; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(BASE + 1); return 0; }
int cuCtxSetCurrent(void *ctx) { return ctx == (void *)(BASE + 1) ? 0 : 1; }
int cuMemGetInfo_v2(size_t *free, size_t *total) { *free = 2ULL << 30; *total = 4ULL << 30; return 0; }
static u64 next = BASE + 0x1000;
int cuMemAlloc_v2(u64 *p, size_t n) { *p = next; next += n; lg("alloc %llu %llu", *p, n); return 0; }
int cuMemFree_v2(u64 p) { lg("free %llu %llu", p, 0); return p >= BASE ? 0 : 1; }
int cuMemcpyHtoD_v2(u64 dst, const unsigned char *src, size_t n) {
    lg("h2d %llu %llu", dst, n);
    return (dst >= BASE && src[0] == 1 && src[n - 1] == 1) ? 0 : 1;
}
int cuModuleLoadData(void **mod, const char *image) {
    if (strncmp(image, ".version", 8)) return 218;
    *mod = (void *)(BASE + 2); lg("load %llu %llu", strlen(image), 0); return 0;
}
int cuModuleGetFunction(void **f, void *mod, const char *name) {
    if (mod != (void *)(BASE + 2) || strcmp(name, "spin")) return 500;
    *f = (void *)(BASE + 3); return 0;
}
int cuModuleUnload(void *mod) { return mod == (void *)(BASE + 2) ? 0 : 1; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shm, void *stream, void **params, void **extra) {
    if (f != (void *)(BASE + 3) || gx != 1 || bx != 1 || stream || extra) return 1;
    lg("launch %llu %llu", *(u64 *)params[0], 0); return 0;
}
int cuCtxSynchronize(void) { return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { lg("release %llu %llu", dev, 0); return 0; }
"""


def test_sibling_ops_pass_the_driver_what_it_expects(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing")
    (tmp_path / "args.c").write_text(ARGS_LIB)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "args.c")], check=True)
    shm = tmp_path / "shm"
    shm.write_bytes(b"\0" * cls.sib.SIZE)
    ops = [
        "init",
        "ctx",
        "alloc:1",
        "free",
        "hostbuf:0.01",
        "h2d",
        "spinmod",
        "bigptx:5",
        "module",
        "unload",
        "spin:3",
        "sync",
        "alloc:64",
        "release",
        "exit",
    ]
    log = tmp_path / "calls.log"
    p = subprocess.run(
        [
            sys.executable,
            str(cls.SIBLING),
            str(shm),
            "ops",
            json.dumps([{"op": o, "gate": False} for o in ops]),
            "30",
        ],
        env={"KREX_LIBCUDA": str(lib), "FAKE_LOG": str(log), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    with open(shm, "r+b") as f:
        m = mmap.mmap(f.fileno(), cls.sib.SIZE)
        recs = [struct.unpack_from("qqqq", m, cls.sib.HEADER + cls.sib.REC * i) for i in range(len(ops))]
    assert [r[2] for r in recs[:-1]] == [0] * (len(ops) - 1), list(zip(ops, recs))
    assert all(r[0] and r[1] >= r[0] for r in recs[:-1]) and recs[-1][0]  # exit: entered, never left
    calls = log.read_text().splitlines()
    assert "launch 3000000 0" in calls  # the spin kernel got its length in ns through kernelParams
    allocs = [c for c in calls if c.startswith("alloc")]
    assert allocs[0].endswith(str(1 << 30)) and allocs[-1].endswith(str(int((2 << 30) * 0.85)))
    assert any(c.startswith("h2d") and c.endswith(str(int(0.01 * (1 << 30)))) for c in calls)
    assert sum(c.startswith("load") for c in calls) >= 4  # spin, two calibration loads, the module
    info = json.loads(p.stdout.strip().splitlines()[-1])["info"]
    assert info["bigptx"]["funcs"] >= 1 and info["ptx_header"]


# torch as the torch scenario's sibling uses it, every call a no-op: the controller's torch path
# (the phase ring, each lock's phase, the JSON) runs without a GPU; the fake driver knows no such
# process, so every lock answers CUDA_ERROR_INVALID_VALUE
STUB_TORCH = """
__version__ = "stub"
class _Any:
    def __getattr__(self, name): return self
    def __call__(self, *a, **k): return self
    def __matmul__(self, o): return self
    def __getitem__(self, k): return self
def __getattr__(name): return _Any()
"""


@pytest.mark.slow  # about 5 s
def test_torch_scenario_with_a_stub_torch(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    fake = build(tmp_path / "fake")
    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "torch.py").write_text(STUB_TORCH)
    out = tmp_path / "out"
    run_script(
        "-m",
        "bench.gpu.check_lock_states",
        "--dry-run",
        "--only",
        "torch",
        "--torch-seconds",
        "2",
        "--torch-period-ms",
        "40",
        "--deadline",
        "30",
        env={
            **fake.env(),
            "OUT": str(out),
            "PYTHONPATH": f"{tmp_path / 'stub'}:{Path(cls.__file__).resolve().parents[2]}",
        },
        timeout=90,
    )
    data = json.loads((out / "check_lock_states.json").read_text())
    assert not data["errors"], data["errors"]
    xs = [a for a in data["attempts"] if a["scenario"] == "torch"]
    assert len(xs) >= 10
    assert {a["where"] for a in xs} & {"h2d", "op", "alloc", "free", "gpu-sync", "d2h", "cpu", "idle"}
    assert all(a["rc"] == 1 for a in xs)  # the fake driver: no such CUDA process
    assert data["siblings"][-1]["labels"]
