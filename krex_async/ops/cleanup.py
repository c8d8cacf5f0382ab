"""`krex cleanup`: thaw and restore every krex cgroup, whatever state a dead daemon left them in.

Runs as the unit's ExecStopPost (after a clean stop, a crash or SIGKILL alike) and by hand. It needs
nothing but the cgroup filesystems: not the daemon, not its state file, not the cgroup backend module
(`python -m krex_async.ops.cleanup` works on its own). Thawing is always safe, so it runs even when no
record of what was frozen survives.

Which trees: the `krex` directory under each root. Roots are the `--root` directories given, else the
configured cgroup_root, this process's own cgroup v2 (with systemd's `.control` leaf stripped, so an
ExecStopPost finds the service's delegated subtree), the cgroup v2 mount, and the v1 freezer and cpuset
hierarchies (their mounts and this process's place in them). Only directories named `krex` and what lies
below them are touched; a root without one is skipped.

What, per tree:
1. thaw, top-down: v2 `cgroup.freeze` 0; v1 `freezer.state` THAWED.
2. cpusets, v2: bottom-up `cpuset.cpus.partition` member and `cpuset.cpus.exclusive` empty, then
   top-down `cpuset.cpus` empty (inherit the parent's). v1: bottom-up `cpuset.cpu_exclusive` 0, then
   top-down the parent's `cpuset.cpus` and `cpuset.mems` written into each child.
3. remove, bottom-up: every directory below `krex` with no processes and no children (not `krex`).
4. unlock the processes the daemon's lock record (`--state-dir`) says it locked through the CUDA
   driver and that still read LOCKED (isolation/cudalock.py), unless that daemon is alive (its
   owner lock, as for its instance directory; --force unlocks them too).
It refuses to run while a daemon answers on its socket (unless --force): a sweep under a live daemon
would thaw its regions. For the same reason it leaves alone every instance directory
(`krex/<instance>/`, one per daemon) whose daemon is alive, whatever socket that one serves on:
the directory names its daemon's state dir, whose owner lock that daemon holds (--force sweeps
those too); the twin of such a directory in another tree (the v1 cpuset one) is left alone with it.
A dead daemon's instance is swept holding that lock shared (isolation/instance.py), so a daemon
starting on its state dir meanwhile waits for the sweep rather than being refused or swept; only
the instances present when the sweep began are touched. Empty instance directories of daemons that
are not running are removed in step 3. A cgroup that vanishes meanwhile is skipped; any other
failed write is reported with its path and the exit status is 1. Nothing is raised to the caller
of `cleanup()`.

--dry-run reads the same files and prints what the sweep would do ("would thaw: ..."), writing
nothing (the lock record is not opened either); it runs beside a live daemon. The summary counts
changes; what was left alone (a live daemon's instance, its locks) is listed apart. A --config
given that cannot be read is refused with 2 and nothing swept, as `krex serve` refuses it; the
default file, broken, only warns (an ExecStopPost must still thaw).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from krex_async.cliargs import directory
from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS, CgroupVanished
from krex_async.isolation.instance import Pin, gate, instance_name, pin_instance, state_dir_of
from krex_async.linux.trust import state_dir_problem, state_dir_refusal
from krex_async.ops.cgroupsites import default_roots as default_roots
from krex_async.ops.cgroupsites import layout as layout
from krex_async.ops.cgroupsites import mounts as mounts
from krex_async.ops.cgroupsites import own_cgroup as own_cgroup
from krex_async.ops.cgroupsites import v1_mount as v1_mount
from krex_async.ops.cgroupsites import v2_mount as v2_mount

SUBTREE = "krex"


# ---------------------------------------------------------------------------------- file I/O


@dataclass
class Result:
    trees: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # changes made (with dry: that would be made)
    notes: list[str] = field(default_factory=list)  # what was left alone, and why: not changes
    errors: list[str] = field(default_factory=list)
    denied: int = 0  # errors that were EACCES/EPERM: the sweep needs the cgroups' owner (root)
    dry: bool = False  # --dry-run: read everything, write nothing; actions say "would ..."

    @property
    def ok(self) -> bool:
        return not self.errors

    def failed(self, line: str, err: int | None) -> None:
        self.errors.append(line)
        self.denied += err in (errno.EACCES, errno.EPERM)


def _read(fs: CgroupFS, d: str, name: str) -> str | None:
    try:
        return fs.read(d, name).strip()
    except CgroupFileError:
        return None


def _write(fs: CgroupFS, res: Result, d: str, name: str, data: str, why: str) -> None:
    path = fs.path(d, name)
    if res.dry:
        res.actions.append(f"would {why}: {path} <- {data!r}")
        return
    try:
        fs.write(d, name, data)
    except CgroupVanished:  # the cgroup vanished: a state, not a failure
        return
    except CgroupFileError as e:
        res.failed(f"{path}: writing {data!r} ({why}) failed: {os.strerror(e.errno or 0)}", e.errno)
    else:
        res.actions.append(f"{why}: {path} <- {data!r}")


def _walk(tree: str) -> Iterator[str]:
    """The tree's cgroup directories, parents before children."""
    for dirpath, dirnames, _ in os.walk(tree):
        dirnames.sort()
        yield dirpath


def _pins(trees: list[str], state_dirs: list[str]) -> list[Pin]:
    """One per instance name under `trees` now (a directory made later is not ours to touch),
    listed at the trees' gate so that each directory already names its state dir. An instance's
    name is the same in every tree (v2, the v1 cpuset twin), so a twin without the xattr (an older
    daemon's, a kernel without user xattrs on v1) goes with the named one; so does a directory
    named after a state dir this cleanup was given."""
    known = {instance_name(s): s for s in state_dirs if s}
    by_name: dict[str, list[str]] = {}
    named: dict[str, set[str | None]] = {}
    with gate(trees, exclusive=True):
        for tree in trees:
            try:
                found = sorted(e.path for e in os.scandir(tree) if e.is_dir())
            except OSError:
                found = []
            for d in found:
                name = os.path.basename(d)
                by_name.setdefault(name, []).append(d)
                named.setdefault(name, {known.get(name)}).add(state_dir_of(d))
    return [Pin(dirs, named[name]) for name, dirs in sorted(by_name.items())]


# ------------------------------------------------------------------------------------ sweep


def sweep(tree: str, res: Result, remove_empty: bool = True, recurse: bool = True) -> None:
    """Thaw, restore cpusets and remove empty children in one `krex` tree (see the module doc);
    with `recurse` False, the tree's own directory only."""
    fs = CgroupFS("/")  # paths below are absolute; the kept files are closed at the end
    try:
        dirs = list(_walk(tree)) if recurse else [tree]
        _restore(fs, dirs, res)
        if remove_empty:
            _remove(fs, dirs[1:], res)
    finally:
        fs.release()


def sweep_instance(pin: Pin, res: Result, remove_empty: bool = True) -> None:
    """Sweep one instance's directories (in every tree) unless its daemon is alive, holding its
    owner lock throughout; asked again right before the removals when nothing could be pinned at
    first (a daemon started since has named its directory and taken its lock by then)."""
    fs = CgroupFS("/")
    try:
        if pin.ask():
            _restore(fs, [d for top in pin.dirs for d in _walk(top)], res)
            if remove_empty and (pin.fds or pin.ask()):
                for top in pin.dirs:
                    _remove(fs, list(_walk(top)), res)
        for d in pin.dirs if pin.live is not None else ():
            res.notes.append(f"left {d} alone: its daemon (pid {pin.live}) is alive")
    finally:
        pin.release()
        fs.release()


def _restore(fs: CgroupFS, dirs: list[str], res: Result) -> None:
    """Steps 1 and 2 over `dirs` (parents first)."""
    for d in dirs:  # 1. thaw, top-down
        if _read(fs, d, "cgroup.freeze") not in (None, "0"):
            _write(fs, res, d, "cgroup.freeze", "0", "thaw")
        state = _read(fs, d, "freezer.state")
        if state is not None and state != "THAWED":
            _write(fs, res, d, "freezer.state", "THAWED", "thaw")
    for d in reversed(dirs):  # 2a. exclusivity off, bottom-up
        p = _read(fs, d, "cpuset.cpus.partition")
        if p is not None and not p.startswith("member"):
            _write(fs, res, d, "cpuset.cpus.partition", "member", "partition off")
        if _read(fs, d, "cpuset.cpus.exclusive"):
            _write(fs, res, d, "cpuset.cpus.exclusive", "", "exclusive cpus off")
        if _read(fs, d, "cpuset.cpu_exclusive") == "1":
            _write(fs, res, d, "cpuset.cpu_exclusive", "0", "exclusive cpus off")
    for d in dirs:  # 2b. cpus back to the parent's, top-down
        v2 = os.path.exists(os.path.join(d, "cgroup.controllers"))
        cpus = _read(fs, d, "cpuset.cpus")
        if cpus is None:
            continue
        if v2:
            if cpus:
                _write(fs, res, d, "cpuset.cpus", "", "restore cpus (inherit)")
            continue
        parent = os.path.dirname(d)
        for name in ("cpuset.cpus", "cpuset.mems"):
            want = _read(fs, parent, name)
            if want is not None and want != _read(fs, d, name):
                _write(fs, res, d, name, want, f"restore {name[7:]} from parent")


def _remove(fs: CgroupFS, dirs: list[str], res: Result) -> None:
    """Step 3: rmdir each of `dirs` (parents first) that is empty, bottom-up (in a dry run, one
    whose children would all be removed counts as empty)."""
    gone: set[str] = set()
    for d in reversed(dirs):
        children = [e.path for e in os.scandir(d) if e.is_dir() and e.path not in gone]
        if _read(fs, d, "cgroup.procs") == "" and not children:
            if res.dry:
                gone.add(d)
                res.actions.append(f"would remove empty {d}")
                continue
            try:
                if fs.rmdir(d):
                    res.actions.append(f"removed empty {d}")
            except CgroupFileError as e:
                res.failed(f"{d}: rmdir failed: {os.strerror(e.errno or 0)}", e.errno)


def cleanup(
    roots: list[str],
    remove_empty: bool = True,
    force: bool = False,
    state_dirs: list[str] | None = None,
    dry: bool = False,
) -> Result:
    """Sweep `<root>/krex` (or `root` itself when it is named krex) for each root that exists;
    instance directories of live daemons are left alone unless `force`. `state_dirs`: state dirs
    whose instances are known by name even where their directories do not say whose they are.
    `dry`: write nothing, list what would be done."""
    res = Result(dry=dry)
    for root in roots:
        tree = root if os.path.basename(root.rstrip("/")) == SUBTREE else os.path.join(root, SUBTREE)
        real = os.path.realpath(tree)
        if real not in res.trees and os.path.isdir(real):
            res.trees.append(real)
    if force:
        for tree in res.trees:
            sweep(tree, res, remove_empty)
        return res
    pins = _pins(res.trees, state_dirs or [])
    for tree in res.trees:
        sweep(tree, res, recurse=False)
    for pin in pins:
        sweep_instance(pin, res, remove_empty)
    return res


def _default_socket() -> str:
    try:
        from krex_async.protocol import default_socket
    except ImportError:
        return "/run/krex/krex.sock"
    return default_socket()


def _state_dir(given: str) -> str:
    """`given`, else the daemon's default state dir ("" where the config cannot be loaded)."""
    try:
        from krex_async.daemon.config import ServeConfig
    except ImportError:  # msgspec missing: the sweep itself needs nothing but the stdlib
        return given
    return given or ServeConfig().resolved().state_dir


def _unlock(state_dir: str, force: bool = False, dry: bool = False) -> list[str]:
    """Undo the CUDA driver locks a dead daemon recorded in its state dir (they outlive it), holding
    its owner lock shared as the sweep does: a live daemon's locks are its regions' holds, left
    alone unless `force` (whatever socket it serves on), and one starting meanwhile waits. A dry
    run does not open the record (reading it means loading libcuda and asking the driver)."""
    if not state_dir:
        return []
    if dry:
        return [f"left the CUDA driver locks recorded in {state_dir} (if any) alone: a dry run"]
    try:
        from krex_async.isolation.cudalock import release_left
    except ImportError:  # msgspec missing: no daemon of this install can have locked anything
        return []
    fd, live = pin_instance(state_dir)
    if live is not None and not force:
        return [f"left the CUDA driver locks recorded in {state_dir} alone: its daemon (pid {live}) is alive"]
    try:
        return release_left(state_dir)
    finally:
        if fd >= 0:
            os.close(fd)


def _serving(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (a stale file: False)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError:
        return False
    finally:
        s.close()
    return True


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = subparsers.add_parser("cleanup", help="thaw and restore every krex cgroup (ExecStopPost)")
    _arguments(p)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        action="append",
        type=directory,
        default=[],
        help="sweep ROOT/krex only (repeatable); default: every place krex may use",
    )
    p.add_argument("--cgroup-root", type=directory, help="the daemon's configured cgroup root")
    p.add_argument(
        "--config", help="read cgroup_root from this krex.toml (default: /etc/krex/krex.toml when it exists)"
    )
    p.add_argument("--keep-empty", action="store_true", help="do not remove empty command cgroups")
    p.add_argument(
        "--socket",
        help=f"the daemon's socket (default: the config's, else {_default_socket()}): cleanup "
        "refuses while a daemon answers there",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="sweep even while a daemon is serving, its instance directory included",
    )
    p.add_argument(
        "--state-dir",
        type=directory,
        help="the daemon's state dir, whose lock record names the "
        "processes it locked through the CUDA driver (default: "
        "from the config, else the default)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would be thawed, restored and removed, and change nothing",
    )
    p.add_argument("--json", action="store_true")


def cleanup_main(args: argparse.Namespace) -> int:
    """Run the sweep for parsed `krex cleanup` arguments; print what was done. 0 ok, 1 if any
    write failed (each failure printed with its path)."""
    conf: dict[str, object] = {}
    try:
        from krex_async.daemon.config import ConfigError, read_file

        conf = read_file(args.config)[1]
    except ConfigError as e:
        if args.config is not None:  # a mistyped --config: the roots meant are unknown, as for serve
            print(f"krex cleanup: {e}; nothing was swept", file=sys.stderr)
            return 2
        # the default file, broken: it must not stop the thaw (ExecStopPost): sweep the defaults
        print(f"krex cleanup: warning: {e}", file=sys.stderr)
    except ImportError:  # msgspec missing: the sweep itself needs nothing but the stdlib
        pass
    sock = args.socket or str(conf.get("socket") or "") or _default_socket()
    if not args.force and not getattr(args, "dry_run", False) and _serving(sock):
        print(
            f"krex cleanup: a daemon is serving on {sock}: a sweep would thaw its regions and "
            "remove cgroups it is about to use; stop it first, or pass --force",
            file=sys.stderr,
        )
        return 1
    roots = list(args.root) or default_roots(args.cgroup_root or str(conf.get("cgroup_root", "")))
    state_dir = _state_dir(args.state_dir or str(conf.get("state_dir") or ""))
    if state_dir and os.path.lexists(state_dir) and (why := state_dir_problem(state_dir)):
        # Its records name processes to unlock: another user's file must not steer this sweep.
        print(f"krex cleanup: {state_dir_refusal(state_dir, why)}", file=sys.stderr)
        return 2
    dry = bool(getattr(args, "dry_run", False))
    res = cleanup(roots, remove_empty=not args.keep_empty, force=args.force, state_dirs=[state_dir], dry=dry)
    for line in _unlock(state_dir, args.force, dry):
        (
            res.actions
            if line.startswith("unlocked")
            else res.notes
            if line.startswith("left ")
            else res.errors
        ).append(line)
    if args.json:
        out = {"ok": res.ok, "dry_run": dry, "trees": res.trees, "actions": res.actions}
        print(json.dumps(out | {"notes": res.notes, "errors": res.errors}, indent=2))
    else:
        for a in [*res.actions, *res.notes]:
            print(f"krex cleanup: {a}")
        for err in res.errors:
            print(f"krex cleanup: error: {err}", file=sys.stderr)
        print(
            f"krex cleanup: {len(res.trees)} tree(s) {'looked at' if dry else 'swept'}, "
            f"{len(res.actions)} change(s){' that would be made (dry run)' if dry else ''}, "
            f"{len(res.notes)} left alone, {len(res.errors)} error(s)"
        )
    if res.denied and os.geteuid() != 0:
        print(
            f"krex cleanup: {res.denied} of them permission denied: the cgroups are root's (the "
            "daemon's); run it as root (sudo krex cleanup)",
            file=sys.stderr,
        )
    return 0 if res.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="krex cleanup", description=__doc__.splitlines()[0])
    _arguments(p)
    return cleanup_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
