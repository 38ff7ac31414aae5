"""Thread-safe espeak-ng phonemisation that reproduces Piper's espeak path exactly.

Piper's bundled espeak-ng (``piper.espeakbridge``) is process-global and not thread safe, so
every call into it (initialise, set_voice, get_phonemes) goes through one module-level lock.
The output must match ``PiperVoice.phonemize`` symbol for symbol, because the voice was trained
on exactly those symbols.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

ESPEAK_LOCK = threading.Lock()
"""Guards every espeakbridge call in this process (espeak-ng keeps global state)."""

_initialized = False

# Same pattern as piper.voice: raw phonemes are written as [[ ... ]] (no newlines inside).
RAW_BLOCK_PATTERN = re.compile(r"(\[\[.*?\]\])")
_LANG_SWITCH_PATTERN = re.compile(r"\([^)]+\)")


def _ensure_initialized() -> None:
    """Initialise espeak once with Piper's bundled data; caller must hold ESPEAK_LOCK."""
    global _initialized
    if _initialized:
        return
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    espeakbridge.initialize(str(ESPEAK_DATA_DIR))
    _initialized = True


def espeak_clauses(voice: str, text: str) -> list[tuple[str, str, bool]]:
    """Raw (phonemes, terminator, end_of_sentence) clauses from espeak, under the lock."""
    from piper import espeakbridge

    with ESPEAK_LOCK:
        _ensure_initialized()
        # Set the voice on every call: another user of espeak may have changed it.
        espeakbridge.set_voice(voice)
        return list(espeakbridge.get_phonemes(text))


def espeak_sentences(voice: str, text: str) -> list[list[str]]:
    """Text to phonemes per sentence, as Piper's ``EspeakPhonemizer.phonemize`` does.

    Like Piper, the result always holds at least one (possibly empty) sentence for text
    without a sentence terminator; callers decide what to do with empty sentences.
    """
    all_phonemes: list[list[str]] = []
    sentence: list[str] = []
    for phonemes_str, terminator, end_of_sentence in espeak_clauses(voice, text):
        # Drop language switch flags such as "(fr)" around foreign words.
        phonemes_str = _LANG_SWITCH_PATTERN.sub("", phonemes_str)
        phonemes_str += terminator
        if terminator in (",", ":", ";"):
            phonemes_str += " "
        # NFD splits accented symbols into base + combining mark, one "phoneme" each.
        sentence.extend(unicodedata.normalize("NFD", phonemes_str))
        if end_of_sentence:
            all_phonemes.append(sentence)
            sentence = []
    if sentence:
        all_phonemes.append(sentence)
    return all_phonemes


@dataclass
class Piece:
    """One part of the input: plain text for espeak, or raw phonemes placed verbatim.

    ``text`` is the source text (for raw pieces, what the user wrote); it is also what
    Piper's spacing rule around raw blocks looks at.
    """

    text: str
    raw: list[str] | None = None
    sentences: list[list[str]] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """Where one local sentence of a piece (or a raw block) landed in the output."""

    sentence: int
    offset: int


def assemble(pieces: Sequence[Piece]) -> tuple[list[list[str]], list[list[Placement]]]:
    """Join text and raw pieces into sentences with the rules of ``PiperVoice.phonemize``.

    A raw block continues the current sentence (starting one if there is none), gets a space
    before/after when the neighbouring text starts/ends with a space, and the first sentence
    of the text after it is appended to it. Text pieces must already hold ``sentences``.
    Returns the sentences and, per piece, the placement of each of its local sentences
    (a raw piece has one). Trailing empty sentence is removed, as Piper does.
    """
    out: list[list[str]] = []
    placements: list[list[Placement]] = []
    prev_raw = False
    for i, piece in enumerate(pieces):
        if piece.raw is not None:
            prev_raw = True
            if not out:
                out.append([])
            if i > 0 and pieces[i - 1].raw is None and pieces[i - 1].text.endswith(" "):
                out[-1].append(" ")
            placements.append([Placement(len(out) - 1, len(out[-1]))])
            out[-1].extend(piece.raw)
            if (
                i < len(pieces) - 1
                and pieces[i + 1].raw is None
                and pieces[i + 1].text.startswith(" ")
            ):
                out[-1].append(" ")
            continue

        local = piece.sentences
        here: list[Placement] = []
        start = 0
        if prev_raw and local:
            here.append(Placement(len(out) - 1, len(out[-1])))
            out[-1].extend(local[0])
            start = 1
        for sentence in local[start:]:
            here.append(Placement(len(out), 0))
            out.append(list(sentence))
        placements.append(here)
        prev_raw = False

    if out and not out[-1]:
        out.pop()
    return out, placements


def split_raw_blocks(text: str) -> list[Piece]:
    """Split text at ``[[ ... ]]`` blocks exactly like Piper (raw content stripped)."""
    pieces: list[Piece] = []
    for part in RAW_BLOCK_PATTERN.split(text):
        if part.startswith("[["):
            pieces.append(Piece(text=part, raw=list(part[2:-2].strip())))
        else:
            pieces.append(Piece(text=part))
    return pieces


def phonemize(voice: str, text: str) -> list[list[str]]:
    """Text to phonemes per sentence, identical to ``PiperVoice.phonemize`` for espeak voices.

    (Voices with ``vowel_clusters`` are not supported; the built-in voice has none.)
    """
    pieces = split_raw_blocks(text)
    for piece in pieces:
        if piece.raw is None:
            piece.sentences = espeak_sentences(voice, piece.text)
    sentences, _ = assemble(pieces)
    return sentences
