"""Region cores: fence a command's cgroup (or some of its pids) onto a set of cpus, and restore.

Three mechanisms, one interface (`Cores.apply`):
- "v2": cpuset.cpus of the command's leaf cgroups (run/, keep/) in the v2 tree, and, for the region
  owner's pids (keep/), a remote cpuset partition (cpuset.cpus.exclusive up the chain, then
  cpuset.cpus.partition=root) where the kernel accepts it; a refused partition is remembered and the
  plain cpuset still applies.
- "v1": the same leaves in the v1 cpuset hierarchy (hybrid hosts). Children are created with
  cgroup.clone_children=1 so cpus and mems are set before any task joins; only leaves are written,
  so a parent never shrinks under a child (EBUSY in v1).
- "none": sched_setaffinity of every thread, originals kept per thread.
Originals are recorded in the intent record before anything changes.
"""

from __future__ import annotations

import errno
import os

from krex_async.isolation.base import IsolationError
from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS, CgroupVanished
from krex_async.isolation.intent import KREX, Intent
from krex_async.linux import procfs


def fmt(cpus: frozenset[int] | set[int]) -> str:
    """{0,1,2,5} -> '0-2,5'."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def parse(text: str) -> frozenset[int]:
    """'0-2,5' -> {0,1,2,5}; '' -> {}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def move(fs: CgroupFS, rel: str, pids: list[int]) -> None:
    """Move processes into `rel`; a pid that exited meanwhile is skipped."""
    for pid in pids:
        try:
            fs.write(rel, "cgroup.procs", str(pid))
        except CgroupVanished:
            raise
        except CgroupFileError as e:
            if e.errno != errno.ESRCH:  # exited meanwhile
                raise


class Cores:
    """Fencing for one backend. `mode` is "v2", "v1" or "none" (see module docstring)."""

    def __init__(
        self, mode: str, v2: CgroupFS, v1: CgroupFS | None, intent: Intent, base: str = KREX
    ) -> None:
        self.mode, self.v2, self.v1, self.intent = mode, v2, v1, intent
        #: the daemon's instance directory (krex/<instance>), and the directories down to it
        self.base = base
        self.chain = [KREX] + ([base] if base != KREX else [])
        self.fs: CgroupFS = v1 if (mode == "v1" and v1 is not None) else v2
        # Partitions are opt-in (KREX_CPUSET_PARTITION=1): on a 6.18 kernel, undoing one left its
        # sibling leaf refusing cpuset.cpus="" with ENOSPC. Plain cpuset fences give
        # the owner its cores alone as well, since every other command is fenced off them.
        self.partition: bool | None = None if os.environ.get("KREX_CPUSET_PARTITION") == "1" else False
        self.partition_why = (
            ""
            if self.partition is None
            else "cpuset partitions are off (KREX_CPUSET_PARTITION=1 turns them on)"
        )

    def setup_root(self) -> None:
        """Make krex/ and the instance directory able to carry cpusets. Raises CgroupFileError."""
        if self.mode == "v2":
            self._enable(self.v2, "")
            for rel in self.chain:
                self.v2.mkdir(rel)
                self._enable(self.v2, rel)
        elif self.mode == "v1" and self.v1 is not None:
            for rel in self.chain:
                self.v1.mkdir(rel)
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if not self.v1.read(rel, name).strip():
                        self.v1.write(rel, name, self.v1.read(os.path.dirname(rel), name).strip())
                self.v1.write(rel, "cgroup.clone_children", "1")

    @staticmethod
    def _enable(fs: CgroupFS, rel: str) -> None:
        if "cpuset" not in fs.read(rel, "cgroup.subtree_control").split():
            fs.write(rel, "cgroup.subtree_control", "+cpuset")

    def setup_group(self, top: str, leaves: list[str]) -> None:
        """After mkdir of `top` in v2 (before its leaves): enable cpuset below it; make the v1 twin."""
        if self.mode == "v2":
            self._enable(self.v2, top)
        elif self.mode == "v1" and self.v1 is not None:
            self.v1.mkdir(top)
            self.v1.write(top, "cgroup.clone_children", "1")
            for leaf in leaves:
                self.v1.mkdir(leaf)

    def remove_group(self, top: str, leaves: list[str]) -> None:
        if self.mode == "v1" and self.v1 is not None:
            for rel in leaves + [top]:
                self.v1.rmdir(rel)

    def originals(self, top: str, leaves: list[str]) -> dict[str, str]:
        """{cpuset.cpus path of each leaf: what restoring writes back} for the intent record (v2:
        "" = inherit; v1: the group's cpus, which krex never changes); {} without cpusets."""
        if self.mode == "none":
            return {}
        original = self.fs.read(top, "cpuset.cpus").strip() if self.mode == "v1" else ""
        return {self.fs.path(leaf, "cpuset.cpus"): original for leaf in leaves}

    def procs_path(self, leaf: str) -> str | None:
        """The v1 cgroup.procs a new process must join too (hybrid), else None."""
        return self.v1.path(leaf, "cgroup.procs") if self.mode == "v1" and self.v1 else None

    async def apply(
        self,
        name: str,
        top: str,
        run: str,
        keep: str,
        cpus: frozenset[int] | None,
        pids: list[int] | None,
        all_pids: list[int],
        affinity: dict[int, set[int]],
        exclusive: bool = False,
    ) -> None:
        """Fence the whole group (`pids` None) or exactly `pids` onto `cpus`; None restores.

        Per-pid fences map onto the two leaves: pids that are all of run/ (a sibling fenced except
        for nothing, or the owner's other processes) fence run/; any other set of pids, and any
        `exclusive` fence (the region owner's cores), is moved into keep/ (others there go back to
        run/) and fences keep/; `exclusive` also asks for a v2 cpuset partition. Pids of other
        leaves keep their cpus. Raises IsolationError naming the file; a vanished group is left
        alone (CgroupVanished propagates to the caller).
        """
        if self.mode == "none":
            self._affinity(cpus, pids if pids is not None else all_pids, affinity, pids is None)
            return
        fs = self.fs
        original = fs.read(top, "cpuset.cpus").strip() if self.mode == "v1" else ""
        in_run, in_keep = set(fs.procs(run)), set(fs.procs(keep))
        if pids is None:
            leaves = [leaf for leaf in (run, keep) if fs.exists(leaf)]
        else:
            want = set(pids) & (in_run | in_keep)
            if not want:
                return
            if want == in_run and not (exclusive and cpus is not None and self.partition is not False):
                # The owner alone in run/ (the usual case) is fenced where it is: moving it to
                # keep/ writes cgroup.procs, whose rwsem waits for an RCU grace period
                # (milliseconds). A partition needs keep/.
                leaves = [run]
            elif want == in_keep or cpus is None:
                leaves = [keep] if want <= in_keep else [x for x in (run, keep) if fs.exists(x)]
            else:
                fs.mkdir(keep)
                move(fs, run, sorted(in_keep - want))
                move(fs, keep, sorted(want - in_keep))
                leaves = [keep]
        if cpus is None:
            if self.mode == "v2" and keep in leaves:
                self._unpartition(keep, top)
            for leaf in leaves:
                self._restore(leaf, top, original)
            return
        if not cpus:
            raise IsolationError(f"set_cores of {name}: empty cpu set")
        await self.intent.ensure(fenced={fs.path(leaf, "cpuset.cpus"): original for leaf in leaves})
        for leaf in leaves:
            fs.write(leaf, "cpuset.cpus", fmt(cpus))
        if self.mode == "v2" and exclusive and leaves == [keep]:
            self._partition(keep, top, cpus)

    def _restore(self, leaf: str, top: str, original: str) -> None:
        """Write the leaf's cpus back. On v2, "" (inherit) can be refused with ENOSPC while cpus
        of the parent are exclusive elsewhere: then the parent's effective cpus are written."""
        try:
            self.fs.write(leaf, "cpuset.cpus", original)
        except CgroupFileError as e:
            if self.mode != "v2" or original or e.errno != errno.ENOSPC:
                raise
            self.fs.write(leaf, "cpuset.cpus", self.fs.read(top, "cpuset.cpus.effective").strip())

    def _partition(self, keep: str, top: str, cpus: frozenset[int]) -> None:
        fs = self.fs
        if self.partition is False or not fs.exists(keep, "cpuset.cpus.partition"):
            return
        try:
            for rel in self.chain:  # each ancestor's exclusive cpus must hold the child's
                have = parse(fs.read(rel, "cpuset.cpus.exclusive"))
                fs.write(rel, "cpuset.cpus.exclusive", fmt(have | cpus))
            fs.write(top, "cpuset.cpus.exclusive", fmt(cpus))
            fs.write(keep, "cpuset.cpus.exclusive", fmt(cpus))
            fs.write(keep, "cpuset.cpus.partition", "root")
            state = fs.read(keep, "cpuset.cpus.partition").strip()
            if state != "root":
                raise IsolationError(f"{fs.path(keep, 'cpuset.cpus.partition')} reads {state!r}")
            self.partition = True
        except (CgroupFileError, IsolationError) as e:
            self.partition, self.partition_why = False, f"cpuset partition refused: {e}"
            self._unpartition(keep, top)

    def _unpartition(self, keep: str, top: str) -> None:
        fs = self.fs
        if not fs.exists(keep, "cpuset.cpus.partition"):
            return
        for rel, name, value in (
            (keep, "cpuset.cpus.partition", "member"),
            (keep, "cpuset.cpus.exclusive", ""),
            (top, "cpuset.cpus.exclusive", ""),
        ):
            try:
                if fs.read(rel, name).split()[:1] != [value] and (value or fs.read(rel, name).strip()):
                    fs.write(rel, name, value)
            except CgroupFileError:
                pass
        try:
            mine = parse(fs.read(keep, "cpuset.cpus"))
            for rel in reversed(self.chain):
                rest = parse(fs.read(rel, "cpuset.cpus.exclusive")) - mine
                fs.write(rel, "cpuset.cpus.exclusive", fmt(rest))
        except CgroupFileError:
            pass

    @staticmethod
    def _affinity(
        cpus: frozenset[int] | None, pids: list[int], saved: dict[int, set[int]], everything: bool
    ) -> None:
        """sched_setaffinity of every thread of `pids`, originals kept per thread in `saved`.

        A restore (`cpus` None) also lifts the fence from threads and processes that began while
        fenced (they inherited it and have no original of their own): each gets the original of
        its process's saved thread, else of its nearest saved ancestor."""
        tids: list[tuple[int, int]] = []  # (tid, its process)
        for pid in pids:
            tids.extend((tid, pid) for tid in procfs.tids(pid) or ())
        if cpus is None:
            todo = {tid: saved[tid] for tid, _ in tids if tid in saved}
            if everything:
                todo.update(saved)
            for tid, pid in tids:
                if tid not in todo and (orig := _inherited(pid, saved)) is not None:
                    todo[tid] = orig
            for tid, orig in todo.items():
                try:
                    os.sched_setaffinity(tid, orig)
                except OSError:
                    pass
                saved.pop(tid, None)
            return
        for tid, _ in tids:
            try:
                saved.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                continue
            except OSError as e:
                raise IsolationError(f"sched_setaffinity({tid}, {fmt(cpus)}): {e.strerror}") from None


def _inherited(pid: int, saved: dict[int, set[int]]) -> set[int] | None:
    """The saved original of `pid` or of its nearest ancestor that has one (a fork inherits its
    parent's affinity, so that is what it had before the fence), None when none has."""
    for _ in range(64):
        if pid in saved:
            return saved[pid]
        st = procfs.stat(pid)
        if st is None or st.ppid <= 1:
            return None
        pid = st.ppid
    return None
