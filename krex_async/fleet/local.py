"""A fleet on one machine: N Ray nodes (ray.cluster_utils.Cluster, each its own raylet) with a krex
daemon per node, owned by that node's agent. For `krex fleet demo`, the tests and bench/fleet.py.

Each node is kept small (1 CPU for Ray's own tasks, which the agents do not use; a 100 MB object
store; no dashboard; workers' logs not sent to the driver) and carries a custom resource
`krex_node_node<i>`, which names it in the fleet. Every daemon has its own socket, state dir and, as
root on cgroup v2, its own cgroup root, under one temporary directory that close() removes.

The cluster is bound to 127.0.0.1 and runs with Ray's token authentication: the token is made in
`<base_dir>/ray-token` (0600, in the 0700 base dir) unless one is named, and reaches the Ray
processes as that file's path (RAY_AUTH_TOKEN_PATH), never in argv.

As root, Ray runs as an unprivileged user (`ray_user`, default krexray, created if missing) and this
process keeps the daemons as root, granting that user run_as (fleet/rayuser.py): a Ray task on a
node runs as the Ray user, never as root.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import tempfile
import time
from typing import Any

import ray
from ray.cluster_utils import Cluster
from ray.exceptions import RayError

from krex_async.client.submit import KrexError
from krex_async.fleet import auth
from krex_async.fleet.agent import DaemonSpec, remove_cgroup
from krex_async.fleet.client import FleetClient
from krex_async.fleet.raycluster import NAMESPACE, NODE_RESOURCE, minor_python_match
from krex_async.fleet.rayuser import DEFAULT_RAY_USER, DaemonKeeper, RayHost, check_ray_user, ensure_user
from krex_async.linux import procfs

SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX socket's path
# the longest socket path below a node's temp dir (a 7-digit pid)
SESSION_SOCKET = "/session_2026-12-07_03-38-23_940027_4194304/sockets/plasma_store"
NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 100 * 1024 * 1024,
    "node_ip_address": "127.0.0.1",  # GCS, raylets and workers listen on loopback only
}


class LocalFleet:
    """start() brings the cluster up and joins it; connect() makes a fleet client (the first starts
    the daemons); close() stops the agents, their daemons and the cluster. A context manager."""

    def __init__(
        self,
        nodes: int = 2,
        daemon_args: tuple[str, ...] = ("--devices", "cpu:2"),
        base_dir: str | None = None,
        token_file: str | None = None,
        run_as: str | int | None = None,
        socket_group: str | None = None,
        ray_user: str | None = None,
        ray_python: str | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a fleet needs at least one node, not {nodes}")
        self.n = nodes
        self.daemon_args = daemon_args
        # Who the commands of connect()'s clients run as on the nodes: as root, `nobody` unless
        # named (the fleet runs nothing as root). Checked first: a bad one leaves nothing behind.
        self.run_as = run_as if run_as is not None else (os.environ.get(auth.RUN_AS_ENV) or "nobody")
        if os.geteuid() == 0 and "--socket-group" not in daemon_args:
            # Its commands reach their node's daemon (regions): the socket's group is theirs.
            who = auth.identity(self.run_as)  # KrexError for root
            group = socket_group or str(_primary_gid(who))
            self.daemon_args = (*daemon_args, "--socket-group", group)
        # As root: who Ray runs as (every task, every agent), granted run_as by the daemons.
        self.ray_user = (ray_user or DEFAULT_RAY_USER) if os.geteuid() == 0 else None
        self.ray_python = ray_python
        if self.ray_user is not None:
            check_ray_user(self.ray_user)
            if _name(self.ray_user) in (str(self.run_as), _name(self.run_as)):
                raise KrexError(
                    "forbidden", f"the fleet's commands cannot run as its Ray user {self.ray_user!r}"
                )
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="krex-fleet-", dir="/tmp")
        self._own_dir = base_dir is None
        if os.geteuid() == 0:
            os.chmod(self.base_dir, 0o711)  # passable to reach the sockets; the token file is 0600
        self.token_file = token_file or os.path.join(self.base_dir, "ray-token")
        self.key = b""
        self.cluster: Cluster | RayHost | None = None
        self.keeper: DaemonKeeper | None = None  # the daemons, where Ray runs as ray_user
        self.ray_nodes: dict[str, Any] = {}  # fleet name -> ray._private.node.Node (None: the host's)
        self._ray_tmpdir: tuple[str | None, ...] = ()  # RAY_TMPDIR before _own_ray_tmp, while set
        self._joined = False  # ray.init called for this fleet (and not left yet)

    def start(self) -> str:
        """Start the head and N-1 worker nodes and join as the driver; returns the address."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls from a test box
        if ray.is_initialized():
            raise RuntimeError("this process already joined a Ray cluster")
        if not os.path.exists(self.token_file):
            auth.create_token(self.token_file)
        self.key = auth.use_token(self.token_file)  # before any Ray process starts: they inherit it
        auth.local_only()
        minor_python_match()
        try:
            address = self._start_ray_user() if self.ray_user is not None else self._start_here()
            self._joined = True  # this process's Ray connection is this fleet's (close() leaves it)
            ray.init(address=address, namespace="krex", log_to_driver=False, configure_logging=False)
        except BaseException:
            self.close()
            raise
        return address

    def _own_ray_tmp(self) -> None:
        """Ray's temp dirs in this fleet's directory, not /tmp/ray: another user who made /tmp/ray
        first would keep the fleet from starting, or, where all may write there, be handed its
        sessions' sockets and logs. The nodes' is `<base dir>/t` (`temp_dir`: short, as a
        session's socket paths must be); Ray's default one, where a Cluster writes its address
        for ray.init("auto") whatever its nodes', is `<base dir>/ray`, through RAY_TMPDIR in this
        process's environment (its children's too), which close() puts back."""
        tmp = self._node_tmp()
        if len(tmp) + len(SESSION_SOCKET) > SOCKET_PATH_MAX:
            most = SOCKET_PATH_MAX - len(SESSION_SOCKET) - (len(tmp) - len(self.base_dir))
            raise KrexError(
                "fleet_error",
                f"the fleet's directory {self.base_dir} is too long for Ray's socket paths (at most "
                f"{most} characters): give a shorter one",
            )
        for name in ("t", "ray"):
            _private_dir(os.path.join(self.base_dir, name))
        self._ray_tmpdir = (os.environ.get("RAY_TMPDIR"),)
        os.environ["RAY_TMPDIR"] = self.base_dir

    def _node_tmp(self) -> str:
        """The nodes' Ray temp dir where this process starts them (not as the Ray user)."""
        return os.path.join(self.base_dir, "t")

    def _node_args(self, name: str) -> dict[str, Any]:
        """A node's arguments where this process starts it (not as the Ray user)."""
        return {**NODE_ARGS, "temp_dir": self._node_tmp(), "resources": {f"{NODE_RESOURCE}{name}": 1}}

    def _start_here(self) -> str:
        """The cluster's processes as children of this process (and as its user)."""
        self._own_ray_tmp()
        self.cluster = Cluster(
            initialize_head=True, head_node_args={**self._node_args("node0"), "include_dashboard": False}
        )
        self.ray_nodes["node0"] = self.cluster.head_node
        for i in range(1, self.n):
            self.ray_nodes[f"node{i}"] = self.cluster.add_node(**self._node_args(f"node{i}"))
        self.cluster.wait_for_nodes()
        return str(self.cluster.address)

    def _start_ray_user(self) -> str:
        """The daemons as root, kept here; the cluster as the Ray user, in the socket group."""
        assert self.ray_user is not None
        user = ensure_user(self.ray_user)
        # The daemons grant it run_as, and make it an admin (its own group), so that its agents see
        # and cancel the commands they started for others.
        self.daemon_args = (*self.daemon_args, "--run-as-peers", str(user.pw_uid))
        if "--admin-group" not in self.daemon_args:
            self.daemon_args = (*self.daemon_args, "--admin-group", str(user.pw_gid))
        names = [f"node{i}" for i in range(self.n)]
        self.keeper = DaemonKeeper(DaemonSpec(self.base_dir, args=self.daemon_args))
        for name in names:
            self.keeper.add(name)
        groups = [_gid(self.daemon_args[self.daemon_args.index("--socket-group") + 1])]
        host = RayHost(user, self.base_dir, self.token_file, groups, self.ray_python)
        self.cluster = host
        address = host.start(NODE_ARGS, names, self.keeper)
        self.ray_nodes.update(dict.fromkeys(names))
        return address

    async def connect(self, **kw: Any) -> FleetClient:
        """A fleet client whose agents own their nodes' daemons (started by the first client)."""
        spec = DaemonSpec(self.base_dir, args=self.daemon_args, start=self.keeper is None)
        kw.setdefault("token_file", self.token_file)
        if os.geteuid() == 0:
            kw.setdefault("run_as", self.run_as)
        return await FleetClient.connect(self.cluster.address if self.cluster else "auto", daemon=spec, **kw)

    def add_node(self, name: str) -> None:
        """Start one more node (fleet name `name`); a client connected after sees it."""
        if isinstance(self.cluster, RayHost):
            assert self.keeper is not None
            self.keeper.add(name)
            self.cluster.ask("add", name)
            self.ray_nodes[name] = None
            return
        assert self.cluster is not None
        self.ray_nodes[name] = self.cluster.add_node(**self._node_args(name))

    def remove_node(self, name: str) -> None:
        """Kill a worker node's Ray processes at once (its agent dies; its daemon gets SIGTERM)."""
        node = self.ray_nodes.pop(name)
        if isinstance(self.cluster, RayHost):
            assert self.keeper is not None
            agent = self._agent_pid(name)
            self.cluster.ask("remove", name)
            # The daemon goes as the agent's death signal took it where the agent owned it: once
            # the agent is gone (its commands' clients see it die: `lost`, not `shutdown`).
            deadline = time.monotonic() + 15
            while agent and procfs.exists(agent) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.keeper.remove(name)
            return
        assert self.cluster is not None
        self.cluster.remove_node(node, allow_graceful=False)

    def _agent_pid(self, name: str) -> int:
        """The pid of `name`'s agent, 0 if it has none that answers."""
        try:
            hello: Any = ray.get(
                ray.get_actor(f"krex-node-{name}", namespace=NAMESPACE).hello.remote(), timeout=10
            )
            return int(hello["pid"])
        except (ValueError, RayError, KrexError):
            return 0

    def stop_agents(self, timeout: float = 30.0) -> None:
        """Stop each node's agent (it stops its daemon: commands end as `shutdown`), then kill it."""
        actors = []
        for name in self.ray_nodes:
            try:
                actors.append((name, ray.get_actor(f"krex-node-{name}", namespace=NAMESPACE)))
            except ValueError:
                continue  # never made, or gone with its node
        try:
            ray.get(
                [a.stop.remote(*auth.seal(self.key, "stop", name, {})) for name, a in actors], timeout=timeout
            )
        except RayError:
            pass  # an agent that is gone took its daemon with it (death signal)
        for _, a in actors:
            ray.kill(a)

    def close(self) -> None:
        """Stop the agents, leave and stop the cluster, remove what the daemons left; RAY_TMPDIR
        and the fleet's own directory go back however that ends."""
        try:
            if self._joined and ray.is_initialized():  # not another fleet's connection
                if self.cluster is not None:
                    self.stop_agents()
                ray.shutdown()
            self._joined = False
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
            if self.keeper is not None:
                self.keeper.close()  # the daemons: their commands end as `shutdown`
                self.keeper = None
            self._remove_cgroups()
        finally:
            if self._ray_tmpdir:
                (before,), self._ray_tmpdir = self._ray_tmpdir, ()
                if before is None:
                    os.environ.pop("RAY_TMPDIR", None)
                else:
                    os.environ["RAY_TMPDIR"] = before
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def _remove_cgroups(self, wait_s: float = 10.0) -> None:
        """Remove the cgroup roots agents made and could not remove (an agent killed with its
        node): their daemons, ended by the death signal, may take a moment to leave them."""
        paths = []
        for node in os.listdir(self.base_dir) if os.path.isdir(self.base_dir) else []:
            try:
                if os.lstat(os.path.join(self.base_dir, node)).st_uid != os.geteuid():
                    continue  # the Ray user's directory: nothing it wrote names what root removes
                with open(os.path.join(self.base_dir, node, "cgroup")) as f:
                    paths += f.read().split()
            except OSError:
                continue
        deadline = time.monotonic() + wait_s
        for path in paths:
            while True:
                remove_cgroup(path)
                if not os.path.exists(path) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _name(who: str | int) -> str:
    """A user's name, from a name or a uid ("" if unknown)."""
    try:
        return pwd.getpwuid(int(who)).pw_name if str(who).isdigit() else str(who)
    except KeyError:
        return ""


def _private_dir(path: str) -> None:
    """`path` as a directory of this user alone: made 0700, or, already there (a base dir given by
    the caller), a directory (not a link) of this user's that no one else may write to."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise KrexError("forbidden", f"{path}: not a directory of this user's alone, for Ray's temp files")


def _primary_gid(who: str) -> int:
    """The primary group of the user (a name, or a uid with no name here) the fleet's commands run
    as. KrexError for one without a passwd entry: it has no group (and the daemons run no command
    as it); its uid was once passed on as the socket's gid, some other group or none."""
    try:
        return (pwd.getpwuid(int(who)) if who.isdigit() else pwd.getpwnam(who)).pw_gid
    except KeyError:
        raise KrexError("forbidden", f"no user {who!r} here to run the fleet's commands as") from None


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
