"""The scheduler: pure planning, no backend calls, no clocks of its own.

Each engine iteration it decides which sessions' next sentences go through the acoustic
stage and which sessions advance by one decoder step, most urgent first:

* a playing session about to run dry (less than `urgent_slack_s` buffered) goes first: a gap
  in audio that is playing is worse than a later start; then sessions waiting for their first
  audio; then the other playing sessions, the least buffered first (on one CPU core's worth of
  decoding, where a step serves one session, this keeps the first sessions of a burst playing
  while the rest start);
* deadlines first: a session with at least `lead_s` of audio ahead of its playback is stepped
  only when no session is waiting for its first audio or below its lead and no sentence
  waits for the acoustic stage (the GPU then has time to spare: unary requests and clients
  that buffer still get their audio as fast as it can be made);
* a session whose client has not yet taken `max_ahead_s` of the audio delivered to it is
  not stepped (backpressure: bounded memory per session, GPU time for those who need it;
  the session wakes the engine when its client catches up);
* a sentence is taken to the acoustic stage only when its session has less than
  `acoustic_lookahead_s` of audio waiting, so a long text queued at once never holds up the
  chunks of the sentence that is playing, nor other sessions' first audio;
* when a playing session is about to run dry, its step runs before the acoustic batch.
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
    decode: list[tuple[SessionState, UtteranceState]] = field(default_factory=list)
    decode_first: bool = False  # a playing session is close to running dry: its step goes first
    wake_at: float | None = None  # nothing to run now: plan again at this time (or on new input/reads)

    @property
    def empty(self) -> bool:
        return not self.acoustic and not self.decode


class Scheduler:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config

    def plan(self, sessions: Iterable[SessionState], now: float, max_rows: int,
             free_slots: Callable[[SessionState, UtteranceState], int] | None = None) -> Plan:
        """`free_slots(s, u)`: decoder slots free for `u`'s voice and precision (None: no slots,
        e.g. the staged decoder). An utterance that needs a slot is planned only while one is
        free, so waiting starts never crowd out the sessions that hold the slots."""
        cfg = self.config
        plan = Plan()
        acoustic: list[tuple[tuple[float, float], SessionState, UtteranceState]] = []
        decode: list[tuple[tuple[int, float, float], SessionState, UtteranceState]] = []
        wake = math.inf
        for s in sessions:
            if not s.utterances:  # waiting for text: nothing to plan
                continue
            slack = s.slack(now)
            head = s.utterances[0]
            if head.status is UtteranceStatus.DECODING and s.unread_s() < cfg.max_ahead_s:
                rank = 1 if head.chunk_index == 0 else 0 if slack < cfg.urgent_slack_s else 2
                decode.append(((rank, slack, s.ready_since), s, head))
            nxt = next((u for u in s.utterances if u.status is UtteranceStatus.ACOUSTIC), None)
            if nxt is not None:
                if s.queued_audio_s() < cfg.acoustic_lookahead_s:
                    acoustic.append(((slack, s.ready_since), s, nxt))
                else:
                    wake = min(wake, now + 0.05)  # the queue drains as audio plays
        if acoustic:
            acoustic.sort(key=lambda item: item[0])
            runtime = acoustic[0][1].spec.runtime
            plan.acoustic = [(s, u) for _, s, u in acoustic if s.spec.runtime is runtime][: cfg.acoustic_max_batch]
        if decode:
            decode.sort(key=lambda item: item[0])
            urgent = [item for item in decode if item[0][0] < 2 or item[0][1] < cfg.lead_s]
            if urgent or acoustic:
                decode = urgent
            plan.decode = self._take(decode, max_rows, free_slots)
            plan.decode_first = bool(decode) and decode[0][0][0] == 0
        if plan.empty and wake < math.inf:
            plan.wake_at = wake
        return plan

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
