"""`cadenza` command line: say, voices, bench, serve, client, compare, precision."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _add_voice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--voice", default=None, help="voice name or path to a Piper .onnx (default: built-in)")
    p.add_argument("--voices", dest="voices_dir", default=None, help="directory of extra Piper voices")
    p.add_argument("--backend", default="auto", help="torch | onnxruntime | tensorrt (default: auto)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for inference")


def _cmd_say(args: argparse.Namespace) -> int:
    from service.audio.wav import write_wav
    from service.synthesis import SynthesisParams, open_synthesizer

    syn = open_synthesizer(
        args.voice, voices_dir=args.voices_dir, backend=args.backend, device=args.device,
        threads=args.threads,
    )
    params = SynthesisParams(
        speaker=args.speaker, seed=args.seed, length_scale=args.length_scale,
        noise_scale=args.noise_scale, noise_w=args.noise_w,
    )
    start = time.perf_counter()
    pieces, words, ttfa = [], [], None
    for chunk in syn.stream(args.text, params):
        if ttfa is None:
            ttfa = time.perf_counter() - start
        pieces.append(chunk.samples)
        words.extend(chunk.words)
    elapsed = time.perf_counter() - start
    import numpy as np

    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    write_wav(args.output, audio, syn.sample_rate)
    seconds = len(audio) / syn.sample_rate
    print(f"wrote {args.output}: {seconds:.2f} s of audio at {syn.sample_rate} Hz "
          f"({syn.backend.name} on {syn.backend.device}, {elapsed:.3f} s compute, "
          f"RTF {elapsed / max(seconds, 1e-9):.3f})")
    if args.stream and ttfa is not None:
        print(f"time to first audio: {ttfa * 1000:.1f} ms")
    if args.words:
        for w in words:
            print(f"  {w.start / syn.sample_rate:7.3f} {w.end / syn.sample_rate:7.3f}  {w.word}")
    return 0


def _cmd_voices_list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.voices import list_voices

    for v in list_voices(Path(args.voices_dir) if args.voices_dir else None):
        print(f"{v.name}\t{v.language}\t{v.sample_rate} Hz\t{v.num_speakers} speaker(s)\t{v.onnx_path}")
    return 0


def _cmd_voices_check(args: argparse.Namespace) -> int:
    from service.voice_check import run_voice_check

    return run_voice_check(args.voice, args.voices_dir, args.backend, args.device, args.threads)


def _cmd_bench_cpu(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.bench import run_cpu_bench

    return run_cpu_bench(Path(args.corpus), args.threads, args.repeats, args.backend)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadenza", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesise text to a WAV file in-process")
    say.add_argument("text")
    say.add_argument("-o", "--output", default="out.wav")
    say.add_argument("--speaker", default=None, help="speaker id or name (multi-speaker voices)")
    say.add_argument("--seed", type=int, default=None)
    say.add_argument("--length-scale", type=float, default=None, help="> 1 speaks slower")
    say.add_argument("--noise-scale", type=float, default=None)
    say.add_argument("--noise-w", type=float, default=None)
    say.add_argument("--stream", action="store_true", help="print the time to first audio")
    say.add_argument("--words", action="store_true", help="print word timings")
    _add_voice_args(say)
    say.set_defaults(func=_cmd_say)

    voices = sub.add_parser("voices", help="list or check voices")
    vsub = voices.add_subparsers(dest="voices_command", required=True)
    vlist = vsub.add_parser("list", help="list available voices")
    vlist.add_argument("--voices", dest="voices_dir", default=None)
    vlist.set_defaults(func=_cmd_voices_list)
    vcheck = vsub.add_parser(
        "check", help="compare our model with the original ONNX voice (PSNR, noise off)"
    )
    _add_voice_args(vcheck)
    vcheck.set_defaults(func=_cmd_voices_check)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bcpu = bsub.add_parser("cpu", help="Cadenza vs piper-tts on this CPU: TTFA and RTF ratios")
    bcpu.add_argument("--corpus", default="bench/corpus_cpu.txt")
    bcpu.add_argument("--threads", type=int, default=2)
    bcpu.add_argument("--repeats", type=int, default=3)
    bcpu.add_argument("--backend", default="onnxruntime")
    bcpu.set_defaults(func=_cmd_bench_cpu)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (LookupError, ValueError) as exc:
        print(f"cadenza: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
