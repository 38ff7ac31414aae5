"""`cadenza voices check`: our model against the original Piper ONNX graph in onnxruntime,
noise scales 0, same phoneme ids, waveform PSNR per sentence. A model check: each sentence is
decoded whole by the family's reference decode (what the served chunks equal, see the
exactness tests), so the figure is the model's, not the chunking's."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from service.audio.quality import psnr_db
from service.models.family import AcousticJob, SynthesisParams, utterance_rng
from service.models.registry import open_voice
from service.voices import find_voice


def check_sentences() -> list[str]:
    text = resources.files("service").joinpath("data/check_sentences.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def run_voice_check(
    voice: str | None, voices_dir: str | None, backend: str, device: str, threads: int | None
) -> int:
    import onnxruntime

    from service.models.vits.runtime import VitsRuntime

    info = find_voice(voice, Path(voices_dir) if voices_dir else None)
    runtime = open_voice(info, "torch" if backend == "auto" else backend, device, threads=threads)
    if not isinstance(runtime, VitsRuntime):
        raise ValueError(f"voices check compares Piper voices with their original ONNX graph; {info.name} is a "
                         f"{info.family} voice")
    opts = onnxruntime.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    original = onnxruntime.InferenceSession(str(info.model_path), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
    input_names = {i.name for i in original.get_inputs()}
    sid = info.speaker_index(None)
    params = SynthesisParams(options=(("noise_scale", 0.0), ("noise_w", 0.0)), length_scale=1.0, seed=0)
    print(f"voice {info.name}: ours ({runtime.backend_name} on {device}, reference decode) "
          f"vs original ONNX (onnxruntime), noise scales 0")
    worst = float("inf")
    for i, text in enumerate(check_sentences()):
        ref_parts, ours_parts = [], []
        for sent in runtime.voice.frontend.sentences(text):
            feed = {
                "input": np.asarray([sent.phoneme_ids], dtype=np.int64),
                "input_lengths": np.asarray([len(sent.phoneme_ids)], dtype=np.int64),
                "scales": np.asarray([0.0, 1.0, 0.0], dtype=np.float32),
            }
            if "sid" in input_names:
                feed["sid"] = np.asarray([sid or 0], dtype=np.int64)
            ref_parts.append(original.run(None, feed)[0].reshape(-1))
            (utt,) = runtime.acoustic_batch([AcousticJob(sent, sid, params, utterance_rng(0, sent.phoneme_ids))])
            ours_parts.append(runtime.reference(utt))
        ref = np.concatenate(ref_parts) if ref_parts else np.zeros(0, np.float32)
        ours = np.concatenate(ours_parts) if ours_parts else np.zeros(0, np.float32)
        value = psnr_db(ref, ours)
        worst = min(worst, value)
        print(f"{i:2d} psnr_db={value:7.2f} samples={len(ours)}/{len(ref)}  {text}")
    print(f"min_psnr_db={worst:.2f}")
    return 0
