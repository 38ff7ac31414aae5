"""AudioOutput: chunked conversion is byte-identical to one-shot, and sessions are isolated."""

from __future__ import annotations

import numpy as np
import pytest

from service.audio.encoding import PCM16_ENCODINGS, AudioEncoding, decode, float_to_int16
from service.audio.output import AudioOutput
from service.audio.resample import StreamingResampler
from service.audio.wav import wav_header
from tests.audio.conftest import speech_like

OUT_RATES = [8000, 16000, 22050, 24000, 44100, 48000]
IN_RATE = 22050


def convert_chunked(out: AudioOutput, x: np.ndarray, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    parts, i = [], 0
    while i < x.size:
        n = int(rng.integers(1, 3000))
        parts.append(out.convert(x[i : i + n]))
        i += n
    parts.append(out.finish())
    return b"".join(parts)


@pytest.mark.parametrize("out_rate", OUT_RATES)
@pytest.mark.parametrize("encoding", list(AudioEncoding))
def test_chunked_equals_one_shot_bytes(encoding: AudioEncoding, out_rate: int) -> None:
    x = speech_like(IN_RATE, 1.0, seed=3)
    one = AudioOutput(IN_RATE, out_rate, encoding, wav_header=False)
    whole = one.convert(x) + one.finish()
    chunked_out = AudioOutput(IN_RATE, out_rate, encoding, wav_header=False)
    chunked = convert_chunked(chunked_out, x, seed=out_rate)
    assert chunked == whole
    assert chunked_out.samples_out == len(whole) // encoding.bytes_per_sample
    assert abs(chunked_out.samples_out - round(x.size * out_rate / IN_RATE)) <= 2


@pytest.mark.parametrize("encoding", list(AudioEncoding))
def test_wav_header_prepended_once(encoding: AudioEncoding) -> None:
    x = speech_like(IN_RATE, 0.5)
    plain = AudioOutput(IN_RATE, 16000, encoding, wav_header=False)
    body = convert_chunked(plain, x, seed=5)
    framed = AudioOutput(IN_RATE, 16000, encoding, wav_header=True)
    blob = convert_chunked(framed, x, seed=5)
    header = wav_header(16000, encoding, None)
    assert blob == header + body
    assert framed.samples_out == plain.samples_out


def test_header_sent_even_if_no_audio() -> None:
    out = AudioOutput(IN_RATE, 8000, AudioEncoding.MULAW, wav_header=True)
    assert out.finish() == wav_header(8000, AudioEncoding.MULAW, None)
    assert out.finish() == b""
    with pytest.raises(RuntimeError):
        out.convert(np.zeros(10, np.float32))


def test_decoded_output_matches_resampled_signal() -> None:
    x = speech_like(IN_RATE, 0.5)
    rs = StreamingResampler(IN_RATE, 24000)
    expected = np.clip(np.concatenate([rs.process(x), rs.flush()]), -1, 1)
    out = AudioOutput(IN_RATE, 24000, AudioEncoding.LINEAR16)
    got = decode(convert_chunked(out, x, seed=7), AudioEncoding.LINEAR16)
    assert np.max(np.abs(got - expected)) <= 0.5 / 32767 + 1e-6


def test_interleaved_sessions_do_not_interact() -> None:
    a_in, b_in = speech_like(IN_RATE, 0.6, seed=1), speech_like(IN_RATE, 0.6, seed=2)
    a_ref = AudioOutput(IN_RATE, 16000, AudioEncoding.ALAW)
    b_ref = AudioOutput(IN_RATE, 16000, AudioEncoding.ALAW)
    a_expected = a_ref.convert(a_in) + a_ref.finish()
    b_expected = b_ref.convert(b_in) + b_ref.finish()
    a = AudioOutput(IN_RATE, 16000, AudioEncoding.ALAW)
    b = AudioOutput(IN_RATE, 16000, AudioEncoding.ALAW)
    a_parts, b_parts = [], []
    for i in range(0, a_in.size, 1000):
        a_parts.append(a.convert(a_in[i : i + 1000]))
        b_parts.append(b.convert(b_in[i : i + 1000]))
    a_parts.append(a.finish())
    b_parts.append(b.finish())
    assert b"".join(a_parts) == a_expected
    assert b"".join(b_parts) == b_expected


def test_rejects_out_of_range_rate() -> None:
    with pytest.raises(ValueError, match=r"8000\.\.48000"):
        AudioOutput(IN_RATE, 96000, AudioEncoding.LINEAR16)


@pytest.mark.parametrize("encoding", PCM16_ENCODINGS)
def test_int16_chunks_give_the_bytes_float_chunks_give(encoding: AudioEncoding) -> None:
    """Chunks converted to int16 PCM where they were made (the engine core's process) encode to
    the same bytes as the float chunks, header included; only outputs that need no resampling and
    are made from 16-bit PCM take them."""
    x = speech_like(IN_RATE, 0.5, seed=5) * 1.3  # some samples past full scale: clipped alike
    want_out, got_out = AudioOutput(IN_RATE, IN_RATE, encoding, wav_header=True), \
        AudioOutput(IN_RATE, IN_RATE, encoding, wav_header=True)
    assert got_out.accepts_pcm16
    pieces = np.array_split(x, 7)
    want = b"".join(want_out.convert(p) for p in pieces) + want_out.finish()
    got = b"".join(got_out.convert(float_to_int16(p)) for p in pieces) + got_out.finish()
    assert got == want and got_out.samples_out == want_out.samples_out == x.size


def test_int16_chunks_are_refused_where_the_output_needs_floats() -> None:
    pcm = float_to_int16(speech_like(IN_RATE, 0.1, seed=6))
    for out in (AudioOutput(IN_RATE, 8000, AudioEncoding.MULAW), AudioOutput(IN_RATE, IN_RATE, AudioEncoding.FLOAT32)):
        assert not out.accepts_pcm16
        with pytest.raises(ValueError, match="int16 PCM"):
            out.convert(pcm)
