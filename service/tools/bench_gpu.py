"""`cadenza bench gpu`: FP16 (with FP32 pins) against FP32 on a CUDA GPU, side by
side in one run: vocoder/flow throughput by batch size, weight and peak memory,
and time to first audio of a long sentence."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LONG_TEXT = (
    "Before we get started, I need to let you know that this call may be recorded for quality "
    "assurance and training purposes, and that you can ask for a copy of the recording at any time."
)


def run_gpu_bench(device: str, batches: list[int], chunk_frames: int, iters: int, out: Path | None) -> int:
    import torch

    from service.backends.torch_backend import TorchBackend
    from service.synthesis import ChunkSchedule, SynthesisParams, Synthesizer
    from service.voices import Voice, builtin_voice_info

    if not torch.cuda.is_available():
        print("cadenza: error: no CUDA GPU visible to torch (bench gpu needs one)")
        return 2
    voice = Voice(builtin_voice_info())
    backend = TorchBackend(voice, device=device)
    syn = Synthesizer(voice, backend, ChunkSchedule())
    hop, rate = syn.hop, syn.sample_rate
    window = chunk_frames + 2 * syn.voc_halo
    flow_window = chunk_frames + 2 * syn.flow_halo
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "chunk_frames": chunk_frames, "vocoder_window": window, "rows": []}

    def stage_bytes(precision: str, stages: tuple[str, ...]) -> int:
        m = backend.model_for(precision)
        return sum(p.numel() * p.element_size() for s in stages for p in getattr(m, s).parameters())

    weights = {p: {"all": backend.weight_bytes(p), "flow+dec": stage_bytes(p, ("flow", "dec"))}
               for p in ("fp32", "fp16")}
    report["weights"] = weights
    print(f"{report['device']}, torch {torch.__version__}; chunk {chunk_frames} frames "
          f"(vocoder window {window}, flow window {flow_window})")
    print(f"weights: fp32 {weights['fp32']['all'] / 2**20:.1f} MiB, fp16 {weights['fp16']['all'] / 2**20:.1f} MiB "
          f"({weights['fp16']['all'] / weights['fp32']['all']:.0%}); flow+vocoder stages "
          f"{weights['fp32']['flow+dec'] / 2**20:.1f} -> {weights['fp16']['flow+dec'] / 2**20:.1f} MiB "
          f"({weights['fp16']['flow+dec'] / weights['fp32']['flow+dec']:.0%})")
    print(f"{'batch':>5} {'prec':>4} {'voc_ms':>8} {'flow_ms':>8} {'rtfx_voc':>9} {'rtfx_all':>9} "
          f"{'e2e_ms':>8} {'peak_MiB':>9}")
    rows = []
    for batch in batches:
        for precision in ("fp32", "fp16"):
            row = _measure(backend, precision, batch, window, flow_window, iters)
            audio_s = batch * chunk_frames * hop / rate
            row["rtfx_vocoder"] = audio_s / (row["vocoder_ms"] / 1000)
            row["rtfx_flow_vocoder"] = audio_s / ((row["vocoder_ms"] + row["flow_ms"]) / 1000)
            rows.append(row)
            print(f"{batch:5d} {precision:>4} {row['vocoder_ms']:8.2f} {row['flow_ms']:8.2f} "
                  f"{row['rtfx_vocoder']:9.0f} {row['rtfx_flow_vocoder']:9.0f} {row['backend_vocode_ms']:8.2f} "
                  f"{row['peak_activation_mib']:9.1f}")
    report["rows"] = rows
    for batch in batches:
        a = next(r for r in rows if r["batch"] == batch and r["fp16"] == 0)
        b = next(r for r in rows if r["batch"] == batch and r["fp16"] == 1)
        print(f"batch {batch}: fp16 speedup vocoder x{a['vocoder_ms'] / b['vocoder_ms']:.2f}, "
              f"flow+vocoder x{(a['vocoder_ms'] + a['flow_ms']) / (b['vocoder_ms'] + b['flow_ms']):.2f}, "
              f"peak activations {b['peak_activation_mib'] / max(a['peak_activation_mib'], 1e-9):.0%} of fp32")
    ttfa = {}
    for precision in ("fp32", "fp16", "fp32", "fp16"):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            stream = syn.stream(LONG_TEXT, SynthesisParams(seed=1, precision=precision))
            next(iter(stream))
            runs.append((time.perf_counter() - t0) * 1000)
            for _chunk in stream:
                pass
        ttfa[precision] = statistics.median(runs)
    report["ttfa_ms_long_sentence"] = ttfa
    print(f"TTFA, {len(LONG_TEXT)}-char sentence, batch 1: fp32 {ttfa['fp32']:.1f} ms, fp16 {ttfa['fp16']:.1f} ms")
    if out is not None:
        out.write_text(json.dumps(report, indent=1), "utf-8")
        print(f"wrote {out}")
    return 0


def _measure(backend: Any, precision: str, batch: int, window: int, flow_window: int, iters: int) -> dict[str, float]:
    """Median CUDA-event times of the flow and vocoder on one batch shape, the
    backend's whole vocode call (guard + copies on session streams), and the
    peak memory above what was allocated before."""
    import torch

    dtype = torch.float16 if precision == "fp16" else torch.float32
    model = backend.model_for(precision)
    dev = torch.device(backend.device)
    c = model.hp.inter_channels
    z = torch.randn(batch, c, window, device=dev, dtype=dtype)
    zp = torch.randn(batch, c, flow_window, device=dev, dtype=dtype)
    mask = torch.ones(batch, 1, flow_window, device=dev, dtype=dtype)

    def timed(fn: Callable[[], object]) -> float:
        with torch.inference_mode():
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        return float(statistics.median(times))

    with torch.inference_mode():  # warm up (cudnn autotuning allocates big workspaces)
        for _ in range(3):
            model.vocode(z)
            model.flow_reverse(zp, mask)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    voc_ms = timed(lambda: model.vocode(z))
    flow_ms = timed(lambda: model.flow_reverse(zp, mask))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    z_host = z.float().cpu().numpy()
    sessions = list(range(batch))
    backend.vocode(z_host, None, precision, sessions=sessions)
    e2e = []
    for _ in range(max(3, iters // 4)):
        t0 = time.perf_counter()
        backend.vocode(z_host, None, precision, sessions=sessions)
        e2e.append((time.perf_counter() - t0) * 1000)
    torch.cuda.empty_cache()
    return {"batch": batch, "fp16": float(precision == "fp16"), "vocoder_ms": voc_ms, "flow_ms": flow_ms,
            "backend_vocode_ms": float(statistics.median(e2e)), "peak_activation_mib": peak}


__all__ = ["run_gpu_bench"]
