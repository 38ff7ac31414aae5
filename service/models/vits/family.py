"""VITS as Piper ships it: the first family on the contract (`service.models.family.Family`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.models.family import ChunkSchedule, ParityCheck, TextFrontend, VoiceInfo, VoiceRuntime
from service.models.vits.voice import FAMILY_NAME, Voice, builtin_voice_info, read_piper_voice


def default_backend(device: str) -> str:
    """ONNX Runtime on CPU (fastest there), PyTorch on CUDA."""
    return "torch" if device.startswith("cuda") else "onnxruntime"


# The engine's loading options each backend takes (the others do not apply to it: ONNX Runtime has
# no FP16 and only it has INT8, only the exporting backends keep a cache, only torch compiles its
# acoustic stage).
_BACKEND_OPTIONS = {
    "torch": frozenset({"threads", "pins", "compile_acoustic"}),
    "onnxruntime": frozenset({"threads", "cache_dir", "int8"}),
    "tensorrt": frozenset({"threads", "pins", "cache_dir", "compile_acoustic"}),
}


class VitsFamily:
    name = FAMILY_NAME
    backends = tuple(sorted(_BACKEND_OPTIONS))

    def recognise(self, path: Path) -> VoiceInfo | None:
        if path.suffix != ".onnx" or not Path(f"{path}.json").is_file():
            return None
        return read_piper_voice(path)

    def discover(self, directory: Path) -> list[VoiceInfo]:
        return [info for p in sorted(directory.glob("*.onnx")) if (info := self.recognise(p)) is not None]

    def builtin(self) -> VoiceInfo:
        return builtin_voice_info()

    def frontend(self, source: str) -> TextFrontend:
        from service.text.frontend import Frontend

        return Frontend.from_piper_config(source)

    def open(self, info: VoiceInfo, backend: str, device: str, schedule: ChunkSchedule,
             **options: Any) -> VoiceRuntime:
        from service.models.vits.backends.registry import create_backend
        from service.models.vits.runtime import VitsRuntime

        voice = Voice(info)
        name = default_backend(device) if backend == "auto" else backend
        accepted = _BACKEND_OPTIONS.get(name, frozenset())
        given = {k: v for k, v in options.items() if k in accepted}
        runtime: VoiceRuntime = VitsRuntime(voice, create_backend(name, voice, device, **given), schedule)
        return runtime


    def parity(self, runtime: VoiceRuntime, threads: int | None) -> ParityCheck:
        from service.models.vits.check import VitsParity
        from service.models.vits.runtime import VitsRuntime

        assert isinstance(runtime, VitsRuntime), "a vits voice's runtime"
        return VitsParity(runtime, threads)

    def voice_prompt(self, info: VoiceInfo, audio: bytes, transcript: str | None) -> Any:
        raise ValueError(f"voice {info.name} ({self.name}) has fixed speakers; it does not take a voice prompt")


FAMILY = VitsFamily()
