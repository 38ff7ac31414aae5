"""Host time of `prior_rows` (a decoder step's prior mean/sigma frames, built row by row on the
host) for a 256-row, 64-frame step of 192-channel priors. Run it with PYTHONPATH pointing at two
checkouts to compare them: `PYTHONPATH=. python scripts/bench_prior_rows.py`."""

from __future__ import annotations

import time

import numpy as np

from service.synthesis import PriorSample, prior_rows


def main(rows: int = 256, frames: int = 64, channels: int = 192, rounds: int = 5, reps: int = 20) -> None:
    rng = np.random.default_rng(0)
    priors, starts = [], []
    for i in range(rows):
        phones, length = int(rng.integers(30, 120)), int(rng.integers(150, 600))
        priors.append(PriorSample(rng.standard_normal((channels, phones)).astype(np.float32),
                                  rng.random((channels, phones)).astype(np.float32),
                                  np.sort(rng.integers(0, phones, length)), i))
        starts.append(int(rng.integers(0, length)))
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            prior_rows(priors, starts, frames)
        best.append((time.perf_counter() - t) / reps)
    print(f"prior_rows: {rows} rows x {frames} frames x {channels} channels: "
          f"median {1e3 * sorted(best)[len(best) // 2]:.2f} ms per step over {rounds} rounds of {reps}")


if __name__ == "__main__":
    main()
