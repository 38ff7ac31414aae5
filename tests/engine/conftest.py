"""Engine fixtures: a started TtsEngine on the tiny test voice (torch backend, CPU, slot decoder)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.engine.config import BatchConfig, EngineConfig
from service.engine.contract import AudioOut, SessionSummary
from service.engine.engine import TtsEngine
from service.models.family import AcousticJob, DecoderInput, SynthesisParams, VoiceRuntime, utterance_rng
from service.models.registry import open_frontend

DATA = Path(__file__).resolve().parent.parent / "data"


def tiny_engine_config(**overrides: object) -> EngineConfig:
    # The core on a thread: these tests reach into it (its executor, backends, cache).
    base: dict[str, object] = dict(voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                                   batch=BatchConfig(), cache_bytes=0, core="thread")
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def prepare(runtime: VoiceRuntime, text: str, params: SynthesisParams) -> list[DecoderInput]:
    """Frontend and acoustic stage for every sentence of `text`, one sentence at a time, each
    with its own seeded noise (as the engine draws it): decoder inputs to drive an executor with."""
    frontend = open_frontend(runtime.info.frontend_key)
    sid = runtime.info.speaker_index(params.speaker)
    sentences = [s for s in frontend.sentences(text, params.custom_dictionary) if s.phoneme_ids]
    return [runtime.acoustic_batch([AcousticJob(s, sid, params, utterance_rng(params.seed, s.phoneme_ids))])[0]
            for s in sentences]


async def drive(session: Any, deltas: list[str]) -> tuple[bytes, list[AudioOut], SessionSummary]:
    """Send `deltas`, end the input and collect the session's audio, events and summary."""
    for d in deltas:
        session.push_text(d)
    session.end_input()
    events: list[AudioOut] = []
    async for e in session.events():
        if isinstance(e, SessionSummary):
            return b"".join(a.audio for a in events), events, e
        events.append(e)
    raise AssertionError("no summary")


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
