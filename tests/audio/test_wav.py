"""WAV headers: readable by the stdlib for PCM, correct fields for every format; WAV files read back."""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from service.audio.encoding import AudioEncoding, encode
from service.audio.wav import UNKNOWN_SIZE, WavStream, read_wav, wav_header, write_wav
from tests.audio.conftest import speech_like

FORMAT_TAGS = {
    AudioEncoding.LINEAR16: (1, 16),
    AudioEncoding.FLOAT32: (3, 32),
    AudioEncoding.ALAW: (6, 8),
    AudioEncoding.MULAW: (7, 8),
}


def parse(header: bytes) -> dict[str, object]:
    """Minimal RIFF walker: chunk ids/sizes and decoded fmt fields."""
    assert header[:4] == b"RIFF" and header[8:12] == b"WAVE"
    out: dict[str, object] = {"riff_size": struct.unpack("<I", header[4:8])[0]}
    pos = 12
    while pos < len(header):
        cid, size = (
            header[pos : pos + 4].decode(),
            struct.unpack("<I", header[pos + 4 : pos + 8])[0],
        )
        body = header[pos + 8 : pos + 8 + size] if cid != "data" else b""
        out[f"{cid}_size"] = size
        if cid == "fmt ":
            tag, ch, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", body[:16])
            out.update(tag=tag, channels=ch, rate=rate, byte_rate=byte_rate, align=align, bits=bits)
        if cid == "fact":
            out["fact_samples"] = struct.unpack("<I", body)[0]
        if cid == "data":
            out["data_offset"] = pos + 8
            break
        pos += 8 + size
    return out


@pytest.mark.parametrize("encoding", list(AudioEncoding))
@pytest.mark.parametrize("num_samples", [None, 0, 1234, 1235])
def test_header_fields(encoding: AudioEncoding, num_samples: int | None) -> None:
    h = wav_header(16000, encoding, num_samples)
    f = parse(h)
    tag, bits = FORMAT_TAGS[encoding]
    width = bits // 8
    assert (f["tag"], f["channels"], f["rate"], f["bits"]) == (tag, 1, 16000, bits)
    assert (f["align"], f["byte_rate"]) == (width, 16000 * width)
    assert f["data_offset"] == len(h)
    assert f["fmt _size"] == (16 if encoding is AudioEncoding.LINEAR16 else 18)
    assert ("fact_samples" in f) == (encoding is not AudioEncoding.LINEAR16)
    if num_samples is None:
        assert f["riff_size"] == f["data_size"] == UNKNOWN_SIZE
        if "fact_samples" in f:
            assert f["fact_samples"] == UNKNOWN_SIZE
    else:
        data_size = num_samples * width
        assert f["data_size"] == data_size
        assert f["riff_size"] == len(h) - 8 + data_size + (data_size & 1)
        if "fact_samples" in f:
            assert f["fact_samples"] == num_samples


def test_pcm16_header_reads_with_wave_module() -> None:
    x = speech_like(24000, 0.3)
    data = encode(x, AudioEncoding.LINEAR16)
    blob = wav_header(24000, AudioEncoding.LINEAR16, x.size) + data
    with wave.open(io.BytesIO(blob)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == x.size
        assert w.readframes(x.size) == data


def test_write_wav_round_trip(tmp_path: Path) -> None:
    x = speech_like(22050, 0.5)
    path = tmp_path / "out.wav"
    write_wav(path, x, 22050)
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        y = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32767
    assert y.size == x.size
    assert np.max(np.abs(y - x)) <= 0.5 / 32767 + 1e-7


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        wav_header(0, AudioEncoding.LINEAR16, 10)
    with pytest.raises(ValueError):
        wav_header(16000, AudioEncoding.LINEAR16, -1)
    with pytest.raises(ValueError):
        wav_header(16000, AudioEncoding.FLOAT32, 2**30)


class _Pipe(io.BytesIO):
    """What a pipe offers a writer: no seeking back."""

    def seekable(self) -> bool:
        return False


@pytest.mark.parametrize("encoding", [AudioEncoding.LINEAR16, AudioEncoding.MULAW])
def test_wav_stream_into_a_pipe_keeps_the_unknown_sizes_and_flushes_each_piece(encoding: AudioEncoding) -> None:
    out = _Pipe()
    flushed: list[int] = []
    out.flush = lambda: flushed.append(len(out.getvalue()))  # type: ignore[method-assign]
    stream = WavStream(out, encoding)
    pieces = [encode(speech_like(8000, 0.05, seed=k), encoding)[:101 * encoding.bytes_per_sample]
              for k in range(3)]  # 101 samples each
    for piece in pieces:
        stream.write(piece, 8000)
    stream.close()
    header = wav_header(8000, encoding, None)
    assert out.getvalue() == header + b"".join(pieces)
    assert flushed[:3] == [len(header) + len(b"".join(pieces[:k + 1])) for k in range(3)]  # each as written


@pytest.mark.parametrize("encoding", [AudioEncoding.LINEAR16, AudioEncoding.MULAW])
def test_wav_stream_into_a_file_gets_its_real_sizes_at_the_end(encoding: AudioEncoding, tmp_path: Path) -> None:
    path = tmp_path / "out.wav"
    pieces = [encode(speech_like(8000, 0.05, seed=k), encoding)[:202] for k in range(2)]
    pieces.append(pieces[0][:1 if encoding is AudioEncoding.MULAW else 2])  # an odd total for 8-bit samples
    with open(path, "wb") as f:
        stream = WavStream(f, encoding)
        for piece in pieces:
            stream.write(piece, 8000)
        stream.close()
    data = b"".join(pieces)
    samples = len(data) // encoding.bytes_per_sample
    assert path.read_bytes() == wav_header(8000, encoding, samples) + data + b"\0" * (len(data) & 1)
    # Appending to a file: its writes cannot go back to the header, which keeps the unknown sizes.
    with open(path, "ab") as f:
        stream = WavStream(f, encoding)
        stream.write(data, 8000)
        stream.close()
    assert path.read_bytes().endswith(wav_header(8000, encoding, None) + data)


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW"])
@pytest.mark.parametrize("channels", [1, 2])
def test_read_wav_reads_what_soundfile_reads(subtype: str, channels: int) -> None:
    import soundfile

    rng = np.random.default_rng(channels)
    samples = np.clip(0.3 * rng.standard_normal((997, channels)), -1, 1)
    out = io.BytesIO()
    soundfile.write(out, samples, 22_050, subtype=subtype, format="WAV")
    ours, rate = read_wav(out.getvalue())
    reference, _ = soundfile.read(io.BytesIO(out.getvalue()), dtype="float64", always_2d=True)
    assert rate == 22_050 and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference.mean(axis=1), rtol=0, atol=1e-7)


def test_read_wav_reads_back_write_wav(tmp_path: Path) -> None:
    samples = np.sin(np.arange(500) / 7.0).astype(np.float32) * 0.5
    write_wav(tmp_path / "x.wav", samples, 16_000)
    ours, rate = read_wav((tmp_path / "x.wav").read_bytes())
    assert rate == 16_000
    np.testing.assert_allclose(ours, samples, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("data", "message"), [
    (b"RIFF\x00\x00\x00\x00WAVE", "no format or no data chunk"),
    (b"ID3 an mp3 file", "not a WAV file"),
    (wav_header(8000, AudioEncoding.LINEAR16, 0)[:12] + b"data\x00\x00\x00\x00", "data comes before its format"),
])
def test_read_wav_refuses_what_it_cannot_read(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_wav(data)
