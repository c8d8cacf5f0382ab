"""What a gateway says at start about where its jobs will run: the daemon's socket by its path,
and a jobs' interpreter that runs but cannot import krex's region client (regions in every job,
KREX_AUTO_REGION's included, would fail) as a warning naming --job-python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.security.helpers import USER_PY, USER_PYTHONPATH

from .conftest import JOB_USER, gateway_home

PY = sys.executable


def start_lines(state: Path, env: dict[str, str], *args: str) -> str:
    """The gateway's stderr up to its `listening on` line; the gateway is stopped after."""
    proc = subprocess.Popen(
        [PY, "-m", "krex_async.gateway", "--listen", "127.0.0.1:0", "--state-dir", str(state), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    return "".join(lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs as another user: needs root")
def test_the_start_names_the_socket_and_a_job_python_without_krex(tmp_path: Path) -> None:
    bare = subprocess.run([USER_PY, "-c", "import msgspec"], capture_output=True)
    if bare.returncode == 0:
        pytest.skip(f"{USER_PY} has msgspec: it can import krex's client, nothing to warn about")
    sock = str(tmp_path / "krex.sock")  # no daemon needed: jobs would queue
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KREX_GATEWAY_TOKEN")}
    args = ("--run-as", JOB_USER, "--job-python", USER_PY)
    with gateway_home() as home:
        said = start_lines(home / "gw", {**base, "KREX_SOCKET": sock}, *args)
        assert f"daemon {sock})" in said, said
        assert f"cannot import krex's region client with {USER_PY}" in said, said
        assert "--job-python" in said, said
        # The same interpreter given krex's dependencies (PYTHONPATH, as jobs inherit it): no warning.
        fine = start_lines(home / "gw2", {**base, "KREX_SOCKET": sock, "PYTHONPATH": USER_PYTHONPATH}, *args)
        assert "region client" not in fine and "listening on" in fine, fine


def test_a_token_flag_given_wins_over_krex_gateway_token_in_the_environment(tmp_path: Path) -> None:
    """$KREX_GATEWAY_TOKEN left in a shell does not turn `--token-file F` or `--no-auth` into
    'give --token-file or --token, not both'; used alone, the start line says where it came from."""
    base = {k: v for k, v in os.environ.items() if k != "KREX_GATEWAY_TOKEN"}
    env = {**base, "KREX_GATEWAY_TOKEN": "t" * 32, "KREX_SOCKET": str(tmp_path / "krex.sock")}
    args = ("--job-python", USER_PY) + (("--run-as", JOB_USER) if os.geteuid() == 0 else ())
    with gateway_home() as home:
        said = start_lines(home / "a", env, *args)
        assert "token from $KREX_GATEWAY_TOKEN" in said and "listening on" in said, said
        said = start_lines(home / "b", env, "--token-file", str(home / "tokens"), *args)
        assert f"new token written to {home / 'tokens'}" in said and "listening on" in said, said
        said = start_lines(home / "c", env, "--no-auth", *args)
        assert "NO AUTHENTICATION" in said and "listening on" in said, said


def test_a_relative_state_dir_from_a_removed_directory_is_exit_2_naming_the_flag(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        f"import os, runpy, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        "sys.argv = ['krex-gateway', '--listen', '127.0.0.1:0', '--state-dir', 'rel']; "
        "runpy.run_module('krex_async.gateway', run_name='__main__')"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "--state-dir rel: the current directory was removed" in p.stderr, p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="runs jobs as another user: needs root")
def test_a_state_dir_the_jobs_user_cannot_reach_is_a_warning_naming_the_directory(tmp_path: Path) -> None:
    """A --state-dir under a parent the jobs' user cannot pass through would fail every job with
    exit 125 (its directory cannot be entered): the start says so, naming that parent and the fix."""
    sock = str(tmp_path / "krex.sock")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KREX_GATEWAY_TOKEN")}
    env = {**base, "KREX_SOCKET": sock, "PYTHONPATH": USER_PYTHONPATH}
    args = ("--run-as", JOB_USER, "--job-python", USER_PY)
    with gateway_home() as home:
        private = home / "private"
        private.mkdir(mode=0o700)
        said = start_lines(private / "gw", env, *args)
        assert "listening on" in said, said
        assert f"{JOB_USER}, who runs jobs, cannot enter {private}," in said, said
        assert f"chmod o+x {private}" in said and "exit 125" in said, said
        private.chmod(0o711)  # passable: nothing to say
        fine = start_lines(private / "gw", env, *args)
        assert "cannot enter" not in fine and "listening on" in fine, fine
