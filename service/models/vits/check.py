"""A Piper voice against its original ONNX graph in ONNX Runtime (`cadenza voices check`): noise
scales 0, same phoneme ids, so the two differ only by the port."""

from __future__ import annotations

import numpy as np

from service.models.family import AcousticJob, SynthesisParams, utterance_rng
from service.models.vits.runtime import VitsRuntime
from service.text.frontend import PhonemizedSentence


class VitsParity:
    description = "original ONNX graph (onnxruntime), noise scales 0"

    def __init__(self, runtime: VitsRuntime, threads: int | None) -> None:
        import onnxruntime

        opts = onnxruntime.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.runtime = runtime
        self.original = onnxruntime.InferenceSession(str(runtime.info.model_path), sess_options=opts,
                                                     providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.original.get_inputs()}
        self.sid = runtime.info.speaker_index(None)
        self.params = SynthesisParams(options=(("noise_scale", 0.0), ("noise_w", 0.0)), length_scale=1.0, seed=0)

    def pair(self, sentence: PhonemizedSentence) -> tuple[np.ndarray, np.ndarray]:
        feed = {
            "input": np.asarray([sentence.phoneme_ids], dtype=np.int64),
            "input_lengths": np.asarray([len(sentence.phoneme_ids)], dtype=np.int64),
            "scales": np.asarray([0.0, 1.0, 0.0], dtype=np.float32),
        }
        if "sid" in self.inputs:
            feed["sid"] = np.asarray([self.sid or 0], dtype=np.int64)
        original = self.original.run(None, feed)[0].reshape(-1)
        job = AcousticJob(sentence, self.sid, self.params, utterance_rng(0, sentence.phoneme_ids))
        (utt,) = self.runtime.acoustic_batch([job])
        return original, self.runtime.reference(utt)
