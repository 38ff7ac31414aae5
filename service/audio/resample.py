"""Streaming sample-rate conversion on top of libsoxr.

The model emits audio chunk by chunk, so the resampler must carry its filter state across
chunks: resampling each chunk on its own would put a seam (filter ramp-up and -down) at every
chunk boundary. ``soxr.ResampleStream`` keeps that state; this wrapper adds rate validation,
a passthrough for equal rates and a one-shot ``flush`` for the filter tail.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt
import soxr

FloatArray = npt.NDArray[np.float32]
Quality = Literal["QQ", "LQ", "MQ", "HQ", "VHQ"]

MIN_OUT_RATE = 8000
MAX_OUT_RATE = 48000


def check_out_rate(out_rate: int) -> None:
    """Reject output rates outside what clients may ask for."""
    if not MIN_OUT_RATE <= out_rate <= MAX_OUT_RATE:
        raise ValueError(
            f"output sample rate {out_rate} Hz is outside {MIN_OUT_RATE}..{MAX_OUT_RATE} Hz"
        )


def _as_mono_f32(chunk: npt.ArrayLike) -> FloatArray:
    x = np.ascontiguousarray(chunk, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-D mono chunk, got shape {x.shape}")
    return x


class StreamingResampler:
    """Resamples one continuous mono float32 stream delivered in chunks of any size.

    Output is identical to resampling the concatenated input in one go. One instance per
    stream; after ``flush`` the stream is over and ``process`` raises.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: Quality = "HQ") -> None:
        if in_rate <= 0:
            raise ValueError(f"input sample rate must be positive, got {in_rate}")
        check_out_rate(out_rate)
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.quality: Quality = quality
        self._stream: soxr.ResampleStream | None = None
        if in_rate != out_rate:
            self._stream = soxr.ResampleStream(
                in_rate, out_rate, 1, dtype="float32", quality=quality
            )
        self._flushed = False

    @property
    def passthrough(self) -> bool:
        """True when rates match and samples are passed through untouched."""
        return self._stream is None

    def process(self, chunk: npt.ArrayLike) -> FloatArray:
        """Resample the next chunk; output may lag input by the filter delay. Without resampling
        the output is the input itself (as float32 mono): callers only read it."""
        if self._flushed:
            raise RuntimeError("StreamingResampler.process called after flush")
        x = _as_mono_f32(chunk)
        if self._stream is None:
            return x
        if x.size == 0:
            return np.zeros(0, dtype=np.float32)
        out: FloatArray = self._stream.resample_chunk(x, last=False)
        return out

    def flush(self) -> FloatArray:
        """End the stream and return the samples still held in the filter."""
        if self._flushed or self._stream is None:
            self._flushed = True
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        out: FloatArray = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        return out
