"""Engine and limit settings, built once (CLI / tests) and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from service.engine.precision import PrecisionPolicyConfig
from service.synthesis import ChunkSchedule
from service.text.segment import SegmenterConfig


@dataclass(frozen=True)
class Limits:
    """Per-server limits; every one is documented in the README's Server section."""

    max_sessions: int = 64  # open sessions; one more -> RESOURCE_EXHAUSTED
    max_text_chars: int = 100_000  # characters one session may send; more -> RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 << 20  # largest gRPC message either way
    idle_timeout_s: float = 60.0  # a stream with no client message for this long is closed


@dataclass(frozen=True)
class BatchConfig:
    """Dynamic batching of flow/vocoder windows across sessions."""

    max_batch: int = 8  # rows per backend call
    max_wait_s: float = 0.002  # how long an underfull batch may wait for company
    # On CUDA, window lengths are rounded up to this many frames (with extra left context, so
    # results do not change) so sessions with different utterance lengths share batches. Not
    # used on CPU, where the extra context would cost more than batching gains.
    cuda_window_bucket_frames: int = 32
    # On CPU, FP32 utterances are decoded alone by the staged decoder (each stage's output kept
    # between chunks) instead of in batched windows that recompute every chunk's context.
    cpu_staged: bool = True
    # While another session is starting or has less than `cpu_urgent_slack_s` of audio left to
    # play, a staged CPU chunk is cut to at most this many frames, so one session's big chunk
    # does not make the others run dry (staged chunks pay only a few samples of context).
    cpu_quantum_frames: int = 32
    cpu_urgent_slack_s: float = 0.5


@dataclass(frozen=True)
class EngineConfig:
    voice: str | None = None  # default voice name; None = the built-in voice
    voices_dir: Path | None = None  # extra Piper voices served by name
    backend: str = "auto"  # torch | onnxruntime | tensorrt | auto (by device)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # CPU inference threads
    batch: BatchConfig = field(default_factory=BatchConfig)
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    segmenter: SegmenterConfig = field(default_factory=SegmenterConfig)
    limits: Limits = field(default_factory=Limits)
    cache_bytes: int = 64 << 20  # result cache bound (float32 model-rate audio); 0 disables
    precision: PrecisionPolicyConfig = field(default_factory=PrecisionPolicyConfig)  # how AUTO decides
    shadow_fraction: float = 0.0  # share of FP16 chunks re-run in FP32 off the hot path (PSNR histogram)
    # Long enough to reach every stage session at every size class the decoder uses (the
    # ORT lanes cut only long calls), so the first caller does not pay for a first run.
    warmup_text: str = (
        "Hello there. This sentence warms up every stage of the decoder, so the first caller does not wait."
    )
