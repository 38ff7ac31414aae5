"""The model families the server knows, by name, imported on first use (a family's module may
load heavy dependencies; the server's API process only reads voice files through it)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from service.models.family import ChunkSchedule, Family, TextFrontend, VoiceInfo, VoiceNotFoundError, VoiceRuntime

# name -> "module:attribute" of its `Family`; the first family with a built-in voice gives the default voice.
FAMILIES: dict[str, str] = {
    "vits": "service.models.vits.family:FAMILY",
    "kokoro": "service.models.kokoro.family:FAMILY",
    "cosyvoice2": "service.models.cosyvoice2.family:FAMILY",
}

_loaded: dict[str, Family] = {}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise VoiceNotFoundError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    found = _loaded.get(name)
    if found is None:
        module, _, attr = FAMILIES[name].partition(":")
        found = _loaded[name] = getattr(importlib.import_module(module), attr)
    return found


def families() -> list[Family]:
    return [family(name) for name in FAMILIES]


def backend_names() -> list[str]:
    """Every backend some family runs on."""
    return sorted({name for fam in families() for name in fam.backends})


def recognise(path: Path) -> VoiceInfo:
    """The voice whose files are at `path`, whichever family's they are."""
    for fam in families():
        info = fam.recognise(path)
        if info is not None:
            return info
    if not path.exists():
        raise VoiceNotFoundError(f"voice file {path} does not exist")
    raise VoiceNotFoundError(f"{path} is not a voice of any known family ({', '.join(FAMILIES)}); "
                             "a Piper voice is <name>.onnx with <name>.onnx.json beside it, a Kokoro voice "
                             "<dir>/voices/<pack>.bin with kokoro-v1.0.int8.onnx in <dir>, a CosyVoice2 voice "
                             "the model directory (cosyvoice2.yaml, llm.pt, flow.pt, hift.pt)")


def builtin_voices() -> list[VoiceInfo]:
    return [info for fam in families() if (info := fam.builtin()) is not None]


def discover(directory: Path) -> list[VoiceInfo]:
    return [info for fam in families() for info in fam.discover(directory)]


def open_frontend(key: str) -> TextFrontend:
    """A voice's text frontend from its `VoiceInfo.frontend_key` ("<family>:<source>")."""
    name, sep, source = key.partition(":")
    if not sep:
        raise ValueError(f"frontend key {key!r} names no family (<family>:<source>)")
    return family(name).frontend(source)


def open_voice(info: VoiceInfo, backend: str, device: str, schedule: ChunkSchedule | None = None,
               **options: Any) -> VoiceRuntime:
    """Load `info`'s weights on `backend` ("auto": its family's choice for `device`). On CUDA,
    FP32 means FP32 from here on in this process (`no_tf32`)."""
    if device.startswith("cuda"):
        from service.models.mixed_precision import no_tf32  # torch: the API process lists voices without it

        no_tf32()
    return family(info.family).open(info, backend, device, schedule or ChunkSchedule(), **options)
