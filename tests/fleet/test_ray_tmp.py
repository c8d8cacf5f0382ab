"""A local fleet of an ordinary user keeps Ray's temp dir in its own directory, not /tmp/ray, which
any user of the machine may have made first (then Ray, which puts its sessions' sockets and logs
there, cannot start, or, where all may write there, hands them to that user)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.security.helpers import User, make_users, python_as, run_python_as

from .conftest import NEEDS_RAY

FLEET = """
from krex_async.fleet.local import LocalFleet
fleet = LocalFleet(1, daemon_args=("--devices", "cpu:1"))
try:
    fleet.start()
    print("started", fleet.base_dir)
finally:
    fleet.close()
"""


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()  # skips unless root


def test_a_ray_tmp_made_first_by_another_user_does_not_stop_a_users_fleet(users: dict[str, User]) -> None:
    """alice made /tmp/ray first (0755, hers); mallory's fleet starts all the same, and nothing of
    it lands in alice's directory. The old fleet failed: Ray could not make its session there."""
    pytest.importorskip("ray", reason=NEEDS_RAY)
    alice, mallory = users["alice"], users["mallory"]
    if os.path.lexists("/tmp/ray"):
        pytest.skip("/tmp/ray exists already: the test must make it as another user")
    try:
        python_as(alice, "import os; os.mkdir('/tmp/ray', 0o755)")
        p = run_python_as(mallory, FLEET, timeout=300)  # Ray's start, on a loaded machine
        assert p.returncode == 0 and p.stdout.startswith("started "), p.stdout + p.stderr
        assert os.listdir("/tmp/ray") == [], os.listdir("/tmp/ray")
        assert not os.path.exists(p.stdout.split()[1]), "the fleet's directory outlived it"
    finally:
        shutil.rmtree("/tmp/ray", ignore_errors=True)


def test_close_puts_ray_tmpdir_back_and_a_long_directory_is_refused(
    monkeypatch: pytest.MonkeyPatch, local_fleet: object
) -> None:
    """RAY_TMPDIR is the caller's again once the fleet closes (as start() does when it fails), and
    the fleet's directory is gone; a base dir too long for a Ray session's socket paths is refused
    before anything starts, saying so. The close of a fleet that never joined Ray leaves this
    process's Ray connection (the package's fleet, here) alone."""
    import ray

    from krex_async.client.submit import KrexError
    from krex_async.fleet.local import LocalFleet

    assert ray.is_initialized()  # the package's fleet (local_fleet) joined it

    monkeypatch.setenv("RAY_TMPDIR", "/somewhere/else")
    fleet = LocalFleet(1)
    fleet._own_ray_tmp()
    assert os.environ["RAY_TMPDIR"] == fleet.base_dir
    assert sorted(os.listdir(fleet.base_dir)) == ["ray", "t"]
    fleet.close()
    assert os.environ["RAY_TMPDIR"] == "/somewhere/else" and not os.path.exists(fleet.base_dir)
    assert ray.is_initialized(), "the package fleet's connection was left"
    long = tempfile.mkdtemp(prefix="krex-" + "x" * 40, dir="/tmp")
    try:
        with pytest.raises(KrexError, match="too long for Ray's socket paths"):
            LocalFleet(1, base_dir=long)._own_ray_tmp()
        assert os.environ["RAY_TMPDIR"] == "/somewhere/else"
    finally:
        shutil.rmtree(long)
