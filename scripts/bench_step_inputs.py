"""Host time of a decoder step's input (`VitsStreamingDecoder._int_rows`: slots, positions and the
prior column each frame reads) for a 256-row, 64-frame step of the built-in voice, each row's
prior already in the decoder's prior memory. The step input used to carry every row's prior
mean and sigma frames (`prior_rows`, `bench/results/cpu-prior-rows.txt`).
`PYTHONPATH=. python scripts/bench_step_inputs.py`"""

from __future__ import annotations

import time

import numpy as np
import torch

from service.models.family import StepRows
from service.models.vits.streaming import VitsStreamingDecoder
from service.synthesis import PriorSample, open_synthesizer


def main(rows: int = 256, frames: int = 64, rounds: int = 5, reps: int = 20) -> None:
    model = open_synthesizer(None, backend="torch").voice.model
    dec = VitsStreamingDecoder(model, "fp32", rows, torch.device("cpu"), torch.float32)
    channels = dec.shapes[0].channels
    rng = np.random.default_rng(0)
    fed = []
    for i in range(rows):
        phones, length = int(rng.integers(30, 120)), int(rng.integers(150, 600))
        assert dec.start(i, PriorSample(rng.standard_normal((channels, phones)).astype(np.float32),
                                        rng.random((channels, phones)).astype(np.float32),
                                        np.sort(rng.integers(0, phones, length)), i))
        fed.append(int(rng.integers(0, length)))
    step = StepRows(list(range(rows)), fed, frames, None)
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            dec._int_rows(step, rows)
        best.append((time.perf_counter() - t) / reps)
    print(f"step input: {rows} rows x {frames} frames ({channels}-channel priors on the device): "
          f"median {1e3 * sorted(best)[len(best) // 2]:.2f} ms per step over {rounds} rounds of {reps}")


if __name__ == "__main__":
    main()
