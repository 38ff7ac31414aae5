"""INT8 decoder stages on the CPU (`cadenza serve --int8`): which stages are quantized, that the
quantized graphs are made once and reused, that streamed INT8 audio is what a whole INT8 decode
gives, and the quality floor README states against FP32 over the check sentences (PESQ-WB median
>= 4.1 and none under 3.75; the recogniser hears as many words right)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soxr

from service.engine.config import BatchConfig, EngineConfig
from service.engine.contract import AudioEncoding, AudioOut, Precision, SessionConfig, SessionSummary
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import AcousticJob, SynthesisParams, utterance_rng
from service.models.vits.backends.ort_backend import OrtBackend
from service.models.vits.backends.quantize import QUANT_VERSION, cached_int8_stages, int8_stage_names
from service.models.vits.backends.stage_export import decoder_stage_names
from service.models.vits.receptive_field import decoder_stage_table
from service.models.vits.runtime import VitsRuntime
from service.models.vits.voice import Voice, builtin_voice_info
from tests.asr import transcribe, word_error_rate

SENTENCES = (
    "Hello from Cadenza, the streaming speech server.",
    "The weather tomorrow will be sunny and warm all day long.",
)
CHECK_SENTENCES = Path(__file__).resolve().parents[2] / "service" / "data" / "check_sentences.txt"
PESQ_MEDIAN_FLOOR = 4.1  # README's figures for --int8
PESQ_FLOOR = 3.75


def test_the_frame_rate_stages_and_the_first_upsampling_stage_are_quantized() -> None:
    model = Voice(builtin_voice_info()).model
    names = decoder_stage_names(model)
    stages = decoder_stage_table(model)
    picked = int8_stage_names(names, stages)
    first_up = next(i for i, (factor, _, _) in enumerate(stages) if factor > 1)
    assert picked == names[: first_up + 1]
    assert all(factor == 1 for factor, _, _ in stages[:first_up])
    # The built-in voice (Piper medium): the flow's four couplings, conv_pre, the first upsampler.
    assert picked == ["latent_s0", "latent_s1", "latent_s2", "latent_s3", "audio_s0", "audio_s1"]


@pytest.fixture(scope="module")
def int8_backend(tmp_path_factory: pytest.TempPathFactory) -> tuple[OrtBackend, Path]:
    cache = tmp_path_factory.mktemp("int8-cache")
    return OrtBackend(Voice(builtin_voice_info()), threads=2, cache_dir=cache, int8=True), cache


def test_int8_graphs_are_made_once_beside_the_exports_and_reused(int8_backend: tuple[OrtBackend, Path]) -> None:
    backend, cache = int8_backend
    assert backend.supported_precisions() == ("fp32", "int8")
    (export_dir,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    made = sorted((export_dir / f"int8-v{QUANT_VERSION}").glob("*.onnx"))
    assert [p.stem for p in made] == sorted(int8_stage_names(backend._stage_names, backend.decoder_stages()))
    stamps = {p: p.stat().st_mtime_ns for p in made}
    again = OrtBackend(Voice(builtin_voice_info()), threads=2, cache_dir=cache, int8=True)
    assert again.supported_precisions() == ("fp32", "int8")
    assert {p: p.stat().st_mtime_ns for p in made} == stamps  # loaded, not made again
    assert not [p for p in export_dir.parent.iterdir() if p.name.startswith(".")]  # no temporary dir left


def test_int8_graphs_for_prebuilt_exports_go_to_the_writable_cache(int8_backend: tuple[OrtBackend, Path],
                                                                   tmp_path: Path) -> None:
    """An image's read-only exports without INT8 graphs: they are made in the cache dir, never
    beside the prebuilt ones; prebuilt INT8 graphs are used where they exist."""
    import shutil

    backend, cache = int8_backend
    (export_dir,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    prebuilt = tmp_path / "prebuilt" / export_dir.name
    shutil.copytree(export_dir, prebuilt, ignore=shutil.ignore_patterns("int8-*"))
    fp32 = {p.stem: p for p in prebuilt.glob("*.onnx")}
    names = int8_stage_names(backend._stage_names, backend.decoder_stages())
    made = cached_int8_stages(backend.voice, fp32, names, tmp_path / "cache", backend._run)
    assert {p.parent for p in made.values()} == {tmp_path / "cache" / export_dir.name / f"int8-v{QUANT_VERSION}"}
    assert not list(prebuilt.glob("int8-*"))
    assert cached_int8_stages(backend.voice, fp32, names, tmp_path / "cache", backend._run) == made
    shutil.copytree(made[names[0]].parent, prebuilt / f"int8-v{QUANT_VERSION}")
    found = cached_int8_stages(backend.voice, fp32, names, tmp_path / "cache", backend._run)
    assert {p.parent for p in found.values()} == {prebuilt / f"int8-v{QUANT_VERSION}"}


def test_a_backend_loaded_without_int8_refuses_it(builtin_ort: VitsRuntime) -> None:
    assert builtin_ort.precisions() == ("fp32",)
    x = np.zeros((1, 192, 20), dtype=np.float32)
    with pytest.raises(ValueError, match="loaded for fp32"):
        builtin_ort.backend.decode_stage(0, x, None, "int8")


def test_int8_stages_run_integer_kernels_and_differ_from_fp32(int8_backend: tuple[OrtBackend, Path]) -> None:
    backend, _ = int8_backend
    x = (np.random.default_rng(0).standard_normal((1, 192, 80)) * 0.7).astype(np.float32)
    fp32 = backend.decode_stage(0, x, None, "fp32")
    int8 = backend.decode_stage(0, x, None, "int8")
    assert fp32.shape == int8.shape and np.isfinite(int8).all()
    assert not np.array_equal(fp32, int8)  # a stage left in FP32 would give the same bits
    # ... and close (this input is noise, outside the calibrated ranges in places).
    assert float(np.linalg.norm(fp32 - int8)) < 0.1 * float(np.linalg.norm(fp32))


@pytest.fixture(scope="module")
def engine(int8_backend: tuple[OrtBackend, Path]) -> Iterator[LocalEngine]:
    _, cache = int8_backend
    with LocalEngine(EngineConfig(
        backend="onnxruntime", device="cpu", threads=2, cache_bytes=0, cache_dir=cache, int8=True,
        frontend=FrontendPoolConfig(workers=0), core="thread", batch=BatchConfig(decoder="staged"),
        warmup_text="Warm up.",
    )) as local:
        yield local


def _served(local: LocalEngine, text: str, precision: Precision) -> tuple[np.ndarray, SessionSummary, set[Precision]]:
    config = SessionConfig(encoding=AudioEncoding.FLOAT32, seed=7, precision=precision)
    parts, summary, made_by = [], None, set()
    for event in local.stream(text, config):
        if isinstance(event, AudioOut):
            parts.append(np.frombuffer(event.audio, dtype="<f4"))
            if event.num_samples:
                made_by.add(event.precision)
        else:
            summary = event
    assert summary is not None
    return np.concatenate(parts), summary, made_by


def _pesq(reference: np.ndarray, degraded: np.ndarray, rate: int) -> float:
    from pesq import pesq

    return float(pesq(16000, soxr.resample(reference, rate, 16000), soxr.resample(degraded, rate, 16000), "wb"))


def test_auto_runs_int8_and_fp32_stays_asked_for(engine: LocalEngine) -> None:
    _, summary, made_by = _served(engine, SENTENCES[0], Precision.AUTO)
    assert summary.precision is Precision.INT8 and "--int8" in summary.precision_reason
    assert made_by == {Precision.INT8}
    _, summary, made_by = _served(engine, SENTENCES[0], Precision.FP32)
    assert summary.precision is Precision.FP32 and made_by == {Precision.FP32}


def test_streamed_int8_equals_a_whole_int8_decode(engine: LocalEngine, int8_backend: tuple[OrtBackend, Path]) -> None:
    """Chunked decoding stays exact in INT8: the quantization scales are fixed, so a stage's
    window computes what the whole call computes."""
    backend, _ = int8_backend
    text = SENTENCES[1]  # no clause break: one utterance
    served, _, _ = _served(engine, text, Precision.INT8)
    runtime = VitsRuntime(backend.voice, backend)
    sentence = runtime.voice.frontend.sentences(text)
    assert len(sentence) == 1
    job = AcousticJob(sentence[0], None, SynthesisParams(seed=7), utterance_rng(7, sentence[0].phoneme_ids))
    (utt,) = runtime.acoustic_batch([job])
    decoder = runtime.utterance_decoder(utt, "int8")
    whole = decoder.audio(0, decoder.samples)  # one call: every stage over the whole utterance
    assert decoder.precision == "int8"
    assert served.shape == whole.shape
    assert float(np.abs(served - whole).max()) <= 1e-4 * max(1.0, float(np.abs(whole).max()))


def test_int8_keeps_the_quality_floor_against_fp32(engine: LocalEngine) -> None:
    rate = engine.sample_rate
    scores, errors, words_seen = [], {"fp32": 0.0, "int8": 0.0}, 0
    for text in CHECK_SENTENCES.read_text(encoding="utf-8").splitlines():
        fp32, _, _ = _served(engine, text, Precision.FP32)
        int8, _, _ = _served(engine, text, Precision.INT8)
        assert fp32.shape == int8.shape  # same durations: the acoustic stage is FP32 in both
        scores.append(_pesq(fp32, int8, rate))
        words = [w.strip(",.;:?!\"").lower() for w in text.split()]
        words_seen += len(words)
        for name, audio in (("fp32", fp32), ("int8", int8)):
            errors[name] += word_error_rate(words, transcribe(audio, rate)) * len(words)
    assert float(np.median(scores)) >= PESQ_MEDIAN_FLOOR and min(scores) >= PESQ_FLOOR, scores
    # The recogniser is coarse (it mishears numbers and names in the FP32 audio too): INT8 costs it
    # at most 3% more of the words.
    assert errors["int8"] <= errors["fp32"] + 0.03 * words_seen, errors
