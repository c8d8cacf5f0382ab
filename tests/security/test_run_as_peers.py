"""--run-as-peers: a named user who is not root (a fleet node's Ray user) may run commands as other
users (Submit.run_as), but never as root, a system user (uid < 1000) or another such peer; everyone
else keeps the old rule (root only). Real users over a real daemon's socket."""

from __future__ import annotations

import asyncio

import pytest

from ..ops.test_cli_input import serve
from .helpers import config_daemon, python_as
from .test_submit_run_as import ASK

pytestmark = pytest.mark.usefixtures("users")


def ask_as(user, socket: str, uid: int) -> str:
    """As `user`, run `id -u` as `uid` through the daemon: the uid it ran as, or the error code."""
    return python_as(user, ASK, socket, str(uid)).strip()


async def test_a_peer_runs_commands_as_ordinary_users_only(users) -> None:
    alice, mallory, outsider = users["alice"], users["mallory"], users["outsider"]
    # By name, by uid, and a uid with no passwd entry (a pod's runAsUser): granted all the same.
    peers = f"{alice.name},{outsider.uid},3999999999"
    async with config_daemon(dir_mode=0o755, socket_group="krexg", run_as_peers=peers) as d:
        # Alice is granted: her command for mallory runs as mallory.
        assert await asyncio.to_thread(ask_as, alice, d.socket, mallory.uid) == str(mallory.uid)
        # Never as root, a system user (`daemon`, uid 1), or another granted peer.
        assert await asyncio.to_thread(ask_as, alice, d.socket, 0) == "forbidden"
        assert await asyncio.to_thread(ask_as, alice, d.socket, 1) == "forbidden"
        assert await asyncio.to_thread(ask_as, alice, d.socket, outsider.uid) == "forbidden"
        # Mallory is not granted: the old rule.
        assert await asyncio.to_thread(ask_as, mallory, d.socket, alice.uid) == "forbidden"
        assert await asyncio.to_thread(ask_as, mallory, d.socket, mallory.uid) == str(mallory.uid)
        # Root still may name anyone.
        async with await d.client() as root:
            res = await root.run(["/bin/sh", "-c", "id -u"], env={"PATH": "/usr/bin:/bin"}, run_as=1)
            assert res.stdout == b"1\n", res.report


@pytest.mark.parametrize(
    "peers,said",
    [
        ("nosuchkrexuser", "flag --run-as-peers: 'nosuchkrexuser': no such user"),
        ("krextest,root", "flag --run-as-peers: 'root' is root, who may run commands as other users"),
        ("0", "flag --run-as-peers: '0' is root"),
    ],
)
def test_serve_refuses_a_peer_that_is_not_a_user_or_is_root(tmp_path, peers: str, said: str) -> None:
    rc, err = serve(tmp_path, "--isolation", "signal", "--log-format", "json", "--run-as-peers", peers)
    assert rc == 2 and said in err, (rc, err)
