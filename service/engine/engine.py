"""The TTS engine: validates session configs, loads voices, and runs the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
from collections.abc import Mapping
from importlib import metadata
from multiprocessing.connection import Connection
from typing import Any

from service.audio.encoding import AudioEncoding
from service.engine.config import EngineConfig
from service.engine.contract import (
    MAX_SAMPLE_RATE,
    MAX_SPEAKING_RATE,
    MIN_SAMPLE_RATE,
    MIN_SPEAKING_RATE,
    AudioOut,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Precision,
    ResourceExhausted,
    ServerInfo,
    SessionConfig,
    SessionSummary,
    SpeakerInfo,
    Unavailable,
    VoiceDescription,
    WordTiming,
    check_text,
    echo,
)
from service.engine.host import Host, LoadedVoice, LocalHost, resolve_device
from service.engine.precision import Hardware, PrecisionDecision, PrecisionPolicy
from service.engine.proc import SOLE_SERVER, ApiSlot, ProcessHost
from service.engine.session import EngineSession, SessionSetup
from service.engine.state import SessionRequest
from service.models.family import ChunkSchedule, SynthesisParams, VoiceInfo, VoiceNotFoundError
from service.models.registry import family
from service.telemetry import Telemetry
from service.telemetry.timeline import LOOP_LAG_PERIOD_S, LOOP_LAG_RECORDED_S, Timeline
from service.voices import list_voices

log = logging.getLogger(__name__)

MAX_CHUNK_FRAMES = 1024
MAX_PROMPT_BYTES = 4 << 20  # a voice prompt's recording
_SPEAKER_INDEX = re.compile(r"[0-9]{1,9}")  # ASCII digits only: "²" and "٣" are names, not indexes


class TtsEngine:
    """Implements `service.engine.contract.Engine`. Call `await start()` before opening sessions."""

    def __init__(self, config: EngineConfig, telemetry: Telemetry | None = None, slot: ApiSlot = SOLE_SERVER) -> None:
        """`slot`: which of several API server processes sharing one core this one is (the
        first starts the core and warms it up; see `service.engine.proc`)."""
        self.config = config
        self.slot = slot
        # With the core in its own process, "auto" is resolved there and reported with the voices
        # it loads (`start`), so this process never imports torch for it.
        self.device = config.device if config.core == "process" else resolve_device(config.device)
        self.backend_name = config.backend
        self.telemetry = telemetry or Telemetry()
        self.timeline = Timeline(config.timeline_dir, "api")
        self.core_mode = config.core
        self.host: Host
        if self.core_mode == "process":
            self.host = ProcessHost(config, self.device, self.backend_name, self.telemetry, self._on_trip, slot)
            self.timeline.watch_gc()  # the core's own process records its collections itself
        elif slot.count > 1:
            raise ValueError("several API server processes (--api-servers) share a core in its own process: "
                             "use --core process")
        else:
            self.host = LocalHost(config, self.device, self.backend_name, self.telemetry, self._on_trip)
        if slot.index == 0:  # the core's figures, counted once
            self.telemetry.observe(cache=self._cache_lookups,
                                   gpu_memory=self._gpu_memory)  # nothing off CUDA
        self._policy: PrecisionPolicy | None = None
        self._voices: dict[str, VoiceInfo] = {}
        self._default: VoiceInfo | None = None
        self._loaded: dict[str, LoadedVoice] = {}
        self._sessions: dict[int, EngineSession] = {}
        self._ids = slot.session_ids()
        self._lag_watch: asyncio.Task[None] | None = None
        self.ready = False
        self.draining = False

    # --- lifecycle ---------------------------------------------------------------------------

    CAPACITY_RUNS = 3  # measured warm-up runs (see start)

    async def start(self) -> None:
        """Load the default voice, start the engine thread and warm it up through a real
        session (every step shape the decoder uses is prepared before the first caller)."""
        await asyncio.get_running_loop().run_in_executor(None, self._start_sync)
        self.ready = True
        if self.slot.index > 0:  # the first API server warmed the core up and measured it
            await asyncio.get_running_loop().run_in_executor(None, self.host.settle)
            return
        for precision in self._warm_precisions():
            session = await self._open_session(SessionConfig(seed=0, precision=precision), internal=True)
            await self._collect(session, self.config.warmup_text)
        for info in self._preloaded()[1:]:  # the other voices (EngineConfig.preload)
            for precision in self._warm_precisions():
                config = SessionConfig(voice=info.name, seed=0, precision=precision)
                await self._collect(await self._open_session(config, internal=True), self.config.warmup_text)
        # Again, warm, for the decoder's measured speed (first runs are slower than serving); a
        # few runs, the slowest of which the capacity estimate takes (see Executor.freeze_rate).
        for run in range(self.CAPACITY_RUNS):
            self.host.reset_rate()
            session = await self._open_session(SessionConfig(seed=1 + run), internal=True)
            await self._collect(session, self.config.warmup_text)
        # After warm-up: what the server built is not scanned by the collector again (off the
        # loop: the process core's collection is waited for).
        await asyncio.get_running_loop().run_in_executor(None, self.host.settle)
        if self.timeline.on:
            self._lag_watch = asyncio.create_task(self._watch_loop_lag())
        capacity = self.host.snapshot().capacity
        for precision in self._warm_precisions():
            estimate = capacity.get(precision.value)
            if estimate:
                log.info("capacity estimate at %s: %.0f real-time streams", precision.value, estimate)

    def _preloaded(self) -> list[VoiceInfo]:
        """The voices ready before SERVING: the default first, then (preload) every other one."""
        assert self._default is not None
        others = [v for v in self._voices.values() if v is not self._default] if self.config.preload else []
        return [self._default, *others]

    def _warm_precisions(self) -> list[Precision]:
        """FP32 (every guard trip redoes in it) and what AUTO picks here."""
        assert self._default is not None
        auto = self._resolve_precision(Precision.AUTO, self._default.name).precision
        return [Precision.FP32] + ([Precision(auto)] if auto != "fp32" else [])

    def _start_sync(self) -> None:
        voices_dir = self.config.voices_dir
        infos = list_voices(voices_dir)
        self._voices = {v.name: v for v in infos}
        if self.config.voice is None:
            self._default = infos[0]
        elif self.config.voice in self._voices:
            self._default = self._voices[self.config.voice]
        else:
            raise VoiceNotFoundError(
                f"unknown default voice {self.config.voice!r}; available: {', '.join(sorted(self._voices))} (--voice)"
            )
        preload = self._preloaded()
        frontend = dataclasses.replace(self.config.frontend, preload=(
            *self.config.frontend.preload, *(v.frontend_key for v in preload)))
        self._loaded = self.host.start(frontend, preload)
        for name in self._loaded:
            self.telemetry.voice_loaded(name)
        first = self._loaded.get(self._default.name)
        if first is not None:  # what the core runs on ("auto" resolved)
            self.device, self.backend_name = first.hardware.device, first.backend
        # The precision policy looks at the hardware (on CUDA: imports torch and asks the driver):
        # here, before SERVING, not in the event loop at the first session.
        self._resolve_precision(Precision.AUTO, self._default.name)
        log.info("synthesis core: %s (%s on %s)", self.core_mode, self.backend_name, self.device)

    async def _watch_loop_lag(self) -> None:
        """`--timeline`: how late this event loop comes back to a short sleep (see LOOP_LAG_PERIOD_S)."""
        while True:
            due = time.monotonic() + LOOP_LAG_PERIOD_S
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            late = time.monotonic() - due
            if late > LOOP_LAG_RECORDED_S and self._sessions:
                self.timeline.add("loop_lag", s=due, lag=late)

    async def stop(self) -> None:
        if self._lag_watch is not None:
            self._lag_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_watch
        for session in list(self._sessions.values()):
            session.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.host.stop)

    @property
    def server_conns(self) -> list[Connection]:
        """The first of several API servers, once started: the other servers' pipes to the core."""
        return self.host.server_conns if isinstance(self.host, ProcessHost) else []

    @property
    def dead(self) -> bool:
        """The engine thread died (an unexpected error): nothing more will be synthesised."""
        return self.host.dead.is_set()

    def fail_all(self, exc: BaseException) -> None:
        """End every open session with `exc` (after the engine thread died)."""
        for session in list(self._sessions.values()):
            session.on_error(exc)

    def drain(self) -> None:
        """Refuse new sessions from now on; open ones continue."""
        self.draining = True

    def sessions(self) -> list[EngineSession]:
        """The sessions open in this process (a drain cuts those left at its end)."""
        return list(self._sessions.values())

    def _cache_lookups(self) -> tuple[int, int]:
        """(hits, misses) of the core's result cache, for the telemetry's collection thread."""
        snap = self.host.snapshot()
        return snap.cache_hits, snap.cache_misses

    def _gpu_memory(self) -> dict[str, int]:
        """Bytes the core's CUDA device holds (the caching allocator's reservation)."""
        return self.host.snapshot().gpu_memory

    def _refused(self, reason: str, error: Exception) -> Exception:
        """Count a refused session (admission metrics) and return the error to raise."""
        self.telemetry.admission(False, 0.0, reason)
        return error

    @property
    def live_sessions(self) -> int:
        """Sessions open in this process (what a drain waits for)."""
        return len(self._sessions)

    @property
    def open_sessions(self) -> int:
        """Sessions open on this server, in every API server process: this one's exactly, the
        others' as the core last counted them (limits and admission count these)."""
        if self.slot.count == 1:  # no others (and a core on a thread makes its snapshot on each call)
            return self.live_sessions
        others = self.host.snapshot().open_sessions
        return self.live_sessions + sum(n for i, n in enumerate(others) if i != self.slot.index)

    @property
    def engine_sessions(self) -> int:
        """Sessions the engine thread still holds state for."""
        return self.host.snapshot().active_work

    def stats(self) -> dict[str, float]:
        snap = self.host.snapshot()
        s = snap.stats
        return {
            "live_sessions": self.live_sessions, "cache_hits": snap.cache_hits, "cache_misses": snap.cache_misses,
            "cache_bytes": snap.cache_bytes, "steps": s.steps, "step_rows": s.rows, "max_step_rows": s.max_rows,
            "step_seconds": s.step_seconds, "step_audio_seconds": s.audio_seconds,
            "acoustic_jobs": s.acoustic_jobs, "acoustic_batches": s.acoustic_batches,
            "acoustic_seconds": s.acoustic_seconds,
            "overlapped_acoustic": s.overlapped, "token_steps": s.token_steps,
            "overlapped_token_steps": s.token_steps_overlapped, "fp32_fallbacks": s.fallbacks,
            "shadow_verified": snap.shadow_verified, "shadow_min_psnr_db": snap.shadow_min_psnr_db,
        }

    # --- voices ------------------------------------------------------------------------------

    def _load(self, info: VoiceInfo) -> None:
        """Load a voice where the core runs (blocking: the first session of a voice waits)."""
        self._loaded[info.name] = self.host.load(info)
        self.telemetry.voice_loaded(info.name)

    def voices(self) -> list[VoiceDescription]:
        out = []
        ordered = sorted(self._voices.values(), key=lambda v: (v is not self._default, v.name))
        for v in ordered:
            names = {i: n for n, i in v.speaker_id_map.items()}
            speakers = [SpeakerInfo(i, names.get(i, "")) for i in range(v.num_speakers)] if v.num_speakers > 1 else []
            out.append(VoiceDescription(v.name, v.language, v.sample_rate, speakers, v.name in self._loaded,
                                        v.family, v.options, v.gender, v.voice_prompts))
        return out

    def server_info(self) -> ServerInfo:
        versions = {}
        for pkg in ("cadenza", "grpcio", "protobuf", "numpy", "torch", "onnxruntime"):
            try:
                versions[pkg] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                continue
        loaded = self._loaded.get(self._default.name) if self._default else None
        precisions = [Precision(p) for p in loaded.precisions] if loaded else [Precision.FP32]
        pins = list(loaded.fp32_pins) if loaded else []
        return ServerInfo(self.backend_name, self.device, precisions,
                          self._default.name if self._default else "", pins, versions,
                          capacity_streams=self.capacity_streams(), open_sessions=self.open_sessions,
                          max_message_bytes=self.config.limits.max_message_bytes)

    def pin_candidates(self) -> tuple[str, ...]:
        """The default voice's modules `cadenza precision sensitivity` tries pinning."""
        loaded = self._loaded.get(self._default.name) if self._default else None
        return loaded.pin_candidates if loaded else ()

    def capacity_streams(self) -> float | None:
        """Real-time streams the engine estimates it carries at the precision AUTO picks."""
        if self.config.limits.capacity_streams is not None:
            return self.config.limits.capacity_streams
        auto = self._policy.resolve("auto", self._default.name, self._supported(self._default.name), 0).precision \
            if self._policy and self._default else None
        capacity = self.host.snapshot().capacity
        return capacity.get(auto or "") or capacity.get("")

    def demand(self) -> int:
        """Open sessions that need the engine now or soon (`EngineSession.demanding`); other API
        server processes' sessions all count."""
        now = time.monotonic()
        own = sum(1 for s in self._sessions.values() if s.demanding(now))
        return own + self.open_sessions - self.live_sessions

    async def _admit(self) -> float:
        """At capacity, or while the engine is behind (a session waits too long for its first
        audio), wait a little for room; then refuse with a clear status. Returns the seconds
        waited. A pinned capacity counts open sessions; the measured one counts the sessions that
        need the engine (new ones, and those speaking), so a burst is refused past it before the
        engine is even busy, while sessions waiting for an LLM's next words leave room."""
        limits = self.config.limits
        if limits.admission_wait_s <= 0:
            return 0.0
        capacity = self.capacity_streams()
        pinned = limits.capacity_streams is not None

        def full() -> bool:
            load = self.open_sessions if pinned else self.demand()
            at_capacity = capacity is not None and load >= capacity
            return at_capacity or self.host.snapshot().first_audio_wait_s > limits.admission_first_audio_s

        if not full():
            return 0.0
        start = time.monotonic()
        deadline = start + limits.admission_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            if not full():
                return time.monotonic() - start
        behind = self.host.snapshot().first_audio_wait_s
        self.telemetry.admission(False, time.monotonic() - start, "capacity")
        # A family whose steps the warm-up does not time has no estimate: only the wait is known.
        fit = f"about {capacity:.0f} real-time streams fit on this {self.device}; " if capacity else ""
        raise ResourceExhausted(
            f"server at capacity: {self.open_sessions} sessions open, {self.demand()} of them speaking or starting "
            f"({fit}a session has waited {behind:.1f} s for its first audio); retry shortly or connect to "
            "another replica")

    def _check_room(self, internal: bool) -> None:
        """RESOURCE_EXHAUSTED at `max_sessions` open (the server's own sessions aside)."""
        if self.open_sessions >= self.config.limits.max_sessions and not internal:
            raise self._refused("max_sessions", ResourceExhausted(
                f"too many open sessions (limit {self.config.limits.max_sessions}); retry later"))

    async def open_session(self, config: SessionConfig) -> EngineSession:
        return await self._open_session(config, internal=False)

    async def _open_session(self, config: SessionConfig, internal: bool) -> EngineSession:
        """`internal`: the server's own warm-up session, outside the client limits."""
        if not self.ready:
            raise self._refused("not_ready", Unavailable("the server is still loading its voice; retry shortly"))
        if self.draining:
            raise self._refused("draining", Unavailable(
                "the server is draining (shutting down); connect to another instance"))
        if self.dead:
            raise self._refused("engine_failed", Unavailable("the server's engine failed; connect to another instance"))
        self._check_room(internal)
        waited = 0.0 if internal else await self._admit()
        info = self._resolve_voice(config)
        sid = self._resolve_speaker(info, config.speaker)
        params, schedule = self._resolve_params(info, config)
        prompt = await self._resolve_prompt(info, config)
        if info.name not in self._loaded:
            await asyncio.get_running_loop().run_in_executor(None, self._load, info)
        decision = self._resolve_precision(config.precision, info.name)
        precision = Precision(decision.precision)
        self._check_room(internal)  # others opened meanwhile
        setup = SessionSetup(
            session_id=next(self._ids), config=config, in_rate=info.sample_rate,
            out_rate=config.sample_rate or info.sample_rate, precision=precision,
            precision_reason=decision.reason,
            segmenter=self.config.segmenter, pieces=info.decodes_whole_utterances,
            max_text_chars=len(self.config.warmup_text) if internal else self.config.limits.max_text_chars,
            max_audio_bytes=max(1024, self.config.limits.max_message_bytes - 1024),
            max_ahead_s=self.config.batch.max_ahead_s,
        )
        session = EngineSession(setup, self.host, self._forget, telemetry=None if internal else self.telemetry,
                                voice=info.name, timeline=None if internal else self.timeline)
        if not internal:
            self.telemetry.admission(True, waited)
        self._sessions[session.id] = session
        request = SessionRequest(
            session_id=session.id, voice_name=info.name, sid=sid, params=params, schedule=schedule,
            precision=precision.value, custom_dictionary=config.custom_dictionary, word_timings=config.word_timings,
            internal=internal, max_phonemes=self.config.limits.max_session_phonemes, voice_prompt=prompt)
        self.host.submit_open(request, info, session, asyncio.get_running_loop(), setup.cursor)
        return session

    async def _resolve_prompt(self, info: VoiceInfo, config: SessionConfig) -> Any:
        """The session's own speaker from its voice prompt (None: it has none), made off the event
        loop: a recording takes tens of milliseconds of feature and ONNX work."""
        prompt = config.voice_prompt
        if prompt is None:
            return None
        if not info.voice_prompts:
            takers = sorted(v.name for v in self._voices.values() if v.voice_prompts)
            raise InvalidArgument("config.voice_prompt", f"voice {info.name} ({info.family}) has fixed speakers and "
                                  f"takes no voice prompt; voices that do: {', '.join(takers) or 'none here'}")
        if config.speaker not in (None, ""):
            raise InvalidArgument("config.voice_prompt", "give a speaker or a voice prompt, not both")
        if len(prompt.audio) > MAX_PROMPT_BYTES:
            raise InvalidArgument("config.voice_prompt", f"the recording is {len(prompt.audio)} bytes; at most "
                                  f"{MAX_PROMPT_BYTES} are read (30 s of 16-bit mono at 48 kHz fits): "
                                  "send a shorter one")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, family(info.family).voice_prompt, info, prompt.audio, prompt.transcript)
        except ValueError as exc:
            raise InvalidArgument("config.voice_prompt", str(exc)) from exc

    def _forget(self, session: EngineSession) -> None:
        self._sessions.pop(session.id, None)
        if not self._sessions:
            self.timeline.flush()  # the busy period is over

    def _resolve_voice(self, config: SessionConfig) -> VoiceInfo:
        assert self._default is not None
        lang = (config.language or "").lower()
        if config.voice:
            info = self._voices.get(config.voice)
            if info is None:
                raise NotFound(f"unknown voice {echo(config.voice)}; available: {', '.join(sorted(self._voices))}")
            if lang and not info.language.lower().startswith(lang):
                raise InvalidArgument(
                    "config.language", f"voice {info.name} speaks {info.language}, not {echo(config.language)}"
                )
            return info
        if not lang or self._default.language.lower().startswith(lang):
            return self._default
        for info in self._voices.values():
            if info.language.lower().startswith(lang):
                return info
        raise NotFound(f"no voice for language {echo(config.language)}; available: "
                       f"{', '.join(sorted({v.language for v in self._voices.values()}))}")

    @staticmethod
    def _resolve_speaker(info: VoiceInfo, speaker: int | str | None) -> int | None:
        """A speaker index or name; any other string (non-ASCII digits such as "²", a too long
        number) is NOT_FOUND with the input clipped, never a Python error."""
        if info.num_speakers <= 1 and speaker not in (None, "", 0, "0"):  # nothing to choose between
            shown = echo(speaker) if isinstance(speaker, str) else speaker
            raise NotFound(f"config.speaker: voice {info.name} has one speaker; leave speaker unset (got {shown})")
        if isinstance(speaker, str) and speaker:
            if _SPEAKER_INDEX.fullmatch(speaker):
                speaker = int(speaker)
            elif info.num_speakers > 1 and speaker in info.speaker_id_map and not speaker.isdigit():
                pass  # a name
            else:
                known = ", ".join(sorted(info.speaker_id_map)) or "none"
                raise NotFound(f"config.speaker: voice {info.name} has no speaker {echo(speaker)}; speakers are "
                               f"named ({known}) or numbered 0..{max(info.num_speakers - 1, 0)} in ASCII digits")
        try:
            return info.speaker_index(speaker)
        except VoiceNotFoundError as exc:
            raise NotFound(str(exc)) from exc

    def _resolve_params(self, info: VoiceInfo, c: SessionConfig) -> tuple[SynthesisParams, ChunkSchedule]:
        if not isinstance(c.encoding, AudioEncoding):
            raise InvalidArgument("config.encoding", f"unknown encoding {c.encoding!r}; use LINEAR16, MULAW, ALAW or "
                                  "FLOAT32")
        if c.sample_rate is not None and not MIN_SAMPLE_RATE <= c.sample_rate <= MAX_SAMPLE_RATE:
            raise InvalidArgument("config.sample_rate", f"{c.sample_rate} Hz is outside {MIN_SAMPLE_RATE}.."
                                  f"{MAX_SAMPLE_RATE} Hz (0 or unset = the voice's rate, {info.sample_rate} Hz)")
        rate = c.speaking_rate
        if not (math.isfinite(rate) and MIN_SPEAKING_RATE <= rate <= MAX_SPEAKING_RATE):
            raise InvalidArgument("config.speaking_rate",
                                  f"{rate} is outside {MIN_SPEAKING_RATE}..{MAX_SPEAKING_RATE} (1.0 = normal)")
        if rate != 1.0 and not info.pace:
            raise InvalidArgument("config.speaking_rate", f"voice {info.name} ({info.family}) speaks at its own pace; "
                                  "leave speaking_rate at 1.0 (or unset)")
        if c.custom_dictionary and not info.pronunciations:
            raise InvalidArgument("config.custom_dictionary", f"voice {info.name} ({info.family}) reads text, not "
                                  "phonemes; send no custom dictionary (spell the words as they should be read)")
        try:
            options = info.resolve_options(c.options or {})
        except ValueError as exc:
            raise InvalidArgument("config.options", str(exc)) from exc
        if c.seed is not None and not 0 <= c.seed < 2**64:
            raise InvalidArgument("config.seed", f"{c.seed} is outside 0..2^64-1")
        base = self.config.schedule
        first = c.first_chunk_frames or base.first_frames
        largest = c.max_chunk_frames or max(base.max_frames, first)
        if not 1 <= first <= MAX_CHUNK_FRAMES:
            raise InvalidArgument("config.first_chunk_frames", f"{first} is outside 1..{MAX_CHUNK_FRAMES}")
        if not first <= largest <= MAX_CHUNK_FRAMES:
            raise InvalidArgument("config.max_chunk_frames",
                                  f"{largest} must be between first_chunk_frames ({first}) and {MAX_CHUNK_FRAMES}")
        self._check_dictionary(c.custom_dictionary or {})
        staged = c.first_chunk_frames or base.staged_first_frames
        schedule = dataclasses.replace(base, first_frames=first, staged_first_frames=staged, max_frames=largest)
        params = SynthesisParams(
            length_scale=info.length_scale / rate, options=options, seed=c.seed,
        )
        return params, schedule

    def _check_dictionary(self, dictionary: Mapping[str, str]) -> None:
        """Entries bounded in count and length: one entry must not turn a word into minutes of audio."""
        limits, field = self.config.limits, "config.custom_dictionary"
        if len(dictionary) > limits.max_dictionary_entries:
            raise InvalidArgument(field, f"{len(dictionary)} entries; at most {limits.max_dictionary_entries} "
                                  "are allowed per session")
        longest = limits.max_dictionary_entry_chars
        for word, pronunciation in dictionary.items():
            if not word.strip() or not pronunciation.strip():
                raise InvalidArgument(field, "entries need a non-empty word and pronunciation")
            for what, value in (("word", word), ("pronunciation", pronunciation)):
                if len(value) > longest:
                    raise InvalidArgument(field, f"the {what} of entry {echo(word, 40)} has {len(value)} characters; "
                                          f"at most {longest} are allowed")
            check_text(word + pronunciation, field)

    def _resolve_precision(self, asked: Precision, voice: str) -> PrecisionDecision:
        """Explicit requests must be supported by the backend; AUTO asks the policy
        (hardware, load, the voice's guard-trip history) and keeps its reason."""
        supported = self._supported(voice)
        if asked is not Precision.AUTO and asked.value not in supported:
            hint = " (INT8 runs on a CPU server started with --int8, for Piper voices)" \
                if asked is Precision.INT8 else ""
            raise InvalidArgument("config.precision", f"the {self.backend_name} backend on {self.device} runs "
                                  f"{', '.join(supported)} only{hint}; ask for AUTO or FP32")
        if self._policy is None:
            loaded = self._runtime_for(voice)
            hardware = loaded.hardware if loaded else Hardware.detect(self.device)
            self._policy = PrecisionPolicy(hardware, self.config.precision)
        return self._policy.resolve(asked.value, voice, supported, self.open_sessions)

    def _runtime_for(self, voice: str) -> LoadedVoice | None:
        """`voice` as loaded; one not loaded yet: the default voice."""
        return self._loaded.get(voice) or (self._loaded.get(self._default.name) if self._default else None)

    def _supported(self, voice: str) -> tuple[str, ...]:
        """The precisions `voice` runs as loaded."""
        loaded = self._runtime_for(voice)
        return tuple(loaded.precisions) if loaded else ("fp32",)

    def _on_trip(self, voice: str) -> None:
        """Called from the engine thread when a chunk fell back to FP32."""
        if self._policy is not None:
            self._policy.record_trip(voice)

    async def synthesize_all(self, config: SessionConfig, text: str) -> tuple[bytes, list[WordTiming], SessionSummary]:
        return await self._collect(await self.open_session(config), text)

    @staticmethod
    async def _collect(session: EngineSession, text: str) -> tuple[bytes, list[WordTiming], SessionSummary]:
        try:
            session.push_text(text)
            session.end_input()
            pieces: list[bytes] = []
            words: list[WordTiming] = []
            summary: SessionSummary | None = None
            async for event in session.events():  # to its end: the session reports itself once taken
                if isinstance(event, AudioOut):
                    pieces.append(event.audio)
                    words.extend(event.words)
                else:
                    summary = event
        finally:
            session.cancel()
        if summary is None:
            raise FailedPrecondition("the session ended without a summary")
        return b"".join(pieces), words, summary
