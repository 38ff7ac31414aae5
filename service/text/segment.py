"""Cutting text into utterances: whole texts (``split_sentences``) and streamed deltas.

Streamed text (LLM tokens) must be spoken as soon as a sentence, or a long enough clause, is
complete, but never cut where the full text would not be: every cut is decided only from the
text already seen, and only once later text cannot change the decision. So pushing a text in
1-character deltas gives exactly the same utterances as pushing it at once.

Rules (documented simplifications):
- A sentence ends at a run of ``. ! ? …`` (plus closing quotes/brackets) followed by
  whitespace. The cut is placed after that whitespace, so it is decided when the next
  non-space character arrives (or on flush / idle timeout).
- A period (or ellipsis) ends a sentence only if the next non-space character is upper case,
  a digit, a quote or an opening bracket, and the word before it is not a known title
  abbreviation ("Dr.", "St."), a single letter ("J.", "U.S.") or dotted ("e.g.", "a.m.").
  "3.14" never ends a sentence (no whitespace after the period).
- A clause ends at ``, ; :`` followed by whitespace, or at an em dash; it is only a cut once
  ``min_clause_chars`` characters (counted up to the punctuation) are buffered.
- A stream's first utterance may end at an earlier clause (``first_min_clause_chars``) when
  at least ``first_clause_lookahead_chars`` characters follow it with no sentence end among
  them: the first audio then waits for a short clause, not a long sentence, while a short
  tail (", please?") stays with its sentence. Decided from those characters alone.
- A streaming voice's first utterance is also a piece (below) of ``first_piece_chars``: a first
  sentence or clause longer than that and its tail is cut at a clause mark or before a
  phrase-starting word within it (never at a bare space: then no such cut is made). The
  acoustic stage runs over a whole utterance before any audio, so its length sets the first
  audio; the cut costs a break in the first sentence (an utterance's closing fall and edge
  silence).
- Text reaching ``max_chars`` without a cut is split at its last clause boundary, else its
  last whitespace, else hard at ``max_chars``.
- A voice that decodes whole utterances (its first audio waits for the whole utterance, e.g.
  Kokoro) gets its stream in growing pieces: utterance k ends by ``piece_chars * piece_growth**k``
  characters, and by ``piece_growth`` times all the text before it (at least ``piece_chars``),
  while that is below ``max_chars``: at its last clause mark, else before its last
  phrase-starting word ("and", "that", "with", ...), else at its last space, never before
  ``piece_min_chars``. A sentence (or early clause) ending within ``piece_tail_chars`` past the
  limit is kept whole. Growing: each piece is decoded while the one before it plays. Each piece
  keeps the model's own opening and closing silence (about 0.7 s between two pieces with Kokoro):
  shortening them changes the whole piece (its norms' statistics span its silence too) and cost
  an offline recogniser twice the word errors.
- Text no rule cut is released whole when no delta came for a while (see `SegmenterConfig`):
  sooner when it ends at a word boundary, later when it ends inside a word that the next
  delta may continue, so a slow stream is not spoken in fragments of words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CLOSERS = "\"'”’»)]}"
_OPENERS = "\"'“‘«([{"
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs mt ft gen col lt sgt capt rev hon fig approx dept".split()
)
_CANDIDATE = re.compile(rf"[.!?…]+[{re.escape(_CLOSERS)}]*|[,;:]+[{re.escape(_CLOSERS)}]*|—")
_CLAUSE_BOUNDARY = re.compile(r"(?:[,;:]+|—)\s*")
_WHITESPACE = re.compile(r"\s+")
_FINAL_END = re.compile(rf"[.!?…][{re.escape(_CLOSERS)}]*$")


@dataclass(frozen=True)
class SegmenterConfig:
    """When the streaming segmenter releases text.

    With no delta for ``idle_timeout_s``, a buffer ending in whitespace or a sentence-final
    punctuation is released: longer than the gap between tokens of even a slow stream (one a
    second, plus jitter), short enough for a finished sentence without punctuation. One ending
    inside a word waits ``word_timeout_s``: the next delta may continue that word, so only a
    stream stalled (or ended without a flush) for that long has its last word spoken alone.
    """

    min_clause_chars: int = 60
    max_chars: int = 300
    idle_timeout_s: float = 1.5
    word_timeout_s: float = 3.0
    first_min_clause_chars: int | None = 20  # None: the first utterance cuts like the rest
    first_clause_lookahead_chars: int = 40
    first_piece_chars: int | None = 50  # streaming voices' first utterance (see above); None: off
    piece_chars: int = 40  # pieces: voices that decode whole utterances (see the module docstring)
    piece_growth: float = 1.5
    piece_tail_chars: int = 20
    piece_min_chars: int = 16


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _period_ends_sentence(text: str, start: int, next_char: str) -> bool:
    """Is the period run starting at ``start`` a sentence end, given the next non-space char?"""
    if next_char and not (next_char.isupper() or next_char.isdigit() or next_char in _OPENERS):
        return False
    word_start = start
    while word_start > 0 and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:start].lstrip(_OPENERS)
    if "." in word or word.lower() in _ABBREVIATIONS:
        return False
    return not (len(word) == 1 and word.isalpha())


def find_cut(
    text: str, min_clause_chars: int | None, final: bool = False, early: tuple[int, int] | None = None
) -> int | None:
    """End index of the first utterance in ``text``, or None if none is decided yet.

    ``final`` says no more text will follow, so trailing whitespace decides a pending end.
    ``min_clause_chars`` None disables clause cuts. ``early`` (min chars, lookahead): a
    shorter clause also ends the utterance when the next ``lookahead`` characters hold no
    sentence end (a stream's first utterance).
    """
    for match in _CANDIDATE.finditer(text):
        end = match.end()
        cut = _skip_space(text, end)
        if cut == len(text) and not final:
            return None  # only whitespace (or nothing) after it yet: undecided
        next_char = text[cut] if cut < len(text) else ""
        spaced = cut > end or not next_char
        run = match.group(0).rstrip(_CLOSERS)
        if run[0] in ".!?…":
            if not spaced:
                continue
            if "!" in run or "?" in run or _period_ends_sentence(text, match.start(), next_char):
                return cut
            continue
        if not (spaced or run == "—"):
            continue
        chars = match.start() + len(run)
        if min_clause_chars is not None and chars >= min_clause_chars:
            return cut
        if early is not None and chars >= early[0]:
            lookahead = text[cut : cut + early[1]]
            if find_cut(lookahead, None) is not None:
                continue  # the sentence ends soon: keep this clause with it
            if len(lookahead) < early[1]:
                return None  # undecided until the lookahead has arrived
            return cut
    return None


# Words a phrase may start with: a piece cut before one of them keeps the phrase whole.
_PHRASE_STARTS = frozenset(
    "and but or nor so yet because that which who whom whose when where while if unless until "
    "although though since before after as than with without for from in on at by about during "
    "of to into through over under between against".split()
)
_WORD = re.compile(r"\S+")


def _starts_phrase(word: str) -> bool:
    return word.strip(_OPENERS).lower() in _PHRASE_STARTS


def piece_cut(text: str, limit: int, min_chars: int) -> int:
    """Where to end a piece of a whole-utterance voice that must end by ``limit`` (see the
    module docstring): its last clause mark, else before its last phrase-starting word (in its
    second half), else at its last space, each at ``min_chars`` or later; else `force_cut`. ``text`` may run past
    ``limit``: a word starting at the limit is still read whole."""
    found = phrase_cut(text, limit, min_chars, limit // 2)
    if found is not None:
        return found
    words = _words(text, limit, min_chars)
    return words[-1][0] if words else force_cut(text[:limit])


def _words(text: str, limit: int, min_chars: int) -> list[tuple[int, str]]:
    """(start, word) of the words of ``text`` starting from ``min_chars`` up to ``limit``."""
    return [(m.start(), m.group(0)) for m in _WORD.finditer(text) if min_chars <= m.start() <= limit]


def phrase_cut(text: str, limit: int, min_chars: int, min_phrase_chars: int) -> int | None:
    """The last clause mark in ``text[:limit]`` at ``min_chars`` or later, else the start of its
    last phrase-starting word at ``min_phrase_chars`` or later (up to ``limit``), else None."""
    window = text[:limit]
    clause = [m.end() for m in _CLAUSE_BOUNDARY.finditer(window)
              if m.end() >= min_chars and m.group(0) != m.group(0).rstrip()]
    if clause:
        return clause[-1]
    words = _words(text, limit, min_chars)
    # Before the first of a run of them ("so that", "and if"): the run starts the phrase.
    starts = [at for i, (at, word) in enumerate(words) if _starts_phrase(word) and at >= min_phrase_chars
              and not (i > 0 and _starts_phrase(words[i - 1][1]))]
    return starts[-1] if starts else None


def force_cut(window: str) -> int:
    """Where to split text that reached the length limit without a natural cut."""
    best = 0
    for match in _CLAUSE_BOUNDARY.finditer(window):
        if match.group(0) != match.group(0).rstrip() or match.group(0).startswith("—"):
            best = match.end()
    if 0 < best:
        return best
    lead = 0  # whitespace the window starts with (a piece of its own rather than a word cut in two)
    for match in _WHITESPACE.finditer(window):
        if match.start() > 0:
            best = match.end()
        elif match.end() < len(window):
            lead = match.end()
    return best or lead or len(window)


class IncrementalSegmenter:
    """Buffers streamed text deltas and releases utterances ready to speak. Not thread safe."""

    def __init__(self, config: SegmenterConfig | None = None, pieces: bool = False) -> None:
        """``pieces``: the voice decodes whole utterances; cut the stream in growing pieces."""
        self.config = config or SegmenterConfig()
        self._pieces = pieces
        self._buffer = ""
        self._last_push: float | None = None
        self._count = 0  # utterances released
        self._chars_out = 0  # their characters

    @property
    def _released(self) -> bool:
        """The stream's first utterance is out."""
        return self._count > 0

    @property
    def pending(self) -> str:
        """Text received but not released yet."""
        return self._buffer

    def push(self, delta: str, now: float) -> list[str]:
        """Add a delta; return the utterances it completed."""
        self._buffer += delta
        self._last_push = now
        return self._release()

    def flush(self) -> list[str]:
        """Release everything buffered (end of input or explicit flush)."""
        out = [self._buffer] if self._buffer else []
        self._buffer = ""
        self._count += len(out)
        self._chars_out += sum(map(len, out))
        return out

    def poll(self, now: float) -> list[str]:
        """Release the buffer if nothing arrived for its idle timeout (see `SegmenterConfig`)."""
        return self.flush() if self.idle_in(now) == 0 else []

    def idle_in(self, now: float) -> float | None:
        """Seconds until `poll` releases the buffer (0: now); None with nothing buffered."""
        if not self._buffer or self._last_push is None:
            return None
        at_boundary = self._buffer[-1].isspace() or _FINAL_END.search(self._buffer) is not None
        timeout = self.config.idle_timeout_s
        if not at_boundary:
            timeout = max(timeout, self.config.word_timeout_s)
        return max(0.0, timeout - (now - self._last_push))

    def _release(self) -> list[str]:
        out: list[str] = []
        max_chars = max(1, self.config.max_chars)
        while self._buffer:
            # Only the first max_chars characters count, so the cut does not depend on how
            # much text arrived in one push.
            window = self._buffer[:max_chars]
            first = self.config.first_min_clause_chars
            early = None if self._released or first is None else (first, self.config.first_clause_lookahead_chars)
            limit, cut = self._piece_limit(), None
            if limit is not None:
                # Decided from the first limit + tail characters alone (the same for any deltas).
                head = window[: limit + self.config.piece_tail_chars]
                cut = find_cut(head, self.config.min_clause_chars, early=early)
                if cut is None:
                    if len(head) < limit + self.config.piece_tail_chars and len(self._buffer) < max_chars:
                        break  # (a full window decides now: it holds all the text that counts)
                    if self._pieces:
                        cut = piece_cut(head, limit, self.config.piece_min_chars)
                    else:  # a streaming voice's first piece: at a phrase boundary or not at all
                        cut = phrase_cut(head, limit, self.config.piece_min_chars, self.config.piece_min_chars)
            if cut is None:
                cut = find_cut(window, self.config.min_clause_chars, early=early)
            if cut is None:
                if len(self._buffer) < max_chars:
                    break
                cut = force_cut(window)
            out.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            self._count += 1
            self._chars_out += cut
        return out

    def _piece_limit(self) -> int | None:
        """The next piece's length limit, or None once pieces reach ``max_chars`` (or are off):
        a streaming voice's first utterance only, a whole-utterance voice's every one."""
        c = self.config
        if not self._pieces:
            first = c.first_piece_chars
            return first if first is not None and self._count == 0 and first < c.max_chars else None
        limit = int(min(c.piece_chars * c.piece_growth ** min(self._count, 32),
                        max(c.piece_chars, c.piece_growth * self._chars_out)))
        return limit if limit < c.max_chars else None


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Split a whole text into sentences of at most ``max_chars`` (stripped, none empty).

    Overlong sentences are split at clause boundaries, then at spaces. The text is the
    pieces joined with the whitespace that was between them.
    """
    segmenter = IncrementalSegmenter(
        SegmenterConfig(min_clause_chars=max_chars + 1, max_chars=max_chars, first_piece_chars=None)
    )
    pieces = segmenter.push(text, 0.0) + segmenter.flush()
    return [p.strip() for p in pieces if p.strip()]
