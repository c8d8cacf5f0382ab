"""Fixtures for tests/security: the test users (see helpers.make_users)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import User, make_users


@pytest.fixture(scope="session")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()
