"""Engine fixtures: a started TtsEngine on the tiny test voice (torch backend, CPU, slot decoder)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.engine.config import BatchConfig, EngineConfig
from service.engine.engine import TtsEngine

DATA = Path(__file__).resolve().parent.parent / "data"


def tiny_engine_config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                                   batch=BatchConfig(), cache_bytes=0)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


class EngineHarness:
    """An engine on its own event loop, driven synchronously from tests."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = TtsEngine(config)
        self.run(self.engine.start())

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.engine.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[EngineHarness]:
    h = EngineHarness(tiny_engine_config())
    yield h
    h.close()


@pytest.fixture(scope="module")
def staged_harness() -> Iterator[EngineHarness]:
    """CPU engine that decodes each utterance alone through the staged decoder (the
    ONNX Runtime default), instead of batched slot steps (the torch default)."""
    h = EngineHarness(tiny_engine_config(batch=BatchConfig(decoder="staged")))
    yield h
    h.close()
