"""The engine core's process gives back the memory its sessions freed.

The core's threads (engine, frontend results, pipe writers) allocate and free audio, latents and
pickled messages by the megabyte, each thread from its own malloc arena. glibc gives an arena's
free memory back to the system only from the top of its heap, so memory freed below a chunk still
in use stays resident: after a load the process stays near its peak although nothing holds that
memory. `malloc_trim(0)` releases the free pages anywhere in every arena; it walks all of them,
so it runs once the core has gone idle, not per step.
Elsewhere than glibc (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CORE_PROCESS_NAME = "cadenza-core"  # what `ps`, `top` and scripts/soak see (/proc/<pid>/comm)
_PR_SET_NAME = 15


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def name_process(name: str) -> None:
    """Name this process (its main thread, and the threads it starts after) as tools list it."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def malloc_trim() -> bool:
    """Give the free pages of every malloc arena back to the system; True if some were."""
    trim = getattr(_LIBC, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


class IdleTrim:
    """Calls `trim` once each time the core has been idle (no session) for `after_s` since it
    was last busy: once the last session's audio has left, not between the sessions of a
    steady load. Its start (loading and warming up the voices) counts as busy."""

    def __init__(self, after_s: float = 1.0, trim: Callable[[], bool] = malloc_trim,
                 now: float | None = None) -> None:
        self.after_s = after_s
        self._trim = trim
        self._busy_at: float | None = time.monotonic() if now is None else now  # None: trimmed since

    def update(self, busy: bool, now: float | None = None) -> bool:
        """Note whether the core is busy now; True when this call trimmed."""
        now = time.monotonic() if now is None else now
        if busy:
            self._busy_at = now
            return False
        if self._busy_at is None or now - self._busy_at < self.after_s:
            return False
        self._busy_at = None
        start = time.monotonic()
        released = self._trim()
        log.debug("idle: malloc_trim %s in %.1f ms", "gave memory back" if released else "found none free",
                  1e3 * (time.monotonic() - start))
        return True
