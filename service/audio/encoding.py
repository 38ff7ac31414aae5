"""Sample encodings for the wire: float32 model output to bytes, and back for tests and clients.

G.711 (mu-law / A-law) is implemented here rather than through ``audioop``, which is deprecated
and gone in Python 3.13. Each codec is a lookup table over all 65536 int16 values, built once,
so encoding a chunk is one vectorised index instead of per-sample segment arithmetic.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
Int16Array = npt.NDArray[np.int16]
UInt8Array = npt.NDArray[np.uint8]

# Full scale used in both directions, so LINEAR16 encode/decode are exact inverses on the grid.
PCM16_SCALE = 32767.0


class AudioEncoding(enum.Enum):
    """Wire encodings a client may ask for (all mono, little-endian where it matters)."""

    LINEAR16 = "linear16"  # PCM signed 16-bit little-endian
    MULAW = "mulaw"  # ITU-T G.711 mu-law, 8 bits per sample
    ALAW = "alaw"  # ITU-T G.711 A-law, 8 bits per sample
    FLOAT32 = "float32"  # IEEE float 32-bit little-endian

    @property
    def bytes_per_sample(self) -> int:
        """Size of one mono sample on the wire."""
        return _BYTES_PER_SAMPLE[self]


_BYTES_PER_SAMPLE = {
    AudioEncoding.LINEAR16: 2,
    AudioEncoding.MULAW: 1,
    AudioEncoding.ALAW: 1,
    AudioEncoding.FLOAT32: 4,
}


# --- G.711 tables --------------------------------------------------------------------------------
# Segment logic follows the classic Sun reference code (g711.c), which audioop also uses:
# mu-law works on the top 14 bits of the sample, A-law on the top 13 bits.

_ULAW_CLIP = 8159  # 14-bit magnitude clip
_ULAW_BIAS = 0x84 >> 2  # bias in the 14-bit domain
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def _all_int16() -> npt.NDArray[np.int32]:
    """Every int16 value, ordered by its uint16 bit pattern (the table index)."""
    return np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)


def _build_ulaw_encode_table() -> UInt8Array:
    pcm = _all_int16() >> 2
    negative = pcm < 0
    mask = np.where(negative, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), _ULAW_CLIP) + _ULAW_BIAS
    seg = np.searchsorted(_ULAW_SEG_END, mag, side="left")  # first seg with mag <= end
    seg_c = np.minimum(seg, 7)
    uval = (seg_c << 4) | ((mag >> (seg_c + 1)) & 0xF)
    uval = np.where(seg >= 8, 0x7F, uval)
    return (uval ^ mask).astype(np.uint8)


def _build_alaw_encode_table() -> UInt8Array:
    pcm = _all_int16() >> 3
    negative = pcm < 0
    mask = np.where(negative, 0x55, 0xD5)
    mag = np.where(negative, -pcm - 1, pcm)
    seg = np.searchsorted(_ALAW_SEG_END, mag, side="left")
    seg_c = np.minimum(seg, 7)
    shift = np.where(seg_c < 2, 1, seg_c)
    aval = (seg_c << 4) | ((mag >> shift) & 0xF)
    aval = np.where(seg >= 8, 0x7F, aval)
    return (aval ^ mask).astype(np.uint8)


def _build_ulaw_decode_table() -> Int16Array:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _build_alaw_decode_table() -> Int16Array:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ULAW_ENCODE = _build_ulaw_encode_table()
_ALAW_ENCODE = _build_alaw_encode_table()
_ULAW_DECODE = _build_ulaw_decode_table()
_ALAW_DECODE = _build_alaw_decode_table()


def linear16_to_mulaw(pcm: Int16Array) -> UInt8Array:
    """G.711 mu-law codes for int16 samples."""
    return _ULAW_ENCODE[np.asarray(pcm, dtype=np.int16).view(np.uint16)]


def linear16_to_alaw(pcm: Int16Array) -> UInt8Array:
    """G.711 A-law codes for int16 samples."""
    return _ALAW_ENCODE[np.asarray(pcm, dtype=np.int16).view(np.uint16)]


def mulaw_to_linear16(codes: UInt8Array) -> Int16Array:
    """int16 samples for G.711 mu-law codes."""
    return _ULAW_DECODE[np.asarray(codes, dtype=np.uint8)]


def alaw_to_linear16(codes: UInt8Array) -> Int16Array:
    """int16 samples for G.711 A-law codes."""
    return _ALAW_DECODE[np.asarray(codes, dtype=np.uint8)]


# --- float32 <-> wire ----------------------------------------------------------------------------


def float_to_int16(samples: npt.ArrayLike) -> Int16Array:
    """Clip to [-1, 1], scale by 32767 and round to nearest (ties to even). One temporary,
    worked on in place: it runs for every chunk of every session."""
    x = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    np.multiply(x, np.float32(PCM16_SCALE), out=x)
    np.rint(x, out=x)
    return x.astype(np.int16)


def encode_linear16(samples: npt.ArrayLike) -> bytes:
    """PCM s16le bytes."""
    return encode_pcm16(float_to_int16(samples), AudioEncoding.LINEAR16)


def encode_mulaw(samples: npt.ArrayLike) -> bytes:
    """G.711 mu-law bytes, quantised from the LINEAR16 values."""
    return encode_pcm16(float_to_int16(samples), AudioEncoding.MULAW)


def encode_alaw(samples: npt.ArrayLike) -> bytes:
    """G.711 A-law bytes, quantised from the LINEAR16 values."""
    return encode_pcm16(float_to_int16(samples), AudioEncoding.ALAW)


def encode_float32(samples: npt.ArrayLike) -> bytes:
    """f32le bytes, unclipped: float clients get exactly what the resampler produced."""
    return np.asarray(samples, dtype="<f4").tobytes()


def encode(samples: npt.ArrayLike, encoding: AudioEncoding) -> bytes:
    """Encode float32 mono samples in [-1, 1] to the wire format."""
    return _ENCODERS[encoding](samples)


PCM16_ENCODINGS = (AudioEncoding.LINEAR16, AudioEncoding.MULAW, AudioEncoding.ALAW)


def encode_pcm16(pcm: Int16Array, encoding: AudioEncoding) -> bytes:
    """Wire bytes of `float_to_int16`'s samples, for the encodings in PCM16_ENCODINGS (what
    `encode` gives for the float samples: its 16-bit encoders come through here)."""
    if encoding is AudioEncoding.LINEAR16:
        return np.asarray(pcm, dtype="<i2").tobytes()
    if encoding is AudioEncoding.MULAW:
        return linear16_to_mulaw(pcm).tobytes()
    if encoding is AudioEncoding.ALAW:
        return linear16_to_alaw(pcm).tobytes()
    raise ValueError(f"{encoding.name} is not made from 16-bit PCM")


_ENCODERS = {
    AudioEncoding.LINEAR16: encode_linear16,
    AudioEncoding.MULAW: encode_mulaw,
    AudioEncoding.ALAW: encode_alaw,
    AudioEncoding.FLOAT32: encode_float32,
}


def _int16_to_float(pcm: Int16Array) -> FloatArray:
    return (pcm.astype(np.float32) / np.float32(PCM16_SCALE)).astype(np.float32)


def decode_linear16(data: bytes) -> FloatArray:
    """float32 samples from PCM s16le bytes (inverse of the 32767 scaling)."""
    return _int16_to_float(np.frombuffer(data, dtype="<i2").astype(np.int16))


def decode_mulaw(data: bytes) -> FloatArray:
    """float32 samples from G.711 mu-law bytes."""
    return _int16_to_float(mulaw_to_linear16(np.frombuffer(data, dtype=np.uint8)))


def decode_alaw(data: bytes) -> FloatArray:
    """float32 samples from G.711 A-law bytes."""
    return _int16_to_float(alaw_to_linear16(np.frombuffer(data, dtype=np.uint8)))


def decode_float32(data: bytes) -> FloatArray:
    """float32 samples from f32le bytes."""
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def decode(data: bytes, encoding: AudioEncoding) -> FloatArray:
    """Decode wire bytes back to float32 mono samples."""
    if len(data) % encoding.bytes_per_sample:
        raise ValueError(
            f"{len(data)} bytes is not a whole number of {encoding.name} samples "
            f"({encoding.bytes_per_sample} bytes each)"
        )
    return _DECODERS[encoding](data)


_DECODERS = {
    AudioEncoding.LINEAR16: decode_linear16,
    AudioEncoding.MULAW: decode_mulaw,
    AudioEncoding.ALAW: decode_alaw,
    AudioEncoding.FLOAT32: decode_float32,
}
