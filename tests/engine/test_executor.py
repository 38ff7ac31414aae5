"""The executor: one batched slot step, its guard, and the FP32 redo of tripped rows only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.audio.encoding import float_to_int16
from service.engine.config import BatchConfig
from service.engine.executor import Executor
from service.engine.faults import break_batches, inject_nonfinite
from service.engine.state import EngineStats, ReadCursor, SessionState, UtteranceState, UtteranceStatus, WorkSpec
from service.models.family import ChunkSchedule, SynthesisParams
from service.models.registry import recognise
from service.models.vits.backends.torch_backend import TorchBackend
from service.models.vits.runtime import PriorSample, Utterance, VitsRuntime
from service.models.vits.voice import Voice
from service.text.frontend import PhonemizedSentence
from tests.engine.conftest import prepare


class _Sink:
    def on_chunk(self, chunk: object) -> None: ...

    def on_done(self) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


def _rows(runtime: VitsRuntime, precision: str, loop: asyncio.AbstractEventLoop
          ) -> list[tuple[SessionState, UtteranceState]]:
    texts = ["The first session speaks here.", "A second one, a little longer than that.", "And a third."]
    rows = []
    for i, text in enumerate(texts):
        spec = WorkSpec(i, "tiny", 0, SynthesisParams(seed=i), ChunkSchedule(), precision, None, runtime=runtime,
                        sink=_Sink(), loop=loop, cursor=ReadCursor())
        utt = prepare(runtime, text, SynthesisParams(seed=i, speaker=0))[0]
        assert isinstance(utt, Utterance)
        u = UtteranceState(0, PhonemizedSentence(text, [], utt.phoneme_ids, []), UtteranceStatus.DECODING, precision)
        u.decoder_input = utt
        s = SessionState(spec, None)
        s.utterances.append(u)
        rows.append((s, u))
    return rows


def _decode_all(executor: Executor, rows: list[tuple[SessionState, UtteranceState]]) -> list[list]:  # type: ignore[type-arg]
    out: list[list] = [[] for _ in rows]  # type: ignore[type-arg]
    while any(u.samples_done < u.frames * 256 for _, u in rows):
        live = [(s, u) for s, u in rows if u.samples_done < u.frames * 256]
        chunks, failed = executor.decode(live, 0.0, lambda s: False)
        assert not failed
        for chunk in chunks:
            chunk.utterance.samples_done += len(chunk.samples)
            chunk.utterance.chunk_index += 1
            out[chunk.session.spec.session_id].append(chunk)
    return out


@pytest.fixture(scope="module")
def runtime(tiny_voice_path: Path) -> VitsRuntime:
    voice = Voice(recognise(tiny_voice_path))
    return VitsRuntime(voice, TorchBackend(voice, "cpu", threads=1), ChunkSchedule())


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()  # sessions name their event loop; nothing runs on it here
    yield loop
    loop.close()


def _reference(runtime: VitsRuntime, loop: asyncio.AbstractEventLoop) -> list[list]:  # type: ignore[type-arg]
    """Every row decoded in FP32 with no fault."""
    return _decode_all(Executor(BatchConfig(step_frames=16), EngineStats()), _rows(runtime, "fp32", loop))


def _executor(stats: EngineStats, pipelined: bool) -> Executor:
    """`pipelined`: every step's rows go as two halves, the second launched before the first
    is cut into chunks (the path batches of 64+ rows take)."""
    executor = Executor(BatchConfig(step_frames=16), stats)
    if pipelined:
        executor.PIPELINE_MIN_ROWS = 1
    return executor


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_guard_trip_in_a_batch_redoes_only_the_tripped_row(
    runtime: VitsRuntime, loop: asyncio.AbstractEventLoop, pipelined: bool
) -> None:
    backend = runtime.backend
    assert isinstance(backend, TorchBackend)
    reference = _reference(runtime, loop)
    fault = inject_nonfinite(backend.model_for("fp16"), "dec.resblocks.0", rows=(1,), every=3, limit=1)
    stats = EngineStats()
    try:
        chunks = _decode_all(_executor(stats, pipelined), _rows(runtime, "fp16", loop))
    finally:
        fault.remove()
    assert fault.fired == 1 and stats.fallbacks == 1
    assert [c.fallback for c in chunks[1]].count(True) == 1
    assert not any(c.fallback for c in chunks[0] + chunks[2])
    assert all(c.precision == "fp16" for c in chunks[0] + chunks[2])
    k = next(i for i, c in enumerate(chunks[1]) if c.fallback)
    assert all(c.precision == "fp32" for c in chunks[1][k:])  # the rest of the utterance stays FP32
    # Each chunk's PCM, the guard's, redone chunk included, is its samples' as the output would make it.
    assert all(c.pcm16 is not None and np.array_equal(c.pcm16, float_to_int16(c.samples))
               for row in chunks for c in row)
    for got, ref in zip(chunks, reference, strict=True):
        audio = np.concatenate([c.samples for c in got])
        expected = np.concatenate([c.samples for c in ref])
        assert np.isfinite(audio).all() and audio.shape == expected.shape
    # The redone chunk and everything after it equal the pure FP32 decode.
    redone = np.concatenate([c.samples for c in chunks[1][k:]])
    expected = np.concatenate([c.samples for c in reference[1][k:]])
    np.testing.assert_allclose(redone, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failing_batch_is_split_and_every_row_still_decodes_exactly(
    runtime: VitsRuntime, loop: asyncio.AbstractEventLoop, pipelined: bool
) -> None:
    """A step that raises for batches of 2+ rows is retried in halves down to single rows,
    each row's decoder state rebuilt first: every session still gets exactly its audio."""
    backend = runtime.backend
    assert isinstance(backend, TorchBackend)
    reference = _reference(runtime, loop)
    breaker = break_batches(backend.model_for("fp32"), "dec.resblocks.0", min_rows=2)
    try:
        chunks = _decode_all(_executor(EngineStats(), pipelined), _rows(runtime, "fp32", loop))
    finally:
        breaker.remove()
    assert breaker.raised >= 1
    for got, ref in zip(chunks, reference, strict=True):
        np.testing.assert_allclose(np.concatenate([c.samples for c in got]), np.concatenate([c.samples for c in ref]),
                                   atol=1e-5, rtol=0)


def test_pipelined_halves_equal_one_batch(runtime: VitsRuntime, loop: asyncio.AbstractEventLoop) -> None:
    reference = _reference(runtime, loop)
    stats = EngineStats()
    chunks = _decode_all(_executor(stats, True), _rows(runtime, "fp32", loop))
    assert stats.steps > len(chunks[0])  # the rows really went in two launches per round
    for got, ref in zip(chunks, reference, strict=True):
        np.testing.assert_allclose(np.concatenate([c.samples for c in got]), np.concatenate([c.samples for c in ref]),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("pipelined", [False, True])
def test_meanwhile_runs_once_between_the_launches_and_the_first_result(
    runtime: VitsRuntime, loop: asyncio.AbstractEventLoop, pipelined: bool
) -> None:
    """The engine's overlap point: every step of the call is launched (each row's `fed` moved
    on), none has been waited for (no step counted yet), and it runs once per call."""
    stats = EngineStats()
    executor = _executor(stats, pipelined)
    rows = _rows(runtime, "fp32", loop)
    seen: list[tuple[list[int], int]] = []
    chunks, failed = executor.decode(rows, 0.0, lambda s: False,
                                     meanwhile=lambda: seen.append(([u.fed for _, u in rows], stats.steps)))
    assert not failed and len(chunks) == len(rows)
    assert len(seen) == 1
    fed, steps = seen[0]
    assert steps == 0 and stats.steps == (2 if pipelined else 1)
    assert all(f > 0 for f in fed)
    # ... and a call with nothing to step still runs it
    executor.decode([], 0.0, lambda s: False, meanwhile=lambda: seen.append(([], -1)))
    assert seen[-1] == ([], -1)


def test_rows_ranked_after_first_chunks_step_after_them(runtime: VitsRuntime, loop: asyncio.AbstractEventLoop) -> None:
    """A playing row ranked before a first chunk (about to run dry) steps before it; one ranked
    after it (a fill) gets its own call after it, instead of riding in the first call. Each
    call's chunks are handed over as it lands, before the next call is waited for."""
    executor = _executor(EngineStats(), pipelined=False)
    a, b, c = _rows(runtime, "fp32", loop)
    executor.decode([a, c], 0.0, lambda s: False)  # a and c are playing now; b starts below
    steps = executor.stats.steps
    seen: list[tuple[list[int], int]] = []
    chunks, failed = executor.decode(
        [a, b, c], 0.0, lambda s: False,
        landed=lambda got: seen.append(([ch.session.spec.session_id for ch in got], executor.stats.steps - steps)))
    assert not failed
    assert [ch.session.spec.session_id for ch in chunks] == [0, 1, 2]
    assert seen == [([0], 1), ([1], 2), ([2], 3)]  # (sessions handed over, calls landed by then)
    # with no first chunk between them, playing rows share one call
    steps = executor.stats.steps
    chunks, failed = executor.decode([a, c], 0.0, lambda s: False)
    assert not failed and executor.stats.steps - steps == 1


def test_an_utterance_waits_while_prior_memory_is_full_and_one_too_long_fails_alone(
    runtime: VitsRuntime, loop: asyncio.AbstractEventLoop
) -> None:
    """Starting an utterance needs a slot and room for its prior: without room it waits (no
    slot held, no error) and starts once memory is freed, decoding exactly; a prior longer than
    the whole memory fails its own session only."""
    reference = _reference(runtime, loop)
    executor = Executor(BatchConfig(step_frames=16, slots=4), EngineStats())
    pool = executor.slots(runtime, "fp32")
    memory = pool.decoder.prior  # type: ignore[attr-defined]
    channels = runtime.backend.model_for("fp32").hp.inter_channels  # type: ignore[attr-defined]
    filler = pool.take()
    assert filler is not None and pool.decoder.start(filler, PriorSample.fixed(
        np.zeros((channels, memory.zero), dtype=np.float32)))  # all of it
    rows = _rows(runtime, "fp32", loop)
    assert executor.decode(rows, 0.0, lambda s: False) == ([], [])
    assert all(u.slot is None and u.fed == 0 for _, u in rows) and len(pool.free) == 3
    pool.decoder.free(filler)
    pool.give(filler)
    too_long = _rows(runtime, "fp32", loop)[0]
    too_long[1].decoder_input = replace(too_long[1].decoder_input, prior=PriorSample.fixed(  # type: ignore[type-var]
        np.zeros((channels, memory.zero + 1), dtype=np.float32)))
    _, failed = executor.decode([too_long], 0.0, lambda s: False)
    assert [(s, str(e)) for s, e in failed] == [
        (too_long[0], f"an utterance of {memory.zero + 1} phoneme ids is longer than the decoder's prior memory "
                      f"({memory.zero} columns) can hold; send shorter sentences")]
    assert len(pool.free) == 4
    chunks = _decode_all(executor, rows)
    for got, ref in zip(chunks, reference, strict=True):
        np.testing.assert_allclose(np.concatenate([c.samples for c in got]), np.concatenate([c.samples for c in ref]),
                                   atol=1e-5, rtol=0)
