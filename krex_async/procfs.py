"""/proc/<pid>/stat, read once for every module that needs a process's parent, session, state or
start time (reused pids are told apart by start time)."""

from __future__ import annotations


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
