"""Encoders: exact G.711 against audioop, LINEAR16 rounding, and codec quality on speech."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from service.audio.encoding import (
    AudioEncoding,
    alaw_to_linear16,
    decode,
    encode,
    float_to_int16,
    linear16_to_alaw,
    linear16_to_mulaw,
    mulaw_to_linear16,
)
from service.audio.resample import StreamingResampler
from tests.audio.conftest import speech_like

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = np.arange(256, dtype=np.uint8)


def test_mulaw_encode_matches_audioop_for_every_int16() -> None:
    ours = linear16_to_mulaw(ALL_INT16).tobytes()
    assert ours == audioop.lin2ulaw(ALL_INT16.astype("<i2").tobytes(), 2)


def test_alaw_encode_matches_audioop_for_every_int16() -> None:
    ours = linear16_to_alaw(ALL_INT16).tobytes()
    assert ours == audioop.lin2alaw(ALL_INT16.astype("<i2").tobytes(), 2)


def test_mulaw_decode_matches_audioop_for_every_code() -> None:
    ours = mulaw_to_linear16(ALL_CODES).astype("<i2").tobytes()
    assert ours == audioop.ulaw2lin(ALL_CODES.tobytes(), 2)


def test_alaw_decode_matches_audioop_for_every_code() -> None:
    ours = alaw_to_linear16(ALL_CODES).astype("<i2").tobytes()
    assert ours == audioop.alaw2lin(ALL_CODES.tobytes(), 2)


def test_float_path_matches_audioop_via_linear16() -> None:
    x = speech_like(8000, 0.5)
    pcm = float_to_int16(x).astype("<i2").tobytes()
    assert encode(x, AudioEncoding.MULAW) == audioop.lin2ulaw(pcm, 2)
    assert encode(x, AudioEncoding.ALAW) == audioop.lin2alaw(pcm, 2)


def test_linear16_clips_scales_and_rounds() -> None:
    x = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 1.6e-5, -1.4e-5], dtype=np.float32)
    got = np.frombuffer(encode(x, AudioEncoding.LINEAR16), dtype="<i2")
    assert got.tolist() == [-32767, -32767, -16384, 0, 16384, 32767, 32767, 1, 0]


def test_linear16_round_trip_is_exact_on_grid() -> None:
    x = ALL_INT16[1:].astype(np.float32) / 32767  # -32768 clips to -32767 by design
    assert encode(
        decode(encode(x, AudioEncoding.LINEAR16), AudioEncoding.LINEAR16), AudioEncoding.LINEAR16
    ) == encode(x, AudioEncoding.LINEAR16)
    assert (
        np.max(np.abs(decode(encode(x, AudioEncoding.LINEAR16), AudioEncoding.LINEAR16) - x)) < 1e-7
    )


def test_float32_round_trip_is_exact() -> None:
    x = speech_like(16000, 0.25)
    data = encode(x, AudioEncoding.FLOAT32)
    assert len(data) == 4 * x.size
    np.testing.assert_array_equal(decode(data, AudioEncoding.FLOAT32), x)


@pytest.mark.parametrize("encoding", list(AudioEncoding))
def test_sizes_and_dtypes(encoding: AudioEncoding) -> None:
    x = speech_like(8000, 0.1)
    data = encode(x, encoding)
    assert len(data) == x.size * encoding.bytes_per_sample
    y = decode(data, encoding)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert encode(np.zeros(0, np.float32), encoding) == b""


def test_decode_rejects_partial_samples() -> None:
    with pytest.raises(ValueError, match="whole number"):
        decode(b"\x00\x01\x02", AudioEncoding.LINEAR16)


def snr_db(ref: np.ndarray, deg: np.ndarray) -> float:
    noise = ref.astype(np.float64) - deg.astype(np.float64)
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum(noise**2)))


@pytest.mark.parametrize("encoding", [AudioEncoding.MULAW, AudioEncoding.ALAW])
def test_g711_quality_on_piper_speech(
    encoding: AudioEncoding, piper_speech: tuple[np.ndarray, int]
) -> None:
    """Narrowband PESQ and SNR of G.711 at 8 kHz on real synthesized speech."""
    pesq = pytest.importorskip("pesq")
    audio, rate = piper_speech
    rs = StreamingResampler(rate, 8000)
    ref = np.concatenate([rs.process(audio), rs.flush()])
    ref = np.clip(ref, -1.0, 1.0)
    deg = decode(encode(ref, encoding), encoding)
    score = pesq.pesq(8000, ref, deg, "nb")
    snr = snr_db(ref, deg)
    print(f"{encoding.name}: PESQ-NB {score:.3f}, SNR {snr:.1f} dB")
    assert score > 4.0
    assert snr > 30.0


@pytest.mark.parametrize("encoding", [AudioEncoding.MULAW, AudioEncoding.ALAW])
def test_g711_quality_on_synthetic_speech(encoding: AudioEncoding) -> None:
    """Same check on a harmonic stand-in, so it runs without the voice."""
    pesq = pytest.importorskip("pesq")
    ref = speech_like(8000, 4.0)
    deg = decode(encode(ref, encoding), encoding)
    score = pesq.pesq(8000, ref, deg, "nb")
    snr = snr_db(ref, deg)
    print(f"{encoding.name} synthetic: PESQ-NB {score:.3f}, SNR {snr:.1f} dB")
    assert score > 4.0
    assert snr > 30.0
