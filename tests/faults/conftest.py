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


@pytest.fixture
def small_ext4():
    """An 8 MiB ext4 on a loop device (root only) that keeps half its blocks for root, as ext4
    keeps 5% by default: an unprivileged writer sees it full while root can still write."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop file system needs root")
    fd, img = tempfile.mkstemp(prefix="krex-ext4-", suffix=".img", dir="/tmp")
    os.ftruncate(fd, 8 << 20)
    os.close(fd)
    d = tempfile.mkdtemp(prefix="krex-ext4-", dir="/tmp")
    try:
        for argv in (["mkfs.ext4", "-q", "-F", "-m", "50", img], ["mount", "-o", "loop", img, d]):
            try:
                p = subprocess.run(argv, capture_output=True, text=True)
            except FileNotFoundError as e:
                pytest.skip(f"cannot make a small ext4: {e}")
            if p.returncode != 0:
                pytest.skip(f"cannot make a small ext4 ({argv[0]}): {p.stderr.strip()}")
        try:
            yield d
        finally:
            subprocess.run(["umount", d], check=False)
    finally:
        os.rmdir(d)
        os.unlink(img)
