"""The engine inside a command that is not the server (`cadenza say`, `bench cpu`).

It runs the same synthesis core the server runs, on a private event loop in a background
thread, and hands the session's events to a plain iterator; so what these commands print
and measure is what a client of the server gets (the segmenter's first-clause rule, the
scheduler, the guard), minus gRPC."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

from service.engine.config import EngineConfig
from service.engine.contract import AudioOut, SessionConfig, SessionEvent, SessionSummary
from service.engine.engine import TtsEngine

_END = object()


class LocalEngine:
    """A started TtsEngine on its own loop thread; `stream` may be called from any one thread."""

    def __init__(self, config: EngineConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cadenza-local-loop", daemon=True)
        self._thread.start()
        self.engine = TtsEngine(config)
        try:
            self._call(self.engine.start())
        except BaseException:
            self.close()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stream(self, text: str, config: SessionConfig) -> Iterator[SessionEvent]:
        """One session: `text`, then end of input; yields its events as they come (the last
        is the SessionSummary). Errors are raised as the engine's typed errors."""
        events: queue.SimpleQueue[object] = queue.SimpleQueue()

        async def run() -> None:
            try:
                session = await self.engine.open_session(config)
                try:
                    session.push_text(text)
                    session.end_input()
                    async for event in session.events():
                        events.put(event)
                finally:
                    session.cancel()
            except BaseException as exc:  # handed to the caller's thread
                events.put(exc)
            finally:
                events.put(_END)

        asyncio.run_coroutine_threadsafe(run(), self._loop)
        while (item := events.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, AudioOut | SessionSummary)
            yield item

    @property
    def sample_rate(self) -> int:
        return self.engine.voices()[0].sample_rate

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self.engine.stop())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
