"""Cheaper ways to run the acoustic stage, measured against what the server runs (FP32, TF32 off),
on real sentences, side by side in one process:

* `tf32`: the same graph with TF32 tensor-core matrix products (10 mantissa bits);
* `compiled`: the FP32 stage through `torch.compile` (inductor fuses its elementwise kernels; the
  arithmetic stays FP32);
* `compiled-dynamic`: the same compiled with dynamic shapes, as the server compiles it once for
  all its buckets (`--compile-acoustic`);
* `compiled-tf32`: compiled with TF32.

For each it prints the device time of one call on a padded batch (a CUDA graph of it on CUDA, the
way the server replays the stage; best of `--rounds`), the largest change of any log-duration
against the baseline, and how many phonemes' durations (whole frames, as the synthesizer rounds
them) changed: a changed duration changes the utterance's length, which the FP32 pin is there to
prevent. A variant is worth taking to the server only with no duration changed.

    python scripts/acoustic_variants.py [--device cuda] [--batch 64] [--rounds 10] [--variants tf32,compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from service.backends.registry import create_backend
from service.tools.bench_load import SENTENCES
from service.voices import Voice, list_voices


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _timed(fn: Callable[[], tuple[torch.Tensor, ...]], device: torch.device, rounds: int, tf32: bool
           ) -> tuple[float, tuple[torch.Tensor, ...]]:
    """(best ms, outputs) of `fn`: on CUDA as a captured graph (the matmul kernels are picked, and
    TF32 decided, at capture), on CPU eagerly."""
    with _tf32(tf32):
        for _ in range(2):
            out = fn()  # warm-up (and compilation)
        if device.type != "cuda":
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                out = fn()
                best = min(best, time.perf_counter() - t0)
            return best * 1e3, out
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--variants", default="tf32,compiled,compiled-dynamic,compiled-tf32")
    args = ap.parse_args()

    voice = Voice(list_voices()[0])
    backend = create_backend("torch", voice, device=args.device)
    model = backend.models["fp32"]  # type: ignore[attr-defined]
    device = torch.device(args.device)
    length_scale = voice.info.length_scale

    sentences = []
    while len(sentences) < args.batch:
        for text in SENTENCES:
            sentences += voice.frontend.sentences(text, words=False)
    sentences = sentences[: args.batch]
    lengths = np.asarray([len(s.phoneme_ids) for s in sentences], dtype=np.int64)
    ids = np.zeros((args.batch, int(lengths.max())), dtype=np.int64)
    for i, s in enumerate(sentences):
        ids[i, : lengths[i]] = s.phoneme_ids
    noise = np.random.default_rng(0).standard_normal((args.batch, 2, ids.shape[1])).astype(np.float32)
    noise *= voice.info.noise_w
    inputs = (torch.as_tensor(ids, device=device), torch.as_tensor(lengths, device=device),
              torch.as_tensor(noise, device=device))

    def stage(fn: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False):
                m_p, logs_p, logw, _ = fn(*inputs, None)
                return m_p, logs_p, logw
        return run

    def durations(logw: torch.Tensor) -> np.ndarray:
        w = np.ceil(np.exp(logw[:, 0].double().cpu().numpy()) * length_scale)
        return np.where(np.arange(w.shape[1])[None, :] < lengths[:, None], w, 0)

    base_ms, base = _timed(stage(model.encode), device, args.rounds, tf32=False)
    base_w = durations(base[2])
    phonemes = int(lengths.sum())
    print(f"device={args.device} batch={args.batch} phonemes={phonemes} (padded to {ids.shape[1]})", flush=True)
    print(f"  fp32 (the server's): {base_ms:.2f} ms", flush=True)
    compiled: dict[bool, Callable[..., tuple[torch.Tensor, ...]]] = {}
    for name in args.variants.split(","):
        fn = model.encode
        if name.startswith("compiled"):
            dynamic = name == "compiled-dynamic"
            if dynamic not in compiled:
                t0 = time.perf_counter()
                compiled[dynamic] = torch.compile(model.encode, dynamic=dynamic)
                stage(compiled[dynamic])()
                print(f"  ({'dynamic shapes ' if dynamic else ''}compiled in {time.perf_counter() - t0:.1f} s)",
                      flush=True)
            fn = compiled[dynamic]
        ms, out = _timed(stage(fn), device, args.rounds, tf32=name.endswith("tf32"))
        mask = torch.as_tensor(base_w > 0, device=out[2].device)[:, None]
        dlogw = float(((out[2] - base[2]).abs() * mask).max())
        dmean = float(((out[0] - base[0]).abs() * mask).max())
        changed = int(np.sum(durations(out[2]) != base_w))
        print(f"  {name}: {ms:.2f} ms ({base_ms / ms:.2f}x), max |d logw| {dlogw:.2e}, max |d mean| {dmean:.2e}, "
              f"durations changed {changed} of {phonemes} phonemes", flush=True)


if __name__ == "__main__":
    main()
