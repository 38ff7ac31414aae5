"""The family contract's chunk schedule: first chunks, boundaries and the checks on its fields."""

from __future__ import annotations

import pytest

from service.models.family import ChunkSchedule


def test_a_streams_first_chunk_is_short_and_later_utterances_start_long() -> None:
    s = ChunkSchedule(first_frames=32, staged_first_frames=16, growth=16.0, max_frames=1024, later_first_frames=1024)
    assert s.first_chunk(0) == 32 and s.first_chunk(1) == 1024
    assert s.boundaries(600, s.staged_first_frames) == [0, 16, 272, 600]
    # staged_first_frames may exceed max_frames: it only ever shortens a first chunk
    assert ChunkSchedule(first_frames=1, growth=1.0, max_frames=1).first_chunk(0) == 1


@pytest.mark.parametrize("bad", [dict(staged_first_frames=0), dict(first_frames=0), dict(first_frames=2048),
                                 dict(growth=0.5)])
def test_a_schedule_that_cannot_run_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="staged_first_frames"):
        ChunkSchedule(**bad)  # type: ignore[arg-type]
