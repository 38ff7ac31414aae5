"""The engine thread: the only code that calls the backends.

Sessions hand it utterance texts; a frontend thread phonemises them (espeak) so that never
stalls decoding. The engine thread runs the acoustic stage for the next utterances of several
sessions in one padded, masked encoder call (each utterance keeps its own noise generator, so
batching changes results only by kernel rounding), then decodes chunks: on CUDA it batches
flow/vocoder windows of equal length from different sessions into one backend call (no padding);
on CPU each FP32 utterance goes through its own staged decoder, in turns of at most
`cpu_quantum_frames` while other sessions wait. Work is picked most urgent first: acoustic jobs
and first chunks of an utterance, then the chunk whose session is closest to running out of audio.
Results go back to each session's event loop with call_soon_threadsafe; nothing mutable is shared
with the loop."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service.engine.cache import CachedUtterance, ResultCache
from service.engine.config import BatchConfig
from service.staged_decoder import StagedDecoder
from service.synthesis import (
    AcousticJob,
    ChunkSchedule,
    ShadowSampler,
    SynthesisParams,
    Synthesizer,
    UtteranceDecoder,
    Window,
    finite,
    redo_chunk_fp32,
    utterance_rng,
)
from service.text.frontend import PhonemizedSentence

log = logging.getLogger(__name__)


@dataclass
class ChunkResult:
    """One decoded chunk, handed to the session on its event loop."""

    samples: np.ndarray  # float32 at the voice's rate
    utterance: int
    word_spans: list[tuple[str, int, int]]  # on an utterance's first chunk; utterance-relative samples
    precision: str
    fallback: bool
    cached: bool


class Sink(Protocol):
    """Loop-side receiver of one session's results (called on its event loop)."""

    def on_chunk(self, chunk: ChunkResult) -> None: ...

    def on_done(self) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


@dataclass(frozen=True)
class WorkSpec:
    """Everything the engine thread needs to synthesise for one session."""

    session_id: int
    runtime: Synthesizer
    voice_name: str
    sid: int | None
    params: SynthesisParams  # length_scale, noise scales, seed resolved by the engine
    schedule: ChunkSchedule
    precision: str  # "fp16" | "fp32"
    custom_dictionary: Mapping[str, str] | None
    sink: Sink
    loop: asyncio.AbstractEventLoop


@dataclass
class _Decoding:
    """One utterance in flight: either decoded chunk by chunk, or replayed from the cache."""

    index: int
    word_spans: list[tuple[str, int, int]]
    decoder: UtteranceDecoder | None
    cached: CachedUtterance | None = None
    staged: StagedDecoder | None = None  # CPU FP32: decoded alone, each stage's output kept
    cache_key: Hashable | None = None
    chunks: list[np.ndarray] = field(default_factory=list)
    precisions: list[str] = field(default_factory=list)
    precision: str = "fp32"  # current: starts at the session's, FP32 for the rest after a guard trip


@dataclass
class _Work:
    """Engine-thread state of one session."""

    spec: WorkSpec
    rng: np.random.Generator | None  # unseeded sessions: one random generator
    texts: deque[list[PhonemizedSentence]] = field(default_factory=deque)  # phonemised, not yet acoustic
    decodings: deque[_Decoding] = field(default_factory=deque)
    ended: bool = False
    utterances: int = 0
    samples_out: int = 0  # model-rate samples produced (playback deadline)
    first_audio_at: float | None = None
    ready_since: float = 0.0

    def slack(self, now: float) -> float:
        """Seconds of audio the client still has buffered (-inf before the first chunk)."""
        if self.first_audio_at is None:
            return -math.inf
        return self.first_audio_at + self.samples_out / self.spec.runtime.sample_rate - now


@dataclass
class EngineStats:
    batches: int = 0
    rows: int = 0
    max_rows: int = 0
    acoustic_jobs: int = 0
    acoustic_batches: int = 0
    fallbacks: int = 0
    nonfinite_fp32: int = 0


class EngineLoop:
    """Owns the backends from its own thread; sessions talk to it through `submit_*`."""

    def __init__(
        self, batch: BatchConfig, cache: ResultCache, on_trip: Callable[[str], None] | None = None,
        shadow: ShadowSampler | None = None,
    ) -> None:
        self.batch = batch
        self.cache = cache
        self.on_trip = on_trip
        self.shadow = shadow
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, int, object]] = []
        self._work: dict[int, _Work] = {}  # engine thread only
        self._stopping = False
        self._specs: dict[int, WorkSpec] = {}  # for the frontend thread (guarded by _cv)
        self._frontend: ThreadPoolExecutor | None = None
        self._thread = threading.Thread(target=self._run, name="cadenza-engine", daemon=True)

    # --- any thread --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        # espeak runs here, beside the engine thread, so phonemising never stalls decoding.
        self._frontend = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-frontend")

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._frontend is not None:
            self._frontend.shutdown(wait=False, cancel_futures=True)

    def _post(self, kind: str, session_id: int, payload: object = None) -> None:
        with self._cv:
            self._inbox.append((kind, session_id, payload))
            self._cv.notify()

    def submit_open(self, spec: WorkSpec) -> None:
        with self._cv:
            self._specs[spec.session_id] = spec
        self._post("open", spec.session_id, spec)

    def submit_text(self, session_id: int, text: str) -> None:
        """Phonemised on the frontend thread, then queued for the acoustic stage."""
        self._via_frontend(self._phonemize, session_id, text)

    def submit_end(self, session_id: int) -> None:
        self._via_frontend(self._post, "end", session_id)  # after the texts sent before it

    def submit_cancel(self, session_id: int) -> None:
        with self._cv:
            self._specs.pop(session_id, None)
        self._post("cancel", session_id)

    def _via_frontend(self, fn: Callable[..., None], *args: object) -> None:
        if self._frontend is None:
            fn(*args)
        else:
            self._frontend.submit(fn, *args)

    def _phonemize(self, session_id: int, text: str) -> None:
        with self._cv:
            spec = self._specs.get(session_id)
        if spec is None:
            return  # cancelled meanwhile
        try:
            sentences = [s for s in spec.runtime.voice.frontend.sentences(text, spec.custom_dictionary)
                         if s.phoneme_ids]
        except Exception as exc:
            from service.engine.api import InvalidArgument

            self._post("error", session_id, InvalidArgument("text", f"cannot phonemise {text[:40]!r}: {exc}"))
            return
        self._post("text", session_id, sentences)

    @property
    def active_work(self) -> int:
        """Sessions the engine thread still holds state for (0 once all are finished or cancelled)."""
        with self._cv:
            return len(self._work) + sum(1 for k, _, _ in self._inbox if k == "open")

    # --- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self._has_work() and not self._stopping:
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            self._apply(inbox)
            if stopping:
                for work in list(self._work.values()):
                    self._fail(work, RuntimeError("engine stopped"))
                return
            try:
                self._step()
            except Exception:  # a bug here must not kill the thread silently
                log.exception("engine step failed")

    def _apply(self, inbox: list[tuple[str, int, object]]) -> None:
        now = time.monotonic()
        for kind, sid, payload in inbox:
            if kind == "open":
                assert isinstance(payload, WorkSpec)
                seed = payload.params.seed
                rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little")) if seed is None else None
                self._work[sid] = _Work(payload, rng, ready_since=now)
                continue
            work = self._work.get(sid)
            if work is None:
                continue
            if kind == "text":
                assert isinstance(payload, list)
                work.texts.append(payload)
                work.ready_since = now
            elif kind == "error":
                assert isinstance(payload, BaseException)
                self._fail(work, payload)
            elif kind == "end":
                work.ended = True
            elif kind == "cancel":
                del self._work[sid]
        for work in list(self._work.values()):
            self._finish_if_done(work)

    def _has_work(self) -> bool:
        return any(w.texts or w.decodings for w in self._work.values())

    def _deliver(self, work: _Work, method: str, *args: object) -> None:
        work.spec.loop.call_soon_threadsafe(getattr(work.spec.sink, method), *args)

    def _fail(self, work: _Work, exc: BaseException) -> None:
        self._work.pop(work.spec.session_id, None)
        with self._cv:
            self._specs.pop(work.spec.session_id, None)
        self._deliver(work, "on_error", exc)

    def _finish_if_done(self, work: _Work) -> None:
        if work.ended and not work.texts and not work.decodings and work.spec.session_id in self._work:
            del self._work[work.spec.session_id]
            with self._cv:
                self._specs.pop(work.spec.session_id, None)
            self._deliver(work, "on_done")

    def _step(self) -> None:
        now = time.monotonic()
        self._replay_cached(now)
        best: tuple[tuple[int, float, float], _Work, str] | None = None
        for work in self._work.values():
            head_dec = work.decodings[0].decoder if work.decodings else None
            if head_dec is not None:
                first = head_dec.index == 0
                key = (0 if first else 1, work.slack(now), work.ready_since)
                if best is None or key < best[0]:
                    best = (key, work, "chunk")
            if work.texts:
                key = (0, work.slack(now), work.ready_since)
                if best is None or key < best[0]:
                    best = (key, work, "acoustic")
        if best is None:
            return
        _, work, kind = best
        if kind == "acoustic":
            self._acoustic(work)
        else:
            self._chunks(work, now)
        self._finish_if_done(work)

    def _replay_cached(self, now: float) -> None:
        """Send cached utterances that reached the head of their session's queue."""
        for work in list(self._work.values()):
            while work.decodings and work.decodings[0].cached is not None:
                item = work.decodings.popleft()
                entry = item.cached
                assert entry is not None
                for k, (samples, precision) in enumerate(zip(entry.chunks, entry.precisions, strict=True)):
                    spans = list(entry.word_spans) if k == 0 else []
                    self._emit(work, ChunkResult(samples, item.index, spans, precision, False, True), now)
            self._finish_if_done(work)

    def _emit(self, work: _Work, chunk: ChunkResult, now: float) -> None:
        if work.first_audio_at is None:
            work.first_audio_at = now
        work.samples_out += len(chunk.samples)
        work.ready_since = now
        self._deliver(work, "on_chunk", chunk)

    # --- acoustic stage ----------------------------------------------------------------------

    def _acoustic(self, head: _Work) -> None:
        """Acoustic stage for `head`'s next text batched with the next texts of other
        sessions on the same voice (one padded encoder call per `max_batch` sentences)."""
        works = [head] + [w for w in self._work.values()
                          if w is not head and w.texts and w.spec.runtime is head.spec.runtime]
        works = works[: self.batch.max_batch]
        pending: list[tuple[_Work, int, AcousticJob, Hashable | None]] = []
        for work in works:
            spec = work.spec
            for sent in work.texts.popleft():
                index = work.utterances
                work.utterances += 1
                key = self._cache_key(spec, sent.text, sent.phoneme_ids)
                entry = self.cache.get(key) if key is not None else None
                if entry is not None:
                    work.decodings.append(_Decoding(index, list(entry.word_spans), None, cached=entry))
                    continue
                rng = work.rng if work.rng is not None else utterance_rng(spec.params.seed, sent.phoneme_ids)
                job = AcousticJob(sent, spec.sid, spec.params, rng)
                pending.append((work, index, job, key))
                # Keep this utterance's place in its session's order; filled in below.
                work.decodings.append(_Decoding(index, [], None, cache_key=key, precision=spec.precision))
        runtime = head.spec.runtime
        for start in range(0, len(pending), self.batch.max_batch):
            group = pending[start : start + self.batch.max_batch]
            try:
                utts = runtime.acoustic_batch([job for _, _, job, _ in group])
            except Exception as exc:
                log.exception("acoustic stage failed")
                for work, _, _, _ in group:
                    self._fail(work, exc)
                continue
            self.stats.acoustic_jobs += len(group)
            self.stats.acoustic_batches += 1
            for (work, index, _, _), utt in zip(group, utts, strict=True):
                spec = work.spec
                item = next(d for d in work.decodings if d.index == index)
                item.word_spans = utt.word_spans
                # Chunk sizes depend only on the utterance's place in the stream, never on
                # timing, so the same input always gives the same samples.
                item.decoder = UtteranceDecoder(utt, spec.schedule, spec.runtime.flow_halo, spec.runtime.voc_halo,
                                                spec.schedule.first_chunk(index), spec.runtime.hop)
                if self._decodes_staged(spec.runtime, item.precision):
                    item.staged = spec.runtime.staged_decoder(utt)
        now = time.monotonic()
        for work in works:
            work.ready_since = now

    def _cache_key(self, spec: WorkSpec, text: str, phoneme_ids: list[int]) -> Hashable | None:
        p = spec.params
        if p.seed is None or self.cache.max_bytes <= 0:
            return None
        return (spec.voice_name, text, tuple(phoneme_ids), spec.sid, p.length_scale, p.noise_scale, p.noise_w,
                p.seed, spec.precision, spec.schedule)

    # --- flow + vocoder, batched -------------------------------------------------------------

    def _decodes_staged(self, runtime: Synthesizer, precision: str) -> bool:
        """On CPU, FP32 utterances are decoded alone by the staged decoder: batching windows
        buys little there, and the staged decoder skips recomputing every chunk's context
        (24 frames of generator context and up to 64 of flow context per windowed chunk)."""
        return self.batch.cpu_staged and runtime.staged and precision == "fp32" and runtime.backend.device == "cpu"

    def _chunks(self, head: _Work, now: float) -> None:
        """Decode the next chunk of `head` together with same-shaped chunks of other sessions."""
        signature = self._signature(head)
        rows = [head]
        mates = sorted(
            (w for w in self._work.values() if w is not head and self._signature(w) == signature),
            key=lambda w: (w.decodings[0].decoder.index > 0, w.slack(now), w.ready_since),  # type: ignore[union-attr]
        )
        rows += mates[: self.batch.max_batch - 1]
        # Waiting only pays when company can come: sessions still in the frontend or the
        # acoustic stage will bring same-shaped first chunks. Later chunks never wait.
        expecting = any(w.texts or not w.decodings for w in self._work.values() if w is not head)
        head_first = head.decodings[0].decoder is not None and head.decodings[0].decoder.index == 0
        alone = head.decodings[0].staged is not None  # no company can share a staged decode
        if not alone and len(rows) < self.batch.max_batch and self.batch.max_wait_s > 0 and head_first and expecting:
            waited = now - head.ready_since
            if waited < self.batch.max_wait_s:
                with self._cv:
                    if not self._inbox:
                        self._cv.wait(self.batch.max_wait_s - waited)
                if self._inbox:
                    return  # new work arrived: plan again with it
        try:
            self._decode_rows(rows, now)
        except Exception as exc:
            log.exception("decode failed")
            for w in rows:
                self._fail(w, exc)
            return
        for w in rows[1:]:
            self._finish_if_done(w)

    def _signature(self, work: _Work) -> tuple[object, ...] | None:
        if not work.decodings or work.decodings[0].decoder is None:
            return None
        if work.decodings[0].staged is not None:
            return ("staged", id(work))
        dec = work.decodings[0].decoder
        flow_w, voc_w = dec.next_windows()
        flow_len = 0 if flow_w is None else flow_w.hi - flow_w.lo
        return (id(work.spec.runtime), work.decodings[0].precision, flow_len, voc_w.hi - voc_w.lo)

    def _decode_staged(self, work: _Work, now: float) -> None:
        item = work.decodings[0]
        assert item.decoder is not None and item.staged is not None
        dec, hop = item.decoder, work.spec.runtime.hop
        a, b = dec.bounds[dec.index], dec.bounds[dec.index + 1]
        quantum = self.batch.cpu_quantum_frames
        if 0 < quantum < b - a and self._others_urgent(work, now):
            b = a + quantum
            dec.bounds.insert(dec.index + 1, b)  # the rest of the planned chunk comes next
        self.stats.batches += 1
        self.stats.rows += 1
        self.stats.max_rows = max(self.stats.max_rows, 1)
        self._deliver_chunk(work, item, finite(item.staged.audio(a * hop, b * hop)), "fp32", False, now)

    def _others_urgent(self, work: _Work, now: float) -> bool:
        """Another session is waiting for its first audio or will soon run out of it."""
        limit = self.batch.cpu_urgent_slack_s
        return any(
            w is not work and (w.texts or w.decodings) and w.slack(now) < limit for w in self._work.values()
        )

    def _decode_rows(self, rows: list[_Work], now: float) -> None:
        if rows[0].decodings[0].staged is not None:
            assert len(rows) == 1
            self._decode_staged(rows[0], now)
            return
        runtime = rows[0].spec.runtime
        backend = runtime.backend
        items = [w.decodings[0] for w in rows]
        precision = items[0].precision  # equal across rows: part of the batch signature
        decs: list[UtteranceDecoder] = []
        for it in items:
            assert it.decoder is not None
            decs.append(it.decoder)
        windows = [d.next_windows() for d in decs]
        sids = self._sids(rows)
        tripped = [False] * len(rows)
        if windows[0][0] is not None:
            flow_ws = [fw for fw, _ in windows if fw is not None]
            z_p = np.stack([d.utt.z_p[:, fw.lo : fw.hi] for d, fw in zip(decs, flow_ws, strict=True)])
            z = backend.flow(z_p, sids, precision)
            for i, (d, fw) in enumerate(zip(decs, flow_ws, strict=True)):
                tripped[i] = not bool(np.isfinite(z[i]).all())
                d.accept_flow(fw, z[i])
        voc_ws: list[Window] = [vw for _, vw in windows]
        z_in = np.stack([d.z[:, vw.lo : vw.hi] for d, vw in zip(decs, voc_ws, strict=True)])
        sessions = [w.spec.session_id for w in rows]
        out = backend.vocode(z_in, sids, precision, sessions=sessions)
        self.stats.batches += 1
        self.stats.rows += len(rows)
        self.stats.max_rows = max(self.stats.max_rows, len(rows))
        for i, (work, item) in enumerate(zip(rows, items, strict=True)):
            dec = decs[i]
            fallback = False
            if (tripped[i] or int(out.nonfinite[i]) > 0) and precision != "fp32":
                # Same prior sample and context, all in FP32; the utterance stays FP32 from here.
                samples = redo_chunk_fp32(backend, dec, voc_ws[i], self._row(sids, i))
                item.precision, fallback = "fp32", True
                self.stats.fallbacks += 1
                log.warning("guard tripped (session %d): chunk recomputed in fp32", work.spec.session_id)
                if self.on_trip is not None:
                    self.on_trip(work.spec.voice_name)
            else:
                if int(out.nonfinite[i]) > 0:
                    self.stats.nonfinite_fp32 += 1  # the backend already zeroed them
                samples = dec.trim_audio(voc_ws[i], out.audio[i], runtime.hop)
                if self.shadow is not None and precision != "fp32":
                    self.shadow.offer(backend, dec, voc_ws[i], self._row(sids, i), samples)
            self._deliver_chunk(work, item, samples, "fp32" if fallback else precision, fallback, now)

    def _deliver_chunk(
        self, work: _Work, item: _Decoding, samples: np.ndarray, used: str, fallback: bool, now: float
    ) -> None:
        """Send one decoded chunk, remember it for the cache, retire a finished utterance."""
        dec = item.decoder
        assert dec is not None
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        spans = item.word_spans if dec.index == 0 else []
        dec.index += 1
        self._emit(work, ChunkResult(samples, item.index, spans, used, fallback, False), now)
        if item.cache_key is not None:
            item.chunks.append(samples)
            item.precisions.append(used)
        if dec.done:
            work.decodings.popleft()
            if item.cache_key is not None:
                self.cache.put(item.cache_key, CachedUtterance(
                    tuple(item.chunks), tuple(item.precisions), tuple(item.word_spans)))

    @staticmethod
    def _sids(rows: list[_Work]) -> np.ndarray | None:
        if rows[0].spec.sid is None:
            return None
        return np.asarray([w.spec.sid for w in rows], dtype=np.int64)

    @staticmethod
    def _row(sids: np.ndarray | None, i: int) -> np.ndarray | None:
        return None if sids is None else sids[i : i + 1]
