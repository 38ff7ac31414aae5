"""Zero-shot speakers from a recording: our features against the originals upstream computes them
with (torchaudio's resampler and Kaldi filterbanks, Whisper's log-mel, Matcha-TTS's mel), the whole
speaker against upstream's own frontend on the same files, `cadenza voices add-speaker`, and a
per-session voice prompt (`cadenza say --prompt-wav`) speaking as the saved speaker."""

from __future__ import annotations

import io
import re
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from service.cli import main
from service.models.cosyvoice2 import prompt
from service.models.cosyvoice2.config import ConfigError, read_config
from service.models.cosyvoice2.official import official
from service.models.cosyvoice2.runtime import load_speakers
from service.models.cosyvoice2.voices import QWEN_DIR, SPEAKERS_FILE, speaker_names

TRANSCRIPT = "This is the voice I would like you to copy."


def voiced(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Speech-like test audio: a gliding harmonic tone, syllable-rate amplitude, breath noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * tone * envelope + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, subtype=subtype, format="WAV")
    return out.getvalue()


@pytest.mark.parametrize(("orig", "new"), [(16_000, 24_000), (44_100, 16_000), (48_000, 16_000), (22_050, 16_000)])
def test_resample_matches_torchaudio(orig: int, new: int) -> None:
    from torchaudio.transforms import Resample

    x = voiced(0.731, orig)[None]
    ours = torch.from_numpy(prompt.resample(x, orig, new))
    torch.testing.assert_close(ours, Resample(orig, new)(torch.from_numpy(x)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seconds", [0.0250625, 0.5, 2.37])  # the first: one frame
def test_kaldi_fbank_matches_torchaudio(seconds: float) -> None:
    from torchaudio.compliance import kaldi

    x = voiced(seconds, 16_000)
    reference = kaldi.fbank(torch.from_numpy(x)[None], num_mel_bins=80, dither=0, sample_frequency=16_000)
    ours = torch.from_numpy(prompt.kaldi_fbank(x))
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


def test_whisper_log_mel_matches_whisper() -> None:
    import whisper

    x = voiced(2.37, 16_000)[None]
    torch.testing.assert_close(torch.from_numpy(prompt.whisper_log_mel(x)),
                               whisper.log_mel_spectrogram(torch.from_numpy(x), n_mels=128), rtol=0, atol=1e-5)


def test_slaney_filters_match_librosa() -> None:
    import librosa

    for rate, n_fft, mels, fmax in ((16_000, 400, 128, 8000.0), (24_000, 1920, 80, 8000.0)):
        ours = prompt.slaney_mel_filters(rate, n_fft, mels, 0.0, fmax)
        np.testing.assert_allclose(ours, librosa.filters.mel(sr=rate, n_fft=n_fft, n_mels=mels, fmin=0, fmax=fmax),
                                   rtol=0, atol=1e-7)


def test_prompt_mel_matches_matcha(cosyvoice2_dir: Path) -> None:
    config = read_config(cosyvoice2_dir)
    mel = config.prompt_mel
    x = voiced(1.63, 24_000)
    reference = official("matcha.utils.audio").mel_spectrogram(
        torch.from_numpy(x)[None], mel.n_fft, mel.num_mels, 24_000, mel.hop_size, mel.win_size, mel.fmin, mel.fmax,
        center=False)
    torch.testing.assert_close(torch.from_numpy(prompt.prompt_mel(x, 24_000, mel)), reference[0].T, rtol=0,
                               atol=1e-5)


def upstream_speaker(directory: Path, wav: bytes) -> dict[str, torch.Tensor]:
    """What upstream saves for this recording: its `load_wav` (soundfile, channels averaged,
    torchaudio resampled to 16 kHz) and its frontend's `frontend_zero_shot`, with the directory's
    tokenizer, ONNX models and feat_extractor."""
    import onnxruntime
    import torchaudio

    frontend_module = official("cosyvoice.cli.frontend")
    tokenizer_module = official("cosyvoice.tokenizer.tokenizer")
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32", always_2d=True)
    speech = torch.from_numpy(audio.T).mean(dim=0, keepdim=True)
    speech_16k = torchaudio.transforms.Resample(rate, 16_000)(speech) if rate != 16_000 else speech
    mel = read_config(directory).prompt_mel
    frontend = frontend_module.CosyVoiceFrontEnd.__new__(frontend_module.CosyVoiceFrontEnd)
    frontend.tokenizer = tokenizer_module.QwenTokenizer(str(directory / QWEN_DIR))
    frontend.allowed_special = "all"
    frontend.device = torch.device("cpu")
    frontend.feat_extractor = partial(official("matcha.utils.audio").mel_spectrogram, n_fft=mel.n_fft,
                                      num_mels=mel.num_mels, sampling_rate=24_000, hop_size=mel.hop_size,
                                      win_size=mel.win_size, fmin=mel.fmin, fmax=mel.fmax, center=False)
    frontend.campplus_session = onnxruntime.InferenceSession(str(directory / prompt.CAMPPLUS_FILE))
    frontend.speech_tokenizer_session = onnxruntime.InferenceSession(str(directory / prompt.SPEECH_TOKENIZER_FILE))
    entry = frontend.frontend_zero_shot("", TRANSCRIPT, speech_16k, 24_000, "")
    del entry["text"], entry["text_len"]  # as add_zero_shot_spk does
    return dict(entry)


@pytest.mark.parametrize(("rate", "channels", "subtype"), [(16_000, 1, "PCM_16"), (22_050, 2, "PCM_16"),
                                                           (48_000, 1, "FLOAT")])
def test_speaker_matches_upstream_frontend(cosyvoice2_dir: Path, rate: int, channels: int, subtype: str) -> None:
    mono = voiced(3.3, rate, seed=rate)
    samples = np.stack([mono, 0.5 * mono], axis=1) if channels == 2 else mono
    wav = wav_bytes(samples, rate, subtype)
    ours = {k: torch.from_numpy(v) for k, v in prompt.make_speaker(cosyvoice2_dir, wav, TRANSCRIPT).items()}
    reference = upstream_speaker(cosyvoice2_dir, wav)
    assert sorted(ours) == sorted(reference)
    for key, value in reference.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        if value.dtype.is_floating_point:
            torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-4, msg=key)
        else:
            assert torch.equal(ours[key], value), key
    tokens = ours["llm_prompt_speech_token"]
    assert ours["prompt_speech_feat"].shape[1] == 2 * tokens.shape[1] > 0
    assert len(set(tokens[0].tolist())) > 5  # the stand-in tokenizer sees the audio change


def test_add_speaker_then_speak_with_it(cosyvoice2_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "CosyVoice2-test"
    shutil.copytree(cosyvoice2_dir, directory)
    before = speaker_names(directory / SPEAKERS_FILE)
    (tmp_path / "ref.wav").write_bytes(wav_bytes(voiced(2.5, 22_050), 22_050))
    assert main(["voices", "add-speaker", str(directory), "--name", "alice", "--wav", str(tmp_path / "ref.wav"),
                 "--text", TRANSCRIPT]) == 0
    shown = capsys.readouterr().out
    assert "saved speaker 'alice' (62 speech tokens, 2.5 s)" in shown and f"--voice {directory}" in shown
    names = speaker_names(directory / SPEAKERS_FILE)
    assert names == sorted([*before, "alice"])
    speaker = load_speakers(directory / SPEAKERS_FILE, 80, 192)[names.index("alice")]
    assert speaker.llm_prompt_speech.shape == (62,) and speaker.prompt_mel.shape == (1, 124, 80)
    for name in ("alice", before[0]):
        out = tmp_path / f"{name}.wav"
        assert main(["say", "--voice", str(directory), "--speaker", name, "Nice to meet you.", "-o", str(out)]) == 0
        audio, rate = soundfile.read(out)
        assert rate == 24_000 and len(audio) > 2400 and np.isfinite(audio).all()
    # the same recording as a per-session voice prompt speaks as the saved speaker does
    say = ["say", "--voice", str(directory), "--seed", "3", "Nice to meet you."]
    assert main([*say, "--speaker", "alice", "-o", str(tmp_path / "saved.wav")]) == 0
    assert main([*say, "--prompt-wav", str(tmp_path / "ref.wav"), "--prompt-text", TRANSCRIPT,
                 "-o", str(tmp_path / "prompted.wav")]) == 0
    assert (tmp_path / "saved.wav").read_bytes() == (tmp_path / "prompted.wav").read_bytes()
    # saving again under the same name replaces that speaker
    (tmp_path / "other.wav").write_bytes(wav_bytes(voiced(1.5, 16_000, seed=9), 16_000))
    assert main(["voices", "add-speaker", str(directory), "--name", "alice", "--wav", str(tmp_path / "other.wav"),
                 "--text", "Hello."]) == 0
    assert speaker_names(directory / SPEAKERS_FILE) == names
    assert load_speakers(directory / SPEAKERS_FILE, 80, 192)[names.index("alice")].llm_prompt_speech.shape == (37,)


@pytest.mark.parametrize(("wav", "text", "message"), [
    (b"not a wav at all", TRANSCRIPT, "not a WAV file"),
    (wav_bytes(voiced(2.0, 8_000), 8_000), TRANSCRIPT, "at 8000 Hz; record or export it at 16000 Hz or more"),
    (wav_bytes(voiced(0.2, 16_000), 16_000), TRANSCRIPT, "is 0.2 s long; use 0.5 to 30 s"),
    (wav_bytes(voiced(31.0, 16_000), 16_000), TRANSCRIPT, "is 31.0 s long"),
    (wav_bytes(voiced(2.0, 16_000), 16_000), "  ", "the prompt transcript is empty"),
    (wav_bytes(voiced(2.0, 16_000), 16_000), "word " * 200, "at most 80 fit"),
])
def test_bad_recordings_are_refused_saying_what_to_change(cosyvoice2_dir: Path, wav: bytes, text: str,
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        prompt.make_speaker(cosyvoice2_dir, wav, text)


def test_a_directory_without_the_onnx_models_is_refused(cosyvoice2_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "CosyVoice2-test"
    shutil.copytree(cosyvoice2_dir, directory)
    (directory / prompt.CAMPPLUS_FILE).unlink()
    with pytest.raises(ConfigError, match=r"has no campplus\.onnx: zero-shot speakers need"):
        prompt.make_speaker(directory, wav_bytes(voiced(2.0, 16_000), 16_000), TRANSCRIPT)
    (tmp_path / "ref.wav").write_bytes(wav_bytes(voiced(2.0, 16_000), 16_000))
    assert main(["voices", "add-speaker", str(directory), "--name", "x", "--wav", str(tmp_path / "ref.wav"),
                 "--text", TRANSCRIPT]) != 0
    assert "has no campplus.onnx" in capsys.readouterr().err
    assert main(["voices", "add-speaker", str(tmp_path), "--name", "x", "--wav", str(tmp_path / "ref.wav"),
                 "--text", TRANSCRIPT]) != 0
    assert "is not a CosyVoice2 model directory" in capsys.readouterr().err
