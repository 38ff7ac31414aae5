"""An offline recogniser for the speech checks (pocketsphinx, coarse): audio -> lower-case words."""

from __future__ import annotations

import numpy as np
import soxr


def transcribe(audio: np.ndarray, rate: int) -> list[str]:
    from pocketsphinx import Decoder

    pcm = (np.clip(soxr.resample(audio, rate, 16000), -1, 1) * 32767).astype(np.int16)
    decoder = Decoder(samprate=16000)
    decoder.start_utt()
    decoder.process_raw(pcm.tobytes(), full_utt=True)
    decoder.end_utt()
    return decoder.hyp().hypstr.lower().split() if decoder.hyp() else []


def word_error_rate(ref: list[str], hyp: list[str]) -> float:
    d = np.zeros((len(ref) + 1, len(hyp) + 1), dtype=int)
    d[:, 0] = np.arange(len(ref) + 1)
    d[0, :] = np.arange(len(hyp) + 1)
    for i in range(1, len(ref) + 1):
        for j in range(1, len(hyp) + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]))
    return float(d[-1, -1]) / max(len(ref), 1)
