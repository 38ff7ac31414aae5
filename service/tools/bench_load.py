"""`cadenza bench load`: a load generator for a RUNNING server, over real gRPC.

`cadenza bench streams` feeds sessions straight into an in-process engine; here every session is a native
StreamingSynthesize stream over grpc.aio (one channel per --sessions-per-channel sessions), so the figures also
include gRPC, the server's event loop and the audio encoding. Each session plays its audio on a simulated
real-time clock that starts at its first chunk; it passes when its worst underrun is at most 100 ms and the
stream ended with status OK.

Load level N: burst starts N sessions at once. Poisson treats N as the target CONCURRENCY: sessions arrive at
N / MEAN_SESSION_S per second for --duration seconds (default 30), so by Little's law about N calls are in
progress once the first ones have played out (an explicit --rate wins instead, and N then caps the arrivals).
The summary reports the concurrency measured: open streams, and calls (open until their audio has played).

TTFA: with sentence pacing, first text sent -> first audio. With llm pacing the time from the first token is
mostly the time the LLM takes to write the first sentence, which the server cannot change, so the headline
`ttfa_ms` is measured from when the delta that completes the session's first sentence was sent (clamped at 0:
the server may start at a clause before the sentence ends); `ttfa_from_first_text_ms` keeps the figure from the
first token. The sweep's pass/fail uses the headline."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.telemetry.histogram import percentile
from service.telemetry.timeline import Timeline

UNDERRUN_LIMIT_S = 0.100  # a session passes when no chunk is later than this
SWEEP_PASS_RATE = 0.99  # --sweep: a probe passes at this pass rate ...
SESSION_TIMEOUT_S = 300.0  # per stream: a hung server fails the session instead of the run
CHARS_PER_AUDIO_S = 20.2  # measured: the 16 SENTENCES via `cadenza say` (built-in voice) = 1398 chars, 69.3 s
POISSON_DURATION_S = 30.0  # poisson at a target concurrency: how long sessions keep arriving by default
NATIVE_SERVICE = "cadenza.v1.TextToSpeech"
PRECISIONS = {"auto": pb.AUTO, "fp16": pb.FP16, "fp32": pb.FP32, "int8": pb.INT8}

# Call-center / assistant turns. Some are long with no early comma, so the server cannot start them at a
# clause and the whole first sentence has to be encoded before its first audio.
SENTENCES = (
    "Thank you for calling, how can I help you today?",
    "I can see that your last payment was received on the fourteenth of March and your account is up to date.",
    "Let me pull up your account details.",
    "Your replacement card has been ordered and should arrive at the address we have on file within five to "
    "seven business days.",
    "Is there anything else I can help you with?",
    "I understand that waiting on hold is frustrating and I appreciate your patience while I look into this.",
    "The technician will arrive between eight in the morning and noon on Thursday.",
    "To reset your password please open the settings page and choose the option that says forgot password at "
    "the bottom of the screen.",
    "Sure, I have moved your appointment to Monday at ten thirty.",
    "Our records show that the package left the regional distribution center this morning and is now out for "
    "delivery in your area.",
    "Could you please confirm the last four digits of the card on the account?",
    "I have applied a credit of twenty five dollars to your next bill as an apology for the outage.",
    "The weather in Boston tomorrow will be mostly sunny with a high of seventy two degrees.",
    "Before we get started, may I have your full name and the phone number linked to the account?",
    "Your flight to Denver is on time and boards from gate twenty three at four fifteen in the afternoon.",
    "If you would like to speak with a specialist about upgrading your internet plan I can transfer you now.",
)


REACH_S = 5.0  # a running server takes a connection at once; nothing listening fails after this
SERVING_WAIT_S = 30.0  # then, a server that listens but is still warming up (LoadConfig.connect_timeout_s)


@dataclass(frozen=True)
class LoadConfig:
    """What to run; the CLI options one to one."""

    target: str = "localhost:50051"
    sessions: int = 8
    arrival: str = "burst"  # burst | poisson
    rate: float | None = None  # poisson arrivals per second; None: derived from the target concurrency
    duration_s: float | None = None  # poisson: stop arriving after this long (None: 30 s, or no limit with rate)
    pace: str = "sentence"  # sentence | llm
    tokens_per_s: float = 30.0  # llm pacing
    precision: str = "auto"
    voice: str = ""  # every session's voice; empty: the server's default
    seed: int = 0
    # None: the server is already running: it must take the connection within REACH_S, then say
    # SERVING within SERVING_WAIT_S. Seconds: wait that long in all for one that is still starting.
    connect_timeout_s: float | None = None
    procs: int = 1  # client processes the sessions are spread over (each its own event loop and connections)
    sessions_per_channel: int = 100  # one grpc.aio channel (its own TCP connection) per this many, round-robin
    sweep_from: int = 1  # --sweep: the first N tried (doubling from there, then bisection)
    sweep_p99_ms: float = 150.0  # --sweep: a probe also needs this p99 time to first audio (ms) or less


@dataclass(frozen=True)
class Connection:
    """How to reach a secured server: TLS files (`tls_ca` verifies the server; `tls_cert` +
    `tls_key` for mutual TLS) and an API key. Kept apart from `LoadConfig`, which goes into
    the JSON report: the key must not."""

    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    api_key: str | None = field(default=None, repr=False)

    def channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        from service.api.client import channel_credentials

        pairs = (("authorization", f"Bearer {self.api_key}"),)
        interceptors: list[Any] | None = [_UnaryMetadata(pairs), _StreamMetadata(pairs)] if self.api_key else None
        credentials = channel_credentials(self.tls_ca, self.tls_cert, self.tls_key)
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


class _SendMetadata:
    """Adds fixed metadata (the API key) to every call on a channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self._pairs = pairs

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self._pairs))
        return details._replace(metadata=metadata)


# grpc.aio files an interceptor under one call shape only: one class per shape.
class _UnaryMetadata(_SendMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(self._with(details), request)


class _StreamMetadata(_SendMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(self._with(details), request_iterator)


@dataclass
class SessionRecord:
    """One session as the client saw it. Times are client-side."""

    index: int
    start_s: float  # when its stream was opened, seconds after the run started
    end_s: float
    text: str
    ttfa_ms: float | None  # headline: first sentence complete (llm pacing) or first text sent -> first audio
    ttfa_from_first_text_ms: float | None = None  # first text sent -> first audio (same as ttfa_ms for sentences)
    first_audio_s: float | None = None  # when its first audio came, seconds after the run started
    server_ttfa_ms: float | None = None  # the server's own figure (summary): the rest is gRPC and the loops
    gaps_ms: list[float] = field(default_factory=list)  # between consecutive audio chunks
    worst_underrun_ms: float = 0.0
    audio_seconds: float = 0.0
    chunks: int = 0
    code: str = "OK"  # gRPC status code name
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.code == "OK" and self.ttfa_ms is not None and self.worst_underrun_ms <= UNDERRUN_LIMIT_S * 1000


@dataclass(frozen=True)
class Summary:
    sessions: int
    passed: int
    errors: int
    pass_rate: float
    ttfa_p50_ms: float  # nan when no session got audio
    ttfa_p99_ms: float
    server_ttfa_p50_ms: float  # as the server measured it: the difference is gRPC, the loops and encoding
    worst_underrun_ms: float
    audio_seconds: float
    wall_s: float
    rtfx: float  # audio seconds delivered per wall second
    client_loop_lag_max_ms: float  # this process's own event loop: large values mean the client was the limit
    ttfa_from_first_text_p50_ms: float = math.nan  # equals ttfa_p50_ms with sentence pacing
    target_concurrency: float = math.nan  # burst: N; poisson: N, or with --rate: rate x MEAN_SESSION_S
    arrival_rate_per_s: float = math.nan  # poisson only
    open_mean: float = math.nan  # gRPC streams open at once, time-averaged from first to last arrival
    open_peak: int = 0
    calls_mean: float = math.nan  # sessions open or still playing their audio (a caller still listening)
    calls_peak: int = 0


# ---- pure parts ---------------------------------------------------------------------------------------------


def worst_underrun(arrivals: Sequence[float], durations: Sequence[float]) -> float:
    """Seconds by which the latest chunk missed its slot on a clock that starts at the first chunk.

    Chunk i is due when the audio before it would have finished playing: arrivals[0] + sum(durations[:i]).
    This maximum equals the total silence a player that waits for late chunks would have inserted. 0 if no
    chunk was late."""
    worst, due = 0.0, arrivals[0] if arrivals else 0.0
    for at, duration in zip(arrivals, durations, strict=True):
        worst = max(worst, at - due)
        due += duration
    return worst


def concurrency(intervals: Sequence[tuple[float, float]], window_s: float) -> tuple[float, int]:
    """(time-averaged count over [0, window_s], peak count) of (start, end) intervals.

    An interval that ends when another starts does not overlap it. With window_s <= 0 the mean is nan."""
    inside = sum(max(0.0, min(end, window_s) - max(start, 0.0)) for start, end in intervals)
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return (inside / window_s if window_s > 0 else math.nan), peak


def call_interval(r: SessionRecord) -> tuple[float, float]:
    """A call lasts until its stream ended or its audio, played from the first chunk, did: whichever is later."""
    played = r.first_audio_s + r.audio_seconds if r.first_audio_s is not None else r.end_s
    return r.start_s, max(r.end_s, played)


def summarise(records: Sequence[SessionRecord], wall_s: float, loop_lag_s: float = 0.0,
              target_concurrency: float = math.nan, arrival_rate: float = math.nan,
              window_s: float | None = None) -> Summary:
    """Figures over one run; concurrency is averaged over [0, window_s] (default: the whole run)."""
    ttfa = [r.ttfa_ms for r in records if r.ttfa_ms is not None]
    audio = sum(r.audio_seconds for r in records)
    passed = sum(r.passed for r in records)
    window = wall_s if window_s is None else window_s
    open_mean, open_peak = concurrency([(r.start_s, r.end_s) for r in records], window)
    calls_mean, calls_peak = concurrency([call_interval(r) for r in records], window)
    return Summary(
        sessions=len(records), passed=passed, errors=sum(r.code != "OK" for r in records),
        pass_rate=passed / len(records) if records else 0.0,
        ttfa_p50_ms=percentile(ttfa, 50), ttfa_p99_ms=percentile(ttfa, 99),
        server_ttfa_p50_ms=percentile([r.server_ttfa_ms for r in records if r.server_ttfa_ms is not None], 50),
        worst_underrun_ms=max((r.worst_underrun_ms for r in records), default=0.0),
        audio_seconds=audio, wall_s=wall_s, rtfx=audio / wall_s if wall_s > 0 else 0.0,
        client_loop_lag_max_ms=loop_lag_s * 1000,
        ttfa_from_first_text_p50_ms=percentile(
            [r.ttfa_from_first_text_ms for r in records if r.ttfa_from_first_text_ms is not None], 50),
        target_concurrency=target_concurrency, arrival_rate_per_s=arrival_rate,
        open_mean=open_mean, open_peak=open_peak, calls_mean=calls_mean, calls_peak=calls_peak,
    )


def summary_line(s: Summary) -> str:
    """The machine-readable last line of the command."""
    return (f"pass_rate={s.pass_rate:.3f} ttfa_p50_ms={s.ttfa_p50_ms:.1f} ttfa_p99_ms={s.ttfa_p99_ms:.1f} "
            f"sessions={s.sessions} rtfx={s.rtfx:.2f}")


def sweep_passes(s: Summary, p99_ms: float) -> bool:
    """NaN p99 (no audio at all) fails, since the comparison is False."""
    return s.pass_rate >= SWEEP_PASS_RATE and s.ttfa_p99_ms <= p99_ms


def next_probe(results: Mapping[int, bool], upper: int, start: int = 1) -> int | None:
    """The next session count to try, given {N: passed} so far; None when the search is done.

    Doubling from `start` until a probe fails or `upper` is reached, then bisection between the largest N
    that passed and the smallest that failed (0 if none passed). Each probe is a full load run, so this keeps
    their number to about 2 * log2(answer); a `start` near the answer (a figure measured before) saves the
    small probes."""
    lo = max((n for n, ok in results.items() if ok), default=0)
    hi = min((n for n, ok in results.items() if not ok), default=None)
    if hi is None:
        return None if lo >= upper else min(upper, 2 * lo if results else max(1, start))
    return None if hi - lo <= 1 else (lo + hi) // 2


def best_probe(results: Mapping[int, bool]) -> int:
    """The largest N that passed (0 if none)."""
    return max((n for n, ok in results.items() if ok), default=0)


def mean_session_chars() -> float:
    """Expected characters of a pick_texts() session: 2 or 3 distinct sentences (mean 2.5) joined by spaces."""
    return 2.5 * statistics.fmean(len(s) for s in SENTENCES) + 1.5


MEAN_SESSION_S = mean_session_chars() / CHARS_PER_AUDIO_S  # expected audio seconds of one session (~10 s)


def poisson_schedule(n: int, rate: float | None, duration_s: float | None) -> tuple[float, float | None, int | None]:
    """(arrivals per second, arrival window, arrival cap) for a poisson run at load level n.

    No rate: n is the target concurrency, so arrivals come at n / MEAN_SESSION_S (Little's law: rate x mean
    session length = sessions in progress) for duration_s (default POISSON_DURATION_S), with no cap on their
    number. An explicit rate wins, and n caps the arrivals (as does duration_s if given)."""
    if rate is not None:
        return rate, duration_s, n
    return n / MEAN_SESSION_S, POISSON_DURATION_S if duration_s is None else duration_s, None


def arrival_times(arrival: str, n: int | None, rate: float, duration_s: float | None,
                  rng: random.Random) -> list[float]:
    """Seconds after the start at which each session opens its stream.

    burst: all n at once. poisson: exponential gaps at `rate` per second, the first at 0, until n sessions
    have arrived (None: no cap) or `duration_s` has passed, whichever comes first; one of them must be set."""
    if arrival == "burst":
        return [0.0] * (n or 0)
    if arrival != "poisson":
        raise ValueError(f"unknown arrival {arrival!r}; use burst or poisson")
    if n is None and duration_s is None:
        raise ValueError("poisson arrivals need a count or a duration")
    times: list[float] = []
    t = 0.0
    while (n is None or len(times) < n) and (duration_s is None or t < duration_s):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def pick_texts(rng: random.Random, n: int) -> list[list[str]]:
    """2-3 different sentences per session, the same for the same seed."""
    return [rng.sample(SENTENCES, rng.choice((2, 3))) for _ in range(n)]


def text_deltas(sentences: Sequence[str], pace: str, tokens_per_s: float) -> list[tuple[float, str]]:
    """(seconds after the first text, delta) pairs.

    sentence: each sentence whole, one after the other (a gateway that forwards finished sentences).
    llm: word-sized tokens (each with its leading space, as LLM tokens come) at `tokens_per_s`."""
    text = " ".join(sentences)
    if pace == "sentence":
        return [(0.0, s if i == 0 else " " + s) for i, s in enumerate(sentences)]
    if pace == "llm":
        return [(k / tokens_per_s, tok) for k, tok in enumerate(re.findall(r"\s*\S+", text))]
    raise ValueError(f"unknown pace {pace!r}; use sentence or llm")


def first_sentence_delta(deltas: Sequence[tuple[float, str]], first_sentence: str) -> int:
    """Index of the delta that completes `first_sentence` (the deltas spell the session's text from its start):
    the headline TTFA is measured from when it was sent."""
    written = 0
    for k, (_, piece) in enumerate(deltas):
        written += len(piece)
        if written >= len(first_sentence):
            return k
    return len(deltas) - 1


# ---- one run over gRPC --------------------------------------------------------------------------------------


async def _requests(config: pb.SessionConfig, deltas: Sequence[tuple[float, str]], marks: dict[int, float]
                    ) -> AsyncIterator[pb.StreamingSynthesizeRequest]:
    """Config, the text deltas on their schedule, end of input. `marks[k]` becomes the time delta k left, for
    the delta indices already in `marks` (only those: one clock read per marked delta)."""
    yield pb.StreamingSynthesizeRequest(config=config)
    base = time.perf_counter()
    for k, (offset, piece) in enumerate(deltas):
        delay = base + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if k in marks:
            marks[k] = time.perf_counter()
        yield pb.StreamingSynthesizeRequest(text=piece)
    yield pb.StreamingSynthesizeRequest(end_input=True)


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else seconds * 1000


async def _session(stub: pb_grpc.TextToSpeechStub, cfg: LoadConfig, index: int, sentences: list[str],
                   start_at: float, t0: float, timeline: Timeline) -> SessionRecord:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    opened = time.perf_counter()
    config = pb.SessionConfig(voice=cfg.voice, precision=PRECISIONS[cfg.precision], request_id=f"bench-load-{index}")
    deltas = text_deltas(sentences, cfg.pace, cfg.tokens_per_s)
    ref = first_sentence_delta(deltas, sentences[0])
    marks = dict.fromkeys((0, ref), math.nan)
    arrivals: list[float] = []
    durations: list[float] = []
    code, message = "OK", ""
    server_ttfa: float | None = None
    call = stub.StreamingSynthesize(_requests(config, deltas, marks), timeout=SESSION_TIMEOUT_S)
    try:
        async for msg in call:
            kind = msg.WhichOneof("response")
            if kind == "audio":
                if msg.audio.audio:
                    arrivals.append(time.perf_counter())
                    durations.append(msg.audio.duration_seconds)
            elif kind == "summary":
                server_ttfa = msg.summary.ttfa_seconds * 1000 if msg.summary.ttfa_seconds > 0 else None
    except grpc.aio.AioRpcError as exc:
        code, message = exc.code().name, exc.details() or ""
    ended = time.perf_counter()
    first = arrivals[0] if arrivals else math.nan
    if timeline.on and arrivals and not math.isnan(marks[0]):
        # perf_counter and monotonic are one clock on Linux; converted anyway, for the server's side
        shift = time.monotonic() - time.perf_counter()
        timeline.add("client", rid=config.request_id, first_text=marks[0] + shift,
                     first_sentence=marks[ref] + shift, first_audio=first + shift)
    from_sentence = _ms(first - marks[ref])  # None when there was no audio or the sentence was never sent
    return SessionRecord(
        index=index, start_s=opened - t0, end_s=ended - t0, text=" ".join(sentences),
        ttfa_ms=None if from_sentence is None else max(0.0, from_sentence),
        ttfa_from_first_text_ms=_ms(first - marks[0]),
        first_audio_s=first - t0 if arrivals else None, server_ttfa_ms=server_ttfa,
        gaps_ms=[(b - a) * 1000 for a, b in itertools.pairwise(arrivals)],
        worst_underrun_ms=worst_underrun(arrivals, durations) * 1000,
        audio_seconds=sum(durations), chunks=len(arrivals), code=code, message=message,
    )


async def _watch_loop(stop: asyncio.Event, period_s: float = 0.01) -> float:
    """Worst lateness of this process's event loop: if the client itself was starved, its figures are too."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, time.perf_counter() - t - period_s)
    return worst


@dataclass(frozen=True)
class _Plan:
    """One run's sessions: when each starts (seconds after the run's start) and what it says."""

    starts: list[float]
    texts: list[list[str]]
    target: float
    rate: float
    window_s: float | None


def _plan(cfg: LoadConfig, n: int) -> _Plan:
    rng = random.Random(cfg.seed)
    if cfg.arrival == "poisson":
        rate, window, cap = poisson_schedule(n, cfg.rate, cfg.duration_s)
        starts = arrival_times("poisson", cap, rate, window, rng)
        target = float(n) if cfg.rate is None else rate * MEAN_SESSION_S  # offered load, by Little's law
        window_s = starts[-1] if len(starts) > 1 else None  # concurrency averaged from first to last arrival
    else:
        rate, target, window_s = math.nan, float(n), None
        starts = arrival_times("burst", n, 1.0, None, rng)
    return _Plan(list(starts), pick_texts(rng, len(starts)), target, rate, window_s)


async def _sessions(stubs: Sequence[pb_grpc.TextToSpeechStub], cfg: LoadConfig, plan: _Plan,
                    indices: Sequence[int], t0: float, timeline: Timeline) -> tuple[list[SessionRecord], float]:
    """Sessions `indices` of `plan`, taking the stubs in turn, from `t0` (perf_counter): their
    records and this process's worst event-loop lag meanwhile."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_loop(stop))
    records = await asyncio.gather(*(
        _session(stubs[k % len(stubs)], cfg, i, plan.texts[i], plan.starts[i], t0, timeline)
        for k, i in enumerate(indices)
    ))
    timeline.flush()
    stop.set()
    return list(records), await watcher


async def run_load(stubs: Sequence[pb_grpc.TextToSpeechStub], cfg: LoadConfig, n: int,
                   timeline: Timeline | None = None) -> tuple[list[SessionRecord], Summary]:
    """One load run at level `n` (see the module docstring) from this process; sessions take the
    stubs in turn. `timeline`: each session's first text sent and first audio received go there
    (one period)."""
    plan = _plan(cfg, n)
    t0 = time.perf_counter()
    records, lag = await _sessions(stubs, cfg, plan, range(len(plan.starts)), t0, timeline or Timeline())
    wall = time.perf_counter() - t0
    return records, summarise(records, wall, lag, plan.target, plan.rate, plan.window_s)


# ---- spread over client processes (--procs) -----------------------------------------------------------------


def _channels(connection: Connection, cfg: LoadConfig, sessions: int) -> list[grpc.aio.Channel]:
    # Separate connections: grpc shares one subchannel between channels with the same target and arguments.
    return [connection.channel(cfg.target, [("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, math.ceil(sessions / cfg.sessions_per_channel)))]


def _client_process(conn: Any, cfg: LoadConfig, connection: Connection, plan: _Plan, indices: list[int],
                    timeline_dir: Path | None) -> None:
    """A client process of `run_load_procs`: connects, says "ready", gets the run's start (monotonic
    seconds, one clock for the host's processes), runs its sessions and sends back their records."""

    async def main() -> tuple[list[SessionRecord], float]:
        channels = _channels(connection, cfg, len(indices))
        try:
            wait = SERVING_WAIT_S if cfg.connect_timeout_s is None else cfg.connect_timeout_s
            await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), wait) for c in channels))
            stubs = [pb_grpc.TextToSpeechStub(c) for c in channels]
            conn.send("ready")
            start = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            t0 = start - (time.monotonic() - time.perf_counter())
            return await _sessions(stubs, cfg, plan, indices, t0, Timeline(timeline_dir, "client"))
        finally:
            await asyncio.gather(*(c.close() for c in channels))

    try:
        conn.send(("done", *asyncio.run(main())))
    except BaseException as exc:  # the parent reports it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))


def _reply(conn: Any) -> Any:
    try:
        return conn.recv()
    except EOFError:
        return ("failed", "it exited without a word (killed, or out of memory?)")


async def run_load_procs(cfg: LoadConfig, n: int, connection: Connection,
                         timeline_dir: Path | None = None) -> tuple[list[SessionRecord], Summary]:
    """`run_load` with the sessions dealt round-robin over `cfg.procs` client processes that start
    together: one Python client's event loop and gRPC's work for hundreds of streams would
    otherwise be part of what is measured."""
    import multiprocessing

    plan = _plan(cfg, n)
    ctx = multiprocessing.get_context("spawn")
    procs = min(cfg.procs, len(plan.starts))
    pipes, workers = [], []
    for k in range(procs):
        ours, theirs = ctx.Pipe()
        worker = ctx.Process(target=_client_process, name=f"cadenza-load-{k}", daemon=True,
                             args=(theirs, cfg, connection, plan, list(range(k, len(plan.starts), procs)),
                                   timeline_dir))
        worker.start()
        theirs.close()
        pipes.append(ours)
        workers.append(worker)
    loop = asyncio.get_running_loop()
    try:
        for ours in pipes:  # each says "ready", or why it could not start
            first = await loop.run_in_executor(None, _reply, ours)
            if first != "ready":
                raise ConnectionError(f"a client process could not start: {first[1]}")
        start = time.monotonic() + 0.05
        for ours in pipes:
            ours.send(start)
        results = [await loop.run_in_executor(None, _reply, ours) for ours in pipes]
        wall = time.monotonic() - start  # the processes' exits are not part of the run
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.terminate()
    failed = [r[1] for r in results if r[0] != "done"]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    records = sorted((r for result in results for r in result[1]), key=lambda r: r.index)
    lag = max(result[2] for result in results)
    return records, summarise(records, wall, lag, plan.target, plan.rate, plan.window_s)


async def wait_until_serving(channel: grpc.aio.Channel, target: str, timeout_s: float | None) -> None:
    """Connected and the health service says SERVING (a server listens before its voice is warm).
    `timeout_s` None: the server must be listening already (see LoadConfig.connect_timeout_s), so
    a wrong address or a server not started fails in seconds, not after the whole start-up wait."""
    if timeout_s is None:
        try:
            await asyncio.wait_for(channel.channel_ready(), REACH_S)
        except TimeoutError:
            raise ConnectionError(f"no server at {target}: start one with `cadenza serve` (or give --connect-timeout "
                                  "SECONDS to wait for one that is starting)") from None
        timeout_s = SERVING_WAIT_S
    deadline = time.perf_counter() + timeout_s
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except TimeoutError:
        raise ConnectionError(f"cannot reach {target} within {timeout_s:g} s (is `cadenza serve` running there?)")\
            from None
    health = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            answer = await health.Check(health_pb2.HealthCheckRequest(service=NATIVE_SERVICE), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                return  # no health service: go ahead
            raise ConnectionError(f"{target}: health check failed: {exc.code().name}: {exc.details()}") from None
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return
        if time.perf_counter() > deadline:
            raise ConnectionError(f"{target} is not SERVING after {timeout_s:g} s "
                                  f"({health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)})")
        await asyncio.sleep(0.2)


# ---- reporting ----------------------------------------------------------------------------------------------


def _describe(records: Sequence[SessionRecord], s: Summary) -> str:
    errors: dict[str, int] = {}
    for r in records:
        if r.code != "OK":
            key = f"{r.code}: {r.message}"
            errors[key] = errors.get(key, 0) + 1
    arrival = "" if math.isnan(s.arrival_rate_per_s) else f", poisson {s.arrival_rate_per_s:.2f}/s"
    llm = s.ttfa_from_first_text_p50_ms != s.ttfa_p50_ms and not math.isnan(s.ttfa_from_first_text_p50_ms)
    from_text = f", from first text p50 {s.ttfa_from_first_text_p50_ms:.1f} ms" if llm else ""
    line = (f"{s.sessions} sessions at target concurrency {s.target_concurrency:g}{arrival} (measured: open streams "
            f"mean {s.open_mean:.1f} peak {s.open_peak}, calls until played out mean {s.calls_mean:.1f} peak "
            f"{s.calls_peak}): {s.passed} passed, {s.errors} errors, TTFA p50 {s.ttfa_p50_ms:.1f} ms p99 "
            f"{s.ttfa_p99_ms:.1f} ms (server-side p50 {s.server_ttfa_p50_ms:.1f} ms{from_text}), worst underrun "
            f"{s.worst_underrun_ms:.1f} ms, {s.audio_seconds:.1f} s of audio in {s.wall_s:.2f} s, "
            f"client loop lag max {s.client_loop_lag_max_ms:.1f} ms")
    return "\n".join([line, *(f"  {count} x {what}" for what, count in errors.items())])


def _jsonable(value: Any) -> Any:
    """NaN is not JSON: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _records_json(records: Sequence[SessionRecord]) -> list[dict[str, Any]]:
    return [{**asdict(r), "passed": r.passed} for r in records]


def plot_ttfa_cdf(path: Path, curves: Sequence[tuple[str, Sequence[float]]], p99_ms: float) -> bool:
    """TTFA CDF, one curve per run. False (and a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("cadenza: matplotlib is not installed; skipping the PNG (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for label, values in curves:
        ordered = sorted(values)
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)
    ax.axvline(p99_ms, color="grey", ls="--", lw=0.8, label=f"{p99_ms:g} ms (sweep p99 limit)")
    ax.set_xlabel("time to first audio (ms, client side, over gRPC)")
    ax.set_ylabel("fraction of sessions")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ttfas(records: Sequence[SessionRecord]) -> list[float]:
    return [r.ttfa_ms for r in records if r.ttfa_ms is not None]


def _arrival_text(cfg: LoadConfig) -> str:
    if cfg.arrival == "burst":
        return "burst"
    if cfg.rate is not None:
        return f"poisson at {cfg.rate:g}/s"
    return (f"poisson at N / {MEAN_SESSION_S:.1f} s mean session per second for "
            f"{POISSON_DURATION_S if cfg.duration_s is None else cfg.duration_s:g} s")


async def _main(cfg: LoadConfig, sweep: bool, json_path: Path | None, png_path: Path | None,
                connection: Connection, timeline: Timeline) -> int:
    channels = _channels(connection, cfg, cfg.sessions if cfg.procs == 1 else 1)
    try:
        return await _drive(channels, cfg, sweep, json_path, png_path, connection, timeline)
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def _drive(channels: Sequence[grpc.aio.Channel], cfg: LoadConfig, sweep: bool, json_path: Path | None,
                 png_path: Path | None, connection: Connection, timeline: Timeline) -> int:
    await wait_until_serving(channels[0], cfg.target, cfg.connect_timeout_s)
    stubs = [pb_grpc.TextToSpeechStub(c) for c in channels]

    async def run(n: int) -> tuple[list[SessionRecord], Summary]:
        if cfg.procs == 1:
            return await run_load(stubs, cfg, n, timeline)
        return await run_load_procs(cfg, n, connection, timeline.directory)
    info = await stubs[0].GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    pacing = (f"llm pacing at {cfg.tokens_per_s:g} tokens/s (TTFA from the first sentence's last token)"
              if cfg.pace == "llm" else "sentence pacing")
    print(f"target {cfg.target}: {info.backend} on {info.device}, voice {cfg.voice or info.default_voice}; "
          f"{_arrival_text(cfg)}, {pacing}, precision {cfg.precision}, "
          + (f"{len(channels)} channel(s)" if cfg.procs == 1 else f"{cfg.procs} client processes"), flush=True)
    report: dict[str, Any] = {"config": asdict(cfg)}
    if not sweep:
        records, summary = await run(cfg.sessions)
        print(_describe(records, summary))
        curves = [(f"{summary.sessions} sessions", _ttfas(records))]
    else:
        results: dict[int, bool] = {}
        runs: dict[int, tuple[list[SessionRecord], Summary]] = {}
        while (n := next_probe(results, cfg.sessions, cfg.sweep_from)) is not None:
            runs[n] = await run(n)
            results[n] = sweep_passes(runs[n][1], cfg.sweep_p99_ms)
            print(f"probe N={n}: {summary_line(runs[n][1])} -> {'pass' if results[n] else 'fail'}", flush=True)
        best = best_probe(results)
        level = "N (target concurrency)" if cfg.arrival == "poisson" else "N"
        print(f"sweep: largest {level} with pass_rate >= {SWEEP_PASS_RATE} and ttfa_p99 <= {cfg.sweep_p99_ms:g} ms: "
              f"{best or 'none'} (searched up to {cfg.sessions})")
        records, summary = runs[best] if best else runs[min(runs)]
        print(_describe(records, summary))
        report["sweep"] = {"best_n": best, "probes": [
            {"n": k, "passed": results[k], "summary": asdict(runs[k][1])} for k in sorted(runs)
        ]}
        curves = [(f"N={k}", _ttfas(runs[k][0])) for k in sorted(runs)]
    report["summary"] = asdict(summary)
    report["sessions"] = _records_json(records)
    if json_path is not None:
        json_path.write_text(json.dumps(_jsonable(report), indent=1), "utf-8")
        print(f"wrote {json_path}")
    if png_path is not None and plot_ttfa_cdf(png_path, [(k, v) for k, v in curves if v], cfg.sweep_p99_ms):
        print(f"wrote {png_path}")
    print(summary_line(summary))
    return 0


def run_bench_load(cfg: LoadConfig, sweep: bool = False, json_path: Path | None = None,
                   png_path: Path | None = None, connection: Connection | None = None,
                   timeline_dir: Path | None = None) -> int:
    """Validate, run (or sweep), report. Raises ConnectionError when the target cannot be used.
    `timeline_dir`: each run's sessions (first text sent, first audio received) as a client
    timeline there, next to a server's `--timeline` files (`cadenza timeline DIR`)."""
    if min(cfg.sessions, cfg.procs, cfg.sessions_per_channel, cfg.sweep_from) < 1:
        raise ValueError("--sessions, --procs, --sessions-per-channel and --sweep-from must be at least 1")
    if (cfg.rate is not None and cfg.rate <= 0) or cfg.tokens_per_s <= 0:
        raise ValueError("--rate and --tokens-per-s must be positive")
    if not cfg.sweep_p99_ms > 0:
        raise ValueError(f"--sweep-p99-ms must be positive milliseconds, not {cfg.sweep_p99_ms:g}")
    if cfg.duration_s is not None and cfg.duration_s <= 0:
        raise ValueError("--duration must be positive")
    if cfg.connect_timeout_s is not None and not cfg.connect_timeout_s > 0:
        raise ValueError("--connect-timeout must be positive")
    if (cfg.duration_s is not None or cfg.rate is not None) and cfg.arrival != "poisson":
        raise ValueError("--rate and --duration apply to --arrival poisson only")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg.precision!r}; use auto, fp16, fp32 or int8")
    if cfg.arrival not in ("burst", "poisson") or cfg.pace not in ("sentence", "llm"):
        raise ValueError("--arrival is burst or poisson, --pace is sentence or llm")
    if connection is not None and (connection.tls_cert is None) != (connection.tls_key is None):
        raise ValueError("a client certificate needs its key: give --tls-cert and --tls-key together")
    return asyncio.run(_main(cfg, sweep, json_path, png_path, connection or Connection(),
                             Timeline(timeline_dir, "client")))
