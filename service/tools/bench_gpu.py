"""`cadenza bench gpu`: FP16 (with FP32 pins) against FP32 on a CUDA GPU, side by side in one
run, on the decoder the server runs: the time of one batched slot-decoder step (a CUDA graph)
by rows, the audio it makes per second, weight and step memory, and the time to first audio of
a long sentence through the engine."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

LONG_TEXT = (
    "Before we get started, I need to let you know that this call may be recorded for quality "
    "assurance and training purposes, and that you can ask for a copy of the recording at any time."
)


def run_gpu_bench(device: str, batches: list[int], chunk_frames: int, out: Path | None) -> int:
    import torch

    from service.audio.encoding import AudioEncoding
    from service.engine.config import EngineConfig
    from service.engine.contract import AudioOut, Precision, SessionConfig
    from service.engine.frontend_pool import FrontendPoolConfig
    from service.engine.local import LocalEngine
    from service.models.registry import open_voice
    from service.voices import builtin_voice_info

    if not torch.cuda.is_available():
        print("cadenza: error: no CUDA GPU visible to torch (bench gpu needs one)")
        return 2
    runtime = open_voice(builtin_voice_info(), "torch", device)
    hop, rate = runtime.hop, runtime.sample_rate
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "step_frames": chunk_frames, "rows": []}
    print(f"{report['device']}, torch {torch.__version__}; decoder steps of {chunk_frames} frames "
          f"({chunk_frames * hop / rate * 1000:.0f} ms of audio per row), best of three graph replays")
    print(f"{'rows':>5} {'prec':>4} {'step_ms':>8} {'rtfx':>9} {'mem_MiB':>8}")
    rows = []
    for precision in ("fp32", "fp16"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        decoder = runtime.streaming_decoder(precision, max(batches), max_rows=max(batches), graphs=True,
                                            graph_frames=(chunk_frames,))
        decoder.capture_all()  # captures and times every step shape (best of three replays)
        memory = (torch.cuda.max_memory_allocated() - base) / 2**20
        for batch in batches:
            seconds = min(s for (r, n), s in decoder.step_seconds.items() if r >= batch and n == chunk_frames)
            audio_s = batch * chunk_frames * hop / rate
            row = {"rows": batch, "precision": precision, "step_ms": seconds * 1000, "rtfx": audio_s / seconds,
                   "memory_mib": memory}
            rows.append(row)
            print(f"{batch:5d} {precision:>4} {row['step_ms']:8.2f} {row['rtfx']:9.0f} {memory:8.1f}")
        del decoder
        torch.cuda.empty_cache()
    report["rows"] = rows
    for batch in batches:
        a = next(r for r in rows if r["rows"] == batch and r["precision"] == "fp32")
        b = next(r for r in rows if r["rows"] == batch and r["precision"] == "fp16")
        print(f"{batch} rows: fp16 step x{float(a['step_ms']) / float(b['step_ms']):.2f} faster than fp32")
    config = EngineConfig(backend="torch", device=device, core="thread", cache_bytes=0,
                          frontend=FrontendPoolConfig(workers=0))
    ttfa: dict[str, list[float]] = {"fp32": [], "fp16": []}
    with LocalEngine(config) as local:
        for precision in ("fp32", "fp16") * 5:
            session = SessionConfig(seed=1, precision=Precision(precision), encoding=AudioEncoding.FLOAT32)
            t0 = time.perf_counter()
            first = None
            for event in local.stream(LONG_TEXT, session):
                if first is None and isinstance(event, AudioOut) and event.num_samples:
                    first = (time.perf_counter() - t0) * 1000
            ttfa[precision].append(first or float("nan"))
    medians = {p: statistics.median(v) for p, v in ttfa.items()}
    report["ttfa_ms_long_sentence"] = medians
    print(f"TTFA through the engine, {len(LONG_TEXT)}-char text, one session: fp32 {medians['fp32']:.1f} ms, "
          f"fp16 {medians['fp16']:.1f} ms (median of 5)")
    if out is not None:
        out.write_text(json.dumps(report, indent=1), "utf-8")
        print(f"wrote {out}")
    return 0


__all__ = ["run_gpu_bench"]
