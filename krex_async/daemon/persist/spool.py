"""Output spooling: every byte a command writes to stdout and stderr, also in a file under the state dir.

The in-memory tails (commands.Tail) keep the last `--output-tail` bytes of each stream; the spool keeps
the whole stream, up to `--spool-limit` bytes per stream (0: no spool), in
`<state_dir>/spool/<command>.stdout|.stderr`. Each file is created with O_EXCL and mode 0600, stays
the daemon's, and a POSIX ACL lets the submitting user read it, so the agent reads its whole output
straight from the file (the spool directory is 0711: others can reach a file they know the name of,
never list or open another user's). The user does not own it, so cannot take a lease on it (a write
lease makes every other open wait up to lease-break-time: a restart reading the spools would stall);
where the filesystem has no ACLs the file is the daemon's alone and the output reaches its agent
through the daemon (the report's tails). The daemon's own reads (`read_tail`) open with O_NONBLOCK
all the same, so a lease on a file from elsewhere costs the reader nothing but the bytes.

The loop never touches the files: the pipe reader queues each chunk, and one writer thread creates,
writes, closes and unlinks them in order (a disk that stalls, or dirty-page throttling, stalls that
thread, never the loop). Queued bytes are bounded per stream (MAX_PENDING): a writer that far behind
stops that stream's spool rather than hold the output in memory. Any OSError (ENOSPC on a full
disk, EIO, EFBIG past a file size limit, EDQUOT) stops spooling *that stream* for good: the bytes
written so far stay, the rest is counted as dropped, the error is kept for the command's report
(`spool_error`) and logged once; the command, its in-memory tail and every other command go on.
Bytes past the limit are counted as dropped without an error. The spool also stops short of a
free-space reserve on the state disk (RESERVE_MAX, or an eighth of a small file system): what any
user's output writes can never take the room the intent record and the command records need.
Before a command's report is built its files are closed (`finish`), so the report's counts are
final and the files complete. The price: when the daemon is SIGKILLed, output it had queued but
not yet written (what the writer was behind, normally microseconds' worth) is not in the file a new
daemon reports from.

Files are removed when the command's retention ends (`remove`), and at start-up those that no
command record names any more (`sweep`).
"""

from __future__ import annotations

import errno
import os
import signal
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from krex_async import logs

log = logs.get("krex.spool")

STREAMS = ("stdout", "stderr")
MAX_PENDING = 16 << 20  # bytes of one stream queued for the writer before that spool stops
RESERVE_MAX = 32 << 20  # free bytes the spool leaves on the state disk (an eighth of a small one)
_ACL_XATTR = "system.posix_acl_access"
_UNDEF = 0xFFFFFFFF


def reader_acl(uid: int) -> bytes:
    """The access ACL `u::rw-,u:<uid>:r--,g::---,m::r--,o::---` in the kernel's xattr form."""
    entries = [
        (0x01, 6, _UNDEF),
        (0x02, 4, uid),
        (0x04, 0, _UNDEF),
        (0x10, 4, _UNDEF),
        (0x20, 0, _UNDEF),
    ]  # USER_OBJ, USER, GROUP_OBJ, MASK, OTHER: sorted by tag
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def describe(e: OSError) -> str:
    """'ENOSPC: No space left on device' (the errno's name first, then the kernel's words)."""
    name = errno.errorcode.get(e.errno or 0, f"errno {e.errno}")
    return f"{name}: {e.strerror or e}"


class SpoolFile:
    """One stream's spool file. The loop calls `write`, which only queues: creating, writing and
    closing run on the spool's writer thread in submission order. Nothing here raises: a failure
    stops the stream's spool for good and is remembered in `error`.

    Counters: `accepted` (queued for the file), `over` (past the limit), `behind` (not queued
    because the writer was more than MAX_PENDING behind) are the loop's; `written` and `failed`
    (queued, then lost to an error) are the writer's. Read them after `finish()` completed.
    """

    def __init__(
        self,
        command: str,
        stream: str,
        path: str,
        limit: int,
        uid: int,
        gid: int,
        submit: Callable[..., Future[None]],
        reserve: int = 0,
    ) -> None:
        self.command = command
        self.reserve = reserve
        self.stream = stream
        self.path = path
        self.limit = limit
        self.submit = submit
        self.accepted = self.over = self.behind = 0
        self.written = self.failed = 0
        self.error = ""
        self.fd: int | None = None
        self.finished: Future[None] | None = None
        submit(self._open, uid, gid)

    @property
    def dropped(self) -> int:
        return self.over + self.behind + self.failed

    def write(self, data: bytes) -> None:
        """Queue data (what fits under the limit); count the rest as dropped."""
        if self.behind or self.error or self.finished is not None:  # stopped
            self.behind += len(data)
            return
        room = max(self.limit - self.accepted, 0)
        if room < len(data):
            self.over += len(data) - room
            data = data[:room]
        if not data:
            return
        if self.accepted - self.written - self.failed + len(data) > MAX_PENDING:
            self.behind += len(data)  # a slow disk: stop here rather than hold unbounded memory
            self.error = self.error or (
                f"writes to {self.path} fell more than {MAX_PENDING} bytes behind; spooling stopped"
            )
            log.warning("spool_behind", command=self.command, stream=self.stream, path=self.path)
            return
        self.accepted += len(data)
        self.submit(self._write, data)

    def finish(self) -> Future[None]:
        """Close the file once everything queued is written; the future completes then."""
        if self.finished is None:
            self.finished = self.submit(self._close)
        return self.finished

    # ------------------------------------------------------------------ on the writer thread

    def _open(self, uid: int, gid: int) -> None:
        try:
            fd = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
        except OSError as e:
            self._fail(e, "create")
            return
        self.fd = fd
        if uid == os.geteuid():
            return
        try:
            os.setxattr(fd, _ACL_XATTR, reader_acl(uid))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                self._fail(e, f"grant read to uid {uid} on")
            # no ACLs here: the file stays the daemon's alone (its agent reads the tails)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.fd is None:
                self.failed += len(view)
                return
            try:
                if self.reserve:
                    st = os.fstatvfs(self.fd)
                    if st.f_bavail * st.f_frsize - len(view) < self.reserve:
                        raise OSError(
                            errno.ENOSPC,
                            f"the state disk's free space would fall "
                            f"below the {self.reserve} bytes kept for krex's records",
                        )
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except OSError as e:
                self.failed += len(view)
                self._fail(e, "write")
                return
            self.written += n
            view = view[n:]

    def _fail(self, e: OSError, op: str) -> None:
        self.error = f"{describe(e)} ({op} {self.path} after {self.written} bytes)"
        log.warning(
            "spool_failed", command=self.command, stream=self.stream, path=self.path, error=self.error
        )
        self._close()

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:  # a deferred write error (NFS): the bytes counted may not all be there
                pass


class Spool:
    """The spool directory of one daemon. limit 0: spooling is off (`open` returns no files)."""

    def __init__(self, state_dir: str, limit: int) -> None:
        self.dir = os.path.join(state_dir, "spool")
        self.limit = limit
        self.reserve = 0  # set below from the file system's size
        self.problem = ""
        self.writer: ThreadPoolExecutor | None = None
        if limit <= 0:
            return
        try:  # past RLIMIT_FSIZE a write must fail with EFBIG, not kill the daemon (commands get
            # SIGXFSZ back at exec: spawn restores signals)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        except ValueError:  # not the main thread (a test's daemon): the default stays
            pass
        try:
            os.makedirs(self.dir, mode=0o711, exist_ok=True)
            os.chmod(self.dir, 0o711)
            # Agents of other users must reach their files: the state dir needs search permission.
            mode = os.stat(state_dir).st_mode & 0o777
            if mode & 0o111 != 0o111:
                os.chmod(state_dir, mode | 0o111)
        except OSError as e:
            self.problem = f"spool directory {self.dir} unusable: {describe(e)}"
            log.warning("spool_unavailable", error=self.problem)
            return
        try:
            st = os.statvfs(self.dir)
            self.reserve = min(RESERVE_MAX, st.f_blocks * st.f_frsize // 8)
        except OSError:
            self.reserve = RESERVE_MAX
        # One thread, so each file's jobs run in the order they were queued.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="krex-spool")

    def paths(self, command: str) -> dict[str, str]:
        return {s: os.path.join(self.dir, f"{command}.{s}") for s in STREAMS}

    def open(self, command: str, uid: int, gid: int) -> dict[str, SpoolFile]:
        """The two spool files of a command about to start ({} when spooling is off)."""
        if self.writer is None:
            return {}
        return {
            s: SpoolFile(command, s, p, self.limit, uid, gid, self.writer.submit, self.reserve)
            for s, p in self.paths(command).items()
        }

    def remove(self, paths: list[str]) -> None:
        """Unlink spool files, after their queued writes (on the writer thread when there is one).
        Files already gone are fine; other errors are logged."""
        if self.writer is not None:
            self.writer.submit(unlink, paths)
        else:
            unlink(paths)

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove spool files of commands not in `keep` (a dead daemon's); returns their names."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        stale = [n for n in names if n.rpartition(".")[0] not in keep]
        unlink([os.path.join(self.dir, n) for n in stale])
        return stale


def unlink(paths: list[str]) -> None:
    """Remove files now; those already gone are fine, other errors are logged."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("spool_remove_failed", path=p, error=describe(e))


def read_tail(path: str, limit: int) -> tuple[bytes, int]:
    """(the last `limit` bytes of a spool file, its size); (b"", 0) when it cannot be read.
    Never waits: the open is O_NONBLOCK, so a lease held on the file raises BlockingIOError
    (the kernel starts breaking the lease; a later call gets the file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BlockingIOError:
        raise
    except OSError:
        return b"", 0
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, limit, max(0, size - limit)), size
    except OSError:
        return b"", 0
    finally:
        os.close(fd)
