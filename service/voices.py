"""Voice discovery over every model family: the built-in voice, a voices directory, a path."""

from __future__ import annotations

from pathlib import Path

from service.models.family import VoiceInfo, VoiceNotFoundError
from service.models.registry import builtin_voices, discover, recognise
from service.models.vits.voice import BUILTIN_VOICE

__all__ = ["BUILTIN_VOICE", "VoiceInfo", "VoiceNotFoundError", "builtin_voice_info", "check_voices_dir", "find_voice",
           "list_voices"]


def builtin_voice_info() -> VoiceInfo:
    """The server's default voice (the first family's built-in voice)."""
    return builtin_voices()[0]


def check_voices_dir(voices_dir: Path | str | None) -> None:
    """A --voices directory that is not there is an error, not an empty list of extra voices
    (a typo would otherwise serve the built-in voice alone, silently)."""
    if voices_dir is None:
        return
    path = Path(voices_dir)
    if not path.exists():
        raise VoiceNotFoundError(f"voices directory {path} does not exist (--voices)")
    if not path.is_dir():
        raise VoiceNotFoundError(f"{path} is not a directory (--voices takes the directory the voices are in)")


def list_voices(voices_dir: Path | None = None) -> list[VoiceInfo]:
    """The built-in voices plus every voice any family recognises in `voices_dir`."""
    check_voices_dir(voices_dir)
    found = builtin_voices()
    if voices_dir is not None:
        found += discover(Path(voices_dir))
    return found


def find_voice(spec: str | None, voices_dir: Path | None = None) -> VoiceInfo:
    """`spec` is None (built-in), a path to a voice's file, or a voice name."""
    check_voices_dir(voices_dir)
    if spec is None or spec == BUILTIN_VOICE:
        return builtin_voice_info()
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        return recognise(path)
    voices = {v.name: v for v in list_voices(voices_dir)}
    if spec in voices:
        return voices[spec]
    raise VoiceNotFoundError(
        f"unknown voice {spec!r}; available: {', '.join(sorted(voices))} (or pass a path to a voice's file, "
        "e.g. a Piper .onnx)"
    )
