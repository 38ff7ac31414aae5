"""Property-based tests (hypothesis): the streaming segmenter and the annotation parser take any
input without an unexpected exception and account for every character (issue 12, item 7)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Set
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.text.annotations import (
    AnnotationError,
    arpabet_symbol_to_ipa,
    parse_arpabet_run,
    parse_pronunciation,
)
from service.text.frontend import Frontend
from service.text.segment import IncrementalSegmenter, SegmenterConfig, split_sentences

# Characters the segmenter's rules look at, plus anything else unicode has.
_SPECIAL = [*"aAbZ. .,;:!?…—\"'”’»)]}“‘«([{\n\t\u00a0Dr.e.g.3", "Mr.", "U.S.", "3.14", "...", ". A", " and ", " of "]
TEXTS = st.lists(st.sampled_from(_SPECIAL) | st.characters(), max_size=120).map("".join)
CONFIGS = st.builds(
    SegmenterConfig,
    min_clause_chars=st.integers(1, 80),
    max_chars=st.integers(0, 120),
    idle_timeout_s=st.just(1.0),
    first_min_clause_chars=st.none() | st.integers(1, 40),
    first_clause_lookahead_chars=st.integers(0, 60),
    first_piece_chars=st.none() | st.integers(1, 80),
)


def _deltas(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _stream(config: SegmenterConfig, deltas: list[str], flush_after: Set[int] = frozenset()) -> list[str]:
    seg = IncrementalSegmenter(config)
    out: list[str] = []
    now = 0.0
    for i, delta in enumerate(deltas):
        out += seg.push(delta, now)
        now += 0.1
        out += seg.poll(now)  # never releases: the idle limit has not passed
        if i in flush_after:
            out += seg.flush()
    return out + seg.flush()


@settings(max_examples=300, deadline=None)
@given(TEXTS, CONFIGS, st.lists(st.integers(0, 10_000), max_size=30), st.sets(st.integers(0, 30), max_size=5))
def test_segmenter_accounts_for_every_character(
    text: str, config: SegmenterConfig, cuts: list[int], flushes: set[int]
) -> None:
    pieces = _stream(config, _deltas(text, cuts), flushes)
    assert "".join(pieces) == text  # streamed pieces are exact slices: nothing lost, added or moved
    assert all(pieces), "no empty utterance is released"
    assert all(len(p) <= max(1, config.max_chars) for p in pieces)


@settings(max_examples=300, deadline=None)
@given(TEXTS, CONFIGS, st.lists(st.integers(0, 10_000), max_size=30), st.lists(st.integers(0, 10_000), max_size=30))
def test_segmenter_is_delta_invariant(text: str, config: SegmenterConfig, a: list[int], b: list[int]) -> None:
    whole = _stream(config, [text])
    assert _stream(config, _deltas(text, a)) == whole
    assert _stream(config, _deltas(text, b)) == whole
    assert _stream(config, list(text)) == whole  # one character at a time


@settings(max_examples=300, deadline=None)
@given(TEXTS, st.integers(1, 120))
def test_split_sentences_keeps_every_non_space_character(text: str, max_chars: int) -> None:
    pieces = split_sentences(text, max_chars)
    assert all(p and p == p.strip() and len(p) <= max_chars for p in pieces)
    squeeze = "".join(ch for ch in text if not ch.isspace())
    assert "".join(ch for p in pieces for ch in p if not ch.isspace()) == squeeze


_ARPA = ["[", "]", "[[", "]]", "AH0", "EY1", "T", "M", "ZH", "Q", "ah2", "X9", " ", "ˈ", "ə", "ɪ", "aɪ", "0", "1"]
PRONUNCIATIONS = st.lists(st.sampled_from(_ARPA) | st.characters(), max_size=25).map("".join)


@settings(max_examples=500, deadline=None)
@given(PRONUNCIATIONS)
def test_pronunciations_parse_or_raise_annotation_error(value: str) -> None:
    id_map: dict[str, list[int]] = {ch: [i] for i, ch in enumerate("abdefhijklmnpstuvwzæðŋɑɔəɚɛɜɡɪʃʊʌʒθˈˌː")}
    for parse in (lambda v: parse_pronunciation(v, id_map), parse_arpabet_run, arpabet_symbol_to_ipa):
        try:
            result = parse(value)
        except AnnotationError as exc:
            assert str(exc)
            continue
        assert result and all(isinstance(p, str) and p for p in result)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["Hello ", "[T][AH0]", "[Q]", "[[", "]]", "[AY1][", "wor", "ld. ", "tomato"])
                | st.characters(exclude_characters="\x00"), max_size=20).map("".join),
       st.dictionaries(st.sampled_from(["tomato", "x", " ", "ld"]), PRONUNCIATIONS, max_size=2))
def test_frontend_annotations_parse_or_raise_annotation_error(
    frontend: Frontend, text: str, dictionary: dict[str, str]
) -> None:
    try:
        sentences: list[Any] = frontend.sentences(text, dictionary)
    except AnnotationError as exc:
        assert str(exc)
        return
    assert all(s.phoneme_ids is not None for s in sentences)


_WORDS = st.lists(
    st.text("abcXYZ19", min_size=1, max_size=12), min_size=1, max_size=25
)
_SEPARATORS = st.sampled_from([" ", "  ", ". ", ", ", "! ", "? ", "\n", ".\" ", " — "])


@settings(max_examples=300, deadline=None)
@given(
    _WORDS, st.lists(_SEPARATORS, min_size=25, max_size=25), CONFIGS,
    st.lists(st.integers(0, 10_000), max_size=40), st.lists(st.floats(0.0, 0.99), min_size=41, max_size=41),
)
@example(  # a long word after a double space: the forced cut once fell inside it
    words=["1"] * 7 + ["111111111111"] * 3, separators=[" "] * 7 + ["  ", "  "] + [" "] * 16,
    config=SegmenterConfig(min_clause_chars=1, max_chars=0, first_min_clause_chars=None,
                           first_clause_lookahead_chars=0),
    cuts=[], gaps=[0.0] * 41,
)
def test_idle_releases_never_split_a_word(
    words: list[str], separators: list[str], config: SegmenterConfig, cuts: list[int], gaps: list[float]
) -> None:
    """Deltas at any pace short of the word timeout, polled often: every cut (idle or not) falls
    between words, never inside one."""
    config = dataclasses.replace(config, max_chars=max(config.max_chars, 13), idle_timeout_s=1.0, word_timeout_s=3.0)
    text = "".join(w + s for w, s in zip(words, separators, strict=False))[:-1]  # may end inside a word
    seg = IncrementalSegmenter(config)
    pieces: list[str] = []
    now = 0.0
    for delta, gap in zip(_deltas(text, cuts), gaps, strict=False):
        pieces += seg.push(delta, now)
        for step in range(1, 5):  # polls up to just short of the word timeout
            pieces += seg.poll(now + step * gap * config.word_timeout_s / 4)
        now += gap * config.word_timeout_s
    pieces += seg.flush()
    assert "".join(pieces) == text
    pos = 0
    for piece in pieces[:-1]:
        pos += len(piece)
        assert not (text[pos - 1].isalnum() and text[pos].isalnum()), (pieces, pos)
