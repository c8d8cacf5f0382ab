"""What the daemon's warm pools are started with: the user their workers run as (--pool-user) and
the environment they get, in one place for Daemon.start_pools and for the start-up check
(startchecks.check_here) that the pool's interpreter can find the modules it is told to import
(ctxpool/preflight.py says why that is asked before serving)."""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping

from krex_async.ctxpool.base import WORKER_CWD, WORKER_MODULE, PoolConfig
from krex_async.ctxpool.preflight import PreflightError, bad_names, missing_modules
from krex_async.daemon.model.command import user_groups, with_runtime


def pool_identity(name: str) -> tuple[int, int, list[int]] | None:
    """--pool-user (a name or a uid) as (uid, gid, groups); None for the daemon's own, which a
    daemon that is not root names too: it cannot set groups, and a spawn that asks to fails (its
    pool never warmed). Raises ValueError for an unknown user, or another user than the daemon's
    where it cannot switch."""
    if not name:
        return None
    try:
        pw = pwd.getpwnam(name) if not name.isdigit() else pwd.getpwuid(int(name))
    except KeyError:
        raise ValueError("no such user") from None
    if os.geteuid() != 0:
        if pw.pw_uid != os.geteuid():
            raise ValueError("only root can run workers as another user")
        return None
    return pw.pw_uid, pw.pw_gid, user_groups(pw.pw_uid, pw.pw_gid)


def pool_env(device_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a pool's workers start with: the daemon's, less its socket, with the
    device's variables and krex's in-command runtime (the one commands get)."""
    env = dict(os.environ)
    env.pop("KREX_SOCKET", None)
    env.update(device_env or {})
    return with_runtime(env)


def module_problems(pool_user: str, preload: list[str], init: list[str]) -> list[tuple[str, str]]:
    """(option, why) for each of --pool-preload and --pool-init naming modules the pool's
    interpreter cannot find as the pool's user, or no module names at all, and for a --pool-user
    who cannot run krex's own worker module there (its pool failed every spawn, said only by
    `krex status`); [] when all are found (or the user is none to run as: `krex serve` refuses
    that itself, daemon.pool_user). Asks one child interpreter (preflight.py) with pool_env()
    less a device's visibility variables, which no lookup reads; imports nothing here."""
    try:
        user = pool_identity(pool_user)
    except ValueError:
        return []
    given = {"pool_preload": preload, "pool_init": init}
    out = [
        (f, f"not a module name: {', '.join(map(repr, bad))}")
        for f, n in given.items()
        if (bad := bad_names(n))
    ]
    if out or not (preload + init or user):
        return out  # the daemon's own interpreter and user run its own worker module
    python = PoolConfig().interpreter()
    who = f"as user {pool_user}" if pool_user else "as the daemon's user"
    blame = "pool_preload" if preload else "pool_init" if init else "pool_user"
    env = pool_env()
    try:
        missing = set(missing_modules([WORKER_MODULE, *preload, *init], python=python, env=env, user=user))
    except PreflightError as e:
        return [(blame, f"cannot ask the pool's interpreter ({who}) for its modules: {e}")]
    if WORKER_MODULE in missing:
        out.append(
            (
                "pool_user" if pool_user else blame,
                f"the pool's interpreter {python} ({who}) cannot find krex's worker module "
                f"{WORKER_MODULE} (under {WORKER_CWD}), so no worker could start; give a user who "
                "can read krex there",
            )
        )
    for field, names in given.items():
        if lost := [n for n in names if n in missing]:
            them = "it" if len(lost) == 1 else "them"
            out.append(
                (
                    field,
                    f"the pool's interpreter {python} ({who}) cannot find module "
                    f"{', '.join(map(repr, lost))}, so no worker could warm; install {them} "
                    f"for that interpreter, or leave {them} out{relative_path_note(env)}",
                )
            )
    return out


def relative_path_note(env: Mapping[str, str]) -> str:
    """What to say of PYTHONPATH's relative entries: workers resolve them from WORKER_CWD, not
    from the directory `krex serve` was started in (PYTHONPATH=. names krex's directory there)."""
    rel = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not os.path.isabs(p)]
    if not rel:
        return ""
    return (
        f" (workers start in {WORKER_CWD}, so PYTHONPATH's relative {', '.join(map(repr, rel))} "
        "is taken from there, not from where krex serve started: give absolute paths)"
    )
