"""Inline ARPAbet / IPA annotations and the per-request custom dictionary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from service.text.annotations import (
    ARPABET_SYMBOLS,
    AnnotationError,
    arpabet_symbol_to_ipa,
    parse_pronunciation,
)
from service.text.frontend import Frontend, PhonemizedSentence


def _ids(id_map: Mapping[str, Sequence[int]], ipa: str) -> list[int]:
    return [i for ch in ipa for i in (*id_map[ch], 0)]


def _word_phonemes(sentence: PhonemizedSentence) -> dict[str, list[int]]:
    return {w.text: sentence.phoneme_ids[w.start_id : w.end_id] for w in sentence.words}


def test_full_arpabet_set_maps_into_voice(voice_config: dict[str, Any]) -> None:
    id_map = voice_config["phoneme_id_map"]
    assert len(ARPABET_SYMBOLS) == 39
    for symbol in ARPABET_SYMBOLS:
        try:
            ipas = [arpabet_symbol_to_ipa(symbol + digit) for digit in ("", "0", "1", "2")]
        except AnnotationError:
            ipas = [arpabet_symbol_to_ipa(symbol)]  # consonants take no stress digit
        for ipa in ipas:
            assert ipa and all(ch in id_map for ch in ipa), (symbol, ipa)


def test_arpabet_examples() -> None:
    assert arpabet_symbol_to_ipa("AY1") == "ˈaɪ"
    assert arpabet_symbol_to_ipa("ER0") == "ɚ"
    assert arpabet_symbol_to_ipa("ER1") == "ˈɜː"
    assert arpabet_symbol_to_ipa("R") == "ɹ"
    assert arpabet_symbol_to_ipa("ey2") == "ˌeɪ"
    assert arpabet_symbol_to_ipa("AH0") == "ə"


def test_arpabet_run_gives_expected_ids(frontend: Frontend, voice_config: dict[str, Any]) -> None:
    id_map = voice_config["phoneme_id_map"]
    (sentence,) = frontend.sentences("A [M][AY0][N][UW1][T] timer")
    word = next(w for w in sentence.words if w.text == "[M][AY0][N][UW1][T]")
    expected = _ids(id_map, "maɪnˈuːt")[:-1]  # span ends on the last phoneme, not its pad
    assert sentence.phoneme_ids[word.start_id : word.end_id] == expected
    assert "".join(sentence.phonemes).split()[1] == "maɪnˈuːt"


def test_unknown_arpabet_symbol_is_named() -> None:
    frontend_error = None
    try:
        arpabet_symbol_to_ipa("QX1")
    except AnnotationError as exc:
        frontend_error = str(exc)
    assert frontend_error is not None
    assert "'QX1'" in frontend_error and "AY" in frontend_error and "ZH" in frontend_error


def test_unknown_arpabet_symbol_in_text(frontend: Frontend) -> None:
    with pytest.raises(AnnotationError, match="'XX'"):
        frontend.sentences("Say [M][XX][T] now.")
    with pytest.raises(ValueError, match="'B1'"):  # consonants take no stress
        frontend.sentences("Say [B1][IY1] now.")


def test_raw_ipa_block(frontend: Frontend, voice_config: dict[str, Any]) -> None:
    id_map = voice_config["phoneme_id_map"]
    (sentence,) = frontend.sentences("I like [[ tˈʌmɑːtoʊ ]] a lot.")
    words = _word_phonemes(sentence)
    assert words["[[ tˈʌmɑːtoʊ ]]"] == _ids(id_map, "tˈʌmɑːtoʊ")[:-1]


def test_unknown_ipa_symbol_is_named(frontend: Frontend) -> None:
    with pytest.raises(AnnotationError, match="'ʮ'"):
        frontend.sentences("Say [[ ʮa ]] now.")
    with pytest.raises(AnnotationError, match="'ʮ'"):
        frontend.sentences("Say it.", {"it": "ʮt"})


def test_pronunciation_forms_agree(voice_config: dict[str, Any]) -> None:
    id_map = voice_config["phoneme_id_map"]
    bracket = parse_pronunciation("[T][AH0][M][EY1][T][OW2]", id_map)
    spaced = parse_pronunciation("T AH0 M EY1 T OW2", id_map)
    ipa = parse_pronunciation("təmˈeɪtˌoʊ", id_map)
    assert bracket == spaced == ipa == list("təmˈeɪtˌoʊ")


def test_dictionary_changes_only_that_word(frontend: Frontend) -> None:
    text = "I say tomato to everyone, Tomato!"
    (plain,) = frontend.sentences(text)
    (custom,) = frontend.sentences(text, {"tomato": "T AH0 M AA1 T OW2"})
    before, after = _word_phonemes(plain), _word_phonemes(custom)
    assert [w.text for w in plain.words] == [w.text for w in custom.words]
    for word in ["I", "say", "to", "everyone"]:
        assert before[word] == after[word], word
    assert before["tomato"] != after["tomato"]
    assert "".join(custom.phonemes).count("təmˈɑːtˌoʊ") == 2  # case-insensitive, both
    # Punctuation after a dictionary word is kept, as espeak would in context.
    assert custom.phonemes[-1] == "!"
    assert "".join(custom.phonemes).split()[-1] == "təmˈɑːtˌoʊ!"


def test_dictionary_matches_whole_words_only(frontend: Frontend) -> None:
    plain = frontend.sentences("Tomatoes and a tomatohouse.")
    custom = frontend.sentences("Tomatoes and a tomatohouse.", {"tomato": "[[ tˈʌmɑːtoʊ ]]"})
    assert [s.phoneme_ids for s in plain] == [s.phoneme_ids for s in custom]


def test_dictionary_entry_errors_name_the_word(frontend: Frontend) -> None:
    with pytest.raises(AnnotationError, match=r"'gif'.*'QQ1'"):
        frontend.sentences("A gif.", {"gif": "[JH][QQ1][F]"})


def test_long_sentences_split_at_word_breaks(frontend: Frontend) -> None:
    """A sentence past MAX_SENTENCE_PHONEMES (long annotations, a run of numbers) becomes several
    utterances of at most that many phonemes, cut between words; its words all survive."""
    from service.text.frontend import MAX_SENTENCE_PHONEMES

    dictionary = {"boom": "[AA1]" * 40}
    text = " ".join(["boom"] * 30) + "."
    sentences = frontend.sentences(text, dictionary)
    assert len(sentences) > 1
    assert all(len(s.phonemes) <= MAX_SENTENCE_PHONEMES for s in sentences)
    assert sum(len(s.words) for s in sentences) == 30
    assert sum(s.phonemes.count("ɑ") for s in sentences) == 30 * 40
    for s in sentences[:-1]:
        assert s.phonemes[-1] == " "  # cut after a word break, never inside a word
    numbers = frontend.sentences("999,999,999,999 " * 10)
    assert len(numbers) > 1 and all(len(s.phonemes) <= MAX_SENTENCE_PHONEMES for s in numbers)
    short = frontend.sentences("A short sentence stays whole.")
    assert len(short) == 1
