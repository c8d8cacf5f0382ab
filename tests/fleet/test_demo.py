"""`krex fleet demo`: runs its own local cluster end to end and leaves nothing behind; bad input is
answered with a message and exit 2."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from .conftest import NEEDS_RAY, env
from .conftest import PY as USER_PY

PY = sys.executable


@pytest.mark.slow
def test_demo_runs_commands_on_every_node_and_stops_everything() -> None:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    before = set(glob.glob("/tmp/krex-fleet-*")) | set(glob.glob("/sys/fs/cgroup/*/krex-fleet-*"))
    r = subprocess.run(
        # As root its commands run as nobody: with an interpreter nobody can run.
        [PY, "-m", "krex_async", "fleet", "demo", "--nodes", "2", "--python", USER_PY],
        capture_output=True,
        text=True,
        env=env(),
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = re.findall(r"^\s+(node\d)/\S+\s+(node\d)\s+(node\d)/cpu\d\s+exited\s", r.stdout, re.M)
    assert len(rows) == 8, r.stdout
    assert all(a == b == c for a, b, c in rows)
    assert {a for a, _, _ in rows} == {"node0", "node1"}
    assert "per node: node0 4, node1 4" in r.stdout
    # Two commands per device: each region froze its sibling, never a command on the other node.
    frozen = [int(line.split()[-2]) for line in r.stdout.splitlines() if re.match(r"\s+node\d/", line)]
    assert max(frozen) == 1, r.stdout
    after = set(glob.glob("/tmp/krex-fleet-*")) | set(glob.glob("/sys/fs/cgroup/*/krex-fleet-*"))
    assert after <= before, after - before
    assert "stopped the agents, daemons and Ray" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0"], "--nodes must be 1..16"),
        (["--nodes", "2", "--commands", "0"], "--commands must be at least 1"),
    ],
)
def test_demo_bad_input(args: list[str], message: str) -> None:
    r = subprocess.run(
        [PY, "-m", "krex_async", "fleet", "demo", *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--run-as", "root"], "--run-as: the fleet runs no command as root"),
        (["--run-as", "no-such-user-x"], "no user 'no-such-user-x' here"),
        (["--run-as", "nobody", "--python", "/nonexistent/python3"], "who cannot run /nonexistent/python3"),
        (["--ray-user", "root"], "--ray-user: the fleet's Ray runs as an unprivileged user, not as root"),
        (
            ["--ray-user", "no-such-user-x"],
            "--ray-user: no user 'no-such-user-x' here to run the fleet's Ray",
        ),
        (
            ["--run-as", "nobody", "--ray-user", "nobody"],
            "--ray-user: the fleet's commands cannot run as its Ray",
        ),
    ],
)
def test_demo_as_root_runs_nothing_as_root(args: list[str], message: str) -> None:
    """Refused before any Ray process starts, leaving no directory behind."""
    if os.geteuid() != 0:
        pytest.skip("as root only: a user's demo runs its commands as that user")
    pytest.importorskip("ray", reason=NEEDS_RAY)
    before = set(glob.glob("/tmp/krex-fleet-*"))
    r = subprocess.run(
        [PY, "-m", "krex_async", "fleet", "demo", "--nodes", "1", *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert set(glob.glob("/tmp/krex-fleet-*")) <= before


def test_without_ray_the_fleet_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\nfrom krex_async.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [PY, "-c", code, "fleet", "demo"], capture_output=True, text=True, env=env(), timeout=60
    )
    assert r.returncode == 2 and "pip install 'krex[fleet]'" in r.stderr, r.stderr
    r = subprocess.run(
        [PY, "-c", code, "gateway", "--state-dir", "/nonexistent/x", "--fleet", "auto"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert r.returncode == 2 and "krex[fleet]" in r.stderr, r.stderr


@pytest.mark.parametrize("address", ["bogus", "host:", ":6379", "host:0", "host:70000", "::1:6379", "ray://"])
@pytest.mark.parametrize(
    "verb", [["gateway", "--state-dir", "/nonexistent/x", "--fleet"], ["fleet", "status", "--address"]]
)
def test_a_bad_ray_address_is_a_usage_error(verb: list[str], address: str) -> None:
    """Checked before anything starts (no Ray needed): exit 2 naming the flag and the forms."""
    r = subprocess.run(
        [PY, "-m", "krex_async", *verb, address], capture_output=True, text=True, env=env(), timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert f"argument {verb[-1]}: {address!r} is not a Ray address" in r.stderr, r.stderr
    assert "auto, HOST:PORT" in r.stderr and "ray://HOST:PORT" in r.stderr, r.stderr


def test_good_ray_addresses_pass() -> None:
    from krex_async.cliargs import ray_address

    for address in ["auto", "10.0.0.5:6379", "head.example:6379", "[::1]:6379", "ray://head:10001"]:
        assert ray_address(address) == address
