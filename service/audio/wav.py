"""RIFF/WAVE headers for streamed and file output, and WAV files read back (prompt recordings).

Streaming clients get the header before the length is known, so sizes are written as
0xFFFFFFFF, which players and ffmpeg treat as "read until end of stream".
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from typing import IO

import numpy as np
import numpy.typing as npt

from service.audio.encoding import AudioEncoding, alaw_to_linear16, encode_linear16, mulaw_to_linear16

UNKNOWN_SIZE = 0xFFFFFFFF

# WAVE format tags (mmreg.h).
WAVE_FORMAT_PCM = 1
WAVE_FORMAT_IEEE_FLOAT = 3
WAVE_FORMAT_ALAW = 6
WAVE_FORMAT_MULAW = 7

_FORMAT_TAG = {
    AudioEncoding.LINEAR16: WAVE_FORMAT_PCM,
    AudioEncoding.FLOAT32: WAVE_FORMAT_IEEE_FLOAT,
    AudioEncoding.ALAW: WAVE_FORMAT_ALAW,
    AudioEncoding.MULAW: WAVE_FORMAT_MULAW,
}


def wav_header(sample_rate: int, encoding: AudioEncoding, num_samples: int | None) -> bytes:
    """Mono RIFF/WAVE header up to and including the ``data`` chunk size.

    PCM uses the plain 16-byte ``fmt`` chunk. Non-PCM formats (float, G.711) get the 18-byte
    ``fmt`` with ``cbSize = 0`` plus a ``fact`` chunk, as the WAVE spec requires for them.
    With ``num_samples=None`` the RIFF, data and fact sizes are 0xFFFFFFFF (unknown length).
    For 8-bit formats with an odd sample count the caller appends one pad byte after the data;
    the RIFF size here already counts it.
    """
    if sample_rate <= 0:
        raise ValueError(f"sample rate must be positive, got {sample_rate}")
    width = encoding.bytes_per_sample
    tag = _FORMAT_TAG[encoding]
    pcm = tag == WAVE_FORMAT_PCM

    fmt = struct.pack("<HHIIHH", tag, 1, sample_rate, sample_rate * width, width, 8 * width)
    if not pcm:
        fmt += struct.pack("<H", 0)  # cbSize: no extra format bytes
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt

    if num_samples is None:
        data_size = riff_size = fact_samples = UNKNOWN_SIZE
    else:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        data_size = num_samples * width
        fact_samples = num_samples
    if not pcm:
        chunks += b"fact" + struct.pack("<II", 4, fact_samples)
    if num_samples is not None:
        pad = data_size & 1
        riff_size = 4 + len(chunks) + 8 + data_size + pad
        if riff_size > UNKNOWN_SIZE - 1:
            raise ValueError(f"{num_samples} samples do not fit in a RIFF file")
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + chunks
        + b"data"
        + struct.pack("<I", data_size)
    )


def write_wav(path: str | os.PathLike[str], samples: npt.ArrayLike, sample_rate: int) -> None:
    """Write float32 mono samples in [-1, 1] as a 16-bit PCM WAV file."""
    data = encode_linear16(samples)
    header = wav_header(sample_rate, AudioEncoding.LINEAR16, len(data) // 2)
    with open(path, "wb") as f:
        f.write(header)
        f.write(data)


class WavStream:
    """A WAV written as its audio arrives, so a player reading a pipe starts at the first chunk:
    the header goes first with its sizes unknown (UNKNOWN_SIZE: "until the stream ends"), and
    every piece is flushed as it is written. Where the output can be rewritten in place (a
    redirected file), `close` fills the real sizes in."""

    def __init__(self, out: IO[bytes], encoding: AudioEncoding) -> None:
        self.out = out
        self.encoding = encoding
        self.sample_rate = 0  # known with the first piece
        self.samples = 0
        self._start: int | None = None  # where the header is, if it can be rewritten

    def write(self, audio: bytes, sample_rate: int) -> None:
        if not self.sample_rate:
            self.sample_rate = sample_rate
            self._start = _rewritable_offset(self.out)
            self.out.write(wav_header(sample_rate, self.encoding, None))
        self.out.write(audio)
        self.out.flush()
        self.samples += len(audio) // self.encoding.bytes_per_sample

    def close(self) -> None:
        """The stream is complete: where possible, the header's sizes become the real ones."""
        if not self.sample_rate or self._start is None:
            return
        if self.samples * self.encoding.bytes_per_sample & 1:
            self.out.write(b"\0")  # RIFF pads an odd-sized data chunk
        end = self.out.tell()
        self.out.seek(self._start)
        self.out.write(wav_header(self.sample_rate, self.encoding, self.samples))
        self.out.seek(end)
        self.out.flush()


def _rewritable_offset(out: IO[bytes]) -> int | None:
    """Where the next write lands, if the output can seek back there later (a file opened for
    appending cannot: its writes all go to its end); None for pipes and terminals."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        if not out.seekable():
            return None
        with contextlib.suppress(ImportError, OSError, ValueError, io.UnsupportedOperation):
            import fcntl

            if fcntl.fcntl(out.fileno(), fcntl.F_GETFL) & os.O_APPEND:
                return None
        return out.tell()
    return None


WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def read_wav(data: bytes) -> tuple[npt.NDArray[np.float32], int]:
    """(mono float32 samples, sample rate) of a WAV file's bytes: PCM of 8 to 32 bits, float, or
    G.711; channels averaged. Integer PCM is scaled by 2**(bits-1), as soundfile and torchaudio
    read it. Raises ValueError naming what is wrong with the file."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file (no RIFF/WAVE header): send a .wav recording")
    fmt: tuple[int, int, int, int] | None = None
    at = 12
    while at + 8 <= len(data):
        kind, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = data[at + 8: at + 8 + size]
        if kind == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
            if tag == WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]  # the sub-format GUID's first two bytes
            fmt = (tag, channels, rate, bits)
        elif kind == b"data":
            if fmt is None:
                raise ValueError("the WAV file's data comes before its format chunk")
            return _samples(body, *fmt), fmt[2]
        at += 8 + size + (size & 1)
    raise ValueError("the WAV file has no format or no data chunk")


def _samples(body: bytes, tag: int, channels: int, rate: int, bits: int) -> npt.NDArray[np.float32]:
    if channels < 1 or rate < 1:
        raise ValueError(f"the WAV file says {channels} channels at {rate} Hz")
    width = bits // 8
    pcm: npt.NDArray[np.float64]
    if tag == WAVE_FORMAT_PCM and bits in (8, 16, 24, 32):
        raw = np.frombuffer(body[: len(body) // width * width], dtype=np.uint8).reshape(-1, width)
        if bits == 8:
            pcm = (raw[:, 0].astype(np.float64) - 128.0) / 128.0
        else:  # little-endian signed: widen to 32 bits with the sign in the top byte
            wide = np.zeros((raw.shape[0], 4), dtype=np.uint8)
            wide[:, 4 - width:] = raw
            pcm = wide.view("<i4")[:, 0].astype(np.float64) / 2.0 ** 31
    elif tag == WAVE_FORMAT_IEEE_FLOAT and bits in (32, 64):
        pcm = np.frombuffer(body[: len(body) // width * width], dtype=f"<f{width}").astype(np.float64)
    elif tag in (WAVE_FORMAT_MULAW, WAVE_FORMAT_ALAW) and bits == 8:
        table = mulaw_to_linear16 if tag == WAVE_FORMAT_MULAW else alaw_to_linear16
        pcm = table(np.frombuffer(body, dtype=np.uint8)).astype(np.float64) / 32768.0
    else:
        raise ValueError(f"unsupported WAV encoding (format tag {tag}, {bits} bits): use 16-bit PCM or float")
    frames = len(pcm) // channels
    return pcm[: frames * channels].reshape(frames, channels).mean(axis=1).astype(np.float32)
