"""A small synchronous client for the native API (used by `cadenza client` and the tests)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc


@dataclass
class StreamResult:
    """Everything one streaming session returned, with client-side timings."""

    audio: bytes = b""
    chunks: list[pb.AudioChunk] = field(default_factory=list)
    words: list[pb.WordTiming] = field(default_factory=list)
    summary: pb.SessionSummary | None = None
    ttfa_s: float | None = None  # first text sent -> first audio received
    arrivals_s: list[float] = field(default_factory=list)  # per chunk, since the first text was sent

    @property
    def sample_rate(self) -> int:
        return self.chunks[0].sample_rate_hz if self.chunks else 0


def requests(config: pb.SessionConfig, pieces: Iterable[str], clock: list[float],
             flush_each: bool = False) -> Iterator[pb.StreamingSynthesizeRequest]:
    """Config, then each text piece (optionally flushed), then end of input.
    `clock[0]` is set when the first text leaves."""
    yield pb.StreamingSynthesizeRequest(config=config)
    for piece in pieces:
        if not clock:
            clock.append(time.perf_counter())
        yield pb.StreamingSynthesizeRequest(text=piece)
        if flush_each:
            yield pb.StreamingSynthesizeRequest(flush=True)
    yield pb.StreamingSynthesizeRequest(end_input=True)


def collect(responses: Iterable[pb.StreamingSynthesizeResponse], clock: list[float],
            on_audio: Callable[[pb.AudioChunk], None] | None = None) -> StreamResult:
    """Everything the stream returns; `on_audio` also sees each chunk the moment it arrives
    (to play or write it while the rest is still being made)."""
    out = StreamResult()
    pieces = []
    for msg in responses:
        kind = msg.WhichOneof("response")
        if kind == "audio":
            now = time.perf_counter() - (clock[0] if clock else 0.0)
            if out.ttfa_s is None and msg.audio.num_samples > 0:
                out.ttfa_s = now
            out.arrivals_s.append(now)
            out.chunks.append(msg.audio)
            pieces.append(msg.audio.audio)
            if on_audio is not None:
                on_audio(msg.audio)
        elif kind == "words":
            out.words.extend(msg.words.words)
        elif kind == "summary":
            out.summary = msg.summary
    out.audio = b"".join(pieces)
    return out


def stream(stub: pb_grpc.TextToSpeechStub, config: pb.SessionConfig, pieces: Iterable[str],
           flush_each: bool = False, timeout: float | None = None,
           metadata: Sequence[tuple[str, str | bytes]] | None = None,
           on_audio: Callable[[pb.AudioChunk], None] | None = None) -> StreamResult:
    """One StreamingSynthesize session: send `pieces` as text deltas, collect everything.
    `metadata`: (key, value) pairs sent with the call (keys lower case; `-bin` keys take bytes);
    `on_audio`: called with each audio chunk as it arrives."""
    clock: list[float] = []
    responses = stub.StreamingSynthesize(requests(config, pieces, clock, flush_each), timeout=timeout,
                                         metadata=tuple(metadata) if metadata else None)
    return collect(responses, clock, on_audio)


def channel_credentials(tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                        tls_key: str | Path | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS file is given (None: plaintext). `tls_ca` verifies the server
    (default: the system's CAs); `tls_cert` + `tls_key` are the client's certificate, for mTLS."""
    if tls_ca is None and tls_cert is None and tls_key is None:
        return None
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("a client certificate needs its key (tls_cert and tls_key together)")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes() if tls_ca is not None else None,
        private_key=Path(tls_key).read_bytes() if tls_key is not None else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert is not None else None,
    )


def connect(addr: str, tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
            tls_key: str | Path | None = None) -> tuple[grpc.Channel, pb_grpc.TextToSpeechStub]:
    """A channel to `addr` (plaintext, or TLS when any TLS file is given) and its native stub."""
    credentials = channel_credentials(tls_ca, tls_cert, tls_key)
    channel = grpc.secure_channel(addr, credentials) if credentials is not None else grpc.insecure_channel(addr)
    return channel, pb_grpc.TextToSpeechStub(channel)
