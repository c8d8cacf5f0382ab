"""Every read of /proc lives here: the process list, /proc/<pid>/stat (parent, session, state, start
time: reused pids are told apart by start time, read one way, start_time), cmdline, environ, status,
cgroup, maps, open fds, threads, the mount table, file locks and memory figures. Each reader answers
None (or []) for a process that is gone or unreadable: /proc changes under every walk.

Not here: krex_async/runtime, loaded into every command's interpreter, lists its own fds with os
alone (importing this module there would cost each command's start-up its imports)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

PROC = "/proc"  # the root every reader takes (`proc`): tests give a fake one
MOUNTINFO = "/proc/self/mountinfo"


def stat_fields(pid: int, proc: str = PROC) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name, from its state (field 3) on, or None
    when the process is gone or unreadable. The name may hold spaces and parentheses: the fields
    are taken after its last ')'. Index 0 is the state, 1 the parent, 3 the session, 19 the start
    time in clock ticks since boot (proc(5) numbers these fields 3, 4, 6 and 22)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields if len(fields) > 19 else None


class Stat(NamedTuple):
    """What /proc/<pid>/stat says of a process that krex uses."""

    state: str  # R, S, D, T, Z, X...
    ppid: int
    session: int
    start: int  # when it started, in clock ticks since boot: a reused pid has another


def stat(pid: int, proc: str = PROC) -> Stat | None:
    """A process's state, parent, session and start time, or None when it is gone or unreadable."""
    f = stat_fields(pid, proc)
    if f is None:
        return None
    return Stat(f[0].decode(errors="replace"), int(f[1]), int(f[3]), int(f[19]))


def start_time(pid: int, proc: str = PROC) -> int | None:
    """When `pid` started (clock ticks since boot: a reused pid has another), or None when it is
    gone or unreadable. The one reading of it: every comparison of start times compares these."""
    st = stat(pid, proc)
    return None if st is None else st.start


def pids(proc: str = PROC) -> list[int]:
    """Every process /proc lists now ([] when it cannot be listed)."""
    try:
        return [int(d) for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return []


def exists(pid: int, proc: str = PROC) -> bool:
    """Whether /proc has an entry for `pid` (a zombie has one; its pid may be reused later)."""
    return os.path.exists(f"{proc}/{pid}")


def _read(path: str, limit: int = -1) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def cmdline(pid: int | str, proc: str = PROC, limit: int = -1) -> bytes | None:
    """/proc/<pid>/cmdline as it is (NUL-separated argv; b"" for a kernel thread, or a process in
    the middle of an exec), its first `limit` bytes when given; None when gone or unreadable."""
    return _read(f"{proc}/{pid}/cmdline", limit)


def environ(pid: int | str, proc: str = PROC) -> bytes | None:
    """/proc/<pid>/environ (NUL-separated), None when gone or another user's."""
    return _read(f"{proc}/{pid}/environ")


def status(pid: int | str, proc: str = PROC) -> dict[str, str] | None:
    """/proc/<pid>/status as {key: value, whitespace collapsed}, None when gone or unreadable."""
    raw = _read(f"{proc}/{pid}/status")
    if raw is None:
        return None
    out = {}
    for line in raw.decode(errors="surrogateescape").splitlines():
        key, _, rest = line.partition(":")
        out[key] = " ".join(rest.split())
    return out


def security_label(pid: int | str, proc: str = PROC) -> str:
    """The process's LSM label (/proc/<pid>/attr/current), "" when there is none or it is gone."""
    raw = _read(f"{proc}/{pid}/attr/current")
    return "" if raw is None else raw.decode(errors="replace").strip("\0\n")


def exe(pid: int | str, proc: str = PROC) -> str | None:
    """The executable a process runs, links resolved; None when gone or unreadable."""
    try:
        return os.path.realpath(f"{proc}/{pid}/exe", strict=True)
    except OSError:
        return None


def maps(pid: int | str, proc: str = PROC) -> str | None:
    """/proc/<pid>/maps, None when gone or unreadable."""
    raw = _read(f"{proc}/{pid}/maps")
    return None if raw is None else raw.decode(errors="surrogateescape")


def in_root(pid: int, path: str, proc: str = PROC) -> str:
    """`path` as process `pid` sees it (through its root: another mount namespace's files)."""
    return f"{proc}/{pid}/root{path}"


def tids(pid: int | str, proc: str = PROC) -> list[int] | None:
    """The threads of a process, None when it is gone or unreadable."""
    try:
        return [int(t) for t in os.listdir(f"{proc}/{pid}/task")]
    except OSError:
        return None


def fds(pid: int | str, proc: str = PROC) -> list[int] | None:
    """The open fds of a process, None when it is gone or they may not be listed."""
    try:
        return [int(fd) for fd in os.listdir(f"{proc}/{pid}/fd")]
    except OSError:
        return None


def fd_target(pid: int | str, fd: int, proc: str = PROC) -> str | None:
    """What fd `fd` of a process names (a path, or "socket:[N]"...), None when it is closed or gone."""
    try:
        return os.readlink(f"{proc}/{pid}/fd/{fd}")
    except OSError:
        return None


def fd_flags(pid: int | str, fd: int, proc: str = PROC) -> int | None:
    """The open flags of fd `fd` of a process (os.O_* bits, from fdinfo), None when unknown."""
    raw = _read(f"{proc}/{pid}/fdinfo/{fd}")
    for line in (raw or b"").splitlines():
        if line.startswith(b"flags:"):
            try:
                return int(line.split()[1], 8)
            except (ValueError, IndexError):
                return None
    return None


def thread_state(tid: int, proc: str = PROC) -> tuple[str, str] | None:
    """(state, wchan: where it sleeps, "-" for nowhere) of a thread, None when it is gone."""
    raw, wchan = _read(f"{proc}/{tid}/stat"), _read(f"{proc}/{tid}/wchan")
    if raw is None or wchan is None:
        return None
    fields = raw.rsplit(b")", 1)[-1].split()
    if not fields:
        return None
    return fields[0].decode(errors="replace"), wchan.decode(errors="surrogateescape").strip() or "-"


def flock_holders(inode: int, proc: str = PROC) -> list[int]:
    """The pids holding a flock on a file of inode `inode` (/proc/locks; a lock on another device's
    file of that inode counts too), [] when /proc/locks cannot be read."""
    raw = _read(f"{proc}/locks")  # "1: FLOCK  ADVISORY  READ 3495 fe:00:2310195 0 EOF"
    try:
        rows = [w.split() for w in (raw or b"").decode().splitlines()]
        return sorted({int(w[4]) for w in rows if w[1:2] == ["FLOCK"] and w[5].endswith(f":{inode}")})
    except (ValueError, IndexError):
        return []


def meminfo(proc: str = PROC) -> dict[str, int]:
    """/proc/meminfo's figures in bytes ({} when unreadable)."""
    raw = _read(f"{proc}/meminfo")
    out: dict[str, int] = {}
    try:
        for line in (raw or b"").decode().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    except ValueError:
        return {}
    return out


def ptrace_scope(proc: str = PROC) -> str | None:
    """Yama's ptrace_scope ("0": classic, "1": descendants only...), None without Yama."""
    raw = _read(f"{proc}/sys/kernel/yama/ptrace_scope")
    return None if raw is None else raw.decode(errors="replace").strip()


def tcp_sockets(proc: str = PROC) -> list[str]:
    """The rows of net/tcp and net/tcp6: this network namespace's TCP sockets, every user's, their
    headers left out (a table missing, as net/tcp6 without IPv6, adds none). OSError when one
    cannot be read."""
    rows: list[str] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                rows += f.readlines()[1:]
        except FileNotFoundError:
            continue
    return rows


def thread_files(pids: list[int], name: str, proc: str = PROC) -> Iterator[tuple[int, str, bytes]]:
    """(pid, tid, contents of /proc/PID/task/TID/NAME) for every thread of `pids`; a process or
    thread gone meanwhile, or a file it cannot read, is left out."""
    for pid in pids:
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"{proc}/{pid}/task/{tid}/{name}", "rb") as f:
                    text = f.read()
            except OSError:
                continue
            yield pid, tid, text


def uninterruptible(pids: list[int], proc: str = PROC) -> list[str]:
    """The threads of `pids` in uninterruptible sleep (state D), as "tid(wchan)"."""
    out = []
    for pid, tid, text in thread_files(pids, "stat", proc):
        if text.rsplit(b")", 1)[-1].split()[:1] != [b"D"]:
            continue
        try:
            with open(f"{proc}/{pid}/task/{tid}/wchan", errors="surrogateescape") as f:
                wchan = f.read().strip()
        except OSError:
            wchan = ""
        out.append(f"{tid}({wchan or '-'})")
    return out


def tgid(tid: int, proc: str = PROC) -> int | None:
    """The process (thread group) of thread `tid`, from /proc/<tid>/status (readable for any thread,
    though /proc lists only processes); None once it is gone."""
    try:
        with open(f"{proc}/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit (the freezer no longer stops it)


def exiting_in_kernel(pid: int, proc: str = PROC) -> bool:
    """Whether `pid` has left user space for good: in the kernel's exit (its memory and files being
    released, a GPU driver freeing device memory as its files close) or a zombie. A process still
    in Python's finalisation or a library's teardown is not, and a freezer still stops it."""
    fields = stat_fields(pid, proc)
    return fields is not None and (fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING))


def tree_memory(roots: dict[str, int], pss: bool = False) -> dict[str, dict[str, int]]:
    """{key: {"rss_bytes": R, "processes": N}} (and "pss_bytes" with `pss`) for each root pid and
    its descendants, from one pass over the process table (psutil). A process that vanishes or is
    unreadable mid-walk is left out; a root that is gone has no entry. PSS reads smaps_rollup per
    process (a few ms each): ask for it only where shared pages matter (warm workers)."""
    import psutil

    attrs = ["ppid", "memory_full_info" if pss else "memory_info"]
    children: dict[int, list[int]] = {}
    mem: dict[int, Any] = {}
    for p in psutil.process_iter(attrs):
        children.setdefault(p.info["ppid"] or 0, []).append(p.pid)
        m = p.info.get("memory_full_info") or p.info.get("memory_info")
        if m is not None:
            mem[p.pid] = m
    out: dict[str, dict[str, int]] = {}
    for key, root in roots.items():
        if root not in mem:
            continue
        todo, seen, total, shared, n = [root], set(), 0, 0, 0
        while todo:
            pid = todo.pop()
            if pid in seen:  # parents read at different moments may not form a tree
                continue
            seen.add(pid)
            m = mem.get(pid)
            if m is not None:
                total += m.rss
                shared += getattr(m, "pss", 0)
                n += 1
            todo.extend(children.get(pid, ()))
        out[key] = {"rss_bytes": total, "processes": n} | ({"pss_bytes": shared} if pss else {})
    return out


def memory(pid: int, proc: str = PROC) -> tuple[int, int] | None:
    """(RSS, PSS) of a process in bytes from smaps_rollup, or None when gone or unreadable. PSS
    shares each page among the processes that map it: what one more such process costs the host."""
    got = {}
    try:
        with open(f"{proc}/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"Rss", b"Pss"):
                    got[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return (got[b"Rss"], got[b"Pss"]) if len(got) == 2 else None


@dataclass(frozen=True)
class Mount:
    """One line of /proc/<pid>/mountinfo."""

    point: str  # where it is mounted (octal escapes such as \040 decoded)
    root: str  # the directory of the filesystem mounted there ("/" unless a bind mount)
    fstype: str  # "cgroup2", "cgroup", "tracefs"...
    options: tuple[str, ...]  # the super options: a v1 cgroup's controllers are among them


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts(*fstypes: str, mountinfo: str = MOUNTINFO) -> list[Mount]:
    """The mounts of this mount namespace in mountinfo order, only those of `fstypes` when given;
    [] when the table cannot be read."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or not rfields or (fstypes and rfields[0] not in fstypes):
            continue
        opts = tuple(rfields[2].split(",")) if len(rfields) > 2 else ()
        out.append(Mount(_unescape(fields[4]), _unescape(fields[3]), rfields[0], opts))
    return out


def cgroups(pid: int | str = "self", proc: str = PROC) -> list[tuple[str, str, str]] | None:
    """/proc/<pid>/cgroup as (hierarchy id, controllers, path) per line: ("0", "", path) is the v2
    one; None when the process is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/cgroup", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
    return out
