"""Acoustic stage on CUDA, side by side in one process: convolutions as matrix products (what
the torch backend runs) vs torch's own (without cuDNN), each as CUDA graphs per bucket.

    python scripts/bench_encoder.py            # prints one line per (batch, phonemes) bucket
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from service.backends.torch_backend import TorchBackend, _EncoderGraphs, _gemm_conv1d
from service.voices import Voice, builtin_voice_info


def _time(graphs: _EncoderGraphs, batch: int, length: int, repeats: int = 10) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 100, (batch, length))
    lengths = np.full(batch, length, dtype=np.int64)
    noise = rng.standard_normal((batch, 2, length)).astype(np.float32)
    graphs.run(ids, lengths, noise, None)  # capture
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        graphs.run(ids, lengths, noise, None)  # includes the copy back to the host
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    backend = TorchBackend(Voice(builtin_voice_info()), device="cuda")
    model = backend.models["fp32"]
    gemm = _EncoderGraphs(model, backend._device)
    library = _EncoderGraphs(model, backend._device)
    patched = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d) and "forward" in vars(m)]
    for batch, length in ((1, 64), (4, 96), (16, 128), (64, 160)):
        a = _time(gemm, batch, length)
        for m in patched:
            del m.forward  # torch's own convolution again
        b = _time(library, batch, length)
        for m in patched:
            m.forward = partial(_gemm_conv1d, m)  # type: ignore[method-assign]
        print(f"batch={batch} phonemes={length} gemm_ms={a * 1e3:.2f} library_ms={b * 1e3:.2f} "
              f"speedup={b / a:.1f}x", flush=True)


if __name__ == "__main__":
    main()
