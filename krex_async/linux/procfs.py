"""Every read of /proc lives here: /proc/<pid>/stat (parent, session, state, start time: reused pids
are told apart by start time), /proc/<pid>/cgroup, the mount table, and memory figures."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def stat_fields(pid: int, proc: str = "/proc") -> list[bytes] | None:
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


def thread_files(pids: list[int], name: str, proc: str = "/proc") -> Iterator[tuple[int, str, bytes]]:
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


def uninterruptible(pids: list[int], proc: str = "/proc") -> list[str]:
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


def tgid(tid: int, proc: str = "/proc") -> int | None:
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


def exiting_in_kernel(pid: int, proc: str = "/proc") -> bool:
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


def memory(pid: int, proc: str = "/proc") -> tuple[int, int] | None:
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


def mounts(*fstypes: str, mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
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


def cgroups(pid: int | str = "self", proc: str = "/proc") -> list[tuple[str, str, str]] | None:
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
