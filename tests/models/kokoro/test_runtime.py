"""A Kokoro voice through the family contract: the registry recognises the fetched packs, the
acoustic stage gives frames, word spans and a seeded decoder input, and the reference decode is
speech an offline recogniser transcribes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.family import AcousticJob, Gender, StepRows, SynthesisParams, utterance_rng
from service.models.kokoro.runtime import KokoroRuntime, KokoroUtterance
from service.models.registry import discover, open_frontend, open_voice, recognise
from service.text.frontend import PhonemizedSentence
from tests.asr import transcribe

TEXT = "Hello world, this is a test of the Kokoro model."
WORDS = ["hello", "world", "this", "is", "a", "test", "of", "the", "kokoro", "model"]


@pytest.fixture(scope="module")
def home(kokoro_home: Path) -> Path:
    return kokoro_home


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
    assert "kokoro-af_heart" in names and "kokoro-bm_george" in names
    # Listed: the English packs (the frontend speaks en-US and en-GB); the others are still
    # recognised by path, and refused by the frontend when asked to speak.
    english = [p for p in (home / "voices").glob("*.bin") if p.stem[0] in "ab"]
    assert len(voices) == len(english) == 28 and {v.language for v in voices} == {"en-US", "en-GB"}
    assert recognise(home / "voices" / "jf_alpha.bin").language == "ja"
    heart = next(v for v in voices if v.name == "kokoro-af_heart")
    assert (heart.family, heart.language, heart.sample_rate) == ("kokoro", "en-US", 24_000)
    assert next(v for v in voices if v.name == "kokoro-bf_emma").language == "en-GB"
    # The pack name's second letter is the speaker's gender (af_heart female, bm_george male).
    genders = {v.name: v.gender for v in voices}
    assert (genders["kokoro-af_heart"], genders["kokoro-bm_george"]) == (Gender.FEMALE, Gender.MALE)
    assert set(genders.values()) == {Gender.FEMALE, Gender.MALE}


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


def test_slot_steps_equal_the_reference(runtime: KokoroRuntime) -> None:
    """Three utterances of different lengths through the slot decoder: two start in one step
    (one padded batch), the third a step later beside the others' later chunks; every chunk is
    the reference decode's samples (FP32, within 1e-4), the padding and the end silent."""
    front = open_frontend(runtime.info.frontend_key)
    texts = ["Good morning.", "The quick brown fox jumps over the lazy dog, twice.", "Is it nine or ten?"]
    utts = []
    for i, text in enumerate(texts):
        sents = front.sentences(text)
        (utt,) = runtime.acoustic_batch([AcousticJob(sents[0], None, SynthesisParams(seed=i),
                                                     utterance_rng(i, sents[0].phoneme_ids))])
        assert isinstance(utt, KokoroUtterance)
        utts.append(utt)
    refs = [runtime.reference(u) for u in utts]
    decoder = runtime.streaming_decoder("fp32", 4, max_rows=4, graphs=False, graph_frames=())
    got: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    fed = {0: 0, 1: 0, 2: 0}
    for slot in (0, 1):
        assert decoder.start(slot, utts[slot].prior)
    schedule = [((0, 1), 8), ((0, 1, 2), 8), ((0, 1, 2), 64), ((1, 2), 64), ((1, 2), 64)]
    for slots, frames in schedule:
        if 2 in slots and fed[2] == 0:
            assert decoder.start(2, utts[2].prior)
        step = decoder.step(StepRows(slots, [fed[s] for s in slots], frames, None))
        audio = runtime.guard_async(step).result().audio
        for row, slot in enumerate(slots):
            got[slot].append(audio[row])
            fed[slot] += frames
    for slot, ref in enumerate(refs):
        stream = np.concatenate(got[slot])
        assert len(stream) >= len(ref), "the schedule covers every utterance"
        np.testing.assert_allclose(stream[: len(ref)], ref, rtol=0, atol=1e-4)
        assert not stream[len(ref):].any()

