"""The local fleet's Ray as an unprivileged user: a token holder who runs a Ray task on a node is
that user there, not root.

    LocalFleet (root) ──stdin/stdout JSON lines──► RayHost: `python -m krex_async.fleet.rayuser`
         │                                           as the Ray user (e.g. krexray): a
         │                                           ray.cluster_utils.Cluster (GCS, raylets, and
         │                                           so every Ray worker and NodeAgent)
         └── DaemonKeeper: each node's `krex serve`, as root, `--run-as-peers <Ray user>`

Ray runs every task as its raylet's user, and an agent that owned its daemon would make that daemon
the Ray user's too (no run_as, no cgroups). So as root the local fleet starts the daemons itself and
keeps them (started again on their state dir when one dies; stopped with their node); the agents
only reach them at `<base_dir>/<node>/s` (DaemonSpec.start False) and ask for run_as as the Ray
user, which the daemon grants for ordinary users only (daemon/commands/access.py).

The Ray user gets a copy of the token of its own (0600, in its 0700 directory, with Ray's temp
dirs: its nodes' and its default one), the socket group as a supplementary group (its agents reach
the daemons' sockets), and an interpreter it can run: this one when it can import krex and Ray with
it, else the system's python3 of the same version, with the directories of krex and Ray on
PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

from krex_async.client.submit import KrexError
from krex_async.fleet import auth
from krex_async.fleet.agent import DaemonSpec, OwnedDaemon, _tail
from krex_async.fleet.clustertrust import DEFAULT_RAY_USER

T = TypeVar("T")


def check_ray_user(name: str) -> None:
    """KrexError for root, or a user other than krexray (which is made when missing) who is not here."""
    try:
        uid = pwd.getpwuid(int(name)).pw_uid if name.isdigit() else pwd.getpwnam(name).pw_uid
    except KeyError:
        if name == DEFAULT_RAY_USER:
            return
        raise KrexError("forbidden", f"no user {name!r} here to run the fleet's Ray as") from None
    if uid == 0:
        raise KrexError("forbidden", "the fleet's Ray runs as an unprivileged user, not as root")


def ensure_user(name: str) -> pwd.struct_passwd:
    """The Ray user, created as a system user without a home or shell where missing (root only)."""
    check_ray_user(name)
    try:
        return pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        pass
    if name != DEFAULT_RAY_USER:  # create only our own; a named one must exist
        raise KrexError("forbidden", f"no user {name!r} here to run the fleet's Ray as")
    useradd = shutil.which("useradd")
    if useradd is None:
        raise KrexError("forbidden", f"no user {name!r} here, and no useradd to create it: create it")
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    return pwd.getpwnam(name)


def import_path() -> str:
    """PYTHONPATH for the Ray user: the directories krex and Ray are imported from here."""
    import ray

    import krex_async

    dirs: list[str] = []
    for mod in (krex_async, ray):
        d = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__ or "")))
        if d not in dirs:
            dirs.append(d)
    return os.pathsep.join(dirs)


class RayHost:
    """The Ray cluster, run by a child process as the Ray user. `address` once started."""

    def __init__(
        self, user: pwd.struct_passwd, base_dir: str, token_file: str, groups: list[int], python: str | None
    ) -> None:
        self.user = user
        self.dir = _own_dir(os.path.join(base_dir, "ray"), user)  # the Ray user's: token, Ray's temp dir
        self.token_file = os.path.join(self.dir, "token")
        # The host's stderr (Ray's own prints), in root's base dir: never a file the Ray user names.
        self.log = os.path.join(base_dir, "ray.log")
        _copy_token(token_file, self.token_file, user)
        _own_dir(os.path.join(self.dir, "ray"), user)
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.dir,
            "LANG": "C.UTF-8",
            "PYTHONPATH": import_path(),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": self.token_file,
            # Ray's default temp dir (<RAY_TMPDIR>/ray): where a Cluster writes its address for
            # ray.init("auto") whatever temp_dir its nodes have (Ray 2.60 makes no /tmp/ray first),
            # the Ray user's own, not /tmp/ray, which any user could make first
            "RAY_TMPDIR": self.dir,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback stays loopback (auth.local_only)
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.groups = groups
        self.python = python or self._python()
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def _popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[str]:
        u = self.user
        return subprocess.Popen(
            argv,
            user=u.pw_uid,
            group=u.pw_gid,
            extra_groups=self.groups,
            env=self.env,
            cwd=self.dir,
            text=True,
            **kw,
        )

    def _python(self) -> str:
        """This interpreter if the Ray user can import krex and Ray with it, else /usr/bin/python3."""
        tried = []
        for exe in dict.fromkeys([sys.executable, shutil.which("python3", path="/usr/bin:/bin") or ""]):
            if not exe:
                continue
            minor = tuple(sys.version_info[:2])
            probe = f"import sys, ray, krex_async; sys.exit(sys.version_info[:2] != {minor})"
            try:
                p = self._popen([exe, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            except OSError as e:  # an interpreter under a directory of root's
                tried.append(f"{exe}: {e.strerror}")
                continue
            _, err = p.communicate(timeout=60)
            if p.returncode == 0:
                return exe
            tried.append(f"{exe}: {(err.strip().splitlines() or ['another Python version'])[-1]}")
        raise KrexError(
            "forbidden",
            f"the Ray user {self.user.pw_name} can run no Python {sys.version_info[0]}.{sys.version_info[1]} "
            f"that imports krex and Ray ({'; '.join(tried)}): give one (--ray-python)",
        )

    def start(
        self, node_args: dict[str, Any], nodes: list[str], keeper: DaemonKeeper, timeout: float = 120.0
    ) -> str:
        """Start the head and the other nodes; returns the GCS address. Spawned from the keeper's
        thread, which lives as long as the fleet: the host's death signal is tied to it."""
        conf = {"node_args": {**node_args, "temp_dir": os.path.join(self.dir, "t")}, "nodes": nodes}
        argv = [self.python, "-m", "krex_async.fleet.rayuser", json.dumps(conf), str(os.getpid())]
        log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self.proc = keeper.on_thread(
                lambda: self._popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            )
        finally:
            os.close(log)
        self.address = str(self._answer(timeout)["address"])
        return self.address

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        line = box[0] if box else ""
        if not line:
            raise KrexError(
                "unreachable",
                f"the Ray cluster of user {self.user.pw_name} did not answer: {_tail(self.log)}",
            )
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise KrexError("unreachable", f"the Ray cluster of user {self.user.pw_name}: {reply['error']}")
        return reply

    def ask(self, op: str, name: str, timeout: float = 120.0) -> None:
        """add or remove the node `name`."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({op: name}) + "\n")
        self.proc.stdin.flush()
        self._answer(timeout)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Close its stdin (it stops the cluster); SIGKILL after `timeout`."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _own_dir(path: str, user: pwd.struct_passwd) -> str:
    """`path`, a directory for the Ray user alone (0700, theirs); never a link followed."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise KrexError("forbidden", f"{path} is not a directory")
    os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
    os.chmod(path, 0o700, follow_symlinks=False)
    return path


def _copy_token(src: str, dst: str, user: pwd.struct_passwd) -> None:
    """The token, for the Ray user alone (0600, theirs): a new file (what the Ray user left at that
    name is removed, never written through: a link to another file)."""
    token = auth.read_token(src)
    try:
        os.unlink(dst)
    except FileNotFoundError:
        pass
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, user.pw_uid, user.pw_gid)
        os.write(fd, token)
    finally:
        os.close(fd)


class DaemonKeeper:
    """Each node's daemon as root (OwnedDaemon), started again when it dies, on a thread of its own
    whose event loop lives as long as the keeper: each daemon's death signal is tied to it."""

    def __init__(self, spec: DaemonSpec) -> None:
        self.spec = spec
        self.daemons: dict[str, OwnedDaemon] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="krex-daemon-keeper", daemon=True)
        self._thread.start()
        self._watch = asyncio.run_coroutine_threadsafe(self._watcher(), self._loop)

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def on_thread(self, fn: Callable[[], T]) -> T:
        """fn() on the keeper's thread (a child it spawns dies with the keeper, not the caller)."""

        async def call() -> T:
            return fn()

        result: T = self._call(call())
        return result

    def add(self, name: str) -> None:
        """Start `name`'s daemon and wait for its socket (RuntimeError with its log's tail)."""

        async def add() -> None:
            d = self.daemons.setdefault(name, OwnedDaemon(self.spec, name))
            if not d.alive():
                await d.start()

        self._call(add())

    def remove(self, name: str) -> None:
        """Stop `name`'s daemon (SIGTERM: it ends its commands), as its node went."""
        d = self.daemons.pop(name, None)
        if d is not None:
            self._call(asyncio.to_thread(d.stop))

    async def _watcher(self) -> None:
        while True:
            for name, d in list(self.daemons.items()):
                if not d.alive() and self.daemons.get(name) is d:
                    try:
                        await d.start()
                    except RuntimeError as e:
                        print(f"krex fleet: node {name}: {e}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.1)

    def close(self) -> None:
        """Stop every daemon, then the thread."""
        self._loop.call_soon_threadsafe(self._watch.cancel)
        for name in list(self.daemons):
            self.remove(name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


# The host: run as the Ray user (`python -m krex_async.fleet.rayuser CONF PARENT_PID`).


def _serve(conf: dict[str, Any], out: IO[str]) -> None:
    from ray.cluster_utils import Cluster

    from krex_async.fleet.raycluster import NODE_RESOURCE

    args = conf["node_args"]
    names = list(conf["nodes"])

    def node_args(name: str) -> dict[str, Any]:
        return {**args, "resources": {f"{NODE_RESOURCE}{name}": 1}}

    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args(names[0]), "include_dashboard": False}
    )
    assert cluster.head_node is not None
    nodes = {names[0]: cluster.head_node}
    try:
        for name in names[1:]:
            nodes[name] = cluster.add_node(**node_args(name))
        cluster.wait_for_nodes()
        out.write(json.dumps({"address": cluster.address}) + "\n")
        out.flush()
        for line in sys.stdin:
            req = json.loads(line)
            try:
                if "add" in req:
                    nodes[req["add"]] = cluster.add_node(**node_args(req["add"]))
                elif "remove" in req:
                    cluster.remove_node(nodes.pop(req["remove"]), allow_graceful=False)
                reply: dict[str, Any] = {"ok": True}
            except Exception as e:  # said to the fleet, which raises it; the cluster serves on
                reply = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        cluster.shutdown()


def main(argv: list[str]) -> int:
    import ctypes

    # Dies with the fleet's process (SIGTERM: shut the cluster down), however that ends.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(argv[1]):
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Ray's own prints go to stderr; stdout carries the answers alone
    try:
        _serve(json.loads(argv[0]), out)
    except Exception as e:
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
