"""The scheduler: pure planning, no backend calls, no clocks of its own.

Each engine iteration it decides which sessions' next sentences go through the acoustic
stage and which sessions advance by one decoder step, most urgent first:

* a playing session about to run dry (less than `urgent_slack_s` buffered, or less than the
  planned acoustic batch is expected to take) goes first: a gap
  in audio that is playing is worse than a later start; then sessions waiting for their first
  audio; then the other playing sessions, the least buffered first (on one CPU core's worth of
  decoding, where a step serves one session, this keeps the first sessions of a burst playing
  while the rest start). Each goes by when its audio runs out, a start's `start_grace_s` after
  its text came: once a start has waited that long it ranks with the sessions about to run dry,
  so when the engine falls behind, sessions that keep running dry do not hold it back for good;
* deadlines first: a session with at least `lead_s` of audio ahead of its playback is stepped
  only when no session is waiting for its first audio or below its lead, no sentence
  waits for the acoustic stage and no session is still making the tokens of its first chunk
  (the GPU then has time to spare: unary requests and clients that buffer still get their
  audio as fast as it can be made), or to fill a step that runs anyway up to `fill_rows` (the
  next in line: on a GPU much of a small step's cost is fixed, so under load sessions are
  advanced in fewer, fuller steps). A decoder step holds the engine thread while it is
  launched, so a step only to run further ahead would hold up a start's token steps;
* a session whose client has not yet taken `max_ahead_s` of the audio delivered to it is
  not stepped (backpressure: bounded memory per session, GPU time for those who need it;
  the session wakes the engine when its client catches up);
* a sentence is taken to the acoustic stage only when its session has less than
  `acoustic_lookahead_s` of audio waiting, so a long text queued at once never holds up the
  chunks of the sentence that is playing, nor other sessions' first audio;
* when a playing session is about to run dry, its step runs before the acoustic batch;
* when starts back up (sessions waiting for the acoustic stage to begin their audio, half an
  acoustic batch of them or more: a burst) an iteration steps only the rows that cannot wait
  (about to run dry, first chunks), with no fill. On a GPU any other step shares the device
  with the acoustic call or runs before the next one, and every waiting start waits for it;
  sessions below their lead catch up once the starts are through (their buffered audio covers
  that: they are not about to run dry);
* among sessions waiting for their first audio, a first sentence goes to the acoustic stage
  before a session's next one (which its first audio does not need);
* a family that makes its decoder input token by token (autoregressive) gets one batched token
  step per iteration over every utterance still making tokens, head utterances and the least
  buffered sessions first, beside the acoustic batch and the decoder step. A session's sentences
  make their tokens one at a time, in order (the next is taken to the acoustic stage once the one
  before has its last token): its first sentence's steps are not slowed by the later ones' prompts
  and rows, and a session holds one row of the token stage's cache, not one per sentence; tokens
  come many times faster than they are spoken, so the next sentence is ready long before it plays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from service.engine.config import BatchConfig
from service.engine.state import SessionState, UtteranceState, UtteranceStatus


@dataclass
class Plan:
    """What one engine iteration runs."""

    acoustic: list[tuple[SessionState, UtteranceState]] = field(default_factory=list)
    # One batched autoregressive step (families whose decoder input is made token by token).
    tokens: list[tuple[SessionState, UtteranceState]] = field(default_factory=list)
    decode: list[tuple[SessionState, UtteranceState]] = field(default_factory=list)
    decode_first: bool = False  # a playing session is close to running dry: its step goes first
    wake_at: float | None = None  # nothing to run now: plan again at this time (or on new input/reads)

    @property
    def empty(self) -> bool:
        return not self.acoustic and not self.tokens and not self.decode


@dataclass
class AcousticCost:
    """The acoustic stage's seconds per sentence over its recent calls: decaying sums of seconds
    and of sentences, so a one-sentence call's fixed cost does not stand for every sentence of
    the next big batch (an average of per-call ratios would let it)."""

    seconds: float = 0.0
    sentences: float = 0.0
    keep: float = 0.8  # weight of the past at each call

    def add(self, seconds: float, sentences: int) -> None:
        self.seconds = self.keep * self.seconds + seconds
        self.sentences = self.keep * self.sentences + sentences

    @property
    def per_sentence(self) -> float:
        return self.seconds / self.sentences if self.sentences else 0.0


class Scheduler:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config

    def token_rows(self, sessions: Iterable[SessionState], now: float) -> list[tuple[SessionState, UtteranceState]]:
        """The rows of the next autoregressive step (one voice): every utterance making tokens (one
        per session), as its later decoding waits for them; heads first, then by slack (first
        audio first)."""
        return self._token_step([item for s in sessions
                                 for item in self._token_items(s, s.past_acoustic(), s.slack(now))])

    @staticmethod
    def _token_items(s: SessionState, past: list[UtteranceState], slack: float
                     ) -> list[tuple[tuple[bool, float, float], SessionState, UtteranceState]]:
        """`s`'s utterances making tokens (among `past`, its `past_acoustic()`), each with its place
        in a token step: heads first, then by slack."""
        return [((u is not s.utterances[0], slack, s.ready_since), s, u) for u in past
                if u.status is UtteranceStatus.TOKENS]

    def _token_step(self, tokens: list[tuple[tuple[bool, float, float], SessionState, UtteranceState]]
                    ) -> list[tuple[SessionState, UtteranceState]]:
        if not tokens:
            return []
        tokens.sort(key=lambda item: item[0])
        runtime = tokens[0][1].spec.runtime
        return [(s, u) for _, s, u in tokens if s.spec.runtime is runtime][: self.config.max_step_rows]

    def plan(self, sessions: Iterable[SessionState], now: float, max_rows: int,
             free_slots: Callable[[SessionState, UtteranceState], int] | None = None,
             acoustic_job_s: float = 0.0, fill_rows: int = 0) -> Plan:
        """`free_slots(s, u)`: decoder slots free for `u`'s voice and precision (None: no slots,
        e.g. the staged decoder). An utterance that needs a slot is planned only while one is
        free, so waiting starts never crowd out the sessions that hold the slots.
        `acoustic_job_s`: what the acoustic stage has been taking per sentence. A playing session
        with less audio buffered than the planned acoustic batch will take to run is urgent too
        (on a CPU a batch of new sessions' sentences can outlast the first session's first chunk).
        `fill_rows`: a step for urgent rows takes the next in line up to this many rows."""
        cfg = self.config
        plan = Plan()
        acoustic: list[tuple[tuple[float, bool, float], SessionState, UtteranceState]] = []
        ready: list[tuple[SessionState, UtteranceState, float, float]] = []  # (..., slack, runs dry at)
        tokens: list[tuple[tuple[bool, float, float], SessionState, UtteranceState]] = []
        wake = math.inf
        starts = 0  # sessions waiting for the acoustic stage to begin their audio
        first_tokens = False  # a session without audio still makes the tokens of its first chunk
        for s in sessions:
            if not s.utterances:  # waiting for text: nothing to plan
                continue
            slack = s.slack(now)
            past = s.past_acoustic()
            making = self._token_items(s, past, slack)
            tokens += making
            head = s.utterances[0]
            # a head still making tokens decodes as far as its tokens so far allow
            decodable = head.status is UtteranceStatus.DECODING or (
                head.status is UtteranceStatus.TOKENS and head.ready_frames(s.spec.runtime.tokens) > head.fed)
            if decodable and s.unread_s() < cfg.max_ahead_s:
                ready.append((s, head, slack, self._runs_dry_at(s, slack, now)))
            first_tokens |= not decodable and s.first_audio_at is None and head.status is UtteranceStatus.TOKENS
            nxt = s.utterances[len(past)] if len(past) < len(s.utterances) else None
            if nxt is not None and making:
                nxt = None  # one sentence at a time makes tokens: the next waits for this one's last
            if nxt is not None:
                if s.queued_audio_s(past) < cfg.acoustic_lookahead_s:
                    acoustic.append(((slack, nxt is not head, s.ready_since), s, nxt))
                    starts += s.first_audio_at is None and nxt is head
                else:
                    wake = min(wake, now + 0.05)  # the queue drains as audio plays
        if acoustic:
            acoustic.sort(key=lambda item: item[0])
            runtime = acoustic[0][1].spec.runtime
            plan.acoustic = [(s, u) for _, s, u in acoustic if s.spec.runtime is runtime][: cfg.acoustic_max_batch]
        plan.tokens = self._token_step(tokens)
        urgent_slack = max(cfg.urgent_slack_s, len(plan.acoustic) * acoustic_job_s)
        # a backlog of starts: the lead does not count and no step is filled
        backlog = 2 * starts >= max(2, cfg.acoustic_max_batch)
        lead_s, fill = (-math.inf, 0) if backlog else (cfg.lead_s, fill_rows)
        # urgent rows (about to run dry, first chunks), then the rest; each by when it runs dry
        decode = [((self._tier(u, dry_at, now, urgent_slack), dry_at, s.ready_since), s, u, slack)
                  for s, u, slack, dry_at in ready]
        if decode:
            decode.sort(key=lambda item: item[0])
            urgent = sum(item[0][0] < 2 or item[3] < lead_s for item in decode)
            if urgent or acoustic or first_tokens:
                decode = decode[: max(urgent, fill)] if urgent else []
            plan.decode = self._take([(key, s, u) for key, s, u, _ in decode], max_rows, free_slots)
            # a playing session about to run dry heads the queue: its step goes before the acoustic batch
            plan.decode_first = bool(decode) and decode[0][0][0] == 0 and decode[0][3] > -math.inf
        if plan.empty and wake < math.inf:
            plan.wake_at = wake
        return plan

    @staticmethod
    def _tier(u: UtteranceState, dry_at: float, now: float, urgent_slack: float) -> int:
        """0: about to run dry (or dry, or a start past its grace); 1: a first chunk; 2: the rest."""
        return 0 if dry_at < now + urgent_slack else 1 if u.chunk_index == 0 else 2

    def _runs_dry_at(self, s: SessionState, slack: float, now: float) -> float:
        """When `s` has (or had) no audio left to play: a playing session's buffer runs out then;
        a start's counts as running out `start_grace_s` after its text reached the engine."""
        if s.first_audio_at is None:
            return (now if s.first_text_at is None else s.first_text_at) + self.config.start_grace_s
        return now + slack

    @staticmethod
    def _take(ranked: Sequence[tuple[object, SessionState, UtteranceState]], max_rows: int,
              free_slots: Callable[[SessionState, UtteranceState], int] | None,
              ) -> list[tuple[SessionState, UtteranceState]]:
        """The first `max_rows` rows that can run: a row without a slot needs a free one."""
        out: list[tuple[SessionState, UtteranceState]] = []
        starts: dict[tuple[int, str], int] = {}
        for _, s, u in ranked:
            if len(out) >= max_rows:
                break
            if free_slots is not None and u.slot is None:
                key = (id(s.spec.runtime), u.precision)
                if key not in starts:
                    starts[key] = free_slots(s, u)
                if starts[key] <= 0:
                    continue
                starts[key] -= 1
            out.append((s, u))
        return out
