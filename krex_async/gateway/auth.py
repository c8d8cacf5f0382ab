"""Who may call the gateway, and whom each caller's jobs run as.

    caller --Authorization: Bearer T--> identity (name, run-as user) --> jobs it owns, run as that user

Every token names one identity. A job belongs to the identity that submitted it: only that identity
lists, reads, waits on or cancels it (for anyone else it does not exist: 404). Tokens come from
--token-file (created with one token if missing), from $KREX_GATEWAY_TOKEN (never the command line,
which every local user reads), or else from
<state>/token, generated at first start; a token file must be a regular file of the gateway's user
with mode 0600 or stricter. `--no-auth` serves everyone as one identity, on loopback only.

Jobs never run as root: a gateway started as root runs them as --run-as USER, or as `nobody` when
none is named; a line of the token file may name another user for its identity. A gateway that is not
root runs jobs as itself (the daemon lets only root ask for another uid).
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAME = "default"


class AuthError(Exception):
    """A configuration the gateway refuses to start with; the message says what to change."""


@dataclass(frozen=True)
class RunAs:
    """The user a job runs as: None for uid means the gateway's own user (it cannot switch)."""

    uid: int | None
    gid: int | None
    name: str
    home: str | None  # the user's home when it is theirs; else the job directory is HOME


@dataclass(frozen=True)
class Identity:
    name: str
    run_as: RunAs


def user(spec: str) -> RunAs:
    """A user by name or number, from the passwd database. Raises AuthError."""
    try:
        pw = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except (KeyError, OverflowError):
        raise AuthError(f"no such user {spec!r}") from None
    home = pw.pw_dir if _owned_dir(pw.pw_dir, pw.pw_uid) else None
    return RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, home)


def _owned_dir(path: str, uid: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def job_user(run_as: str | None, euid: int) -> tuple[RunAs, str]:
    """(whom jobs run as, a line to print when that needs saying). Raises AuthError."""
    if euid == 0:
        if run_as is None:
            return user("nobody"), (
                "jobs run as 'nobody': the gateway runs as root and no --run-as USER was given"
            )
        target = user(run_as)
        if target.uid == 0:
            raise AuthError(f"--run-as {run_as}: jobs never run as root")
        return target, ""
    me = pwd.getpwuid(euid).pw_name if _has_passwd(euid) else str(euid)
    if run_as is not None and user(run_as).uid != euid:
        raise AuthError(f"--run-as {run_as}: only a gateway started as root can run jobs as another user")
    return RunAs(None, None, me, None), (
        f"jobs run as the gateway's own user {me}: they can reach "
        "its state directory; start it as root with --run-as "
        "USER to keep them out"
    )


def _has_passwd(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class Auth:
    """Token -> identity. `open` (--no-auth): every caller is one identity and no header is read."""

    def __init__(self, tokens: dict[str, Identity], open_as: Identity | None = None) -> None:
        self.tokens = tokens
        self.open_as = open_as

    def identify(self, header: str) -> Identity | None:
        """The identity of an `Authorization` header, or None. Compares against every token in
        constant time, so the answer's timing does not tell how much of a token was right."""
        if self.open_as is not None:
            return self.open_as
        scheme, _, got = header.partition(" ")
        found = None
        for token, ident in self.tokens.items():
            if secrets.compare_digest(got.strip().encode(), token.encode()) and scheme.lower() == "bearer":
                found = ident
        return found


def check_private(path: Path, euid: int) -> None:
    """A secret's file: a regular file of ours that nobody else can read or write."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise AuthError(f"token file {path} is not a regular file")
    if st.st_uid != euid:
        raise AuthError(f"token file {path} belongs to uid {st.st_uid}, not the gateway's {euid}")
    if st.st_mode & 0o077:
        raise AuthError(
            f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read it; chmod 600 {path}"
        )


def generate(path: Path) -> str:
    """Write a new token to `path` (created 0600, never over an existing file or link)."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_tokens(path: Path, default: RunAs, euid: int) -> dict[str, Identity]:
    """Parse a token file: `TOKEN` (identity 'default'), or `NAME TOKEN [USER]` per line; blank
    lines and `#` comments are skipped. USER (root only) runs that identity's jobs as USER."""
    check_private(path, euid)
    tokens: dict[str, Identity] = {}
    names: set[str] = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 3:
            raise AuthError(f"{path}:{n}: expected TOKEN or NAME TOKEN [USER]")
        name, token = (DEFAULT_NAME, fields[0]) if len(fields) == 1 else (fields[0], fields[1])
        run_as = default
        if len(fields) == 3:
            if euid != 0:
                raise AuthError(f"{path}:{n}: a per-token USER needs a gateway started as root")
            run_as = user(fields[2])
            if run_as.uid == 0:
                raise AuthError(f"{path}:{n}: jobs never run as root")
        if name in names or token in tokens:
            raise AuthError(f"{path}:{n}: identity {name!r} or its token is given twice")
        names.add(name)
        tokens[token] = Identity(name, run_as)
    if not tokens:
        raise AuthError(f"token file {path} holds no token")
    return tokens


def load(
    state: Path,
    token_file: str | None,
    token: str | None,
    no_auth: bool,
    run_as: RunAs,
    euid: int,
    token_from: str = "--token",
) -> tuple[Auth, str]:
    """The gateway's Auth and a line saying where its tokens are (`token_from`: where `token`
    came from, --token or $KREX_GATEWAY_TOKEN). Raises AuthError."""
    if no_auth:
        if token or token_file:
            raise AuthError("--no-auth cannot be combined with --token or --token-file")
        return Auth({}, Identity("anonymous", run_as)), (
            "WARNING: --no-auth: NO AUTHENTICATION. Any local user or process that can reach "
            f"this port submits jobs (run as {run_as.name}) and reads, waits on and cancels "
            "every job and its output"
        )
    if token_file and token:
        raise AuthError("give --token-file or --token, not both")
    if token:
        return Auth({token: Identity(DEFAULT_NAME, run_as)}), f"token from {token_from}"
    path = Path(token_file) if token_file else state / "token"
    made = False
    try:
        generate(path)
        made = True
    except FileExistsError:
        pass
    except OSError as e:
        raise AuthError(f"cannot create token file {path}: {e}") from None
    tokens = read_tokens(path, run_as, euid)
    return Auth(tokens), (
        f"{'new token written to' if made else 'tokens from'} {path} "
        f"({len(tokens)} identit{'y' if len(tokens) == 1 else 'ies'}); "
        f"clients send 'Authorization: Bearer <token>' (AGATE_TOKEN)"
    )


def check_job_users(
    gate: Auth,
    python: str,
    socket_path: str,
    make_env: Callable[[RunAs], dict[str, str]],
    jobs_dir: Path,
) -> str:
    """Warnings, one a line, when a jobs' user cannot reach the job directories under `jobs_dir`
    (a --state-dir under a private parent: every job would fail to start, exit 125), cannot run
    the jobs' python (a venv under a private home), cannot import krex's region client with it (an
    interpreter without krex's dependencies: every region in a job, KREX_AUTO_REGION's included,
    would fail) or cannot reach the daemon's socket (a job's regions go through it: add the user
    to --socket-group). Each probe runs as that user in the environment its jobs get (make_env)."""
    users = {i.run_as for i in gate.tokens.values()}
    if gate.open_as is not None:
        users.add(gate.open_as.run_as)
    probe = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
    warnings: list[str] = []
    for u in sorted(users, key=lambda u: u.name):
        if u.uid is None or u.gid is None:
            continue
        groups = os.getgrouplist(u.name, u.gid)
        env = make_env(u)
        if _fails_as(u, groups, env, ["/bin/sh", "-c", 'cd "$1"', "sh", str(jobs_dir)]):
            where = blocking_dir(jobs_dir, u.uid, groups) or jobs_dir
            warnings.append(
                f"WARNING: {u.name}, who runs jobs, cannot enter {where}, so every job fails to "
                f"start (exit 125) in its directory under {jobs_dir}: let it through (chmod o+x "
                f"{where}, or a group of {u.name}'s), or choose a --state-dir it can reach"
            )
        for i, (argv, what) in enumerate(
            (
                ([python, "-c", ""], f"run {python}: pass --job-python PATH"),
                (
                    [python, "-c", "import krex_async.client.region"],
                    f"import krex's region client with {python}, so regions in its jobs fail: install "
                    "krex's dependencies for it, or pass --job-python of an environment that has krex",
                ),
                (
                    [python, "-c", probe, socket_path],
                    f"reach the daemon's socket {socket_path}, so regions in its jobs "
                    "fail: add it to the daemon's --socket-group",
                ),
            )
        ):
            if last := _fails_as(u, groups, env, argv):
                warnings.append(f"WARNING: {u.name}, who runs jobs, cannot {what} ({last})")
                if i == 0:  # it cannot run the interpreter: nothing else can be asked of it
                    break
    return "\n".join(warnings)


def _fails_as(u: RunAs, groups: list[int], env: dict[str, str], argv: list[str]) -> str:
    """Run argv as `u`; "" when it succeeds, else the last line it said (or its exit status)."""
    try:
        r = subprocess.run(
            argv,
            user=u.uid,
            group=u.gid,
            extra_groups=groups,
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if r.returncode == 0:
        return ""
    return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]


def blocking_dir(path: Path, uid: int, groups: list[int]) -> Path | None:
    """The first directory on the way to `path` (itself included) that `uid` with `groups` may not
    pass through, by its mode bits; None when every one lets it (an ACL may still refuse)."""
    for p in (*reversed(path.parents), path):
        try:
            st = os.stat(p)
        except OSError:
            return p
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid in groups else 0o001
        if not st.st_mode & bit:
            return p
    return None
