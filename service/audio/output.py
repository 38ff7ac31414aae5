"""Per-session audio output: model chunks in, client bytes out.

Chains the streaming resampler and the wire encoder, and optionally prepends a streaming WAV
header. All state (resampler filter, header sent, sample count) lives on the instance, so one
instance serves exactly one session and sessions never bleed into each other.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from service.audio.encoding import AudioEncoding, encode
from service.audio.resample import Quality, StreamingResampler
from service.audio.wav import wav_header as make_wav_header


class AudioOutput:
    """Converts one session's float32 chunks at ``in_rate`` to encoded bytes at ``out_rate``."""

    def __init__(
        self,
        in_rate: int,
        out_rate: int,
        encoding: AudioEncoding,
        wav_header: bool = False,
        quality: Quality = "HQ",
    ) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.encoding = encoding
        self.wav_header = wav_header
        self._resampler = StreamingResampler(in_rate, out_rate, quality=quality)
        self._header_pending = wav_header
        self._finished = False
        self.samples_out = 0

    def _emit(self, samples: npt.NDArray[np.float32]) -> bytes:
        self.samples_out += len(samples)
        payload = encode(samples, self.encoding)
        if self._header_pending:
            self._header_pending = False
            payload = make_wav_header(self.out_rate, self.encoding, None) + payload
        return payload

    def convert(self, chunk: npt.ArrayLike) -> bytes:
        """Bytes for the next model chunk (the first call carries the WAV header, if asked)."""
        if self._finished:
            raise RuntimeError("AudioOutput.convert called after finish")
        return self._emit(self._resampler.process(chunk))

    def finish(self) -> bytes:
        """Bytes for the resampler tail; ends the session's stream."""
        if self._finished:
            return b""
        self._finished = True
        return self._emit(self._resampler.flush())
