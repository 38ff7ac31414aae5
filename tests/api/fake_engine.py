"""A deterministic stand-in for the engine: checks the servicers' wire behaviour without a model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc

from service.engine.api import (
    AudioOut,
    FailedPrecondition,
    InvalidArgument,
    Precision,
    ServerInfo,
    SessionConfig,
    SessionEvent,
    SessionSummary,
    SpeakerInfo,
    VoiceDescription,
    WordTiming,
)

IDLE_TIMEOUT_S = 0.5
VOICES = [
    VoiceDescription("en_US-joe-medium", "en-US", 22050, [], loaded=True),
    VoiceDescription("tiny-multi", "en-US", 16000, [SpeakerInfo(0, "alice"), SpeakerInfo(1, "bob")], loaded=True),
]


def fake_audio(config: SessionConfig, sentence: str) -> bytes:
    """Bytes that depend on everything the servicer must pass through."""
    key = f"{config.voice}|{config.speaker}|{config.speaking_rate}|{config.seed}|{config.sample_rate}|{sentence}"
    samples = 10 * len(sentence)
    return (key.encode() * samples)[: samples * config.encoding.bytes_per_sample]


class FakeSession:
    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._text = ""
        self._queue: asyncio.Queue[SessionEvent | None] = asyncio.Queue()
        self._closed = False

    def push_text(self, delta: str) -> None:
        if self._closed:
            raise FailedPrecondition("closed")
        if "FAIL" in delta:
            raise InvalidArgument("text", "the fake engine refuses FAIL")
        self._text += delta

    def flush(self) -> None:
        pass

    def end_input(self) -> None:
        self._closed = True
        rate = self.config.sample_rate or 22050
        offset = 0
        sentences = [s.strip() + "." for s in self._text.split(".") if s.strip()]
        for index, sentence in enumerate(sentences):
            audio = fake_audio(self.config, sentence)
            n = len(audio) // self.config.encoding.bytes_per_sample
            words = [WordTiming(sentence.split()[0], offset, offset + n)] if self.config.word_timings else []
            self._queue.put_nowait(AudioOut(audio, index, offset, n, rate, index, Precision.FP32, False, words))
            offset += n
        self._queue.put_nowait(SessionSummary(len(self._text), 0.0, None, 0, len(sentences), len(sentences)))
        self._queue.put_nowait(None)

    def cancel(self) -> None:
        self._closed = True
        self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[SessionEvent]:
        while (event := await self._queue.get()) is not None:
            yield event


class FakeEngine:
    def __init__(self) -> None:
        self.configs: list[SessionConfig] = []

    async def open_session(self, config: SessionConfig) -> FakeSession:
        self.configs.append(config)
        return FakeSession(config)

    def voices(self) -> list[VoiceDescription]:
        return VOICES

    def server_info(self) -> ServerInfo:
        return ServerInfo("fake", "cpu", [Precision.FP32], VOICES[0].name, [], {})

    async def synthesize_all(self, config: SessionConfig, text: str) -> tuple[bytes, list[WordTiming], SessionSummary]:
        session = await self.open_session(config)
        session.push_text(text)
        session.end_input()
        audio, words, summary = b"", [], None
        async for event in session.events():
            if isinstance(event, AudioOut):
                audio += event.audio
                words += event.words
            else:
                summary = event
        assert summary is not None
        return audio, words, summary


@contextmanager
def serve_fake(engine: FakeEngine) -> Iterator[str]:
    """A grpc.aio server with both compatibility APIs on a free port, in a thread; yields its address."""
    from service.api.google_tts import add_google
    from service.api.riva import add_riva

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, object] = {}

    async def main() -> None:
        server = grpc.aio.server()
        add_riva(server, engine, idle_timeout_s=IDLE_TIMEOUT_S)  # type: ignore[arg-type]
        add_google(server, engine, idle_timeout_s=IDLE_TIMEOUT_S)  # type: ignore[arg-type]
        state["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = asyncio.Event()
        state["stop"] = stop
        ready.set()
        await stop.wait()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield f"127.0.0.1:{state['port']}"
    finally:
        stop = state["stop"]
        assert isinstance(stop, asyncio.Event)
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
