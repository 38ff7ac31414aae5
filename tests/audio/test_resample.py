"""Streaming resampler: chunking is invisible, lengths add up, frequencies stay put."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from service.audio.resample import StreamingResampler
from tests.audio.conftest import speech_like

OUT_RATES = [8000, 16000, 22050, 24000, 44100, 48000]


def run_chunked(rs: StreamingResampler, x: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts, i = [], 0
    while i < x.size:
        n = int(rng.integers(0, 2500))  # includes empty chunks
        parts.append(rs.process(x[i : i + n]))
        i += n
    parts.append(rs.flush())
    return np.concatenate(parts)


@pytest.mark.parametrize("out_rate", OUT_RATES)
def test_chunked_equals_one_shot(out_rate: int) -> None:
    x = speech_like(22050, 1.5)
    one = StreamingResampler(22050, out_rate)
    whole = np.concatenate([one.process(x), one.flush()])
    chunked = run_chunked(StreamingResampler(22050, out_rate), x, seed=out_rate)
    assert chunked.dtype == np.float32
    assert chunked.shape == whole.shape
    assert np.max(np.abs(chunked - whole)) < 1e-6
    assert abs(chunked.size - round(x.size * out_rate / 22050)) <= 2


@pytest.mark.parametrize("out_rate", [8000, 44100])
def test_matches_soxr_one_shot(out_rate: int) -> None:
    x = speech_like(22050, 1.0)
    ours = run_chunked(StreamingResampler(22050, out_rate), x, seed=1)
    ref = soxr.resample(x, 22050, out_rate, quality="HQ")
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) < 1e-6


@pytest.mark.parametrize("out_rate", [8000, 16000, 48000])
def test_sine_keeps_its_frequency(out_rate: int) -> None:
    freq, in_rate = 1000.0, 22050
    t = np.arange(in_rate * 2) / in_rate
    x = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    y = run_chunked(StreamingResampler(in_rate, out_rate), x, seed=2)
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    peak_hz = np.argmax(spectrum) * out_rate / y.size
    assert abs(peak_hz - freq) < 2.0
    mid = y[out_rate // 2 : -out_rate // 2]
    assert abs(np.max(np.abs(mid)) - 0.5) < 0.01  # amplitude preserved too


def test_same_rate_is_passthrough() -> None:
    x = speech_like(22050, 0.2)
    rs = StreamingResampler(22050, 22050)
    assert rs.passthrough
    np.testing.assert_array_equal(rs.process(x), x)
    assert rs.flush().size == 0


@pytest.mark.parametrize("out_rate", [7999, 48001, 96000, 0])
def test_out_rate_range_enforced(out_rate: int) -> None:
    with pytest.raises(ValueError, match=r"8000\.\.48000"):
        StreamingResampler(22050, out_rate)


def test_rejects_multichannel_and_use_after_flush() -> None:
    rs = StreamingResampler(22050, 16000)
    with pytest.raises(ValueError, match="1-D"):
        rs.process(np.zeros((10, 2), np.float32))
    rs.flush()
    assert rs.flush().size == 0
    with pytest.raises(RuntimeError):
        rs.process(np.zeros(10, np.float32))
