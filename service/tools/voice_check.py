"""`cadenza voices check`: our model against the original implementation it was ported from (the
family's `ParityCheck`: Piper's ONNX graph, Kokoro's official model), waveform PSNR per sentence. A
model check: each sentence is decoded whole by our reference decode (what the served chunks equal,
see the exactness tests), so the figure is the port's, not the chunking's."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from service.audio.quality import psnr_db
from service.models.registry import family, open_frontend, open_voice
from service.voices import find_voice


def check_sentences() -> list[str]:
    text = resources.files("service").joinpath("data/check_sentences.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def run_voice_check(
    voice: str | None, voices_dir: str | None, backend: str, device: str, threads: int | None,
    limit: int | None = None,
) -> int:
    info = find_voice(voice, Path(voices_dir) if voices_dir else None)
    runtime = open_voice(info, "torch" if backend == "auto" else backend, device, threads=threads)
    check = family(info.family).parity(runtime, threads)
    frontend = open_frontend(info.frontend_key)
    print(f"voice {info.name}: ours ({runtime.backend_name} on {device}, reference decode) vs {check.description}")
    worst = float("inf")
    for i, text in enumerate(check_sentences()[:limit]):
        pairs = [check.pair(sent) for sent in frontend.sentences(text)]
        ref = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.float32)
        ours = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.float32)
        value = psnr_db(ref, ours)
        worst = min(worst, value)
        print(f"{i:2d} psnr_db={value:7.2f} samples={len(ours)}/{len(ref)}  {text}")
    print(f"min_psnr_db={worst:.2f}")
    return 0
