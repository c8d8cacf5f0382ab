"""Fixtures shared by the fault tests."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest


@pytest.fixture
def small_tmpfs():
    """A 256 KiB tmpfs (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    d = tempfile.mkdtemp(prefix="krex-tmpfs-", dir="/tmp")
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", d], capture_output=True, text=True
    )
    if p.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs: {p.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)
