"""The session's event queue: a writer that keeps up gets every chunk as it came; one that falls
behind gets the audio waiting for it in fewer, larger events, with the same bytes and a
contiguous sequence."""

from __future__ import annotations

import asyncio

import numpy as np

from service.audio.encoding import AudioEncoding
from service.engine.contract import AudioOut, Precision, SessionConfig, SessionSummary, WordTiming
from service.engine.session import _EventQueue
from tests.engine.conftest import EngineHarness

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy!"


def _audio(offset: int, n: int, utterance: int = 0, words: list[WordTiming] | None = None,
           precision: Precision = Precision.FP32) -> AudioOut:
    data = bytes((offset + i) % 251 for i in range(2 * n))
    return AudioOut(audio=data, seq=0, offset_samples=offset, num_samples=n, sample_rate=22050,
                    utterance=utterance, precision=precision, fallback=False, words=words or [])


async def _take(q: _EventQueue, n: int) -> list[object]:
    return [await q.get() for _ in range(n)]


def test_a_writer_that_keeps_up_gets_every_chunk() -> None:
    async def run() -> list[object]:
        q, got = _EventQueue(1 << 20), []
        for i in range(4):
            assert not q.put_audio(_audio(100 * i, 100))
            got.append(await q.get())
        return got

    got = asyncio.run(run())
    assert [(e.offset_samples, e.num_samples) for e in got] == [(0, 100), (100, 100), (200, 100), (300, 100)]


def test_waiting_audio_is_joined_in_order_up_to_the_limits() -> None:
    """Chunks of one utterance join the audio event waiting before them; a new utterance, word
    timings, another precision, the byte limit and a summary each start a new event."""
    words = [WordTiming("dog", 500, 600)]
    chunks = [_audio(0, 100), _audio(100, 100), _audio(200, 50),  # joined: 250 samples
              _audio(250, 100, utterance=1, words=words), _audio(350, 100, utterance=1),  # joined
              _audio(450, 100, utterance=1, precision=Precision.FP16),  # another precision
              _audio(550, 450, utterance=1, precision=Precision.FP16),  # 200 + 900 bytes: over the cap
              _audio(1000, 50, utterance=1, precision=Precision.FP16)]  # 900 + 100: at the cap
    summary = SessionSummary(characters=1, audio_seconds=0.0, ttfa_seconds=None, fallbacks=0, utterances=2,
                             chunks=0, cache_hits=0, precision=Precision.FP16, precision_reason="")

    async def run() -> tuple[list[object], int]:
        q = _EventQueue(1000)
        appended = [q.put_audio(c) for c in chunks]
        q.put(summary)
        assert appended == [False, True, True, False, True, False, False, True]
        return await _take(q, 5), q.merged

    got, merged = asyncio.run(run())
    audio = [e for e in got if isinstance(e, AudioOut)]
    assert [(e.offset_samples, e.num_samples, e.utterance) for e in audio] == [
        (0, 250, 0), (250, 200, 1), (450, 100, 1), (550, 500, 1)]
    assert b"".join(e.audio for e in audio) == b"".join(c.audio for c in chunks)
    assert audio[1].words == words and got[-1] is summary and merged == 4
    assert all(len(e.audio) <= 1000 for e in audio)


def test_a_late_reader_gets_the_same_audio_in_fewer_events(harness: EngineHarness) -> None:
    """Through the engine: a client that starts reading only after all the audio was made gets
    it in fewer events than one that reads as it comes, with the same bytes, a contiguous
    sequence and contiguous offsets (same seed)."""
    cfg = SessionConfig(seed=11, encoding=AudioEncoding.FLOAT32, word_timings=True)

    async def run(late: bool) -> tuple[list[AudioOut], SessionSummary]:
        session = await harness.engine.open_session(cfg)
        session.push_text(TEXT)
        session.end_input()
        if late:  # let a few chunks queue up (less than the backpressure limit holds back)
            while not session.closed and session.setup.cursor.delivered_s < 2.0:
                await asyncio.sleep(0.01)
        events: list[AudioOut] = []
        async for e in session.events():
            if isinstance(e, SessionSummary):
                return events, e
            events.append(e)
        raise AssertionError("no summary")

    prompt, s1 = harness.run(run(False))
    late, s2 = harness.run(run(True))
    assert len(late) < len(prompt) and s2.chunks == len(late) and s1.chunks == len(prompt)
    for events in (prompt, late):
        assert [e.seq for e in events] == list(range(len(events)))
        ends = np.cumsum([0] + [e.num_samples for e in events])
        assert [e.offset_samples for e in events] == list(ends[:-1])
    assert b"".join(e.audio for e in late) == b"".join(e.audio for e in prompt)
    assert [w for e in late for w in e.words] == [w for e in prompt for w in e.words]
