"""`cadenza bench cpu`: Cadenza and a peer engine side by side in one process run,
same voice, same texts, same thread count, rotating order so drift in the
machine's speed hits all equally. Reports per-text TTFA and RTF and ratios, and TTFA
summarised over all texts and over the long ones (LONG_TEXT_CHARS+).

The peer is the one for the voice's family (`PEERS`, by `VoiceInfo.family`): piper-tts for a
Piper voice, kokoro-onnx for a Kokoro voice (`service.tools.bench_cpu_kokoro`). Our side is
always the engine the server runs (`LocalEngine`), timed the same way whatever the family.

The default corpus is packaged (service/data/corpus_cpu.txt), so the bench runs from any
directory.

Every timed run starts after a short idle pause: ONNX Runtime's worker threads
keep spinning for a while after a run (piper-tts's session does, by default), and
whichever run came next would pay for it (measured: +7 ms on a 10 ms encoder call)."""

from __future__ import annotations

import importlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.audio.encoding import AudioEncoding
from service.engine.config import EngineConfig
from service.engine.contract import AudioOut, SessionConfig
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import VoiceInfo
from service.tools.bench_load import worst_underrun
from service.voices import find_voice

LONG_TEXT_CHARS = 150
# The peer engine of each family: "module:class", built as cls(info, threads) (see `Peer`).
PEERS: dict[str, str] = {
    "vits": "service.tools.bench_cpu:PiperPeer",
    "kokoro": "service.tools.bench_cpu_kokoro:KokoroOnnxPeer",
}
CORPUS_RESOURCE = "data/corpus_cpu.txt"  # in the service package
LEGACY_CORPUS_PATH = Path("bench/corpus_cpu.txt")
"""Where the corpus lived before it was packaged: the CLI's default; it names the packaged one."""


@dataclass
class Run:
    ttfa: float  # seconds to the first audio chunk
    total: float  # seconds to the last chunk
    audio_seconds: float
    gap: float  # seconds of silence a player that starts at the first chunk waits for late ones

    @property
    def rtf(self) -> float:
        return self.total / max(self.audio_seconds, 1e-9)


class Playback:
    """A run's clock: when each chunk of audio arrived and how long it plays. First audio is
    only half of streaming; the other half is that no later chunk arrives after the audio
    before it has played."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []
        self.durations: list[float] = []

    def chunk(self, seconds: float) -> None:
        self.arrivals.append(time.perf_counter() - self.start)
        self.durations.append(seconds)

    def run(self) -> Run:
        total = time.perf_counter() - self.start
        return Run(self.arrivals[0] if self.arrivals else total, total, sum(self.durations),
                   worst_underrun(self.arrivals, self.durations))


def load_corpus(path: Path | None = None) -> list[str]:
    """Texts of a corpus file (one per line, ``#`` comments); None (or the old default path
    ``bench/corpus_cpu.txt``, when no such file exists) is the packaged corpus."""
    if path is None or (Path(path) == LEGACY_CORPUS_PATH and not Path(path).is_file()):
        text = resources.files("service").joinpath(CORPUS_RESOURCE).read_text("utf-8")
    else:
        text = Path(path).read_text("utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def time_cadenza(local: LocalEngine, text: str, seed: int) -> Run:
    """One text through the engine the server runs (segmenter, scheduler, decoder, output)."""
    clock = Playback()
    for event in local.stream(text, SessionConfig(seed=seed, encoding=AudioEncoding.FLOAT32)):
        if isinstance(event, AudioOut) and event.num_samples:
            clock.chunk(event.num_samples / event.sample_rate)
    return clock.run()


class Peer(Protocol):
    """The engine ours is timed against, on the same voice and threads."""

    label: str  # the report's name for it, e.g. "piper-tts"

    def run(self, text: str) -> Run:
        """One text, timed from the text to its first and its last audio."""
        ...

    def notes(self) -> list[str]:
        """Lines for the end of the report (what its times hold), or none."""
        ...


def open_peer(info: VoiceInfo, threads: int) -> Peer:
    """The peer of `info`'s family (`PEERS`)."""
    if info.family not in PEERS:
        raise ValueError(f"bench cpu has no peer engine for {info.family} voices; it has for {', '.join(PEERS)}")
    module, _, name = PEERS[info.family].partition(":")
    peer: Peer = getattr(importlib.import_module(module), name)(info, threads)
    return peer


def load_piper(threads: int, info: VoiceInfo | None = None) -> Any:
    """piper-tts's own voice object for `info` (None: the built-in voice), with the same
    thread count as ours."""
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    from service.models.vits.voice import builtin_voice_info

    info = info or builtin_voice_info()
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    config = json.loads(Path(info.config_path).read_text("utf-8"))
    session = onnxruntime.InferenceSession(
        str(info.model_path), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    return PiperVoice(session=session, config=PiperConfig.from_dict(config))


def time_piper(voice: Any, text: str) -> Run:
    clock = Playback()
    for chunk in voice.synthesize(text):
        clock.chunk(len(chunk.audio_float_array) / chunk.sample_rate)
    return clock.run()


class PiperPeer:
    """piper-tts on the voice's own files: it streams a chunk per sentence (TTFA: its first)."""

    label = "piper"

    def __init__(self, info: VoiceInfo, threads: int) -> None:
        self.voice = load_piper(threads, info)

    def run(self, text: str) -> Run:
        return time_piper(self.voice, text)

    def notes(self) -> list[str]:
        return []


def run_cpu_bench(
    corpus: Path | None, threads: int, repeats: int, backend: str, settle_s: float = 0.1, stat: str = "median",
    voice: str | None = None, voices_dir: Path | None = None, int8: bool = False,
) -> int:
    """`corpus`: a corpus file, None for the packaged one (see load_corpus).
    `stat`: how a text's repeats are summarised, "median" or "min" (the fastest run: least
    disturbed by other load on a noisy machine).
    `voice`/`voices_dir`: as `cadenza say` takes them (None: the built-in Piper voice); the
    peer is the voice family's (`PEERS`). `backend` "auto" is the family's CPU choice; `int8`: as
    `cadenza serve --int8`, Cadenza's sessions in INT8."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', not {stat!r}")

    def pick(values: list[float]) -> float:
        return statistics.median(values) if stat == "median" else min(values)

    import torch

    torch.set_num_threads(threads)
    # Like piper, phonemise in this process (a frontend pool pays off for many sessions, not one).
    info = find_voice(voice, voices_dir)
    texts = load_corpus(corpus)
    local = LocalEngine(EngineConfig(voice=voice and info.name, voices_dir=voices_dir, backend=backend,
                                     device="cpu", threads=threads, cache_bytes=0, int8=int8,
                                     frontend=FrontendPoolConfig(workers=0)))
    try:
        peer = open_peer(info, threads)
        runners: dict[str, Callable[[str, int], Run]] = {
            "cadenza": lambda text, seed: time_cadenza(local, text, seed),
            peer.label: lambda text, seed: peer.run(text),
        }
        return _bench(runners, texts, repeats, settle_s, pick, stat,
                      f"{info.name}: {local.engine.backend_name}, {local.engine.config.batch.decoder} decoder"
                      + (", int8" if int8 else ""),
                      peer.notes)
    finally:
        local.close()


def _bench(runners: dict[str, Callable[[str, int], Run]], texts: list[str], repeats: int, settle_s: float,
           pick: Callable[[list[float]], float], stat: str, label: str,
           notes: Callable[[], list[str]] = list) -> int:
    """`runners`: "cadenza" first, then the peer under its label."""
    for text in texts[:2]:  # warm up (allocators, caches)
        for run in runners.values():
            run(text, 0)
    names = list(runners)
    other = names[1]
    print(f"cadenza ({label}) vs {'piper-tts' if other == 'piper' else other}, {repeats} runs per text ({stat}), "
          f"rotating order, {settle_s * 1000:.0f} ms idle before each run")
    print(f"{'chars':>5} {'ttfa_c':>8} {'ttfa_p':>8} {'ratio':>6} {'rtf_c':>6} {'rtf_p':>6} {'ratio':>6} "
          f"{'gap_c':>7} {'gap_p':>7}  text")
    ttfa_long, ttfa_all, rtf_all, total_all = [], [], [], []
    ttfa_ms: list[tuple[float, float]] = []  # per text: cadenza, peer
    gaps_ms: list[tuple[float, float]] = []  # per text, the worst of its runs: cadenza, peer
    audio_s = [0.0, 0.0]  # cadenza, peer: audio of one run per text, summed
    for i, text in enumerate(texts):
        runs: dict[str, list[Run]] = {name: [] for name in names}
        for rep in range(repeats):
            k = (i + rep) % len(names)
            for name in names[k:] + names[:k]:
                time.sleep(settle_s)
                runs[name].append(runners[name](text, rep))
        tc = pick([r.ttfa for r in runs["cadenza"]])
        tp = pick([r.ttfa for r in runs[other]])
        rc = pick([r.rtf for r in runs["cadenza"]])
        rp = pick([r.rtf for r in runs[other]])
        total_all.append(pick([r.total for r in runs["cadenza"]]) / pick([r.total for r in runs[other]]))
        audio_s[0] += runs["cadenza"][0].audio_seconds
        audio_s[1] += runs[other][0].audio_seconds
        ttfa_all.append(tc / tp)
        ttfa_ms.append((tc * 1000, tp * 1000))
        rtf_all.append(rc / rp)
        gc, gp = (1000 * max(r.gap for r in runs[name]) for name in ("cadenza", other))
        gaps_ms.append((gc, gp))
        if len(text) >= LONG_TEXT_CHARS:
            ttfa_long.append(tc / tp)
        print(f"{len(text):5d} {tc * 1000:7.1f}ms {tp * 1000:7.1f}ms {tc / tp:6.3f} "
              f"{rc:6.3f} {rp:6.3f} {rc / rp:6.3f} {gc:5.1f}ms {gp:5.1f}ms  {text[:48]}")
    all_ratio = statistics.median(ttfa_all)
    print(f"median ttfa ratio, all texts: {all_ratio:.3f}; "
          f"texts of {LONG_TEXT_CHARS}+ chars: {statistics.median(ttfa_long) if ttfa_long else float('nan'):.3f}")
    worst = max(range(len(texts)), key=lambda k: ttfa_all[k])
    print(f"ttfa, all {len(texts)} texts: cadenza median {statistics.median(t[0] for t in ttfa_ms):.1f} ms "
          f"(max {max(t[0] for t in ttfa_ms):.1f}), {other} median {statistics.median(t[1] for t in ttfa_ms):.1f} ms "
          f"(max {max(t[1] for t in ttfa_ms):.1f}); highest ratio {ttfa_all[worst]:.3f} "
          f"({len(texts[worst])} chars: {texts[worst][:40]})")
    total_ratio = statistics.median(total_all)
    print(f"total time, median ratio over all texts: {total_ratio:.3f}; audio made (one run per text): "
          f"cadenza {audio_s[0]:.2f} s, {other} {audio_s[1]:.2f} s")
    print(f"worst gap (silence a player waits for a late chunk), all runs: "
          f"cadenza {max(g[0] for g in gaps_ms):.1f} ms, {other} {max(g[1] for g in gaps_ms):.1f} ms")
    for line in notes():
        print(line)
    long_ratio = statistics.median(ttfa_long) if ttfa_long else float(np.nan)
    # Parsed by scripts and tests: the long-text ratio first, as before, then the overall ones.
    print(f"ttfa_ratio={long_ratio:.3f} rtf_ratio={statistics.median(rtf_all):.3f} ttfa_ratio_all={all_ratio:.3f} "
          f"total_ratio={total_ratio:.3f}")
    return 0
