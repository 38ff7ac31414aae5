"""A Kokoro voice through the family contract: the registry recognises the fetched packs, the
acoustic stage gives frames, word spans and a seeded decoder input, and the reference decode is
speech an offline recogniser transcribes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.family import AcousticJob, SynthesisParams, utterance_rng
from service.models.kokoro import weights as kw
from service.models.kokoro.runtime import KokoroRuntime, KokoroUtterance
from service.models.registry import discover, open_frontend, open_voice, recognise
from service.text.frontend import PhonemizedSentence
from tests.asr import transcribe

TEXT = "Hello world, this is a test of the Kokoro model."
WORDS = ["hello", "world", "this", "is", "a", "test", "of", "the", "kokoro", "model"]


@pytest.fixture(scope="module")
def home() -> Path:
    cache = kw.default_cache_dir()
    kw.fetch_model(cache)
    kw.fetch_voices(cache)
    return cache


@pytest.fixture(scope="module")
def runtime(home: Path) -> KokoroRuntime:
    info = recognise(home / "voices" / "af_heart.bin")
    loaded = open_voice(info, "auto", "cpu", threads=2)
    assert isinstance(loaded, KokoroRuntime)
    return loaded


def sentence(runtime: KokoroRuntime) -> PhonemizedSentence:
    """TEXT through the voice's own frontend (misaki, as the official pipeline runs it)."""
    (sent,) = open_frontend(runtime.info.frontend_key).sentences(TEXT)
    return sent


def test_the_fetched_packs_are_kokoro_voices(home: Path) -> None:
    voices = discover(home)
    names = {v.name for v in voices}
    assert len(voices) == kw.VOICE_COUNT and "kokoro-af_heart" in names and "kokoro-bm_george" in names
    heart = next(v for v in voices if v.name == "kokoro-af_heart")
    assert (heart.family, heart.language, heart.sample_rate) == ("kokoro", "en-US", 24_000)
    assert next(v for v in voices if v.name == "kokoro-bf_emma").language == "en-GB"


def test_a_sentence_is_speech_with_word_spans(runtime: KokoroRuntime) -> None:
    sent = sentence(runtime)
    job = AcousticJob(sent, None, SynthesisParams(seed=1), utterance_rng(1, sent.phoneme_ids))
    (utt,) = runtime.acoustic_batch([job])
    assert isinstance(utt, KokoroUtterance)
    audio = runtime.reference(utt)
    assert len(audio) == utt.frames * runtime.hop and np.isfinite(audio).all()
    assert 2.0 < len(audio) / runtime.sample_rate < 5.0
    starts = [s for _, s, _ in utt.word_spans]
    assert [w.lower().strip(",.") for w, _, _ in utt.word_spans] == WORDS and starts == sorted(starts)
    assert all(s < e <= len(audio) for _, s, e in utt.word_spans)
    hyp = transcribe(audio, runtime.sample_rate)
    assert sum(w in hyp for w in WORDS) >= 6, hyp  # "kokoro" is in no dictionary


def test_the_same_seed_gives_the_same_audio(runtime: KokoroRuntime) -> None:
    sent = sentence(runtime)

    def speak(seed: int) -> np.ndarray:
        (utt,) = runtime.acoustic_batch([AcousticJob(sent, None, SynthesisParams(seed=seed),
                                                     utterance_rng(seed, sent.phoneme_ids))])
        return runtime.reference(utt)

    a, b, c = speak(3), speak(3), speak(4)
    assert np.array_equal(a, b)
    assert len(a) == len(c) and not np.array_equal(a, c)  # the sine source's noise differs
