"""`cadenza` command line: say, voices, bench, serve, client, compare, precision."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.engine.config import BatchConfig


def _add_voice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--voice", default=None, help="voice name or path to a Piper .onnx (default: built-in)")
    p.add_argument("--voices", dest="voices_dir", default=None, help="directory of extra Piper voices")
    p.add_argument("--backend", default="auto", help="torch | onnxruntime | tensorrt (default: auto)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for inference")


def _cmd_say(args: argparse.Namespace) -> int:
    """In-process synthesis through the same engine the server runs (no gRPC)."""
    from pathlib import Path

    import numpy as np

    from service.audio.encoding import AudioEncoding
    from service.audio.wav import write_wav
    from service.engine.api import AudioOut, SessionConfig
    from service.engine.config import EngineConfig
    from service.engine.local import LocalEngine
    from service.text.frontend_pool import FrontendPoolConfig
    from service.voices import find_voice

    voices_dir = Path(args.voices_dir) if args.voices_dir else None
    info = find_voice(args.voice, voices_dir)
    if args.voice and Path(args.voice).suffix == ".onnx":  # a voice file: serve its folder
        voices_dir = Path(args.voice).resolve().parent
    config = EngineConfig(
        voice=info.name, voices_dir=voices_dir, backend=args.backend, device=args.device, threads=args.threads,
        cache_bytes=0, frontend=FrontendPoolConfig(workers=0),  # one text: no frontend processes needed
    )
    session = SessionConfig(
        speaker=args.speaker, seed=args.seed, noise_scale=args.noise_scale, noise_w=args.noise_w,
        speaking_rate=info.length_scale / args.length_scale if args.length_scale else 1.0,
        encoding=AudioEncoding.FLOAT32, word_timings=True,
    )
    with LocalEngine(config) as local:
        start = time.perf_counter()
        pieces, words, ttfa = [], [], None
        for event in local.stream(args.text, session):
            if not isinstance(event, AudioOut):
                continue
            if ttfa is None:
                ttfa = time.perf_counter() - start
            pieces.append(np.frombuffer(event.audio, dtype="<f4"))
            words.extend(event.words)
        elapsed = time.perf_counter() - start
        backend, device = local.engine.backend_name, local.engine.device
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    rate = info.sample_rate
    write_wav(args.output, audio, rate)
    seconds = len(audio) / rate
    print(f"wrote {args.output}: {seconds:.2f} s of audio at {rate} Hz "
          f"({backend} on {device}, {elapsed:.3f} s compute, RTF {elapsed / max(seconds, 1e-9):.3f})")
    if args.stream and ttfa is not None:
        print(f"time to first audio: {ttfa * 1000:.1f} ms")
    if args.words:
        for w in words:
            print(f"  {w.start / rate:7.3f} {w.end / rate:7.3f}  {w.word}")
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

    return run_cpu_bench(Path(args.corpus), args.threads, args.repeats, args.backend, args.settle_ms / 1000,
                         args.whole, args.stat)


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    from pathlib import Path

    from service.api.server import ServerConfig, serve
    from service.engine.config import EngineConfig, Limits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        host=args.host, port=args.port, drain_grace_s=args.drain_grace,
        engine=EngineConfig(
            voice=args.voice, voices_dir=Path(args.voices_dir) if args.voices_dir else None,
            backend=args.backend, device=args.device, threads=args.threads,
            batch=_batch_config(args),
            cache_bytes=args.cache_mb << 20,
        ),
        limits=Limits(
            max_sessions=args.max_sessions, max_text_chars=args.max_text_chars,
            max_message_bytes=args.max_message_bytes, idle_timeout_s=args.idle_timeout,
            admission_wait_s=args.admission_wait, capacity_streams=args.capacity,
        ),
    )

    def ready(server: object) -> None:
        print(f"cadenza: serving on {args.host}:{getattr(server, 'port', args.port)}", flush=True)

    asyncio.run(serve(config, on_ready=ready))
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    from collections.abc import Iterator

    import grpc

    from service.api.client import connect, stream
    from service.api.gen.cadenza.v1 import tts_pb2 as pb
    from service.audio.encoding import AudioEncoding
    from service.audio.wav import wav_header

    encoding = AudioEncoding(args.encoding)
    config = pb.SessionConfig(
        voice=args.voice or "", speaker=args.speaker or "", encoding=pb.AudioEncoding.Value(encoding.name),
        sample_rate_hz=args.rate or 0, speaking_rate=args.speaking_rate, word_timings=args.words,
    )
    if args.seed is not None:
        config.seed = args.seed

    if args.stdin:
        pieces: list[str] | Iterator[str] = iter(sys.stdin.readline, "")  # each line as soon as it is typed
    elif args.text:
        pieces = [args.text]
    else:
        print("cadenza: error: give the text or --stdin", file=sys.stderr)
        return 2
    channel, stub = connect(args.addr)
    try:
        result = stream(stub, config, pieces, flush_each=args.stdin)
    except grpc.RpcError as exc:
        print(f"cadenza: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    rate = result.sample_rate
    n = len(result.audio) // encoding.bytes_per_sample
    with open(args.output, "wb") as f:
        f.write(wav_header(rate, encoding, n) + result.audio)
    for chunk, at in zip(result.chunks, result.arrivals_s, strict=True):
        note = ", fallback" if chunk.fallback else ""
        print(f"  chunk {chunk.seq:3d} at {at * 1000:8.1f} ms: {chunk.duration_seconds * 1000:7.1f} ms of audio "
              f"(utterance {chunk.utterance}, {pb.Precision.Name(chunk.precision)}{note})")
    for w in result.words:
        print(f"  {w.start_sample / rate:7.3f} {w.end_sample / rate:7.3f}  {w.word}")
    ttfa = f"{result.ttfa_s * 1000:.1f} ms" if result.ttfa_s is not None else "n/a"
    print(f"wrote {args.output}: {n / max(rate, 1):.2f} s at {rate} Hz {encoding.value}; time to first audio: {ttfa}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.precision_tools import run_compare

    return run_compare(args.precision, args.voice, args.voices_dir, args.device, Path(args.out), args.limit)


def _cmd_sensitivity(args: argparse.Namespace) -> int:
    from service.precision_tools import run_sensitivity

    return run_sensitivity(args.voice, args.voices_dir, args.device, args.limit)


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.bench_gpu import run_gpu_bench

    batches = [int(b) for b in args.batches.split(",")]
    return run_gpu_bench(args.device, batches, args.chunk_frames, args.iters, Path(args.json) if args.json else None)


def _cmd_bench_streams(args: argparse.Namespace) -> int:
    from service.bench_streams import run_streams_bench

    counts = [int(n) for n in args.streams.split(",")]
    overrides = {"growth": args.growth, "first_frames": args.first_frames}
    schedule = {k: v for k, v in overrides.items() if v is not None}
    return run_streams_bench(args.device, args.backend, counts, args.precisions.split(","), _batch_config(args),
                             schedule)


def _cmd_bench_load(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.bench_load import LoadConfig, run_bench_load

    config = LoadConfig(
        target=args.target, sessions=args.sessions, arrival=args.arrival, rate=args.rate, duration_s=args.duration,
        pace=args.pace, tokens_per_s=args.tokens_per_s, precision=args.precision, seed=args.seed,
        connect_timeout_s=args.connect_timeout,
    )
    try:
        return run_bench_load(config, args.sweep, Path(args.json) if args.json else None,
                              Path(args.png) if args.png else None)
    except ConnectionError as exc:
        print(f"cadenza: error: {exc}", file=sys.stderr)
        return 1


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    from service.engine.config import BatchConfig

    d = BatchConfig()
    p.add_argument("--decoder", choices=("auto", "slots", "staged"), default=d.decoder,
                   help="slots: batched steps with per-session device state (torch); staged: one utterance at a "
                        "time (ONNX Runtime CPU); auto: slots where the backend has them (default: %(default)s)")
    p.add_argument("--step-frames", type=int, default=d.step_frames,
                   help="latent frames each session advances per decoder step (default: %(default)s)")
    p.add_argument("--max-step-rows", type=int, default=d.max_step_rows,
                   help="sessions one decoder step advances at most (default: %(default)s)")
    p.add_argument("--slots", type=int, default=d.slots,
                   help="utterances decoding at once per voice and precision (default: %(default)s)")
    p.add_argument("--max-ahead", type=float, default=d.max_ahead_s,
                   help="seconds of unread audio after which a session is not stepped (default: %(default)s)")


def _batch_config(args: argparse.Namespace) -> BatchConfig:
    from service.engine.config import BatchConfig

    return BatchConfig(decoder=args.decoder, step_frames=args.step_frames, max_step_rows=args.max_step_rows,
                       slots=args.slots, max_ahead_s=args.max_ahead)


def build_parser() -> argparse.ArgumentParser:
    from service.engine.config import Limits

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
    compare = sub.add_parser("compare", help="FP16 vs FP32 on a fixed corpus: PSNR, JSON report, plot")
    compare.add_argument("--precision", default="fp16", choices=["fp16"])
    compare.add_argument("--device", default="cpu")
    compare.add_argument("--voice", default=None)
    compare.add_argument("--voices", dest="voices_dir", default=None)
    compare.add_argument("--out", default="compare-out", help="directory for compare.json and compare.png")
    compare.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    compare.set_defaults(func=_cmd_compare)

    precision = sub.add_parser("precision", help="precision tools")
    psub = precision.add_subparsers(dest="precision_command", required=True)
    sens = psub.add_parser("sensitivity", help="PSNR cost of running each candidate module in FP16 alone")
    sens.add_argument("--device", default="cpu")
    sens.add_argument("--voice", default=None)
    sens.add_argument("--voices", dest="voices_dir", default=None)
    sens.add_argument("--limit", type=int, default=4, help="sentences to use")
    sens.set_defaults(func=_cmd_sensitivity)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bcpu = bsub.add_parser("cpu", help="Cadenza vs piper-tts on this CPU: TTFA and RTF ratios")
    bcpu.add_argument("--corpus", default="bench/corpus_cpu.txt")
    bcpu.add_argument("--threads", type=int, default=2)
    bcpu.add_argument("--repeats", type=int, default=3)
    bcpu.add_argument("--settle-ms", type=float, default=100.0,
                      help="idle pause before every timed run, so no run inherits another's spinning threads")
    bcpu.add_argument("--whole", action="store_true",
                      help="also time Cadenza without streaming (whole utterances): the cost of streaming")
    bcpu.add_argument("--stat", choices=("median", "min"), default="median",
                      help="summarise each text's repeats by their median or their fastest run")
    bcpu.add_argument("--backend", default="onnxruntime")
    bcpu.set_defaults(func=_cmd_bench_cpu)
    bgpu = bsub.add_parser("gpu", help="FP16 vs FP32 on a CUDA GPU: throughput by batch, memory, TTFA")
    bgpu.add_argument("--device", default="cuda")
    bgpu.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    bgpu.add_argument("--chunk-frames", type=int, default=64, help="latent frames per chunk (plus context)")
    bgpu.add_argument("--iters", type=int, default=20)
    bgpu.add_argument("--json", default=None, help="also write the figures to this JSON file")
    bgpu.set_defaults(func=_cmd_bench_gpu)
    bstr = bsub.add_parser("streams", help="N concurrent sessions through the engine: TTFA P50/P99, underruns")
    bstr.add_argument("--device", default="auto")
    bstr.add_argument("--backend", default="auto")
    bstr.add_argument("--streams", default="1,4", help="comma-separated session counts")
    bstr.add_argument("--precisions", default="fp32", help="comma-separated: auto, fp16, fp32")
    bstr.add_argument("--growth", type=float, default=None, help="chunk growth factor (default: the engine's)")
    bstr.add_argument("--first-frames", type=int, default=None,
                      help="first chunk in latent frames (default: the engine's)")
    _add_batch_args(bstr)
    bstr.set_defaults(func=_cmd_bench_streams)
    bload = bsub.add_parser(
        "load", help="N sessions against a RUNNING server over gRPC: TTFA P50/P99, underruns, pass rate",
        description="Drive a running `cadenza serve` over the native streaming API. A session passes when its "
                    "worst underrun (audio played from its first chunk) is at most 100 ms and it ended OK. "
                    "Last line: pass_rate= ttfa_p50_ms= ttfa_p99_ms= sessions= rtfx= (sessions: how many ran).",
    )
    bload.add_argument("--target", default="localhost:50051", help="server host:port (default: %(default)s)")
    bload.add_argument("--sessions", type=int, default=8,
                       help="the load level N. burst: sessions started at once; poisson: the target number of "
                            "sessions in progress at once (with --rate: the most that arrive); --sweep: the "
                            "largest N tried (default: %(default)s)")
    bload.add_argument("--arrival", choices=("burst", "poisson"), default="burst",
                       help="burst: all sessions start together; poisson: random arrivals at N / (mean session "
                            "audio seconds) per second, so about N are in progress at once (default: %(default)s)")
    bload.add_argument("--rate", type=float, default=None,
                       help="poisson: sessions arriving per second, overriding the rate derived from N; N then "
                            "caps the arrivals (default: derived)")
    bload.add_argument("--duration", type=float, default=None,
                       help="poisson: stop arriving after this many seconds (default: 30, or no limit with "
                            "--rate)")
    bload.add_argument("--pace", choices=("sentence", "llm"), default="sentence",
                       help="sentence: each sentence pushed whole, TTFA from the first text; llm: word-sized "
                            "deltas at --tokens-per-s, TTFA from the delta that completes the first sentence "
                            "(clamped at 0; the JSON keeps ttfa_from_first_text_ms too) (default: %(default)s)")
    bload.add_argument("--tokens-per-s", type=float, default=30.0,
                       help="llm pacing: text tokens per second (default: %(default)s)")
    bload.add_argument("--sweep", action="store_true",
                       help="find the largest N <= --sessions (poisson: target concurrency) with pass_rate >= "
                            "0.99 and TTFA p99 <= 150 ms (doubling, then bisection; one line per probe)")
    bload.add_argument("--precision", choices=("auto", "fp16", "fp32"), default="auto",
                       help="precision each session asks for (default: %(default)s)")
    bload.add_argument("--json", default=None, help="write per-session records and the summary here (default: none)")
    bload.add_argument("--png", default=None, help="write the TTFA CDF plot here (default: none)")
    bload.add_argument("--seed", type=int, default=0,
                       help="picks each session's texts and the poisson arrivals (default: %(default)s)")
    bload.add_argument("--connect-timeout", type=float, default=30.0,
                       help="seconds to wait for the server to be reachable and SERVING (default: %(default)s)")
    bload.set_defaults(func=_cmd_bench_load)
    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--host", default="[::]")
    serve.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    _add_voice_args(serve)
    serve.set_defaults(device="auto")
    _add_batch_args(serve)
    serve.add_argument("--cache-mb", type=int, default=64, help="result cache size (seeded requests)")
    limits = Limits()
    serve.add_argument("--max-sessions", type=int, default=limits.max_sessions,
                       help="open sessions; one more gets RESOURCE_EXHAUSTED (default: %(default)s)")
    serve.add_argument("--max-text-chars", type=int, default=limits.max_text_chars,
                       help="characters per session (default: %(default)s)")
    serve.add_argument("--max-message-bytes", type=int, default=limits.max_message_bytes,
                       help="largest gRPC message either way (default: %(default)s)")
    serve.add_argument("--idle-timeout", type=float, default=limits.idle_timeout_s,
                       help="seconds without a client message (default: %(default)s)")
    serve.add_argument("--admission-wait", type=float, default=limits.admission_wait_s,
                       help="at the estimated capacity, seconds a new session waits before RESOURCE_EXHAUSTED; "
                            "0 turns admission control off (default: %(default)s)")
    serve.add_argument("--capacity", type=float, default=limits.capacity_streams,
                       help="real-time streams to admit, instead of the estimate measured at start-up")
    serve.add_argument("--drain-grace", type=float, default=30.0, help="seconds open sessions get after SIGTERM")
    serve.set_defaults(func=_cmd_serve)

    client = sub.add_parser("client", help="stream text to a server, write a WAV, print TTFA and chunk timings")
    client.add_argument("text", nargs="?", default=None)
    client.add_argument("-o", "--output", default="out.wav")
    client.add_argument("--addr", default="localhost:50051")
    client.add_argument("--stdin", action="store_true", help="stream stdin line by line (each line flushed)")
    client.add_argument("--encoding", default="linear16", choices=["linear16", "mulaw", "alaw", "float32"])
    client.add_argument("--rate", type=int, default=None, help="output sample rate (Hz)")
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--voice", default=None)
    client.add_argument("--speaker", default=None)
    client.add_argument("--speaking-rate", type=float, default=1.0)
    client.add_argument("--words", action="store_true", help="print word timings")
    client.set_defaults(func=_cmd_client)
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
