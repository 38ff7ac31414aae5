"""Where the synthesis core runs. `LocalHost` runs it on a thread of this process;
`service.engine.proc.ProcessHost` runs the same core in a process of its own, so its Python
does not share a GIL with the server's event loop (as vLLM's V1 engine core does). `TtsEngine`
talks to either through the same small surface: start, load a voice, the `submit_*` messages,
and a snapshot of the core's figures."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from service.engine.cache import ResultCache
from service.engine.config import EngineConfig
from service.engine.core import EngineCore
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.precision import Hardware
from service.engine.shadow import ShadowVerifier
from service.engine.state import EngineStats, ReadCursor, SessionRequest, Sink, WorkSpec
from service.models.family import VoiceInfo, VoiceRuntime
from service.models.registry import open_voice
from service.telemetry import Telemetry
from service.telemetry.telemetry import PRECISIONS
from service.telemetry.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedVoice:
    """What the server needs to know about a loaded voice (its backend stays with the core)."""

    name: str
    precisions: tuple[str, ...]  # what its backend runs
    # The device it runs on and the backend, as the core sees them ("auto" resolved): the
    # server's process never imports torch to know them.
    hardware: Hardware
    backend: str
    fp32_pins: tuple[str, ...] = ()
    pin_candidates: tuple[str, ...] = ()


@dataclass
class CoreSnapshot:
    """The core's figures, as the server reads them (metrics, admission, GetServerInfo)."""

    stats: EngineStats = field(default_factory=EngineStats)
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes: int = 0
    first_audio_wait_s: float = 0.0  # the longest any session has waited for its first audio
    busy_share: float = 0.0  # of its recent time the engine thread worked (see EngineCore.busy_share)
    active_work: int = 0  # sessions the core still holds state for
    # Sessions the core has open for each API server process (serve --api-servers): admission
    # counts the others' from here, its own exactly.
    open_sessions: tuple[int, ...] = ()
    capacity: dict[str, float] = field(default_factory=dict)  # precision ("" = any) -> real-time streams
    shadow_verified: int = 0
    shadow_min_psnr_db: float = math.inf
    gpu_memory: dict[str, int] = field(default_factory=dict)  # device -> bytes reserved
    frozen_objects: int = 0  # objects the core's process took out of the collector's scans (settle_heap)


class Host(Protocol):
    """What `TtsEngine` and the sessions need from wherever the core runs."""

    dead: threading.Event  # the core died: nothing more will be synthesised

    def start(self, frontend: FrontendPoolConfig, preload: list[VoiceInfo]) -> dict[str, LoadedVoice]: ...

    def load(self, info: VoiceInfo) -> LoadedVoice: ...

    def submit_open(self, request: SessionRequest, voice: VoiceInfo, sink: Sink, loop: asyncio.AbstractEventLoop,
                    cursor: ReadCursor) -> None: ...

    def submit_text(self, session_id: int, text: str) -> None: ...

    def submit_end(self, session_id: int) -> None: ...

    def submit_cancel(self, session_id: int) -> None: ...

    def taken(self, session_id: int, read_s: float, wake: bool) -> None: ...

    def snapshot(self) -> CoreSnapshot: ...

    def reset_rate(self) -> None: ...

    def settle(self) -> None:
        """The server is warm: take what it has built so far out of the garbage collector's
        scans, on the core's side and the server's (`settle_heap`); returns once both are done."""

    def stop(self) -> None: ...


def resolve_device(device: str) -> str:
    """The device with "auto" decided: CUDA when torch sees a GPU, else the CPU (imports torch
    only for an "auto" device). An "auto" backend is each voice's family's choice for it."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Runtimes:
    """Loads each voice once (weights, backend, exports) on the side that runs the core."""

    def __init__(self, config: EngineConfig, device: str, backend_name: str) -> None:
        self.config = config
        self.device = device
        self.backend_name = backend_name
        self.loaded: dict[str, VoiceRuntime] = {}
        self._lock = threading.Lock()

    def get(self, info: VoiceInfo) -> VoiceRuntime:
        with self._lock:
            runtime = self.loaded.get(info.name)
            if runtime is None:
                options: dict[str, object] = {"threads": self.config.threads} if self.config.threads else {}
                options["compile_acoustic"] = self.config.batch.compile_acoustic
                options["compile_decoder"] = self.config.batch.compile_decoder
                if self.config.cache_dir is not None:
                    options["cache_dir"] = self.config.cache_dir
                if self.config.fp32_pins is not None:
                    options["pins"] = self.config.fp32_pins
                if self.config.int8:
                    options["int8"] = True
                runtime = open_voice(info, self.backend_name, self.device, self.config.schedule, **options)
                self.loaded[info.name] = runtime
                log.info("loaded voice %s (%s) on %s/%s", info.name, info.family, runtime.backend_name, self.device)
                if self.config.int8 and "int8" not in runtime.precisions():
                    log.warning("--int8 does not apply to voice %s (%s on %s/%s: INT8 is for Piper voices on the "
                                "onnxruntime backend); its sessions run %s", info.name, info.family,
                                runtime.backend_name, self.device, ", ".join(runtime.precisions()))
                if _Heap.frozen:  # loaded after the warm server settled: keep its weights out of the scans too
                    settle_heap()
            return runtime

    def prepare(self, info: VoiceInfo) -> LoadedVoice:
        """Load a voice and capture its encoder graphs where the backend has them (before the
        core's thread runs: graph captures need the GPU alone)."""
        runtime = self.get(info)
        start = time.perf_counter()
        runtime.prepare(self.config.batch.acoustic_max_batch)
        log.info("prepared voice %s in %.1f s", info.name, time.perf_counter() - start)
        return self.describe(info)

    def describe(self, info: VoiceInfo) -> LoadedVoice:
        runtime = self.get(info)
        return LoadedVoice(info.name, runtime.precisions(), Hardware.detect(self.device), runtime.backend_name,
                           runtime.fp32_pins, runtime.pin_candidates)


class _Heap:
    """What `settle_heap` froze in this process (the collector is per process, and so is this)."""

    frozen = 0


def settle_heap() -> None:
    """Collect once, then freeze every object left (`gc.freeze`): a full collection scans every
    object the process holds (the models, CUDA graphs, gRPC's modules: tens of milliseconds) and
    holds the GIL while it does, so it stops every thread. A burst of sessions allocates enough to
    set one off. Frozen objects are never scanned again; only what is made afterwards is.

    The frozen count is taken here, once (`_Heap.frozen`): `gc.get_freeze_count` walks the whole
    frozen list holding the GIL (milliseconds), so the figures thread must not call it."""
    gc.collect()
    gc.freeze()
    _Heap.frozen = gc.get_freeze_count()


def build_core(config: EngineConfig, telemetry: Telemetry, on_trip: Callable[[str], None]) -> EngineCore:
    """The core with its cache and (if asked) its shadow verifier, wherever it runs."""
    shadow = ShadowVerifier(config.shadow_fraction, on_psnr=telemetry.shadow_psnr) \
        if config.shadow_fraction > 0 else None
    return EngineCore(config.batch, ResultCache(config.cache_bytes), on_trip=on_trip, shadow=shadow,
                      frontend=config.frontend, telemetry=telemetry, profile_dir=config.profile_dir,
                      timeline=Timeline(config.timeline_dir, "core"))


class _GpuMemory:
    """Bytes the device's caching allocator holds, read at most every `EVERY_S`. Torch builds its
    memory statistics as a large dict while holding the GIL, and snapshots are taken every few
    tens of milliseconds, while the engine thread needs the GIL back after each native call."""

    EVERY_S = 1.0

    def __init__(self) -> None:
        self._read: dict[str, tuple[float, dict[str, int]]] = {}

    def read(self, device: str) -> dict[str, int]:
        now = time.monotonic()
        at, value = self._read.get(device, (-math.inf, {}))
        if now - at >= self.EVERY_S:
            import torch

            dev = torch.device(device)
            value = {str(dev): int(torch.cuda.memory_reserved(dev))}
            self._read[device] = (now, value)
        return value


_GPU_MEMORY = _GpuMemory()


def snapshot(core: EngineCore, device: str) -> CoreSnapshot:
    """The core's figures now (read from another thread: plain numbers, no lock needed)."""
    cache, executor = core.output.cache, core.executor
    shadow = core.shadow
    capacity = {p: c for p in ("", *PRECISIONS) if (c := executor.capacity_streams(p or None))}
    gpu = _GPU_MEMORY.read(device) if device.startswith("cuda") else {}
    return CoreSnapshot(
        stats=EngineStats(**vars(core.stats)), cache_hits=cache.hits, cache_misses=cache.misses,
        cache_bytes=cache.bytes, first_audio_wait_s=core.first_audio_wait(), busy_share=core.busy_share(),
        active_work=core.active_work,
        capacity=capacity, shadow_verified=shadow.verified if shadow else 0,
        shadow_min_psnr_db=shadow.psnr.minimum if shadow and shadow.verified else math.inf, gpu_memory=gpu,
        frozen_objects=_Heap.frozen)


class LocalHost:
    """The core on a thread of this process (the CPU default, `say` and the benchmarks)."""

    def __init__(self, config: EngineConfig, device: str, backend_name: str, telemetry: Telemetry,
                 on_trip: Callable[[str], None]) -> None:
        self.device = device
        self.runtimes = Runtimes(config, device, backend_name)
        self.core = build_core(config, telemetry, on_trip)
        self.cache = self.core.output.cache
        self.shadow = self.core.shadow
        self.dead = self.core.dead
        self.submit_text = self.core.submit_text
        self.submit_end = self.core.submit_end
        self.submit_cancel = self.core.submit_cancel

    def start(self, frontend: FrontendPoolConfig, preload: list[VoiceInfo]) -> dict[str, LoadedVoice]:
        """Load and prepare `preload` (the default voice first), then start the core's thread."""
        loaded = {info.name: self.runtimes.prepare(info) for info in preload}
        self.core.frontend_config = frontend
        self.core.start()
        return loaded

    def load(self, info: VoiceInfo) -> LoadedVoice:
        return self.runtimes.describe(info)

    def submit_open(self, request: SessionRequest, voice: VoiceInfo, sink: Sink, loop: asyncio.AbstractEventLoop,
                    cursor: ReadCursor) -> None:
        self.core.submit_open(WorkSpec.of(request, self.runtimes.get(voice), sink, loop, cursor))

    def taken(self, session_id: int, read_s: float, wake: bool) -> None:
        """A client took audio (its read cursor is shared with the core; only the wake-up is news)."""
        if wake:
            self.core.poke()

    def snapshot(self) -> CoreSnapshot:
        return snapshot(self.core, self.device)

    def reset_rate(self) -> None:
        self.core.reset_rate()

    def settle(self) -> None:
        settle_heap()  # one process for both sides

    def stop(self) -> None:
        self.core.stop()
