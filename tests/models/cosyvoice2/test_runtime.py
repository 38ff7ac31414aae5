"""A CosyVoice2 directory served (`CosyVoice2Runtime`), on the random-weight test directory:
batched token steps give each sentence what it gets alone, the slot decoder's steps stream
exactly the reference audio (also while the tokens are still being made), KV cache rows grow
and come back, a sentence whose scores cannot be sampled fails alone, and the whole path equals
the official code (`cadenza voices check`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from service.audio.quality import psnr_db
from service.models import registry
from service.models.cosyvoice2.config import ConfigError
from service.models.cosyvoice2.flow import HalfEstimator
from service.models.cosyvoice2.runtime import (
    COSYVOICE2_FP32_PINS,
    MAX_PROMPT_SPEECH_TOKENS,
    CosyVoice2Runtime,
    PinSplit,
    SpeechUtterance,
    load_speakers,
    split_pins,
)
from service.models.family import AcousticJob, StepRows, SynthesisParams, TextFrontend, utterance_rng

TEXTS = ["Hello there.", "Thank you for calling, how can I help you today?", "Goodbye!"]


@pytest.fixture(scope="module")
def runtime(cosyvoice2_dir: Path) -> CosyVoice2Runtime:
    rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cpu")
    assert isinstance(rt, CosyVoice2Runtime)
    return rt


@pytest.fixture(scope="module")
def frontend(runtime: CosyVoice2Runtime) -> TextFrontend:
    return registry.open_frontend(runtime.info.frontend_key)


def jobs(frontend: TextFrontend, texts: list[str], seed: int = 1, sid: int | None = 0) -> list[AcousticJob]:
    sentences = [s for t in texts for s in frontend.sentences(t)]
    return [AcousticJob(s, sid, SynthesisParams(seed=seed), utterance_rng(seed, s.phoneme_ids)) for s in sentences]


def tokens_of(runtime: CosyVoice2Runtime, batch: list[AcousticJob]) -> list[SpeechUtterance]:
    utts = [u for u in runtime.acoustic_batch(batch) if isinstance(u, SpeechUtterance)]
    while not all(u.complete for u in utts):
        runtime.tokens.step(utts)
    return utts


def test_speakers_are_the_saved_ones_in_name_order(runtime: CosyVoice2Runtime, cosyvoice2_dir: Path) -> None:
    table = torch.load(cosyvoice2_dir / "spk2info.pt", weights_only=True)
    zero_shot, sft = load_speakers(cosyvoice2_dir / "spk2info.pt", 80, 192)
    assert torch.equal(zero_shot.prompt_text, table["prompt_a"]["prompt_text"][0].long())
    assert torch.equal(zero_shot.llm_prompt_speech, table["prompt_a"]["llm_prompt_speech_token"][0].long())
    assert zero_shot.prompt_mel.shape == (1, 2 * zero_shot.flow_prompt_tokens.shape[1], 80)
    assert torch.equal(sft.embedding, table["sft_b"]["embedding"])
    assert sft.prompt_text.numel() == sft.llm_prompt_speech.numel() == sft.prompt_mel.numel() == 0
    assert len(runtime.speakers) == runtime.info.num_speakers == 2


def test_a_speaker_prompt_too_long_for_the_kv_cache_is_refused_at_load(cosyvoice2_dir: Path, tmp_path: Path) -> None:
    table = torch.load(cosyvoice2_dir / "spk2info.pt", weights_only=True)
    table["prompt_a"]["llm_prompt_speech_token"] = torch.zeros(1, MAX_PROMPT_SPEECH_TOKENS + 1, dtype=torch.int32)
    torch.save(table, tmp_path / "spk2info.pt")
    with pytest.raises(ConfigError, match=r"speaker 'prompt_a': a speaker prompt of .* shorter recording"):
        load_speakers(tmp_path / "spk2info.pt", 80, 192)


def test_batched_steps_give_each_sentence_what_it_gets_alone(runtime: CosyVoice2Runtime,
                                                              frontend: TextFrontend) -> None:
    """Each sentence draws from its own generator, and a padded batch's scores equal its scores
    alone to rounding, so the tokens are the same. Rounding can still flip a draw that falls on
    a near-tie (random weights give flat scores with many), after which the two runs part: the
    test allows one sentence in four to part, and only after its first 10 tokens (a wrong row,
    prompt or generator parts them at once). The thread count is fixed, since earlier tests in
    the same process may have changed it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batched_equals_alone(runtime, frontend)
    finally:
        torch.set_num_threads(threads)


def batched_equals_alone(runtime: CosyVoice2Runtime, frontend: TextFrontend) -> None:
    together = tokens_of(runtime, jobs(frontend, TEXTS) + jobs(frontend, TEXTS[:1], sid=1))
    alone = [tokens_of(runtime, [job])[0] for job in jobs(frontend, TEXTS) + jobs(frontend, TEXTS[:1], sid=1)]
    same = [a.tokens == b.tokens for a, b in zip(together, alone, strict=True)]
    assert sum(same) >= len(same) - 1, same
    assert all(a.tokens[:10] == b.tokens[:10] for a, b in zip(together, alone, strict=True))
    assert together[0].tokens != together[-1].tokens  # another speaker, another prompt: other tokens
    for a, b, equal in zip(together, alone, same, strict=True):
        assert a.min_tokens <= len(a.tokens) <= a.max_tokens
        if equal:
            np.testing.assert_allclose(runtime.reference(a), runtime.reference(b), atol=1e-5)


def test_the_slot_decoders_steps_stream_the_reference(runtime: CosyVoice2Runtime,
                                                               frontend: TextFrontend) -> None:
    utts = tokens_of(runtime, jobs(frontend, TEXTS[1:2], seed=4) + jobs(frontend, TEXTS[2:], seed=5))
    decoder = runtime.streaming_decoder("fp32", 4, max_rows=4, graphs=False, graph_frames=())
    for slot, u in enumerate(utts):
        assert decoder.start(slot, u.prior)
    fed, pieces = [0, 0], [[], []]
    frames = 40  # a first step, then steps of 64 frames: not the chunk grid of the token-to-audio stage
    while any(f < u.frames for f, u in zip(fed, utts, strict=True)):
        audio = decoder.step(StepRows([0, 1], list(fed), frames, None)).numpy()
        for row in range(2):
            pieces[row].append(audio[row])
            fed[row] += frames
        frames = 64
    for row, u in enumerate(utts):
        streamed = np.concatenate(pieces[row])
        want = runtime.reference(u)
        assert len(want) == u.frames * runtime.hop
        # The two rows share each step's solve (one's chunk beside the other's last chunk): their
        # mels equal each alone to kernel rounding (test_flow), which the vocoder's sine phase,
        # summed over each chunk, carries into the waveform as rounding of up to about 1e-3.
        assert psnr_db(want, streamed[: len(want)]) >= 70.0
        assert not streamed[len(want):].any()  # past the end: zeros
        assert np.abs(want).max() > 0.01


def test_decoding_starts_before_the_tokens_are_complete(runtime: CosyVoice2Runtime,
                                                        frontend: TextFrontend) -> None:
    """A sentence decoded as far as its tokens so far allow, step after step while they are
    made, streams the reference made from all of them: each streaming chunk needs only the
    tokens up to its lookahead."""
    (u,) = [v for v in runtime.acoustic_batch(jobs(frontend, TEXTS[1:2], seed=4)) if isinstance(v, SpeechUtterance)]
    stage = runtime.tokens
    decoder = runtime.streaming_decoder("fp32", 1, max_rows=1, graphs=False, graph_frames=())
    assert decoder.start(0, u.prior)
    fed, pieces, early = 0, [], 0
    while fed < u.frames or not u.complete:
        if not u.complete:
            stage.step([u])
        ready = stage.ready_frames(u)
        assert ready <= u.frames and (u.complete or ready < u.frames)  # the last chunk waits for the last token
        if ready > fed:
            pieces.append(decoder.step(StepRows([0], [fed], ready - fed, None)).numpy()[0])
            early += not u.complete
            fed = ready
    assert early >= 2  # more than one step's audio came before the last token
    want = runtime.reference(u)
    np.testing.assert_allclose(np.concatenate(pieces), want, atol=1e-5, rtol=0)


def test_a_fault_in_one_sentence_of_a_token_step_fails_only_that_one(runtime: CosyVoice2Runtime,
                                                                     frontend: TextFrontend) -> None:
    """A batched token step that raises is taken again sentence by sentence from where each was
    (its cache row and length): the sentence that raises alone fails, the others go on with the
    tokens they make without it. The fault here is the one a guard redo once caused: a sentence
    still making tokens without its cache row."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def started() -> list[SpeechUtterance]:
            utts = [u for u in runtime.acoustic_batch(jobs(frontend, TEXTS, seed=8)) if isinstance(u, SpeechUtterance)]
            for _ in range(3):
                runtime.tokens.step(utts)
            assert not any(u.complete for u in utts)
            return utts

        stage = runtime.tokens
        faulty = started()
        broken = faulty[1]
        stage.release(broken)  # its row given back while it is still making tokens
        first = stage.step(faulty)
        assert isinstance(first[1], AssertionError) and broken.complete and broken.failed is first[1]
        assert first[0] is False and first[2] is False
        for u in (faulty[0], faulty[2]):
            assert u.row is not None and int(stage.cache.lengths[u.row]) == u.cached
        while not all(u.complete for u in faulty):
            stage.step(faulty)

        control = started()
        stage.release(control[1])
        control[1].complete = True
        for u in (control[0], control[2]):
            stage.step([u])  # as the faulty step went on: each alone
        while not all(u.complete for u in control):
            stage.step(control)
        for i in (0, 2):
            assert faulty[i].failed is None and faulty[i].tokens == control[i].tokens
        assert len(stage.free) == len(stage.cache.lengths)  # every row back
    finally:
        torch.set_num_threads(threads)


def test_a_sentence_with_non_finite_scores_fails_alone_and_its_row_is_clean_for_the_next(
        runtime: CosyVoice2Runtime, frontend: TextFrontend) -> None:
    """Non-finite keys and values in one sentence's row (what an FP16 overflow or a corrupted
    kernel leaves) fail that sentence alone, and the row's next sentence makes what it makes on
    a clean row: positions past its length are masked, but 0 x NaN would still reach it."""
    stage = runtime.tokens
    # a short sentence batched with a longer one: its row is read past its length (masked)
    pair = [TEXTS[0], TEXTS[1]]
    clean = [u.tokens for u in tokens_of(runtime, jobs(frontend, pair, seed=5))]
    utts = [u for u in runtime.acoustic_batch(jobs(frontend, TEXTS, seed=4)) if isinstance(u, SpeechUtterance)]
    stage.step(utts)
    poisoned = utts[1]
    row = poisoned.row
    assert row is not None
    for layer in stage.cache.layers:
        layer[:, row].fill_(float("nan"))
    results = stage.step(utts)
    assert isinstance(results[1], RuntimeError) and poisoned.failed is results[1] and poisoned.row is None
    assert results[0] is False and results[2] is False  # the others go on
    while not all(u.complete for u in utts):
        stage.step(utts)
    stage.free.remove(row)
    stage.free.append(row)  # the next row taken: the short sentence's
    again = [u for u in runtime.acoustic_batch(jobs(frontend, pair, seed=5)) if isinstance(u, SpeechUtterance)]
    assert again[0].row == row
    while not all(u.complete for u in again):
        stage.step(again)
    assert not any(u.failed for u in again) and [u.tokens for u in again] == clean


def test_kv_rows_grow_when_full_and_come_back(runtime: CosyVoice2Runtime, frontend: TextFrontend) -> None:
    stage = runtime.tokens
    many = jobs(frontend, TEXTS * 4, seed=7)
    utts = [u for u in runtime.acoustic_batch(many) if isinstance(u, SpeechUtterance)]
    rows = len(stage.cache.lengths)
    assert rows >= len(many) and len({u.row for u in utts}) == len(many)
    stage.release(utts[0])  # its session ended before its tokens did
    assert utts[0].row is None and len(stage.free) == rows - len(many) + 1
    rest = utts[1:]
    while not all(u.complete for u in rest):
        stage.step(rest)
    assert len(stage.free) == rows
    again = tokens_of(runtime, jobs(frontend, TEXTS * 4, seed=7)[1:])  # the rows reused: the same tokens
    assert [u.tokens for u in again] == [u.tokens for u in rest]


def test_a_sentence_whose_scores_cannot_be_sampled_fails_alone(cosyvoice2_dir: Path, tmp_path: Path) -> None:
    """An LM that puts all its mass on end of speech: a sentence that may end draws it and is
    complete; one that may not end yet fails after upstream's 100 redraws, alone."""
    broken = tmp_path / "CosyVoice2-eos"
    shutil.copytree(cosyvoice2_dir, broken)
    state = torch.load(broken / "llm.pt", weights_only=True)
    state["llm_decoder.bias"][runtime_eos(state)] += 100.0
    torch.save(state, broken / "llm.pt")
    rt = registry.open_voice(registry.recognise(broken), "auto", "cpu")
    assert isinstance(rt, CosyVoice2Runtime)
    sentences = registry.open_frontend(rt.info.frontend_key).sentences("Hello there. Goodbye.")
    batch = [AcousticJob(s, 0, SynthesisParams(seed=1), utterance_rng(1, s.phoneme_ids)) for s in sentences]
    prefilled = rt.acoustic_batch(batch)  # the first draw fails: reported by the next step, per sentence
    assert all(isinstance(u, SpeechUtterance) and u.failed and u.row is None for u in prefilled)
    assert all(isinstance(r, RuntimeError) for r in rt.tokens.step(prefilled))
    may_end, may_not = make_two(rt, batch)
    may_end.min_tokens = 0
    results = rt.tokens.step([may_end, may_not])
    assert results[0] is True and may_end.complete and not may_end.failed
    assert isinstance(results[1], RuntimeError) and "end of speech" in str(results[1])
    assert len(rt.tokens.free) == len(rt.tokens.cache.lengths)  # both rows given back


def runtime_eos(state: dict[str, torch.Tensor]) -> int:
    return int(state["llm_decoder.weight"].shape[0]) - 3


def make_two(rt: CosyVoice2Runtime, batch: list[AcousticJob]) -> list[SpeechUtterance]:
    """Two sentences past their prefill, as the acoustic stage leaves them (their first token
    drawn by hand: the broken LM cannot draw one)."""
    out = []
    for job in batch:
        utt = SpeechUtterance(job.sentence.text, list(job.sentence.phoneme_ids), rt.speakers[0], 0, 1, 2,
                              torch.Generator().manual_seed(1), 2 * len(job.sentence.phoneme_ids),
                              20 * len(job.sentence.phoneme_ids), 2, tokens=[5])
        utt.row = rt.tokens._take_row()
        rt.tokens.cache.lengths[utt.row], utt.cached = 3, 3
        out.append(utt)
    return out


def test_a_speaking_rate_is_refused_with_what_to_change(runtime: CosyVoice2Runtime,
                                                         frontend: TextFrontend) -> None:
    job = jobs(frontend, ["Hello."])[0]
    job.params = SynthesisParams(length_scale=1.5)
    with pytest.raises(ValueError, match="leave the speaking rate at its default"):
        runtime.acoustic_batch([job])


def test_the_voice_equals_the_official_code(runtime: CosyVoice2Runtime, frontend: TextFrontend) -> None:
    """`cadenza voices check`'s comparison: the official LM's tokens and its streamed audio
    against ours, same weights and seeds (the README's figure: min_psnr_db >= 60)."""
    parity = registry.family("cosyvoice2").parity(runtime, None)
    for sentence in frontend.sentences("Hello, and welcome to Cadenza. Is there anything else?"):
        theirs, ours = parity.pair(sentence)
        assert len(theirs) == len(ours) > 0
        assert psnr_db(theirs, ours) >= 60


def test_fp32_pins_split_into_the_estimators_and_the_vocoders() -> None:
    assert split_pins(COSYVOICE2_FP32_PINS) == PinSplit(True, (), ("conv_post",))
    assert split_pins(("flow.decoder.estimator.time_mlp", "hift.ups.*", "hift")) == PinSplit(
        False, ("time_mlp",), ("ups.*", "*"))
    assert split_pins(("flow.decoder",)).estimator_fp32 and split_pins(("flow*",)).estimator_fp32
    assert split_pins(()) == PinSplit(False, (), ())
    with pytest.raises(ValueError, match=r"'conv_post' names no part .* pin flow .* under flow\.decoder\.estimator\. "
                                         r"or hift\."):
        split_pins(("conv_post",))


def test_an_unknown_pin_fails_when_the_voice_opens(cosyvoice2_dir: Path) -> None:
    with pytest.raises(ValueError, match="'lm' names no part"):
        registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cpu", pins=("lm",))


def test_with_flow_unpinned_fp16_solves_with_an_fp16_estimator_beside_the_fp32_flow(
        runtime: CosyVoice2Runtime, frontend: TextFrontend, cosyvoice2_dir: Path) -> None:
    """The FP16 twin shares the flow's encoder and every other module: only the estimator is a
    second copy, in FP16 (pins FP32), inside a solve whose state stays FP32. Its mel is FP16's
    rounding away from FP32's; the FP32 flow is untouched."""
    half_rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cpu",
                                  pins=("hift.conv_post", "flow.decoder.estimator.final_proj"))
    assert isinstance(half_rt, CosyVoice2Runtime)
    fp32 = half_rt.token2wav("fp32").flow
    flow = half_rt.token2wav("fp16").flow
    assert fp32 is runtime.token2wav("fp32").flow and runtime.token2wav("fp16").flow is fp32  # flow pinned there
    assert flow.encoder is fp32.encoder and flow.input_embedding is fp32.input_embedding and flow.noise is fp32.noise
    half = flow.decoder.estimator
    assert isinstance(half, HalfEstimator)
    assert half.estimator.time_mlp.linear_1.weight.dtype == torch.float16
    assert half.estimator.final_proj.weight.dtype == torch.float32  # pinned
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    utt = tokens_of(half_rt, jobs(frontend, TEXTS[1:2], seed=6))[0]
    state32, state16 = half_rt.stream_state(utt, "fp32"), half_rt.stream_state(utt, "fp16")
    tokens = torch.tensor([utt.tokens])
    with torch.inference_mode():
        want = fp32.batch([half_rt.token2wav("fp32").request(state32, tokens, True)], streaming=False,
                          finalize=True)[0]
        got = flow.batch([half_rt.token2wav("fp16").request(state16, tokens, True)], streaming=False,
                         finalize=True)[0]
    assert got.dtype == torch.float32 and got.shape == want.shape
    mel_db = psnr_db(want.numpy().ravel(), got.numpy().ravel())
    print(f"FP16 estimator against FP32: mel {mel_db:.1f} dB")
    assert mel_db >= 45.0
    audio = half_rt.reference(utt, "fp16")
    assert np.isfinite(audio).all() and len(audio) == len(half_rt.reference(utt))


def test_compiling_the_decoder_applies_to_cuda_only(cosyvoice2_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="service.models.cosyvoice2.runtime"):
        rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cpu", compile_decoder=True)
    assert isinstance(rt, CosyVoice2Runtime) and rt.token2wav("fp32").flow.graphed is None
    assert "compiling the decoder applies to CUDA only: the flow runs eagerly on cpu" in caplog.text
