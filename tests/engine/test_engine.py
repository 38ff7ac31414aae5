"""Engine: segmenter integration, batching exactness, cancel, cache, guard fallback, validation."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from service.audio.encoding import AudioEncoding
from service.engine.config import BatchConfig, Limits
from service.engine.contract import (
    AudioOut,
    InvalidArgument,
    NotFound,
    Precision,
    ResourceExhausted,
    SessionConfig,
    SessionSummary,
)
from service.models.family import ChunkSchedule
from tests.engine.conftest import EngineHarness, drive, tiny_engine_config

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy!"
FLOAT = AudioEncoding.FLOAT32


def _samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.float32)


def test_word_timings_only_when_asked_and_never_lost_to_the_cache(harness: EngineHarness) -> None:
    """Without word timings the frontend skips word alignment; a cached utterance made that way
    must not serve a later session that asks for them (same seed, same text)."""
    async def run(words: bool) -> tuple[bytes, list[AudioOut], SessionSummary]:
        return await drive(await harness.engine.open_session(SessionConfig(seed=41, encoding=FLOAT,
                                                                            word_timings=words)), [TEXT])

    bare, ev_bare, _ = harness.run(run(False))
    timed, ev_timed, _ = harness.run(run(True))
    again, ev_again, _ = harness.run(run(True))
    assert bare == timed == again and len(bare) > 0
    assert not [w for e in ev_bare for w in e.words]
    words = [w.word for e in ev_timed for w in e.words]
    assert words[:3] == ["The", "quick", "brown"] and words == [w.word for e in ev_again for w in e.words]


def test_tiny_deltas_equal_text_at_once(harness: EngineHarness) -> None:
    cfg = SessionConfig(seed=7, encoding=FLOAT, word_timings=True)

    async def run(deltas: list[str]) -> tuple[bytes, list[AudioOut], SessionSummary]:
        return await drive(await harness.engine.open_session(cfg), deltas)

    whole, ev1, s1 = harness.run(run([TEXT]))
    tiny, ev2, s2 = harness.run(run([TEXT[i : i + 2] for i in range(0, len(TEXT), 2)]))
    assert whole == tiny and len(whole) > 0
    assert [w for e in ev1 for w in e.words] == [w for e in ev2 for w in e.words]
    assert s1.utterances == s2.utterances == 2 and s1.characters == len(TEXT)
    assert [e.seq for e in ev2] == list(range(len(ev2)))
    offsets = [e.offset_samples for e in ev2]
    assert offsets == [sum(e.num_samples for e in ev2[:i]) for i in range(len(ev2))]


def _cfg(i: int) -> SessionConfig:
    return SessionConfig(
        seed=100 + i, speaker=["alice", "bob", "carol"][i % 3], encoding=FLOAT,
        speaking_rate=[1.0, 1.3, 0.8, 2.0][i % 4], sample_rate=[None, 8000, 22050][i % 3],
    )


def test_batching_keeps_each_session_result(harness: EngineHarness) -> None:
    """20 concurrent sessions with different settings share slot steps: each equals its solo run
    (to kernel rounding: conv kernels depend on the batch size)."""
    alone = [harness.run(harness.engine.synthesize_all(_cfg(i), TEXT))[0] for i in range(20)]
    rows_before = harness.engine.stats()["step_rows"] - harness.engine.stats()["steps"]
    acoustic_before = harness.engine.stats()["acoustic_jobs"] - harness.engine.stats()["acoustic_batches"]

    async def together() -> list[tuple[bytes, object, SessionSummary]]:
        return await asyncio.gather(*[harness.engine.synthesize_all(_cfg(i), TEXT) for i in range(20)])

    results = harness.run(together())
    assert harness.engine.stats()["step_rows"] - harness.engine.stats()["steps"] > rows_before  # batched
    stats = harness.engine.stats()
    assert stats["acoustic_jobs"] - stats["acoustic_batches"] > acoustic_before  # encoder calls were batched too
    for i, (data, _, _) in enumerate(results):
        a, b = _samples(alone[i]), _samples(data)
        assert a.shape == b.shape, i
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    # different settings really differ (no shared state leaking one session into another)
    assert len({r[0] for r in results}) == 20


def test_acoustic_stage_run_during_a_step_keeps_each_session_result(harness: EngineHarness) -> None:
    """Where steps run asynchronously (CUDA), the acoustic stage for new sentences runs while a
    step is on the device and the sentences it readied start right after. The CPU backend marked
    asynchronous takes that path too (its steps just finish before returning): every session
    still gets its solo audio, whoever shared its steps and whatever ran in between."""
    runtime = harness.engine.host.runtimes.loaded["tiny-multi"]
    alone = [harness.run(harness.engine.synthesize_all(_cfg(i), TEXT))[0] for i in range(6)]
    before = harness.engine.stats()["overlapped_acoustic"]

    async def staggered() -> list[tuple[bytes, object, SessionSummary]]:
        async def one(i: int) -> tuple[bytes, object, SessionSummary]:
            await asyncio.sleep(0.05 * i)  # later sessions' sentences arrive while others decode
            return await harness.engine.synthesize_all(_cfg(i), TEXT)
        return await asyncio.gather(*[one(i) for i in range(6)])

    # Whether a sentence arrives while a step is planned depends on timing: stagger until the
    # overlapped path ran (bounded), checking every session of every run.
    declared = runtime.capabilities  # what the engine reads (never probing the backend)
    runtime.capabilities = dataclasses.replace(declared, asynchronous=True)
    try:
        for _ in range(8):
            results = harness.run(staggered())
            for i, (data, _, _) in enumerate(results):
                a, b = _samples(alone[i]), _samples(data)
                assert a.shape == b.shape, i
                np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
            if harness.engine.stats()["overlapped_acoustic"] > before:
                break
    finally:
        runtime.capabilities = declared
    assert harness.engine.stats()["overlapped_acoustic"] > before


def test_staged_decoding_equals_slot_steps(harness: EngineHarness, staged_harness: EngineHarness) -> None:
    """Each utterance alone through the staged decoder (the ONNX Runtime CPU path) and the
    batched slot steps give the same audio, and the staged path never batches chunks."""
    before = staged_harness.engine.stats()
    staged = _samples(staged_harness.run(staged_harness.engine.synthesize_all(_cfg(3), TEXT))[0])
    after = staged_harness.engine.stats()
    slots = _samples(harness.run(harness.engine.synthesize_all(_cfg(3), TEXT))[0])
    assert staged.shape == slots.shape and staged.size > 16000
    np.testing.assert_allclose(staged, slots, atol=1e-4, rtol=0)
    assert after["steps"] > before["steps"]
    assert after["step_rows"] - before["step_rows"] == after["steps"] - before["steps"]


def test_cpu_chunks_are_cut_while_other_sessions_wait() -> None:
    """Sessions decoded together by the staged decoder take turns in short chunks (no
    session's big chunk starves the others); each session's audio still equals its solo run.
    Any buffered audio counts as running low here (`cpu_urgent_slack_s`): the tiny voice
    decodes so fast that sessions are soon far ahead, and whether one was still low when
    another's chunk was cut would depend on this machine's speed."""
    harness = EngineHarness(tiny_engine_config(batch=BatchConfig(decoder="staged", cpu_urgent_slack_s=1e9)))
    text = TEXT * 3

    async def events(cfg: SessionConfig) -> list[AudioOut]:
        return (await drive(await harness.engine.open_session(cfg), [text]))[1]

    async def together() -> list[list[AudioOut]]:
        return await asyncio.gather(*[events(_cfg(i)) for i in range(3)])

    try:
        alone = [harness.run(events(_cfg(i))) for i in range(3)]
        mixed = harness.run(together())
        for solo, shared in zip(alone, mixed, strict=True):
            a = _samples(b"".join(e.audio for e in solo))
            b = _samples(b"".join(e.audio for e in shared))
            assert a.shape == b.shape
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    finally:
        harness.close()
    assert sum(len(m) for m in mixed) > sum(len(a) for a in alone)  # chunks were cut into turns


def test_cancel_frees_the_session(harness: EngineHarness) -> None:
    async def run() -> None:
        session = await harness.engine.open_session(SessionConfig(seed=1))
        session.push_text(TEXT * 5)
        session.end_input()
        async for _ in session.events():
            break
        session.cancel()
        deadline = time.monotonic() + 5
        while harness.engine.engine_sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    harness.run(run())
    assert harness.engine.live_sessions == 0
    assert harness.engine.engine_sessions == 0


def test_idle_timeout_and_flush_release_text() -> None:
    from service.text.segment import SegmenterConfig

    h = EngineHarness(tiny_engine_config(segmenter=SegmenterConfig(idle_timeout_s=0.05)))
    try:
        async def run() -> tuple[AudioOut, AudioOut]:
            session = await h.engine.open_session(SessionConfig(seed=2))
            session.push_text("no sentence end here")  # released by the idle timeout
            events = aiter(session.events())
            first = await asyncio.wait_for(anext(events), 10)
            session.push_text("and then a flush")
            session.flush()
            while (e := await asyncio.wait_for(anext(events), 10)).utterance == 0:
                pass
            session.cancel()
            assert isinstance(first, AudioOut) and isinstance(e, AudioOut)
            return first, e

        first, later = h.run(run())
        assert first.utterance == 0 and later.utterance == 1
    finally:
        h.close()


def test_the_idle_timeout_counts_from_the_last_delta() -> None:
    """Deltas closer together than the idle time stay one utterance, released by the idle
    timeout after the last of them (its timer fires early, after the first, and waits on)."""
    from service.text.segment import SegmenterConfig

    h = EngineHarness(tiny_engine_config(segmenter=SegmenterConfig(idle_timeout_s=0.3)))
    try:
        async def run() -> SessionSummary:
            session = await h.engine.open_session(SessionConfig(seed=2))
            for delta in ("no sentence", " end here", " for a while"):
                session.push_text(delta)
                await asyncio.sleep(0.1)
            events = aiter(session.events())
            first = await asyncio.wait_for(anext(events), 10)  # before end_input: the timeout let it go
            assert isinstance(first, AudioOut) and first.utterance == 0
            session.end_input()
            async for event in events:
                if isinstance(event, SessionSummary):
                    return event
            raise AssertionError("no summary")

        assert h.run(run()).utterances == 1
    finally:
        h.close()


def test_cache_hits_for_seeded_repeats_only() -> None:
    h = EngineHarness(tiny_engine_config(cache_bytes=8 << 20))
    try:
        seeded = SessionConfig(seed=5, encoding=FLOAT)
        a, _, s1 = h.run(h.engine.synthesize_all(seeded, TEXT))
        b, _, s2 = h.run(h.engine.synthesize_all(seeded, TEXT))
        assert a == b and s1.cache_hits == 0 and s2.cache_hits == 2
        # other rate/encoding reuses the model-rate entry
        _, _, s3 = h.run(h.engine.synthesize_all(SessionConfig(seed=5, sample_rate=8000), TEXT))
        assert s3.cache_hits == 2
        hits = h.engine.host.cache.hits
        u1, _, _ = h.run(h.engine.synthesize_all(SessionConfig(encoding=FLOAT), TEXT))
        u2, _, _ = h.run(h.engine.synthesize_all(SessionConfig(encoding=FLOAT), TEXT))
        assert h.engine.host.cache.hits == hits and u1 != u2
        assert 0 < h.engine.host.cache.bytes <= 8 << 20
        # What the cache counts is what it holds: its chunks are copies, not views that would keep
        # their whole step's audio alive.
        held = [c for entry in h.engine.host.cache._entries.values() for c in entry.chunks]
        assert held and all(c.base is None for c in held)
    finally:
        h.close()


def test_cache_is_bounded_lru() -> None:
    from service.engine.cache import CachedUtterance, ResultCache

    cache = ResultCache(max_bytes=10_000)
    entry = CachedUtterance((np.zeros(1000, np.float32),), ("fp32",), ())
    for k in range(5):
        cache.put(k, entry)
    assert cache.bytes <= 10_000 and len(cache) == 2
    assert cache.get(0) is None and cache.get(4) is entry
    assert (cache.hits, cache.misses) == (1, 1)


@pytest.mark.parametrize("layer, value", [("dec.resblocks.0", float("nan")), ("flow.flows.2.enc", float("inf"))])
def test_guard_trip_recomputes_in_fp32(layer: str, value: float) -> None:
    """A fault injected into the real FP16 model (vocoder or flow) trips the guard:
    no non-finite sample leaves, the chunk is redone in FP32, the rest of the
    utterance stays FP32, and the audio matches a pure FP32 run."""
    from service.audio.quality import psnr_db
    from service.engine.faults import inject_nonfinite
    from service.models.vits.backends.torch_backend import TorchBackend

    h = EngineHarness(tiny_engine_config())
    try:
        backend = h.engine.host.runtimes.loaded["tiny-multi"].backend  # type: ignore[attr-defined]
        assert isinstance(backend, TorchBackend)
        fault = inject_nonfinite(backend.model_for("fp16"), layer, value=value)
        text = "Hello there, this sentence is long enough for several chunks of audio."
        cfg = SessionConfig(seed=3, encoding=FLOAT, precision=Precision.FP16, first_chunk_frames=4)
        data, _, summary = h.run(h.engine.synthesize_all(cfg, text))
        ref, _, _ = h.run(h.engine.synthesize_all(dataclasses.replace(cfg, precision=Precision.FP32), text))
        assert fault.fired >= 1
        assert summary.fallbacks >= 1 and summary.chunks > summary.fallbacks
        out, expected = _samples(data), _samples(ref)
        assert np.isfinite(out).all() and len(out) == len(expected)
        assert psnr_db(expected, out) >= 60.0
        assert h.engine.stats()["fp32_fallbacks"] == summary.fallbacks
    finally:
        h.close()


@pytest.mark.parametrize("cfg, error, field", [
    (SessionConfig(voice="nobody"), NotFound, None),
    (SessionConfig(speaker="zed"), NotFound, None),
    (SessionConfig(speaker=9), NotFound, None),
    (SessionConfig(sample_rate=4000), InvalidArgument, "config.sample_rate"),
    (SessionConfig(speaking_rate=9.0), InvalidArgument, "config.speaking_rate"),
    (SessionConfig(speaking_rate=float("nan")), InvalidArgument, "config.speaking_rate"),
    (SessionConfig(options={"noise_scale": -1.0}), InvalidArgument, "config.options"),
    (SessionConfig(options={"noise_w": float("nan")}), InvalidArgument, "config.options"),
    (SessionConfig(options={"temperature": 0.5}), InvalidArgument, "config.options"),
    (SessionConfig(first_chunk_frames=16, max_chunk_frames=8), InvalidArgument, "config.max_chunk_frames"),
    (SessionConfig(first_chunk_frames=5000), InvalidArgument, "config.first_chunk_frames"),
    (SessionConfig(voice="tiny-multi", language="de"), InvalidArgument, "config.language"),
    (SessionConfig(language="de"), NotFound, None),
    (SessionConfig(encoding="wav"), InvalidArgument, "config.encoding"),  # type: ignore[arg-type]
])
def test_bad_configs_are_rejected(harness: EngineHarness, cfg: SessionConfig, error: type, field: str | None) -> None:
    with pytest.raises(error) as info:
        harness.run(harness.engine.open_session(cfg))
    if field:
        assert info.value.field == field
    assert harness.engine.live_sessions == 0


@pytest.mark.parametrize("speaker", ["bob", "2", 2])
def test_a_speaker_for_a_single_speaker_voice_says_to_leave_it_unset(speaker: int | str) -> None:
    from service.engine.engine import TtsEngine
    from service.voices import builtin_voice_info

    info = builtin_voice_info()
    assert info.num_speakers == 1
    with pytest.raises(NotFound) as caught:
        TtsEngine._resolve_speaker(info, speaker)
    assert str(caught.value) == (f"config.speaker: voice {info.name} has one speaker; leave speaker unset "
                                 f"(got {speaker!r})")
    for unset in (None, "", 0, "0"):  # the one speaker, however it is named
        assert TtsEngine._resolve_speaker(info, unset) is None


def test_family_options_are_checked_by_name_and_range_and_reach_the_voice(harness: EngineHarness) -> None:
    """`SessionConfig.options` carries the family's options: a bad one is refused naming it and
    what it takes; good ones change the audio (both noise scales at 0: the seed no longer matters)."""
    with pytest.raises(InvalidArgument) as info:
        harness.run(harness.engine.open_session(SessionConfig(options={"noise_scale": -1.0})))
    assert "noise_scale" in str(info.value) and "0..2" in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        harness.run(harness.engine.open_session(SessionConfig(options={"temperature": 0.5})))
    assert "temperature" in str(info.value) and "noise_scale, noise_w" in str(info.value)
    assert harness.engine.live_sessions == 0

    def audio(seed: int, **options: float) -> np.ndarray:
        cfg = SessionConfig(seed=seed, encoding=FLOAT, options=options or None)
        return _samples(harness.run(harness.engine.synthesize_all(cfg, "Options reach the voice."))[0])

    quiet = dict(noise_scale=0.0, noise_w=0.0)
    np.testing.assert_array_equal(audio(1, **quiet), audio(2, **quiet))
    one, two = audio(1), audio(2)  # the voice's defaults: the seed decides the noise
    assert one.shape != two.shape or not np.array_equal(one, two)
    np.testing.assert_array_equal(audio(1), one)


def test_limits_sessions_and_text() -> None:
    from service.engine.config import Limits

    h = EngineHarness(tiny_engine_config(limits=Limits(max_sessions=2, max_text_chars=20)))
    try:
        a = h.run(h.engine.open_session(SessionConfig()))
        b = h.run(h.engine.open_session(SessionConfig()))
        with pytest.raises(ResourceExhausted):
            h.run(h.engine.open_session(SessionConfig()))
        with pytest.raises(ResourceExhausted):
            a.push_text("x" * 21)
        a.cancel()
        b.cancel()
        data, _, _ = h.run(h.engine.synthesize_all(SessionConfig(), "Still serving."))
        assert data
    finally:
        h.close()


@pytest.mark.gpu
def test_auto_precision_on_a_tensor_core_gpu_is_fp16_and_says_why() -> None:
    h = EngineHarness(tiny_engine_config(device="cuda"))
    try:
        data, _, summary = h.run(h.engine.synthesize_all(SessionConfig(seed=3, encoding=FLOAT), "Hello there."))
        assert summary.precision is Precision.FP16 and "tensor cores" in summary.precision_reason
        assert np.isfinite(_samples(data)).all() and len(data) > 0
    finally:
        h.close()


def test_admission_control_waits_for_a_free_stream_then_refuses() -> None:
    """At the capacity estimate a new session waits up to `admission_wait_s`: it gets in when
    another ends meanwhile, else RESOURCE_EXHAUSTED with a message that says what to do."""
    h = EngineHarness(tiny_engine_config(limits=Limits(capacity_streams=2, admission_wait_s=0.3)))
    try:
        async def run() -> None:
            a = await h.engine.open_session(SessionConfig())
            b = await h.engine.open_session(SessionConfig())
            t0 = time.monotonic()
            with pytest.raises(ResourceExhausted, match=r"capacity: 2 sessions open.*retry"):
                await h.engine.open_session(SessionConfig())
            assert time.monotonic() - t0 >= 0.3

            async def end_one_soon() -> None:
                await asyncio.sleep(0.1)
                a.cancel()

            ending = asyncio.create_task(end_one_soon())
            c = await h.engine.open_session(SessionConfig())
            await ending
            assert h.engine.server_info().open_sessions == 2
            b.cancel()
            c.cancel()

        h.run(run())
        assert h.engine.server_info().capacity_streams == 2
    finally:
        h.close()


def test_capacity_is_measured_from_the_decoder() -> None:
    """Without a pinned figure the capacity comes from the engine's measured speed (the staged
    decoder: its warm-up, acoustic stage included), and GetServerInfo reports it."""
    h = EngineHarness(tiny_engine_config(batch=BatchConfig(decoder="staged")))
    try:
        capacity = h.engine.server_info().capacity_streams
        stats = h.engine.stats()
        assert capacity is not None and capacity > 0
        busy = stats["step_seconds"] + stats["acoustic_seconds"]
        assert stats["acoustic_seconds"] > 0
        # the slowest of the measured warm-up runs, the last of which the stats hold
        headroom = h.engine.host.core.executor.STAGED_CAPACITY_HEADROOM
        assert capacity <= headroom * stats["step_audio_seconds"] / busy * (1 + 1e-9)
        executor = h.engine.host.core.executor
        runs = executor._rate_samples[1:]
        assert len(runs) == h.engine.CAPACITY_RUNS - 1
        assert capacity == pytest.approx(headroom * min([*runs, stats["step_audio_seconds"] / busy]))
    finally:
        h.close()


@pytest.mark.parametrize("core", ["thread", "process"])
def test_backpressure_holds_a_session_whose_client_stops_reading(core: str) -> None:
    """A client that stops taking audio gets at most `max_ahead_s` (plus one step) delivered
    and queued; when it reads again, the rest comes and the session completes (with the core in
    its own process, what the client took crosses the pipe)."""
    h = EngineHarness(tiny_engine_config(core=core, batch=BatchConfig(max_ahead_s=1.0, step_frames=16)))
    try:
        async def run() -> tuple[float, float, SessionSummary]:
            session = await h.engine.open_session(SessionConfig(seed=5, encoding=FLOAT))
            session.push_text(TEXT * 8)  # tens of seconds of audio
            session.end_input()
            await asyncio.sleep(2.0)  # not reading: the engine must stop
            held = session.setup.cursor.delivered_s
            await asyncio.sleep(0.5)
            still = session.setup.cursor.delivered_s
            summary = None
            async for event in session.events():
                if isinstance(event, SessionSummary):
                    summary = event
            assert summary is not None
            return held, still, summary

        held, still, summary = h.run(run())
        step_s = 16 * 256 / 16000  # one step of the tiny voice
        assert held <= 1.0 + 2 * step_s and still == held
        assert summary.audio_seconds > 10 * held  # and everything came once the client read
    finally:
        h.close()


def test_admission_waits_while_the_engine_is_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the capacity estimate says, a session waiting too long for its first audio
    makes new sessions wait (and be refused if it lasts)."""
    h = EngineHarness(tiny_engine_config(limits=Limits(capacity_streams=100, admission_wait_s=0.2,
                                                       admission_first_audio_s=0.5)))
    try:
        async def run() -> None:
            core = h.engine.host.core
            monkeypatch.setattr(core, "first_audio_wait", lambda: 2.0)  # what the engine reports when behind
            with pytest.raises(ResourceExhausted, match=r"\(about 100 real-time streams fit on this cpu; a session "
                                                        r"has waited 2.0 s for its first audio\)"):
                await h.engine.open_session(SessionConfig())
            # No estimate (a family whose steps the warm-up does not time): the wait alone, no "about 0".
            monkeypatch.setattr(h.engine, "capacity_streams", lambda: None)
            with pytest.raises(ResourceExhausted, match=r"starting \(a session has waited 2.0 s for its first audio\)"):
                await h.engine.open_session(SessionConfig())
            monkeypatch.setattr(core, "first_audio_wait", lambda: 0.0)
            (await h.engine.open_session(SessionConfig())).cancel()

        h.run(run())
    finally:
        h.close()


def test_the_measured_capacity_counts_sessions_that_need_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the measured estimate (not a pinned one), a new session is refused while the open
    ones are starting or speaking, whatever the engine is doing this instant (a burst is refused
    before the engine is busy); a session whose audio has played out and that waits for its next
    text (an LLM's) leaves room."""
    h = EngineHarness(tiny_engine_config(limits=Limits(admission_wait_s=0.2)))
    try:
        async def run() -> None:
            core = h.engine.host.core
            monkeypatch.setattr(core.executor, "capacity_streams", lambda precision=None: 1.0)
            monkeypatch.setattr(core, "busy_share", lambda: 0.0)  # the engine idle: no matter
            assert h.engine.server_info().capacity_streams == 1.0
            a = await h.engine.open_session(SessionConfig(seed=1, encoding=FLOAT))
            with pytest.raises(ResourceExhausted, match=r"capacity: 1 sessions open, 1 of them speaking or starting"):
                await h.engine.open_session(SessionConfig())
            a.push_text("Hello there. ")
            a.flush()
            events = a.events()
            first = await anext(events)
            assert isinstance(first, AudioOut)
            while h.engine.demand():  # its audio plays out (on the playback clock), then it idles
                await asyncio.sleep(0.05)
            b = await h.engine.open_session(SessionConfig())  # room again: a waits for text
            a.cancel()
            b.cancel()

        h.run(run())
    finally:
        h.close()


def test_the_engine_threads_busy_share_covers_idle_time(harness: EngineHarness) -> None:
    """The share comes from the last closed window, or from the open one once it is long (an
    idle thread closes none): a busy spell long ago does not read as saturated now."""
    core = harness.engine.host.core  # idle: its thread touches no window meanwhile
    saved = core._window, core._busy_share
    try:
        now = time.monotonic()
        core._window, core._busy_share = (now - 0.5, 0.5, 0.0, 0, 0), 0.95  # a short open window: the last closed
        assert core.busy_share() == 0.95
        core._window = (now - 10.0, 0.5, 0.0, 0, 0)  # idle since: the open window says so
        assert core.busy_share() == pytest.approx(0.05, abs=0.01)
        assert harness.engine.host.snapshot().busy_share == pytest.approx(0.05, abs=0.01)
    finally:
        core._window, core._busy_share = saved


def test_a_client_that_stops_reading_is_ended_after_the_stall_limit() -> None:
    """Held back by backpressure for `stall_timeout_s`, a session ends with ClientStalled
    (DEADLINE_EXCEEDED on the wire) and the engine forgets it."""
    from service.engine.contract import ClientStalled

    h = EngineHarness(tiny_engine_config(batch=BatchConfig(max_ahead_s=0.5, stall_timeout_s=1.0)))
    try:
        async def run() -> None:
            session = await h.engine.open_session(SessionConfig(seed=5, encoding=FLOAT))
            session.push_text(TEXT * 8)
            session.end_input()
            await asyncio.sleep(2.5)
            with pytest.raises(ClientStalled, match="took no audio for 1 s"):
                async for _ in session.events():
                    pass
            assert h.engine.engine_sessions == 0

        h.run(run())
    finally:
        h.close()


def test_capacity_is_capped_by_what_the_busy_engine_made(harness: EngineHarness) -> None:
    """A window in which the engine thread worked most of the time with large steps caps the
    estimate at the audio it made per working second; an idle or small-batch window does not."""
    core = harness.engine.host.core
    executor, stats = core.executor, core.stats
    saved = executor.engine_rate
    try:
        executor.engine_rate = 0.0
        before = executor.capacity_streams()  # None here: CPU slot steps are not timed at warm-up
        core._window = (time.monotonic() - 2.5, 0.0, stats.audio_seconds, stats.steps, stats.rows)
        stats.audio_seconds += 10.0
        stats.steps += 2
        stats.rows += 4  # 2 rows per step: too small to measure capacity from
        core._note_busy(2.4)
        assert executor.engine_rate == 0.0
        core._window = (time.monotonic() - 2.5, 0.0, stats.audio_seconds, stats.steps, stats.rows)
        stats.audio_seconds += 10.0
        stats.steps += 2
        stats.rows += 64
        core._note_busy(0.5)  # mostly idle: not saturated
        assert executor.engine_rate == 0.0
        core._window = (time.monotonic() - 2.5, 0.0, stats.audio_seconds, stats.steps, stats.rows)
        stats.audio_seconds += 10.0
        stats.steps += 2
        stats.rows += 64
        core._note_busy(2.0)
        assert executor.engine_rate == pytest.approx(5.0)
        assert executor.capacity_streams() == pytest.approx(0.8 * 5.0 if before is None else min(before, 0.8 * 5.0))
    finally:
        executor.engine_rate = saved


def test_engine_start_sets_the_gil_switch_interval() -> None:
    """The engine thread's many short native calls each wait for the GIL up to the interval."""
    import sys

    before = sys.getswitchinterval()
    h = EngineHarness(tiny_engine_config(batch=BatchConfig(gil_switch_interval_s=0.002)))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        h.close()
        sys.setswitchinterval(before)
    with pytest.raises(ValueError, match="gil_switch_interval_s"):
        BatchConfig(gil_switch_interval_s=0.0)



def test_a_warm_engine_leaves_its_heap_out_of_the_collector_s_scans() -> None:
    """Once warm, the server freezes what it built (models, graphs, modules), so a full
    collection scans only what was made since (bench/RESULTS.md has what one costs otherwise)."""
    import gc

    from service.engine.engine import TtsEngine

    async def start_and_stop() -> tuple[int, int]:
        engine = TtsEngine(tiny_engine_config())
        await engine.start()
        try:
            frozen = gc.get_freeze_count()
            # The figures thread reads the count kept at the freeze: counting walks every frozen
            # object holding the GIL, and snapshots are taken every few tens of milliseconds.
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(gc, "get_freeze_count", lambda: pytest.fail("snapshot counted the frozen objects"))
                reported = engine.host.snapshot().frozen_objects
            return frozen, reported
        finally:
            await engine.stop()

    gc.unfreeze()  # whatever an earlier test's server froze
    assert gc.get_freeze_count() == 0
    frozen, reported = asyncio.run(start_and_stop())
    assert reported >= frozen > 0  # counted at the freeze (frozen objects freed since leave the list)


def test_a_voice_loaded_after_warm_up_is_left_out_of_the_scans_too() -> None:
    """A voice first asked for after the server settled is frozen once loaded, so later full
    collections do not scan its weights again."""
    import gc

    from service.engine.contract import SessionConfig
    from service.engine.engine import TtsEngine

    async def load_late() -> tuple[int, int, int]:
        engine = TtsEngine(tiny_engine_config())
        await engine.start()
        try:
            before = gc.get_freeze_count()
            session = await engine.open_session(SessionConfig(voice="en_US-joe-medium"))  # not preloaded
            session.cancel()
            return before, gc.get_freeze_count(), engine.host.snapshot().frozen_objects
        finally:
            await engine.stop()

    gc.unfreeze()
    before, after, reported = asyncio.run(load_late())
    assert reported >= after > before > 0


def test_staged_chunks_go_through_the_one_host_guard(staged_harness: EngineHarness,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged (CPU, FP32) path guards its chunks like every other path: a non-finite sample
    never leaves (it is zeroed: there is no FP32 to fall back to) and it is counted."""
    from service.models.vits.staged import StagedDecoder

    real = StagedDecoder.audio

    def poisoned(self: StagedDecoder, start: int, end: int) -> np.ndarray:
        audio = real(self, start, end).copy()
        audio[: min(3, len(audio))] = np.nan
        return audio

    monkeypatch.setattr(StagedDecoder, "audio", poisoned)
    before = staged_harness.engine.host.core.stats.nonfinite_fp32
    data, _, summary = staged_harness.run(staged_harness.engine.synthesize_all(_cfg(0), TEXT))
    samples = _samples(data)
    assert summary.audio_seconds > 0 and np.isfinite(samples).all()
    assert staged_harness.engine.host.core.stats.nonfinite_fp32 > before


def test_the_staged_first_chunk_follows_the_staged_schedule() -> None:
    """With the staged decoder (a CPU's) a stream's first chunk is `staged_first_frames` long
    while no other session waits (`first_frames` otherwise); a session's first_chunk_frames sets it."""
    h = EngineHarness(tiny_engine_config(batch=BatchConfig(decoder="staged")))
    try:
        hop = h.engine.host.runtimes.loaded["tiny-multi"].hop  # type: ignore[attr-defined]
        default = ChunkSchedule()
        assert default.staged_first_frames < default.first_frames
        for first_chunk_frames, frames in ((None, default.staged_first_frames), (24, 24)):
            cfg = SessionConfig(seed=1, encoding=FLOAT, first_chunk_frames=first_chunk_frames)
            session = h.run(h.engine.open_session(cfg))
            _, events, _ = h.run(drive(session, [TEXT]))
            assert len(events[0].audio) == frames * hop * 4  # FLOAT32 samples
            assert len(events[1].audio) > len(events[0].audio)
    finally:
        h.close()
