"""End to end: the real grpc.aio server on a free port, driven through the generated stubs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.api.client import StreamResult, connect, stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.native_server import ServerThread

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day, and everyone was happy!"


def _config(limits: Limits | None = None) -> ServerConfig:
    return ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=limits or Limits(),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0),
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    s = ServerThread(_config(Limits(max_sessions=24, max_text_chars=2000, idle_timeout_s=1.0)))
    yield s
    s.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.TextToSpeechStub]:
    channel, s = connect(server.addr)
    yield s
    channel.close()


def _floats(result: StreamResult) -> np.ndarray:
    return np.frombuffer(result.audio, dtype=np.float32)


def _assert_serves(stub: pb_grpc.TextToSpeechStub) -> None:
    r = stream(stub, pb.SessionConfig(seed=1), ["Still here."], timeout=30)
    assert r.summary is not None and len(r.audio) > 0


def test_health_reflection_voices_info(server: ServerThread, stub: pb_grpc.TextToSpeechStub) -> None:
    channel = grpc.insecure_channel(server.addr)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="cadenza.v1.TextToSpeech")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "cadenza.v1.TextToSpeech" in {s.name for s in answer.list_services_response.service}
    channel.close()
    voices = stub.ListVoices(pb.ListVoicesRequest()).voices
    assert voices[0].name == "tiny-multi" and [s.name for s in voices[0].speakers] == ["alice", "bob", "carol"]
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.backend == "torch" and info.default_voice == "tiny-multi" and "grpcio" in info.versions


def test_tiny_deltas_give_the_same_audio(stub: pb_grpc.TextToSpeechStub) -> None:
    cfg = pb.SessionConfig(seed=11, encoding=pb.FLOAT32, word_timings=True, speaker="bob")
    whole = stream(stub, cfg, [TEXT], timeout=60)
    tiny = stream(stub, cfg, [TEXT[i : i + 3] for i in range(0, len(TEXT), 3)], timeout=60)
    assert whole.audio == tiny.audio and len(whole.audio) > 0
    assert [(w.word, w.start_sample) for w in whole.words] == [(w.word, w.start_sample) for w in tiny.words]
    assert whole.summary is not None and whole.summary.utterances == 2
    assert whole.summary.characters == len(TEXT) and whole.summary.ttfa_seconds > 0
    assert [c.seq for c in tiny.chunks] == list(range(len(tiny.chunks)))


def _settings(i: int) -> pb.SessionConfig:
    cfg = pb.SessionConfig(
        seed=200 + i, speaker=["alice", "bob", "carol"][i % 3], encoding=[pb.FLOAT32, pb.LINEAR16][i % 2],
        sample_rate_hz=[0, 8000, 24000, 16000][i % 4], speaking_rate=[1.0, 1.5, 0.7][i % 3],
    )
    return cfg


def test_twenty_concurrent_sessions_never_mix(stub: pb_grpc.TextToSpeechStub) -> None:
    alone = [stream(stub, _settings(i), [TEXT], timeout=60) for i in range(20)]
    results: list[StreamResult | None] = [None] * 20

    def run(i: int) -> None:
        results[i] = stream(stub, _settings(i), [TEXT[k : k + 7] for k in range(0, len(TEXT), 7)], timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        assert r is not None and r.summary is not None
        assert r.chunks[0].sample_rate_hz == (_settings(i).sample_rate_hz or 16000)
        if _settings(i).encoding == pb.FLOAT32:
            np.testing.assert_allclose(_floats(r), _floats(alone[i]), atol=1e-5, rtol=0)
        else:
            a = np.frombuffer(r.audio, np.int16).astype(int)
            b = np.frombuffer(alone[i].audio, np.int16).astype(int)
            assert a.shape == b.shape and np.abs(a - b).max() <= 1


def test_cancel_mid_stream_frees_the_session(server: ServerThread, stub: pb_grpc.TextToSpeechStub) -> None:
    def reqs() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=3))
        yield pb.StreamingSynthesizeRequest(text=TEXT * 10)
        time.sleep(30)  # keep the input open; the call is cancelled before this ends

    call = stub.StreamingSynthesize(reqs())
    first = next(call)
    assert first.WhichOneof("response") in ("audio", "words")
    assert server.server.engine.live_sessions == 1
    call.cancel()
    deadline = time.monotonic() + 5
    engine = server.server.engine
    while (engine.live_sessions or engine.engine_sessions) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.live_sessions == 0 and engine.engine_sessions == 0
    _assert_serves(stub)


def _bidi(stub: pb_grpc.TextToSpeechStub, messages: list[pb.StreamingSynthesizeRequest]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingSynthesize(iter(messages), timeout=30))
    return info.value  # type: ignore[return-value]


def test_voices_declare_their_family_and_options_and_sessions_take_them(stub: pb_grpc.TextToSpeechStub) -> None:
    """ListVoices says each voice's model family and the options a session may set (defaults
    from the voice's config, ranges from the family); `SessionConfig.options` (field 17) reaches
    the voice, and a name the voice does not take is refused naming the ones it does."""
    voice = stub.ListVoices(pb.ListVoicesRequest()).voices[0]
    assert voice.name == "tiny-multi" and voice.family == "vits"
    options = {o.name: o for o in voice.options}
    assert sorted(options) == ["noise_scale", "noise_w"]
    for name, default in [("noise_scale", 0.667), ("noise_w", 0.8)]:  # tests/data/tiny-multi.onnx.json
        o = options[name]
        assert o.default_value == pytest.approx(default) and (o.min_value, o.max_value) == (0.0, 2.0)
        assert o.description
    # both noise scales at 0: the seed no longer changes the audio; at the defaults it does
    quiet = {"noise_scale": 0.0, "noise_w": 0.0}
    a, b = (stream(stub, pb.SessionConfig(seed=seed, options=quiet), ["Options, please."], timeout=30)
            for seed in (1, 2))
    assert a.summary is not None and len(a.audio) > 0 and a.audio == b.audio
    c, d = (stream(stub, pb.SessionConfig(seed=seed), ["Options, please."], timeout=30) for seed in (1, 2))
    assert c.audio != d.audio
    for options, needles in [({"temperature": 0.5}, ("temperature", "noise_scale, noise_w")),
                             ({"noise_w": 2.5}, ("noise_w=2.5", "0..2"))]:
        config = pb.SessionConfig(options=options)
        err = _bidi(stub, [CFG(config=config), CFG(text="Hello.")])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.options" in err.details()
        assert all(n in err.details() for n in needles), err.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Synthesize(pb.SynthesizeRequest(config=config, text="Hello."), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    _assert_serves(stub)


CFG = pb.StreamingSynthesizeRequest
BAD_CONFIGS = [
    (pb.SessionConfig(voice="nobody"), grpc.StatusCode.NOT_FOUND, "nobody"),
    (pb.SessionConfig(speaker="zed"), grpc.StatusCode.NOT_FOUND, "zed"),
    (pb.SessionConfig(speaker="7"), grpc.StatusCode.NOT_FOUND, "speaker"),
    (pb.SessionConfig(sample_rate_hz=100), grpc.StatusCode.INVALID_ARGUMENT, "config.sample_rate"),
    (pb.SessionConfig(sample_rate_hz=96000), grpc.StatusCode.INVALID_ARGUMENT, "config.sample_rate"),
    (pb.SessionConfig(encoding=17), grpc.StatusCode.INVALID_ARGUMENT, "config.encoding"),  # type: ignore[arg-type]
    (pb.SessionConfig(speaking_rate=10.0), grpc.StatusCode.INVALID_ARGUMENT, "config.speaking_rate"),
    (pb.SessionConfig(speaking_rate=0.1), grpc.StatusCode.INVALID_ARGUMENT, "config.speaking_rate"),
    (pb.SessionConfig(precision=9), grpc.StatusCode.INVALID_ARGUMENT, "config.precision"),  # type: ignore[arg-type]
    (pb.SessionConfig(precision=pb.INT8), grpc.StatusCode.INVALID_ARGUMENT, "started with --int8"),
    (pb.SessionConfig(language="de"), grpc.StatusCode.NOT_FOUND, "de"),
]


@pytest.mark.parametrize("config, code, needle", BAD_CONFIGS)
def test_bad_config_gets_its_status(stub: pb_grpc.TextToSpeechStub, config: pb.SessionConfig,
                                    code: grpc.StatusCode, needle: str) -> None:
    err = _bidi(stub, [CFG(config=config), CFG(text="Hello.")])
    assert err.code() == code and needle in err.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Synthesize(pb.SynthesizeRequest(config=config, text="Hello."), timeout=30))
    assert info.value.code() == code  # type: ignore[attr-defined]
    _assert_serves(stub)


def test_protocol_errors(stub: pb_grpc.TextToSpeechStub) -> None:
    err = _bidi(stub, [CFG(text="Hello.")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "config" in err.details()
    err = _bidi(stub, [CFG(config=pb.SessionConfig()), CFG(text="Hi"), CFG(config=pb.SessionConfig())])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in err.details()
    err = _bidi(stub, [CFG(config=pb.SessionConfig()), CFG()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.details()
    err = _bidi(stub, [CFG(config=pb.SessionConfig()), CFG(text="x" * 2001)])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2000" in err.details()
    _assert_serves(stub)


def test_a_bad_message_fails_the_stream_before_its_queued_audio(stub: pb_grpc.TextToSpeechStub) -> None:
    """The request side's error ends the stream at once: the client does not first receive all
    the audio the session had queued (which would take as long to play as it is long)."""
    text = " ".join(f"Sentence number {k} is here to make a long stream of audio." for k in range(12))
    whole = stream(stub, pb.SessionConfig(seed=5), [text], timeout=60)
    assert whole.summary is not None
    full = whole.summary.audio_seconds

    def reqs() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield CFG(config=pb.SessionConfig(seed=5))
        yield CFG(text=text)
        yield CFG()  # empty: INVALID_ARGUMENT

    samples = 0
    with pytest.raises(grpc.RpcError) as info:
        for msg in stub.StreamingSynthesize(reqs(), timeout=30):
            if msg.WhichOneof("response") == "audio":
                samples += msg.audio.num_samples
                rate = msg.audio.sample_rate_hz
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert samples == 0 or samples / rate < 0.5 * full
    _assert_serves(stub)


def test_idle_stream_is_closed(stub: pb_grpc.TextToSpeechStub) -> None:
    def reqs() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield CFG(config=pb.SessionConfig())
        time.sleep(3)

    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamingSynthesize(reqs(), timeout=30))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    _assert_serves(stub)


def test_too_many_sessions_and_oversized_message() -> None:
    s = ServerThread(_config(Limits(max_sessions=1, max_message_bytes=64 * 1024)))
    try:
        channel, stub = connect(s.addr)

        def hold() -> Iterator[pb.StreamingSynthesizeRequest]:
            yield CFG(config=pb.SessionConfig())
            time.sleep(30)

        holder = stub.StreamingSynthesize(hold())
        deadline = time.monotonic() + 10
        while s.server.engine.live_sessions == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        err = _bidi(stub, [CFG(config=pb.SessionConfig()), CFG(text="Hello.")])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "sessions" in err.details()
        holder.cancel()
        while s.server.engine.live_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        err = _bidi(stub, [CFG(config=pb.SessionConfig()), CFG(text="y" * 100_000)])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        _assert_serves(stub)
        channel.close()
    finally:
        s.close()


def test_generated_code_does_not_drift(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos"), str(tmp_path)], check=True,
                   capture_output=True)
    committed = ROOT / "service" / "api" / "gen"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert fresh and fresh == sorted(p.relative_to(committed) for p in committed.rglob("*_pb2*"))
    for rel in fresh:
        assert (tmp_path / rel).read_text() == (committed / rel).read_text(), f"{rel} drifted: run scripts/gen_protos"
