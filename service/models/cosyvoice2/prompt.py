"""Zero-shot speakers: a recording and its transcript made into the prompt CosyVoice2 speaks after.

As upstream's frontend (`frontend_zero_shot`, `add_zero_shot_spk`) does it, so a speaker saved here
is the speaker upstream would save from the same recording:
- the recording, mono at 16 kHz, gives the prompt's speech tokens (Whisper's 128-bin log-mel through
  the shipped `speech_tokenizer_v2.onnx`) and the speaker embedding (Kaldi filterbanks, mean
  removed, through `campplus.onnx`);
- resampled to the model's rate it gives the prompt mel the flow continues (the mel of
  `feat_extractor` in cosyvoice2.yaml); mel and tokens are cut to exactly two frames a token.

The features are our own code in NumPy (upstream takes them from torchaudio, Whisper and
Matcha-TTS; the tests hold them to those): a session's prompt is made in the server's API process,
which never loads torch. Entries are plain arrays; `save_speaker` writes them as upstream does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.audio.wav import read_wav
from service.models.cosyvoice2.hyperyaml import ConfigError, Tagged, read_yaml
from service.models.cosyvoice2.text import MAX_SENTENCE_TOKENS, QwenTokenizer
from service.models.cosyvoice2.voices import CONFIG_FILE, QWEN_DIR, SPEAKERS_FILE

TOKENIZER_RATE = 16_000
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
# Upstream's speech tokenizer refuses longer recordings.
MAX_PROMPT_SECONDS = 30.0
MIN_PROMPT_SECONDS = 0.5
# The longest speaker prompt the KV cache holds, in speech tokens (25 per second).
MAX_PROMPT_SPEECH_TOKENS = 1024

Floats = npt.NDArray[np.float32]
Entry = dict[str, np.ndarray]


@dataclass(frozen=True)
class MelConfig:
    """cosyvoice2.yaml's `feat_extractor` (matcha's mel_spectrogram); defaults are CosyVoice2's."""

    n_fft: int = 1920
    num_mels: int = 80
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float = 8000.0


def mel_config(data: dict[str, Any]) -> MelConfig:
    """The prompt mel's settings from cosyvoice2.yaml's data (`read_yaml`)."""
    node = data.get("feat_extractor")
    args = node.args if isinstance(node, Tagged) and isinstance(node.args, dict) else {}
    given = {k: v for k, v in args.items() if k in MelConfig.__dataclass_fields__}
    return MelConfig(**{k: type(getattr(MelConfig, k))(v) for k, v in given.items()})


def resample(samples: np.ndarray, orig: int, new: int) -> Floats:
    """Band-limited (Hann-windowed sinc, 6 zero crossings, 0.99 roll-off) resampling along the last
    axis, as torchaudio's `Resample`, which upstream uses."""
    samples = np.asarray(samples, dtype=np.float32)
    if orig == new:
        return samples
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    zeros, base = 6, min(orig, new) * 0.99
    width = math.ceil(zeros * orig / base)
    idx = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
    offsets = (np.arange(0, -new, -1) / new).astype(np.float32).astype(np.float64)[:, None]
    t = np.clip((offsets + idx) * base, -zeros, zeros)
    window = np.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    kernel = (sinc * window * (base / orig)).astype(np.float32)  # [new, taps]
    shape, n = samples.shape[:-1], samples.shape[-1]
    flat = np.pad(samples.reshape(-1, n), ((0, 0), (width, width + orig)))
    frames = np.lib.stride_tricks.sliding_window_view(flat, kernel.shape[1], axis=1)[:, ::orig]
    out = (frames @ kernel.T).reshape(flat.shape[0], -1)
    return out[:, : math.ceil(new * n / orig)].reshape(*shape, -1).astype(np.float32)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default): linear to 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    step = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / step, f * 3.0 / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    step = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(step * (m - 15.0)), m * 200.0 / 3.0)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> Floats:
    """[n_mels, n_fft // 2 + 1] triangular filters, area-normalised (librosa.filters.mel's defaults)."""
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(fmax)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


def _hann(size: int, periodic: bool) -> np.ndarray:
    n = np.arange(size, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * math.pi * n / (size if periodic else size - 1))


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    return np.lib.stride_tricks.sliding_window_view(x, size, axis=-1)[..., ::hop, :]


def whisper_log_mel(samples: np.ndarray, n_mels: int = 128) -> Floats:
    """Whisper's log-mel of 16 kHz audio ([..., n] -> [..., n_mels, n // 160]): 25 ms Hann frames
    every 10 ms (centred, reflect-padded), power spectrum, log10, floored 8 below the peak, scaled
    to about [-1, 1]."""
    x = np.pad(np.asarray(samples, dtype=np.float64), [(0, 0)] * (np.ndim(samples) - 1) + [(200, 200)],
               mode="reflect")
    power = np.abs(np.fft.rfft(_frames(x, 400, 160) * _hann(400, True), axis=-1)) ** 2
    power = np.swapaxes(power, -1, -2)[..., :-1]  # [..., bins, frames], the last frame dropped
    filters = slaney_mel_filters(TOKENIZER_RATE, 400, n_mels, 0.0, TOKENIZER_RATE / 2).astype(np.float64)
    log = np.log10(np.maximum(filters @ power, 1e-10))
    return ((np.maximum(log, log.max() - 8.0) + 4.0) / 4.0).astype(np.float32)


def kaldi_fbank(samples: np.ndarray, num_mel_bins: int = 80, sample_rate: int = TOKENIZER_RATE) -> Floats:
    """Kaldi's log mel filterbanks ([n] -> [frames, num_mel_bins]) with Kaldi's defaults and no
    dither: 25 ms frames every 10 ms (edges snipped), DC removed, pre-emphasis 0.97, Povey window,
    FFT to a power of two, power spectrum, Kaldi mel bins from 20 Hz to Nyquist, natural log."""
    size, shift = sample_rate * 25 // 1000, sample_rate * 10 // 1000
    x = np.asarray(samples, dtype=np.float64)
    if x.shape[-1] < size:
        return np.zeros((0, num_mel_bins), dtype=np.float32)
    frames = _frames(x, size, shift)
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = (frames - 0.97 * previous) * _hann(size, False) ** 0.85
    padded = 1 << (size - 1).bit_length()
    power = np.abs(np.fft.rfft(frames, n=padded, axis=1)) ** 2
    energies = power @ _kaldi_mel_banks(num_mel_bins, padded, sample_rate).T
    return np.log(np.maximum(energies, np.finfo(np.float32).eps)).astype(np.float32)


@lru_cache(maxsize=4)
def _kaldi_mel_banks(bins: int, padded: int, sample_rate: int) -> np.ndarray:
    """[bins, padded // 2 + 1] Kaldi triangles (mel = 1127 ln(1 + f / 700)), the Nyquist bin zero."""
    low, high = (1127.0 * math.log(1.0 + f / 700.0) for f in (20.0, sample_rate / 2))
    delta = (high - low) / (bins + 1)
    b = np.arange(bins, dtype=np.float64)[:, None]
    left, centre, right = low + b * delta, low + (b + 1.0) * delta, low + (b + 2.0) * delta
    m = 1127.0 * np.log(1.0 + (sample_rate / padded) * np.arange(padded // 2) / 700.0)
    banks = np.maximum(0.0, np.minimum((m - left) / (centre - left), (right - m) / (right - centre)))
    return np.pad(banks, ((0, 0), (0, 1)))


def prompt_mel(samples: np.ndarray, sample_rate: int, config: MelConfig) -> Floats:
    """The flow's mel of mono audio at the model's rate ([n] -> [frames, num_mels]): matcha's
    mel_spectrogram (reflect-padded, uncentred STFT, magnitude, Slaney mel, natural log)."""
    pad = (config.n_fft - config.hop_size) // 2
    x = np.pad(np.asarray(samples, dtype=np.float64), (pad, pad), mode="reflect")
    window = np.zeros(config.n_fft)
    left = (config.n_fft - config.win_size) // 2  # torch.stft centres a shorter window
    window[left: left + config.win_size] = _hann(config.win_size, True)
    spectrum = np.fft.rfft(_frames(x, config.n_fft, config.hop_size) * window, axis=-1)
    magnitude = np.sqrt(spectrum.real ** 2 + spectrum.imag ** 2 + 1e-9)
    filters = slaney_mel_filters(sample_rate, config.n_fft, config.num_mels, config.fmin, config.fmax)
    return np.log(np.maximum(magnitude @ filters.T.astype(np.float64), 1e-5)).astype(np.float32)


class PromptEncoder:
    """The model directory's two ONNX front models (speech tokenizer, speaker embedding) on the
    CPU, and its prompt mel settings."""

    def __init__(self, directory: Path) -> None:
        import onnxruntime

        missing = [n for n in (SPEECH_TOKENIZER_FILE, CAMPPLUS_FILE) if not (directory / n).is_file()]
        if missing:
            raise ConfigError(f"{directory} has no {' or '.join(missing)}: zero-shot speakers need the two ONNX "
                              "models of the official CosyVoice2-0.5B release in the model directory")
        data = read_yaml(directory / CONFIG_FILE)
        self.sample_rate, self.mel = int(data.get("sample_rate", 24_000)), mel_config(data)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        self._tokenizer = onnxruntime.InferenceSession(str(directory / SPEECH_TOKENIZER_FILE), options,
                                                       providers=["CPUExecutionProvider"])
        self._campplus = onnxruntime.InferenceSession(str(directory / CAMPPLUS_FILE), options,
                                                      providers=["CPUExecutionProvider"])

    def speech_tokens(self, audio_16k: np.ndarray) -> npt.NDArray[np.int32]:
        feats = whisper_log_mel(audio_16k[None])
        names = [i.name for i in self._tokenizer.get_inputs()]
        out = self._tokenizer.run(None, {names[0]: feats, names[1]: np.array([feats.shape[2]], dtype=np.int32)})[0]
        return np.asarray(out).reshape(1, -1).astype(np.int32)

    def embedding(self, audio_16k: np.ndarray) -> Floats:
        feats = kaldi_fbank(audio_16k)
        feats = feats - feats.mean(axis=0, keepdims=True)
        out = self._campplus.run(None, {self._campplus.get_inputs()[0].name: feats[None]})[0]
        return np.asarray(out, dtype=np.float32).reshape(1, -1)

    def speaker(self, samples: npt.ArrayLike, sample_rate: int, prompt_text: list[int] | None) -> Entry:
        """A `spk2info.pt` entry (upstream's keys, shapes and dtypes, as arrays) for mono `samples`
        at `sample_rate` (16 kHz or more) spoken as the Qwen2 ids `prompt_text`. None: words
        unknown, so the LM gets no prompt and only the flow imitates the recording (upstream's
        cross-lingual mode)."""
        audio = np.asarray(samples, dtype=np.float32).reshape(-1)
        seconds = len(audio) / sample_rate
        if sample_rate < TOKENIZER_RATE:
            raise ValueError(f"the prompt recording is at {sample_rate} Hz; record or export it at "
                             f"{TOKENIZER_RATE} Hz or more")
        if not MIN_PROMPT_SECONDS <= seconds <= MAX_PROMPT_SECONDS:
            raise ValueError(f"the prompt recording is {seconds:.1f} s long; use {MIN_PROMPT_SECONDS:g} to "
                             f"{MAX_PROMPT_SECONDS:g} s of the speaker (3 to 10 s of clean speech works best)")
        if prompt_text is not None and not prompt_text:
            raise ValueError("the prompt transcript is empty; give the words spoken in the recording")
        if prompt_text is not None and len(prompt_text) > MAX_SENTENCE_TOKENS:
            raise ValueError(f"the prompt transcript is {len(prompt_text)} tokens; at most {MAX_SENTENCE_TOKENS} "
                             "fit: use a shorter recording and its transcript")
        audio_16k = resample(audio, sample_rate, TOKENIZER_RATE)
        mel = prompt_mel(resample(audio_16k, TOKENIZER_RATE, self.sample_rate), self.sample_rate, self.mel)
        tokens = self.speech_tokens(audio_16k)
        n = min(len(mel) // 2, tokens.shape[1])
        mel, tokens = mel[None, : 2 * n], np.ascontiguousarray(tokens[:, :n])
        embedding = self.embedding(audio_16k)

        def length(a: np.ndarray) -> npt.NDArray[np.int32]:
            return np.array([a.shape[1]], dtype=np.int32)

        entry = {"flow_prompt_speech_token": tokens, "flow_prompt_speech_token_len": length(tokens),
                 "prompt_speech_feat": mel, "prompt_speech_feat_len": length(mel),
                 "llm_embedding": embedding, "flow_embedding": embedding}
        if prompt_text is not None:
            text = np.array([prompt_text], dtype=np.int32)
            entry |= {"prompt_text": text, "prompt_text_len": length(text),
                      "llm_prompt_speech_token": tokens, "llm_prompt_speech_token_len": length(tokens)}
        return entry


@lru_cache(maxsize=4)
def _encoder(directory: Path) -> tuple[PromptEncoder, QwenTokenizer]:
    return PromptEncoder(directory), QwenTokenizer(directory / QWEN_DIR)


def make_speaker(directory: Path, wav: bytes, transcript: str | None) -> Entry:
    """The `spk2info.pt` entry of a recording (a WAV file's bytes) and the words spoken in it (None:
    not known, cross-lingual), for the model directory `directory` (its tokenizer, its two ONNX
    front models, its mel settings). ValueError (ConfigError for the directory) says what to change."""
    encoder, tokenizer = _encoder(Path(directory))
    ids = None if transcript is None else tokenizer.encode(" ".join(transcript.split()))[0]
    samples, rate = read_wav(wav)
    return encoder.speaker(samples, rate, ids)


def save_speaker(directory: Path, name: str, entry: Entry) -> Path:
    """Add (or replace) speaker `name` in the directory's `spk2info.pt` as torch tensors, as
    upstream's `add_zero_shot_spk` + `save_spkinfo` do; written to a new file, then renamed over
    the old."""
    import torch

    if not name.strip() or name != name.strip():
        raise ValueError(f"speaker name {name!r}: give a non-empty name without leading or trailing spaces")
    path = directory / SPEAKERS_FILE
    table = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else {}
    table[name] = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in entry.items()}
    partial = path.with_name(path.name + ".partial")
    torch.save(table, partial)
    partial.replace(path)
    return path
