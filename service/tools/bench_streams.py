"""`cadenza bench streams`: N concurrent sessions through one in-process engine
(the same engine the gRPC server runs). Each session sends a sentence; the
playback of its audio is simulated from the first chunk's arrival. Reports TTFA
P50/P99 and the share of streams whose worst underrun is at most 100 ms.

`--profile DIR`: the core records each round (a busy period) with `torch.profiler`, see
service/telemetry/ranges.py; a profiled round's figures include the profiler's overhead."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.engine.config import BatchConfig
from service.engine.contract import AudioOut, Precision, SessionConfig, SessionSummary

if TYPE_CHECKING:
    from service.engine.engine import TtsEngine

UNDERRUN_LIMIT_S = 0.100
TEXTS = (
    "Thank you for calling, your appointment is confirmed for Tuesday at three thirty in the afternoon.",
    "Please hold while I transfer your call to the next available agent, it should not take long.",
    "Your order has shipped and will arrive on Friday; you can track it from the link in your email.",
    "I can help with billing, technical support, or a new account, which one would you like today?",
)


@dataclass
class StreamResult:
    ttfa: float
    worst_underrun: float
    audio_seconds: float


async def _one(engine: TtsEngine, index: int, precision: Precision, start: asyncio.Event) -> StreamResult:
    await start.wait()
    t0 = time.perf_counter()
    session = await engine.open_session(SessionConfig(seed=index, precision=precision))
    session.push_text(TEXTS[index % len(TEXTS)])
    session.end_input()
    first = None
    played = 0.0  # seconds of audio received before this chunk
    worst = 0.0
    async for event in session.events():
        now = time.perf_counter()
        if isinstance(event, AudioOut) and event.num_samples:
            if first is None:
                first = now
            else:
                worst = max(worst, now - (first + played))
            played += event.num_samples / event.sample_rate
        elif isinstance(event, SessionSummary):
            break
    assert first is not None
    return StreamResult(first - t0, worst, played)


async def _round(engine: TtsEngine, n: int, precision: Precision) -> list[StreamResult]:
    start = asyncio.Event()
    tasks = [asyncio.create_task(_one(engine, i, precision, start)) for i in range(n)]
    start.set()
    return list(await asyncio.gather(*tasks))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _main(
    device: str, backend: str, counts: list[int], precisions: list[Precision], batch: BatchConfig,
    schedule: dict[str, float], profile_dir: Path | None = None,
) -> int:
    import dataclasses

    from service.engine.config import EngineConfig, Limits
    from service.engine.engine import TtsEngine

    config = EngineConfig(
        device=device, backend=backend, cache_bytes=0, batch=batch, limits=Limits(max_sessions=max(counts) + 8),
    )
    if profile_dir is not None:
        config = dataclasses.replace(config, profile_dir=profile_dir)
    if schedule:
        config = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, **schedule))  # type: ignore[arg-type]
    engine = TtsEngine(config)
    await engine.start()
    print(f"engine: {engine.backend_name} on {engine.device}, {batch}, {config.schedule}")
    print(f"{'streams':>7} {'prec':>5} {'ttfa_p50':>9} {'ttfa_p99':>9} {'underrun_max':>12} {'ok<=100ms':>9} "
          f"{'wall_s':>7}")
    try:
        await _round(engine, 2, precisions[0])  # warm-up
        for n in counts:
            for precision in precisions:
                t0 = time.perf_counter()
                results = await _round(engine, n, precision)
                wall = time.perf_counter() - t0
                ttfa = [r.ttfa for r in results]
                ok = sum(r.worst_underrun <= UNDERRUN_LIMIT_S for r in results)
                p50, p99 = statistics.median(ttfa) * 1000, _pct(ttfa, 0.99) * 1000
                worst = max(r.worst_underrun for r in results) * 1000
                print(f"{n:7d} {precision.value:>5} {p50:8.1f}ms {p99:8.1f}ms {worst:11.1f}ms {ok:5d}/{n:<3d} "
                      f"{wall:7.2f}")
        stats = engine.stats()
        print(f"steps {stats['steps']:.0f}, rows {stats['step_rows']:.0f}, largest step {stats['max_step_rows']:.0f}, "
              f"step time {stats['step_seconds']:.2f} s for {stats['step_audio_seconds']:.1f} s of audio, "
              f"acoustic {stats['acoustic_jobs']:.0f} jobs in {stats['acoustic_batches']:.0f} calls, "
              f"fp32 fallbacks {stats['fp32_fallbacks']:.0f}")
    finally:
        await engine.stop()
    return 0


def run_streams_bench(
    device: str, backend: str, counts: list[int], precisions: list[str], batch: BatchConfig | None = None,
    schedule: dict[str, float] | None = None, profile_dir: Path | None = None,
) -> int:
    """`schedule`: ChunkSchedule fields to override; `profile_dir`: see the module docstring."""
    return asyncio.run(
        _main(device, backend, counts, [Precision(p.lower()) for p in precisions], batch or BatchConfig(),
              schedule or {}, profile_dir)
    )
