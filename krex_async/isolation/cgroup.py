"""The cgroup backend: v2 freezer, cpuset cores (v2, or v1 on hybrid hosts), crash-safe thaw.

Several daemons may share a cgroup root: each owns an instance directory ``<root>/krex/<instance>/``
named after its state dir (so a restart on the same state dir finds what its predecessor left, and
daemons on other state dirs never meet it), and its start-up sweep, watchdog and commands stay
inside it. A daemon holds `<state_dir>/cgroup.owner` locked (flock) for its life: a second one on
the same instance finds the lock taken and refuses to start instead of thawing the first one's
regions (InstanceBusy).

Each command gets ``<root>/krex/<instance>/cmd-<id>/`` in v2 with two leaves: ``run/`` where the
command starts and ``keep/`` for the region owner's own processes (created on demand). A freeze of the
whole group writes ``cmd-<id>/cgroup.freeze``; a freeze that keeps some pids moves them into
``keep/`` and freezes ``run/`` only, so a group is never frozen through a parent it shares with
anyone else. On hybrid hosts the v1 cpuset hierarchy carries the same tree for cores.

The wrapper from `launch_argv` writes its own pid into the cgroup.procs files (v1 first, v2 last) and
then execs the command, so the command's first instruction already runs inside its cgroups; when the
v2 leaf was frozen beforehand, the wrapper stops on return from that write and never reaches exec
until thawed.

Freeze: record intent, arm the cgroup.events watch, write 1, read back, await `frozen 1` within the
bound; on timeout or any error write 0 back and raise FreezeError. All file access: cgroupfs.CgroupFS.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import shutil
import signal as _signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from krex_async.isolation.base import Backend, Freeze, FreezeError, Group, IsolationError
from krex_async.isolation.cgroupfs import (
    CgroupFileError,
    CgroupFS,
    CgroupVanished,
    EventsWatcher,
    Layout,
    Watch,
    detect,
)
from krex_async.isolation.cpuset import Cores, move
from krex_async.isolation.instance import claim_instance, gate, instance_name, mark_instance, remove_instance
from krex_async.isolation.intent import KREX, Intent, sweep
from krex_async.linux import procfs
from krex_async.logs import get as get_log

log = get_log("krex.cgroup")

DEFAULT_STATE_DIR = (
    "/run/krex" if os.geteuid() == 0 else os.path.join(os.environ.get("XDG_RUNTIME_DIR", "/tmp"), "krex")
)

# $1.. are cgroup.procs files up to "--", then the command. A failed join exits 125 before exec.
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass
class CgroupGroup(Group):
    top: str = ""  # krex/cmd-<id>, relative to the v2 root (and the v1 cpuset root)
    affinity: dict[int, set[int]] = field(default_factory=dict)  # "none" cpuset mode: originals
    has_keep: bool = False  # keep/ exists in v2 (krex makes it; only krex does)
    thawed_at: float = 0.0  # time.monotonic() of the last thaw (its cgroup.events notification)
    written: set[str] = field(default_factory=set)  # cgroups whose cgroup.freeze we set to 1
    #: cgroup.events watches of top/ and run/, armed at create() and closed at remove(): armed
    #: long before any write, and a freeze pays no inotify_add_watch (tens of microseconds)
    watches: dict[str, Watch] = field(default_factory=dict)

    @property
    def run(self) -> str:
        return f"{self.top}/run"

    @property
    def keep(self) -> str:
        return f"{self.top}/keep"


def probe_cgroup(root: str | None = None) -> tuple[bool, str]:
    """Can the cgroup backend run here (root of a writable v2 tree with cgroup.freeze)? And why."""
    try:
        lay = detect(root)
    except (IsolationError, OSError) as e:
        return False, str(e)
    probe = os.path.join(lay.v2, KREX)
    try:
        os.makedirs(probe, exist_ok=True)
    except OSError as e:
        return False, f"cannot create {probe}: {e.strerror}"
    if not os.path.exists(os.path.join(probe, "cgroup.freeze")):
        return False, f"{probe} has no cgroup.freeze (kernel older than 5.2?)"
    return True, lay.reason


class CgroupBackend(Backend):
    """Isolation through cgroups. `root`: a v2 directory to use instead of our own cgroup;
    `cpuset_root`: the v1 cpuset directory on hybrid hosts; `cpuset`: "auto", "v2", "v1" or "none";
    `ncpus`: cpus krex may hand out (default: our affinity). Raises IsolationError when unusable."""

    name = "cgroup"
    wrapper_drops_privileges = True

    def __init__(
        self,
        root: str | None = None,
        state_dir: str = DEFAULT_STATE_DIR,
        ncpus: int | None = None,
        *,
        cpuset_root: str | None = None,
        cpuset: str = "auto",
    ) -> None:
        super().__init__()
        self.layout: Layout = detect(root, cpuset_root, cpuset)
        self.v2 = CgroupFS(self.layout.v2, keep_procs=True)
        self.v1 = CgroupFS(self.layout.v1_cpuset) if self.layout.v1_cpuset else None
        self.state_dir = state_dir
        #: this daemon's own directory under krex/: everything it makes, sweeps and watches
        self.base = f"{KREX}/{instance_name(state_dir)}"
        self._owner_fd = claim_instance(state_dir, self.v2.path(self.base))
        self.intent = Intent(state_dir)
        self.cores = Cores(self.layout.cpuset, self.v2, self.v1, self.intent, self.base)
        allowed = sorted(os.sched_getaffinity(0))
        self.cpus = frozenset(allowed[:ncpus] if ncpus else allowed)
        self.reason = self.layout.reason
        try:
            self._make_instance()
        except CgroupFileError as e:
            if self.layout.cpuset != "v2" or not self.v2.exists(self.base):
                os.close(self._owner_fd)  # a start that failed leaves the state dir to the next
                raise
            # v2 forbids processes in a cgroup that hands controllers to children: a daemon that
            # lives in its own delegated cgroup must run in a leaf of it, or be given a root.
            self.cores = Cores("none", self.v2, None, self.intent, self.base)
            self.reason += (
                f"; cpuset unusable ({e}): cores fenced with sched_setaffinity"
                " (run the daemon in a leaf cgroup or configure a root to fix)"
            )
        self.has_kill = self.v2.exists(KREX, "cgroup.kill")
        self.groups: dict[str, CgroupGroup] = {}
        self.orphans: list[tuple[str, list[int]]] = []
        self._watcher: EventsWatcher | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        #: re-read cgroup.events on every loop turn this long before relying on the notification
        self.freeze_spin_s = 0.002
        #: the kernel notifies a cgroup file at most once per 10 ms (later ones are deferred to the
        #: end of that interval): a freeze soon after a thaw spins until that interval is over
        self.notify_interval_s = 0.012

    def start_watchdog(self, pid: int | None = None) -> None:
        """Start the guard process that sweeps when `pid` (default: us) dies. Raises RuntimeError."""
        from krex_async.isolation.watchdog import start_watchdog

        lay = self.layout
        self.watchdog = start_watchdog(
            pid or os.getpid(), lay.v2, lay.v1_cpuset, self.cores.mode, self.state_dir, self.base
        )

    def _watch(self, rel: str) -> Watch:
        if self._watcher is None:
            self._watcher = EventsWatcher()
        return self._watcher.watch(self.v2.path(rel, "cgroup.events"))

    def _group_watch(self, g: CgroupGroup, rel: str) -> Watch:
        """The group's kept watch of `rel` (armed now if it is not yet). Raises CgroupVanished."""
        w = g.watches.get(rel)
        if w is None or w.gone:
            w = g.watches[rel] = self._watch(rel)
        return w

    def _close_watches(self, g: CgroupGroup) -> None:
        for w in g.watches.values():
            w.close()
        g.watches.clear()

    def _make_instance(self) -> None:
        """mkdir krex/ and the instance directory, named (xattr) and able to carry cpusets.
        Raises CgroupFileError."""
        self.v2.mkdir(KREX)
        with gate([self.v2.path(KREX)], exclusive=False):  # no sweep lists it before it is named
            self.v2.mkdir(self.base)
            mark_instance(self.v2.path(self.base), self.state_dir)
            self.cores.setup_root()
            if self.cores.mode == "v1" and self.v1 is not None:  # so `krex cleanup` leaves it alone too
                mark_instance(self.v1.path(self.base), self.state_dir)

    def _make_group(self, g: CgroupGroup) -> None:
        self.v2.mkdir(g.top)
        self.cores.setup_group(g.top, [g.run])
        self.v2.mkdir(g.run)

    async def create(self, command_id: str) -> CgroupGroup:
        """mkdir <instance>/cmd-<id>/run (and the v1 twin). Raises IsolationError (CgroupFileError)."""
        g = CgroupGroup(command_id=command_id)
        g.top = f"{self.base}/{g.name}"
        try:
            try:
                self._make_group(g)
            except CgroupVanished:  # our instance directory, empty, was removed (an older
                self._make_instance()  # `krex cleanup`, a hand's rmdir): made again
                self._make_group(g)
            for rel in (g.top, g.run):
                try:
                    self._group_watch(g, rel)
                except CgroupVanished:
                    raise
                except CgroupFileError:
                    pass  # out of inotify watches, say: armed again at the freeze, or refused there
        except BaseException:
            self._close_watches(g)
            await self._rmdirs(g)
            raise
        self.groups[command_id] = g
        # Record now what a region may later freeze or fence, so that the region pays no write.
        self.intent.note(
            frozen=[self.v2.path(r) for r in (g.top, g.run)],
            fenced=self.cores.originals(g.top, [g.run, g.keep]),
        )
        return g

    def launch_argv(
        self,
        group: Group,
        argv: list[str],
        *,
        frozen: bool,
        as_user: tuple[int, int, list[int]] | None = None,
    ) -> list[str]:
        """`/bin/sh -c <join cgroups; exec>`; with `frozen` the v2 leaf is frozen first (intent
        recorded synchronously), so the command is stopped before its first instruction.

        The wrapper writes cgroup.procs, so it must start with the daemon's privileges: pass
        `as_user=(uid, gid, groups)` to drop to the submitting user after joining (setpriv), and
        spawn without Popen(user=). Raises IsolationError when setpriv is missing.
        """
        g = self._g(group)
        if as_user is not None:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise IsolationError(
                    "setpriv (util-linux) not found: cannot drop to the user after joining the cgroup"
                )
            uid, gid, groups = as_user
            grp = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
            argv = [setpriv, f"--reuid={uid}", f"--regid={gid}", grp, "--", *argv]
        files = self._procs_files(g)
        if frozen:
            self.intent.frozen.add(self.v2.path(g.run))
            self.intent.write_now()
            self.v2.write(g.run, "cgroup.freeze", "1")
            g.frozen = True
            g.written.add(g.run)
        return ["/bin/sh", "-c", _ENTER, "krex-enter", *files, "--", *argv]

    def _procs_files(self, g: CgroupGroup) -> list[str]:
        """The cgroup.procs (and v1 cpuset tasks) files a process of the group's run/ leaf joins."""
        files = [f for f in (self.cores.procs_path(g.run),) if f]
        files.append(self.v2.path(g.run, "cgroup.procs"))
        return files

    def cgroup_dir(self, group: Group) -> str | None:
        return self.v2.path(self._g(group).run)

    def join(self, group: Group, pid: int) -> None:
        """Write `pid` into the group's run/ leaf (v1 cpuset twin first, as the launch wrapper does).
        Raises IsolationError (CgroupFileError) when the kernel refuses."""
        for path in self._procs_files(self._g(group)):
            try:
                with open(path, "w") as f:
                    f.write(str(pid))
            except OSError as e:
                raise IsolationError(f"cannot move pid {pid} into {path}: {e.strerror}") from None

    async def started(self, group: Group, pid: int) -> None:
        group.pid = pid
        # The launch wrapper joins the cgroups itself, but a kill (cgroup.kill) or a freeze can
        # come before it has run and would miss the command: put the leader in from here too
        # (writing a pid that is already there is a no-op; a leader already gone is fine).
        try:
            self.join(group, pid)
        except (OSError, IsolationError):
            pass

    def _leaves(self, g: CgroupGroup, target: str | None = None) -> list[str]:
        """The cgroups that hold the group's processes: run/ and, once made, keep/ (krex puts
        processes nowhere else, and commands cannot make cgroups of their own), within `target`."""
        if target == g.run:
            return [g.run]
        return [g.run, g.keep] if g.has_keep else [g.run]

    def pids(self, group: Group) -> list[int]:
        g = self._g(group)
        found: list[int] = []
        for rel in self._leaves(g):
            found.extend(p for p in self.v2.procs(rel) if p not in found)
        if g.pid in found:
            found.remove(g.pid)  # type: ignore[arg-type]
            found.insert(0, g.pid)  # type: ignore[arg-type]
        return found

    async def freeze(
        self, group: Group, *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> Freeze:
        """Freeze the group (its run/ leaf only when `keep` is given, after moving those pids to keep/).

        Returns Freeze(vanished=True) for a cgroup that is gone or empty. Raises FreezeError after
        writing 0 back when `frozen 1` does not show within `timeout`.
        """
        return (await self.freeze_many([group], keep=keep, timeout=timeout))[0]

    async def freeze_many(
        self, groups: list[Group], *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> list[Freeze]:
        """Freeze the groups together: one intent write (none when create() already recorded them),
        every cgroup.freeze written and read back in one go (each group's watch armed since its
        create), then one bounded wait for all of them. On any failure every group of the batch is
        written back to 0 and the first error propagates (FreezeError names the group and lists
        its tasks with their states)."""
        gs = [self._g(g) for g in groups]
        t0 = time.perf_counter()
        try:
            targets = [self._freeze_target(g, keep) for g in gs]
            await self.intent.ensure(frozen=[self.v2.path(t) for t in targets if t is not None])
            armed: dict[int, tuple[Watch, Callable[[], bool]]] = {}
            stopped: dict[int, list[int]] = {}  # read as each group freezes, while others still go
            for i, (g, target) in enumerate(zip(gs, targets)):
                if target is not None and (w := self._freeze_write(g, target)) is not None:
                    armed[i] = (w, functools.partial(self._frozen_pids, g, target, stopped, i))
            now = time.monotonic()
            spin = max([self.freeze_spin_s] + [g.thawed_at + self.notify_interval_s - now for g in gs])
            done = await Watch.until_all(armed, timeout, spin=spin) if armed else {}
            elapsed = time.perf_counter() - t0
            results = []
            for i, (g, target) in enumerate(zip(gs, targets)):
                if i in armed and i not in done:
                    raise FreezeError(
                        g.name,
                        f"{self.v2.path(target or g.top)} not frozen after "
                        f"{timeout:.3f}s; its threads (state wchan): "
                        f"{self._not_frozen(target or g.top)}",
                    )
                err = done.get(i)
                if err is not None and not isinstance(err, CgroupVanished):
                    raise err
                if i not in armed or err is not None:  # vanished before or after the write
                    self._unfreeze(g)
                    results.append(Freeze(g.name, elapsed, 0, vanished=True))
                    continue
                pids = stopped[i]
                results.append(Freeze(g.name, elapsed, len(pids), vanished=not pids, stopped=pids))
        except BaseException:
            for g in gs:
                self._unfreeze(g)
            raise
        return results

    def _frozen_pids(self, g: CgroupGroup, target: str, into: dict[int, list[int]], i: int) -> bool:
        """Whether `target` shows `frozen 1`; once it does, its pids go to into[i]. Raises
        CgroupVanished."""
        if self.v2.events(target).get("frozen") != 1:
            return False
        into[i] = [p for rel in self._leaves(g, target) for p in self.v2.procs(rel)]
        return True

    def _freeze_target(self, g: CgroupGroup, keep: frozenset[int]) -> str | None:
        """The cgroup to freeze: top/, or run/ after moving the `keep` pids into keep/. None: gone."""
        if not keep:
            return g.top
        mine = [p for p in keep if p in self.pids(g)]
        if not mine:
            return g.top
        try:
            self.v2.mkdir(g.keep)
            g.has_keep = True
            back = [p for p in self.v2.procs(g.keep) if p not in mine]
            move(self.v2, g.run, back)
            move(self.v2, g.keep, mine)
        except CgroupVanished:
            return None
        return g.run

    def _freeze_write(self, g: CgroupGroup, target: str) -> Watch | None:
        """Write 1 with the target's watch armed, read it back. None when the cgroup vanished."""
        try:
            w = self._group_watch(g, target)
            g.written.add(target)
            self.v2.write(target, "cgroup.freeze", "1")
            g.frozen = True
            if self.v2.read(target, "cgroup.freeze").strip() != "1":
                raise FreezeError(g.name, f"{self.v2.path(target, 'cgroup.freeze')} did not read 1")
        except CgroupVanished:
            return None
        return w

    def _not_frozen(self, target: str) -> str:
        """Every thread under `target` with its /proc state and where it sleeps (wchan), for a
        freeze that timed out. The freezer stops threads one by one and cgroup v2 exposes no
        per-thread frozen flag (a frozen thread reads "S" in do_freezer_trap's wait), so which
        of them held the freeze up cannot be told from here: all are listed as tid(state wchan);
        a kernel wait other than the freezer's names the culprit."""
        out = []
        for rel in self.v2.walk(target):
            try:
                tids = [int(x) for x in self.v2.read(rel, "cgroup.threads").split()]
            except CgroupFileError:
                tids = self.v2.procs(rel)
            for tid in tids:
                if (st := procfs.thread_state(tid)) is not None:
                    out.append(f"{tid}({st[0]} {st[1]})")
        return ", ".join(out) or "none listed"

    def _unfreeze(self, g: CgroupGroup) -> None:
        """Write cgroup.freeze=0 wherever we may have written 1, checking each file (the failure
        and removal paths); never raises for a vanished cgroup."""
        for rel in {g.top, g.run} | g.written:
            try:
                if self.v2.read(rel, "cgroup.freeze").strip() != "0":
                    self.v2.write(rel, "cgroup.freeze", "0")
                    g.thawed_at = time.monotonic()
            except CgroupVanished:
                pass
        g.frozen = False
        g.written.clear()

    async def thaw(self, group: Group) -> float:
        """cgroup.freeze=0 where we wrote 1, each read back (no wait: thawing is immediate for the
        tasks). Raises CgroupFileError only for a cgroup that exists and refuses."""
        t0 = time.perf_counter()
        g = self._g(group)
        try:
            for rel in g.written:
                self.v2.write(rel, "cgroup.freeze", "0")
                if self.v2.read(rel, "cgroup.freeze").strip() != "0":
                    raise CgroupFileError(
                        "thaw", self.v2.path(rel, "cgroup.freeze"), "0", OSError(errno.EIO, "did not read 0")
                    )
            g.thawed_at = time.monotonic()
            g.frozen = False
            g.written.clear()
        except CgroupVanished:
            self._unfreeze(g)  # the rest of them, each checked
        return time.perf_counter() - t0

    async def set_cores(
        self,
        group: Group,
        cpus: frozenset[int] | None,
        *,
        pids: list[int] | None = None,
        exclusive: bool = False,
    ) -> None:
        """Fence the group, or exactly `pids`, onto `cpus`; None restores (those pids' leaf, or
        the whole group). `exclusive`: these are region cores for the owner's `pids`: they go to
        keep/ and, on v2, into a cpuset partition where the kernel allows it (else a plain cpuset;
        `self.cores.partition_why` says why). A vanished group is left alone; other failures
        raise IsolationError."""
        g = self._g(group)
        try:
            await self.cores.apply(
                g.name, g.top, g.run, g.keep, cpus, pids, self.pids(g), g.affinity, exclusive
            )
        except CgroupVanished:
            return
        finally:
            if self.cores.mode == "v2" and not g.has_keep:  # apply() may have made keep/
                g.has_keep = self.v2.exists(g.keep)
        if pids is None:
            g.cores = cpus

    async def kill(self, group: Group, sig: int = _signal.SIGKILL) -> None:
        """cgroup.kill for SIGKILL where the kernel has it; else `sig` to every pid (frozen included)."""
        g = self._g(group)
        if sig == _signal.SIGKILL and self.has_kill:
            try:
                self.v2.write(g.top, "cgroup.kill", "1")
                return
            except CgroupVanished:
                return
        for pid in self.pids(g):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def remove(self, group: Group, timeout: float = 2.0) -> None:
        """Wait (bounded, on cgroup.events) until the group is empty, killing it if it is not,
        then rmdir its cgroups. Raises IsolationError when tasks outlive the bound."""
        g = self._g(group)
        try:
            with self._watch(g.top) as w:  # its own: one waiter per Watch object
                empty = lambda: self.v2.events(g.top).get("populated") == 0  # noqa: E731
                if not await w.until(empty, timeout / 2):
                    await self.kill(g)
                    if not await w.until(empty, timeout / 2):
                        raise IsolationError(
                            f"{self.v2.path(g.top)} still has tasks after {timeout}s: {self.pids(g)}"
                        )
        except CgroupVanished:
            pass
        self._unfreeze(g)
        self._close_watches(g)
        await self._rmdirs(g)
        self.intent.forget(
            [self.v2.path(r) for r in (g.top, g.run)]
            + [self.cores.fs.path(r, "cpuset.cpus") for r in (g.run, g.keep)]
        )
        self.groups.pop(g.command_id, None)

    async def _rmdirs(self, g: CgroupGroup) -> None:
        leaves = [g.run, g.keep]
        for attempt in range(50):  # v1 twins can lag the v2 emptiness by a scheduler tick
            try:
                for rel in leaves + [g.top]:
                    self.v2.rmdir(rel)
                self.cores.remove_group(g.top, leaves)
                return
            except CgroupFileError as e:
                if e.errno != errno.EBUSY or attempt == 49:
                    raise
                await asyncio.sleep(0.002)

    async def reconcile(self) -> list[str]:
        """Thaw everything under our instance directory, restore cpusets and partitions, remove
        empty command cgroups; report also what the previous intent record said. Populated
        leftovers stay (self.orphans). Other daemons' instances are not touched."""
        lines, self.orphans = sweep(self.v2, self.v1, self.cores.mode, self.state_dir, base=self.base)
        try:
            self.intent.write_now()
        except OSError as e:  # a full state disk: serve anyway; a region refuses until it clears
            lines.append(
                f"intent record not written ({e.strerror or e}): regions are refused until it can be"
            )
        return lines or ["nothing left by a previous daemon"]

    async def close(self) -> None:
        """Stop the watchdog (clean shutdown: nothing is frozen any more) and the inotify watcher;
        remove the instance directory if it is empty (while the owner lock still keeps any other
        daemon on this state dir from making it), log why when it is not."""
        if self.watchdog is not None:
            from krex_async.isolation.watchdog import release

            release(self.watchdog)
            self.watchdog = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        self.v2.release()
        if self._owner_fd >= 0:  # then the next daemon on this state dir may start
            fss = [self.v2] + ([self.v1] if self.v1 is not None and self.cores.mode == "v1" else [])
            for line in remove_instance(fss, self.base):
                log.warning("instance_kept", detail=line)
            os.close(self._owner_fd)
            self._owner_fd = -1

    def _g(self, group: Group) -> CgroupGroup:
        if not isinstance(group, CgroupGroup):
            raise IsolationError(f"{group.name} is not a cgroup group")
        return group
