"""Real syntheses through the real server, its telemetry read from in-memory OpenTelemetry
readers: metrics per session, the guard's fallback counter, spans and their links, logs."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.trace import SpanKind

from service.api.client import StreamResult, connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.engine.faults import inject_nonfinite
from service.engine.shadow import ShadowVerifier
from service.telemetry.logs import WITHHELD, JsonFormatter, allow_text
from tests.telemetry.conftest import (
    TIMEOUT_S,
    HeldStream,
    Observed,
    ObservedServer,
    eventually,
    observed,
    tiny_server_config,
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def stub(server: ObservedServer) -> Iterator[pb_grpc.TextToSpeechStub]:
    channel, s = connect(server.addr)
    yield s
    channel.close()


def _run(stub: pb_grpc.TextToSpeechStub, pieces: list[str], metadata: list[tuple[str, str]] | None = None,
         **config: Any) -> StreamResult:
    return stream(stub, pb.SessionConfig(**config), pieces, timeout=TIMEOUT_S, metadata=metadata)


def test_ttfa_recorded_once_per_session(stub: pb_grpc.TextToSpeechStub, seen: Observed) -> None:
    ttfa_before = seen.total("cadenza.session.time_to_first_audio")
    admitted_before = seen.total("cadenza.sessions.admitted")
    audio_before = seen.total("cadenza.audio.duration")
    results = [_run(stub, ["One sentence. ", "And a second one."], seed=1),
               _run(stub, ["Just one."], seed=2),
               _run(stub, ["Three, ", "in pieces. ", "Really."], seed=3)]
    assert all(r.summary is not None and r.summary.ttfa_seconds > 0 for r in results)
    eventually(lambda: seen.total("cadenza.session.time_to_first_audio") == ttfa_before + 3)
    assert seen.total("cadenza.sessions.admitted") == admitted_before + 3
    assert seen.total("cadenza.sessions.active") == 0
    audio = sum(r.summary.audio_seconds for r in results if r.summary is not None)
    assert seen.total("cadenza.audio.duration") - audio_before == pytest.approx(audio, rel=1e-3)
    # The histogram holds what the summaries report (one value per session).
    ttfa_sum = sum(p.sum for p in seen.points("cadenza.session.time_to_first_audio"))
    assert ttfa_sum >= sum(r.summary.ttfa_seconds for r in results if r.summary is not None) * 0.999
    steps = seen.points("cadenza.engine.step.duration")
    assert {p.attributes["stage"] for p in steps} == {"acoustic", "decoder"}
    assert seen.total("rpc.server.call.duration", **{"rpc.method": "cadenza.v1.TextToSpeech/StreamingSynthesize",
                                                    "rpc.response.status_code": "OK"}) >= 3


def test_first_audio_split_into_its_stages(stub: pb_grpc.TextToSpeechStub, seen: Observed) -> None:
    """Each session's first sentence records one time per stage, and together they fit inside
    its time to first audio (they start when the text reaches the engine, after the client sent it)."""
    name, stages = "cadenza.session.first_audio.stage", ("frontend", "acoustic_wait", "acoustic", "decoder_wait",
                                                          "decoder")

    def totals() -> tuple[list[float], float]:
        points = seen.points(name)
        return [seen.total(name, stage=st) for st in stages], sum(p.sum for p in points)

    counts_before, sum_before = totals()
    ttfa_before = sum(p.sum for p in seen.points("cadenza.session.time_to_first_audio"))
    results = [_run(stub, ["Where does the time go? ", "Second sentence."], seed=11), _run(stub, ["Once."], seed=None)]
    eventually(lambda: totals()[0] == [c + 2 for c in counts_before])
    assert all(r.summary is not None for r in results)
    spent = totals()[1] - sum_before
    ttfa = sum(p.sum for p in seen.points("cadenza.session.time_to_first_audio")) - ttfa_before
    assert 0 < spent <= ttfa
    assert seen.total(name, stage="acoustic") - counts_before[2] == 2
    assert sum(p.sum for p in seen.points(name) if p.attributes["stage"] == "acoustic") > 0


def test_active_sessions_and_refusals(stub: pb_grpc.TextToSpeechStub, seen: Observed) -> None:
    refused_before = seen.total("cadenza.sessions.rejected", reason="max_sessions")
    held = [HeldStream(stub) for _ in range(3)]  # the fixture's limit: 3 open sessions
    try:
        for h in held:
            assert h.first_audio.wait(TIMEOUT_S) and h.error is None
        assert seen.total("cadenza.sessions.active") == 3
        with pytest.raises(grpc.RpcError) as info:
            _run(stub, ["One too many."], seed=1)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert seen.total("cadenza.sessions.rejected", reason="max_sessions") == refused_before + 1
        eventually(lambda: seen.total("rpc.server.call.duration",
                                       **{"rpc.response.status_code": "RESOURCE_EXHAUSTED"}) >= 1)
    finally:
        for h in held:
            h.release()
    assert all(h.error is None for h in held)
    eventually(lambda: seen.total("cadenza.sessions.active") == 0)


def test_injected_nan_counts_each_tripped_chunk(server: ObservedServer, stub: pb_grpc.TextToSpeechStub,
                                                seen: Observed) -> None:
    backend = server.server.engine.host.runtimes.loaded["tiny-multi"].backend
    fallbacks_before = seen.total("cadenza.guard.fp32_fallbacks", **{"cadenza.voice": "tiny-multi"})
    trips_before = seen.total("cadenza.guard.trips", **{"cadenza.precision": "fp16"})
    seen.spans.clear()
    fault = inject_nonfinite(backend.model_for("fp16"), "dec.resblocks.0")  # every FP16 call
    try:
        result = _run(stub, ["Hello there, this sentence is long enough for several chunks of audio."],
                      seed=3, precision=pb.FP16, first_chunk_frames=4)
    finally:
        fault.remove()
    assert result.summary is not None and fault.fired >= 1
    tripped = result.summary.fallbacks
    assert tripped >= 1 and sum(c.fallback for c in result.chunks) == tripped
    assert seen.total("cadenza.guard.fp32_fallbacks", **{"cadenza.voice": "tiny-multi", "stage": "decoder"}) \
        == fallbacks_before + tripped
    assert seen.total("cadenza.guard.trips", **{"cadenza.precision": "fp16"}) == trips_before + tripped
    eventually(lambda: bool(seen.finished("cadenza.session")))
    session = seen.finished("cadenza.session")[-1]
    assert [e.name for e in session.events].count("fp32_fallback") == tripped
    assert session.attributes["cadenza.fallbacks"] == tripped


def test_spans_continue_the_callers_trace(stub: pb_grpc.TextToSpeechStub, seen: Observed) -> None:
    seen.spans.clear()
    result = _run(stub, ["First sentence here. ", "Second sentence there."],
                  metadata=[("traceparent", TRACEPARENT)], seed=5, encoding=pb.MULAW, sample_rate_hz=8000,
                  request_id="req-42")
    assert result.summary is not None and result.summary.utterances == 2
    rpc_name = "cadenza.v1.TextToSpeech/StreamingSynthesize"
    eventually(lambda: bool(seen.finished(rpc_name)) and len(seen.finished("cadenza.utterance")) == 2)
    (rpc,) = seen.finished(rpc_name)
    (session,) = seen.finished("cadenza.session")
    utterances = seen.finished("cadenza.utterance")
    # The caller's span -> the RPC's server span -> the session -> its utterances, one trace.
    assert rpc.kind is SpanKind.SERVER and rpc.parent is not None and rpc.parent.is_remote
    assert format(rpc.parent.span_id, "016x") == PARENT_ID
    assert format(rpc.context.trace_id, "032x") == TRACE_ID
    assert session.parent is not None and session.parent.span_id == rpc.context.span_id
    assert {u.parent.span_id for u in utterances if u.parent} == {session.context.span_id}
    assert {s.context.trace_id for s in (rpc, session, *utterances)} == {rpc.context.trace_id}
    assert sorted(u.attributes["cadenza.utterance.index"] for u in utterances) == [0, 1]
    assert all(u.start_time <= u.end_time and session.start_time <= u.start_time for u in utterances)
    attrs = session.attributes
    assert attrs["cadenza.voice"] == "tiny-multi" and attrs["cadenza.request_id"] == "req-42"
    assert attrs["cadenza.precision"] == "fp32" and attrs["cadenza.precision.reason"]
    assert attrs["cadenza.audio.encoding"] == "MULAW" and attrs["cadenza.audio.sample_rate"] == 8000
    assert attrs["cadenza.outcome"] == "ok" and attrs["cadenza.status"] == "OK"
    assert rpc.attributes["rpc.response.status_code"] == "OK"
    assert "first_audio" in [e.name for e in session.events]
    # Engine steps serve many sessions: each is its own span, linked to the sessions it served.
    for name in ("cadenza.engine.step", "cadenza.engine.acoustic"):
        linked = [s for s in seen.finished(name) if any(link.context.span_id == session.context.span_id
                                                         for link in s.links)]
        assert linked, name


def test_no_text_in_logs_unless_asked(stub: pb_grpc.TextToSpeechStub, caplog: pytest.LogCaptureFixture) -> None:
    secret = "Zebras juggle marmalade [QQ9] quietly."  # an unknown ARPAbet symbol: INVALID_ARGUMENT
    with caplog.at_level(logging.DEBUG):
        ok = _run(stub, ["Zebras juggle marmalade."], seed=1, request_id="req-logs")
        with pytest.raises(grpc.RpcError) as info:
            _run(stub, [secret], seed=1, request_id="req-bad")
    assert ok.summary is not None
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Zebras" in (info.value.details() or "")
    text = caplog.text
    assert "Zebras" not in text and "marmalade" not in text
    ends = [r.getMessage() for r in caplog.records if r.name == "service.sessions"]
    assert any("request_id=req-logs" in m and "outcome=ok status=OK" in m and "ttfa_ms=" in m for m in ends)
    assert any("request_id=req-bad" in m and "status=INVALID_ARGUMENT" in m for m in ends)
    failed = [r.getMessage() for r in caplog.records if r.name == "service.api.errors"]
    assert any("INVALID_ARGUMENT" in m and WITHHELD in m for m in failed)
    caplog.clear()
    allow_text(True)  # --log-text: the same error line quotes the text
    try:
        with caplog.at_level(logging.DEBUG), pytest.raises(grpc.RpcError):
            _run(stub, [secret], seed=1)
    finally:
        allow_text(False)
    assert "Zebras" in caplog.text


def test_json_session_line_carries_trace_and_span_ids(stub: pb_grpc.TextToSpeechStub, seen: Observed) -> None:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("service.sessions")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    seen.spans.clear()
    try:
        _run(stub, ["Jellyfish drift."], metadata=[("traceparent", TRACEPARENT)], seed=1, request_id="req-json")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    records = [json.loads(line) for line in buffer.getvalue().splitlines()]
    (record,) = [r for r in records if r.get("request_id") == "req-json"]
    eventually(lambda: bool(seen.finished("cadenza.session")))
    (session,) = seen.finished("cadenza.session")
    assert record["trace_id"] == TRACE_ID
    assert record["span_id"] == format(session.context.span_id, "016x")
    assert record["voice"] == "tiny-multi" and record["status"] == "OK" and record["ttfa_s"] > 0
    assert record["level"] == "INFO" and "Jellyfish" not in buffer.getvalue()


def test_shadow_psnr_exported_and_computed_on_the_engine_thread() -> None:
    """--shadow-fraction: FP16 chunks re-run in FP32 into the PSNR histogram, on the engine's
    own thread (a backend is not thread-safe), never on another."""
    seen = observed()
    server = ObservedServer(tiny_server_config(shadow_fraction=1.0), seen)
    channel, stub = connect(server.addr)
    try:
        engine = server.server.engine
        shadow = engine.host.shadow
        assert isinstance(shadow, ShadowVerifier)
        backend = engine.host.runtimes.loaded["tiny-multi"].backend
        threads: list[str] = []
        flow = backend.flow

        def recording_flow(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return flow(*args, **kwargs)

        backend.flow = recording_flow  # type: ignore[method-assign]
        result = _run(stub, ["Shadows measure the quality of every chunk."], seed=2, precision=pb.FP16)
        assert result.summary is not None
        eventually(lambda: shadow.pending == 0 and shadow.verified >= result.summary.chunks - 1)  # type: ignore[union-attr]
        assert threads and set(threads) == {"cadenza-engine"}
        points = seen.points("cadenza.shadow.psnr")
        assert sum(p.count for p in points) == shadow.verified
        assert points[0].attributes["cadenza.voice"] == "tiny-multi"
        assert points[0].min > 0
    finally:
        channel.close()
        server.close()


def test_session_line_has_the_status_the_call_ended_with(stub: pb_grpc.TextToSpeechStub, seen: Observed,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A call the servicer ends (text after end_input) logs its session with that status."""
    def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=1, request_id="req-late"))
        yield pb.StreamingSynthesizeRequest(text="A sentence long enough to still be speaking. " * 8)
        yield pb.StreamingSynthesizeRequest(end_input=True)
        yield pb.StreamingSynthesizeRequest(text="Too late.")

    seen.spans.clear()
    with caplog.at_level(logging.INFO, logger="service.sessions"), pytest.raises(grpc.RpcError) as info:
        for _ in stub.StreamingSynthesize(requests(), timeout=TIMEOUT_S):
            pass
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    eventually(lambda: any("request_id=req-late" in r.getMessage() for r in caplog.records))
    (line,) = [r.getMessage() for r in caplog.records if "request_id=req-late" in r.getMessage()]
    assert "outcome=error status=FAILED_PRECONDITION" in line
    eventually(lambda: bool(seen.finished("cadenza.session")))
    assert seen.finished("cadenza.session")[-1].attributes["cadenza.status"] == "FAILED_PRECONDITION"
