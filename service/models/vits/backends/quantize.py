"""INT8 decoder stages for the CPU: ONNX Runtime static quantization of the staged decoder.

What is quantized: the convolutions of the stages that run at the frame rate (the flow's
couplings, the generator's input convolution) and of the generator's first upsampling stage.
Later generator stages stay FP32: their activations span a range that one 8-bit scale per tensor
cannot hold without audible error, and so does the acoustic stage (a small error there moves a
duration by a frame and shifts everything after it). Weights are INT8 per output channel with 7
bits of range (x86 CPUs without VNNI add pairs of UINT8 x INT8 products in 16 bits, which
full-range weights saturate), activations UINT8 with ranges from FP32 decodes of a few fixed
sentences (MinMax), in QDQ form so ONNX Runtime runs integer kernels.

The result is lossy (`bench/RESULTS.md` gives its measured quality against FP32); it is made once
per voice and kept next to the FP32 stage exports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from service.models.vits.backends.stage_export import find_graphs, make_graphs, writable_cache_dir
from service.models.vits.voice import Voice

log = logging.getLogger(__name__)

QUANT_VERSION = "2"  # a change to what or how this module quantizes bumps it
# Calibration sentences: statements, a question, numbers and a long clause, so the activation
# ranges cover quiet and loud, short and long phonemes.
CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Would you like me to book a table for two at seven thirty tonight?",
    "Your order of 3 items ships on Monday, and the tracking number is 4 7 2 9.",
    "Please hold while I transfer your call to the next available agent; it should not take long.",
    "Wow! That is amazing news.",
)
CALIBRATION_SEED = 1234

# Run an FP32 graph by name on a feed (`OrtBackend._run` or a lane session).
StageRunner = Callable[[str, dict[str, np.ndarray]], list[np.ndarray]]


def int8_stage_names(stage_names: Sequence[str], stages: Sequence[tuple[int, int, int]]) -> list[str]:
    """The staged decoder's graphs that run in INT8 (see the module's doc): every stage up to and
    including the first that upsamples. `stages` is the decoder's stage table (factor first)."""
    first_up = next(i for i, (factor, _, _) in enumerate(stages) if factor > 1)
    return list(stage_names[: first_up + 1])


def calibration_inputs(voice: Voice, stage_names: Sequence[str], run: StageRunner,
                       texts: Sequence[str] = CALIBRATION_TEXTS) -> dict[str, list[np.ndarray]]:
    """Every decoder stage's input for whole-utterance FP32 decodes of `texts` (the voice's own
    noise scales and pace, a fixed seed)."""
    info = voice.info
    frontend = voice.frontend
    rng = np.random.default_rng(CALIBRATION_SEED)
    noise_scale = np.float32(info.option("noise_scale").default)
    noise_w = np.float32(info.option("noise_w").default)
    sid = np.zeros(1, dtype=np.int64)
    inputs: dict[str, list[np.ndarray]] = {name: [] for name in stage_names}
    for text in texts:
        for sentence in frontend.sentences(text, words=False):
            ids = np.asarray([sentence.phoneme_ids], dtype=np.int64)
            n = ids.shape[1]
            dp_noise = rng.standard_normal((1, 2, n), dtype=np.float32) * noise_w
            m_p, logs_p, logw = run("prior", {"ids": ids, "lengths": np.asarray([n], dtype=np.int64),
                                              "dp_noise": dp_noise, "sid": sid})
            durations = np.ceil(np.exp(logw[0, 0, :n]) * np.float32(info.length_scale)).astype(np.int64)
            src = np.repeat(np.arange(n), durations)
            if src.size == 0:
                continue
            noise = rng.standard_normal((m_p.shape[1], src.size), dtype=np.float32)
            x = (m_p[0][:, src] + np.exp(logs_p[0][:, src]) * noise * noise_scale)[None].astype(np.float32)
            for name in stage_names:
                inputs[name].append(x)
                (x,) = run(name, {"x": x, "sid": sid})
    return inputs


class _Reader:
    """ONNX Runtime's calibration data reader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def quantize_stage(fp32_path: Path, out_path: Path, samples: list[np.ndarray]) -> None:
    """One stage graph to static INT8 (QDQ), its activation ranges from `samples` (its inputs)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quant_pre_process, quantize_static

    graph_inputs = {i.name for i in onnx.load(str(fp32_path), load_external_data=False).graph.input}
    feeds = [{"x": x, **({"sid": np.zeros(1, dtype=np.int64)} if "sid" in graph_inputs else {})} for x in samples]
    prepared = out_path.with_suffix(".prepared.onnx")  # shapes inferred, constants folded
    quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
    quantize_static(
        str(prepared), str(out_path), _Reader(feeds), op_types_to_quantize=["Conv"],
        quant_format=QuantFormat.QDQ, per_channel=True, reduce_range=True,
        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
    )


def cached_int8_stages(voice: Voice, fp32_paths: dict[str, Path], names: Sequence[str], cache_dir: Path,
                       run: StageRunner) -> dict[str, Path]:
    """INT8 graphs for the stages `names` (`int8_stage_names`), kept in `int8-v<version>` beside
    the FP32 exports: found there (a prebuilt dir or `cache_dir`), else calibrated and quantized
    once into `cache_dir` (or its writable fallback, as the exports are)."""
    export_dir = fp32_paths[names[0]].parent
    sub = f"int8-v{QUANT_VERSION}"
    found = find_graphs(names, [export_dir / sub, cache_dir / export_dir.name / sub])
    if found is not None:
        return found
    out_dir = writable_cache_dir(cache_dir) / export_dir.name / sub

    def quantize(tmp: Path) -> None:
        log.info("quantizing voice %s's decoder stages to INT8 into %s (once: later runs load them from there) ...",
                 voice.info.name, out_dir)
        start = time.perf_counter()
        samples = calibration_inputs(voice, names, run)
        for name in names:
            quantize_stage(fp32_paths[name], tmp / f"{name}.onnx", samples[name])
        log.info("quantized %d decoder stages of voice %s in %.1f s (cached for later runs)", len(names),
                 voice.info.name, time.perf_counter() - start)

    # The fallback dir may have them already.
    return find_graphs(names, [out_dir]) or make_graphs(names, out_dir, quantize)
