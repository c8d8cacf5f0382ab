"""/proc/<pid>/stat, read once for every module that needs a process's parent, session, state or
start time (reused pids are told apart by start time)."""

from __future__ import annotations

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
    fields = data[data.rfind(b")") + 2:].split()
    return fields if len(fields) > 19 else None


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
