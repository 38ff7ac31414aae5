"""Host time of the acoustic stage per sentence: `Synthesizer.acoustic_batch` without its encode.

On a GPU the engine thread spends each acoustic call in three parts: the host work before and
after the encoder (padding, noise draws, durations, length regulation, word spans), and the wait
for the encoder on the device. `serve --timeline` gives the whole call; this separates the host
part, which is the same work on any machine, by running a real batch once (built-in voice,
torch on CPU) and then timing the same batch with the encoder's outputs replayed.

    .venv/bin/python scripts/acoustic_host_cost.py [--batch 64] [--rounds 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from service.backends.registry import create_backend
from service.synthesis import AcousticJob, ChunkSchedule, SynthesisParams, Synthesizer
from service.tools.bench_load import SENTENCES
from service.voices import Voice, list_voices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="sentences per acoustic call")
    parser.add_argument("--rounds", type=int, default=20, help="timed calls")
    args = parser.parse_args()
    info = list_voices(None)[0]
    voice = Voice(info)
    synth = Synthesizer(voice, create_backend("torch", voice, "cpu"), ChunkSchedule())
    sentences = []
    while len(sentences) < args.batch:
        for text in SENTENCES:
            sentences += voice.frontend.sentences(text, words=False)
    sentences = sentences[: args.batch]
    params = SynthesisParams(length_scale=info.length_scale)

    def jobs() -> list[AcousticJob]:
        return [AcousticJob(s, None, params, np.random.default_rng(i)) for i, s in enumerate(sentences)]

    encode, outputs = synth._encode, {}

    def replay(ids, lengths, dp_noise, sid, scales):  # type: ignore[no-untyped-def]
        if ids.shape not in outputs:
            outputs[ids.shape] = encode(ids, lengths, dp_noise, sid, scales)
        return outputs[ids.shape]

    synth._encode = replay  # type: ignore[method-assign]
    synth.acoustic_batch(jobs())  # the one real encode
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        synth.acoustic_batch(jobs())
    seconds = (time.perf_counter() - t0) / args.rounds
    ids = np.mean([len(s.phoneme_ids) for s in sentences])
    print(f"acoustic_batch host part, {args.batch} sentences ({ids:.0f} phoneme ids on average): "
          f"{seconds * 1000:.2f} ms per call, {seconds / args.batch * 1e6:.0f} us per sentence")


if __name__ == "__main__":
    main()
