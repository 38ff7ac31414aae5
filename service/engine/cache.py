"""Bounded LRU cache of synthesised utterances (seeded requests only).

Entries hold model-rate float32 chunks, not encoded bytes: the per-session resampler is
stateful across utterances, so encoding happens after the cache and one entry serves
every output encoding and rate."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CachedUtterance:
    chunks: tuple[np.ndarray, ...]  # float32 model-rate audio, in order
    precisions: tuple[str, ...]  # per chunk
    word_spans: tuple[tuple[str, int, int], ...]  # utterance-relative model samples

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.chunks) + 64 * len(self.word_spans)


class ResultCache:
    """LRU bounded in bytes. Owned by the engine thread (no locking); counters may be read anywhere."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, CachedUtterance] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> CachedUtterance | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: Hashable, entry: CachedUtterance) -> None:
        size = entry.nbytes
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = entry
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
