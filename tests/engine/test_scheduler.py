"""The scheduler's decisions (pure planning: no backend calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.engine.config import BatchConfig
from service.engine.scheduler import AcousticCost, Scheduler
from service.engine.state import ReadCursor, SessionState, UtteranceState, UtteranceStatus, WorkSpec
from service.models.family import ChunkSchedule, SynthesisParams, VoiceRuntime
from service.models.registry import open_voice, recognise
from service.models.vits.runtime import PriorSample, Utterance
from service.text.frontend import PhonemizedSentence

NOW = 1000.0


LOOP = asyncio.new_event_loop()  # sessions name their event loop; nothing runs on it here


@pytest.fixture(scope="module")
def runtime(tiny_voice_path: Path) -> Iterator[VoiceRuntime]:
    yield open_voice(recognise(tiny_voice_path), "torch", "cpu", threads=1)
    LOOP.close()


class _Sink:
    def on_chunk(self, chunk: object) -> None: ...

    def on_done(self) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


def _session(runtime: VoiceRuntime, sid: int, *, playing_for: float | None = None, slack: float = 0.0,
             decoding: bool = True, acoustic: int = 0, unread: float = 0.0, frames: int = 400) -> SessionState:
    """A session whose head utterance is decoding (or waiting for the acoustic stage), that
    started playing `playing_for` seconds ago (None: no audio yet) with `slack` seconds left."""
    spec = WorkSpec(sid, "tiny", 0, SynthesisParams(), ChunkSchedule(), "fp32", None, runtime=runtime, sink=_Sink(),
                    loop=LOOP, cursor=ReadCursor(delivered_s=unread))
    s = SessionState(spec, None, ready_since=NOW - sid * 1e-3)
    sentence = PhonemizedSentence("hi", ["h", "i"], [1, 2, 3], [])
    if decoding:
        u = UtteranceState(0, sentence, UtteranceStatus.DECODING)
        prior = PriorSample.fixed(np.zeros((4, frames), np.float32))
        u.decoder_input = Utterance("hi", [1, 2, 3], prior, np.ones(3, np.int64), 0, [])
        s.utterances.append(u)
    for k in range(acoustic):
        s.utterances.append(UtteranceState(1 + k, sentence))
    if playing_for is not None:
        s.first_audio_at = NOW - playing_for
        s.samples_out = round((playing_for + slack) * runtime.sample_rate)
        if s.utterances and s.utterances[0].decoder_input is not None:
            s.utterances[0].chunk_index = 1
            s.utterances[0].samples_done = s.samples_out
    return s


def test_about_to_run_dry_then_first_chunks_then_least_buffered(runtime: VoiceRuntime) -> None:
    dry = _session(runtime, 1, playing_for=2.0, slack=0.2)
    low = _session(runtime, 2, playing_for=2.0, slack=0.4)
    mid = _session(runtime, 3, playing_for=2.0, slack=0.6)
    new = _session(runtime, 4)
    cfg = BatchConfig(urgent_slack_s=0.3)
    plan = Scheduler(cfg).plan([mid, low, new, dry], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [dry, new, low, mid]
    assert plan.decode_first  # the session running dry also goes before new sentences
    plan = Scheduler(cfg).plan([mid, low, new], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [new, low, mid]
    assert not plan.decode_first  # the head of the queue is a first chunk, not a playing session


def test_a_start_is_not_held_back_for_good_by_sessions_that_keep_running_dry(runtime: VoiceRuntime) -> None:
    """An engine behind its load (one row a step, playing sessions running dry): a start counts
    as running out of audio `start_grace_s` after its text came, and ranks by that with the
    sessions about to run dry; so first audio comes in bounded time, while a start that waited
    less never makes a playing session's gap longer."""
    cfg = BatchConfig(urgent_slack_s=0.3, start_grace_s=1.0)
    dry = [_session(runtime, 1 + k, playing_for=5.0, slack=-0.2 - 0.1 * k) for k in range(3)]  # dry since
    soon = _session(runtime, 4, playing_for=5.0, slack=0.1)  # NOW - 0.2, - 0.3, - 0.4; soon: NOW + 0.1
    start = _session(runtime, 9)
    start.first_text_at = NOW - 0.6  # waited, but less than the grace: runs out at NOW + 0.4
    plan = Scheduler(cfg).plan([*dry, start, soon], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [dry[2], dry[1], dry[0], soon, start] and plan.decode_first
    start.first_text_at = NOW - 1.35  # runs out at NOW - 0.35
    plan = Scheduler(cfg).plan([*dry, start, soon], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [dry[2], start, dry[1], dry[0], soon] and plan.decode_first
    start.first_text_at = NOW - 30.0
    plan = Scheduler(cfg).plan([*dry, start], NOW, max_rows=1)
    assert [s for s, _ in plan.decode] == [start] and not plan.decode_first


def test_a_long_queue_of_sentences_is_scanned_only_up_to_the_acoustic_stage(runtime: VoiceRuntime) -> None:
    """A session that queued a whole document: planning looks at the sentences through the
    acoustic stage, not at the hundreds waiting for it (each iteration plans every session)."""
    s = _session(runtime, 1, playing_for=1.0, slack=0.5, acoustic=500)
    past = s.past_acoustic()
    assert past == [s.utterances[0]]
    assert s.queued_audio_s() == pytest.approx(s.queued_audio_s(past)) and s.queued_audio_s() > 0

    class Untouchable(UtteranceState):
        def __getattribute__(self, name: str) -> object:
            if name != "__class__":
                raise AssertionError(f"the plan read {name} of a sentence behind the acoustic stage's queue")
            return super().__getattribute__(name)

    sentence = s.utterances[1].sentence
    for k in range(2, len(s.utterances)):
        s.utterances[k] = Untouchable(k, sentence)
    plan = Scheduler(BatchConfig(acoustic_lookahead_s=100.0)).plan([s], NOW, max_rows=8)
    assert [u.index for _, u in plan.acoustic] == [1] and [u for _, u in plan.decode] == [s.utterances[0]]


def test_row_cap_keeps_the_most_urgent(runtime: VoiceRuntime) -> None:
    sessions = [_session(runtime, i, playing_for=1.0, slack=0.1 * i) for i in range(1, 6)]
    plan = Scheduler(BatchConfig()).plan(sessions[::-1], NOW, max_rows=2)
    assert [s.spec.session_id for s, _ in plan.decode] == [1, 2]


def test_sessions_ahead_of_their_lead_wait_while_others_are_urgent(runtime: VoiceRuntime) -> None:
    cfg = BatchConfig(lead_s=1.0)
    ahead = _session(runtime, 1, playing_for=1.0, slack=2.5)
    behind = _session(runtime, 2, playing_for=1.0, slack=0.5)
    plan = Scheduler(cfg).plan([ahead, behind], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [behind]
    starting = _session(runtime, 3, decoding=False, acoustic=1)
    plan = Scheduler(cfg).plan([ahead, starting], NOW, max_rows=8)
    assert plan.decode == [] and [s for s, _ in plan.acoustic] == [starting]
    # Nothing urgent: the GPU's spare time goes to sessions already ahead.
    plan = Scheduler(cfg).plan([ahead], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [ahead]


def test_sessions_ahead_of_their_lead_wait_while_a_start_makes_its_first_tokens(runtime: VoiceRuntime) -> None:
    """An autoregressive start's first audio waits for its first chunk's tokens, one token step an
    iteration: a decoder step only to run a session further ahead would hold those steps up."""
    cfg = BatchConfig(lead_s=1.0)
    ahead = _session(runtime, 1, playing_for=1.0, slack=2.5)
    behind = _session(runtime, 2, playing_for=1.0, slack=0.5)
    starting = _session(runtime, 3, decoding=False)
    starting.utterances.append(UtteranceState(0, PhonemizedSentence("hi", ["h", "i"], [1, 2, 3], []),
                                              UtteranceStatus.TOKENS))
    plan = Scheduler(cfg).plan([ahead, starting], NOW, max_rows=8, fill_rows=4)
    assert plan.decode == [] and plan.tokens == [(starting, starting.utterances[0])]
    # below its lead a session still steps, and its step takes the next in line as before
    plan = Scheduler(cfg).plan([ahead, behind, starting], NOW, max_rows=8, fill_rows=4)
    assert [s for s, _ in plan.decode] == [behind, ahead] and len(plan.tokens) == 1
    # once the start plays, it no longer holds the others back
    starting.first_audio_at = NOW - 0.1
    starting.samples_out = round(2.0 * runtime.sample_rate)
    assert [s for s, _ in Scheduler(cfg).plan([ahead], NOW, max_rows=8).decode] == [ahead]
    plan = Scheduler(cfg).plan([ahead, starting], NOW, max_rows=8, fill_rows=4)
    assert [s for s, _ in plan.decode] == [ahead]


def test_a_step_for_urgent_rows_is_filled_with_the_next_in_line(runtime: VoiceRuntime) -> None:
    """Up to `fill_rows`, least buffered first; never past backpressure; no step only to fill."""
    cfg = BatchConfig(lead_s=1.0, max_ahead_s=3.0)
    behind = _session(runtime, 1, playing_for=1.0, slack=0.5)
    ahead = [_session(runtime, 2 + k, playing_for=1.0, slack=2.0 - 0.1 * k) for k in range(4)]
    held = _session(runtime, 9, playing_for=1.0, slack=1.2, unread=3.5)
    starting = _session(runtime, 10, decoding=False, acoustic=1)
    sessions = [*ahead, held, behind, starting]
    plan = Scheduler(cfg).plan(sessions, NOW, max_rows=8, fill_rows=3)
    assert [s.spec.session_id for s, _ in plan.decode] == [1, 5, 4]  # the urgent one, then the least ahead
    assert [s for s, _ in plan.acoustic] == [starting]
    plan = Scheduler(cfg).plan(sessions, NOW, max_rows=8, fill_rows=0)
    assert [s for s, _ in plan.decode] == [behind]
    # Nothing urgent, a sentence waits for the acoustic stage: no step is made only to fill one.
    plan = Scheduler(cfg).plan([*ahead, starting], NOW, max_rows=8, fill_rows=3)
    assert plan.decode == []


def test_backpressure_on_unread_audio(runtime: VoiceRuntime) -> None:
    cfg = BatchConfig(max_ahead_s=3.0)
    stalled = _session(runtime, 1, playing_for=1.0, slack=0.1, unread=3.5)
    reading = _session(runtime, 2, playing_for=1.0, slack=0.1, unread=0.5)
    plan = Scheduler(cfg).plan([stalled, reading], NOW, max_rows=8)
    assert [s for s, _ in plan.decode] == [reading]


def test_acoustic_lookahead_and_running_dry_goes_first(runtime: VoiceRuntime) -> None:
    cfg = BatchConfig(acoustic_lookahead_s=2.0, urgent_slack_s=0.3)
    # ~4.6 s of its current sentence still to decode: its next sentence waits.
    long_queue = _session(runtime, 1, playing_for=1.0, slack=0.1, acoustic=3, frames=400)
    fresh = _session(runtime, 2, decoding=False, acoustic=1)
    plan = Scheduler(cfg).plan([long_queue, fresh], NOW, max_rows=8)
    assert [s for s, _ in plan.acoustic] == [fresh]
    assert [s for s, _ in plan.decode] == [long_queue]
    assert plan.decode_first  # 0.1 s left to play: its step runs before the acoustic batch


def test_starts_wait_for_a_free_slot_and_never_crowd_out_slot_holders(runtime: VoiceRuntime) -> None:
    """With every decoder slot taken, new utterances (most urgent by rank) are left out and
    the sessions that hold the slots are stepped, so slots free up (no livelock)."""
    holders = [_session(runtime, i, playing_for=1.0, slack=0.5) for i in range(1, 4)]
    for k, s in enumerate(holders):
        s.utterances[0].slot = k
    starts = [_session(runtime, 10 + i) for i in range(5)]
    full = Scheduler(BatchConfig()).plan(starts + holders, NOW, max_rows=4, free_slots=lambda s, u: 0)
    assert {id(s) for s, _ in full.decode} == {id(s) for s in holders}
    one = Scheduler(BatchConfig()).plan(starts + holders, NOW, max_rows=4, free_slots=lambda s, u: 1)
    planned = [s for s, _ in one.decode]
    assert len(planned) == 4 and planned[0] in starts and {id(s) for s in planned[1:]} == {id(s) for s in holders}


def test_a_slow_acoustic_batch_makes_a_playing_session_urgent(runtime: VoiceRuntime) -> None:
    """On a CPU, seven new sessions' sentences take longer than the first session's first chunk
    plays: that session's next step goes first. On a GPU (a fast stage) nothing changes."""
    cfg = BatchConfig(urgent_slack_s=0.3)
    playing = _session(runtime, 1, playing_for=0.05, slack=0.35)
    starting = [_session(runtime, 2 + k, decoding=False, acoustic=1) for k in range(7)]
    slow = Scheduler(cfg).plan([playing, *starting], NOW, max_rows=1, acoustic_job_s=0.06)  # 0.42 s > 0.35 s
    assert slow.decode_first and [s for s, _ in slow.decode] == [playing]
    assert len(slow.acoustic) == 7
    fast = Scheduler(cfg).plan([playing, *starting], NOW, max_rows=1, acoustic_job_s=0.0005)
    assert not fast.decode_first and len(fast.acoustic) == 7


def test_a_backlog_of_starts_steps_only_the_rows_that_cannot_wait(runtime: VoiceRuntime) -> None:
    """Half an acoustic batch of sessions or more waiting for the acoustic stage to begin their
    audio: sessions below their lead but not about to run dry wait, and no step is filled;
    first chunks and the dry-soon step."""
    cfg = BatchConfig(lead_s=1.0, urgent_slack_s=0.3, acoustic_max_batch=4)
    dry = _session(runtime, 1, playing_for=1.0, slack=0.2)
    below_lead = _session(runtime, 2, playing_for=1.0, slack=0.6)
    ahead = _session(runtime, 3, playing_for=1.0, slack=2.0)
    fresh = _session(runtime, 4)  # through the acoustic stage: its first chunk is next
    starts = [_session(runtime, 10 + k, decoding=False, acoustic=1) for k in range(5)]
    for waiting in (starts, starts[:2]):  # more than a batch; half of one
        plan = Scheduler(cfg).plan([dry, below_lead, ahead, fresh, *waiting], NOW, max_rows=8, fill_rows=8)
        assert len(plan.acoustic) == min(4, len(waiting))
        assert [s for s, _ in plan.decode] == [dry, fresh]
    # One start: as before, the sessions below their lead step too, and the fill takes the rest.
    plan = Scheduler(cfg).plan([dry, below_lead, ahead, fresh, starts[0]], NOW, max_rows=8, fill_rows=8)
    assert [s for s, _ in plan.decode] == [dry, fresh, below_lead, ahead]
    # A full batch of the next sentences of sessions already playing: no backlog of starts.
    playing = [_session(runtime, 20 + k, playing_for=1.0, slack=1.5 + 0.1 * k, acoustic=1) for k in range(4)]
    lookahead = BatchConfig(lead_s=1.0, urgent_slack_s=0.3, acoustic_max_batch=4, acoustic_lookahead_s=100.0)
    plan = Scheduler(lookahead).plan([below_lead, *playing], NOW, max_rows=8)
    assert len(plan.acoustic) == 4 and [s for s, _ in plan.decode] == [below_lead]


def test_first_sentences_go_to_the_acoustic_stage_before_next_ones(runtime: VoiceRuntime) -> None:
    """Both sessions wait for their first audio; one is through the acoustic stage already and
    its next sentence does not make its first audio come sooner."""
    started = _session(runtime, 2, acoustic=1)  # readied before the other
    waiting = _session(runtime, 1, decoding=False, acoustic=1)
    assert started.ready_since < waiting.ready_since
    cfg = BatchConfig(acoustic_max_batch=1, acoustic_lookahead_s=100.0)
    plan = Scheduler(cfg).plan([started, waiting], NOW, max_rows=8)
    assert [s for s, _ in plan.acoustic] == [waiting]
    plan = Scheduler(cfg).plan([started], NOW, max_rows=8)
    assert [s for s, _ in plan.acoustic] == [started]  # alone, its next sentence goes


def test_the_acoustic_cost_per_sentence_weighs_calls_by_their_sentences() -> None:
    """A one-sentence call's fixed cost must not make the next 64-sentence batch look 64 times
    that long (which would make every playing session look about to run dry)."""
    cost = AcousticCost()
    assert cost.per_sentence == 0.0
    cost.add(0.020, 1)
    assert cost.per_sentence == pytest.approx(0.020)
    cost.add(0.053, 64)
    assert cost.per_sentence == pytest.approx((0.8 * 0.020 + 0.053) / (0.8 + 64))
    assert cost.per_sentence < 0.0011
    for _ in range(40):  # the past fades
        cost.add(0.022, 64)
    assert cost.per_sentence == pytest.approx(0.022 / 64, rel=1e-3)
