"""Autoregressive rows in the plan: a family whose decoder input is made token by token gets one
batched token step per engine iteration, beside the acoustic batch and the decoder step, and
an utterance is decoded once its tokens are complete. Run through the real engine core with the
built-in voice's runtime declared autoregressive (one token per 25 decoder frames)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from service.engine.cache import ResultCache
from service.engine.config import BatchConfig
from service.engine.core import EngineCore
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.scheduler import Scheduler
from service.engine.state import ChunkResult, ReadCursor, SessionState, UtteranceState, UtteranceStatus, WorkSpec
from service.models.family import ChunkSchedule, DecoderInput, SynthesisParams
from service.models.registry import open_voice
from service.models.vits.runtime import VitsRuntime
from service.text.frontend import PhonemizedSentence
from service.voices import builtin_voice_info

TOKEN_FRAMES = 25


class TokenVits:
    """The built-in voice, its prior released one "token" (25 frames) per autoregressive step."""

    def __init__(self, inner: VitsRuntime) -> None:
        self.inner = inner
        self.tokens = self  # its own token stage
        self.made: dict[int, int] = {}
        self.batches: list[int] = []
        self._held: list[DecoderInput] = []  # keeps each input alive, so no id() is reused for another

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def ready_frames(self, utt: DecoderInput) -> int:
        """Nothing decodable before the last token (CosyVoice2 decodes earlier: its own tests)."""
        return utt.frames if self.made.get(id(utt), 0) * TOKEN_FRAMES >= utt.frames else 0

    def step(self, rows: Sequence[DecoderInput | None]) -> list[bool]:
        time.sleep(0.005)  # a device step's time: sessions that arrive meanwhile join the next one
        self.batches.append(len(rows))
        out = []
        for utt in rows:
            assert utt is not None
            if id(utt) not in self.made:
                self._held.append(utt)
            self.made[id(utt)] = self.made.get(id(utt), 0) + 1
            out.append(self.made[id(utt)] * TOKEN_FRAMES >= utt.frames)
        return out


class _Sink:
    def __init__(self) -> None:
        self.chunks: list[ChunkResult] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def on_chunk(self, chunk: ChunkResult) -> None:
        self.chunks.append(chunk)

    def on_done(self) -> None:
        self.done.set()

    def on_error(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


@pytest.fixture(scope="module")
def plain() -> VitsRuntime:
    runtime = open_voice(builtin_voice_info(), "onnxruntime", "cpu", threads=1)
    assert isinstance(runtime, VitsRuntime)
    return runtime


def _speak(runtime: object, texts: list[str]) -> tuple[list[np.ndarray], EngineCore]:
    """Each text in a session of its own, all open at once; returns each session's audio."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    core = EngineCore(BatchConfig(), ResultCache(0), frontend=FrontendPoolConfig(workers=0))
    core.start()
    sinks = []
    try:
        for i, text in enumerate(texts):
            sink = _Sink()
            spec = WorkSpec(i + 1, "joe", None, SynthesisParams(seed=7), ChunkSchedule(), "fp32", None,
                            runtime=runtime, sink=sink, loop=loop, cursor=ReadCursor())  # type: ignore[arg-type]
            core.submit_open(spec)
            core.submit_text(i + 1, text)
            core.submit_end(i + 1)
            sinks.append(sink)
        for sink in sinks:
            assert sink.done.wait(120), "session did not finish"
            assert sink.error is None, sink.error
    finally:
        core.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    return [np.concatenate([c.samples for c in sink.chunks]) for sink in sinks], core


TEXTS = ["The first caller hears this sentence.", "A second caller, at the same time, hears another one.",
         "And a third caller hears the last one."]


def test_token_rows_are_batched_and_the_audio_is_the_same(plain: VitsRuntime) -> None:
    wrapped = TokenVits(plain)
    ar, _ = _speak(wrapped, TEXTS)
    reference, _ = _speak(plain, TEXTS)
    assert wrapped.batches, "no token step ran"
    assert max(wrapped.batches) > 1, "token steps were not batched across sessions"
    assert all(n >= 1 for n in wrapped.made.values())
    for a, b in zip(ar, reference, strict=True):  # chunk edges may differ: exact within the decoders' 1e-4
        assert len(a) == len(b) and float(np.abs(a - b).max()) <= 1e-4


def test_the_plan_holds_token_rows_beside_the_decoder_step(plain: VitsRuntime) -> None:
    sentence = PhonemizedSentence("hi", ["h", "i"], [1, 2, 3], [])
    sessions = []
    for sid, status in enumerate((UtteranceStatus.TOKENS, UtteranceStatus.DECODING, UtteranceStatus.TOKENS), 1):
        spec = WorkSpec(sid, "joe", None, SynthesisParams(), ChunkSchedule(), "fp32", None,
                        runtime=plain, sink=_Sink(), loop=asyncio.new_event_loop(), cursor=ReadCursor())
        s = SessionState(spec, None)
        s.utterances.append(UtteranceState(0, sentence, status))
        sessions.append(s)
    plan = Scheduler(BatchConfig()).plan(sessions, 1000.0, max_rows=8)
    assert [s.spec.session_id for s, _ in plan.tokens] == [1, 3]
    assert [s.spec.session_id for s, _ in plan.decode] == [2]
    assert not plan.empty and math.isinf(sessions[0].slack(1000.0))
    for s in sessions:
        s.spec.loop.close()  # type: ignore[attr-defined]


def test_a_sessions_sentences_make_their_tokens_one_at_a_time(plain: VitsRuntime) -> None:
    sentence = PhonemizedSentence("hi", ["h", "i"], [1, 2, 3], [])
    spec = WorkSpec(1, "joe", None, SynthesisParams(), ChunkSchedule(), "fp32", None,
                    runtime=plain, sink=_Sink(), loop=asyncio.new_event_loop(), cursor=ReadCursor())
    s = SessionState(spec, None)
    head, nxt = UtteranceState(0, sentence, UtteranceStatus.TOKENS), UtteranceState(1, sentence)
    s.utterances += [head, nxt]
    assert nxt.status is UtteranceStatus.ACOUSTIC
    scheduler = Scheduler(BatchConfig())
    plan = scheduler.plan([s], 1000.0, max_rows=8)
    assert plan.tokens == [(s, head)] and plan.acoustic == []  # the next sentence waits for the head's tokens
    head.status = UtteranceStatus.DECODING
    assert scheduler.plan([s], 1000.0, max_rows=8).acoustic == [(s, nxt)]
    spec.loop.close()  # type: ignore[attr-defined]


def test_sessions_of_many_sentences_hold_one_token_row_each(plain: VitsRuntime) -> None:
    wrapped = TokenVits(plain)
    texts = [" ".join(TEXTS), " ".join(reversed(TEXTS))]
    _speak(wrapped, texts)
    assert len(wrapped.made) >= 2 * len(TEXTS), "every sentence made tokens"
    assert max(wrapped.batches) <= len(texts), f"a session had more than one row in a step: {wrapped.batches}"
