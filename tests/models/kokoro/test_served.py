"""A Kokoro voice served by the engine the server runs (segmenter, scheduler, executor, output),
in this process: speech with word timings, the same audio for the same seed, 24 kHz."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.audio.encoding import AudioEncoding
from service.engine.config import EngineConfig
from service.engine.contract import AudioOut, SessionConfig
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from tests.asr import transcribe

TEXT = "Thank you for calling. How can I help you today?"


@pytest.fixture(scope="module")
def local(kokoro_home: Path) -> Iterator[LocalEngine]:
    config = EngineConfig(voice="kokoro-af_heart", voices_dir=kokoro_home, device="cpu", threads=2, core="thread",
                          cache_bytes=0, frontend=FrontendPoolConfig(workers=0), warmup_text="Hello.")
    with LocalEngine(config) as engine:
        yield engine


def speak(local: LocalEngine, seed: int) -> tuple[np.ndarray, list[AudioOut]]:
    config = SessionConfig(seed=seed, encoding=AudioEncoding.FLOAT32, word_timings=True)
    events = [e for e in local.stream(TEXT, config) if isinstance(e, AudioOut)]
    return np.concatenate([np.frombuffer(e.audio, dtype="<f4") for e in events]), events


def test_served_speech_with_word_timings(local: LocalEngine) -> None:
    audio, events = speak(local, 1)
    assert local.sample_rate == 24_000 and {e.sample_rate for e in events} == {24_000}
    assert len(events) > 2  # chunks, two utterances
    words = [w.word.lower().strip(".,?") for e in events for w in e.words]
    assert words == "thank you for calling how can i help you today".split()
    hyp = transcribe(audio, 24_000)
    assert sum(w in hyp for w in words) >= 7, hyp


def test_the_same_seed_serves_the_same_audio(local: LocalEngine) -> None:
    a, _ = speak(local, 5)
    b, _ = speak(local, 5)
    assert np.array_equal(a, b)


def test_a_long_sentence_is_served_in_growing_pieces(local: LocalEngine) -> None:
    """The decoder needs a whole utterance, so a long first sentence goes out in pieces: the first
    short (first audio waits for it alone), later ones longer, and every word spoken once, in order."""
    text = ("The quarterly report shows that revenue grew by twelve percent compared with the same "
            "period last year, driven mostly by strong demand in the European and Asian markets.")
    config = SessionConfig(seed=2, encoding=AudioEncoding.FLOAT32, word_timings=True)
    events = [e for e in local.stream(text, config) if isinstance(e, AudioOut)]
    by_utterance: dict[int, list[AudioOut]] = {}
    for e in events:
        by_utterance.setdefault(e.utterance, []).append(e)
    seconds = [sum(len(e.audio) for e in es) / 4 / 24_000 for _, es in sorted(by_utterance.items())]
    assert len(seconds) >= 3 and seconds[0] < 2.5 and seconds[0] < seconds[-1], seconds
    words = [w.word.lower().strip(".,") for e in events for w in e.words]
    assert words == text.lower().replace(",", "").replace(".", "").split()
