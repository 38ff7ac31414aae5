"""The Kokoro text frontend on the real G2P (misaki with spaCy, piper's espeak-ng): no mocks."""

from __future__ import annotations

import logging

import pytest

from service.models.kokoro import frontend as kf
from service.models.kokoro.frontend import KOKORO_VOCAB, MAX_PHONEMES, KokoroFrontend, ipa_to_kokoro
from service.text.annotations import AnnotationError

PUNCT = set(';:,.!?—…"()“” ')


@pytest.fixture(scope="module")
def us() -> KokoroFrontend:
    return KokoroFrontend("en-US")


@pytest.fixture(scope="module")
def gb() -> KokoroFrontend:
    return KokoroFrontend("en-GB", british=True)


@pytest.fixture(scope="module")
def us_espeak() -> KokoroFrontend:
    return KokoroFrontend("en-US", g2p="espeak")


def official_misaki(british: bool):
    """misaki.en.G2P with the attributes its __init__ sets (misaki 0.9.4), no fallback: what
    KPipeline runs for in-lexicon words."""
    import spacy
    from misaki import en

    g2p = en.G2P.__new__(en.G2P)
    g2p.version, g2p.british, g2p.fallback, g2p.unk = None, british, None, ""
    name = next(n for n in kf.SPACY_MODELS if spacy.util.is_package(n))
    g2p.nlp = spacy.load(name, enable=["tok2vec", "tagger"])
    g2p.lexicon = en.Lexicon(british)
    return g2p


def span_phonemes(sentence, span) -> str:
    return "".join(sentence.phonemes[span.start_id - 1:span.end_id - 1])


def test_vocabulary_is_kokoro_v1() -> None:
    assert len(KOKORO_VOCAB) == 114
    assert len(set(KOKORO_VOCAB.values())) == 114
    assert 0 not in KOKORO_VOCAB.values() and max(KOKORO_VOCAB.values()) == 177  # n_token 178
    assert KOKORO_VOCAB[" "] == 16 and KOKORO_VOCAB["ˈ"] == 156 and KOKORO_VOCAB["ᵻ"] == 177


def test_g2p_is_named(us: KokoroFrontend, us_espeak: KokoroFrontend) -> None:
    assert us.g2p == "misaki" and us.spacy_model in kf.SPACY_MODELS
    assert us_espeak.g2p == "espeak" and us_espeak.spacy_model is None
    with pytest.raises(ValueError, match="misaki, espeak"):
        KokoroFrontend("en-US", g2p="phonemizer")


@pytest.mark.parametrize("name", ["us", "gb", "us_espeak"])
def test_ids_are_in_the_vocabulary(name: str, request: pytest.FixtureRequest) -> None:
    frontend: KokoroFrontend = request.getfixturevalue(name)
    text = ('Dr. Müller paid $3.50 for 12 "naïve" crêpes (really?) — on 3/4/2025; café au lait... '
            "Ça va? Zyxwq! ½ ☃ 日本")
    sentences = frontend.sentences(text)
    assert sentences
    known = set(KOKORO_VOCAB.values())
    for s in sentences:
        assert s.phoneme_ids[0] == s.phoneme_ids[-1] == kf.BOUNDARY_ID
        assert s.phoneme_ids[1:-1] == [KOKORO_VOCAB[p] for p in s.phonemes]
        assert set(s.phoneme_ids[1:-1]) <= known
        assert 0 < len(s.phonemes) <= MAX_PHONEMES


@pytest.mark.parametrize(("british", "expected"), [
    (False, "həlˈO wˈɜɹld, ðɪs ɪz mI vˈYs."),
    (True, "həlˈQ wˈɜːld, ðɪs ɪz mI vˈYs."),
])
def test_sentence_is_misakis(british: bool, expected: str, us: KokoroFrontend, gb: KokoroFrontend) -> None:
    frontend = gb if british else us
    [sentence] = frontend.sentences("Hello world, this is my voice.")
    assert "".join(sentence.phonemes) == expected
    official, _ = official_misaki(british)("Hello world, this is my voice.")
    assert "".join(sentence.phonemes) == official


def test_sentences_together_are_misakis_whole_text(us: KokoroFrontend) -> None:
    text = ('I read the book yesterday. Will you read it too? "Yes!" she said (twice); '
            "the 2 dogs cost $30... OK.")
    sentences = us.sentences(text)
    assert [s.text for s in sentences] == [
        "I read the book yesterday.", "Will you read it too?", '"Yes!"', "she said (twice); the 2 dogs cost $30...",
        "OK."]
    official, _ = official_misaki(False)(text)
    assert " ".join("".join(s.phonemes) for s in sentences) == official
    assert "ɹˈɛd" in "".join(sentences[0].phonemes)  # spaCy's tagger: past tense
    assert "ɹˈid" in "".join(sentences[1].phonemes)


def test_unknown_words_go_to_espeak(us: KokoroFrontend, us_espeak: KokoroFrontend) -> None:
    [sentence] = us.sentences("Zyxwq")
    [word] = sentence.words
    assert word.text == "Zyxwq"
    assert span_phonemes(sentence, word) == us._espeak_word("Zyxwq") == "zˈɪksʊk"
    [alone] = us_espeak.sentences("Zyxwq")
    assert alone.phonemes == sentence.phonemes


def test_espeak_conversion_follows_misakis_rules(us_espeak: KokoroFrontend) -> None:
    # Words whose misaki lexicon entry is what misaki's espeak path makes of espeak's IPA.
    [sentence] = us_espeak.sentences("Hello world, this is my voice; judge the boy.")
    assert [span_phonemes(sentence, w) for w in sentence.words] == [
        "həlˈO", "wˈɜɹld", "ðɪs", "ɪz", "mI", "vˈYs", "ʤˈʌʤ", "ðə", "bˈY"]
    assert ipa_to_kokoro("bˈɑːɾəl", british=False) == "bˈɑTᵊl"  # flap T, syllabic l, no length
    assert ipa_to_kokoro("bˈʌʔn̩", british=False) == "bˈʌtn"
    assert ipa_to_kokoro("təmˈeɪɾoʊ", british=False) == "təmˈATO"
    assert ipa_to_kokoro("ˈeə təmˈɑːtəʊ", british=True) == "ˈɛː təmˈɑːtQ"
    assert ipa_to_kokoro("nˈɜːs ɐbˈaʊt", british=False) == "nˈɜɹs əbˈWt"


def test_long_sentence_splits_at_clauses(us: KokoroFrontend) -> None:
    clause = "the quick brown fox jumps over the lazy dog near the river bank"
    text = ", ".join([clause] * 12) + "."
    pieces = us.sentences(text)
    assert len(pieces) >= 2
    for piece in pieces:
        assert len(piece.phonemes) <= MAX_PHONEMES and len(piece.phoneme_ids) <= MAX_PHONEMES + 2
    for piece in pieces[:-1]:
        assert piece.phonemes[-1] == ","  # cut after a clause, not inside one
    words = [w.text for p in pieces for w in p.words]
    assert words == text.replace(",", "").replace(".", "").split()


def test_long_sentence_without_clauses_splits_at_words(us: KokoroFrontend) -> None:
    text = " ".join(["remarkably"] * 80) + "."
    pieces = us.sentences(text)
    assert len(pieces) >= 2
    assert all(len(p.phonemes) <= MAX_PHONEMES for p in pieces)
    assert [w.text for p in pieces for w in p.words] == ["remarkably"] * 80
    one = span_phonemes(pieces[0], pieces[0].words[0])
    for p in pieces:
        assert all(span_phonemes(p, w) == one for w in p.words)  # no word cut in two


def test_over_long_word_is_cut(us: KokoroFrontend) -> None:
    pieces = us.sentences("[[" + "tə" * 400 + "]]")
    assert [len(p.phonemes) for p in pieces] == [510, 290]


def test_word_spans_cover_the_words_in_order(us: KokoroFrontend) -> None:
    text = 'Well, "Kokoro" speaks 82 million words -- fast! Then it stops.'
    sentences = us.sentences(text)
    assert [[w.text for w in s.words] for s in sentences] == [
        ["Well", "Kokoro", "speaks", "82", "million", "words", "fast"], ["Then", "it", "stops"]]
    for s in sentences:
        last = 1
        for w in s.words:
            assert last <= w.start_id < w.end_id <= len(s.phoneme_ids) - 1
            said = span_phonemes(s, w)
            assert said == said.strip() and not set(said) & {",", ".", "!", "“", "”"}
            last = w.end_id
    assert span_phonemes(sentences[0], sentences[0].words[3]) == "ˈATi tˈu"
    assert all(s.words == [] for s in us.sentences(text, words=False))
    assert [s.phoneme_ids for s in us.sentences(text, words=False)] == [s.phoneme_ids for s in sentences]


def test_ipa_annotation_takes_effect(us: KokoroFrontend) -> None:
    [native] = us.sentences("[[kəkˈɔɹO]] is fast.")
    [ipa] = us.sentences("[[kəkˈɔːɹoʊ]] is fast.")  # standard IPA, converted
    [arpabet] = us.sentences("[K][AH0][K][AO1][R][OW0] is fast.")
    for s in (native, ipa, arpabet):
        assert "".join(s.phonemes) == "kəkˈɔɹO ɪz fˈæst."
        assert span_phonemes(s, s.words[0]) == "kəkˈɔɹO"
        assert [w.text for w in s.words][1:] == ["is", "fast"]


def test_dictionary_entry_takes_effect(us: KokoroFrontend, gb: KokoroFrontend) -> None:
    dictionary = {"kokoro": "kəkˈɔːɹoʊ", "open weight": "[[ˈOpᵊn wˈAt]]", "TTS": "T IY1 T IY1 EH1 S"}
    [s] = us.sentences("Kokoro is an open weight TTS.", dictionary)
    assert [(w.text, span_phonemes(s, w)) for w in s.words] == [
        ("Kokoro", "kəkˈɔɹO"), ("is", "ɪz"), ("an", "ɐn"), ("open weight", "ˈOpᵊn wˈAt"), ("TTS", "tˈitˈiˈɛs")]
    [g] = gb.sentences("kokoro.", {"Kokoro": "kəkˈɔːɹəʊ"})
    assert "".join(g.phonemes) == "kəkˈɔːɹQ."


def test_unsayable_annotations_are_errors(us: KokoroFrontend) -> None:
    with pytest.raises(ValueError, match=r"'ʘ'.*no Kokoro phoneme id"):
        us.sentences("a [[ʘa]] click")
    with pytest.raises(AnnotationError, match=r"custom dictionary entry 'tsk'.*'ǀ'"):
        us.sentences("tsk", {"tsk": "ǀ"})
    with pytest.raises(ValueError, match="unknown ARPAbet symbol"):
        us.sentences("[Q][AA1]")


def test_unsupported_languages_are_errors() -> None:
    for language in ("fr-FR", "ja", "es"):
        with pytest.raises(ValueError, match=f"{language!r}.*en-US, en-GB"):
            KokoroFrontend(language, g2p="espeak")
    with pytest.raises(ValueError, match="contradicts british=True"):
        KokoroFrontend("en-US", british=True, g2p="espeak")


def test_unknown_symbols_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=kf.__name__):
        assert kf._keep_known("a☄b") == "ab"
        assert kf._keep_known("☄☄") == ""
    assert sum("'☄'" in r.getMessage() for r in caplog.records) == 1


def test_blank_text(us: KokoroFrontend) -> None:
    assert us.sentences("") == [] and us.sentences(" \n\n ") == []
