"""The native cadenza.v1 servicer: proto <-> domain translation only."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import AsyncIterator

import grpc

from service.api.compat import RequestReader, relay_events, speaker_value, unary_text
from service.api.errors import add_service, methods_of
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.audio.encoding import AudioEncoding
from service.engine.contract import (
    AudioOut,
    Engine,
    FailedPrecondition,
    Gender,
    InvalidArgument,
    Precision,
    Session,
    SessionConfig,
    SessionEvent,
    SessionSummary,
    VoiceDescription,
    VoicePrompt,
)

_ENCODINGS = {
    pb.AUDIO_ENCODING_UNSPECIFIED: AudioEncoding.LINEAR16,
    pb.LINEAR16: AudioEncoding.LINEAR16,
    pb.MULAW: AudioEncoding.MULAW,
    pb.ALAW: AudioEncoding.ALAW,
    pb.FLOAT32: AudioEncoding.FLOAT32,
}
_PRECISIONS = {
    pb.PRECISION_UNSPECIFIED: Precision.AUTO,
    pb.AUTO: Precision.AUTO,
    pb.FP16: Precision.FP16,
    pb.FP32: Precision.FP32,
    pb.INT8: Precision.INT8,
}
_PRECISION_OUT = {Precision.AUTO: pb.AUTO, Precision.FP16: pb.FP16, Precision.FP32: pb.FP32, Precision.INT8: pb.INT8}
_GENDERS = {Gender.FEMALE: pb.FEMALE, Gender.MALE: pb.MALE, Gender.UNSPECIFIED: pb.VOICE_GENDER_UNSPECIFIED}


def session_config(msg: pb.SessionConfig) -> SessionConfig:
    """Proto config -> domain config (0 / empty = default)."""
    if msg.encoding not in _ENCODINGS:
        raise InvalidArgument("config.encoding", f"unknown value {msg.encoding}; use LINEAR16, MULAW, ALAW or FLOAT32")
    if msg.precision not in _PRECISIONS:
        raise InvalidArgument("config.precision", f"unknown value {msg.precision}; use AUTO, FP16, FP32 or INT8")
    if msg.sample_rate_hz < 0:
        raise InvalidArgument("config.sample_rate_hz", f"{msg.sample_rate_hz} is negative (0 = the voice's rate)")
    for name in ("first_chunk_frames", "max_chunk_frames"):
        if getattr(msg, name) < 0:
            raise InvalidArgument(f"config.{name}", "must be >= 0 (0 = server default)")
    speaker = speaker_value(msg.speaker)
    rate = msg.speaking_rate if msg.speaking_rate != 0 else 1.0
    if not math.isfinite(rate):
        raise InvalidArgument("config.speaking_rate", f"{rate} is not a number")
    return SessionConfig(
        voice=msg.voice or None,
        speaker=speaker,
        language=msg.language or None,
        encoding=_ENCODINGS[msg.encoding],
        sample_rate=msg.sample_rate_hz or None,
        speaking_rate=rate,
        options=dict(msg.options) or None,
        seed=msg.seed if msg.HasField("seed") else None,
        precision=_PRECISIONS[msg.precision],
        first_chunk_frames=msg.first_chunk_frames or None,
        max_chunk_frames=msg.max_chunk_frames or None,
        custom_dictionary=dict(msg.custom_dictionary) or None,
        wav_header=msg.wav_header,
        word_timings=msg.word_timings,
        request_id=msg.request_id,
        voice_prompt=VoicePrompt(msg.voice_prompt.audio, msg.voice_prompt.transcript.strip() or None)
        if msg.HasField("voice_prompt") else None,
    )


def responses(event: SessionEvent) -> list[pb.StreamingSynthesizeResponse]:
    """Domain event -> response messages (word timings go right before their audio)."""
    if isinstance(event, SessionSummary):
        return [pb.StreamingSynthesizeResponse(summary=pb.SessionSummary(
            characters=event.characters, audio_seconds=event.audio_seconds,
            ttfa_seconds=event.ttfa_seconds or 0.0, fallbacks=event.fallbacks, utterances=event.utterances,
            chunks=event.chunks, cache_hits=event.cache_hits, precision=_PRECISION_OUT[event.precision],
            precision_reason=event.precision_reason,
        ))]
    out = []
    if event.words:
        out.append(pb.StreamingSynthesizeResponse(words=pb.WordTimings(words=[
            pb.WordTiming(word=w.word, start_sample=w.start, end_sample=w.end) for w in event.words
        ])))
    out.append(pb.StreamingSynthesizeResponse(audio=_chunk(event)))
    return out


def voice_message(v: VoiceDescription) -> pb.Voice:
    """A voice as ListVoices and GetServerInfo list it."""
    return pb.Voice(
        name=v.name, language=v.language, sample_rate_hz=v.sample_rate, loaded=v.loaded,
        speakers=[pb.Speaker(id=s.id, name=s.name) for s in v.speakers], family=v.family,
        options=[pb.VoiceOption(name=o.name, default_value=o.default, min_value=o.low, max_value=o.high,
                                description=o.help) for o in v.options],
        gender=_GENDERS[v.gender], voice_prompts=v.voice_prompts,
    )


def _chunk(a: AudioOut) -> dict[str, object]:
    """The AudioChunk's fields. Given as a mapping, the chunk is built inside the response; an
    AudioChunk message passed in would be copied into it, audio bytes and all (tens of times
    slower for a chunk of a few seconds, on the event loop of every stream)."""
    return dict(
        audio=a.audio, seq=a.seq, offset_samples=a.offset_samples, num_samples=a.num_samples,
        duration_seconds=a.num_samples / a.sample_rate, sample_rate_hz=a.sample_rate, utterance=a.utterance,
        precision=_PRECISION_OUT[a.precision], fallback=a.fallback,
    )


class NativeServicer(pb_grpc.TextToSpeechServicer):
    """Every RPC runs behind `service.api.errors.boundary` (see `add_native`): errors are raised, not caught."""

    def __init__(self, engine: Engine, idle_timeout_s: float) -> None:
        self.engine = engine
        self.idle_timeout_s = idle_timeout_s

    async def StreamingSynthesize(
        self, request_iterator: AsyncIterator[pb.StreamingSynthesizeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamingSynthesizeResponse]:
        requests = RequestReader(request_iterator, self.idle_timeout_s, hint="send end_input when the text is complete")
        session: Session | None = None
        reader: asyncio.Task[None] | None = None
        try:
            first = await requests.next()
            if first is None:
                return
            if first.WhichOneof("request") != "config":
                raise InvalidArgument("config", f"the first message must carry the session config, not "
                                      f"{first.WhichOneof('request') or 'nothing'}")
            session = requests.session = await self.engine.open_session(session_config(first.config))
            reader = asyncio.create_task(self._read(requests, session))
            async for event in relay_events(session, reader):
                for msg in responses(event):
                    yield msg
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            requests.close()
            if session is not None:
                session.cancel(sys.exc_info()[1])

    async def _read(self, requests: RequestReader[pb.StreamingSynthesizeRequest], session: Session) -> None:
        """Client messages -> session calls; a half-close without end_input ends the input too.
        After end_input the stream is still read (no idle limit: the audio may take long) so that a
        late message fails the RPC (FAILED_PRECONDITION) instead of being dropped unseen."""
        while (req := await requests.next()) is not None:
            kind = req.WhichOneof("request")
            if kind == "text":
                session.push_text(req.text)
            elif kind == "flush":
                session.flush()
            elif kind == "end_input":
                session.end_input()
                break
            elif kind == "config":
                raise InvalidArgument("config", "sent twice; the config goes only in the first message")
            else:
                raise InvalidArgument("request", "empty message; set text, flush or end_input")
        else:
            session.end_input()
            return
        async for late in requests.requests:
            raise FailedPrecondition(f"{late.WhichOneof('request') or 'a message'} sent after end_input; the "
                                     "session's input has ended (open a new session for more text)")

    async def Synthesize(
        self, request: pb.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamingSynthesizeResponse]:
        session: Session | None = None
        try:
            config = session_config(request.config)
            text = unary_text(request.text)
            session = await self.engine.open_session(config)
            session.push_text(text)
            session.end_input()
            async for event in session.events():
                for msg in responses(event):
                    yield msg
        finally:
            if session is not None:
                session.cancel(sys.exc_info()[1])

    async def ListVoices(
        self, request: pb.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVoicesResponse:
        return pb.ListVoicesResponse(voices=[voice_message(v) for v in self.engine.voices()])

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        info = self.engine.server_info()
        return pb.ServerInfo(
            backend=info.backend, device=info.device, precisions=[_PRECISION_OUT[p] for p in info.precisions],
            default_voice=info.default_voice, fp32_pins=info.fp32_pins, versions=dict(info.versions),
            capacity_streams=info.capacity_streams or 0.0, open_sessions=info.open_sessions,
            voices=[voice_message(v) for v in self.engine.voices()],
        )


NATIVE_METHODS = methods_of(pb.DESCRIPTOR.services_by_name["TextToSpeech"])


def add_native(server: grpc.aio.Server, engine: Engine, idle_timeout_s: float, write_stall_s: float) -> None:
    """Serve ``cadenza.v1.TextToSpeech`` on `server`, every RPC behind the shared error boundary."""
    service = pb.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
    add_service(server, service, NativeServicer(engine, idle_timeout_s), NATIVE_METHODS, write_stall_s=write_stall_s)
