"""Kokoro voices as files: the model and beside it `voices/<pack>.bin`, one 510 x 256 style table
per voice (raw float32). The model is one of `MODEL_FILES`: the int8 release that
`service.models.kokoro.weights` fetches into the cache (dequantised on load), or the official
checkpoint or float graph that `cadenza voices install kokoro --from DIR` copies there
(`service.models.kokoro.install`). Serve them with `cadenza serve --voices <that folder>`."""

from __future__ import annotations

from pathlib import Path

from service.models.family import Gender, VoiceInfo

FAMILY_NAME = "kokoro"
MODEL_FILE = "kokoro-v1.0.int8.onnx"  # the int8 release: what the registries hold
CHECKPOINT_FILE = "kokoro-v1_0.pth"  # the official KModel checkpoint (float32)
FLOAT_MODEL_FILE = "kokoro-v1.0.onnx"  # kokoro-onnx's float graph
# Which model a folder's voices use when it holds several: the float weights before the int8 ones.
MODEL_FILES = (CHECKPOINT_FILE, FLOAT_MODEL_FILE, MODEL_FILE)
SAMPLE_RATE = 24_000
VOICE_ROWS, VOICE_DIM = 510, 256  # a pack: one style vector per utterance length in phonemes
VOICE_BYTES = VOICE_ROWS * VOICE_DIM * 4
PREFIX = "kokoro-"

# A pack's first letter is its language, its second the speaker's gender (the official naming).
LANGUAGES = {"a": "en-US", "b": "en-GB", "e": "es", "f": "fr-FR", "h": "hi", "i": "it", "j": "ja",
             "p": "pt-BR", "z": "zh"}
GENDERS = {"f": Gender.FEMALE, "m": Gender.MALE}


def model_file(directory: Path) -> Path | None:
    """The model the voices under `directory` use: the first of `MODEL_FILES` there."""
    return next((directory / name for name in MODEL_FILES if (directory / name).is_file()), None)


def read_pack(path: Path) -> VoiceInfo | None:
    """The voice of `<dir>/voices/<pack>.bin` when a model is in `<dir>` (None: not a Kokoro pack)."""
    model = model_file(path.parent.parent)
    if path.suffix != ".bin" or path.parent.name != "voices" or model is None:
        return None
    if path.stat().st_size != VOICE_BYTES or path.stem[:1] not in LANGUAGES:
        return None
    language = LANGUAGES[path.stem[0]]
    return VoiceInfo(
        name=PREFIX + path.stem, family=FAMILY_NAME, model_path=path, config_path=model,
        frontend_key=f"{FAMILY_NAME}:{language}", sample_rate=SAMPLE_RATE, language=language,
        num_speakers=1, speaker_id_map={}, length_scale=1.0,
        gender=GENDERS.get(path.stem[1:2], Gender.UNSPECIFIED), decodes_whole_utterances=True,
    )


def discover(directory: Path) -> list[VoiceInfo]:
    """The packs in `directory` whose language the frontend speaks: a server lists (and with
    --preload warms up) only voices that can answer; the others are still recognised by path."""
    from service.models.kokoro.frontend import SUPPORTED_LANGUAGES

    packs = sorted((directory / "voices").glob("*.bin"))
    return [info for p in packs if (info := read_pack(p)) is not None and info.language in SUPPORTED_LANGUAGES]
