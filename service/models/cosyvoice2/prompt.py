"""Zero-shot speakers: a recording and its transcript made into the prompt CosyVoice2 speaks after.

As upstream's frontend (`frontend_zero_shot`, `add_zero_shot_spk`) does it, so a speaker saved here
is the speaker upstream would save from the same recording:
- the recording, mono at 16 kHz, gives the prompt's speech tokens (Whisper's 128-bin log-mel through
  the shipped `speech_tokenizer_v2.onnx`) and the speaker embedding (Kaldi filterbanks, mean
  removed, through `campplus.onnx`);
- resampled to the model's rate it gives the prompt mel the flow continues (the mel of
  `feat_extractor` in cosyvoice2.yaml); mel and tokens are cut to exactly two frames a token.

The features are our own code (upstream takes them from torchaudio, Whisper and Matcha-TTS, which
we do not ship); the tests hold them to those originals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from service.audio.wav import read_wav
from service.models.cosyvoice2.config import QWEN_DIR, ConfigError, MelConfig, read_config
from service.models.cosyvoice2.text import MAX_SENTENCE_TOKENS, QwenTokenizer
from service.models.cosyvoice2.voices import SPEAKERS_FILE

TOKENIZER_RATE = 16_000
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
# Upstream's speech tokenizer refuses longer recordings.
MAX_PROMPT_SECONDS = 30.0
MIN_PROMPT_SECONDS = 0.5


def resample(samples: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """Band-limited (Hann-windowed sinc, 6 zero crossings, 0.99 roll-off) resampling along the last
    axis, sample for sample as torchaudio's `Resample`, which upstream uses."""
    if orig == new:
        return samples
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    zeros, base = 6, min(orig, new) * 0.99
    width = math.ceil(zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = ((torch.arange(0, -new, -1)[:, None, None] / new + idx) * base).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = (torch.where(t == 0, torch.ones_like(t), t.sin() / t) * window * (base / orig)).float()
    shape, n = samples.shape[:-1], samples.shape[-1]
    flat = torch.nn.functional.pad(samples.reshape(-1, n), (width, width + orig))
    out = torch.nn.functional.conv1d(flat[:, None], kernel, stride=orig).transpose(1, 2).reshape(flat.shape[0], -1)
    return out[:, : math.ceil(new * n / orig)].reshape(*shape, -1)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default): linear to 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    step = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / step, f * 3.0 / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    step = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(step * (m - 15.0)), m * 200.0 / 3.0)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters, area-normalised (librosa.filters.mel's defaults)."""
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(fmax)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def whisper_log_mel(samples: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper's log-mel of 16 kHz audio ([..., n] -> [..., n_mels, n // 160]): 25 ms Hann frames
    every 10 ms, power spectrum, log10, floored 8 below the peak, scaled to about [-1, 1]."""
    stft = torch.stft(samples, 400, 160, window=torch.hann_window(400), return_complex=True)
    power = stft[..., :-1].abs() ** 2
    log = (slaney_mel_filters(TOKENIZER_RATE, 400, n_mels, 0.0, TOKENIZER_RATE / 2) @ power).clamp(min=1e-10).log10()
    return (torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0


def kaldi_fbank(samples: torch.Tensor, num_mel_bins: int = 80, sample_rate: int = TOKENIZER_RATE) -> torch.Tensor:
    """Kaldi's log mel filterbanks ([n] -> [frames, num_mel_bins]) with Kaldi's defaults and no
    dither: 25 ms frames every 10 ms (edges snipped), DC removed, pre-emphasis 0.97, Povey window,
    FFT to a power of two, power spectrum, Kaldi mel bins from 20 Hz to Nyquist, natural log."""
    size, shift = sample_rate * 25 // 1000, sample_rate * 10 // 1000
    if samples.shape[-1] < size:
        return torch.zeros(0, num_mel_bins)
    frames = samples.unfold(-1, size, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = (frames - 0.97 * previous) * torch.hann_window(size, periodic=False).pow(0.85)
    padded = 1 << (size - 1).bit_length()
    power = torch.fft.rfft(torch.nn.functional.pad(frames, (0, padded - size))).abs().pow(2.0)
    return (power @ _kaldi_mel_banks(num_mel_bins, padded, sample_rate).T).clamp(
        min=torch.finfo(torch.float32).eps).log()


@lru_cache(maxsize=4)
def _kaldi_mel_banks(bins: int, padded: int, sample_rate: int) -> torch.Tensor:
    """[bins, padded // 2 + 1] Kaldi triangles (mel = 1127 ln(1 + f / 700)), the Nyquist bin zero."""
    low, high = (1127.0 * math.log(1.0 + f / 700.0) for f in (20.0, sample_rate / 2))
    delta = (high - low) / (bins + 1)
    b = torch.arange(bins).unsqueeze(1)
    left, centre, right = low + b * delta, low + (b + 1.0) * delta, low + (b + 2.0) * delta
    m = 1127.0 * (1.0 + (sample_rate / padded) * torch.arange(padded // 2) / 700.0).log()
    up, down = (m - left) / (centre - left), (right - m) / (right - centre)
    banks = torch.clamp(torch.min(up, down), min=0.0)
    return torch.nn.functional.pad(banks, (0, 1))


def prompt_mel(samples: torch.Tensor, sample_rate: int, config: MelConfig) -> torch.Tensor:
    """The flow's mel of audio at the model's rate ([1, n] -> [1, frames, num_mels]): matcha's
    mel_spectrogram (reflect-padded, uncentred STFT, magnitude, Slaney mel, natural log)."""
    pad = (config.n_fft - config.hop_size) // 2
    x = torch.nn.functional.pad(samples[:, None], (pad, pad), mode="reflect")[:, 0]
    spec = torch.stft(x, config.n_fft, config.hop_size, config.win_size, torch.hann_window(config.win_size),
                      center=False, return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    filters = slaney_mel_filters(sample_rate, config.n_fft, config.num_mels, config.fmin, config.fmax)
    return torch.log(torch.clamp(filters @ magnitude, min=1e-5)).transpose(1, 2)


# The longest speaker prompt the KV cache holds, in speech tokens (25 per second).
MAX_PROMPT_SPEECH_TOKENS = 1024


@dataclass(frozen=True)
class Speaker:
    """A speaker as the LM and the flow take it (no LM prompt for an SFT or cross-lingual speaker)."""

    prompt_text: torch.Tensor  # [Lt] Qwen2 ids
    llm_prompt_speech: torch.Tensor  # [P] speech tokens
    flow_prompt_tokens: torch.Tensor  # [1, P']
    prompt_mel: torch.Tensor  # [1, 2P', 80]
    embedding: torch.Tensor  # [1, 192]


def _ids(value: Any) -> torch.Tensor:
    return torch.as_tensor(value).reshape(-1).long() if value is not None else torch.zeros(0, dtype=torch.long)


def speaker_from_entry(entry: dict[str, Any], mel_bins: int) -> Speaker:
    """A `spk2info.pt` entry (upstream's keys) as a Speaker; ValueError if it cannot be one."""
    embedding = entry.get("flow_embedding", entry.get("embedding"))
    if embedding is None:
        raise ValueError("a speaker has no embedding ('flow_embedding' or 'embedding')")
    flow_tokens = _ids(entry.get("flow_prompt_speech_token"))
    mel = entry.get("prompt_speech_feat")
    mel = torch.zeros(1, 0, mel_bins) if mel is None else torch.as_tensor(mel).float().reshape(1, -1, mel_bins)
    n = min(mel.shape[1] // 2, flow_tokens.shape[0])  # upstream keeps the mel at two frames a token
    prompt_text, prompt_speech = _ids(entry.get("prompt_text")), _ids(entry.get("llm_prompt_speech_token"))
    if len(prompt_text) > MAX_SENTENCE_TOKENS or len(prompt_speech) > MAX_PROMPT_SPEECH_TOKENS:
        raise ValueError(
            f"a speaker prompt of {len(prompt_text)} text and {len(prompt_speech)} speech tokens; at most "
            f"{MAX_SENTENCE_TOKENS} and {MAX_PROMPT_SPEECH_TOKENS} ({MAX_PROMPT_SPEECH_TOKENS // 25} s) fit the "
            "KV cache: make it again from a shorter recording")
    return Speaker(prompt_text, prompt_speech, flow_tokens[:n][None], mel[:, : 2 * n],
                   torch.as_tensor(embedding).float().reshape(1, -1))


class PromptEncoder:
    """The model directory's two ONNX front models (speech tokenizer, speaker embedding), run on
    the CPU as upstream runs the embedding."""

    def __init__(self, directory: Path, sample_rate: int, mel: MelConfig) -> None:
        import onnxruntime

        missing = [n for n in (SPEECH_TOKENIZER_FILE, CAMPPLUS_FILE) if not (directory / n).is_file()]
        if missing:
            raise ConfigError(f"{directory} has no {' or '.join(missing)}: zero-shot speakers need the two ONNX "
                              "models of the official CosyVoice2-0.5B release in the model directory")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        self._tokenizer = onnxruntime.InferenceSession(str(directory / SPEECH_TOKENIZER_FILE), options,
                                                       providers=["CPUExecutionProvider"])
        self._campplus = onnxruntime.InferenceSession(str(directory / CAMPPLUS_FILE), options,
                                                      providers=["CPUExecutionProvider"])
        self.sample_rate, self.mel = sample_rate, mel

    def speech_tokens(self, audio_16k: torch.Tensor) -> torch.Tensor:
        feats = whisper_log_mel(audio_16k).numpy()
        names = [i.name for i in self._tokenizer.get_inputs()]
        out = self._tokenizer.run(None, {names[0]: feats, names[1]: np.array([feats.shape[2]], dtype=np.int32)})[0]
        return torch.as_tensor(np.asarray(out).reshape(1, -1), dtype=torch.int32)

    def embedding(self, audio_16k: torch.Tensor) -> torch.Tensor:
        feats = kaldi_fbank(audio_16k[0])
        feats = feats - feats.mean(dim=0, keepdim=True)
        out = self._campplus.run(None, {self._campplus.get_inputs()[0].name: feats[None].numpy()})[0]
        return torch.as_tensor(np.asarray(out, dtype=np.float32).reshape(1, -1))

    def speaker(self, samples: npt.ArrayLike, sample_rate: int,
                prompt_text: list[int] | None) -> dict[str, torch.Tensor]:
        """A `spk2info.pt` entry (upstream's keys and dtypes) for mono `samples` at `sample_rate`
        (16 kHz or more) spoken as the Qwen2 ids `prompt_text`. None: words unknown, so the LM gets
        no prompt and only the flow imitates the recording (upstream's cross-lingual mode)."""
        audio = torch.as_tensor(np.asarray(samples, dtype=np.float32)).reshape(1, -1)
        seconds = audio.shape[1] / sample_rate
        if sample_rate < TOKENIZER_RATE:
            raise ValueError(f"the prompt recording is at {sample_rate} Hz; record or export it at "
                             f"{TOKENIZER_RATE} Hz or more")
        if not MIN_PROMPT_SECONDS <= seconds <= MAX_PROMPT_SECONDS:
            raise ValueError(f"the prompt recording is {seconds:.1f} s long; use {MIN_PROMPT_SECONDS:g} to "
                             f"{MAX_PROMPT_SECONDS:g} s of the speaker (3 to 10 s of clean speech works best)")
        if prompt_text is not None and not prompt_text:
            raise ValueError("the prompt transcript is empty; give the words spoken in the recording")
        audio_16k = resample(audio, sample_rate, TOKENIZER_RATE)
        mel = prompt_mel(resample(audio_16k, TOKENIZER_RATE, self.sample_rate), self.sample_rate, self.mel)
        tokens = self.speech_tokens(audio_16k)
        n = min(mel.shape[1] // 2, tokens.shape[1])
        mel, tokens = mel[:, : 2 * n].contiguous(), tokens[:, :n].contiguous()
        embedding = self.embedding(audio_16k)
        length = lambda t: torch.tensor([t.shape[1]], dtype=torch.int32)  # noqa: E731
        entry = {"flow_prompt_speech_token": tokens, "flow_prompt_speech_token_len": length(tokens),
                 "prompt_speech_feat": mel, "prompt_speech_feat_len": length(mel),
                 "llm_embedding": embedding, "flow_embedding": embedding}
        if prompt_text is not None:
            text = torch.tensor([prompt_text], dtype=torch.int32)
            entry |= {"prompt_text": text, "prompt_text_len": length(text),
                      "llm_prompt_speech_token": tokens, "llm_prompt_speech_token_len": length(tokens)}
        return entry


@lru_cache(maxsize=4)
def _encoder(directory: Path) -> tuple[PromptEncoder, QwenTokenizer, int]:
    config = read_config(directory)
    return (PromptEncoder(directory, config.sample_rate, config.prompt_mel), QwenTokenizer(directory / QWEN_DIR),
            config.flow.output_size)


def make_speaker(directory: Path, wav: bytes, transcript: str | None) -> dict[str, torch.Tensor]:
    """The `spk2info.pt` entry of a recording (a WAV file's bytes) and the words spoken in it (None:
    not known, cross-lingual), for the model directory `directory` (its tokenizer, its two ONNX
    front models, its mel settings)."""
    encoder, tokenizer, _ = _encoder(directory)
    ids = None if transcript is None else tokenizer.encode(" ".join(transcript.split()))[0]
    if ids is not None and len(ids) > MAX_SENTENCE_TOKENS:
        raise ValueError(f"the prompt transcript is {len(ids)} tokens; at most {MAX_SENTENCE_TOKENS} fit: "
                         "use a shorter recording and its transcript")
    samples, rate = read_wav(wav)
    return encoder.speaker(samples, rate, ids)


def voice_prompt(directory: Path, wav: bytes, transcript: str | None) -> dict[str, np.ndarray]:
    """A session's own speaker from a recording (`make_speaker`), as plain arrays (it crosses to
    the engine core by pickle); the runtime makes it a Speaker with `speaker_from_entry`."""
    entry = make_speaker(directory, wav, transcript)
    speaker_from_entry(entry, _encoder(directory)[2])  # refused here, not on the engine thread
    return {key: value.numpy() for key, value in entry.items()}


def save_speaker(directory: Path, name: str, entry: dict[str, torch.Tensor]) -> Path:
    """Add (or replace) speaker `name` in the directory's `spk2info.pt`, as upstream's
    `add_zero_shot_spk` + `save_spkinfo` do; written to a new file, then renamed over the old."""
    if not name.strip() or name != name.strip():
        raise ValueError(f"speaker name {name!r}: give a non-empty name without leading or trailing spaces")
    path = directory / SPEAKERS_FILE
    table = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else {}
    table[name] = entry
    partial = path.with_name(path.name + ".partial")
    torch.save(table, partial)
    partial.replace(path)
    return path
