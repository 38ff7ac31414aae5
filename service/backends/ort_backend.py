"""ONNX Runtime backend: runs the per-stage ONNX exports of our own modules.
The default on CPU (faster than eager PyTorch there)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from service.backends.base import EncodeOut, VocodeOut, guard_host
from service.backends.stage_export import cached_stage_exports, decoder_stage_names
from service.models.vits.receptive_field import decoder_stage_table
from service.voices import Voice


def default_cache_dir() -> Path:
    """Where stage exports are kept; XDG cache by default."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cadenza" / "onnx"


class OrtBackend:
    name = "onnxruntime"

    def __init__(
        self, voice: Voice, device: str = "cpu", threads: int | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        import onnxruntime as ort

        if device != "cpu":
            raise ValueError(
                f"the onnxruntime backend runs on cpu only here; got device {device!r} "
                "(use --backend torch for cuda)"
            )
        self.device = device
        self.voice = voice
        paths = cached_stage_exports(voice.model, voice.info.onnx_path, cache_dir or default_cache_dir())
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
        self._sessions = {
            name: ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])
            for name, p in paths.items()
        }

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        return decoder_stage_table(self.voice.model)

    def decode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None) -> np.ndarray:
        """One flow coupling or generator stage (the staged streaming path)."""
        (y,) = self._run(self._stage_names[index], {"x": np.ascontiguousarray(x, dtype=np.float32),
                                                    "sid": self._sid(sid, x.shape[0])})
        return y

    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32",)

    @staticmethod
    def _sid(sid: np.ndarray | None, batch: int) -> np.ndarray:
        return np.zeros(batch, dtype=np.int64) if sid is None else np.asarray(sid, dtype=np.int64)

    def _run(self, stage: str, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        sess = self._sessions[stage]
        wanted = {i.name for i in sess.get_inputs()}
        return sess.run(None, {k: v for k, v in feed.items() if k in wanted})

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

    def vocode(
        self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32",
        sessions: Sequence[int] | None = None,
    ) -> VocodeOut:
        (audio,) = self._run("audio", {"z": np.ascontiguousarray(z, dtype=np.float32),
                                       "sid": self._sid(sid, z.shape[0])})
        return guard_host(audio, "fp32")
