"""ONNX Runtime backend: runs the per-stage ONNX exports of our own modules.
The default on CPU (faster than eager PyTorch there). FP32, and INT8 for the staged decoder's
early stages when asked for at load (`int8`, see `quantize`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from service.models.family import guard_host
from service.models.vits.backends.base import Capabilities, EncodeOut, VocodeOut
from service.models.vits.backends.quantize import cached_int8_stages, int8_stage_names
from service.models.vits.backends.stage_export import cached_stage_exports, decoder_stage_names, default_cache_dir
from service.models.vits.receptive_field import decoder_stage_table
from service.models.vits.voice import Voice

# Staged-decoder calls are cut in time into pieces of at least this many input frames
# (flow) or samples (generator), at most one per CPU lane, each run by a one-thread
# session in its own thread: the flow's small convs and the last generator stages'
# cache-sized pieces do more per core that way than one session spreading every op
# over all threads. Calls too short for two pieces stay whole (the cut's extra context
# and hand-off would cost more than they save).
LANE_MIN_FLOW_FRAMES = 64
LANE_MIN_GENERATOR_SAMPLES = 1024
LANE_GENERATOR_STAGES = 2  # the last two generator stages (longest inputs)


def lane_split_minimums(stages: list[tuple[int, int, int]], flow_stages: int) -> list[int | None]:
    """Per staged-decoder stage: the shortest input piece a call is cut into, or
    None (never cut)."""
    out: list[int | None] = []
    for i in range(len(stages)):
        if i < flow_stages:
            out.append(LANE_MIN_FLOW_FRAMES)
        elif i >= len(stages) - LANE_GENERATOR_STAGES:
            out.append(LANE_MIN_GENERATOR_SAMPLES)
        else:
            out.append(None)
    return out


def run_session(sess: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run an ONNX Runtime session on the inputs of `feed` its graph has (an export
    drops `sid` where the stage does not use it)."""
    wanted = {i.name for i in sess.get_inputs()}
    result: list[np.ndarray] = sess.run(None, {k: v for k, v in feed.items() if k in wanted})
    return result


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class OrtBackend:
    name = "onnxruntime"
    capabilities = Capabilities(staged_decoder=True)
    fp32_pins: tuple[str, ...] = ()  # no FP16

    def __init__(
        self, voice: Voice, device: str = "cpu", threads: int | None = None,
        cache_dir: Path | None = None, int8: bool = False,
    ) -> None:
        import onnxruntime as ort

        if device != "cpu":
            raise ValueError(
                f"the onnxruntime backend runs on cpu only here; got device {device!r} "
                "(use --backend torch for cuda)"
            )
        self.device = device
        self.voice = voice
        cache_dir = cache_dir or default_cache_dir()
        paths = cached_stage_exports(voice.model, voice.info.model_path, cache_dir)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        # Worker threads spin between the ops of a run (waking a blocked thread for
        # every op costs 10-40% on these small convs), and stop spinning when the run
        # ends: several stage sessions run one after another, and a pool still spinning
        # after its run would steal the cores from the next stage (2-3x slower calls).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
        opts.add_session_config_entry("session.force_spinning_stop", "1")
        self._stage_names = decoder_stage_names(voice.model)
        self._stages = decoder_stage_table(voice.model)

        def load(path: Path, options: Any) -> Any:
            return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])

        # Sessions per (precision, graph); a stage without an INT8 graph runs its FP32 one.
        self._sessions: dict[str, dict[str, Any]] = {"fp32": {name: load(p, opts) for name, p in paths.items()}}
        if int8:
            quantized = cached_int8_stages(voice, paths, int8_stage_names(self._stage_names, self._stages),
                                           cache_dir, self._run)
            self._sessions["int8"] = {**self._sessions["fp32"], **{n: load(p, opts) for n, p in quantized.items()}}
        self.lanes = threads or cpu_count()
        self.lane_minimums = lane_split_minimums(self._stages, voice.model.flow.num_stages)
        self._lane_sessions: dict[str, dict[str, Any]] = {}
        self._lane_pool: ThreadPoolExecutor | None = None
        if self.lanes > 1:
            one = ort.SessionOptions()
            one.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            one.intra_op_num_threads = 1
            one.inter_op_num_threads = 1
            cut = [name for name, least in zip(self._stage_names, self.lane_minimums, strict=True) if least is not None]
            self._lane_sessions = {"fp32": {name: load(paths[name], one) for name in cut}}
            if int8:
                self._lane_sessions["int8"] = {
                    name: load(quantized.get(name, paths[name]), one) for name in cut}
            self._lane_pool = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="cadenza-ort-lane")

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        return self._stages

    def decode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        """One flow coupling or generator stage (the staged streaming path)."""
        if precision not in self._sessions:
            raise ValueError(f"the onnxruntime backend was loaded for {', '.join(self._sessions)}; "
                             f"got precision {precision!r}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        name = self._stage_names[index]
        least = self.lane_minimums[index]
        pieces = min(self.lanes, x.shape[-1] // least) if least else 1
        if self._lane_pool is None or pieces < 2:
            (y,) = run_session(self._sessions[precision][name], {"x": x, "sid": self._sid(sid, x.shape[0])})
            return y
        return self._decode_in_lanes(index, x, sid, pieces, precision)

    def _decode_in_lanes(self, index: int, x: np.ndarray, sid: np.ndarray | None, pieces: int,
                         precision: str) -> np.ndarray:
        """One stage call cut in time into `pieces` (at most one per lane). Each piece
        carries the stage's input context on its inner sides, so its kept outputs equal
        the whole call's; the pieces run at once in one-thread sessions."""
        assert self._lane_pool is not None
        factor, context, _ = self._stages[index]
        sess = self._lane_sessions[precision][self._stage_names[index]]
        length = x.shape[-1]
        edges = [length * k // pieces for k in range(pieces + 1)]
        sid_arr = self._sid(sid, x.shape[0])

        def piece(k: int) -> np.ndarray:
            lo, hi = edges[k], edges[k + 1]
            in_lo, in_hi = max(0, lo - context), min(length, hi + context)
            (y,) = run_session(sess, {"x": np.ascontiguousarray(x[:, :, in_lo:in_hi]), "sid": sid_arr})
            return y[:, :, (lo - in_lo) * factor : (hi - in_lo) * factor]

        others = [self._lane_pool.submit(piece, k) for k in range(1, pieces)]
        parts = [piece(0)] + [f.result() for f in others]
        return np.concatenate(parts, axis=-1)

    def supported_precisions(self) -> tuple[str, ...]:
        return tuple(self._sessions)

    @staticmethod
    def _sid(sid: np.ndarray | None, batch: int) -> np.ndarray:
        return np.zeros(batch, dtype=np.int64) if sid is None else np.asarray(sid, dtype=np.int64)

    def _run(self, stage: str, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return run_session(self._sessions["fp32"][stage], feed)

    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut:
        m_p, logs_p, logw = self._run("prior", {
            "ids": np.asarray(ids, dtype=np.int64), "lengths": np.asarray(lengths, dtype=np.int64),
            "dp_noise": np.asarray(dp_noise, dtype=np.float32), "sid": self._sid(sid, ids.shape[0]),
        })
        return EncodeOut(m_p, logs_p, logw)

    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        (z,) = self._run("latent", {"z_p": np.ascontiguousarray(z_p, dtype=np.float32),
                                    "sid": self._sid(sid, z_p.shape[0])})
        return z

    def vocode(self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> VocodeOut:
        (audio,) = self._run("audio", {"z": np.ascontiguousarray(z, dtype=np.float32),
                                       "sid": self._sid(sid, z.shape[0])})
        guarded = guard_host(audio)
        return VocodeOut(guarded.audio, guarded.nonfinite, "fp32")
