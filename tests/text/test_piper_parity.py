"""Without annotations our ids must be Piper's, sentence for sentence (acceptance test)."""

from __future__ import annotations

from typing import Any

from service.text.frontend import Frontend
from service.text.phonemize import phonemize


def _piper_ids(voice: Any, text: str) -> list[list[int]]:
    return [voice.phonemes_to_ids(p) for p in voice.phonemize(text)]


def test_corpus_is_varied(corpus: list[str]) -> None:
    assert len(corpus) >= 40


def test_piper_reference_is_piper_itself(piper_voice: Any) -> None:
    # The reference ids come from piper-tts's own PiperVoice, not from our code.
    from piper import PiperVoice

    assert type(piper_voice) is PiperVoice
    assert not type(piper_voice).__module__.startswith("service")


def test_ids_equal_piper_per_line(frontend: Frontend, piper_voice: Any, corpus: list[str]) -> None:
    sentences = 0
    for line in corpus:
        ours = [s.phoneme_ids for s in frontend.sentences(line)]
        theirs = _piper_ids(piper_voice, line)
        assert ours and all(ours), line  # not vacuous: every line gives ids
        assert ours == theirs, line
        sentences += len(ours)
    assert sentences >= len(corpus)


def test_ids_equal_piper_whole_corpus(
    frontend: Frontend, piper_voice: Any, corpus: list[str]
) -> None:
    text = " ".join(corpus)
    ours = [s.phoneme_ids for s in frontend.sentences(text)]
    assert ours == _piper_ids(piper_voice, text)


def test_phonemize_equals_piper_with_raw_blocks(piper_voice: Any) -> None:
    for text in [
        "I like [[ tˈʌmɑːtoʊ ]] very much.",
        "[[ haɪ ]] there. And [[bˈaɪ]]!",
        "Two [[a]][[b]] blocks [[ c ]] here",
    ]:
        assert phonemize("en-us", text) == piper_voice.phonemize(text), text


def test_blank_and_punctuation_only(frontend: Frontend, piper_voice: Any) -> None:
    assert frontend.sentences("") == []
    assert frontend.sentences("   \n\t ") == []
    for text in ["...", "!?", "—", ".", "\"'", "!!!", "()"]:
        assert [s.phoneme_ids for s in frontend.sentences(text)] == _piper_ids(piper_voice, text)


def test_sentence_text_is_source(frontend: Frontend) -> None:
    sentences = frontend.sentences("Hello there. How are you? Fine!")
    assert [s.text for s in sentences] == ["Hello there.", "How are you?", "Fine!"]
