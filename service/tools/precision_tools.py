"""`cadenza compare` (FP16 vs FP32 on a fixed corpus, with a JSON report and a
plot) and `cadenza precision sensitivity` (what each FP32 pin is worth)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.audio.quality import psnr_db
from service.backends.torch_backend import TorchBackend
from service.models.vits.precision import VITS_FP32_PINS, VITS_PIN_CANDIDATES, fp16_only, pinned_modules
from service.synthesis import ChunkSchedule, SynthesisParams, Synthesizer
from service.tools.voice_check import check_sentences
from service.voices import Voice, find_voice

PLOT_HINT = "pip install matplotlib"

# One window per utterance: the whole flow and vocoder in one call each, no chunk halos.
_WHOLE = 1 << 30
WHOLE_UTTERANCE = ChunkSchedule(first_frames=_WHOLE, max_frames=_WHOLE, later_first_frames=_WHOLE)


def _synthesizer(
    voice: str | None, voices_dir: str | None, device: str, threads: int | None = None,
    schedule: ChunkSchedule | None = None, staged: bool | None = None,
) -> Synthesizer:
    loaded = Voice(find_voice(voice, Path(voices_dir) if voices_dir else None))
    return Synthesizer(loaded, TorchBackend(loaded, device=device, threads=threads), schedule, staged=staged)


def run_compare(
    precision: str, voice: str | None, voices_dir: str | None, device: str, out_dir: Path | None,
    limit: int | None, seed: int = 1234,
) -> int:
    """FP16 (as served: chunked, guarded) against FP32 (as served) on the check corpus.
    Writes compare.json, and compare.png where matplotlib is installed, into `out_dir`
    (default: a fresh temporary directory). Last line: min_psnr_db=."""
    syn = _synthesizer(voice, voices_dir, device)
    texts = check_sentences()[:limit] if limit else check_sentences()
    backend = syn.backend
    assert isinstance(backend, TorchBackend)
    print(f"voice {syn.voice.info.name} on {device}: {precision} vs fp32, seed {seed}; FP32 pins: "
          f"{', '.join(pinned_modules(backend.model_for(precision), backend.pins))}")
    rows: list[dict[str, Any]] = []
    worst: tuple[float, str, np.ndarray, np.ndarray] | None = None
    for i, text in enumerate(texts):
        ref, _ = syn.synthesize(text, SynthesisParams(seed=seed, precision="fp32"))
        start = time.perf_counter()
        chunks = list(syn.stream(text, SynthesisParams(seed=seed, precision=precision)))
        elapsed = time.perf_counter() - start
        test = np.concatenate([c.samples for c in chunks])
        value = psnr_db(ref, test)
        fallbacks = sum(c.fallback for c in chunks)
        assert np.isfinite(test).all()
        rows.append({"text": text, "psnr_db": value, "samples": len(test), "fallbacks": fallbacks,
                     "max_abs_diff": float(np.abs(ref - test).max()), "seconds": elapsed})
        if worst is None or value < worst[0]:
            worst = (value, text, ref, test)
        print(f"{i:2d} psnr_db={value:7.2f} fallbacks={fallbacks}  {text}")
    minimum = min(r["psnr_db"] for r in rows)
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="cadenza-compare-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "voice": syn.voice.info.name, "device": device, "precision": precision, "seed": seed,
        "fp32_pins": list(backend.pins),
        "weight_bytes": {p: backend.weight_bytes(p) for p in ("fp32", precision)},
        "sentences": rows, "min_psnr_db": minimum,
        "median_psnr_db": statistics.median(r["psnr_db"] for r in rows),
    }
    (out_dir / "compare.json").write_text(json.dumps(report, indent=1), "utf-8")
    assert worst is not None
    if _plot(out_dir / "compare.png", rows, worst, syn.sample_rate, precision):
        print(f"wrote {out_dir / 'compare.json'} and {out_dir / 'compare.png'}")
    else:
        print(f"wrote {out_dir / 'compare.json'}; no plot: compare.png needs matplotlib ({PLOT_HINT})")
    print(f"min_psnr_db={minimum:.2f}")
    return 0


def _plot(
    path: Path, rows: list[dict[str, Any]], worst: tuple[float, str, np.ndarray, np.ndarray], rate: int,
    precision: str,
) -> bool:
    """Draw compare.png; False (nothing written) where matplotlib is not installed (an optional extra)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    value, text, ref, test = worst
    t = np.arange(len(ref)) / rate
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), constrained_layout=True)
    axes[0].bar(range(len(rows)), [r["psnr_db"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("PSNR (dB)")
    axes[0].set_xlabel("sentence")
    axes[0].set_title(f"{precision} vs fp32 waveform PSNR per sentence")
    axes[1].plot(t, ref, lw=0.5, label="fp32")
    axes[1].plot(t, test[: len(ref)], lw=0.5, alpha=0.7, label=precision)
    axes[1].set_title(f"worst sentence ({value:.1f} dB): {text[:70]}")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, test[: len(ref)] - ref, lw=0.5, color="tab:red")
    axes[2].set_title(f"difference ({precision} - fp32)")
    axes[2].set_xlabel("seconds")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_sensitivity(
    voice: str | None, voices_dir: str | None, device: str, limit: int, seed: int = 1234,
    threads: int | None = None,
) -> int:
    """Each candidate alone in FP16 (all else FP32): the PSNR it costs.

    Reference and candidates decode each utterance whole through the model's own modules
    (`flow_reverse`, `vocode`), where the candidate's FP16 casts take effect. Not the staged
    decoder: it calls flow couplings and generator stages one by one, past the casts on an
    enclosing module (a module in FP16 would get FP32 inputs)."""
    syn = _synthesizer(voice, voices_dir, device, threads, schedule=WHOLE_UTTERANCE, staged=False)
    backend = syn.backend
    assert isinstance(backend, TorchBackend)
    fp32_model = backend.models["fp32"]
    texts = check_sentences()[:limit]
    if not texts:
        raise ValueError(f"--limit {limit}: use at least one sentence")
    refs = [syn.synthesize(t, SynthesisParams(seed=seed))[0] for t in texts]
    print(f"candidate FP32 pins, each run alone in FP16 ({len(texts)} sentence(s), {syn.voice.info.name} on "
          f"{device}); current pins: {', '.join(VITS_FP32_PINS)}", flush=True)
    print(f"{'module':32s} {'min_db':>8s} {'median_db':>9s} {'len_changes':>11s}")
    try:
        for candidate in VITS_PIN_CANDIDATES:
            backend.models["fp32"] = fp16_only(fp32_model, candidate)
            values, length_changes = [], 0
            for text, ref in zip(texts, refs, strict=True):
                test, _ = syn.synthesize(text, SynthesisParams(seed=seed))
                values.append(psnr_db(ref, test))
                length_changes += len(test) != len(ref)
            print(f"{candidate:32s} {min(values):8.2f} {statistics.median(values):9.2f} {length_changes:11d}",
                  flush=True)
    finally:
        backend.models["fp32"] = fp32_model
    return 0
