"""The daemon arguments LocalFleet builds as root, without starting Ray: each node's daemon socket
belongs to the primary group of the user the fleet's commands run as (they reach it for regions),
never to a group that merely shares that user's uid number."""

from __future__ import annotations

import grp
import os
import shutil
from collections.abc import Iterator

import pytest

from krex_async.client.submit import KrexError
from krex_async.gateway.auth import _has_passwd
from tests.conftest import run_daemon
from tests.security.helpers import User, make_users, python_as

from .conftest import NEEDS_RAY


@pytest.fixture(scope="module")
def mallory() -> Iterator[User]:
    for users in make_users():  # skips unless root
        yield users["mallory"]


def socket_group(run_as: str | int) -> str:
    """The --socket-group of a LocalFleet whose commands run as `run_as` (its temp dir removed)."""
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from krex_async.fleet.local import LocalFleet

    fleet = LocalFleet(1, daemon_args=("--devices", "cpu:2"), run_as=run_as)
    shutil.rmtree(fleet.base_dir, ignore_errors=True)
    args = list(fleet.daemon_args)
    return args[args.index("--socket-group") + 1]


def nameless_uid() -> int:
    """A uid without a passwd entry; where possible an existing group's gid (what the old code
    handed the socket to: that group's members reached the daemon)."""
    for g in sorted(grp.getgrall(), key=lambda g: g.gr_gid):
        if g.gr_gid >= 1000 and not _has_passwd(g.gr_gid):
            return g.gr_gid
    return next(u for u in range(60000, 65000) if not _has_passwd(u))


async def test_a_uid_run_as_gives_the_socket_to_that_users_primary_group(mallory: User) -> None:
    """krextest2's uid is not its primary gid (here it is krexadm's, the admin group): the socket
    goes to its primary group however run_as names it, and that user reaches the daemon."""
    assert mallory.uid != mallory.gid, "the test needs a user whose uid and primary gid differ"
    for run_as in (mallory.uid, str(mallory.uid), mallory.name):
        assert socket_group(run_as) == str(mallory.gid), run_as
    async with run_daemon("--socket-group", socket_group(mallory.uid), "--devices", "cpu:1") as daemon:
        os.chmod(os.path.dirname(daemon.socket), 0o711)
        assert os.stat(daemon.socket).st_gid == mallory.gid
        code = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('ok')"
        assert python_as(mallory, code, daemon.socket).strip() == "ok"


def test_a_uid_without_a_passwd_entry_is_refused_not_taken_for_a_gid() -> None:
    """Such a uid has no primary group (and the daemons run no command as it): LocalFleet says so
    before it makes anything. Before, the uid itself became the socket's group: another group, or
    none (the daemon then refused to start, naming only the group)."""
    if os.geteuid() != 0:
        pytest.skip("the socket group is chosen as root only")
    uid = nameless_uid()
    with pytest.raises(KrexError, match=f"no user '{uid}' here to run the fleet's commands as"):
        socket_group(uid)
