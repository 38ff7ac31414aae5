"""kokoro-onnx (PyPI, 0.6.1) as `cadenza bench cpu`'s peer for Kokoro voices.

Both sides synthesise the same thing: kokoro-onnx runs the shipped int8 graph
(`kokoro-v1.0.int8.onnx`, the file our weights are dequantised from) on an ONNX Runtime session
of our making (intra-op threads = ours, inter-op 1, CPU), and is given our frontend's phonemes
(`is_phonemes=True`; its own espeak G2P is never called), one of our sentences per call, with
the voice's pack, our vocabulary and our speed. Each call's tokens are checked to be our
sentence's ids, so its style row (the phoneme count's) is ours too. No trimming and no added
pauses: its audio is the model's, as ours is.

What is timed, from the text: our frontend's G2P of the whole text (kokoro-onnx has to be fed
phonemes from somewhere, and ours pays for the same G2P inside its TTFA), then one `create` per
sentence. kokoro-onnx does not stream: its TTFA is when its first sentence's audio is complete,
its total when its last is. (Left to itself it would phonemise the text and cut it into 510-
phoneme batches, i.e. one call for any text of the corpus, so its TTFA would be its total;
sentence by sentence is the quicker first audio of the two ways to drive it.)"""

from __future__ import annotations

import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from service.models.family import VoiceInfo
from service.models.kokoro.voices import VOICE_DIM, VOICE_ROWS
from service.models.registry import open_frontend
from service.text.frontend import PhonemizedSentence
from service.tools.bench_cpu import Playback, Run

VERSION = "0.6.1"  # the pin in pyproject.toml's test extra


class KokoroOnnxPeer:
    """kokoro-onnx's `Kokoro` on the voice's graph and pack, fed our sentences' phonemes."""

    label = "kokoro-onnx"

    def __init__(self, info: VoiceInfo, threads: int) -> None:
        try:
            import onnxruntime
            from kokoro_onnx import Kokoro
        except ImportError as exc:  # the test extra installs it
            raise RuntimeError(f"the bench's Kokoro peer is not installed: pip install kokoro-onnx=={VERSION} "
                               f"({exc})") from exc
        found = metadata.version("kokoro-onnx")
        if found != VERSION:
            raise RuntimeError(f"kokoro-onnx {found} is installed; the bench compares with {VERSION}")
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        model = Path(info.config_path)  # a Kokoro voice's config file is its model: here an ONNX graph
        if model.suffix != ".onnx":
            raise ValueError(f"kokoro-onnx runs an ONNX graph, and {model.parent} serves {model.name}: bench a "
                             "folder with the int8 release (`cadenza voices install kokoro --dir DIR`)")
        session = onnxruntime.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
        pack = np.fromfile(info.model_path, dtype="<f4").reshape(VOICE_ROWS, 1, VOICE_DIM)
        # Its constructor loads a voices .npz (name -> pack): ours. Calls pass the pack itself, which
        # spares it a read of the archive per call.
        with tempfile.TemporaryDirectory(prefix="cadenza-kokoro-onnx-") as tmp:
            voices = Path(tmp) / "voices.npz"
            packs: dict[str, Any] = {info.model_path.stem: pack}
            np.savez(voices, **packs)
            self.kokoro: Any = Kokoro.from_session(session, str(voices),
                                                   vocab_config=str(model.parent / "vocab.json"))
        self.pack = pack
        self.speed = 1.0 / info.length_scale  # as our acoustic stage, at the voice's default pace
        self.frontend = open_frontend(info.frontend_key)
        self.g2p_s: list[float] = []  # per run: the frontend's share of its times
        self._checked: set[str] = set()
        self.sample_rate = 24_000

    def synthesize(self, sentence: PhonemizedSentence) -> np.ndarray:
        audio, self.sample_rate = self.kokoro.create(
            "".join(sentence.phonemes), voice=self.pack, speed=self.speed, is_phonemes=True, trim=False,
            sentence_pause=0.0, clause_pause=0.0,
        )
        return np.asarray(audio, dtype=np.float32)

    def run(self, text: str) -> Run:
        clock = Playback()
        sentences = self.frontend.sentences(text, words=False)
        self.g2p_s.append(time.perf_counter() - clock.start)
        for sentence in sentences:
            clock.chunk(len(self.synthesize(sentence)) / self.sample_rate)
        run = clock.run()
        if text not in self._checked:  # after the clock: the same work as ours, once per text
            self.check_tokens(sentences)
            self._checked.add(text)
        return run

    def check_tokens(self, sentences: list[PhonemizedSentence]) -> None:
        """Raise unless kokoro-onnx turns each sentence's phonemes into our ids (less the
        boundary ids it adds itself): then both models run the same tokens and style row."""
        for sentence in sentences:
            phonemes = " ".join("".join(sentence.phonemes).split())  # its normalisation of phonemes
            tokens = self.kokoro.tokenizer.tokenize(phonemes)
            if tokens != list(sentence.phoneme_ids[1:-1]):
                raise RuntimeError(f"kokoro-onnx tokenises {phonemes!r} otherwise than our frontend; "
                                   "the two sides would not synthesise the same thing")

    def notes(self) -> list[str]:
        if not self.g2p_s:
            return []
        return [f"{self.label} {VERSION}: int8 graph on ONNX Runtime, fed our frontend's phonemes a sentence per "
                f"call; its times include that G2P, median {statistics.median(self.g2p_s) * 1000:.1f} ms per text"]
