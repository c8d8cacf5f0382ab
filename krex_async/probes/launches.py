"""The launch probe (opt-in): uprobes on the user-mode launch APIs, counting each submission.

Kernel launches are user-mode submissions (a doorbell write, no syscall), so the ioctl probe sees only
allocation, context and sync activity; these uprobes see every call of:
- libcuda: cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch (and the _ptsz
  per-thread-stream variants where the library exports them);
- libhsa-runtime64: hsa_signal_store_{relaxed,screlease,release} (doorbell rings are signal stores,
  but so are other host-side signal writes: an upper bound on dispatches) and
  hsa_queue_add_write_index_{relaxed,screlease,scacq_screl} (one per packet reservation).

Libraries come from the configured paths, then `ldconfig -p`, a few known directories
(/usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu, /opt/rocm/lib) and /proc/*/maps of running
processes; the same file under several names is probed once (by device and inode), and symbols that
alias one address are probed once. A uprobe on a file applies to every process that maps it, now or
later. About every `rescan_s` the poll thread looks in /proc/*/maps again and probes libraries it had
not seen (a libcuda outside ldconfig's paths, loaded after start).

BPF side: `counts` keyed by (tgid, symbol index), lossless; with stream=True each call also goes
through the ring buffer as a "launch" ProbeEvent (name = the symbol), reservation failures in `lost`.
"""

from __future__ import annotations

import asyncio
import glob
import mmap
import os
import re
import struct
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

from . import _bcc
from .base import ProbeBackend, ProbeEvent, ProbeUnavailable
from .failure import FailureReporting

CUDA_SYMBOLS = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
                "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz",
                "cuGraphLaunch", "cuGraphLaunch_ptsz")
HSA_SYMBOLS = ("hsa_signal_store_relaxed", "hsa_signal_store_screlease", "hsa_signal_store_release",
               "hsa_queue_add_write_index_relaxed", "hsa_queue_add_write_index_screlease",
               "hsa_queue_add_write_index_scacq_screl")
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
    funcs = "\n".join(f"int on_sym_{i}(struct pt_regs *ctx) {{ return hit({i}); }}"
                      for i in range(n_symbols))
    return (BPF_TEXT.replace("__RING_PAGES__", str(ring_pages))
            .replace("__STREAM__", "1" if stream else "0").replace("__FUNCS__", funcs))


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
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/") and os.path.basename(path).startswith(names):
                        found.add(path)
        except OSError:
            continue
    return sorted(found)


def find_libraries(configured: Iterable[str] | None = None, names: Iterable[str] = LIB_NAMES,
                   search: bool = True) -> list[str]:
    """Library files to probe, one path per distinct file (device, inode).

    `configured` entries may be files or glob patterns and are always used; with `search` the
    ldconfig cache, KNOWN_DIRS and /proc/*/maps are searched for files named like `names`.
    """
    names = tuple(names)
    cands: list[str] = []
    for c in configured or ():
        cands.extend(sorted(glob.glob(c)) or [c])
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


class LaunchProbe(FailureReporting, ProbeBackend):
    """bcc uprobes on launch APIs; see the module docstring.

    start() raises ProbeUnavailable when bcc cannot run, or (with search=False) when no configured
    library exports a known symbol. With search=True it starts even with none found yet and probes
    libraries as /proc/*/maps shows them (`attached` says what is probed). stop() detaches every
    uprobe and joins the poll thread.
    """

    name = "bcc-launches"

    def __init__(self, libs: Iterable[str] | None = None, search: bool = True, stream: bool = False,
                 ring_pages: int = 256, rescan_s: float = 5.0,
                 symbols: Iterable[str] = SYMBOLS, mmap_reader: bool = True) -> None:
        self.libs_configured = list(libs or ())
        self.search = search
        self.stream = stream
        self.ring_pages = ring_pages
        self.rescan_s = rescan_s
        self.mmap_reader = mmap_reader
        self.symbols = tuple(symbols)
        self.attached: dict[str, list[str]] = {}  # library path -> symbols probed there
        self._seen_files: set[tuple[int, int]] = set()
        self._bpf: Any = None
        self._poller: _bcc.RingPoller | None = None
        self._final: dict[tuple[int, str], int] = {}
        self._final_lost = 0

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
        bcc = _bcc.import_bcc()
        pattern = "^(" + "|".join(re.escape(s) for s in self.symbols) + ")$"
        try:
            found = bcc.BPF.get_user_functions_and_addresses(path.encode(), pattern.encode())
        except Exception:
            return []
        done: list[str] = []
        addrs: set[int] = set()
        for sym, addr in sorted(found, key=lambda t: (len(t[0]), t[0])):
            name = sym.decode() if isinstance(sym, bytes) else sym
            if addr in addrs or name not in self.symbols:
                continue  # an alias of a symbol already probed would count twice
            addrs.add(addr)
            idx = self.symbols.index(name)
            try:
                self._bpf.attach_uprobe(name=path.encode(), sym=name.encode(),
                                       fn_name=f"on_sym_{idx}".encode())
            except Exception:
                continue
            done.append(name)
        if done:
            self.attached[path] = done
        return done

    def _rescan(self) -> None:
        for lib in find_libraries(None, LIB_NAMES, search=True) if self.search else ():
            self._attach_lib(lib)

    def start(self, loop: asyncio.AbstractEventLoop,
              on_events: Callable[[list[ProbeEvent]], None]) -> None:
        libs = find_libraries(self.libs_configured, LIB_NAMES, self.search)
        if not libs and not self.search:
            raise ProbeUnavailable(f"{self.name}: no {'/'.join(LIB_NAMES)} found (configured "
                                   f"{self.libs_configured})")
        self._bpf = _bcc.compile_bpf(self.text(), self.name)
        try:
            for lib in libs:
                self._attach_lib(lib)
            if not self.attached and not self.search:
                raise ProbeUnavailable(f"{self.name}: none of {libs} exports a launch symbol")
            ring_bytes = self.ring_pages * mmap.PAGESIZE if self.mmap_reader else 0
            self._poller = _bcc.RingPoller(self._bpf, "events", self._decode, self.name,
                                           tick=self._rescan, tick_s=self.rescan_s or 3600.0,
                                           ring_bytes=ring_bytes,
                                           on_failure=lambda why: self._failed(loop, why))
            self._poller.start(loop, on_events)
        except BaseException:
            self._bpf.cleanup()
            self._bpf = None
            raise

    def _decode(self, raw: bytes) -> ProbeEvent:
        ts, tgid, tid, sym, _, comm = LAUNCH_EVENT.unpack_from(raw)
        return ProbeEvent(ts, tgid, tid, "launch", -1, 0, self.symbols[sym], _bcc.cstr(comm))

    def by_symbol(self) -> dict[tuple[int, str], int]:
        """Calls per (tgid, symbol) since start, lossless."""
        if self._bpf is None:
            return dict(self._final)
        return {(k.tgid, self.symbols[k.sym]): v.value for k, v in self._bpf[b"counts"].items()}

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
