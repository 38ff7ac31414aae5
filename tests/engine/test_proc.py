"""The synthesis core in its own process (`EngineConfig.core="process"`): the same audio and
word timings as the core on a thread, its figures and telemetry reach the server, errors keep
their type across the pipe, and a dead core process fails the server's sessions. (Backpressure
across the pipe is tested in test_engine.py.)"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from service.api.client import connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.audio.encoding import AudioEncoding
from service.engine.config import BatchConfig
from service.engine.contract import AudioOut, ClientStalled, InvalidArgument, SessionConfig, SessionSummary, Unavailable
from service.engine.proc import ProcessHost
from tests.engine.conftest import EngineHarness, drive, tiny_engine_config
from tests.telemetry.conftest import ObservedServer, eventually, observed, tiny_server_config

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy!"
LONG = " ".join(["This sentence is long enough to keep the decoder busy for a while."] * 12)
FLOAT = AudioEncoding.FLOAT32


@pytest.fixture(scope="module")
def proc_harness() -> Iterator[EngineHarness]:
    h = EngineHarness(tiny_engine_config(core="process", batch=BatchConfig(max_ahead_s=0.5, stall_timeout_s=2.0)))
    yield h
    h.close()


async def _collect(harness: EngineHarness, config: SessionConfig, text: str) -> tuple[bytes, list[AudioOut],
                                                                                       SessionSummary]:
    return await drive(await harness.engine.open_session(config), [text])


def test_same_audio_and_words_as_the_core_on_a_thread(harness: EngineHarness, proc_harness: EngineHarness) -> None:
    assert proc_harness.engine.core_mode == "process" and harness.engine.core_mode == "thread"
    configs = [SessionConfig(seed=5, encoding=FLOAT, word_timings=True),
               SessionConfig(seed=6, speaker="bob", speaking_rate=1.3, sample_rate=8000, encoding=FLOAT),
               SessionConfig(seed=7, speaker=2, encoding=AudioEncoding.LINEAR16, word_timings=True),
               # 16-bit outputs at the voice's rate cross the pipe as int16 PCM (converted in the core's process)
               SessionConfig(seed=8, encoding=AudioEncoding.MULAW, wav_header=True),
               SessionConfig(seed=9, encoding=AudioEncoding.ALAW)]
    for config in configs:
        here, ev_here, sum_here = harness.run(_collect(harness, config, TEXT))
        there, ev_there, sum_there = proc_harness.run(_collect(proc_harness, config, TEXT))
        assert len(here) > 0 and here == there
        assert [w for e in ev_here for w in e.words] == [w for e in ev_there for w in e.words]
        assert sum_here.utterances == sum_there.utterances == 2 and sum_there.ttfa_seconds is not None


def test_figures_come_back_from_the_core(proc_harness: EngineHarness) -> None:
    engine = proc_harness.engine
    before = engine.stats()["steps"]
    proc_harness.run(_collect(proc_harness, SessionConfig(seed=8, encoding=FLOAT), "Counting the steps."))
    deadline = time.monotonic() + 5
    while engine.stats()["steps"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["steps"] > before and engine.stats()["step_rows"] >= engine.stats()["steps"]
    deadline = time.monotonic() + 5
    while engine.engine_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.engine_sessions == 0  # the core let the finished session go
    assert engine.server_info().precisions and engine.voices()[0].loaded
    assert engine.host.snapshot().frozen_objects > 0  # the warm core settled its heap (settle_heap)


def test_errors_keep_their_type_across_the_pipe(proc_harness: EngineHarness) -> None:
    err = pickle.loads(pickle.dumps(InvalidArgument("config.seed", "too large")))
    assert isinstance(err, InvalidArgument) and err.field == "config.seed" and str(err) == "config.seed: too large"

    async def stalled() -> BaseException:
        session = await proc_harness.engine.open_session(SessionConfig(seed=10, encoding=FLOAT))
        session.push_text(LONG)
        session.end_input()
        await asyncio.sleep(3.5)  # never reads: held back, then ended after stall_timeout_s
        with pytest.raises(ClientStalled) as info:
            async for _ in session.events():
                pass
        return info.value

    assert "took no audio" in str(proc_harness.run(stalled()))


def test_a_dead_core_process_fails_sessions_and_the_server_stops() -> None:
    server = ObservedServer(tiny_server_config(core="process"), observed())
    host = server.server.engine.host
    assert isinstance(host, ProcessHost)
    channel, stub = connect(server.addr)
    try:
        assert stream(stub, pb.SessionConfig(seed=1), ["Alive."], timeout=30).summary is not None

        def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1))
            yield pb.StreamingSynthesizeRequest(text=LONG)
            time.sleep(0.5)
            assert host._proc is not None
            host._proc.kill()
            time.sleep(30)  # the stream stays open: the server must end it

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.StreamingSynthesize(requests(), timeout=60):
                pass
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert "Traceback" not in (info.value.details() or "")
        eventually(lambda: server.server.engine_failed, timeout=20)
        assert time.monotonic() - started < 20
    finally:
        channel.close()
        server.close()


def test_a_core_process_that_dies_in_the_warm_up_fails_the_start() -> None:
    """The relay ends every open session when the core's pipe closes, with no server watching
    yet: a core that dies during the warm-up (here killed as soon as it said ready, the warm-up
    made long) makes the engine's start fail with that, instead of waiting for ever."""
    from service.engine.engine import TtsEngine

    engine = TtsEngine(tiny_engine_config(core="process", warmup_text=LONG * 4))
    host = engine.host
    assert isinstance(host, ProcessHost)

    async def run() -> None:
        start = asyncio.create_task(engine.start())
        while host._receiver is None and not start.done():  # the core has said ready
            await asyncio.sleep(0.005)
        assert host._proc is not None and not start.done()
        host._proc.kill()
        with pytest.raises(Unavailable, match="engine failed"):
            await asyncio.wait_for(start, 30)

    try:
        asyncio.run(run())
    finally:
        host.stop()


def test_telemetry_of_the_core_reaches_the_server() -> None:
    seen = observed()
    server = ObservedServer(tiny_server_config(core="process"), seen)
    channel, stub = connect(server.addr)
    name = "cadenza.session.first_audio.stage"
    try:
        result = stream(stub, pb.SessionConfig(seed=3), ["Where does the time go? ", "Second sentence."], timeout=30)
        assert result.summary is not None
        # This session's stages, not the server's warm-up sessions' (sent before it, if at all).
        eventually(lambda: seen.total(name, stage="acoustic") == 1)
        time.sleep(0.2)
        assert seen.total(name, stage="acoustic") == 1
        steps = seen.points("cadenza.engine.step.duration")
        assert {p.attributes["stage"] for p in steps} == {"acoustic", "decoder"}
        eventually(lambda: {"cadenza.engine.acoustic", "cadenza.engine.step"} <= {s.name for s in seen.finished()})
    finally:
        channel.close()
        server.close()


def test_samples_are_float32_and_finite(proc_harness: EngineHarness) -> None:
    audio, _, _ = proc_harness.run(_collect(proc_harness, SessionConfig(seed=12, encoding=FLOAT), "Finite."))
    samples = np.frombuffer(audio, dtype=np.float32)
    assert samples.size > 0 and np.isfinite(samples).all()


def test_chunks_for_pcm16_sessions_cross_the_pipe_as_int16() -> None:
    """The core's outbox converts the chunks of sessions whose output is made from 16-bit PCM at
    the voice's rate (`float_to_int16`, on its own thread) and leaves the others' floats alone."""
    import multiprocessing

    from service.audio.encoding import float_to_int16
    from service.engine.output import run_all
    from service.engine.proc import _Outbox, _recv, _RemoteSink
    from service.engine.state import ChunkResult, ReadCursor

    here, there = multiprocessing.Pipe()
    outbox = _Outbox(there)
    samples = np.linspace(-1.2, 1.2, 1001, dtype=np.float32)
    chunk = ChunkResult(samples, 0, [], "fp32", False, False)
    # A step's chunk carries the guard's PCM: that crosses as it is (here made different on purpose).
    stepped = ChunkResult(samples, 1, [], "fp16", True, False, pcm16=np.arange(1001).astype(np.int16))
    pcm16, floats = _RemoteSink(1, ReadCursor(), 22050, pcm16=True), _RemoteSink(2, ReadCursor(), 22050)
    outbox.call_soon_threadsafe(run_all, [(pcm16, "on_chunk", (chunk,)), (floats, "on_chunk", (chunk,)),
                                          (pcm16, "on_chunk", (stepped,)), (floats, "on_chunk", (stepped,))])
    kind, out, _ = _recv(here)
    outbox.close()
    assert kind == "out" and [(sid, method) for sid, method, _ in out] == [(1, "on_chunk"), (2, "on_chunk")] * 2
    converted, untouched = out[0][2][0].samples, out[1][2][0].samples
    assert converted.dtype == np.int16 and np.array_equal(converted, float_to_int16(samples))
    assert untouched.dtype == np.float32 and np.array_equal(untouched, samples)
    assert np.array_equal(out[2][2][0].samples, stepped.pcm16) and np.array_equal(out[3][2][0].samples, samples)
    assert [(c.utterance, c.precision, c.fallback, c.pcm16) for _, _, (c,) in out] == [
        (0, "fp32", False, None)] * 2 + [(1, "fp16", True, None)] * 2  # the PCM crosses once, as the samples
    assert chunk.samples is samples and pcm16.cursor.delivered_s == floats.cursor.delivered_s == 2 * 1001 / 22050


def test_core_wakes_when_a_read_frees_a_session_it_holds_back() -> None:
    """Backpressure is decided by the core's count of what it delivered. Audio still in the pipe
    is delivered for the core but not yet for the server, so a client that keeps up with a slow
    pipe never looks held back on the server's side: the core must wake itself when a read
    brings a session it holds back (`max_ahead_s` unread) under the limit, and only then."""
    import multiprocessing

    from service.engine.proc import _Outbox
    from service.engine.state import ReadCursor

    _here, there = multiprocessing.Pipe()
    outbox = _Outbox(there)
    try:
        held, ahead = ReadCursor(delivered_s=3.2), ReadCursor(delivered_s=1.0)
        outbox.cursors.update({1: held, 2: ahead})
        assert not outbox.take_reads({2: 0.5}, limit_s=3.0)  # not held back: nothing to wake
        assert not outbox.take_reads({1: 0.1}, limit_s=3.0)  # still 3.1 s unread
        assert held.read_s == 0.1 and ahead.read_s == 0.5
        assert outbox.take_reads({1: 0.7, 99: 1.0}, limit_s=3.0)  # under the limit now; 99 is gone
        assert not outbox.take_reads({1: 1.0}, limit_s=3.0)  # was not held back any more
    finally:
        outbox.close()


def test_a_large_flush_crosses_the_pipe_as_several_messages_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush with more audio than one pipe message may carry goes as several, each holding at
    most about `MAX_MESSAGE_AUDIO_BYTES` of samples (pickling one holds the GIL throughout): the
    same deliveries in the same order, the telemetry once, with the last."""
    import multiprocessing

    from service.engine.output import run_all
    from service.engine.proc import _Outbox, _recv, _RemoteSink
    from service.engine.state import ChunkResult, ReadCursor

    monkeypatch.setattr(_Outbox, "MAX_MESSAGE_AUDIO_BYTES", 10_000)
    here, there = multiprocessing.Pipe()
    outbox = _Outbox(there)
    try:
        floats, pcm16 = _RemoteSink(1, ReadCursor(), 22050), _RemoteSink(2, ReadCursor(), 22050, pcm16=True)
        chunks = [ChunkResult(np.full(1000, i / 10, dtype=np.float32), 0, [], "fp32", False, False) for i in range(9)]
        calls = [((floats, pcm16)[i % 2], "on_chunk", (c,)) for i, c in enumerate(chunks)]
        calls.append((floats, "on_done", ()))
        outbox.record("decoder_step", ("x",))
        outbox.call_soon_threadsafe(run_all, calls)
        messages = [_recv(here)]
        while not messages[-1][2]:  # the telemetry comes with the last part
            messages.append(_recv(here))
    finally:
        outbox.close()
    assert len(messages) > 1 and all(kind == "out" for kind, _, _ in messages)
    assert [t for _, _, t in messages] == [[]] * (len(messages) - 1) + [[("decoder_step", ("x",))]]
    for _, out, _ in messages[:-1]:  # 4 bytes a float sample, 2 an int16 one
        sent = sum(args[0].samples.nbytes for _, method, args in out if method == "on_chunk")
        assert 10_000 <= sent < 10_000 + 4_000
    delivered = [item for _, out, _ in messages for item in out]
    assert [(sid, method) for sid, method, _ in delivered] == [(1 + i % 2, "on_chunk") for i in range(9)] + [
        (1, "on_done")]
    for i, (_, _, (chunk,)) in enumerate(delivered[:9]):
        assert chunk.samples.dtype == (np.int16 if i % 2 else np.float32)
        assert np.allclose(chunk.samples.astype(np.float64) / (32767 if i % 2 else 1), i / 10, atol=1e-4)


def test_a_busy_loop_turn_reaches_the_core_in_order_across_several_messages(
        proc_harness: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sends one loop turn's session messages as pipe messages of at most `MAX_BATCH`
    (the core unpickles each while holding the GIL); split, they still arrive whole and in order:
    sessions opened and fed in one turn get the audio they get one at a time."""
    monkeypatch.setattr(ProcessHost, "MAX_BATCH", 2)
    texts = ["One short sentence.", "Another one, a bit longer than the first.", "A third."]

    async def together() -> list[bytes]:
        sessions = [await proc_harness.engine.open_session(SessionConfig(seed=20 + i, encoding=FLOAT))
                    for i in range(len(texts))]
        results = await asyncio.gather(*(drive(s, [t]) for s, t in zip(sessions, texts, strict=True)))
        return [audio for audio, _, _ in results]

    split = proc_harness.run(together())
    monkeypatch.setattr(ProcessHost, "MAX_BATCH", 64)
    alone = [proc_harness.run(_collect(proc_harness, SessionConfig(seed=20 + i, encoding=FLOAT), t))[0]
             for i, t in enumerate(texts)]
    for a, b in zip(split, alone, strict=True):
        x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
        assert len(x) == len(y) and np.allclose(x, y, atol=1e-4)  # batched with others: kernel rounding only


def test_whoever_sends_never_waits_for_a_full_pipe() -> None:
    """The server's event loop and the core's output stage hand messages to a writer thread: a
    pipe whose reader is slow (here: not reading at all) holds far less than a burst sends, and
    waiting on it would stop every stream. Once read, everything arrives whole and in order."""
    import multiprocessing

    from service.engine.proc import _PipeWriter, _recv

    ours, theirs = multiprocessing.Pipe()
    writer = _PipeWriter(ours, "test-writer")
    messages = [("batch", [("text", i, "x" * 100_000)]) for i in range(50)]  # 5 MB
    start = time.monotonic()
    for m in messages:
        writer.put(m)
    assert time.monotonic() - start < 0.5  # nothing was read yet
    assert [_recv(theirs) for _ in messages] == messages
    writer.close()
    assert not writer._thread.is_alive()


def test_a_core_slow_to_read_never_stops_the_server_s_event_loop() -> None:
    """With the core's process stopped (SIGSTOP: nothing reads its pipe), the server's event
    loop goes on posting; the core takes it all in once it runs again, and sessions work."""
    import os
    import signal
    import threading

    h = EngineHarness(tiny_engine_config(core="process"))
    host = h.engine.host
    assert isinstance(host, ProcessHost) and host._proc is not None and host._proc.pid is not None
    pid = host._proc.pid
    resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
    try:
        os.kill(pid, signal.SIGSTOP)
        resume.start()

        async def flood() -> float:
            worst = 0.0
            for _ in range(50):  # 5 MB: far more than the pipe holds
                t = time.monotonic()
                host.submit_text(10**9, "x" * 100_000)  # no such session: the core drops it
                await asyncio.sleep(0)  # the loop turn ends: its messages go out
                worst = max(worst, time.monotonic() - t)
            return worst

        worst = h.run(flood())
        resume.join()
        assert worst < 1.0
        audio, _, summary = h.run(_collect(h, SessionConfig(seed=3, encoding=FLOAT), TEXT))
        assert len(audio) > 0 and summary.utterances == 2
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
        h.close()


def test_the_server_is_ready_only_once_the_core_has_settled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`start` returns (and the server says SERVING) after the core's full collection at
    settle, not while it runs: the first sessions would otherwise wait for it."""
    import json

    h = EngineHarness(tiny_engine_config(core="process", timeline_dir=tmp_path))
    ready = time.monotonic()
    try:
        h.run(_collect(h, SessionConfig(seed=3, encoding=FLOAT), "One sentence."))  # a period: the core writes
    finally:
        h.close()
    events = [json.loads(line) for p in tmp_path.glob("core-*.jsonl") for line in p.read_text().splitlines()]
    full = [e for e in events if e["k"] == "gc" and e["generation"] == 2 and e["s"] < ready]
    assert full  # the settle's collection
    assert all(e["t"] <= ready for e in full)


# --- failures of the pipe and of the core (issue 33 item 8, issue 39 item 4) ---------------------


def test_a_session_message_that_cannot_be_pickled_fails_that_session_only(proc_harness: EngineHarness) -> None:
    """A message the server's writer cannot pickle fails the session it belongs to, with an error
    that says so; the others in the same pipe message, and the writer, carry on."""
    import threading

    engine, host = proc_harness.engine, proc_harness.engine.host
    assert isinstance(host, ProcessHost)

    async def events(session) -> list[object]:  # type: ignore[no-untyped-def]
        return [e async for e in session.events()]

    async def run() -> None:
        bad = await engine.open_session(SessionConfig(seed=30, encoding=FLOAT))
        good = await engine.open_session(SessionConfig(seed=31, encoding=FLOAT))
        host.submit_text(bad.id, threading.Lock())  # type: ignore[arg-type]  # pickle refuses a lock
        good.push_text(TEXT)  # in the same loop turn: the same pipe message
        good.end_input()
        with pytest.raises(RuntimeError, match="could not be sent to the engine process"):
            await asyncio.wait_for(events(bad), 30)
        assert isinstance((await asyncio.wait_for(events(good), 30))[-1], SessionSummary)

    proc_harness.run(run())
    assert not host.dead.is_set()
    audio, _, summary = proc_harness.run(_collect(proc_harness, SessionConfig(seed=32, encoding=FLOAT), TEXT))
    assert len(audio) > 0 and summary.utterances == 2


def test_a_delivery_the_core_cannot_send_fails_its_session_only() -> None:
    """The core's outbox: a chunk its writer cannot convert (`_Flush.wire`) or pickle fails that
    session (an error for the server, and the core is told to drop it); the other sessions'
    deliveries of the same flush arrive, and the writer carries on."""
    import multiprocessing
    import threading

    from service.engine.output import run_all
    from service.engine.proc import _Outbox, _recv, _RemoteSink
    from service.engine.state import ChunkResult, ReadCursor

    here, there = multiprocessing.Pipe()
    outbox = _Outbox(there)
    lost: list[int] = []
    outbox.lost = lost.append
    try:
        good, unconvertible, unpicklable = (_RemoteSink(1, ReadCursor(), 22050),
                                            _RemoteSink(2, ReadCursor(), 22050, pcm16=True),
                                            _RemoteSink(3, ReadCursor(), 22050))
        outbox.cursors.update({s.session_id: s.cursor for s in (good, unconvertible, unpicklable)})
        chunk = ChunkResult(np.zeros(100, np.float32), 0, [], "fp32", False, False)
        strings = ChunkResult(np.array(["x"] * 100), 0, [], "fp32", False, False)  # float_to_int16 refuses these
        locked = ChunkResult(np.zeros(100, np.float32), 0, [("word", 0, threading.Lock())], "fp32", False, False)  # type: ignore[list-item]
        outbox.call_soon_threadsafe(run_all, [(good, "on_chunk", (chunk,)), (unconvertible, "on_chunk", (strings,)),
                                              (unpicklable, "on_chunk", (locked,)), (unpicklable, "on_done", ()),
                                              (good, "on_chunk", (chunk,))])
        assert here.poll(10), "nothing came: the writer died"
        kind, out, _ = _recv(here)
        assert kind == "out"
        assert [(sid, method) for sid, method, _ in out] == [(1, "on_chunk"), (2, "on_error"), (3, "on_error"),
                                                             (1, "on_chunk")]
        for _, _, (error,) in out[1:3]:
            assert isinstance(error, RuntimeError) and "could not be sent to the API server" in str(error)
        assert np.array_equal(out[0][2][0].samples, chunk.samples)
        assert lost == [2, 3] and set(outbox.cursors) == {1}
        outbox.send("settled")
        assert here.poll(10) and _recv(here) == ("settled",)
    finally:
        outbox.close()


def test_a_pipe_the_server_cannot_write_to_fails_every_session_and_marks_the_core_dead() -> None:
    """When the server's end of the pipe is unusable (here closed while the core is stopped, so
    only the writer can notice), every open session ends with an error and the core counts as
    dead; nothing waits for ever."""
    import os
    import signal


    h = EngineHarness(tiny_engine_config(core="process"))
    host = h.engine.host
    assert isinstance(host, ProcessHost) and host._proc is not None and host._proc.pid is not None
    pid = host._proc.pid

    async def events(session) -> list[object]:  # type: ignore[no-untyped-def]
        return [e async for e in session.events()]

    async def run() -> None:
        sessions = [await h.engine.open_session(SessionConfig(seed=40 + i, encoding=FLOAT)) for i in range(2)]
        os.kill(pid, signal.SIGSTOP)  # the relay hears nothing more
        await asyncio.sleep(0.5)  # and has read what was on its way: it waits for the next message
        assert host._conn is not None
        host._conn.close()
        sessions[0].push_text(TEXT)  # the next write fails
        for session in sessions:
            with pytest.raises(Unavailable, match="reconnect"):
                await asyncio.wait_for(events(session), 10)

    try:
        h.run(run())
        assert host.dead.is_set()
    finally:
        os.kill(pid, signal.SIGKILL)
        h.close()


def test_a_voice_load_the_core_never_answers_fails_with_a_timeout_naming_it(proc_harness: EngineHarness,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`ProcessHost.load` waits a bounded time (`CoreWaits.load_s`) for the core's reply, then
    fails with an error that names the voice and the wait."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from service.engine.proc import CoreWaits
    from service.voices import list_voices
    from tests.engine.conftest import DATA

    host = proc_harness.engine.host
    assert isinstance(host, ProcessHost) and host._proc is not None and host._proc.pid is not None
    monkeypatch.setattr(host, "waits", CoreWaits(load_s=1.0))
    info = next(v for v in list_voices(DATA) if v.name == "tiny-multi")
    pool = ThreadPoolExecutor(1)
    os.kill(host._proc.pid, signal.SIGSTOP)  # the core answers nothing
    try:
        loading = pool.submit(host.load, info)
        with pytest.raises(Unavailable, match=r"voice tiny-multi .*within 1 s"):
            loading.result(timeout=15)
    finally:
        os.kill(host._proc.pid, signal.SIGCONT)
        pool.shutdown()
    assert not host.dead.is_set()
    assert host.load(info).name == "tiny-multi"  # the core answers again


def test_a_core_that_never_says_ready_fails_the_start_with_a_timeout() -> None:
    """The start waits a bounded time (`CoreWaits.start_s`) for the core's "ready", then stops
    the core's process and fails with an error naming what it waited for."""
    from service.engine.frontend_pool import FrontendPoolConfig
    from service.engine.proc import CoreWaits
    from service.telemetry import Telemetry
    from service.voices import list_voices
    from tests.engine.conftest import DATA

    config = tiny_engine_config(core="process")
    host = ProcessHost(config, "cpu", "torch", Telemetry(), lambda voice: None, waits=CoreWaits(start_s=0.2))
    preload = [v for v in list_voices(DATA) if v.name == "tiny-multi"]
    with pytest.raises(TimeoutError, match=r"ready.*within 0.2 s.*tiny-multi"):
        host.start(FrontendPoolConfig(), preload)
    assert host._proc is not None and not host._proc.is_alive()
