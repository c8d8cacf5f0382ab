"""Adoption, the daemon's side: decide whether a command's interpreter may be run by a warm worker,
hand it over, and relay the worker's exit status back to it.

    adopter (runtime/adopt.py) ── Adopt ──► Daemon.adopt: token, and the peer is inside the command
      refusal(): no pool, no warm worker yet, another user, interpreter or version, a flag, a
                 start-up variable that differs from the workers' ............ Adopted(declined)
      pidfd_open(peer) ──► pool.adopt(): the worker joins the command's cgroup, takes fds 0/1/2
                 through the pidfd, checks the adopter's sys.path against what it preloaded
                 ◄── "declined" ................................................ Adopted(declined)
                 ◄── "started" ................................................. Adopted(pid)
      the worker's exit (its pidfd, the pool) ............................. AdoptExited(status)
      the adopter's connection closes first (it was killed) ............... SIGKILL to the worker

Security: workers run as the pool's user; only an adopter whose real, effective, saved and fs ids,
groups and privileges (capabilities, no_new_privs, seccomp, LSM label) are exactly a worker's is
handed over (and KREX_POOL is offered only to such commands), so a user's environment and
descriptors reach only processes of that user, and a program never gains a privilege its
interpreter lacked. The daemon never holds the adopter's fds: it passes a pidfd, and the worker,
as that user, copies them.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from krex_async import protocol as P
from krex_async.ctxpool import forms
from krex_async.ctxpool.pool import Pool
from krex_async.ctxpool.procs import kill as _kill
from krex_async.linux import procfs
from krex_async.linux.spawn import Launched, LaunchSpec

# Start-up variables a worker takes over from the adopter instead of requiring them equal: sys.path
# comes whole from the adopter (PYTHONPATH, user site), and -u / -B / the pycache prefix are applied.
TAKEN_OVER = frozenset(
    {
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONNOUSERSITE",
        "PYTHONUSERBASE",
    }
)
Hand = Callable[[LaunchSpec, int, dict[str, Any]], "asyncio.Future[Launched | str]"]


@dataclass
class Tally:
    """Per command: interpreters adopted, and why the others were not."""

    adopted: int = 0
    declined: collections.Counter[str] = field(default_factory=collections.Counter)

    def decline(self, reason: str, pool: Pool | None) -> None:
        key = reason[:96]
        if key in self.declined or len(self.declined) < 32:
            self.declined[key] += 1
        if pool is not None and (key in pool.declined or len(pool.declined) < 64):
            pool.declined[key] += 1


def pool_env(pool: Pool) -> str:
    """KREX_POOL: the pool interpreter's realpath and its venv ("" outside one), one a line; what
    the runtime compares its own interpreter with before it asks (runtime/adopt.py)."""
    cfg = forms.venv_of(pool.python)
    return os.path.realpath(pool.python) + "\n" + (os.path.dirname(cfg) if cfg else "")


def workers_can_take_fds(pool: Pool, proc: str = procfs.PROC) -> bool:
    """Whether the pool's workers may pidfd_getfd an adopter (ptrace access): as root always; as
    another user only where Yama does not restrict ptrace to descendants (the adopter is none)."""
    if pool.identity[0] == 0:
        return True
    return procfs.ptrace_scope(proc) in (None, "0")  # None: no Yama, the same user may


# What a process may do beyond its ids: a worker with more than its adopter would run the program
# with privileges the command never had (a capability, no no_new_privs, no seccomp filter, another
# LSM label), so these must be equal.
PRIVILEGES = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")


def _status(pid: int) -> dict[str, str] | None:
    """Ids, groups, capabilities, no_new_privs, seccomp mode and LSM label of a process."""
    status = procfs.status(pid)
    if status is None:
        return None
    out = {k: v for k, v in status.items() if k in ("Uid", "Gid", "Groups", *PRIVILEGES)}
    out["lsm"] = procfs.security_label(pid)
    return out if {"Uid", "Gid", "Groups"} <= out.keys() else None


def refusal(pool: Pool | None, req: P.Adopt, peer_pid: int) -> str | None:
    """Why `req` cannot be adopted by `pool`, as a short reason; None when a worker may take it."""
    if pool is None or pool.config.size <= 0:
        return "no pool"
    interp = pool.interpreter
    if interp is None:
        return "no warm worker"
    uid, gid, groups = pool.identity
    ids = _status(peer_pid)
    if (
        ids is None
        or set(ids["Uid"].split()) != {str(uid)}
        or set(ids["Gid"].split()) != {str(gid)}
        or sorted(int(g) for g in ids["Groups"].split()) != sorted(groups)
    ):
        return "user"
    # any live worker speaks for all (they start alike); one reaped meanwhile is passed over
    theirs = next((st for p in sorted(pool.pids()) if (st := _status(p)) is not None), None)
    if theirs is None:
        return "no warm worker"
    for key in (*PRIVILEGES, "lsm"):
        if ids.get(key) != theirs.get(key):
            return f"privileges {key}"
    if procfs.exe(peer_pid) != os.path.realpath(pool.python):
        return "interpreter"
    if req.hexversion != interp.get("hexversion"):
        return "interpreter version"
    try:
        _, argv = forms.split_flags(req.argv)
    except ValueError as e:
        return str(e)
    form = forms.parse(argv)
    if form is None or form.kind == "script" and form.target.endswith((".pyc", ".pyo")):
        return "form"
    for name, value in interp.get("flags", {}).items():
        if name != "dont_write_bytecode" and req.flags.get(name) != value:
            return f"flag {name}"
    if req.xoptions != interp.get("xoptions", {}):
        return "flag -X"
    if req.warnoptions != interp.get("warnoptions", []):
        return "flag -W"
    theirs = interp.get("init_env", {})
    for name in sorted(forms.INIT_VARS - TAKEN_OVER):
        if req.env.get(name) != theirs.get(name):
            return f"env {name}"
    return None


def handover(req: P.Adopt, peer_pid: int) -> tuple[LaunchSpec, dict[str, Any]]:
    """The LaunchSpec (argv without the flags the worker applies) and the worker's "adopt" part."""
    _, argv = forms.split_flags(req.argv)
    spec = LaunchSpec(argv=argv, cwd=req.cwd, env=dict(req.env), stdin_fd=-1, stdout_fd=-1, stderr_fd=-1)
    adopt = {
        "orig_argv": list(req.argv),
        "executable": req.executable,
        "sys_path": list(req.sys_path),
        "unbuffered": req.unbuffered,
        "dont_write_bytecode": req.dont_write_bytecode,
        "pycache_prefix": req.pycache_prefix,
        "umask": req.umask,
        "ignored": list(req.ignored),
        "mask": list(req.mask),
        "adopter": peer_pid,  # os.getppid() in the program is this one's parent (adopted.seen_parent)
    }
    return spec, adopt


async def serve(
    pool: Pool | None,
    req: P.Adopt,
    peer_pid: int,
    send: Callable[[P.Msg], bool],
    hand: Hand,
    tally: Tally,
    prepare: Callable[[], Awaitable[str | None]] | None = None,
) -> bool:
    """Answer one Adopt (the peer already checked to be inside its command): Adopted, then
    AdoptExited; True once a worker ran the program to its end (False: declined). Cancelled (the
    adopter's connection closed) while the worker runs: the worker is killed, as the adopter's own
    program would have died with it. Holds no fd past its return. `prepare` runs once the adoption
    is allowed, before the hand-over, and may still decline it with a reason (the daemon reserves a
    worker, and holds the command in a region it must be frozen for)."""
    reason = refusal(pool, req, peer_pid)
    if reason is None and prepare is not None:
        reason = await prepare()
    answer: Launched | str = reason or ""
    if reason is None:
        assert pool is not None
        try:
            pidfd = os.pidfd_open(peer_pid)
        except OSError as e:
            answer = f"pidfd: {e.strerror}"
        else:
            try:
                spec, adopt = handover(req, peer_pid)
                fut = hand(spec, pidfd, adopt)
            except Exception as e:  # the cgroup refused the worker: the adopter starts fresh
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(f"hand-over: {type(e).__name__}")
            finally:
                os.close(pidfd)
            try:
                answer = await asyncio.shield(fut)
            except asyncio.CancelledError:
                _kill_when_started(fut, tally, pool)
                raise
    if isinstance(answer, str):
        tally.decline(answer, pool)
        send(P.Adopted(id=req.id, declined=answer))
        return False
    assert pool is not None
    tally.adopted += 1
    pool.adopted += 1
    send(P.Adopted(id=req.id, pid=answer.pid))
    try:
        status = await answer.wait()
    except asyncio.CancelledError:
        if answer.returncode is None:
            _kill(answer.pid)
        raise
    send(P.AdoptExited(id=req.id, returncode=status.returncode))
    return True


def _kill_when_started(fut: asyncio.Future[Launched | str], tally: Tally, pool: Pool) -> None:
    """The adopter died while its worker was taking the program over: a worker that started is
    killed, and still counts as adopted: it sends "started" as the program begins, so the program
    may have run (and been seen, and the adopter killed for it) before the daemon read that."""

    def done(f: asyncio.Future[Launched | str]) -> None:
        got = f.result() if not f.cancelled() else None
        if isinstance(got, Launched):
            tally.adopted += 1
            pool.adopted += 1
            if got.returncode is None:
                _kill(got.pid)

    fut.add_done_callback(done)
