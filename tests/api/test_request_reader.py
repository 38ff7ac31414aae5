"""`RequestReader`: the idle limit counts each wait for a message, kept by one timer per stream."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator

import pytest

from service.api.compat import RequestReader
from service.api.errors import IdleTimeout

LIMIT_S = 0.2


async def _paced(count: int, every_s: float, then_stall: bool = False) -> AsyncIterator[int]:
    for k in range(count):
        await asyncio.sleep(every_s)
        yield k
    if then_stall:
        await asyncio.sleep(3600)


def test_a_stream_that_keeps_writing_is_never_idle() -> None:
    """Messages 0.1 s apart for 1 s in all (5x the limit): every wait is short, none times out."""
    async def main() -> list[int]:
        reader = RequestReader(_paced(10, LIMIT_S / 2), LIMIT_S)
        got = []
        while (msg := await reader.next()) is not None:
            got.append(msg)
        return got

    assert asyncio.run(main()) == list(range(10))


def test_a_stalled_stream_times_out_after_the_limit_and_the_task_goes_on() -> None:
    async def main() -> tuple[float, int, str]:
        reader = RequestReader(_paced(2, 0.01, then_stall=True), LIMIT_S, hint="send more")
        assert await reader.next() == 0
        assert await reader.next() == 1
        start = time.monotonic()
        with pytest.raises(IdleTimeout) as caught:
            await reader.next()
        waited = time.monotonic() - start
        await asyncio.sleep(0.01)  # the task was not left cancelled: it can still await
        task = asyncio.current_task()
        assert task is not None
        return waited, task.cancelling(), caught.value.message

    waited, cancelling, message = asyncio.run(main())
    assert LIMIT_S * 0.9 <= waited < LIMIT_S * 3
    assert cancelling == 0
    assert message == f"no message for {LIMIT_S:g} s; send more"


def test_time_spent_handling_a_message_is_not_idle_time() -> None:
    """The handler takes 2x the limit between reads; the next message then comes at once."""
    async def main() -> list[int]:
        reader = RequestReader(_paced(3, 0.0), LIMIT_S)
        got = []
        while (msg := await reader.next()) is not None:
            got.append(msg)
            await asyncio.sleep(LIMIT_S * 2)
        return got

    assert asyncio.run(main()) == [0, 1, 2]


class _Speaking:
    """A session with audio still going out until `until` (monotonic): not quiet before it."""

    def __init__(self, until: float) -> None:
        self.until = until

    def quiet_s(self, now: float) -> float:
        return max(0.0, now - self.until)


def test_the_limit_waits_for_the_session_to_fall_quiet() -> None:
    """No message for 3x the limit while audio goes out for 2x the limit: the timeout comes a
    limit after the audio ended, not a limit after the last message."""
    async def main() -> float:
        reader = RequestReader(_paced(1, 0.0, then_stall=True), LIMIT_S)
        assert await reader.next() == 0
        start = time.monotonic()
        reader.session = _Speaking(start + 2 * LIMIT_S)  # type: ignore[assignment]
        with pytest.raises(IdleTimeout):
            await reader.next()
        return time.monotonic() - start

    waited = asyncio.run(main())
    assert 3 * LIMIT_S * 0.9 <= waited < 3 * LIMIT_S + 0.5


def test_close_lets_the_session_go() -> None:
    """The timer, armed for 60 s, would keep the reader (and its session) alive after the stream."""
    async def main() -> tuple[bool, bool]:
        reader = RequestReader(_paced(1, 0.0), 60.0)
        session = _Speaking(0.0)
        reader.session = session  # type: ignore[assignment]
        assert await reader.next() == 0  # the timer is armed for 60 s and holds the reader
        ref = weakref.ref(session)
        del session
        gc.collect()
        held = ref() is not None
        reader.close()
        gc.collect()
        return held, ref() is None

    held_before, freed_after = asyncio.run(main())
    assert held_before and freed_after
