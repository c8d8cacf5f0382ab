"""The launch probe (opt-in): uprobes on the user-mode launch APIs, counting each submission.

Kernel launches are user-mode submissions (a doorbell write, no syscall), so the ioctl probe sees only
allocation, context and sync activity; these uprobes see every call of:
- libcuda: cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch (and the _ptsz
  per-thread-stream variants where the library exports them);
- libhsa-runtime64: hsa_signal_store_{relaxed,screlease,release} (doorbell rings are signal stores,
  but so are other host-side signal writes: an upper bound on dispatches) and
  hsa_queue_add_write_index_{relaxed,screlease,scacq_screl} (one per packet reservation).

Scope: who is probed (`scope`, `krex serve --launch-scope`; the daemon's default is `outsiders`).
A uprobe is an int3 at the probed address: every call traps into the kernel, which then emulates the
replaced instruction. cuLaunchKernel starts with `push %rbp` (emulated, the cheapest kind), and that
trap still costs about a tenth of a torch launch: some 10% of the launch rate with global uprobes
(bench/RESULTS.md; the goal is under 3%). A trap cannot get cheaper,
so the probe stays out of the processes whose timings krex protects:
- `all`: uprobes on the library files (pid -1): every process mapping them, now or later, traps
  on every launch, krex's own commands included.
- `outsiders`: uprobes attached per process (a perf event with a target task: the kernel installs
  the breakpoint only in that process's address space; tests/probes/test_launch_scope.py shows that
  another process mapping the same library runs at the unprobed cost), and only in processes
  outside krex's commands. Those are the only ones whose launches can be strays: during a region
  the sibling commands on the device are frozen (`--freeze all`), or hold no GPU file and are
  frozen the moment they open one (`--freeze device-holders`), and the owner's own launches are
  never strays. The daemon says who is inside with `is_command(tgid)` (its commands and its pool
  workers); it is called on the event loop only (the daemon's attribution reads /proc and caches
  on the loop), never on the poll thread. Outsiders are found
  (a) at start and every `rescan_s` on the poll thread: processes whose /proc/<pid>/maps show a
      launch library (the loop then asks is_command and hands the answers back);
  (b) at once when the ioctl probe sees a process open a GPU device file: CombinedProbe hands the
      "open" events' tgids to `opened()` (on the loop), and the poll thread attaches in its next
      tick (milliseconds after the open; CUDA init takes far longer after its first open before
      any launch can happen).
  At each rescan the uprobes of exited processes are let go, and so are those of a process that
  has joined a command since it was attached (rare; until that rescan its launches trap and are
  counted as before); they are closed one per idle tick (closing one waits for the kernel).
  Limits of `outsiders`:
  - launches of krex's commands (and pool workers) are not counted at all; so under `--policy
    shared`, where nothing is frozen, a sibling command's launches during a region are not seen as
    strays (use `all` to measure those);
  - an outsider's launches before its attach are missed;
  - a process that launches without having opened a GPU file under the ioctl probe's prefixes (or
    with the ioctl probe not running), or that maps the library only after its opens, is probed
    only at the next rescan (up to `rescan_s` later), and launches until then are missed;
  - every outsider costs one perf event (an fd) per symbol and library (8 for libcuda), within
    bcc's quota of 1000 uprobes per process (BCC_PROBE_LIMIT; attaches beyond it fail and are
    counted in `krex status`), and closing one takes ~0.1 s, so stop() takes as long per event;
  - the daemon's own pid is never probed (its NVML opens GPU files; it launches nothing).

Libraries (scope `all`) come from the configured paths, then `ldconfig -p`, a few known directories
(/usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu, /opt/rocm/lib) and /proc/*/maps of running
processes; the same file under several names is probed once (by device and inode), and symbols that
alias one address are probed once. About every `rescan_s` the poll thread looks in /proc/*/maps
again and probes libraries it had not seen (a libcuda outside ldconfig's paths, loaded after
start). With scope `outsiders` a process is probed on the libraries it maps itself (named like
libcuda.so / libhsa-runtime64.so when `search` is on, or a configured file), see launch_scope.py.

BPF side: `counts` keyed by (tgid, symbol index), lossless; with stream=True each call also goes
through the ring buffer as a "launch" ProbeEvent (name = the symbol), reservation failures in `lost`.
The scope changes who reaches the BPF program, not what it does: counting and the events (and so
the daemon's stray attribution) are as before for every process probed.
"""

from __future__ import annotations

import asyncio
import glob
import mmap
import os
import re
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from krex_async.linux import procfs
from krex_async.probes import _bcc
from krex_async.probes.base import ProbeBackend, ProbeEvent, ProbeUnavailable
from krex_async.probes.failure import FailureReporting
from krex_async.probes.launch_scope import SCOPES, Outsiders, exported, inode_key

CUDA_SYMBOLS = (
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernel_ptsz",
    "cuGraphLaunch",
    "cuGraphLaunch_ptsz",
)
HSA_SYMBOLS = (
    "hsa_signal_store_relaxed",
    "hsa_signal_store_screlease",
    "hsa_signal_store_release",
    "hsa_queue_add_write_index_relaxed",
    "hsa_queue_add_write_index_screlease",
    "hsa_queue_add_write_index_scacq_screl",
)
SYMBOLS = CUDA_SYMBOLS + HSA_SYMBOLS
LIB_NAMES = ("libcuda.so", "libhsa-runtime64.so")
KNOWN_DIRS = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/opt/rocm/lib")

BPF_TEXT = r"""
#define RING_PAGES __RING_PAGES__
#define STREAM __STREAM__
struct lkey_t { u32 tgid; u32 sym; };
struct levent_t { u64 ts; u32 tgid; u32 tid; u32 sym; u32 pad; char comm[16]; };
BPF_HASH(counts, struct lkey_t, u64, 65536);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_RINGBUF_OUTPUT(events, RING_PAGES);

static __always_inline int hit(u32 sym) {
    u64 id = bpf_get_current_pid_tgid();
    struct lkey_t k = {.tgid = id >> 32, .sym = sym};
    u64 zero = 0, *c = counts.lookup_or_try_init(&k, &zero);
    if (c) __sync_fetch_and_add(c, 1);
#if STREAM
    struct levent_t *e = events.ringbuf_reserve(sizeof(struct levent_t));
    if (!e) {
        int z = 0;
        u64 *l = lost.lookup(&z);
        if (l) *l += 1;
        return 0;
    }
    e->ts = bpf_ktime_get_ns(); e->tgid = id >> 32; e->tid = (u32)id; e->sym = sym; e->pad = 0;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    events.ringbuf_submit(e, 1);  /* BPF_RB_NO_WAKEUP: drained on a timer */
#endif
    return 0;
}
__FUNCS__
"""


LAUNCH_EVENT = struct.Struct("<QIIII16s")  # struct levent_t


def bpf_text(n_symbols: int = len(SYMBOLS), ring_pages: int = 256, stream: bool = False) -> str:
    """The BPF program: one entry function `on_sym_<i>` per symbol index."""
    funcs = "\n".join(f"int on_sym_{i}(struct pt_regs *ctx) {{ return hit({i}); }}" for i in range(n_symbols))
    return (
        BPF_TEXT.replace("__RING_PAGES__", str(ring_pages))
        .replace("__STREAM__", "1" if stream else "0")
        .replace("__FUNCS__", funcs)
    )


def _ldconfig_libs(names: Iterable[str]) -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and m.group(1).startswith(tuple(names)) and "64" in m.group(2):
            found.append(m.group(3))
    return found


def _maps_libs(names: Iterable[str]) -> list[str]:
    names = tuple(names)
    found: set[str] = set()
    for pid in procfs.pids():
        for line in (procfs.maps(pid) or "").splitlines():
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("/") and os.path.basename(path).startswith(names):
                found.add(path)
    return sorted(found)


def find_libraries(
    configured: Iterable[str] | None = None, names: Iterable[str] = LIB_NAMES, search: bool = True
) -> list[str]:
    """Library files to probe, one path per distinct file (device, inode).

    `configured` entries may be files or glob patterns and are always used; with `search` the
    ldconfig cache, KNOWN_DIRS and /proc/*/maps are searched for files named like `names`.
    """
    names = tuple(names)
    cands: list[str] = []
    for c in configured or ():
        cands.extend(sorted(glob.glob(c)) or [c])  # a path with glob characters may name itself
    if search:
        cands.extend(_ldconfig_libs(names))
        for d in KNOWN_DIRS:
            for n in names:
                cands.extend(sorted(glob.glob(f"{d}/{n}*")))
        cands.extend(_maps_libs(names))
    seen: set[tuple[int, int]] = set()
    out = []
    for c in cands:
        try:
            st = os.stat(c)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        out.append(os.path.realpath(c))
    return out


def check_configured(configured: Iterable[str]) -> None:
    """Raise ValueError naming the configured entries (--launch-libs) that name no library file: a
    path that does not exist or is no regular file, a glob pattern that matches none. find_libraries
    passes over them without a word (the probe then ran on whatever the search found), so the
    daemon asks this at start-up."""
    entries = list(configured)
    if not entries:
        raise ValueError("no library given")
    bad = []
    for c in entries:
        if any(os.path.isfile(p) for p in glob.glob(c)) or os.path.isfile(c):
            continue
        if os.path.exists(c):
            bad.append(f"{c!r} is no regular file")
        elif glob.has_magic(c):
            bad.append(f"pattern {c!r} matches no file")
        else:
            bad.append(f"{c!r}: no such file")
    if bad:
        raise ValueError("; ".join(bad))


class LaunchProbe(FailureReporting, ProbeBackend):
    """bcc uprobes on launch APIs; see the module docstring.

    start() raises ProbeUnavailable when bcc cannot run, or (with search=False) when no configured
    library exports a known symbol. With search=True it starts even with none found yet and probes
    libraries as /proc/*/maps shows them (`attached` says what is probed). stop() detaches every
    uprobe and joins the poll thread.

    `scope` ("all" here by default, for direct users; the daemon passes its `--launch-scope`,
    default "outsiders"): see the module docstring. With "outsiders", start() must be called on the
    loop's thread (it asks `is_command` there), `opened(tgids)` is called on the loop, and
    `watched()` says which processes are probed (launch_scope.Outsiders does the work).
    `is_command(tgid)` True: a process inside krex, never probed; None: every process is an
    outsider. A predicate that raises counts as False (the process is probed: a bug there may cost
    launch rate, never a missed stray).
    """

    name = "bcc-launches"
    TICK_S = 0.01  # scope outsiders: how often the poll thread takes the attach requests
    RETIRE_S = 5.0  # with rescans off: how often exited processes' counts leave the map

    def __init__(
        self,
        libs: Iterable[str] | None = None,
        search: bool = True,
        stream: bool = False,
        ring_pages: int = 256,
        rescan_s: float = 5.0,
        symbols: Iterable[str] = SYMBOLS,
        mmap_reader: bool = True,
        scope: str = "all",
        is_command: Callable[[int], bool] | None = None,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"launch scope {scope!r}: one of {', '.join(SCOPES)}")
        self.libs_configured = list(libs or ())
        self.search = search
        self.stream = stream
        self.ring_pages = ring_pages
        self.rescan_s = rescan_s
        self.mmap_reader = mmap_reader
        self.symbols = tuple(symbols)
        self.scope = scope
        self.is_command = is_command
        self.attached: dict[str, list[str]] = {}  # library path -> symbols probed there
        self._seen_files: set[tuple[int, int]] = set()
        self._bpf: Any = None
        self._poller: _bcc.RingPoller | None = None
        self._final: dict[tuple[int, str], int] = {}
        self._final_lost = 0
        # counts of exited processes, moved out of the map (_retire_gone); _moving is held while
        # one moves, so that by_symbol() sees it in the map or here, never in both or neither
        self._gone: dict[tuple[int, str], int] = {}
        self._moving = threading.Lock()
        self._next_retire = 0.0
        self._outsiders: Outsiders | None = None  # scope outsiders, once started

    @property
    def wants_opens(self) -> bool:
        """Whether CombinedProbe should hand this probe the tgids of "open" events."""
        return self.scope == "outsiders"

    def text(self) -> str:
        return bpf_text(len(self.symbols), self.ring_pages, self.stream)

    def _attach_lib(self, path: str) -> list[str]:
        try:
            st = os.stat(path)
        except OSError:
            return []
        if (st.st_dev, st.st_ino) in self._seen_files:
            return []
        self._seen_files.add((st.st_dev, st.st_ino))
        done: list[str] = []
        for name, _ in exported(path, self.symbols):
            idx = self.symbols.index(name)
            try:
                self._bpf.attach_uprobe(
                    name=path.encode(), sym=name.encode(), fn_name=f"on_sym_{idx}".encode()
                )
            except Exception:
                continue
            done.append(name)
        if done:
            self.attached[path] = done
        return done

    def _rescan(self) -> None:
        for lib in find_libraries(None, LIB_NAMES, search=True) if self.search else ():
            self._attach_lib(lib)

    # ------------------------------------------------------------------ scope outsiders

    def opened(self, tgids: Iterable[int]) -> None:
        """On the loop (CombinedProbe): these processes just opened a GPU device file; each
        outsider among them gets probed within a poll tick."""
        if self._outsiders is not None:
            self._outsiders.opened(tgids)

    def watched(self) -> dict[int, list[str]]:
        """Scope outsiders: {tgid: libraries} of the processes probed now ({} with scope all).
        Safe from any thread."""
        return self._outsiders.procs.watched() if self._outsiders is not None else {}

    def probed_since_ns(self, tgid: int) -> int | None:
        """Scope outsiders: when `tgid` was probed (CLOCK_MONOTONIC ns, as ProbeEvent.ts_ns), or
        None when it is not. For checks of how soon after its open a process is probed."""
        return self._outsiders.procs.since_ns(tgid) if self._outsiders is not None else None

    def describe(self) -> dict[str, Any]:
        """What `krex status` shows of this probe: its scope, how many processes it probes
        (outsiders) and which libraries. Cheap (a copy of small dicts), on any thread."""
        out: dict[str, Any] = {"scope": self.scope, "libraries": sorted(self.attached)}
        if self._outsiders is not None:
            out.update(self._outsiders.describe())
        return {"launches": out}

    # -------------------------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        libs = find_libraries(self.libs_configured, LIB_NAMES, self.search)
        if not libs and not self.search:
            raise ProbeUnavailable(
                f"{self.name}: no {'/'.join(LIB_NAMES)} found (configured {self.libs_configured})"
            )
        self._bpf = _bcc.compile_bpf(self.text(), self.name)
        try:
            if self.scope == "all":
                for lib in libs:
                    self._attach_lib(lib)
                if not self.attached and not self.search:
                    raise ProbeUnavailable(f"{self.name}: none of {libs} exports a launch symbol")
                tick: Callable[[], None] = self._rescan if self.rescan_s else lambda: None
                tick_s = self.rescan_s or self.RETIRE_S
            else:
                if not self.search and not any(exported(lib, self.symbols) for lib in libs):
                    raise ProbeUnavailable(f"{self.name}: none of {libs} exports a launch symbol")
                inodes = frozenset(k for k in map(inode_key, libs) if k is not None)
                self._outsiders = Outsiders(
                    self._bpf,
                    self.symbols,
                    LIB_NAMES if self.search else (),
                    inodes,
                    self.is_command,
                    self.rescan_s,
                    self.attached,
                )
                self._outsiders.start(loop)
                tick, tick_s = self._outsiders.tick, self.TICK_S
            tick = self._with_upkeep(tick)
            ring_bytes = self.ring_pages * mmap.PAGESIZE if self.mmap_reader else 0
            self._poller = _bcc.RingPoller(
                self._bpf,
                "events",
                self._decode,
                self.name,
                tick=tick,
                tick_s=tick_s,
                ring_bytes=ring_bytes,
                on_failure=lambda why: self._failed(loop, why),
            )
            self._poller.start(loop, on_events)
        except BaseException:
            self._outsiders = None
            self._bpf.cleanup()
            self._bpf = None
            raise

    def _with_upkeep(self, tick: Callable[[], None]) -> Callable[[], None]:
        """`tick`, and every rescan_s (or RETIRE_S without rescans) the counts of exited
        processes moved out of the map."""
        every = self.rescan_s or self.RETIRE_S

        def upkeep() -> None:
            tick()
            if time.monotonic() >= self._next_retire:
                self._next_retire = time.monotonic() + every
                self._retire_gone()

        return upkeep

    def _retire_gone(self) -> None:
        """Poll thread: the counts of exited processes leave the map (65536 (process, symbol)
        pairs) for Python, as bpf_ioctl's do."""
        table = self._bpf[b"counts"]
        _bcc.retire_counts(
            table,
            list(table.keys()),
            lambda k: _bcc.exited(k.tgid),
            lambda k: (k.tgid, self.symbols[k.sym]),
            self._gone,
            self._moving,
        )

    def _decode(self, raw: bytes) -> ProbeEvent:
        ts, tgid, tid, sym, _, comm = LAUNCH_EVENT.unpack_from(raw)
        return ProbeEvent(ts, tgid, tid, "launch", -1, 0, self.symbols[sym], _bcc.cstr(comm))

    def by_symbol(self) -> dict[tuple[int, str], int]:
        """Calls per (tgid, symbol) since start, lossless."""
        if self._bpf is None:
            return dict(self._final)
        with self._moving:
            out = dict(self._gone)
            live = list(self._bpf[b"counts"].items())
        for k, v in live:
            key = (k.tgid, self.symbols[k.sym])
            out[key] = out.get(key, 0) + v.value
        return out

    def counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (tgid, _), n in self.by_symbol().items():
            out[tgid] = out.get(tgid, 0) + n
        return out

    def lost(self) -> int:
        if self._bpf is None:
            return self._final_lost
        bad = self._poller.undecodable if self._poller is not None else 0
        return _bcc.sum_percpu(self._bpf[b"lost"]) + bad

    def stop(self) -> None:
        """Detach everything (each uprobe's close waits for the kernel, ~0.1 s per perf event, so a
        daemon probing many outsiders takes a while to stop), drain, release."""
        if self._bpf is None:
            return

        def snapshot() -> None:  # detached and drained: these match what was delivered
            self._final, self._final_lost = self.by_symbol(), self.lost()

        if self._poller is not None:
            self._poller.stop(snapshot)
            self._poller = None
        else:
            snapshot()
            self._bpf.cleanup()
        self._bpf = None
        if self._outsiders is not None:
            self._outsiders.close()
