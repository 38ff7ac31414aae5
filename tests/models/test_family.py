"""The family contract's chunk schedule: first chunks, boundaries and the checks on its fields."""

from __future__ import annotations

import pytest

from service.models.family import ChunkSchedule


def test_a_streams_first_chunk_is_short_and_later_utterances_start_long() -> None:
    s = ChunkSchedule(first_frames=32, staged_first_frames=16, growth=16.0, max_frames=1024, later_first_frames=1024)
    assert s.first_chunk(0) == 32 and s.first_chunk(1) == 1024
    assert s.boundaries(600, s.staged_first_frames) == [0, 16, 272, 600]
    assert ChunkSchedule(staged_first_frames=8, staged_growth=4.0).staged_boundaries(600) == [0, 8, 40, 168, 600]
    # staged_first_frames may exceed max_frames: it only ever shortens a first chunk
    assert ChunkSchedule(first_frames=1, growth=1.0, max_frames=1).first_chunk(0) == 1


def test_each_staged_chunk_is_made_while_the_ones_before_it_play() -> None:
    """From the default staged first chunk, each chunk is at most staged_growth (g) times the
    frames before it, so a decoder at up to 1 / (g + 1) of real time makes it before they have
    played: its time, r * g * S, is at most what is left of them, S - r * S."""
    s = ChunkSchedule()
    for total in (9, 100, 437, 2000, 5000):
        b = s.staged_boundaries(total)
        assert b[0] == 0 and b[-1] == total and b[1] == min(total, s.staged_first_frames)
        assert all(b[k + 1] - b[k] <= s.staged_growth * b[k] for k in range(1, len(b) - 2))


@pytest.mark.parametrize("bad", [dict(staged_first_frames=0), dict(first_frames=0), dict(first_frames=2048),
                                 dict(growth=0.5), dict(staged_growth=0.5)])
def test_a_schedule_that_cannot_run_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="staged_first_frames"):
        ChunkSchedule(**bad)  # type: ignore[arg-type]
