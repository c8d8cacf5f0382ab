"""The ioctl probe: which processes talk to GPU device files, and how, from syscall tracepoints only.

BPF side (BPF_TEXT, specialised by `bpf_text()`):
- sys_enter_openat/openat2/open: read the path argument (bpf_probe_read_user_str) and compare it with
  the configured prefixes (an unrolled byte compare generated into the MATCH() #define); a match is
  parked per thread in `pending`.
- sys_exit_openat/openat2/open: on success, (tgid, fd) -> path goes into `tracked`; an "open" event.
- sys_enter_close: the (tgid, fd) leaves `tracked`.
- sys_enter/exit of dup, dup2, dup3 and fcntl(F_DUPFD, F_DUPFD_CLOEXEC): the new fd is tracked when
  the old one is (same path), and leaves `tracked` otherwise (dup2 onto a tracked number).
- fork (sched_process_fork): a child's untouched fd is found in its parent's (or grandparent's)
  entry when that predates the fork, and copied on first use; a child's close leaves a tombstone.
- execve: each entry keeps its fd's close-on-exec flag (from the open or dup flags, F_SETFD,
  FIOCLEX/FIONCLEX, fdinfo for seeds) and when it was made; sched_process_exec notes the tgid's
  execve time, and an ioctl on an entry with the flag that is older than that drops the entry.
- sys_enter_ioctl: a tracked fd gives an "ioctl" event {ts, tgid, tid, fd, cmd, cgroup, comm} (56
  bytes; the path travels only with "open" events and seeds, and is kept in user space per fd).
Every event is counted per tgid in `counts` and per cgroup (v2 id) in `cg_counts` before it is
offered to the ring buffer, so counts lose nothing; a failed ring-buffer reservation adds to `lost`.
Thus sum(counts) == delivered + lost. No kernel struct is read: only tracepoint arguments and helpers
(bpf_get_current_pid_tgid, bpf_ktime_get_ns = CLOCK_MONOTONIC, bpf_get_current_cgroup_id).

User side: `tracked` is seeded at start from /proc/*/fd, so fds opened before the probe started are
covered; about every `rescan_s` the poll thread drops entries whose /proc/<tgid>/fd/<fd> no longer
names a device (execve's O_CLOEXEC, close_range, exit) and seeds again, which also catches what
the BPF side cannot see: fds closed by close_range, passed over a unix socket, opened through
io_uring. Print the generated program with `python -m krex_async.probes.bpf_ioctl --print`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes as ct
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from krex_async.linux import procfs
from krex_async.probes import _bcc
from krex_async.probes.base import ProbeBackend, ProbeEvent, ProbeUnavailable
from krex_async.probes.failure import FailureReporting
from krex_async.probes.hold import HOLD
from krex_async.probes.ioctls import ioctl_name
from krex_async.runtime.quiesce import GPU_PREFIXES

DEFAULT_PREFIXES = GPU_PREFIXES
PATH_LEN = 64  # bytes of path kept per fd (prefixes must be shorter)
MAX_PREFIXES = 8
KIND_OPEN, KIND_IOCTL = 1, 2

BPF_TEXT = r"""
#define PATH_LEN __PATH_LEN__
#define RING_PAGES __RING_PAGES__
#define STREAM __STREAM__
#define MATCH(w) (__MATCH__)
#define RB_NO_WAKEUP 1  /* BPF_RB_NO_WAKEUP: the drain thread polls on a timer */
#define O_CLOEXEC_ 02000000  /* x86-64 and arm64 */

struct key_t { u32 tgid; s32 fd; };
/* A tracked fd: its path, when this fd number got it (ns), and its close-on-exec flag. */
struct path_t { char s[PATH_LEN]; u64 ts; u32 cloexec; u32 pad; } __attribute__((aligned(8)));
struct event_t {
    u64 ts; u32 tgid; u32 tid; s32 fd; u32 cmd; u32 kind; u32 pad; u64 cgroup; char comm[16];
};
struct open_event_t { struct event_t h; char path[PATH_LEN]; };

BPF_HASH(tracked, struct key_t, struct path_t, 65536);
BPF_HASH(pending, u32, struct path_t, 4096);
BPF_TABLE("lru_hash", u32, u64, execs, 65536);  /* tgid -> time of its last execve */

/* fork: the child (pid of the new task) inherits the parent's fds. An fd the child has not touched
   is looked up in its parent's entries (up to FORK_DEPTH ancestors), valid when the parent's entry
   predates the fork; on first use it is copied into the child's own entry. A child's close of an
   inherited fd leaves a tombstone (empty path), so a reused number is not inherited again. A
   rescan seeds every process's real fds from /proc, stamped with the scan's start: a parent's
   entry is then newer than the forks before it, so those children are no longer inherited into
   (they were seeded; a number one of them closed with close_range stays closed). */
#define FORK_DEPTH 3
struct fork_t { u32 parent; u32 pad; u64 ts; };
BPF_TABLE("lru_hash", u32, struct fork_t, forks, 65536);

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 child = args->child_pid;
    struct fork_t f = {.parent = bpf_get_current_pid_tgid() >> 32, .ts = bpf_ktime_get_ns()};
    forks.update(&child, &f);
    return 0;
}

/* The ancestor's entry that k (not in `tracked`) inherited through fork, or 0; *since is set to
   the earliest fork on the way. */
static __always_inline struct path_t *inherited(struct key_t *k, u64 *since) {
    u32 tgid = k->tgid;
    *since = (u64)-1;
    #pragma unroll
    for (int i = 0; i < FORK_DEPTH; i++) {
        struct fork_t *f = forks.lookup(&tgid);
        if (!f)
            return 0;
        if (f->ts < *since)
            *since = f->ts;
        struct key_t pk = {.tgid = f->parent, .fd = k->fd};
        struct path_t *pp = tracked.lookup(&pk);
        if (pp)  /* closed there, or opened after the fork: not inherited */
            return (pp->s[0] && pp->ts <= *since) ? pp : 0;
        tgid = f->parent;
    }
    return 0;
}

static __always_inline struct path_t *find(struct key_t *k) {
    struct path_t *p = tracked.lookup(k);
    if (p)
        return p->s[0] ? p : 0;
    u64 since;
    struct path_t *pp = inherited(k, &since);
    if (!pp)
        return 0;
    struct path_t copy = *pp;
    copy.ts = since;  /* the child's fd dates from its fork */
    tracked.update(k, &copy);
    return tracked.lookup(k);
}

/* The fd no longer names what it did. Where it would still be inherited from an ancestor's
   entry, a tombstone stays (only then: not for every close of every forked process). */
static __always_inline void untrack(struct key_t *k) {
    struct path_t *p = tracked.lookup(k);
    if (p && !p->s[0])
        return;  /* already a tombstone */
    u64 since;
    if (inherited(k, &since)) {
        struct path_t dead = {};
        dead.ts = bpf_ktime_get_ns();
        tracked.update(k, &dead);
    } else if (p) {
        tracked.delete(k);
    }
}
BPF_HASH(counts, u32, u64, 65536);
BPF_HASH(cg_counts, u64, u64, 16384);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_RINGBUF_OUTPUT(events, RING_PAGES);

static __always_inline void count(u64 id) {
    u32 tgid = id >> 32;
    u64 zero = 0, *c = counts.lookup_or_try_init(&tgid, &zero);
    if (c) __sync_fetch_and_add(c, 1);
    u64 cg = bpf_get_current_cgroup_id();
    c = cg_counts.lookup_or_try_init(&cg, &zero);
    if (c) __sync_fetch_and_add(c, 1);
}

static __always_inline void lost_one(void) {
    int k = 0;
    u64 *l = lost.lookup(&k);
    if (l) *l += 1;
}

static __always_inline void fill(struct event_t *e, u64 id, u32 kind, s32 fd, u32 cmd) {
    e->ts = bpf_ktime_get_ns();
    e->tgid = id >> 32; e->tid = (u32)id; e->fd = fd; e->cmd = cmd; e->kind = kind; e->pad = 0;
    e->cgroup = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
}

static __always_inline int enter_open(const char *filename, u64 flags) {
    struct path_t p = {};
    if (bpf_probe_read_user_str(p.s, sizeof(p.s), filename) <= 0)
        return 0;
    if (!(MATCH((u64 *)p.s)))
        return 0;
    p.cloexec = (flags & O_CLOEXEC_) ? 1 : 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    pending.update(&tid, &p);
    return 0;
}

static __always_inline int exit_open(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct path_t *p = pending.lookup(&tid);
    if (!p)
        return 0;
    if (ret >= 0) {
        struct key_t k = {.tgid = id >> 32, .fd = (s32)ret};
        p->ts = bpf_ktime_get_ns();
        tracked.update(&k, p);
        count(id);
#if STREAM
        struct open_event_t *e = events.ringbuf_reserve(sizeof(struct open_event_t));
        if (e) {
            fill(&e->h, id, 1, (s32)ret, 0);
            __builtin_memcpy(e->path, p->s, PATH_LEN);
            events.ringbuf_submit(e, RB_NO_WAKEUP);
        } else {
            lost_one();
        }
#endif
    }
    pending.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return enter_open(args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_openat) { return exit_open(args->ret); }
__OPENAT2__
__OPEN__

TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    struct key_t k = {.tgid = bpf_get_current_pid_tgid() >> 32, .fd = (s32)args->fd};
    untrack(&k);
    return 0;
}

/* dup, dup2, dup3, fcntl(F_DUPFD[_CLOEXEC]): the new number names what the old one does. It is
   tracked when the old one is, and untracked otherwise (dup2 onto a tracked number closes it). */
struct dup_t { s32 oldfd; u32 cloexec; };
BPF_HASH(dups, u32, struct dup_t, 4096);

static __always_inline int enter_dup(u32 oldfd, u32 cloexec) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct dup_t d = {.oldfd = (s32)oldfd, .cloexec = cloexec};
    dups.update(&tid, &d);
    return 0;
}

static __always_inline int exit_dup(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct dup_t *d = dups.lookup(&tid);
    if (!d)
        return 0;
    if (ret >= 0) {
        struct key_t from = {.tgid = id >> 32, .fd = d->oldfd};
        struct key_t to = {.tgid = id >> 32, .fd = (s32)ret};
        struct path_t *p = find(&from);
        if (p) {
            struct path_t copy = *p;
            copy.ts = bpf_ktime_get_ns();  /* a new fd: its own flag, made after any execve */
            copy.cloexec = d->cloexec;
            tracked.update(&to, &copy);
        } else {
            untrack(&to);
        }
    }
    dups.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_dup) { return enter_dup(args->fildes, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_dup) { return exit_dup(args->ret); }
__DUP2__
TRACEPOINT_PROBE(syscalls, sys_enter_dup3) {
    return enter_dup(args->oldfd, (args->flags & O_CLOEXEC_) ? 1 : 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_dup3) { return exit_dup(args->ret); }

static __always_inline void set_cloexec(s32 fd, u32 on) {
    struct key_t k = {.tgid = bpf_get_current_pid_tgid() >> 32, .fd = fd};
    struct path_t *p = find(&k);
    if (p)
        p->cloexec = on;
}

TRACEPOINT_PROBE(syscalls, sys_enter_fcntl) {
    if (args->cmd == 0 || args->cmd == 1030)  /* F_DUPFD, F_DUPFD_CLOEXEC */
        return enter_dup(args->fd, args->cmd == 1030);
    if (args->cmd == 2)  /* F_SETFD */
        set_cloexec((s32)args->fd, args->arg & 1);  /* FD_CLOEXEC */
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_fcntl) { return exit_dup(args->ret); }

/* execve closes the O_CLOEXEC fds without a close syscall: entries older than the tgid's last
   execve with the flag set are stale (the number may name another file now) and are dropped. */
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 now = bpf_ktime_get_ns();
    execs.update(&tgid, &now);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_ioctl) {
    u64 id = bpf_get_current_pid_tgid();
    struct key_t k = {.tgid = id >> 32, .fd = (s32)args->fd};
    struct path_t *p = find(&k);
    if (!p)
        return 0;
    if (p->cloexec) {
        u64 *x = execs.lookup(&k.tgid);
        if (x && *x > p->ts) {
            untrack(&k);
            return 0;
        }
    }
    if (args->cmd == 0x5451 || args->cmd == 0x5450)  /* FIOCLEX, FIONCLEX */
        p->cloexec = args->cmd == 0x5451;
    count(id);
#if STREAM
    struct event_t *e = events.ringbuf_reserve(sizeof(struct event_t));
    if (!e) {
        lost_one();
        return 0;
    }
    fill(e, id, 2, k.fd, (u32)args->cmd);
    events.ringbuf_submit(e, RB_NO_WAKEUP);
#endif
    return 0;
}
"""

_OPENAT2 = """TRACEPOINT_PROBE(syscalls, sys_enter_openat2) {
    u64 flags = 0;  /* struct open_how's first field, in user memory */
    bpf_probe_read_user(&flags, sizeof(flags), args->how);
    return enter_open(args->filename, flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { return exit_open(args->ret); }"""
# dup2 is not a syscall on arm64 (Grace, GH200): only dup3 there, as only openat for open.
_DUP2 = """TRACEPOINT_PROBE(syscalls, sys_enter_dup2) { return enter_dup(args->oldfd, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_dup2) { return exit_dup(args->ret); }
"""

_OPEN = """TRACEPOINT_PROBE(syscalls, sys_enter_open) { return enter_open(args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_open) { return exit_open(args->ret); }"""


EVENT = struct.Struct("<QIIiIIIQ16s")  # struct event_t
OPEN_EVENT = struct.Struct(f"<QIIiIIIQ16s{PATH_LEN}s")  # struct open_event_t


@dataclass(frozen=True, slots=True)
class BccEvent(ProbeEvent):
    """A ProbeEvent with the cgroup v2 id of the calling task (bpf_get_current_cgroup_id): the inode
    number of its cgroup directory, so an event maps to a command's cgroup even after the process
    has exited. 0 from backends that do not know it."""

    cgroup: int = 0


def _slot_setters(cls: type, names: Iterable[str]) -> list[Callable[[Any, Any], None]]:
    """The slot descriptors' __set__ of `names` on cls (a frozen slots dataclass)."""
    out = []
    for n in names:
        owner = next(k for k in cls.__mro__ if n in vars(k))
        out.append(vars(owner)[n].__set__)
    return out


_SET = _slot_setters(BccEvent, ("ts_ns", "tgid", "tid", "kind", "fd", "request", "name", "comm", "cgroup"))
_NEW = object.__new__


def bcc_event(
    ts: int, tgid: int, tid: int, kind: str, fd: int, request: int, name: str, comm: str, cgroup: int
) -> BccEvent:
    """BccEvent(...) at half the cost: the reader builds one per record (100k/s and more), and a
    frozen dataclass's __init__ goes through object.__setattr__ per field; the slot descriptors
    set the same fields directly. Equal to the constructor's result (tests/probes/test_bpf_ioctl)."""
    ev = _NEW(BccEvent)
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = _SET
    s0(ev, ts)
    s1(ev, tgid)
    s2(ev, tid)
    s3(ev, kind)
    s4(ev, fd)
    s5(ev, request)
    s6(ev, name)
    s7(ev, comm)
    s8(ev, cgroup)
    return ev


def match_expr(prefixes: Iterable[str]) -> str:
    """The C expression for MATCH(w), w the path as u64 words: true when it starts with a prefix.

    Each prefix becomes masked 8-byte compares OR-ed together and tested once, so the verifier sees
    one branch per prefix and no loop (a byte-by-byte && chain of 20 bytes was refused with E2BIG).
    """
    terms = []
    for p in prefixes:
        raw = p.encode()
        parts = []
        for j in range(0, len(raw), 8):
            chunk = raw[j : j + 8]
            val = int.from_bytes(chunk.ljust(8, b"\0"), "little")
            mask = int.from_bytes(b"\xff" * len(chunk) + b"\0" * (8 - len(chunk)), "little")
            parts.append(f"(((w)[{j // 8}] ^ 0x{val:016x}ULL) & 0x{mask:016x}ULL)")
        terms.append("((" + " | ".join(parts) + ") == 0)")
    return " || ".join(terms)


def check_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """Validate the prefix list. Raises ValueError naming the bad entry."""
    out = tuple(prefixes)
    if not out:
        raise ValueError("at least one device path prefix is needed")
    if len(out) > MAX_PREFIXES:
        raise ValueError(f"at most {MAX_PREFIXES} prefixes, got {len(out)}")
    for p in out:
        if not p.startswith("/") or not 1 < len(p.encode()) < PATH_LEN:
            raise ValueError(f"prefix {p!r}: absolute path of 2..{PATH_LEN - 1} bytes needed")
    return out


def tracepoint_exists(category: str, event: str) -> bool:
    """Probe for a tracepoint through bcc when it imports, else through tracefs."""
    try:
        if _bcc.import_bcc().BPF.tracepoint_exists(category, event):
            return True  # bcc looks under debugfs only: tracefs may be mounted without it
    except ProbeUnavailable:
        pass
    return any(
        os.path.isdir(f"{root}/events/{category}/{event}")
        for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
    )


RING_PAGES = 4096  # 16 MiB: 2.6 s of 100k events/s while the reader is starved of CPU


def bpf_text(
    prefixes: Iterable[str] = DEFAULT_PREFIXES, ring_pages: int = RING_PAGES, stream: bool = True
) -> str:
    """The BPF program for these prefixes. ring_pages must be a power of two (4 KiB pages)."""
    prefixes = check_prefixes(prefixes)
    if ring_pages < 1 or ring_pages & (ring_pages - 1):
        raise ValueError(f"ring_pages must be a power of two, got {ring_pages}")

    def both(n: str) -> bool:
        return tracepoint_exists("syscalls", f"sys_enter_{n}") and tracepoint_exists(
            "syscalls", f"sys_exit_{n}"
        )

    return (
        BPF_TEXT.replace("__PATH_LEN__", str(PATH_LEN))
        .replace("__RING_PAGES__", str(ring_pages))
        .replace("__STREAM__", "1" if stream else "0")
        .replace("__MATCH__", match_expr(prefixes))
        .replace("__OPENAT2__", _OPENAT2 if both("openat2") else "")
        .replace("__OPEN__", _OPEN if both("open") else "")
        .replace("__DUP2__", _DUP2 if both("dup2") else "")
    )


def scan_proc(prefixes: tuple[str, ...]) -> Iterator[tuple[int, int, str]]:
    """(tgid, fd, path) for every open fd in /proc whose target starts with a prefix.

    Processes and fds that vanish or deny access while scanning are skipped.
    """
    for pid in procfs.pids():
        HOLD.wait()  # on a probe thread's upkeep a region entering goes first (none at start)
        for fd in procfs.fds(pid) or ():
            target = procfs.fd_target(pid, fd)
            if target is not None and target.startswith(prefixes):
                yield pid, fd, target


def fd_cloexec(pid: int, fd: int) -> int:
    """1 when the fd has close-on-exec set (/proc/<pid>/fdinfo/<fd>), else 0 (also when unknown)."""
    flags = procfs.fd_flags(pid, fd)
    return 1 if flags is not None and flags & os.O_CLOEXEC else 0


class IoctlProbe(FailureReporting, ProbeBackend):
    """bcc backend on syscall tracepoints; see the module docstring.

    start() compiles (about 0.3-0.5 s), seeds `tracked`, and starts the poll thread; it raises
    ProbeUnavailable (not root, no bcc, compile failure) having released whatever it loaded. stop()
    joins the thread and detaches the program; counts() and lost() still answer after stop().
    If the poll thread dies at runtime, `failure` says why and `on_failure` is called on the loop
    (failure.py); the program stays loaded (counts still answer) until stop().
    """

    name = "bcc-ioctl"

    def __init__(
        self,
        prefixes: Iterable[str] | None = None,
        ring_pages: int = RING_PAGES,
        stream: bool = True,
        rescan_s: float = 5.0,
        mmap_reader: bool = True,
    ) -> None:
        self.prefixes = check_prefixes(prefixes if prefixes is not None else DEFAULT_PREFIXES)
        self.ring_pages = ring_pages
        self.stream = stream
        self.rescan_s = rescan_s
        self.mmap_reader = mmap_reader  # False: bcc's ring_buffer_consume (a ctypes call per record)
        self.fd_paths: dict[tuple[int, int], str] = {}  # (tgid, fd) -> path, from seeds and opens
        self._poller: _bcc.RingPoller | None = None
        self._bpf: Any = None
        self._final_counts: dict[int, int] = {}
        self._final_lost = 0
        self._gone_counts: dict[int, int] = {}
        self._gone_cg_counts: dict[int, int] = {}  # of cgroups removed since (their ids are unique)
        self._moving = threading.Lock()  # held while a count moves from a map to _gone_*
        self._names: dict[tuple[int, str], str] = {}
        self._comms: dict[bytes, str] = {}

    def text(self) -> str:
        return bpf_text(self.prefixes, self.ring_pages, self.stream)

    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        bpf = _bcc.compile_bpf(self.text(), self.name)
        try:
            self._bpf = bpf
            self._counts = _bcc.CountMap(bpf[b"counts"])
            self._cg_counts = _bcc.CountMap(bpf[b"cg_counts"], ct.c_uint64)
            self.seed()
            ring_bytes = self.ring_pages * mmap.PAGESIZE if self.mmap_reader else 0
            self._poller = _bcc.RingPoller(
                bpf,
                "events",
                self._decode,
                self.name,
                tick=self._upkeep,
                tick_s=self.rescan_s or 3600.0,
                ring_bytes=ring_bytes,
                on_failure=lambda why: self._failed(loop, why),
            )
            self._poller.start(loop, on_events)
        except Exception as e:
            bpf.cleanup()
            self._bpf = None
            raise ProbeUnavailable(f"{self.name}: start failed: {e}") from e

    def _decode(self, raw: bytes) -> ProbeEvent | None:
        if len(raw) >= OPEN_EVENT.size:
            ts, tgid, tid, fd, cmd, kind, _, cg, comm, path_b = OPEN_EVENT.unpack_from(raw)
            path = _bcc.cstr(path_b)
            self.fd_paths[(tgid, fd)] = path
            return bcc_event(ts, tgid, tid, "open", fd, 0, path, self._comm(comm), cg)
        ts, tgid, tid, fd, cmd, kind, _, cg, comm = EVENT.unpack_from(raw)
        path = self.fd_paths.get((tgid, fd), "")
        name = self._names.get((cmd, path))
        if name is None:
            name = self._names[(cmd, path)] = ioctl_name(cmd, path)
        return bcc_event(ts, tgid, tid, "ioctl", fd, cmd, name, self._comm(comm), cg)

    def _comm(self, raw: bytes) -> str:
        c = self._comms.get(raw)
        if c is None:
            c = self._comms[raw] = _bcc.cstr(raw)
        return c

    def seed(self) -> int:
        """Put every matching fd now open in /proc into `tracked`. Returns how many were found."""
        table = self._bpf[b"tracked"]
        n = 0
        # Stamped with the scan's start: an execve or fork after it is "later" (module docstring).
        start = time.monotonic_ns()
        for tgid, fd, path in scan_proc(self.prefixes):
            key = table.Key(tgid, fd)
            made = table.get(key)
            if made is not None and made.ts >= start:
                # the BPF side made it since the scan began (an open, a dup): its stamp is the true
                # one. The scan's would predate an execve between the two, and the entry of a
                # close-on-exec fd opened after that execve would be dropped at its first ioctl.
                self.fd_paths[(tgid, fd)] = path
                n += 1
                continue
            leaf = table.Leaf()
            leaf.s = path.encode()[: PATH_LEN - 1]
            leaf.ts = start
            leaf.cloexec = fd_cloexec(tgid, fd)
            table[key] = leaf
            self.fd_paths[(tgid, fd)] = path
            n += 1
        return n

    def _upkeep(self) -> None:
        """Drop tracked fds that no longer name a device file, move counts of processes that are
        gone to Python, reseed.

        An fd can stop naming a device without a close syscall the BPF side sees: execve closes
        O_CLOEXEC fds, close_range closes a range, a process exits (and its pid may be reused).
        Such an entry would count the ioctls of whatever file gets that number next (a tty, a
        socket) as GPU activity, so each entry is checked against /proc/<tgid>/fd/<fd>. An fd that
        is closed and reopened on a device between the check and the drop is put back by the
        seed that follows."""
        table = self._bpf[b"tracked"]
        for k, v in list(table.items()):
            HOLD.wait()
            if not v.s and procfs.exists(k.tgid):
                continue  # a live child's tombstone: it keeps the fd from being inherited again
            target = procfs.fd_target(k.tgid, k.fd) or ""  # "": gone, the fd or the whole process
            if not target.startswith(self.prefixes):
                table.pop(k, None)
                self.fd_paths.pop((k.tgid, k.fd), None)
        counts = self._bpf[b"counts"]
        keys = [counts.Key(tgid) for tgid in self._counts.read()]
        _bcc.retire_counts(
            counts, keys, lambda k: _bcc.exited(k.value), lambda k: k.value, self._gone_counts, self._moving
        )
        self._prune_cgroups()
        self.seed()

    def _prune_cgroups(self) -> None:
        """Move the counts of removed cgroups to Python: the map holds 16384 cgroups, and a node
        that runs a command per cgroup would fill it in a day, after which new cgroups would go
        uncounted. A cgroup v2 id is its directory's inode number, never reused."""
        from krex_async.isolation.cgroupfs import cgroup_mounts

        v2, _ = cgroup_mounts()
        if v2 is None:
            return
        live: set[int] = set()
        stack = [v2]
        while stack:
            HOLD.wait()
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            live.add(e.inode())
                            stack.append(e.path)
            except OSError:
                continue  # removed while we walked
        live.add(os.stat(v2).st_ino)
        table = self._bpf[b"cg_counts"]
        keys = [table.Key(cg) for cg in self._cg_counts.read()]
        _bcc.retire_counts(
            table, keys, lambda k: k.value not in live, lambda k: k.value, self._gone_cg_counts, self._moving
        )

    def stop(self) -> None:
        if self._bpf is None:
            return

        def snapshot() -> None:  # detached and drained: these match what was delivered
            self._final_counts = self.counts()
            self._final_lost = self.lost()

        if self._poller is not None:
            self._poller.stop(snapshot)
            self._poller = None
        else:
            snapshot()
            self._bpf.cleanup()
        self._bpf = None

    def lost(self) -> int:
        """Reservation failures in the BPF program plus records that could not be decoded."""
        if self._bpf is None:
            return self._final_lost
        bad = self._poller.undecodable if self._poller is not None else 0
        return _bcc.sum_percpu(self._bpf[b"lost"]) + bad

    def counts(self) -> dict[int, int]:
        if self._bpf is None:
            return dict(self._final_counts)
        with self._moving:
            out = dict(self._gone_counts)
            live = self._counts.read()
        for tgid, n in live.items():
            out[tgid] = out.get(tgid, 0) + n
        return out

    def cgroup_counts(self) -> dict[int, int]:
        """Events per cgroup v2 id (the inode number of the cgroup's directory, os.stat().st_ino),
        removed cgroups included."""
        with self._moving:
            out = dict(self._gone_cg_counts)
            live = self._cg_counts.read() if self._bpf is not None else {}
        for cg, n in live.items():
            out[cg] = out.get(cg, 0) + n
        return out

    @property
    def poller(self) -> _bcc.RingPoller | None:
        return self._poller


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Print or run the krex ioctl probe.")
    ap.add_argument("--print", action="store_true", help="print the generated BPF text and exit")
    ap.add_argument("--prefix", action="append", help="device path prefix (repeatable)")
    args = ap.parse_args(argv)
    probe = IoctlProbe(args.prefix)
    if args.print:
        print(probe.text())
        return

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def show(batch: list[ProbeEvent]) -> None:
            for ev in batch:
                print(ev, flush=True)

        probe.start(loop, show)
        try:
            await asyncio.Event().wait()
        finally:
            probe.stop()
            print("counts", probe.counts(), "lost", probe.lost())

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
