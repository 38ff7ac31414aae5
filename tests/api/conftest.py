"""Shared fixtures for the compatibility tests: one real server per test module and the
native-API reference its audio is compared with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.compat_server import Native, running_server


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with running_server() as addr:
        yield addr


@pytest.fixture(scope="module")
def native(address: str) -> Iterator[Native]:
    client = Native(address)
    yield client
    client.close()
