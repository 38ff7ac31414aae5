"""Per-session audio output: model chunks in, client bytes out.

Chains the streaming resampler and the wire encoder, and optionally prepends a streaming WAV
header. All state (resampler filter, header sent, sample count) lives on the instance, so one
instance serves exactly one session and sessions never bleed into each other.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from service.audio.encoding import PCM16_ENCODINGS, AudioEncoding, encode, encode_pcm16
from service.audio.resample import Quality, StreamingResampler
from service.audio.wav import wav_header as make_wav_header


class AudioOutput:
    """Converts one session's float32 chunks at ``in_rate`` to encoded bytes at ``out_rate``.

    Where the output needs no resampling and is made from 16-bit PCM (`accepts_pcm16`), chunks
    may also come as int16 PCM already (`float_to_int16`'s, made where the audio was: the engine
    core's process), with the same bytes out."""

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

    @property
    def accepts_pcm16(self) -> bool:
        return self._resampler.passthrough and self.encoding in PCM16_ENCODINGS

    def _emit(self, samples: npt.NDArray[np.float32]) -> bytes:
        return self._framed(len(samples), encode(samples, self.encoding))

    def _framed(self, count: int, payload: bytes) -> bytes:
        """`payload` (`count` samples) as sent: the WAV header before the first bytes, if asked."""
        self.samples_out += count
        if self._header_pending:
            self._header_pending = False
            payload = make_wav_header(self.out_rate, self.encoding, None) + payload
        return payload

    def convert(self, chunk: npt.ArrayLike) -> bytes:
        """Bytes for the next model chunk (the first call carries the WAV header, if asked)."""
        if self._finished:
            raise RuntimeError("AudioOutput.convert called after finish")
        if isinstance(chunk, np.ndarray) and chunk.dtype == np.int16:
            if not self.accepts_pcm16:
                raise ValueError(f"int16 PCM given, but this output resamples or is {self.encoding.name}")
            return self._framed(len(chunk), encode_pcm16(chunk, self.encoding))
        return self._emit(self._resampler.process(chunk))

    def finish(self) -> bytes:
        """Bytes for the resampler tail; ends the session's stream."""
        if self._finished:
            return b""
        self._finished = True
        return self._emit(self._resampler.flush())
