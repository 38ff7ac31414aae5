"""Waveform comparison figures used by `voices check`, `compare` and tests."""

from __future__ import annotations

import math

import numpy as np

# Reported when two signals are identical (MSE 0): a finite stand-in for infinity.
PSNR_IDENTICAL_DB = 200.0


def psnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Peak signal-to-noise ratio of `test` against `reference`, with the peak
    taken as the reference's max |x| (stricter than full scale for quiet audio).
    Signals of different length compare as if the shorter were zero-padded."""
    n = max(len(reference), len(test))
    ref = np.zeros(n, dtype=np.float64)
    tst = np.zeros(n, dtype=np.float64)
    ref[: len(reference)] = reference
    tst[: len(test)] = test
    mse = float(np.mean((ref - tst) ** 2)) if n else 0.0
    peak = float(np.max(np.abs(ref))) if n else 0.0
    if mse == 0.0:
        return PSNR_IDENTICAL_DB
    if peak == 0.0:
        return -math.inf
    return 10.0 * math.log10(peak * peak / mse)
