"""`cadenza compare` (FP16 vs FP32 on a fixed corpus, with a JSON report and a plot) and
`cadenza precision sensitivity` (what each FP32 pin is worth).

Both measure the served path: each sentence is one session of the engine the server runs
(segmenter, acoustic batch, slot decoder steps, guard and FP32 redo), on the torch backend;
only the precision and the FP32 pins differ between runs."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.audio.encoding import AudioEncoding
from service.audio.quality import psnr_db
from service.engine.config import BatchConfig, EngineConfig
from service.engine.contract import AudioOut, Precision, SessionConfig, SessionSummary
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.tools.voice_check import check_sentences

PLOT_HINT = "pip install matplotlib"
SERVED = "served path: engine sessions, slot decoder steps, guard and FP32 redo"


@dataclass
class Spoken:
    audio: np.ndarray
    fallbacks: int
    seconds: float


class ServedVoice:
    """One voice in an engine configured as a server would be (torch backend, slot decoder),
    with the given FP32 pins (None: the family's)."""

    def __init__(self, voice: str | None, voices_dir: str | None, device: str, threads: int | None = None,
                 pins: Sequence[str] | None = None) -> None:
        config = EngineConfig(
            voice=voice, voices_dir=Path(voices_dir) if voices_dir else None, backend="torch", device=device,
            threads=threads, core="thread", cache_bytes=0, frontend=FrontendPoolConfig(workers=0),
            # one session at a time: a few slots and rows (fewer step graphs to capture per engine)
            batch=BatchConfig(decoder="slots", slots=16, max_step_rows=4),
            warmup_text="Warm up.",  # an engine per pin set: each only needs its step shapes prepared
            fp32_pins=None if pins is None else tuple(pins),
        )
        self.local = LocalEngine(config)
        info = self.local.engine.server_info()
        self.voice = info.default_voice
        self.pins = tuple(info.fp32_pins)

    def speak(self, text: str, precision: str, seed: int) -> Spoken:
        session = SessionConfig(voice=self.voice, seed=seed, precision=Precision(precision),
                                encoding=AudioEncoding.FLOAT32)
        pieces, fallbacks, start = [], 0, time.perf_counter()
        for event in self.local.stream(text, session):
            if isinstance(event, AudioOut):
                pieces.append(np.frombuffer(event.audio, dtype="<f4"))
            elif isinstance(event, SessionSummary):
                fallbacks = event.fallbacks
        audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return Spoken(audio, fallbacks, time.perf_counter() - start)

    def close(self) -> None:
        self.local.close()


def corpus_sentences(corpus: Path | None) -> list[str]:
    """The check corpus, or a file of one sentence a line (blank lines skipped)."""
    if corpus is None:
        return check_sentences()
    try:
        lines = corpus.read_text("utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--corpus {corpus}: {exc.strerror or exc}") from None
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"--corpus {corpus} has no sentences (one a line)")
    return texts


def run_compare(
    precision: str, voice: str | None, voices_dir: str | None, device: str, out_dir: Path | None,
    limit: int | None, seed: int = 1234, corpus: Path | None = None, pins: Sequence[str] | None = None,
) -> int:
    """FP16 against FP32, both as served, on the check corpus (or `corpus`: one sentence a line).
    Writes compare.json, and compare.png where matplotlib is installed, into `out_dir` (default: a
    fresh temporary directory). Last line: min_psnr_db=."""
    texts = corpus_sentences(corpus)[:limit]
    served = ServedVoice(voice, voices_dir, device, pins=pins)
    try:
        print(f"voice {served.voice} on {device}: {precision} vs fp32, seed {seed} ({SERVED}); FP32 pins: "
              f"{', '.join(served.pins) or 'none'}")
        rows: list[dict[str, Any]] = []
        worst: tuple[float, str, np.ndarray, np.ndarray] | None = None
        for i, text in enumerate(texts):
            ref = served.speak(text, "fp32", seed).audio
            test = served.speak(text, precision, seed)
            value = psnr_db(ref, test.audio)
            assert np.isfinite(test.audio).all()
            rows.append({"text": text, "psnr_db": value, "samples": len(test.audio), "fallbacks": test.fallbacks,
                         "max_abs_diff": float(np.abs(ref - test.audio[: len(ref)]).max()) if len(ref) else 0.0,
                         "seconds": test.seconds})
            if worst is None or value < worst[0]:
                worst = (value, text, ref, test.audio)
            print(f"{i:2d} psnr_db={value:7.2f} fallbacks={test.fallbacks}  {text}")
        rate = served.local.sample_rate
    finally:
        served.close()
    minimum = min(r["psnr_db"] for r in rows)
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="cadenza-compare-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "voice": served.voice, "device": device, "precision": precision, "seed": seed, "path": SERVED,
        "fp32_pins": list(served.pins), "sentences": rows, "min_psnr_db": minimum,
        "median_psnr_db": statistics.median(r["psnr_db"] for r in rows),
    }
    (out_dir / "compare.json").write_text(json.dumps(report, indent=1), "utf-8")
    assert worst is not None
    if _plot(out_dir / "compare.png", rows, worst, rate, precision):
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
    threads: int | None = None, corpus: Path | None = None,
) -> int:
    """What each FP32 pin is worth on the served path: FP16 sessions with the family's pins, with
    each pin taken out, and with each other candidate added, against FP32 sessions of the same
    sentences and seed (waveform PSNR, guard redos, length changes)."""
    texts = corpus_sentences(corpus)[:limit]
    if not texts:
        raise ValueError(f"--limit {limit}: use at least one sentence")
    served = ServedVoice(voice, voices_dir, device, threads)
    try:
        pins, candidates = served.pins, served.local.engine.pin_candidates()
        refs = [served.speak(t, "fp32", seed).audio for t in texts]
        baseline = _score(served, texts, refs, seed)
    finally:
        served.close()
    print(f"FP32 pins on the {SERVED}; {len(texts)} sentence(s), voice {served.voice} on {device}; "
          f"the family's pins: {', '.join(pins) or 'none'}", flush=True)
    trials = [(f"without {p}", tuple(q for q in pins if q != p)) for p in pins]
    trials += [(f"with {c} added", (*pins, c)) for c in candidates if c not in pins]
    trials.append(("no pins", ()))
    width = max(40, *(len(label) for label, _ in trials))
    print(f"{'FP16 run':{width}s} {'min_db':>8s} {'median_db':>9s} {'redos':>5s} {'len_changes':>11s}")
    _print_row("with the family's pins", baseline, width)
    for label, trial in trials:
        one = ServedVoice(voice, voices_dir, device, threads, pins=trial)
        try:
            _print_row(label, _score(one, texts, refs, seed), width)
        finally:
            one.close()
    return 0


def _score(served: ServedVoice, texts: list[str], refs: list[np.ndarray], seed: int) -> tuple[list[float], int, int]:
    values, redos, length_changes = [], 0, 0
    for text, ref in zip(texts, refs, strict=True):
        test = served.speak(text, "fp16", seed)
        values.append(psnr_db(ref, test.audio))
        redos += test.fallbacks
        length_changes += len(test.audio) != len(ref)
    return values, redos, length_changes


def _print_row(label: str, score: tuple[list[float], int, int], width: int) -> None:
    values, redos, length_changes = score
    print(f"{label:{width}s} {min(values):8.2f} {statistics.median(values):9.2f} {redos:5d} {length_changes:11d}",
          flush=True)
