"""Kokoro-82M (StyleTTS2 with an iSTFTNet decoder, 24 kHz): the second family on the contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.models.family import ChunkSchedule, ParityCheck, TextFrontend, VoiceInfo, VoiceRuntime
from service.models.kokoro.voices import FAMILY_NAME, discover, read_pack


class KokoroFamily:
    name = FAMILY_NAME
    backends = ("torch",)

    def recognise(self, path: Path) -> VoiceInfo | None:
        return read_pack(path)

    def discover(self, directory: Path) -> list[VoiceInfo]:
        return discover(directory)

    def builtin(self) -> VoiceInfo | None:
        return None

    def frontend(self, source: str) -> TextFrontend:
        from service.models.kokoro.frontend import KokoroFrontend

        return KokoroFrontend(source)

    def open(self, info: VoiceInfo, backend: str, device: str, schedule: ChunkSchedule,
             **options: Any) -> VoiceRuntime:
        if backend not in ("auto", "torch"):
            raise ValueError(f"Kokoro voices run on the torch backend, not {backend!r} (--backend torch or auto)")
        import torch

        from service.models.kokoro.runtime import KokoroRuntime

        if options.get("threads"):
            torch.set_num_threads(int(options["threads"]))
        pins = options.get("pins")
        runtime: VoiceRuntime = (KokoroRuntime(info, device, schedule) if pins is None
                                 else KokoroRuntime(info, device, schedule, tuple(pins)))
        return runtime


    def parity(self, runtime: VoiceRuntime, threads: int | None) -> ParityCheck:
        from service.models.kokoro.check import KokoroParity
        from service.models.kokoro.runtime import KokoroRuntime

        assert isinstance(runtime, KokoroRuntime), "a kokoro voice's runtime"
        return KokoroParity(runtime, threads)

    def voice_prompt(self, info: VoiceInfo, audio: bytes, transcript: str | None) -> Any:
        raise ValueError(f"voice {info.name} ({self.name}) has fixed speakers; it does not take a voice prompt")


FAMILY = KokoroFamily()
