"""The gateway's state directory and each job's directory, kept apart.

    <state>/            0711 gateway user: jobs may pass through, not list or write
        jobs.db, token  0600 gateway user
        bin/            0755 gateway user: the `python` shims every job runs
        jobs/           0711 gateway user
            <id>/       0700 the job's user: written by the gateway, then handed over

A job's directory is filled by the gateway before the job starts (no link can be in the way yet),
then handed to the job's user. What the gateway reads back after the job (eval_result.json, the
profiler's CSV) is read without following a link and only from files the job's user owns, so a job
cannot point the gateway (root) at another job's files or the system's. A finished job's directory
is removed the same way, never following a link (`remove_tree`, when its retention ends).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StateError(Exception):
    """The state directory cannot be made safe; the message says why."""


def low_space(path: Path, reserve: int) -> str:
    """Why new work must wait or be refused ("" when it need not): less than `reserve` bytes left
    to this user on `path`'s file system (0: never)."""
    if reserve <= 0:
        return ""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"cannot tell the free space of {path}: {e}"
    free = st.f_bavail * st.f_frsize
    if free >= reserve:
        return ""
    return (
        f"the gateway's state disk is full: {free} bytes free under {path}, under the "
        f"--min-free-space reserve of {reserve}"
    )


def own_dir(path: Path, mode: int) -> None:
    """Create `path` (or take the existing one) as a directory of this user with exactly `mode`.
    Raises StateError for a link, a non-directory, or a directory of another user."""
    try:
        path.mkdir(mode=mode, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise StateError(
            f"{path} belongs to uid {st.st_uid}, not the gateway's {os.geteuid()}: "
            "a job's user could change the gateway's state"
        )
    os.chmod(path, mode)


def open_lock(path: Path) -> int:
    """Open (or create, 0600) the state directory's lock file without following a link: a link
    planted there would turn the gateway's open and chmod onto its target. Returns the fd, which
    the caller closes. Raises StateError for a symbolic or hard link or a non-regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise StateError(f"{path} is a symbolic link; refusing it as the lock file (remove it)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            what = "a hard link" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise StateError(f"{path} is {what}; refusing it as the lock file (remove it)")
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare_state(state: Path) -> None:
    """The layout above, with the modes above. Raises StateError."""
    own_dir(state, 0o711)
    own_dir(state / "jobs", 0o711)
    own_dir(state / "bin", 0o755)
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm", "gateway.json", "gateway.lock"):
        p = state / name
        if p.exists() and not p.is_symlink():
            os.chmod(p, 0o600)


def write_files(root: Path, files: dict[str, str]) -> None:
    """Create each (already validated) relative path under root, never following a symlink.

    Directories are walked with dir fds and O_NOFOLLOW, files are created with O_EXCL: a link or
    an existing entry in the way is an OSError, not a write outside root.
    """
    rootfd = os.open(root, DIR_FLAGS)
    try:
        for name, content in files.items():
            *dirs, leaf = name.split("/")
            fd = os.dup(rootfd)
            try:
                for d in dirs:
                    try:
                        os.mkdir(d, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(d, DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = nfd
                out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
                with os.fdopen(out, "wb") as f:
                    f.write(content.encode("utf-8", "surrogatepass"))
            finally:
                os.close(fd)
    finally:
        os.close(rootfd)


def hand_over(root: Path, uid: int | None, gid: int | None) -> None:
    """Give the tree the gateway wrote (no job has run in it yet) to the job's user."""
    if uid is None or gid is None:
        return
    for top, dirs, names in os.walk(root):
        for n in dirs + names:
            os.lchown(os.path.join(top, n), uid, gid)
    os.chown(root, uid, gid)
    os.chmod(root, 0o700)


def _open_under(root: Path, rel: str, owner: int) -> int:
    """An fd for root/rel opened without following any link, of a regular file `owner` owns."""
    *dirs, leaf = rel.split("/")
    fd = os.open(root, DIR_FLAGS)
    try:
        for d in dirs:
            nfd = os.open(d, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        out = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    st = os.fstat(out)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (owner, os.geteuid()):
        os.close(out)
        raise PermissionError(f"{rel} is not a regular file of the job's user")
    return out


def read_job_file(root: Path, rel: str, owner: int | None, limit: int) -> bytes:
    """At most `limit` bytes of root/rel, read as `_open_under` opens it. Raises OSError
    (FileNotFoundError when there is no such file)."""
    fd = _open_under(root, rel, os.geteuid() if owner is None else owner)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{rel} is larger than {limit} bytes")
    return data


def find(root: Path, sub: str, name: str = "", suffix: str = "") -> Iterator[str]:
    """Relative paths (from root) of files under root/sub called `name` (or ending in `suffix`);
    links are not followed (root/sub itself included)."""
    if (root / sub).is_symlink():
        return
    for top, dirs, names in os.walk(root / sub, followlinks=False):
        rel = os.path.relpath(top, root)
        dirs.sort()
        for n in sorted(names):
            if n == name or (suffix and n.endswith(suffix)):
                yield f"{rel}/{n}"


def remove_tree(path: Path) -> bool:
    """Remove a job's directory tree without following links and without recursion (a job may
    leave a tree thousands of levels deep: shutil.rmtree's recursion and its fd per level would
    fail on it); False if it was not there. It walks down by directory fds opened with O_NOFOLLOW
    and back up by "..", checking each parent is the one it came from (a directory moved
    meanwhile is an OSError, never a walk elsewhere), so it holds one fd at a time. A gateway that
    is not root may meet a directory its job made read-only or unreadable (a module cache): it
    makes its own directories u+rwx. Blocking (run it off the event loop); raises OSError."""
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(top.st_mode):
        raise OSError(
            errno.ELOOP, f"refusing to remove a symbolic link in place of a job's directory: {path}"
        )
    if not stat.S_ISDIR(top.st_mode):
        os.unlink(path)
        return True
    fd = _open_dir(str(path), None, top)
    trail: list[tuple[str, int, int]] = []  # (name, dev, ino) of each directory below `path`
    try:
        while True:
            child = _clear_files(fd)
            if child is not None:  # go down into it
                cfd = _open_dir(child, fd, os.stat(child, dir_fd=fd, follow_symlinks=False))
                st = os.fstat(cfd)
                os.close(fd)
                fd = cfd
                trail.append((child, st.st_dev, st.st_ino))
                continue
            if not trail:
                break
            name, _, _ = trail.pop()
            want = trail[-1][1:] if trail else (top.st_dev, top.st_ino)
            pfd = os.open("..", DIR_FLAGS, dir_fd=fd)
            st = os.fstat(pfd)
            os.close(fd)
            fd = pfd
            if (st.st_dev, st.st_ino) != want:
                raise OSError(errno.ESTALE, f"a directory under {path} was moved while it was removed")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)
    return True


def _open_dir(name: str, dir_fd: int | None, seen: os.stat_result) -> int:
    """An fd of the directory `name` (relative to dir_fd), which must still be the one `seen`
    (lstat) described; a directory of ours without u+rwx is made so (not root: see remove_tree)."""
    if not stat.S_ISDIR(seen.st_mode):
        raise OSError(errno.ENOTDIR, f"{name} is no longer a directory")
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        if os.geteuid() == 0 or seen.st_uid != os.geteuid():
            raise
        os.chmod(name, 0o700, dir_fd=dir_fd)  # ours, not root: a swapped-in link gains its uid nothing
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        os.close(fd)
        raise OSError(errno.ESTALE, f"{name} was replaced while it was removed")
    if os.geteuid() != 0 and st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _clear_files(fd: int) -> str | None:
    """Unlink every entry of the directory `fd` that is not a directory (a link is unlinked, never
    followed); the name of one subdirectory, or None when it is empty."""
    with os.scandir(fd) as it:
        entries = list(it)  # listed first: unlinking while reading the directory may skip some
    sub = None
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            sub = sub or entry.name
            continue
        try:
            os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:
            pass
    return sub
