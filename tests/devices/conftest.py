"""The fake test vendor's device for the admission tests (krex_async/devices/fake.py): TOTAL bytes
whose allocations are files the tests and the daemon read."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from ..conftest import py_env

MiB = 1 << 20
TOTAL = 1000 * MiB


def fake_gpu_env() -> Iterator[dict[str, str]]:
    """The environment of commands on a fake device of TOTAL bytes; its directory goes after."""
    d = tempfile.mkdtemp(prefix="fakegpu-", dir="/tmp")
    yield py_env(KREX_FAKE_GPU_DIR=d, KREX_FAKE_GPU_MEM=str(TOTAL))
    for root, _dirs, files in os.walk(d, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        os.rmdir(root)


@pytest.fixture
def fake() -> Iterator[dict[str, str]]:
    yield from fake_gpu_env()
