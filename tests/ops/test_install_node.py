"""The README's install route for a node: scripts/install-node.sh puts krex in its own virtual
environment, `krex` on PATH, the unit and the config in place, and `systemd-analyze verify`
accepts the unit it wrote. Run into a temporary tree (the same script, other paths)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_install_route_gives_a_unit_systemd_accepts(tmp_path: Path) -> None:
    t = tmp_path
    args = [
        "--prefix",
        str(t / "opt"),
        "--bin",
        str(t / "bin"),
        "--unit-dir",
        str(t / "units"),
        "--conf-dir",
        str(t / "etc"),
        "--no-bcc",
        "--extras",
        "metrics",
    ]
    p = subprocess.run(
        [str(ROOT / "scripts/install-node.sh"), *args], capture_output=True, text=True, timeout=600, cwd="/"
    )
    assert p.returncode == 0, p.stderr
    unit = (t / "units/krex.service").read_text()
    assert f"ExecStart={t}/bin/krex serve --config {t}/etc/krex.toml" in unit
    assert (t / "etc/krex.toml").read_text() == (ROOT / "packaging/krex.toml.example").read_text()
    v = subprocess.run([str(t / "bin/krex"), "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("krex ")
    # the installed copy runs without this checkout on its path
    assert not (t / "opt").joinpath("src").exists()
    ok = subprocess.run(
        ["systemd-analyze", "verify", str(t / "units/krex.service")], capture_output=True, text=True, cwd="/"
    )
    assert ok.returncode == 0, ok.stderr
    # again: idempotent, and an edited config is kept
    (t / "etc/krex.toml").write_text('policy = "command"\n')
    again = subprocess.run(
        [str(ROOT / "scripts/install-node.sh"), *args], capture_output=True, text=True, timeout=600, cwd="/"
    )
    assert again.returncode == 0, again.stderr
    assert (t / "etc/krex.toml").read_text() == 'policy = "command"\n'


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.skipif(os.path.exists("/usr/local/bin/krex"), reason="krex is installed on this host")
def test_the_unit_fails_verification_where_nothing_installed_krex() -> None:
    """What the install route fixes: the unit alone names a binary nothing created."""
    p = subprocess.run(
        ["systemd-analyze", "verify", str(ROOT / "packaging/krex.service")],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert p.returncode != 0 and "/usr/local/bin/krex" in p.stderr
