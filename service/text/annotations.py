"""Inline pronunciation annotations: ARPAbet ``[M][AY0][N][UW1][T]`` and raw IPA ``[[ ... ]]``.

ARPAbet is mapped to the IPA symbols espeak-ng's en-us voice emits, so annotated words sound
like the voice's own words. Stress: a vowel with digit 1 gets ``ˈ``, with 2 gets ``ˌ``, placed
directly before the vowel. That is where espeak-ng puts it ("twˈɛnti", "təmˈeɪɾoʊ"), so no
syllabification is needed. Digit 0 or no digit means unstressed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_CONSONANTS: dict[str, str] = {
    "B": "b",
    "CH": "tʃ",
    "D": "d",
    "DH": "ð",
    "F": "f",
    "G": "ɡ",
    "HH": "h",
    "JH": "dʒ",
    "K": "k",
    "L": "l",
    "M": "m",
    "N": "n",
    "NG": "ŋ",
    "P": "p",
    "R": "ɹ",
    "S": "s",
    "SH": "ʃ",
    "T": "t",
    "TH": "θ",
    "V": "v",
    "W": "w",
    "Y": "j",
    "Z": "z",
    "ZH": "ʒ",
}

# Vowel -> (stressed IPA, unstressed IPA). espeak en-us reduces AH/ER/IY when unstressed.
_VOWELS: dict[str, tuple[str, str]] = {
    "AA": ("ɑː", "ɑː"),
    "AE": ("æ", "æ"),
    "AH": ("ʌ", "ə"),
    "AO": ("ɔː", "ɔː"),
    "AW": ("aʊ", "aʊ"),
    "AY": ("aɪ", "aɪ"),
    "EH": ("ɛ", "ɛ"),
    "ER": ("ɜː", "ɚ"),
    "EY": ("eɪ", "eɪ"),
    "IH": ("ɪ", "ɪ"),
    "IY": ("iː", "i"),
    "OW": ("oʊ", "oʊ"),
    "OY": ("ɔɪ", "ɔɪ"),
    "UH": ("ʊ", "ʊ"),
    "UW": ("uː", "uː"),
}

ARPABET_SYMBOLS: tuple[str, ...] = tuple(sorted([*_CONSONANTS, *_VOWELS]))
"""The 39 CMU ARPAbet phonemes accepted (vowels may carry a stress digit 0, 1 or 2)."""

_STRESS_MARKS = {"1": "ˈ", "2": "ˌ"}

# One ARPAbet run: consecutive [SYMBOL] brackets, e.g. [T][AH0][M][EY1][T][OW2].
ARPABET_RUN_PATTERN = re.compile(r"(?:\[[A-Za-z]{1,3}[0-9]?\])+")
_BRACKET_SYMBOL = re.compile(r"\[([^\[\]]*)\]")
_SPACED_ARPABET = re.compile(r"[A-Z]{1,2}[0-2]?(?: +[A-Z]{1,2}[0-2]?)*")


class AnnotationError(ValueError):
    """A user-written pronunciation cannot be used with this voice."""


def _accepted() -> str:
    return (
        "accepted ARPAbet symbols: "
        + " ".join(ARPABET_SYMBOLS)
        + " (vowels "
        + " ".join(sorted(_VOWELS))
        + " may end in stress digit 0, 1 or 2)"
    )


def arpabet_symbol_to_ipa(symbol: str) -> str:
    """One ARPAbet symbol (e.g. ``EY1``) to IPA, stress mark included."""
    upper = symbol.upper()
    base, digit = (upper[:-1], upper[-1]) if upper[-1:].isdigit() else (upper, "")
    if base in _CONSONANTS and not digit:
        return _CONSONANTS[base]
    if base in _VOWELS and digit in ("", "0", "1", "2"):
        stressed, unstressed = _VOWELS[base]
        if digit in _STRESS_MARKS:
            return _STRESS_MARKS[digit] + stressed
        return unstressed
    raise AnnotationError(f"unknown ARPAbet symbol {symbol!r}; {_accepted()}")


def arpabet_to_phonemes(symbols: Sequence[str]) -> list[str]:
    """ARPAbet symbols to single-codepoint phonemes, as the id map expects."""
    if not symbols:
        raise AnnotationError(f"empty ARPAbet pronunciation; {_accepted()}")
    return [ch for symbol in symbols for ch in arpabet_symbol_to_ipa(symbol)]


def parse_arpabet_run(run: str) -> list[str]:
    """``[M][AY0][N]`` to phonemes."""
    return arpabet_to_phonemes(_BRACKET_SYMBOL.findall(run))


def ipa_to_phonemes(ipa: str, id_map: Mapping[str, Sequence[int]]) -> list[str]:
    """Raw IPA to phonemes (one per codepoint, as Piper does); unknown symbols are errors."""
    phonemes = list(ipa.strip())
    for phoneme in phonemes:
        if phoneme not in id_map:
            raise AnnotationError(
                f"IPA symbol {phoneme!r} (U+{ord(phoneme):04X}) is not in this voice's phoneme set"
            )
    if not phonemes:
        raise AnnotationError("empty IPA pronunciation")
    return phonemes


def parse_pronunciation(value: str, id_map: Mapping[str, Sequence[int]]) -> list[str]:
    """A custom dictionary entry to phonemes.

    Accepted: bracket ARPAbet ``[T][AH0][M][EY1][T][OW2]``, space separated upper-case
    ARPAbet ``T AH0 M EY1 T OW2``, ``[[ ipa ]]`` or bare IPA ``təmˈeɪɾoʊ``.
    """
    text = value.strip()
    if ARPABET_RUN_PATTERN.fullmatch(text):
        return parse_arpabet_run(text)
    if text.startswith("[[") and text.endswith("]]"):
        return ipa_to_phonemes(text[2:-2], id_map)
    if _SPACED_ARPABET.fullmatch(text):
        symbols = text.split()
        bases = [s[:-1] if s[-1].isdigit() else s for s in symbols]
        if all(b in _CONSONANTS or b in _VOWELS for b in bases):
            return arpabet_to_phonemes(symbols)
    return ipa_to_phonemes(text, id_map)
