"""CosyVoice2 (a Qwen2 LM writing 25 Hz speech tokens, chunked flow matching, HiFT vocoder, 24 kHz):
the third family on the contract, the first autoregressive one. A voice is the user's model
directory in the official release's layout (`voices.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.models.cosyvoice2.voices import FAMILY_NAME, discover, read_directory
from service.models.family import ChunkSchedule, ParityCheck, TextFrontend, VoiceInfo, VoiceRuntime


class CosyVoice2Family:
    name = FAMILY_NAME
    backends = ("torch",)

    def recognise(self, path: Path) -> VoiceInfo | None:
        return read_directory(path)

    def discover(self, directory: Path) -> list[VoiceInfo]:
        return discover(directory)

    def builtin(self) -> VoiceInfo | None:
        return None

    def frontend(self, source: str) -> TextFrontend:
        from service.models.cosyvoice2.text import CosyVoice2Frontend

        return CosyVoice2Frontend(source)

    def open(self, info: VoiceInfo, backend: str, device: str, schedule: ChunkSchedule,
             **options: Any) -> VoiceRuntime:
        if backend not in ("auto", "torch"):
            raise ValueError(f"CosyVoice2 voices run on the torch backend, not {backend!r} (--backend torch or auto)")
        import torch

        from service.models.cosyvoice2.runtime import COSYVOICE2_FP32_PINS, CosyVoice2Runtime

        if options.get("threads"):
            torch.set_num_threads(int(options["threads"]))
        pins = options.get("pins")
        return CosyVoice2Runtime(info, device, schedule, COSYVOICE2_FP32_PINS if pins is None else tuple(pins),
                                 compile_flow=bool(options.get("compile_decoder")))  # its decoder's hot part

    def parity(self, runtime: VoiceRuntime, threads: int | None) -> ParityCheck:
        from service.models.cosyvoice2.check import CosyVoice2Parity
        from service.models.cosyvoice2.runtime import CosyVoice2Runtime

        assert isinstance(runtime, CosyVoice2Runtime), "a cosyvoice2 voice's runtime"
        return CosyVoice2Parity(runtime, threads)

    def voice_prompt(self, info: VoiceInfo, audio: bytes, transcript: str | None) -> Any:
        from service.models.cosyvoice2.prompt import make_speaker

        return make_speaker(info.model_path, audio, transcript)


FAMILY = CosyVoice2Family()
