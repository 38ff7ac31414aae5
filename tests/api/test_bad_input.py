"""Bad input on every API of the real server: each case gets its own clean status, never a Python
class name or traceback, and a healthy native session running beside them all is unharmed."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import riva.client.proto.riva_tts_pb2 as rtts
import riva.client.proto.riva_tts_pb2_grpc as rtts_grpc
from riva.client.proto.riva_audio_pb2 import AudioEncoding as RivaEncoding

from service.api import google_tts as g
from service.api.errors import INTERNAL_ERRORS, InternalErrorLog
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.config import BatchConfig, EngineConfig, Limits
from tests.api.compat_server import DATA
from tests.api.native_server import ServerThread

TIMEOUT_S = 60.0
LEAKS = ("<class", "Traceback", "Error:", "Exception", "File \"")
LONG = "x" * 10_000
NATIVE = "/cadenza.v1.TextToSpeech/"
RIVA = "/nvidia.riva.tts.RivaSpeechSynthesis/"
GOOGLE = "/google.cloud.texttospeech.v1.TextToSpeech/"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    s = ServerThread(ServerConfig(
        host="127.0.0.1", port=0, drain_grace_s=2.0,
        engine=EngineConfig(limits=Limits(max_sessions=64, idle_timeout_s=30.0),
                            voice="tiny-multi", voices_dir=DATA, backend="torch", device="cpu", threads=1,
                            batch=BatchConfig(), cache_bytes=0),
    ))
    yield s
    s.close()


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(server.addr)
    yield ch
    ch.close()


# --- the healthy session that runs beside every case ----------------------------------------


@dataclass
class Healthy:
    """A native stream fed a sentence every 0.2 s until `stop` is set, read to its end."""

    stop: threading.Event
    thread: threading.Thread
    sent_chars: int = 0
    chunks: list[Any] | None = None
    summary: Any = None
    error: BaseException | None = None


SENTENCE = "The healthy session keeps talking while the others fail. "


@pytest.fixture(scope="module")
def healthy(channel: grpc.Channel) -> Iterator[Healthy]:
    stub = pb_grpc.TextToSpeechStub(channel)
    stop = threading.Event()
    state = Healthy(stop, threading.Thread())

    def requests() -> Iterator[pb.StreamingSynthesizeRequest]:
        yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=5, speaker="bob"))
        deadline = time.monotonic() + 240
        while not stop.is_set() and time.monotonic() < deadline:
            state.sent_chars += len(SENTENCE)
            yield pb.StreamingSynthesizeRequest(text=SENTENCE)
            stop.wait(0.2)
        yield pb.StreamingSynthesizeRequest(end_input=True)

    def run() -> None:
        chunks = []
        try:
            for response in stub.StreamingSynthesize(requests(), timeout=300):
                if response.WhichOneof("response") == "audio":
                    chunks.append(response.audio)
                elif response.WhichOneof("response") == "summary":
                    state.summary = response.summary
        except BaseException as exc:  # reported by the final test
            state.error = exc
        state.chunks = chunks

    state.thread = threading.Thread(target=run, daemon=True)
    state.thread.start()
    yield state
    stop.set()
    state.thread.join(120)


# --- the cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[grpc.Channel], Any]
    code: grpc.StatusCode
    needle: str = ""  # must appear in the status message


def _native_unary(text: str = "Hello there.", **config: Any) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        request = pb.SynthesizeRequest(config=pb.SessionConfig(**config), text=text)
        return list(pb_grpc.TextToSpeechStub(ch).Synthesize(request, timeout=TIMEOUT_S))
    return call


def _native_stream(*messages: pb.StreamingSynthesizeRequest) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        return list(pb_grpc.TextToSpeechStub(ch).StreamingSynthesize(iter(messages), timeout=TIMEOUT_S))
    return call


N = pb.StreamingSynthesizeRequest
NCFG = N(config=pb.SessionConfig())


def _riva(text: str = "Hello there.", metadata: tuple[tuple[str, str], ...] = (), **fields: Any
          ) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        custom = fields.pop("custom_configuration", {})
        request = rtts.SynthesizeSpeechRequest(text=text, **fields)
        request.custom_configuration.update(custom)
        return rtts_grpc.RivaSpeechSynthesisStub(ch).Synthesize(request, timeout=TIMEOUT_S, metadata=metadata)
    return call


def _riva_online(*texts: str, **fields: Any) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        requests = [rtts.SynthesizeSpeechRequest(text=t, **fields) for t in texts]
        return list(rtts_grpc.RivaSpeechSynthesisStub(ch).SynthesizeOnline(iter(requests), timeout=TIMEOUT_S))
    return call


def _riva_config(model_name: str) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        request = rtts.RivaSynthesisConfigRequest(model_name=model_name)
        return rtts_grpc.RivaSpeechSynthesisStub(ch).GetRivaSynthesisConfig(request, timeout=TIMEOUT_S)
    return call


def _google(text: str | None = "Hello there.", pronunciations: tuple[tuple[str, int, str], ...] = (),
            voice: dict[str, Any] | None = None, audio: dict[str, Any] | None = None, ssml: str = "",
            ) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        request = g.SynthesizeSpeechRequest()
        if ssml:
            request.input.ssml = ssml
        else:
            request.input.text = text or ""
        for phrase, encoding, pronunciation in pronunciations:
            request.input.custom_pronunciations.pronunciations.add(
                phrase=phrase, phonetic_encoding=encoding, pronunciation=pronunciation)
        for key, value in (voice or {"language_code": "en-US"}).items():
            setattr(request.voice, key, value)
        for key, value in (audio or {}).items():
            setattr(request.audio_config, key, value)
        rpc = ch.unary_unary(GOOGLE + "SynthesizeSpeech",
                             request_serializer=g.SynthesizeSpeechRequest.SerializeToString,
                             response_deserializer=g.SynthesizeSpeechResponse.FromString)
        return rpc(request, timeout=TIMEOUT_S)
    return call


def _google_stream(*requests: Any) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        rpc = ch.stream_stream(GOOGLE + "StreamingSynthesize",
                               request_serializer=g.StreamingSynthesizeRequest.SerializeToString,
                               response_deserializer=g.StreamingSynthesizeResponse.FromString)
        return list(rpc(iter(requests), timeout=TIMEOUT_S))
    return call


def _gcfg(**voice: Any) -> Any:
    request = g.StreamingSynthesizeRequest()
    request.streaming_config.voice.language_code = "en-US"
    for key, value in voice.items():
        setattr(request.streaming_config.voice, key, value)
    return request


def _gtext(text: str) -> Any:
    request = g.StreamingSynthesizeRequest()
    request.input.text = text
    return request


def _gcfg_pronunciation(encoding: int) -> Any:
    request = _gcfg()
    request.streaming_config.custom_pronunciations.pronunciations.add(
        phrase="tomato", phonetic_encoding=encoding, pronunciation="təˈmeɪtoʊ")
    return request


def _gcfg_custom_voice() -> Any:
    request = _gcfg()
    request.streaming_config.voice.custom_voice.model = "projects/x/models/y"
    return request


def _ginput_markup() -> Any:
    request = g.StreamingSynthesizeRequest()
    request.input.markup = "Hello"
    return request


IA, NF, FP, OOR = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)
IPA = g._PhoneticEncoding.PHONETIC_ENCODING_IPA
X_SAMPA = g._PhoneticEncoding.PHONETIC_ENCODING_X_SAMPA

CASES = [
    # native cadenza.v1.TextToSpeech
    Case("native-speaker-superscript-two", _native_unary(speaker="²"), NF, "speaker"),
    Case("native-speaker-arabic-digit", _native_unary(speaker="٣"), NF, "speaker"),
    Case("native-speaker-5000-digits", _native_unary(speaker="9" * 5000), NF, "speaker"),
    Case("native-empty-text", _native_unary(""), IA, "text is empty"),
    Case("native-whitespace-text", _native_unary(" \t\n "), IA, "text is empty"),
    Case("native-nul-in-text", _native_unary("Hello\x00there."), IA, "NUL"),
    Case("native-long-language", _native_unary(language=LONG), NF, "10000 characters"),
    Case("native-long-voice", _native_unary(voice=LONG), NF, "10000 characters"),
    Case("native-negative-rate", _native_unary(sample_rate_hz=-1), IA, "config.sample_rate"),
    Case("native-nan-speaking-rate", _native_unary(speaking_rate=float("nan")), IA, "config.speaking_rate"),
    Case("native-inf-noise", _native_unary(options={"noise_scale": float("inf")}), IA, "config.options"),
    Case("native-unknown-option", _native_unary(options={"temperature": 0.5}), IA, "config.options"),
    Case("native-huge-chunk", _native_unary(first_chunk_frames=100_000), IA, "config.first_chunk_frames"),
    Case("native-unknown-encoding", _native_unary(encoding=17), IA, "config.encoding"),
    Case("native-empty-dictionary-word", _native_unary(custom_dictionary={" ": "x"}), IA, "custom_dictionary"),
    Case("native-nul-in-dictionary", _native_unary(custom_dictionary={"a\x00": "b"}), IA, "NUL"),
    Case("native-stream-text-after-end", _native_stream(NCFG, N(text="Hi."), N(end_input=True), N(text="More.")),
         FP, "after end_input"),
    Case("native-stream-flush-after-end", _native_stream(NCFG, N(text="Hi."), N(end_input=True), N(flush=True)),
         FP, "after end_input"),
    Case("native-stream-no-config", _native_stream(N(text="Hi.")), IA, "config"),
    Case("native-stream-config-twice", _native_stream(NCFG, NCFG), IA, "twice"),
    Case("native-stream-empty-message", _native_stream(NCFG, N()), IA, "empty message"),
    Case("native-stream-nul", _native_stream(NCFG, N(text="a\x00b"), N(end_input=True)), IA, "NUL"),
    Case("native-stream-speaker-superscript", _native_stream(N(config=pb.SessionConfig(speaker="²"))), NF,
         "speaker"),
    # hostile values: amplification and huge or odd numbers (never INTERNAL)
    Case("native-dictionary-bomb", _native_unary("boom boom", custom_dictionary={"boom": "[AA1]" * 5000}), IA,
         "at most 200"),
    Case("native-dictionary-100k-value", _native_unary(custom_dictionary={"boom": "a" * 100_000}), IA,
         "at most 200"),
    Case("native-dictionary-too-many", _native_unary(custom_dictionary={f"w{i}": "[AA1]" for i in range(1001)}),
         IA, "at most 1000"),
    Case("native-stream-dictionary-bomb", _native_stream(
        N(config=pb.SessionConfig(custom_dictionary={"boom": "[AA1]" * 5000})), N(text="boom boom"),
        N(end_input=True)), IA, "at most 200"),
    Case("native-stream-phoneme-budget", _native_stream(
        N(config=pb.SessionConfig(custom_dictionary={"boom": "[AA1]" * 40})), N(text="boom " * 5000),
        N(end_input=True)), grpc.StatusCode.RESOURCE_EXHAUSTED, "phonemes"),
    Case("native-speaker-minus-one", _native_unary(speaker="-1"), NF, "speaker"),
    Case("native-speaker-11-digits", _native_unary(speaker="99999999999"), NF, "speaker"),
    Case("native-sample-rate-1", _native_unary(sample_rate_hz=1), IA, "config.sample_rate"),
    Case("native-sample-rate-int32-max", _native_unary(sample_rate_hz=2**31 - 1), IA, "config.sample_rate"),
    Case("native-noise-w-1e6", _native_unary(options={"noise_w": 1e6}), IA, "config.options"),
    Case("native-language-100k", _native_unary(language="x" * 100_000), NF, "100000 characters"),
    Case("native-text-3-5-mb", _native_unary("word " * 700_000), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "characters"),
    Case("native-stream-sample-rate-int32-max", _native_stream(N(config=pb.SessionConfig(
        sample_rate_hz=2**31 - 1)), *[N(text="More text. ")] * 20, N(end_input=True)), IA, "config.sample_rate"),
    Case("riva-dictionary-bomb", _riva("boom", custom_dictionary="boom  " + "AA1 " * 5000), IA, "at most 200"),
    Case("google-pronunciation-bomb", _google("boom", pronunciations=(("boom", IPA, "ə" * 5000),)), IA,
         "at most 200"),
    # NVIDIA Riva
    Case("riva-voice-superscript-two", _riva(voice_name="tiny-multi.²"), NF, "voice_name"),
    Case("riva-voice-unknown-speaker-index", _riva(voice_name="tiny-multi.7"), NF, "voice_name"),
    Case("riva-long-voice", _riva(voice_name=LONG), NF, "10000 characters"),
    Case("riva-empty-text", _riva(""), IA, "text is empty"),
    Case("riva-whitespace-text", _riva("   "), IA, "text is empty"),
    Case("riva-nul-in-text", _riva("Hi\x00"), IA, "NUL"),
    Case("riva-flac", _riva(encoding=RivaEncoding.FLAC), IA, "LINEAR_PCM"),
    Case("riva-rate-not-a-number", _riva(custom_configuration={"speaking_rate": "fast"}), IA, "speaking_rate"),
    Case("riva-long-custom-key", _riva(custom_configuration={LONG: "1"}), IA, "10000 characters"),
    Case("riva-seed-superscript", _riva(custom_configuration={"seed": "²"}), IA, "seed"),
    Case("riva-bad-dictionary", _riva(custom_dictionary="lonely"), IA, "custom_dictionary"),
    Case("riva-long-language", _riva(language_code=LONG), NF, "10000 characters"),
    Case("riva-sample-rate-huge", _riva(sample_rate_hz=10**9), IA, "sample_rate_hz"),
    Case("riva-seed-header", _riva(metadata=(("x-cadenza-seed", "abc"),)), IA, "x-cadenza-seed"),
    Case("riva-too-long-for-unary", _riva("Words and more words. " * 4100), OOR, "SynthesizeOnline"),
    Case("riva-too-long-at-8k", _riva("Words. " * 800, sample_rate_hz=8000, encoding=RivaEncoding.LINEAR_PCM,
                                      custom_configuration={"speaking_rate": "0.25"}), OOR, "SynthesizeOnline"),
    Case("riva-online-voice-superscript", _riva_online("Hi.", voice_name="tiny-multi.²"), NF, "voice_name"),
    Case("riva-online-empty-text", _riva_online("Hi.", ""), IA, "text is empty"),
    Case("riva-config-long-model", _riva_config(LONG), NF, "10000 characters"),
    # Google Cloud TTS
    Case("google-unknown-phonetic-encoding", _google(pronunciations=(("tomato", 99, "təˈmeɪtoʊ"),)), IA,
         "input.custom_pronunciations.pronunciations[0].phonetic_encoding"),
    Case("google-x-sampa", _google(pronunciations=(("a", IPA, "ə"), ("tomato", X_SAMPA, "t@"))), IA,
         "pronunciations[1].phonetic_encoding"),
    Case("google-empty-pronunciation", _google(pronunciations=(("tomato", IPA, ""),)), IA,
         "input.custom_pronunciations"),
    Case("google-empty-text", _google(""), IA, "text is empty"),
    Case("google-whitespace-text", _google("\n\n"), IA, "input.text"),
    Case("google-nul-in-text", _google("a\x00b"), IA, "input.text"),
    Case("google-ssml", _google(ssml="<speak>Hi</speak>"), IA, "input.ssml"),
    Case("google-long-voice-name", _google(voice={"name": LONG}), NF, "10000 characters"),
    Case("google-long-language", _google(voice={"language_code": LONG}), NF, "10000 characters"),
    Case("google-speaking-rate", _google(audio={"speaking_rate": 10.0}), IA, "audio_config.speaking_rate"),
    Case("google-pitch", _google(audio={"pitch": 3.0}), IA, "audio_config.pitch"),
    Case("google-mp3", _google(audio={"audio_encoding": g._GoogleEncoding.MP3}), IA, "audio_encoding"),
    Case("google-unknown-encoding", _google(audio={"audio_encoding": 999}), IA, "audio_encoding"),
    Case("google-sample-rate", _google(audio={"sample_rate_hertz": 100}), IA, "sample_rate_hertz"),
    Case("google-too-long-for-unary", _google("Words and more words. " * 4100), OOR, "StreamingSynthesize"),
    Case("google-stream-input-first", _google_stream(_gtext("Hi.")), IA, "streaming_config"),
    Case("google-stream-config-twice", _google_stream(_gcfg(), _gcfg()), IA, "streaming_config"),
    Case("google-stream-nul", _google_stream(_gcfg(), _gtext("a\x00b")), IA, "NUL"),
    Case("google-stream-unknown-phonetic-encoding", _google_stream(_gcfg_pronunciation(42)), IA,
         "custom_pronunciations.pronunciations[0].phonetic_encoding"),
    Case("google-stream-markup", _google_stream(_gcfg(), _ginput_markup()), IA, "input.markup"),
    Case("google-stream-custom-voice", _google_stream(_gcfg_custom_voice()), IA, "voice.custom_voice"),
    Case("google-stream-long-voice", _google_stream(_gcfg(name=LONG)), NF, "10000 characters"),
]


def _check_clean(err: grpc.RpcError, code: grpc.StatusCode, needle: str) -> str:
    details = err.details() or ""  # type: ignore[attr-defined]
    assert err.code() == code, f"{err.code()} {details!r}"  # type: ignore[attr-defined]
    assert needle in details, details
    for leak in LEAKS:
        assert leak not in details, details
    assert len(details) <= 1000 and LONG[:200] not in details, details
    return details


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_status(channel: grpc.Channel, healthy: Healthy, case: Case) -> None:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        case.call(channel)
    _check_clean(info.value, case.code, case.needle)
    if case.code == OOR:
        assert time.monotonic() - start < 5, "refused only after synthesising"


def test_at_least_sixty_cases_across_three_apis() -> None:
    assert len({c.name for c in CASES}) == len(CASES) >= 60
    assert {c.name.split("-")[0] for c in CASES} == {"native", "riva", "google"}


# --- corrupt protobuf bytes on every RPC ----------------------------------------------------------

RPCS = [  # path, request streaming, response streaming, a request with a string field ("zz" marks it; None: none)
    (NATIVE + "StreamingSynthesize", True, True, N(text="zz")),
    (NATIVE + "Synthesize", False, True, pb.SynthesizeRequest(text="zz")),
    (NATIVE + "ListVoices", False, False, None),
    (NATIVE + "GetServerInfo", False, False, None),
    (RIVA + "Synthesize", False, False, rtts.SynthesizeSpeechRequest(text="zz")),
    (RIVA + "SynthesizeOnline", True, True, rtts.SynthesizeSpeechRequest(text="zz")),
    (RIVA + "GetRivaSynthesisConfig", False, False, rtts.RivaSynthesisConfigRequest(model_name="zz")),
    (GOOGLE + "ListVoices", False, False, g.ListVoicesRequest(language_code="zz")),
    (GOOGLE + "SynthesizeSpeech", False, False, g.SynthesizeSpeechRequest(input={"text": "zz"})),
    (GOOGLE + "StreamingSynthesize", True, True, g.StreamingSynthesizeRequest(input={"text": "zz"})),
]
CORRUPT = {
    "truncated": b"\x0a\x09ab",  # a field 9 bytes long with 2 left
    "garbage": b"\xff\xff\xff\xff",  # a tag that never ends
    "bad-wire-type": b"\x0f\x00",  # wire type 7 does not exist
}


def _raw_call(channel: grpc.Channel, path: str, streaming_in: bool, streaming_out: bool,
              messages: list[bytes]) -> Any:
    """The RPC with bytes sent as they are (no serializer)."""
    if not streaming_in:
        if streaming_out:
            return list(channel.unary_stream(path)(messages[0], timeout=TIMEOUT_S))
        return channel.unary_unary(path)(messages[0], timeout=TIMEOUT_S)
    return list(channel.stream_stream(path)(iter(messages), timeout=TIMEOUT_S))


def _payloads() -> list[tuple[str, str, bool, bool, list[bytes], str]]:
    out = []
    for path, s_in, s_out, sample in RPCS:
        for kind, data in CORRUPT.items():
            out.append((f"{path}:{kind}", path, s_in, s_out, [data], "corrupt"))
        if sample is not None:
            bad = sample.SerializeToString().replace(b"zz", b"\xff\xfe")
            out.append((f"{path}:invalid-utf8", path, s_in, s_out, [bad], "UTF-8"))
    native_first = NCFG.SerializeToString()
    out.append(("native-stream-corrupt-second", NATIVE + "StreamingSynthesize", True, True,
                [native_first, CORRUPT["truncated"]], "corrupt"))
    google_first = _gcfg().SerializeToString()
    out.append(("google-stream-corrupt-second", GOOGLE + "StreamingSynthesize", True, True,
                [google_first, b"\x12\x02\xff\xfe"], "not a valid"))
    return out


PAYLOADS = _payloads()


@pytest.mark.parametrize("name, path, s_in, s_out, messages, needle", PAYLOADS, ids=[p[0] for p in PAYLOADS])
def test_corrupt_protobuf_is_invalid_argument(channel: grpc.Channel, healthy: Healthy, name: str, path: str,
                                              s_in: bool, s_out: bool, messages: list[bytes], needle: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, path, s_in, s_out, messages)
    details = _check_clean(info.value, IA, needle)
    assert re.match(r"the request is not a valid \w+ message \(", details), details
    assert "Traceback" not in caplog.text and "DecodeError" not in caplog.text


# --- internal errors --------------------------------------------------------------------------


def test_internal_error_has_an_id_logged_once(server: ServerThread, channel: grpc.Channel,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Any:
        raise RuntimeError("the test hook broke voices()")

    monkeypatch.setattr(server.server.engine, "voices", broken)
    stub = pb_grpc.TextToSpeechStub(channel)
    ids = []
    with caplog.at_level(logging.ERROR, logger="service.api.errors"):
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                stub.ListVoices(pb.ListVoicesRequest(), timeout=TIMEOUT_S)
            details = _check_clean(info.value, grpc.StatusCode.INTERNAL, "internal error")
            assert "test hook" not in details and "RuntimeError" not in details
            match = re.search(r"\b([0-9a-f]{8})\b", details)
            assert match, details
            ids.append(match.group(1))
    assert len(set(ids)) == 3
    text = caplog.text
    assert text.count(ids[0]) == 1 and "Traceback" in text and "test hook" in text
    assert ids[1] not in text and ids[2] not in text  # the same error again within a minute: counted only
    assert sum(r.exc_info is not None for r in caplog.records if r.name == "service.api.errors") == 1


def test_internal_error_log_rate_limit_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    errors = InternalErrorLog(window_s=60.0, clock=lambda: now[0])

    def fail() -> RuntimeError:
        try:
            raise RuntimeError("same place")
        except RuntimeError as exc:
            return exc

    with caplog.at_level(logging.ERROR, logger="service.api.errors"):
        first = errors.record("rpc", fail())
        hidden = [errors.record("rpc", fail()) for _ in range(5)]
        other = errors.record("rpc", ValueError("another kind"))  # another (type, place): logged
        now[0] = 61.0
        later = errors.record("rpc", fail())
    assert first in caplog.text and other in caplog.text and later in caplog.text
    assert not any(h in caplog.text for h in hidden)
    assert "5 more like it" in caplog.text
    assert INTERNAL_ERRORS.window_s == 60.0


# --- the healthy session ----------------------------------------------------------------------


def test_zz_the_healthy_session_was_complete(healthy: Healthy) -> None:
    """Runs last (by name within this module): the session beside all the cases delivered everything."""
    healthy.stop.set()
    healthy.thread.join(120)
    assert healthy.error is None, healthy.error
    summary, chunks = healthy.summary, healthy.chunks
    assert summary is not None and chunks
    assert summary.ttfa_seconds < 2.0, summary.ttfa_seconds  # its first audio came as usual
    assert summary.characters == healthy.sent_chars > len(SENTENCE)
    assert summary.chunks == len(chunks) and [c.seq for c in chunks] == list(range(len(chunks)))
    total_bytes = sum(len(c.audio) for c in chunks)
    total_samples = sum(c.num_samples for c in chunks)
    assert total_bytes == 2 * total_samples  # LINEAR16
    assert abs(total_samples / chunks[0].sample_rate_hz - summary.audio_seconds) < 1e-3
    offsets = [c.offset_samples for c in chunks]
    assert offsets == [sum(c.num_samples for c in chunks[:i]) for i in range(len(chunks))]


# --- a refused config while the client is still writing ---------------------------------------


def test_aio_client_writing_sees_the_refusal(server: ServerThread) -> None:
    """A grpc.aio client that queued its messages behind a bad config gets the server's status
    (NOT_FOUND for the speaker), not a client-side INTERNAL from its failed writes."""
    import asyncio

    async def one() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(server.addr) as ch:
            call = pb_grpc.TextToSpeechStub(ch).StreamingSynthesize(timeout=TIMEOUT_S)
            await call.write(N(config=pb.SessionConfig(speaker="99999999999")))
            for _ in range(20):
                await call.write(N(text="More text for a stream that was refused. "))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    assert "speaker" in (exc.details() or "")
                return exc.code()
            except Exception:  # a write after the status: the status is still the call's code
                pass
            return await call.code()

    async def runs() -> list[grpc.StatusCode]:
        return [await one() for _ in range(20)]

    codes = asyncio.run(runs())
    assert codes == [grpc.StatusCode.NOT_FOUND] * 20, codes
