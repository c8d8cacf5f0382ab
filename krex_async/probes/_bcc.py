"""What the bcc backends share: importing bcc, and a ring-buffer poller on its own thread.

Data flow of a bcc backend:

    BPF program (tracepoint/uprobe) ──ringbuf_reserve──► ring buffer ──► drain thread
        │  (reserve fails: lost[0] += 1;                   every 10 ms: read the ring's mmap (MmapRing;
        │   submit with BPF_RB_NO_WAKEUP)                  bcc's ring_buffer_consume where not x86-64),
        └─ counts map (per tgid, lossless)                 decode, then the batch goes to the loop through
                                                           loop.call_soon_threadsafe(on_events, batch)

bcc is Debian's python3-bpfcc (not on PyPI). `import_bcc()` imports it from sys.path (a venv with the
.pth file that .ci/install-bcc.sh writes, or PYTHONPATH as .bcc/activate.sh sets) and otherwise loads
the `bcc` package alone from /usr/lib/python3/dist-packages, without putting the rest of Debian's
packages on sys.path.
"""

from __future__ import annotations

import asyncio
import ctypes as ct
import errno
import importlib.util
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from types import ModuleType
from typing import Any

from krex_async.linux import procfs
from krex_async.probes.base import ProbeEvent, ProbeUnavailable
from krex_async.probes.hold import HOLD

DEBIAN_BCC = "/usr/lib/python3/dist-packages/bcc/__init__.py"


def import_bcc() -> ModuleType:
    """Return the `bcc` module. Raises ProbeUnavailable (with the reason) when it cannot be imported."""
    try:
        import bcc  # type: ignore[import-not-found]

        return bcc
    except ImportError as e:
        first = e
    except Exception as e:  # libbcc.so missing or broken: bcc raises OSError at import
        raise ProbeUnavailable(f"bcc import failed: {e}") from e
    if not os.path.exists(DEBIAN_BCC):
        raise ProbeUnavailable(f"bcc not installed ({first}); run .ci/install-bcc.sh")
    try:
        spec = importlib.util.spec_from_file_location(
            "bcc", DEBIAN_BCC, submodule_search_locations=[os.path.dirname(DEBIAN_BCC)]
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bcc"] = mod
        spec.loader.exec_module(mod)
        return mod
    except Exception as e:
        sys.modules.pop("bcc", None)
        raise ProbeUnavailable(f"bcc from {DEBIAN_BCC} failed to load: {e}") from e


def check_root() -> None:
    """bcc needs CAP_BPF/CAP_PERFMON; root is the simple way. Raises ProbeUnavailable otherwise."""
    if os.geteuid() != 0:
        raise ProbeUnavailable(f"eBPF probes need root (euid is {os.geteuid()})")


def compile_bpf(text: str, what: str) -> Any:
    """Compile and load BPF text. Raises ProbeUnavailable with bcc's error (first lines) on failure."""
    bcc = import_bcc()
    check_root()
    try:
        return bcc.BPF(text=text.encode())
    except Exception as e:
        msg = str(e).strip().splitlines()
        raise ProbeUnavailable(f"{what}: BPF compile/load failed: {' | '.join(msg[:3])}") from e


def detach_all(bpf: Any) -> None:
    """Detach every program of a loaded BPF object from its attach points (tracepoints, uprobes,
    kprobes), keeping its maps and ring buffer readable. Best effort: an attach point that
    cannot be detached is left for bpf.cleanup()."""
    for fds, detach in (
        (bpf.tracepoint_fds, bpf.detach_tracepoint),
        (bpf.uprobe_fds, bpf.detach_uprobe_event),
        (bpf.kprobe_fds, bpf.detach_kprobe_event),
        (bpf.raw_tracepoint_fds, bpf.detach_raw_tracepoint),
    ):
        for k in list(fds):
            try:
                detach(k)
            except Exception:
                pass


ENOTSUPP = 524  # the kernel's own 'not supported' (include/linux/errno.h), seen by user space


class CountMap:
    """A BPF hash of integer keys to u64 counts, read whole by BPF_MAP_LOOKUP_BATCH.

    bcc's items() costs two syscalls and microseconds of Python per entry; its items_lookup_batch()
    allocates max_entries-sized arrays on every call. This keeps one pair of arrays for the map's
    life and reads it in one syscall (a few when entries move between calls). Where the kernel has no batch
    lookup (before 5.6: EINVAL), read() falls back to items() for good.
    """

    def __init__(self, table: Any, key_type: Any = ct.c_uint32) -> None:
        self.table = table
        self.fd = table.map_fd
        self.size = int(table.max_entries)
        self._keys = (key_type * self.size)()
        self._values = (ct.c_uint64 * self.size)()
        self._batch: Any = import_bcc().libbcc.lib.bpf_lookup_batch
        self._lock = threading.Lock()  # the arrays are shared: the loop and the poll thread read
        self.batched = True

    def read(self) -> dict[int, int]:
        """Every key's count now; safe from any thread. Raises OSError when the map cannot be
        read."""
        with self._lock:
            return self._read()

    def _read(self) -> dict[int, int]:
        if not self.batched:
            return {k.value: v.value for k, v in self.table.items()}
        total = 0
        token = ct.c_uint32(0)
        count = ct.c_uint32(0)
        k_size, v_size = ct.sizeof(self._keys._type_), 8
        while total < self.size:
            count.value = self.size - total
            res = self._batch(
                self.fd,
                ct.byref(token) if total else None,
                ct.byref(token),
                ct.byref(self._keys, k_size * total),
                ct.byref(self._values, v_size * total),
                ct.byref(count),
            )
            err = ct.get_errno()
            total += count.value
            if res == 0:
                if count.value == 0:
                    break  # no progress (a bucket grew under us): what was read stands
                continue
            if err == errno.ENOENT:
                break  # the end of the map
            if total == 0 and err in (errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP):
                self.batched = False
                return self._read()
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on map fd {self.fd}: {os.strerror(err)}")
        return dict(zip(self._keys[:total], self._values[:total]))


def retire_counts(
    table: Any,
    keys: Iterable[Any],
    gone: Callable[[Any], bool],
    name: Callable[[Any], Hashable],
    into: dict[Any, int],
    lock: threading.Lock,
) -> None:
    """Poll thread: move the counts under those of `keys` whose owner is `gone` (an exited
    process, a removed cgroup) from the BPF hash `table` into `into`, under `name(key)`. The
    kernel never empties a count map: full, it counts no new owner. `lock` is held while a count
    moves, so a reader that takes it sees each count in the map or in `into`, never in both or
    neither."""
    for k in keys:
        HOLD.wait()
        if not gone(k):
            continue
        with lock:
            n = table.pop(k, None)
            if n is not None:
                key = name(k)
                into[key] = into.get(key, 0) + n.value


def exited(tgid: int) -> bool:
    """No process `tgid` in /proc (its pid may be reused later: counts are kept per tgid anyway)."""
    return not procfs.exists(tgid)


def sum_percpu(table: Any, key: int = 0) -> int:
    """Sum one key of a BPF_PERCPU_ARRAY across CPUs."""
    try:
        return int(sum(table.getvalue(table.Key(key))))
    except Exception:
        return 0


class MmapRing:
    """A BPF ring buffer read straight from its mmap, with no per-record ctypes callback.

    The kernel's layout: page 0 the consumer position (ours to write), page 1 the producer position,
    then the data area, mapped twice in a row so a record that wraps is still contiguous. Each record
    is an 8-byte header (u32 length with BUSY and DISCARD bits, u32 page offset), the data, padding to
    8 bytes. x86-64 only (its ordering makes plain loads and stores safe); elsewhere RingPoller uses
    bcc's reader.

    The positions are read and written through memoryview casts ('Q', 'I'): one aligned 8- or 4-byte
    load or store each. struct.pack_into must not be used on the consumer page: it zeroes the field
    first and then writes it byte by byte, and a BPF producer that reads the position in that window
    sees the ring as full and drops the event (the lost events of bench/RESULTS.md sections 5 and 8).
    """

    BUSY, DISCARD = 1 << 31, 1 << 30

    def __init__(self, map_fd: int, size: int) -> None:
        page = mmap.PAGESIZE
        self.size, self.page = size, page
        self.cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self.prod = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        except BaseException:
            self.cons.close()
            raise
        self._cons_q = memoryview(self.cons).cast("Q")
        self._prod_q = memoryview(self.prod).cast("Q")
        self._words = memoryview(self.prod).cast("I")

    def pending(self) -> int:
        """Bytes committed or reserved in the ring and not yet consumed."""
        return int(self._prod_q[0] - self._cons_q[0])

    def read(self) -> list[bytes]:
        """Every committed record since the last read (stops at one still being written)."""
        cons = self._cons_q[0]
        prod = self._prod_q[0]
        out = []
        mask, base, data, words = self.size - 1, self.page, self.prod, self._words
        busy, discard = self.BUSY, self.DISCARD
        while cons < prod:
            off = base + (cons & mask)
            ln = words[off >> 2]
            if ln & busy:
                break
            n = ln & ~(busy | discard)
            if not ln & discard:
                out.append(data[off + 8 : off + 8 + n])
            cons += (n + 8 + 7) & ~7
        self._cons_q[0] = cons
        return out

    def close(self) -> None:
        for view in (self._cons_q, self._prod_q, self._words):
            view.release()
        self.cons.close()
        self.prod.close()


class RingPoller:
    """Owns a loaded BPF object's ring buffer and the thread that drains it.

    The BPF side submits with BPF_RB_NO_WAKEUP, so producers never pay for waking us; this thread
    drains the ring every `interval_s` (ring_buffer_consume), copies each record out as bytes in the
    callback, then decodes the lot with `decode(raw) -> ProbeEvent | None` and hands the batch to
    the loop. The ring must hold what arrives while the thread is not scheduled or busy: the ioctl
    probe's 4096 pages (16 MiB) hold 262144 records of 64 bytes, 2.6 s at 100k events/s; the thread
    itself must keep up on average (about 2 us of CPU per event here: 20% of a core at 100k/s).
    `tick()` runs on this thread every `tick_s` (map upkeep). Neither a drain nor a tick starts
    while a region is entering (hold.HOLD); a long tick should call HOLD.wait() between its steps.
    `stop(snapshot)` detaches the programs, lets the thread drain what they produced and exit, calls
    `snapshot()` (the owner reads its final counts and lost there: they then describe exactly the
    records delivered), then releases everything (bpf.cleanup()).
    """

    def __init__(
        self,
        bpf: Any,
        ringbuf: str,
        decode: Callable[[bytes], ProbeEvent | None],
        name: str,
        tick: Callable[[], None] | None = None,
        tick_s: float = 1.0,
        interval_s: float = 0.01,
        ring_bytes: int = 0,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.bpf = bpf
        self._decode = decode
        self._tick = tick
        self._tick_s = tick_s
        self._interval_s = interval_s
        self._name = name
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()  # held while tick() runs; stop() takes it to end ticks
        self._no_tick = False
        self._thread: threading.Thread | None = None
        self._raw: list[bytes] = []
        self.delivered = 0
        self.undecodable = 0  # records read but not decoded: lost as detail, counted in lost()
        self.error: BaseException | None = None
        self.paused = threading.Event()  # set: records wait in the ring buffer (tests, benchmarks)
        self._mm: MmapRing | None = None
        table = bpf[ringbuf.encode()]
        if ring_bytes and platform.machine() in ("x86_64", "AMD64"):
            try:
                self._mm = MmapRing(table.map_fd, ring_bytes)
            except (OSError, ValueError):
                self._mm = None
        if self._mm is None:
            table.open_ring_buffer(self._on_record)
        self.reader = "mmap" if self._mm is not None else "bcc"

    def _on_record(self, _ctx: Any, data: int, size: int) -> int:
        self._raw.append(ct.string_at(data, size))
        return 0

    def _drain(self) -> list[ProbeEvent]:
        if self._mm is not None:
            raw = self._mm.read()
        else:
            self.bpf.ring_buffer_consume()
            raw, self._raw = self._raw, []
        out = []
        for r in raw:
            try:
                ev = self._decode(r)
            except Exception as e:  # a decode bug costs that record, not the poll thread
                self.error = e
                self.undecodable += 1
                continue
            if ev is not None:
                out.append(ev)
        return out

    def pending(self) -> int | None:
        """Bytes waiting in the ring (mmap reader only; None with bcc's reader)."""
        return self._mm.pending() if self._mm is not None else None

    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        """Start the drain thread. Decode and upkeep errors are survived (counted, kept in
        `error`); anything else (reading the ring failing, a closed mapping) ends the thread: the
        reason goes to `on_failure`, called once on this thread, and `error` keeps it."""

        def deliver(batch: list[ProbeEvent]) -> bool:
            if batch:
                self.delivered += len(batch)
                try:
                    loop.call_soon_threadsafe(on_events, batch)
                except RuntimeError:  # loop closed under us: stop quietly
                    return False
            return True

        def run() -> None:
            from krex_async.probes.failure import name_thread

            name_thread(f"krex-probe-{self._name}"[:15])
            next_tick = time.monotonic() + self._tick_s
            try:
                while not self._stop.wait(self._interval_s):
                    if self.paused.is_set():
                        continue
                    HOLD.wait()  # a region is entering: leave the GIL to the loop
                    if not deliver(self._drain()):
                        return
                    if self._tick is not None and time.monotonic() >= next_tick:
                        next_tick = time.monotonic() + self._tick_s
                        HOLD.wait()
                        with self._tick_lock:
                            try:
                                if not self._no_tick:
                                    self._tick()
                            except Exception as e:  # upkeep failing leaves the stream running
                                self.error = e
                # Stopping: hand over everything still in the ring. One more pass catches a
                # record that was being written during the first.
                for _ in range(2):
                    deliver(self._drain())
            except BaseException as e:
                self.error = e
                if self._on_failure is not None:
                    self._on_failure(f"{self._name}: poll thread failed: {e!r}")

        self._thread = threading.Thread(target=run, name=f"krex-probe-{self._name}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, snapshot: Callable[[], None] | None = None) -> None:
        """Detach the programs, join the thread (its last drains hand over every record they
        produced), call `snapshot()`, unmap the ring and release the BPF object. Safe after a
        failure. Ticks end first, so none attaches anything after the detach."""
        with self._tick_lock:
            self._no_tick = True
        detach_all(self.bpf)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if snapshot is not None:
            try:
                snapshot()
            except Exception as e:
                self.error = e
        if self._mm is not None:
            try:
                self._mm.close()
            except (BufferError, ValueError):
                pass
            self._mm = None
        try:
            self.bpf.cleanup()
        except Exception:
            pass


def cstr(raw: bytes) -> str:
    """A NUL-terminated byte field as text."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
