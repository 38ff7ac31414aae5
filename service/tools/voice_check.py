"""`cadenza voices check`: our model against the original Piper ONNX graph in
onnxruntime, noise scales 0, same phoneme ids, waveform PSNR per sentence."""

from __future__ import annotations

from importlib import resources

import numpy as np

from service.audio.quality import psnr_db
from service.synthesis import SynthesisParams, open_synthesizer


def check_sentences() -> list[str]:
    text = resources.files("service").joinpath("data/check_sentences.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def run_voice_check(
    voice: str | None, voices_dir: str | None, backend: str, device: str, threads: int | None
) -> int:
    import onnxruntime

    name = "torch" if backend == "auto" else backend
    # Whole sentences, like Piper (no fast-start clause split); chunked decoding stays on.
    syn = open_synthesizer(voice, voices_dir=voices_dir, backend=name, device=device,
                           threads=threads)
    info = syn.voice.info
    opts = onnxruntime.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    original = onnxruntime.InferenceSession(
        str(info.onnx_path), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    input_names = {i.name for i in original.get_inputs()}
    sid = syn.voice.speaker_index(None)
    params = SynthesisParams(noise_scale=0.0, noise_w=0.0, length_scale=1.0, seed=0)
    print(f"voice {info.name}: ours ({syn.backend.name} on {syn.backend.device}, chunked) "
          f"vs original ONNX (onnxruntime), noise scales 0")
    worst = float("inf")
    for i, text in enumerate(check_sentences()):
        ref_parts = []
        for sent in syn.voice.frontend.sentences(text):
            feed = {
                "input": np.asarray([sent.phoneme_ids], dtype=np.int64),
                "input_lengths": np.asarray([len(sent.phoneme_ids)], dtype=np.int64),
                "scales": np.asarray([0.0, 1.0, 0.0], dtype=np.float32),
            }
            if "sid" in input_names:
                feed["sid"] = np.asarray([sid or 0], dtype=np.int64)
            ref_parts.append(original.run(None, feed)[0].reshape(-1))
        ours, _ = syn.synthesize(text, params)
        ref = np.concatenate(ref_parts) if ref_parts else np.zeros(0, np.float32)
        value = psnr_db(ref, ours)
        worst = min(worst, value)
        print(f"{i:2d} psnr_db={value:7.2f} samples={len(ours)}/{len(ref)}  {text}")
    print(f"min_psnr_db={worst:.2f}")
    return 0
