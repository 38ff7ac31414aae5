"""The core's process gives back freed memory once idle (issue 33, item 7); the server-level check
is tests/tools/test_soak.py."""

from __future__ import annotations

import threading
from pathlib import Path

from service.engine.memory import CORE_PROCESS_NAME, IdleTrim, malloc_trim, name_process


def test_trims_once_per_idle_period() -> None:
    calls: list[float] = []
    idle = IdleTrim(after_s=1.0, trim=lambda: calls.append(0) is None, now=0.0)
    assert not idle.update(busy=False, now=0.5)  # the start counts as busy
    assert idle.update(busy=False, now=1.0) and len(calls) == 1  # ... then once idle for after_s
    assert not idle.update(busy=False, now=5.0)  # once per idle period
    assert not idle.update(busy=True, now=6.0)
    assert not idle.update(busy=True, now=9.0)  # never while busy, however long
    assert not idle.update(busy=False, now=9.5)
    assert idle.update(busy=False, now=10.0) and len(calls) == 2


def test_malloc_trim_runs_here() -> None:
    blocks = [bytearray(64 << 10) for _ in range(200)]  # freed pages for malloc to give back
    del blocks[::2]
    assert isinstance(malloc_trim(), bool)


def test_name_process_names_the_calling_thread() -> None:
    seen: list[str] = []

    def named() -> None:
        name_process(CORE_PROCESS_NAME)
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=named)  # a thread of its own, so this test process keeps its name
    thread.start()
    thread.join()
    assert seen == [CORE_PROCESS_NAME]
