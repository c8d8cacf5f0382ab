"""A stand-in for libcuda's checkpoint lock with the driver's observable semantics, built with gcc
at test time and loaded by krex through the same ctypes path (KREX_LIBCUDA), plus a sibling program.

The lock state of each "CUDA process" lives in `$FAKE_CUDA_DIR/<pid>` (4 ints, mmap'd shared): a
process becomes one when it creates a context (cuCtxCreate_v2), as with the real driver. While
locked, every CUDA call of that process blocks at entry (cuLaunchKernel, cuMemAlloc_v2); the lock
waits for a call in flight, its context's creation included, up to its timeoutMs and locks as it
ends, or answers CUDA_ERROR_NOT_READY with nothing locked (as the H200's driver 580 did inside
copies, allocations, module loads, synchronises and context creation: bench/gpu/check_lock_states.py;
the long call is fakeSlowCall); it does not wait for work already done; the state outlives the
locker; a locked process still dies of any fatal signal. A pid without a context answers
CUDA_ERROR_INVALID_VALUE. With FAKE_CUDA_CTX_MS=N, cuCtxCreate_v2 takes N ms.

The sibling (`sib LIB NAME MODE [DEVFILE [ioctl]]`): MODE cuda (a context, then launches in a loop on the
main thread), slow (a context, then one 3 s CUDA call before the loop), nocuda (no context). A
second thread, started before the context, counts CPU work (and with `ioctl`, makes an ioctl on DEVFILE every 20 ms). Its
counters are in `$FAKE_CUDA_DIR/NAME.stats` (pid, launches, cpu ticks as three longs), written from the start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LIB = r"""
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <stddef.h>
#include <unistd.h>
typedef struct { int state, in_call, creating, pad1; } st_t;
typedef struct { unsigned timeoutMs, reserved0; unsigned long long reserved1[7]; } lockargs_t;
static st_t *self_st;
static st_t *map_pid(int pid, int create) {
    char path[512];
    const char *d = getenv("FAKE_CUDA_DIR");
    snprintf(path, sizeof path, "%s/%d", d ? d : "/tmp", pid);
    int fd = open(path, O_RDWR | (create ? O_CREAT : 0), 0666);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, sizeof(st_t))) { close(fd); return NULL; }
    void *p = mmap(NULL, sizeof(st_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : (st_t *)p;
}
static st_t *target(int pid) {
    if (pid <= 0 || (kill(pid, 0) && errno == ESRCH)) return NULL;
    return map_pid(pid, 0);
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int cuInit(unsigned flags) { const char *e = getenv("FAKE_CUDA_INIT_ERROR"); return e ? atoi(e) : 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuCtxCreate_v2(void **ctx, unsigned flags, int dev) {
    self_st = map_pid(getpid(), 1);
    if (!self_st) return 2;
    const char *ms = getenv("FAKE_CUDA_CTX_MS");  /* creation in flight: a lock answers NOT_READY */
    if (ms && atoi(ms) > 0) {
        __atomic_store_n(&self_st->creating, 1, __ATOMIC_SEQ_CST);
        usleep(atoi(ms) * 1000);
        __atomic_store_n(&self_st->creating, 0, __ATOMIC_SEQ_CST);
    }
    *ctx = self_st;
    return 0;
}
static void enter(void) {
    for (;;) {
        while (__atomic_load_n(&self_st->state, __ATOMIC_SEQ_CST) == 1) usleep(100);
        __atomic_store_n(&self_st->in_call, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&self_st->state, __ATOMIC_SEQ_CST) != 1) return;
        __atomic_store_n(&self_st->in_call, 0, __ATOMIC_SEQ_CST);
    }
}
static void leave(void) { __atomic_store_n(&self_st->in_call, 0, __ATOMIC_SEQ_CST); }
int cuLaunchKernel(void *f) { if (!self_st) return 201; enter(); leave(); return 0; }
static char arena[1 << 20];
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { return cuCtxCreate_v2(ctx, 0, dev); }
int cuCtxSetCurrent(void *ctx) { return self_st ? 0 : 201; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { if (!self_st) return 201; enter(); *p = (unsigned long long)arena; leave(); return 0; }
int cuMemsetD32_v2(unsigned long long p, unsigned v, size_t n) {
    if (!self_st) return 201;
    enter();
    unsigned *a = (unsigned *)p;
    for (size_t i = 0; i < n && i < sizeof arena / 4; i++) a[i] = v;
    leave();
    return 0;
}
int cuCtxSynchronize(void) { if (!self_st) return 201; enter(); leave(); return 0; }
int fakeSlowCall(unsigned long us) { if (!self_st) return 201; enter(); usleep(us); leave(); return 0; }
int cuCheckpointProcessLock(int pid, lockargs_t *a) {
    st_t *s = target(pid);
    if (!s) return 1;
    double end = now() + (a && a->timeoutMs ? a->timeoutMs / 1000.0 : 1e9);
    while (__atomic_load_n(&s->creating, __ATOMIC_SEQ_CST)) {
        if (now() > end) { munmap(s, sizeof *s); return 600; }
        usleep(100);
    }
    int expect = 0;
    if (!__atomic_compare_exchange_n(&s->state, &expect, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        munmap(s, sizeof *s); return 401;
    }
    while (__atomic_load_n(&s->in_call, __ATOMIC_SEQ_CST)) {
        if (now() > end) { __atomic_store_n(&s->state, 0, __ATOMIC_SEQ_CST); munmap(s, sizeof *s); return 600; }
        usleep(100);
    }
    munmap(s, sizeof *s);
    return 0;
}
int cuCheckpointProcessUnlock(int pid, void *a) {
    st_t *s = target(pid);
    if (!s) return 1;
    int expect = 1, ok = __atomic_compare_exchange_n(&s->state, &expect, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    munmap(s, sizeof *s);
    return ok ? 0 : 401;
}
int cuCheckpointProcessGetState(int pid, int *state) {
    st_t *s = target(pid);
    if (!s) return 1;
    *state = __atomic_load_n(&s->state, __ATOMIC_SEQ_CST);
    munmap(s, sizeof *s);
    return 0;
}
int cuGetErrorName(int rc, const char **name) {
    switch (rc) {
    case 0: *name = "CUDA_SUCCESS"; return 0;
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 3: *name = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 100: *name = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 401: *name = "CUDA_ERROR_ILLEGAL_STATE"; return 0;
    case 600: *name = "CUDA_ERROR_NOT_READY"; return 0;
    case 909: *name = "CUDA_ERROR_TIMEOUT"; return 0;
    }
    return 1;
}
"""

# A build without the checkpoint API: a driver older than it.
OLD_LIB = "int cuInit(unsigned f) { return 0; }\n"

SIB = r"""
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>
static volatile long *stats;
static int gpu_fd = -1, do_ioctl;
static void *cpu(void *a) {
    for (long n = 0;; n++) {
        __atomic_add_fetch(&stats[2], 1, __ATOMIC_SEQ_CST);
        if (do_ioctl && n % 20 == 0) ioctl(gpu_fd, 0x5401, 0);  /* touches the "GPU" from the CPU thread */
        usleep(1000);
    }
    return 0;
}
int main(int argc, char **argv) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.stats", getenv("FAKE_CUDA_DIR"), argv[2]);
    int fd = open(path, O_RDWR | O_CREAT, 0666);
    if (fd < 0 || ftruncate(fd, 3 * sizeof(long))) { perror(path); return 1; }
    stats = mmap(NULL, 3 * sizeof(long), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (argc > 4 && (gpu_fd = open(argv[4], O_RDONLY)) < 0) { perror(argv[4]); return 1; }
    do_ioctl = argc > 5 && !strcmp(argv[5], "ioctl");
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    int (*init)(unsigned) = dlsym(h, "cuInit");
    int (*ctx)(void **, unsigned, int) = dlsym(h, "cuCtxCreate_v2");
    int (*launch)(void *) = dlsym(h, "cuLaunchKernel");
    int (*slow)(unsigned long) = dlsym(h, "fakeSlowCall");
    void *c;
    init(0);
    int cuda = strcmp(argv[3], "nocuda") != 0;
    pthread_t th;
    pthread_create(&th, 0, cpu, 0);
    stats[0] = getpid();
    if (cuda && ctx(&c, 0, 0)) { fprintf(stderr, "no context\n"); return 1; }
    if (!strcmp(argv[3], "slow")) slow(3000000);
    for (;;) {
        if (cuda) { launch(0); __atomic_add_fetch(&stats[1], 1, __ATOMIC_SEQ_CST); }
        usleep(500);
    }
}
"""


class Fake:
    """The built library, its API-less twin and the sibling, and the state directory."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.lib = str(d / "libcuda.so.1")
        self.old = str(d / "old" / "libcuda.so.1")
        self.sib = str(d / "sib")
        self.state = d / "state"

    def env(self, **extra: str) -> dict[str, str]:
        e = {"KREX_LIBCUDA": self.lib, "FAKE_CUDA_DIR": str(self.state)}
        e.update(extra)
        return e

    def argv(self, name: str, mode: str = "cuda", gpu_file: bool = True, *extra: str) -> list[str]:
        """The sibling as a command. With `gpu_file` it holds "/dev/nvidia0" open: a file by that
        name in a private mount namespace (readlink of its fd from outside reads the same name), so
        the GPU-holder checks treat it as a GPU process on a machine without one."""
        if not gpu_file:
            return [self.sib, self.lib, name, mode]
        return self.with_gpu_file([self.sib, self.lib, name, mode, "/dev/nvidia0", *extra])

    @staticmethod
    def with_gpu_file(argv: list[str]) -> list[str]:
        """`argv` run in a private mount namespace where "/dev/nvidia0" is an empty file it may
        open (see argv)."""
        return [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs krex-fake /dev && : > /dev/nvidia0 && exec "$@"',
            "sh",
            *argv,
        ]

    def stats(self, name: str) -> tuple[int, int, int]:
        """(pid, launches, cpu ticks) of the sibling `name` (zeros before it started)."""
        try:
            with open(self.state / f"{name}.stats", "rb") as f:
                data = f.read(24)
        except FileNotFoundError:
            return 0, 0, 0
        if len(data) < 24:
            return 0, 0, 0
        a, b, c = (int.from_bytes(data[i : i + 8], "little", signed=True) for i in (0, 8, 16))
        return a, b, c

    def lock_state(self, pid: int) -> int | None:
        """The fake driver's state of `pid` (0 running, 1 locked), None for no context."""
        try:
            with open(self.state / str(pid), "rb") as f:
                return int.from_bytes(f.read(4), "little")
        except FileNotFoundError:
            return None


def build(d: Path) -> Fake:
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing: cannot build the fake libcuda")
    f = Fake(d)
    f.state.mkdir(mode=0o777, exist_ok=True)
    os.chmod(f.state, 0o777)
    (d / "old").mkdir(exist_ok=True)
    (d / "fake.c").write_text(LIB)
    (d / "old.c").write_text(OLD_LIB)
    (d / "sib.c").write_text(SIB)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", f.lib, str(d / "fake.c")], check=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", f.old, str(d / "old.c")], check=True)
    subprocess.run(["gcc", "-O2", "-pthread", "-o", f.sib, str(d / "sib.c"), "-ldl"], check=True)
    return f


__all__ = ["Fake", "build"]
