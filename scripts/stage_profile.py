"""The two calls a session's first audio waits for, in isolation, on the server's device setup:
the acoustic stage of a batch of first sentences (`Synthesizer.acoustic_batch`) and the first
decoder step of those sentences (slot start + one step launch + its result).

`serve --timeline` shows what these calls take under load; this shows what they take alone, split
into host time and device time, so the difference is what load adds (GIL waits, other threads).
For each batch size it prints wall time, the engine thread's CPU time, the device time of the
encoder graph (CUDA events) and the cProfile functions that took the most host time; with
`--kernels N` on CUDA, the N kernels of the acoustic stage that took the most device time, and its
device time split into the text encoder and the duration predictor.

    python scripts/stage_profile.py [--device cuda] [--precision fp16|fp32] [--batches 1,16,64] [--rounds 10]
                                    [--kernels 20]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import numpy as np

from service.backends.registry import create_backend
from service.engine.config import BatchConfig
from service.models.family import StepRows
from service.synthesis import AcousticJob, ChunkSchedule, SynthesisParams, Synthesizer, Utterance
from service.tools.bench_load import SENTENCES
from service.voices import Voice, list_voices


def _best(fn: Callable[[], object], rounds: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(best wall, its thread CPU) of `fn` over `rounds` calls, each one synchronized."""
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        sync()
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        sync()
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        if wall < best[0]:
            best = (wall, cpu)
    return best


def _top(fn: Callable[[], object], n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join("      " + ln for ln in lines[start : start + n + 1])


def _kernels(graphs: object, batch: int, length: int, top: int, rounds: int) -> None:
    """The acoustic stage run eagerly on a graph bucket's padded inputs (the kernels its graph
    replays): device time of the text encoder and of the duration predictor (CUDA events), and
    the kernels that took the most device time (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    rows, padded = graphs._bucket(batch, length)  # type: ignore[attr-defined]
    _, inputs, _ = graphs._get(rows, padded)  # type: ignore[attr-defined]
    model = graphs.model  # type: ignore[attr-defined]
    ids, lengths, noise, _ = inputs
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False):
        for _ in range(2):  # warm
            graphs._run(*inputs)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        split = np.zeros(2)
        for _ in range(rounds):
            events[0].record()
            x, _, _, x_mask = model.enc_p(ids, lengths)
            events[1].record()
            model.dp(x, x_mask, noise, g=None)
            events[2].record()
            torch.cuda.synchronize()
            split += [events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])]
        split /= rounds
        print(f"  acoustic rows={rows} phonemes={padded} eager on the device: text encoder {split[0]:.2f} ms, "
              f"duration predictor {split[1]:.2f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._run(*inputs)  # type: ignore[attr-defined]
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (what the numbers are for)")
    parser.add_argument("--precision", default=None, help="the decoder's (default: fp16 on cuda, fp32 on cpu)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="cProfile lines per call")
    parser.add_argument("--kernels", type=int, default=0, help="CUDA: the acoustic stage's top kernels")
    args = parser.parse_args()
    import torch

    info = list_voices(None)[0]
    voice = Voice(info)
    backend = create_backend("torch", voice, args.device)
    synth = Synthesizer(voice, backend, ChunkSchedule())
    batch_cfg = BatchConfig()
    cuda = args.device.startswith("cuda")
    args.precision = args.precision or ("fp16" if cuda else "fp32")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        backend.capture_encoder(batch_cfg.acoustic_max_batch)  # type: ignore[attr-defined]
        table = backend._encoder_graphs.device_ms  # type: ignore[attr-defined]
        lengths = sorted({n for _, n in table})
        print("encoder graph device ms, rows x phonemes: " + " ".join(f"{n:5d}" for n in lengths))
        for rows in sorted({r for r, _ in table}):
            print(f"  {rows:4d} " + " ".join(f"{table[(rows, n)]:5.2f}" for n in lengths), flush=True)
    sentences = []
    while len(sentences) < max(int(b) for b in args.batches.split(",")):
        for text in SENTENCES:
            sentences += voice.frontend.sentences(text, words=False)
    params = SynthesisParams()
    lag = backend.streaming_lag()  # type: ignore[attr-defined]
    first = synth.schedule.first_frames + lag
    decoder = backend.streaming_decoder(  # type: ignore[attr-defined]
        args.precision, batch_cfg.slots, max_rows=batch_cfg.max_step_rows, graphs=True,
        graph_frames=(batch_cfg.step_frames, first))
    decoder.capture_all()
    print(f"device={args.device} precision={args.precision} first step frames={first}", flush=True)

    for batch in (int(b) for b in args.batches.split(",")):
        group = sorted(sentences[:batch], key=lambda s: len(s.phoneme_ids))
        ids = np.mean([len(s.phoneme_ids) for s in group])

        def jobs(group=group) -> list[AcousticJob]:  # type: ignore[no-untyped-def]
            return [AcousticJob(s, None, params, np.random.default_rng(i)) for i, s in enumerate(group)]

        def acoustic(jobs=jobs) -> list[Utterance]:  # type: ignore[no-untyped-def]
            return synth.acoustic_batch(jobs())

        wall, cpu = _best(acoustic, args.rounds, sync)
        split = getattr(backend, "acoustic_split", None)
        if split is not None:
            print(f"acoustic batch={batch}: run as groups of {split([len(s.phoneme_ids) for s in group])}")
        enc_jobs = jobs()
        lengths = np.asarray([len(j.sentence.phoneme_ids) for j in enc_jobs], dtype=np.int64)
        pad = np.zeros((batch, int(lengths.max())), dtype=np.int64)
        for i, j in enumerate(enc_jobs):
            pad[i, : lengths[i]] = j.sentence.phoneme_ids
        noise = np.zeros((batch, 2, pad.shape[1]), dtype=np.float32)
        scales = np.full(batch, info.noise_scale, dtype=np.float32)

        def encode(pad=pad, lengths=lengths, noise=noise, scales=scales):  # type: ignore[no-untyped-def]
            return synth._encode(pad, lengths, noise, None, scales)

        enc_wall, enc_cpu = _best(encode, args.rounds, sync)
        device_ms = float("nan")
        if cuda:
            graphs = backend._encoder_graphs  # type: ignore[attr-defined]
            graph = graphs._get(*graphs._bucket(batch, pad.shape[1]))[0]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync()
            start.record()
            for _ in range(args.rounds):
                graph.replay()
            end.record()
            sync()
            device_ms = start.elapsed_time(end) / args.rounds
        if cuda and args.kernels:
            _kernels(graphs, batch, pad.shape[1], args.kernels, args.rounds)
        print(f"acoustic batch={batch} ids={ids:.0f}: call wall {wall * 1e3:.2f} ms cpu {cpu * 1e3:.2f} ms; "
              f"encode alone wall {enc_wall * 1e3:.2f} ms cpu {enc_cpu * 1e3:.2f} ms; "
              f"encoder graph on the device {device_ms:.2f} ms", flush=True)
        print(_top(acoustic, args.top), flush=True)

        utts = acoustic()

        def first_step(utts=utts) -> torch.Tensor:  # type: ignore[no-untyped-def]
            slots = list(range(len(utts)))
            for slot, u in zip(slots, utts, strict=True):
                decoder.start(slot, u.prior)
            audio = decoder.step(StepRows(slots, [0] * len(slots), first, None))
            return backend.guard_async(audio).result()  # type: ignore[attr-defined]

        def launch_only(utts=utts) -> torch.Tensor:  # type: ignore[no-untyped-def]
            slots = list(range(len(utts)))
            for slot, u in zip(slots, utts, strict=True):
                decoder.start(slot, u.prior)
            return decoder.step(StepRows(slots, [0] * len(slots), first, None))

        wall, cpu = _best(first_step, args.rounds, sync)
        lwall, lcpu = _best(launch_only, args.rounds, lambda: None)
        sync()
        print(f"first step batch={batch}: start+launch+result wall {wall * 1e3:.2f} ms cpu {cpu * 1e3:.2f} ms; "
              f"start+launch alone wall {lwall * 1e3:.2f} ms cpu {lcpu * 1e3:.2f} ms", flush=True)
        print(_top(first_step, args.top), flush=True)
        for slot in range(len(utts)):
            decoder.free(slot)


if __name__ == "__main__":
    main()
