"""Engine and limit settings, built once (CLI / tests) and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.precision import PrecisionPolicyConfig
from service.models.family import ChunkSchedule
from service.text.segment import SegmenterConfig


@dataclass(frozen=True)
class Limits:
    """Per-server limits; every one is documented in the README's Server section."""

    max_sessions: int = 1024  # open sessions; one more -> RESOURCE_EXHAUSTED (admission control acts first)
    max_text_chars: int = 100_000  # characters one session may send; more -> RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 << 20  # largest gRPC message either way
    # Work is bounded in the units that cost, not only in characters: a dictionary entry or an
    # annotation can make one word hundreds of phonemes. Phonemes one session may have spoken
    # (about 3 hours of speech); more -> RESOURCE_EXHAUSTED.
    max_session_phonemes: int = 200_000
    max_dictionary_entries: int = 1000  # custom dictionary entries per session
    max_dictionary_entry_chars: int = 200  # characters of one entry's word or of its pronunciation
    idle_timeout_s: float = 60.0  # a stream with no client message for this long is closed
    # At the estimated capacity (real-time streams, see GetServerInfo) a new session waits this
    # long for one to end, then gets RESOURCE_EXHAUSTED; 0 turns admission control off.
    admission_wait_s: float = 1.0
    capacity_streams: float | None = None  # pins the capacity instead of measuring it
    # ... and while a session has waited this long for its first audio (the engine is behind,
    # whatever the estimate says), new sessions wait too.
    admission_first_audio_s: float = 0.5


@dataclass(frozen=True)
class BatchConfig:
    """How the engine batches and paces decoding across sessions (see scheduler.py)."""

    # "slots": every step advances many sessions by `step_frames` in one call, each session's
    # decoder state in a device slot (the torch backend). "staged": each utterance decoded
    # alone by the staged decoder (ONNX Runtime on CPU). "auto": slots where the backend has them.
    decoder: str = "auto"
    step_frames: int = 64  # decoder frames a session advances per step after its first chunk
    max_step_rows: int = 256  # sessions advanced by one step at most (the most urgent first)
    # A GPU step that runs for urgent sessions takes the next sessions in line too, up to this
    # many rows: a step's fixed cost (launch, small-batch device time) is paid once for all of
    # them instead of once per trickle of urgent rows. On a CPU each row costs its own time: no fill.
    step_fill_rows: int = 128
    slots: int = 1024  # utterances decoding at once per voice and precision (state kept on the device)
    cuda_graphs: bool = True  # capture each (batch bucket, step size) as a CUDA graph
    max_ahead_s: float = 3.0  # backpressure: a session whose client has this much audio unread is not stepped
    stall_timeout_s: float = 30.0  # ... and one held back this long ends with DEADLINE_EXCEEDED (memory back)
    lead_s: float = 1.0  # audio kept ahead of playback; sessions further ahead step only when nothing is urgent
    urgent_slack_s: float = 0.3  # a playing session with less buffered is stepped before new sentences
    # A start counts as running out of audio this long after its text came (from then on it ranks
    # with the playing sessions about to run dry): sessions that keep running dry (an engine behind
    # its load) cannot hold a start back for good, and one that waited less never lengthens a gap.
    start_grace_s: float = 1.0
    acoustic_max_batch: int = 64  # sentences per acoustic-stage call
    # On CUDA, run the acoustic stage (text encoder and duration predictor, FP32) through
    # torch.compile: inductor fuses its many small elementwise kernels, so each sentence waits
    # less for its durations; the arithmetic stays FP32 (no duration changes, tested). Off: it
    # lengthens every start-up by the compile (bench/RESULTS.md weighs it).
    compile_acoustic: bool = False
    # On CUDA, run the decoder's hot module through torch.compile under its CUDA graphs, where the
    # voice's family can (`VoiceRuntime` options): fused kernels, the arithmetic unchanged. Off:
    # each start-up compiles for minutes the first time (bench/RESULTS.md weighs it).
    compile_decoder: bool = False
    acoustic_lookahead_s: float = 2.0  # a session's next sentence waits while this much audio is queued
    # Staged decoding: while another session is starting or has less than `cpu_urgent_slack_s`
    # of audio left, a chunk is cut to at most this many frames, so one session's big chunk does
    # not make the others run dry (staged chunks pay only a few samples of context).
    cpu_quantum_frames: int = 32
    cpu_urgent_slack_s: float = 0.5
    # How long a thread holding the GIL runs before it must hand it over (Python's default is
    # 5 ms). The engine thread makes many short native calls that each give the GIL up; while
    # the event loop is busy (a burst of new streams) each such call waits up to this long to
    # get it back, so a 5 ms interval turns a step of a few dozen calls into a long stall.
    gil_switch_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        if self.decoder not in ("auto", "slots", "staged"):
            raise ValueError(f"unknown decoder {self.decoder!r}; use auto, slots or staged")
        if not 0 < self.gil_switch_interval_s <= 1:
            raise ValueError("gil_switch_interval_s must be in (0, 1] seconds")
        if min(self.step_frames, self.max_step_rows, self.slots, self.acoustic_max_batch) < 1:
            raise ValueError("step_frames, max_step_rows, slots and acoustic_max_batch must be at least 1")
        if self.step_fill_rows < 0:
            raise ValueError("step_fill_rows must be at least 0")


@dataclass(frozen=True)
class EngineConfig:
    voice: str | None = None  # default voice name; None = the built-in voice
    voices_dir: Path | None = None  # extra voices (any family's files) served by name
    backend: str = "auto"  # torch | onnxruntime | tensorrt | auto (by device)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # CPU inference threads
    # Where the synthesis core runs: "process" (a process of its own, so its Python does not share
    # the GIL with the server's event loop and its streams), "thread" (in the caller's process:
    # one-text commands, and tests that reach into the core).
    core: str = "process"
    batch: BatchConfig = field(default_factory=BatchConfig)
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    segmenter: SegmenterConfig = field(default_factory=SegmenterConfig)
    frontend: FrontendPoolConfig = field(default_factory=FrontendPoolConfig)  # phonemiser processes
    limits: Limits = field(default_factory=Limits)
    cache_bytes: int = 64 << 20  # result cache bound (float32 model-rate audio); 0 disables
    precision: PrecisionPolicyConfig = field(default_factory=PrecisionPolicyConfig)  # how AUTO decides
    shadow_fraction: float = 0.0  # share of FP16 chunks re-run in FP32 off the hot path (PSNR histogram)
    # Load, export and warm up every configured voice (not only the default) before health says
    # SERVING, so no voice's first caller pays for it. Off for development (quick starts, `say`);
    # the Helm chart turns it on.
    preload: bool = False
    # Writable home of the ONNX stage exports; None = $XDG_CACHE_HOME or ~/.cache, /cadenza/onnx.
    # Read-only prebuilt exports (the image's) are looked up first; an unwritable dir falls back to
    # a temporary one with a warning.
    cache_dir: Path | None = None
    # Module patterns kept in FP32 when running FP16; None = the family's declared pins (the
    # precision tools try others through the served path).
    fp32_pins: tuple[str, ...] | None = None
    # Piper voices on the CPU (ONNX Runtime): also load the decoder's early stages quantized to
    # INT8 (made once per voice, kept beside the ONNX exports); AUTO sessions then run them. Lossy.
    int8: bool = False
    # Record the core's busy periods with torch.profiler into this directory (a Chrome trace and a
    # summary per period, see telemetry/ranges.py); None = off.
    profile_dir: Path | None = None
    # Record a timeline of the core's iterations and of each session's way to its first audio
    # into this directory, one file per busy period and side (see telemetry/timeline.py); None = off.
    timeline_dir: Path | None = None
    # Long enough to reach every stage session at every size class the decoder uses (the
    # ORT lanes cut only long calls), so the first caller does not pay for a first run.
    warmup_text: str = (
        "Hello there. This sentence warms up every stage of the decoder, so the first caller does not wait."
    )

    def __post_init__(self) -> None:
        if self.core not in ("process", "thread"):
            raise ValueError(f"unknown core placement {self.core!r}; use process or thread")
