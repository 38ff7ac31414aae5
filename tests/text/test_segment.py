"""Sentence splitting and the streaming segmenter's invariants."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from service.text.segment import IncrementalSegmenter, SegmenterConfig, piece_cut, split_sentences

TEXT = (
    'Dr. Smith went to the U.S. Army base at 3.14 p.m. today. He said "hi." Then left! '
    "e.g. this works? Yes, it does; really, truly, completely, and absolutely without any "
    "doubt whatsoever — ok. Prices rose 2.5% in 2023. Wow... Really?! "
    + "A very long clause without any punctuation at all that goes on " * 6
    + "and finally ends. Last one"
)


def _rejoins(text: str, pieces: list[str]) -> bool:
    pos = 0
    for piece in pieces:
        found = text.find(piece, pos)
        if found < 0 or text[pos:found].strip():
            return False
        pos = found + len(piece)
    return not text[pos:].strip()


def _push_all(text: str, cuts: list[int], config: SegmenterConfig) -> tuple[list[str], str]:
    segmenter = IncrementalSegmenter(config)
    out: list[str] = []
    edges = [0, *sorted(cuts), len(text)]
    for i in range(len(edges) - 1):
        out += segmenter.push(text[edges[i] : edges[i + 1]], float(i))
    return out, segmenter.pending


def test_split_sentences_basic() -> None:
    assert split_sentences("Hello there. How are you? Fine!") == [
        "Hello there.",
        "How are you?",
        "Fine!",
    ]
    assert split_sentences("  ") == []
    assert split_sentences("Dr. Smith met Mrs. Jones at 3.14 p.m. in the U.S. Army.") == [
        "Dr. Smith met Mrs. Jones at 3.14 p.m. in the U.S. Army."
    ]
    assert split_sentences('He said "hi." Then left.') == ['He said "hi."', "Then left."]
    assert split_sentences("It is e.g. fine. ok then.") == ["It is e.g. fine. ok then."]


def test_split_sentences_long() -> None:
    pieces = split_sentences(TEXT, max_chars=50)
    assert _rejoins(TEXT, pieces)
    assert all(0 < len(p) <= 50 for p in pieces)
    assert "Yes, it does; really, truly, completely," in pieces


def test_split_sentences_corpus_rejoins() -> None:
    corpus = Path(__file__).with_name("corpus_en.txt").read_text(encoding="utf-8")
    for max_chars in (20, 80, 300):
        pieces = split_sentences(corpus, max_chars)
        assert _rejoins(corpus, pieces)
        assert all(len(p) <= max_chars for p in pieces)


def test_releases_at_sentence_end_after_next_text() -> None:
    segmenter = IncrementalSegmenter()
    assert segmenter.push("Hello world.", 0.0) == []
    assert segmenter.push(" ", 0.1) == []
    assert segmenter.push("How", 0.2) == ["Hello world. "]
    assert segmenter.pending == "How"
    assert segmenter.push(" are you? I", 0.3) == ["How are you? "]
    assert segmenter.flush() == ["I"]
    assert segmenter.pending == ""


def test_abbreviation_and_decimal_do_not_release() -> None:
    segmenter = IncrementalSegmenter()
    first = "Dr. Smith paid 3.14 dollars in the U.S. Army on e.g. Monday. "
    assert segmenter.push(first + "Then", 0.0) == [first]
    # "left. and" is not an end (lower case follows); "then. Bye" is.
    assert segmenter.push(" he left. and then. Bye", 0.0) == ["Then he left. and then. "]
    assert segmenter.pending == "Bye"


def test_clause_release_needs_min_chars() -> None:
    config = SegmenterConfig(min_clause_chars=20)
    segmenter = IncrementalSegmenter(config)
    assert segmenter.push("Short, clause, ", 0.0) == []
    assert segmenter.push("but now we have enough, and more", 0.0) == [
        "Short, clause, but now we have enough, "
    ]


def test_max_chars_split() -> None:
    segmenter = IncrementalSegmenter(SegmenterConfig(max_chars=30))
    out = segmenter.push("word " * 20, 0.0)
    assert out and all(len(u) <= 30 for u in out)
    assert "".join(out) + segmenter.pending == "word " * 20


def test_idle_timeout() -> None:
    segmenter = IncrementalSegmenter(SegmenterConfig(idle_timeout_s=1.0, word_timeout_s=3.0))
    assert segmenter.poll(5.0) == []
    assert segmenter.idle_in(5.0) is None
    segmenter.push("Thinking about it ", 10.0)  # ends at a word boundary: the short timeout
    assert segmenter.poll(10.5) == []
    assert segmenter.idle_in(10.5) == 0.5
    assert segmenter.poll(11.0) == ["Thinking about it "]
    assert segmenter.pending == ""
    assert segmenter.idle_in(11.0) is None
    assert segmenter.poll(20.0) == []


def test_idle_release_waits_longer_inside_a_word() -> None:
    segmenter = IncrementalSegmenter(SegmenterConfig(idle_timeout_s=1.0, word_timeout_s=3.0))
    segmenter.push("Thinking about i", 10.0)  # "i" may be the start of "it" or "its"
    assert segmenter.poll(11.5) == []
    assert segmenter.idle_in(11.5) == 1.5
    segmenter.push("ts", 12.0)
    assert segmenter.poll(14.5) == []
    assert segmenter.poll(15.0) == ["Thinking about its"]  # stalled that long: the word is done
    segmenter.push("Is it done?", 20.0)  # a sentence end at the end of the buffer is a boundary
    assert segmenter.idle_in(20.0) == 1.0
    segmenter.push(")", 20.5)
    assert segmenter.poll(21.5) == ["Is it done?)"]


def test_one_character_a_second_is_not_spoken_in_fragments() -> None:
    """Issue 33 item 6: a slow stream gave an utterance per character or two."""
    text = "Hello there, how are you doing today?"
    segmenter = IncrementalSegmenter()
    out: list[str] = []
    for i, ch in enumerate(text):
        out += segmenter.push(ch, float(i))
        for quarter in (0.25, 0.5, 0.75, 1.0):  # polls between deltas, one at the next delta's time
            out += segmenter.poll(i + quarter)
    now = float(len(text))
    while segmenter.pending:
        now += 0.25
        out += segmenter.poll(now)
    assert out == [text]


def test_invariants_random_splits() -> None:
    rng = random.Random(1234)
    corpus = Path(__file__).with_name("corpus_en.txt").read_text(encoding="utf-8")
    texts = [TEXT, corpus, corpus.replace("\n", " "), "", "   ", "...!!! ,,, — —"]
    configs = [
        SegmenterConfig(),
        SegmenterConfig(min_clause_chars=10, max_chars=40),
        SegmenterConfig(min_clause_chars=0, max_chars=7),
        SegmenterConfig(max_chars=1),
    ]
    for text in texts:
        for config in configs:
            at_once, pending_once = _push_all(text, [], config)
            one_char, pending_chars = _push_all(text, list(range(1, len(text))), config)
            assert one_char == at_once and pending_chars == pending_once
            assert "".join(at_once) + pending_once == text
            assert all(u for u in at_once)
            for _ in range(30):
                cuts = rng.sample(range(1, max(len(text), 2)), k=min(len(text) // 5, 40))
                released, pending = _push_all(text, cuts, config)
                assert released == at_once and pending == pending_once
                assert "".join(released) + pending == text


def test_random_words_invariants() -> None:
    rng = random.Random(99)
    vocab = [
        "Dr.",
        "U.S.",
        "3.14",
        "hi",
        "Hello",
        "world.",
        "ok,",
        "yes;",
        "no:",
        "—",
        "e.g.",
        "Wow!",
        "why?",
        '"Quote."',
        "the",
        "A",
        "…",
        "x" * 12,
        "\n\n",
    ]
    for _ in range(200):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 60)))
        config = SegmenterConfig(min_clause_chars=rng.randint(0, 50), max_chars=rng.randint(5, 80))
        at_once, pending_once = _push_all(text, [], config)
        cuts = [i for i in range(1, len(text)) if rng.random() < 0.3]
        released, pending = _push_all(text, cuts, config)
        assert (released, pending) == (at_once, pending_once), text
        assert "".join(released) + pending == text
        assert all(len(u) <= config.max_chars for u in released)
        flushed = IncrementalSegmenter(config)
        assert "".join(flushed.push(text, 0.0) + flushed.flush()) == text


FAST = "Before we get started, I need to let you know that this call may be recorded. Thanks, bye."


def test_first_utterance_ends_at_an_early_clause() -> None:
    released, pending = _push_all(FAST, [], SegmenterConfig())
    assert released == ["Before we get started, ", "I need to let you know that this call may be recorded. "]
    assert pending == "Thanks, bye."
    # Only the stream's first utterance: the same clause later waits for its sentence.
    released, _ = _push_all("Hello there. " + FAST, [], SegmenterConfig())
    assert released[:2] == [
        "Hello there. ", "Before we get started, I need to let you know that this call may be recorded. "
    ]
    # Off when asked.
    released, _ = _push_all(FAST, [], SegmenterConfig(first_min_clause_chars=None, first_piece_chars=None))
    assert released[0].startswith("Before we get started, I need")


def test_early_clause_waits_for_its_lookahead_and_keeps_short_tails() -> None:
    segmenter = IncrementalSegmenter(SegmenterConfig())
    assert segmenter.push("Before we get started, I need to let you know", 0.0) == []  # 23 of 40
    assert segmenter.push(" that this call may", 0.0) == ["Before we get started, "]
    # A sentence end within the lookahead keeps the clause with its sentence.
    released, pending = _push_all("Can I have your account number, please? Sure.", [], SegmenterConfig())
    assert released == ["Can I have your account number, please? "] and pending == "Sure."


def test_early_clause_invariants_random_splits() -> None:
    rng = random.Random(7)
    texts = [FAST, "Well, " + FAST, FAST.replace(",", ";"), "One, two, three, four, five, six, seven, eight."]
    for text in texts:
        for config in (SegmenterConfig(), SegmenterConfig(first_min_clause_chars=5, first_clause_lookahead_chars=8)):
            at_once, pending_once = _push_all(text, [], config)
            for _ in range(40):
                cuts = rng.sample(range(1, len(text)), k=rng.randint(1, len(text) - 1))
                assert _push_all(text, cuts, config) == (at_once, pending_once)


LONG = ("Our records show that the last payment on your account was received on the fourteenth of March, "
        "and that the next statement will be issued at the end of the current billing cycle. "
        "I have gone ahead and moved your delivery to the morning slot on Thursday so that someone "
        "will be at home to sign for the package when the courier arrives at your door.")


def _plain(text: str, config: SegmenterConfig) -> list[str]:
    """A streaming voice's utterances for `text` pushed at once."""
    segmenter = IncrementalSegmenter(config)
    return segmenter.push(text, 0.0) + segmenter.flush()


def _pieces(text: str, config: SegmenterConfig, cuts: list[int] | None = None) -> list[str]:
    segmenter = IncrementalSegmenter(config, pieces=True)
    edges = [0, *sorted(cuts or []), len(text)]
    out: list[str] = []
    for i in range(len(edges) - 1):
        out += segmenter.push(text[edges[i] : edges[i + 1]], float(i))
    return out + segmenter.flush()


def test_pieces_grow_and_end_at_phrase_boundaries() -> None:
    config = SegmenterConfig()
    pieces = _pieces(LONG, config)
    assert "".join(pieces) == LONG
    assert pieces[:3] == ["Our records show that the last payment ",
                          "on your account was received on the fourteenth of March, ",
                          "and that the next statement will be issued at the end of the current billing cycle. "]
    # Before the first of "so that", not between them; a starter in a piece's first half is no cut.
    text = "and moved your delivery to the morning slot on Thursday so that someone will be"
    assert text[: piece_cut(text, 62, 16)] == "and moved your delivery to the morning slot on Thursday "
    text = "that revenue grew by twelve percent compared with the same"
    assert text[: piece_cut(text, 40, 16)] == "that revenue grew by twelve percent "
    released = 0
    for k, piece in enumerate(pieces[:-1]):
        limit = min(config.piece_chars * config.piece_growth ** k,
                    max(config.piece_chars, config.piece_growth * released))
        if limit < config.max_chars:
            assert len(piece) <= limit + config.piece_tail_chars, (k, piece)
        released += len(piece)
    # Without pieces (a streaming voice) only the first utterance is one; the rest goes by clauses
    # of 60+ characters and sentences.
    assert _plain(LONG, config)[:2] == [pieces[0], pieces[1] + pieces[2]]
    assert _plain(LONG, dataclasses.replace(config, first_piece_chars=None))[0] == (
        "Our records show that the last payment on your account was received on the fourteenth of March, ")


def test_a_streaming_voice_first_utterance_is_cut_only_when_long() -> None:
    """The first piece: short first sentences and early clauses stay whole, a long first sentence
    is cut before a phrase-starting word, and only the first utterance."""
    config = SegmenterConfig()
    assert _plain("Thank you for calling. How can I help you today?", config)[0] == "Thank you for calling. "
    assert _plain("Your appointment is confirmed for Tuesday at three thirty in the afternoon.", config) == [
        "Your appointment is confirmed for Tuesday ", "at three thirty in the afternoon."]
    text = ("I have gone ahead and moved your delivery to the morning slot on Thursday so that someone will "
            "be at home to sign for the package when the courier arrives at your door. " * 2)
    utts = _plain(text, config)
    assert utts[0] == "I have gone ahead and moved your delivery "
    assert len(utts[1]) > 2 * config.first_piece_chars  # later sentences are not cut so
    assert _plain("Before we get started, I need to let you know that this call may be recorded.", config)[0] == (
        "Before we get started, ")
    # no clause mark or phrase-starting word within the first piece: not cut at a bare space
    text = "Your refund for the cancelled subscription has been approved and the full amount will appear soon."
    assert _plain(text, config) == [text]


def test_pieces_keep_short_sentences_and_tails_whole() -> None:
    assert _pieces("Can I have your account number, please? Sure.", SegmenterConfig()) == [
        "Can I have your account number, please? ", "Sure."]
    assert _pieces("One moment while I look that up for you.", SegmenterConfig()) == [
        "One moment while I look that up for you."]


def test_pieces_the_same_for_any_deltas() -> None:
    rng = random.Random(11)
    config = SegmenterConfig()
    for text in (LONG, FAST, "word " * 80, "x" * 500):
        at_once = _pieces(text, config)
        assert "".join(at_once) == text
        for _ in range(25):
            cuts = rng.sample(range(1, len(text)), k=rng.randint(1, min(60, len(text) - 1)))
            assert _pieces(text, config, cuts) == at_once
