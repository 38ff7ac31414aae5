"""The real Kokoro files, fetched once per test run into the cache as README's install does
(nothing is fetched again when they are there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.models.kokoro import weights as kw


@pytest.fixture(scope="session")
def kokoro_home() -> Path:
    home = kw.default_cache_dir()
    kw.fetch_model(home)
    kw.fetch_voices(home)
    return home
