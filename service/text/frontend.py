"""Text frontend: text (+ annotations, custom dictionary) to per-sentence phoneme ids and words.

Without annotations the ids are exactly Piper's (``PiperVoice.phonemize`` then
``phonemes_to_ids``), because the voice was trained on them. Annotations and dictionary words
become raw phoneme blocks, joined to the espeak output with Piper's own ``[[ ]]`` rules.

Word spans are recovered after the fact: espeak separates words with spaces but does not say
which source word produced which phoneme word (numbers expand, abbreviations merge), so source
tokens are aligned to phoneme words by counting, see ``_map_words``.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from service.text.annotations import (
    ARPABET_RUN_PATTERN,
    AnnotationError,
    ipa_to_phonemes,
    parse_arpabet_run,
    parse_pronunciation,
)
from service.text.phoneme_ids import phonemes_to_ids
from service.text.phonemize import RAW_BLOCK_PATTERN, Piece, assemble, espeak_sentences

_TOKEN = re.compile(r"\S+")
_EDGE_PUNCT = "\"'“”‘’«»„()[]{}<>,;:!?.…—–-¡¿"
_LEADING_PUNCT = re.compile(r"\s*([.!?]+|[,;:])")
_PLAIN_CHARS = _EDGE_PUNCT + "'’"
_CLOSERS = "\"'“”‘’»)]}"
_SENTENCE_END_CHARS = ".!?…"
# espeak clause terminators Piper keeps as symbols; they belong to no word.
_PUNCT_PHONEMES = frozenset(",.;:!?")
# Preference for sentence breaks after sentence-final punctuation, in units of "words off".
_NO_PUNCT_PENALTY = 1.5
_SOLO_CACHE_MAX = 20_000
# The most phonemes one utterance may hold. A longer sentence (a run of numbers or symbols, or
# long annotations) is split at word boundaries: the acoustic stage's time and memory grow with
# the square of an utterance's length, and one utterance of minutes would hold every other
# session's first audio behind it.
MAX_SENTENCE_PHONEMES = 400
_SENTENCE_SLACK = 10  # how many words past a sentence's count its end is searched


@dataclass(frozen=True)
class WordSpan:
    """A source word and the ids it produced (for timing and highlighting)."""

    text: str  # the word as written (for numbers, e.g. "123", the whole token)
    start_id: int  # index into phoneme_ids of the word's first phoneme id
    end_id: int  # exclusive end index into phoneme_ids


@dataclass(frozen=True)
class PhonemizedSentence:
    """One sentence, the unit the acoustic model synthesises."""

    text: str  # the source text of this sentence
    phonemes: list[str]
    phoneme_ids: list[int]
    words: list[WordSpan]


@dataclass(frozen=True)
class _Token:
    text: str
    start: int  # char offsets into the request text
    end: int
    ends_sentence: bool  # followed by sentence punctuation or a line break


@dataclass
class _Source:
    """A piece plus where it came from in the request text."""

    piece: Piece
    start: int
    end: int
    display: str = ""  # word text for annotation pieces


@dataclass
class _Word:
    text: str
    start: int  # phoneme indices within the (local or final) sentence
    end: int


@dataclass
class _LocalSentence:
    words: list[_Word] = field(default_factory=list)
    char_start: int = -1
    char_end: int = -1


@dataclass
class _Builder:
    words: list[_Word] = field(default_factory=list)
    from_user: set[int] = field(default_factory=set)
    char_start: int = -1
    char_end: int = -1

    def cover(self, start: int, end: int) -> None:
        if start < 0:
            return
        self.char_start = start if self.char_start < 0 else min(self.char_start, start)
        self.char_end = max(self.char_end, end)


class Frontend:
    """Phonemises text for one espeak voice and phoneme id map. Thread safe."""

    def __init__(self, espeak_voice: str, phoneme_id_map: Mapping[str, Sequence[int]]) -> None:
        self.espeak_voice = espeak_voice
        self.phoneme_id_map = phoneme_id_map
        self._solo_cache: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_piper_config(cls, config_path: str | Path) -> Frontend:
        """Build from a Piper voice ``.onnx.json``."""
        config = json.loads(Path(config_path).read_text(encoding="utf-8"))
        return cls(config["espeak"]["voice"], config["phoneme_id_map"])

    def sentences(
        self, text: str, custom_dictionary: Mapping[str, str] | None = None, words: bool = True
    ) -> list[PhonemizedSentence]:
        """Text to sentences of phonemes, ids and word spans (``[]`` for blank text).

        ``words=False``: no word spans (empty ``words``; ids and sentence texts are the same).
        Matching written words to the phoneme words espeak made is most of the frontend's time,
        and only callers that asked for word timings need it.

        Raises ``AnnotationError`` for unusable annotations or dictionary entries.
        """
        if not text.strip():
            return []
        sources = self._sources(text, custom_dictionary or {})
        locals_per_source: list[list[_LocalSentence]] = []
        for i, source in enumerate(sources):
            if source.piece.raw is None:
                after_word = (
                    i > 0
                    and sources[i - 1].piece.raw is not None
                    and not (sources[i - 1].piece.text.startswith("[["))
                )
                source.piece.sentences = self._text_sentences(source.piece.text, after_word)
                locals_per_source.append(self._align_text(source, words))
            else:
                locals_per_source.append([])
        out, placements = assemble([s.piece for s in sources])

        builders = [_Builder() for _ in out]
        for source, local, places in zip(sources, locals_per_source, placements, strict=True):
            if source.piece.raw is not None:
                place = places[0]
                if place.sentence >= len(out):
                    continue
                builder = builders[place.sentence]
                n = len(source.piece.raw)
                builder.from_user.update(range(place.offset, place.offset + n))
                builder.cover(source.start, source.end)
                if n and words:
                    builder.words.append(_Word(source.display, place.offset, place.offset + n))
                continue
            for sentence, place in zip(local, places, strict=True):
                if place.sentence >= len(out):
                    continue
                builder = builders[place.sentence]
                builder.cover(sentence.char_start, sentence.char_end)
                for word in sentence.words:
                    builder.words.append(
                        _Word(word.text, word.start + place.offset, word.end + place.offset)
                    )
        return [
            self._finish(text, part, piece)
            for phonemes, builder in zip(out, builders, strict=True)
            for part, piece in _split_long(phonemes, builder, MAX_SENTENCE_PHONEMES)
        ]

    def _text_sentences(self, text: str, after_word: bool) -> list[list[str]]:
        """espeak sentences of a text piece.

        Alone, espeak drops or spells out punctuation that starts a text ("." vanishes, "!"
        becomes "exclamation"). After an ARPAbet or dictionary word (not after Piper's own
        ``[[ ]]`` blocks, kept bit-exact) that punctuation belongs to the word, so it is
        emitted here as espeak would have in context.
        """
        lead = _LEADING_PUNCT.match(text) if after_word else None
        if lead is None:
            return espeak_sentences(self.espeak_voice, text)
        mark = lead.group(1)[0]
        rest = espeak_sentences(self.espeak_voice, text[lead.end() :])
        if mark in ".!?":
            return [[mark], *rest]
        return [[mark, " ", *rest[0]], *rest[1:]]

    # -- building pieces -------------------------------------------------------------------

    def _sources(self, text: str, dictionary: Mapping[str, str]) -> list[_Source]:
        """Split text into espeak text and annotation pieces (raw IPA, ARPAbet, dictionary)."""
        id_map = self.phoneme_id_map
        entries = _compile_dictionary(dictionary, id_map)
        sources: list[_Source] = []
        # Piper's [[ ]] split first, so raw blocks behave exactly as in Piper.
        pos = 0
        for part in RAW_BLOCK_PATTERN.split(text):
            start, pos = pos, pos + len(part)
            if part.startswith("[["):
                phonemes = ipa_to_phonemes(part[2:-2], id_map)
                sources.append(_Source(Piece(part, raw=phonemes), start, pos, part))
            else:
                sources.extend(_split_plain(part, start, entries))
        return sources

    # -- word alignment --------------------------------------------------------------------

    def _solo_words(self, token: str) -> tuple[str, ...]:
        """The phoneme words espeak makes of this token alone (cached)."""
        cached = self._solo_cache.get(token)
        if cached is None:
            cached = tuple(
                "".join(s[a:b])
                for s in espeak_sentences(self.espeak_voice, token)
                for a, b in _phoneme_words(s)
            )
            if len(self._solo_cache) >= _SOLO_CACHE_MAX:
                self._solo_cache.clear()
            self._solo_cache[token] = cached
        return cached

    def _align_text(self, source: _Source, words: bool = True) -> list[_LocalSentence]:
        """Assign the tokens of a text piece to its espeak sentences and (`words`) phoneme words."""
        text, base = source.piece.text, source.start
        tokens = _tokens(text, base)
        sentences = source.piece.sentences
        pwords = [_phoneme_words(s) for s in sentences]
        if len(sentences) <= 1:
            groups = [tokens]
        else:
            solo = [self._solo_words(t.text) for t in tokens]
            word_texts = [
                ["".join(s[a:b]) for a, b in w] for s, w in zip(sentences, pwords, strict=True)
            ]
            bounds = _sentence_bounds(solo, [t.ends_sentence for t in tokens], word_texts)
            edges = [0, *bounds, len(tokens)]
            groups = [tokens[edges[i] : edges[i + 1]] for i in range(len(sentences))]
        result: list[_LocalSentence] = []
        for group, spans in zip(groups, pwords, strict=True):
            local = _LocalSentence()
            if group:
                local.char_start, local.char_end = group[0].start, group[-1].end
            sentence = sentences[len(result)]
            result.append(local)
            if not words:
                continue
            texts = ["".join(sentence[a:b]) for a, b in spans]
            for t0, t1, first, last in _map_words(group, texts, self._solo_words):
                written = text[group[t0].start - base : group[t1 - 1].end - base]
                local.words.append(_Word(_word_text(written), spans[first][0], spans[last - 1][1]))
        return result

    def _finish(self, text: str, phonemes: list[str], builder: _Builder) -> PhonemizedSentence:
        from_user = [k in builder.from_user for k in range(len(phonemes))]
        converted = phonemes_to_ids(phonemes, self.phoneme_id_map, from_user)
        spans: list[WordSpan] = []
        last_end = 0
        for word in sorted(builder.words, key=lambda w: w.start):
            kept = [k for k in range(word.start, word.end) if converted.positions[k] >= 0]
            if not kept:
                continue
            start_id = converted.positions[kept[0]]
            end_id = converted.positions[kept[-1]] + len(self.phoneme_id_map[phonemes[kept[-1]]])
            if start_id < last_end:
                continue
            spans.append(WordSpan(word.text, start_id, end_id))
            last_end = end_id
        source = text[builder.char_start : builder.char_end] if builder.char_start >= 0 else ""
        return PhonemizedSentence(source, list(phonemes), converted.ids, spans)


def _split_long(
    phonemes: list[str], builder: _Builder, limit: int
) -> list[tuple[list[str], _Builder]]:
    """A sentence of more than `limit` phonemes as pieces of at most `limit`, cut after the last
    word break (a space phoneme) that fits, else hard at the limit."""
    if len(phonemes) <= limit:
        return [(phonemes, builder)]
    pieces: list[tuple[list[str], _Builder]] = []
    start = 0
    while start < len(phonemes):
        end = min(start + limit, len(phonemes))
        if end < len(phonemes):
            spaces = [k for k in range(start + 1, end) if phonemes[k] == " "]
            if spaces:
                end = spaces[-1] + 1
        piece = _Builder(from_user={k - start for k in builder.from_user if start <= k < end})
        for word in builder.words:
            if start <= word.start < end:
                piece.words.append(_Word(word.text, word.start - start, min(word.end, end) - start))
        piece.char_start, piece.char_end = builder.char_start, builder.char_end
        pieces.append((phonemes[start:end], piece))
        start = end
    return pieces


def _split_plain(text: str, offset: int, entries: Mapping[str, list[str]]) -> list[_Source]:
    """Split plain text at ARPAbet runs and dictionary words."""
    pattern = _annotation_pattern(list(entries))
    sources: list[_Source] = []
    pos = 0
    for match in pattern.finditer(text):
        plain = text[pos : match.start()]
        sources.append(_Source(Piece(plain), offset + pos, offset + match.start()))
        written = match.group(0)
        if ARPABET_RUN_PATTERN.fullmatch(written):
            phonemes = parse_arpabet_run(written)
        else:
            phonemes = list(entries[written.lower()])
        sources.append(
            _Source(
                Piece(written, raw=phonemes),
                offset + match.start(),
                offset + match.end(),
                written,
            )
        )
        pos = match.end()
    sources.append(_Source(Piece(text[pos:]), offset + pos, offset + len(text)))
    return sources


def _compile_dictionary(
    dictionary: Mapping[str, str], id_map: Mapping[str, Sequence[int]]
) -> dict[str, list[str]]:
    """Lower-cased word -> phonemes; a bad entry is an error naming the word."""
    entries: dict[str, list[str]] = {}
    for word, pronunciation in dictionary.items():
        key = word.strip().lower()
        if not key:
            continue
        try:
            entries[key] = parse_pronunciation(pronunciation, id_map)
        except AnnotationError as exc:
            raise AnnotationError(f"custom dictionary entry {word!r}: {exc}") from exc
    return entries


def _annotation_pattern(words: list[str]) -> re.Pattern[str]:
    """ARPAbet runs, then whole-word dictionary words (longest first), case-insensitive."""
    alternatives = [ARPABET_RUN_PATTERN.pattern]
    if words:
        escaped = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        alternatives.append(rf"(?<!\w)(?:{escaped})(?!\w)")
    return re.compile("|".join(alternatives), re.IGNORECASE)


def _tokens(text: str, offset: int) -> list[_Token]:
    tokens: list[_Token] = []
    for match in _TOKEN.finditer(text):
        word = match.group(0).rstrip(_CLOSERS)
        after = text[match.end() : match.end() + 2]
        ends = word.endswith(tuple(_SENTENCE_END_CHARS)) or "\n" in after
        tokens.append(_Token(match.group(0), offset + match.start(), offset + match.end(), ends))
    return tokens


def _word_text(token: str) -> str:
    stripped = token.strip(_EDGE_PUNCT)
    return stripped or token


def _phoneme_words(phonemes: Sequence[str]) -> list[tuple[int, int]]:
    """Phoneme index ranges of the space separated words, terminator punctuation trimmed."""
    words: list[tuple[int, int]] = []
    start = -1
    for k, phoneme in enumerate([*phonemes, " "]):
        if phoneme != " ":
            if start < 0:
                start = k
            continue
        if start >= 0:
            first, end = start, k
            while first < end and phonemes[first] in _PUNCT_PHONEMES:
                first += 1
            while end > first and phonemes[end - 1] in _PUNCT_PHONEMES:
                end -= 1
            if first < end:
                words.append((first, end))
            start = -1
    return words


def _sentence_bounds(
    solo: Sequence[tuple[str, ...]], ends_sentence: Sequence[bool], pwords: Sequence[list[str]]
) -> list[int]:
    """Token boundaries between espeak sentences (len(pwords) - 1 of them).

    Greedy, sentence by sentence, so a miscount in one sentence does not shift the next:
    the end token is the one whose solo word count best fills the sentence, preferring
    tokens that end with sentence punctuation and whose last phoneme word is the sentence's.
    """
    bounds: list[int] = []
    start = 0
    for words in pwords[:-1]:
        want = len(words)
        last = _strip_stress(words[-1]) if words else ""
        best_cost, best_k = float("inf"), start
        have = 0
        for k in range(start, len(solo) + 1):
            if k > start:
                have += len(solo[k - 1])
                if have > want + _SENTENCE_SLACK:
                    break
            cost = abs(have - want) + (0.0 if k > 0 and ends_sentence[k - 1] else _NO_PUNCT_PENALTY)
            if last and k > start and solo[k - 1] and _strip_stress(solo[k - 1][-1]) == last:
                cost -= 1.0
            if cost < best_cost:
                best_cost, best_k = cost, k
        bounds.append(best_k)
        start = best_k
    return bounds


def _map_words(
    tokens: Sequence[_Token],
    pwords: Sequence[str],
    solo_words: Callable[[str], tuple[str, ...]],
) -> list[tuple[int, int, int, int]]:
    """(first token, end token, first phoneme word, end phoneme word) groups, in order.

    1:1 when the word-like tokens match the phoneme words in number; else consecutive groups
    sized by each token's solo phoneme word count; else a banded alignment (``_align_dp``).
    """
    n = len(pwords)
    if not tokens or n == 0:
        return []
    wordlike = [i for i, t in enumerate(tokens) if any(ch.isalnum() for ch in t.text)]
    # Numbers and symbols expand to several words, so a count match would be a coincidence.
    plain = all(ch.isalpha() or ch in _PLAIN_CHARS for t in tokens for ch in t.text)
    if plain and len(wordlike) == n:
        return [(i, i + 1, k, k + 1) for k, i in enumerate(wordlike)]
    solo = [solo_words(t.text) for t in tokens]
    takes = [len(words) for words in solo]
    if sum(takes) != n:
        takes = _align_dp(solo, pwords) or _proportional(takes, wordlike, n)
    starts: list[int] = []
    pos = 0
    for k in takes:
        starts.append(pos)
        pos += k
    takers = [i for i, k in enumerate(takes) if k]
    first_token = {i: i for i in takers}
    end_token = {i: i + 1 for i in takers}
    for i, k in enumerate(takes):
        if k or not solo[i]:
            continue
        # espeak merged this token into a neighbour's word ("Main St.", "of the"): join the
        # neighbour whose adjacent phoneme word looks more like this token alone.
        before = [j for j in takers if j < i]
        after = [j for j in takers if j > i]
        own = _strip_stress("".join(solo[i]))
        score_before = score_after = -1.0
        if before:
            word = pwords[starts[before[-1]] + takes[before[-1]] - 1]
            score_before = difflib.SequenceMatcher(None, own, _strip_stress(word)).ratio()
        if after:
            word = pwords[starts[after[0]]]
            score_after = difflib.SequenceMatcher(None, own, _strip_stress(word)).ratio()
        if score_before < 0 and score_after < 0:
            continue
        if score_after > score_before:
            first_token[after[0]] = min(first_token[after[0]], i)
        else:
            end_token[before[-1]] = max(end_token[before[-1]], i + 1)
    return [(first_token[i], end_token[i], starts[i], starts[i] + takes[i]) for i in takers]


def _strip_stress(phonemes: str) -> str:
    return phonemes.replace("ˈ", "").replace("ˌ", "")


def _align_dp(solo: Sequence[tuple[str, ...]], pwords: Sequence[str]) -> list[int] | None:
    """How many phoneme words each token takes, when espeak merged or split words in context.

    Cost of a token taking k words: how far k is from its solo count, plus up to 0.5 for
    phonemes that do not resemble its solo phonemes. Searched in a band around the solo
    positions; None when the band cannot reach the end.
    """
    m, n = len(solo), len(pwords)
    band = 8
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(m + 1)]
    choice = [[0] * (n + 1) for _ in range(m + 1)]
    cost[0][0] = 0.0
    expected = 0
    # Same minimum and the same tie-breaking (smallest j) as scoring every candidate in
    # (j, k) order, several times faster (this runs before the first audio of every
    # sentence espeak re-words): candidates are tried cheapest count term first, a
    # candidate is scored only while its lower bound (count term, then difflib's
    # cheap upper bound on the ratio) can still win, and each phoneme-word span keeps
    # one matcher with its second sequence indexed once.
    matchers: dict[tuple[int, int], difflib.SequenceMatcher[str]] = {}

    def wins(value: float, j: int, t: int, row: list[float], picks: list[int]) -> bool:
        return value < row[t] or (value == row[t] and j < t - picks[t])

    for i, words in enumerate(solo):
        want = len(words)
        solo_text = _strip_stress("".join(words))
        low, high = max(0, expected - band), min(n, expected + want + band)
        expected += want
        row, picks = cost[i + 1], choice[i + 1]
        candidates = [
            (cost[i][j] + float(abs(k - want)), j, k)
            for j in range(low, high + 1) if cost[i][j] != inf
            for k in range(0, min(n - j, want + 3) + 1)
        ]
        candidates.sort()
        for bound, j, k in candidates:
            t = j + k
            if not wins(bound, j, t, row, picks):
                continue
            value = bound
            if k:
                matcher = matchers.get((j, k))
                if matcher is None:
                    matcher = difflib.SequenceMatcher(None, "", _strip_stress("".join(pwords[j:t])))
                    matchers[(j, k)] = matcher
                matcher.set_seq1(solo_text)
                count = float(abs(k - want))
                if not wins(cost[i][j] + (count + 0.5 * (1.0 - matcher.real_quick_ratio())), j, t, row, picks):
                    continue
                value = cost[i][j] + (count + 0.5 * (1.0 - matcher.ratio()))
            if wins(value, j, t, row, picks):
                row[t] = value
                picks[t] = k
    if cost[m][n] == inf:
        return None
    takes: list[int] = []
    j = n
    for i in range(m, 0, -1):
        k = choice[i][j]
        takes.append(k)
        j -= k
    return takes[::-1]


def _proportional(counts: Sequence[int], wordlike: Sequence[int], n: int) -> list[int]:
    """Share n phoneme words among tokens in proportion to their solo counts."""
    weights = list(counts) if any(counts) else [int(i in wordlike) for i in range(len(counts))]
    if not any(weights):
        weights = [1] * len(counts)
    total = sum(weights)
    takes: list[int] = []
    cum = 0
    for w in weights:
        first = round(n * cum / total)
        cum += w
        takes.append(round(n * cum / total) - first)
    return takes
