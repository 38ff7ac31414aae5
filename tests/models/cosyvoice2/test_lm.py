"""Our speech-token LM against the official `Qwen2LM` (around transformers' `Qwen2ForCausalLM`)
on the same random weights: log-probabilities at the prompt and at each decoding step, alone and
batched with another session of a different length."""

from __future__ import annotations

import torch

from service.models.cosyvoice2.check import widen_step_masks
from service.models.cosyvoice2.lm import (
    KVCache,
    Qwen2Config,
    SamplingConfig,
    generate,
    load_lm,
    nuclei,
    sample_token,
)
from service.models.cosyvoice2.official import official
from service.models.cosyvoice2.official import official_lm as official_lm_class

SMALL = Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                    vocab_size=300, speech_token_size=50)


def official_lm(config: Qwen2Config, seed: int) -> torch.nn.Module:
    """The official `Qwen2LM` with `config`'s shapes and random weights (norms near 1)."""
    model = official_lm_class(config)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=rng)) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=rng) * 0.2)
    return model.eval()


def official_steps(model: torch.nn.Module, text: torch.Tensor, prompt_speech: torch.Tensor,
                   tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities after the prompt, then after each of `tokens` fed back, as the official
    inference loop computes them (each step's mask over cache and step, as the transformers
    release upstream pins builds it; see test_generation_writes_the_official_tokens)."""
    with torch.inference_mode():
        emb = model.llm.model.model.embed_tokens(text[None])
        sos = model.llm_embedding.weight[0].reshape(1, 1, -1)
        task = model.llm_embedding.weight[1].reshape(1, 1, -1)
        lm_input = torch.cat([sos, emb, task, model.speech_embedding(prompt_speech[None])], dim=1)
        out, cache, total = [], None, lm_input.shape[1]
        for token in [None, *tokens]:
            if token is not None:
                lm_input = model.speech_embedding.weight[token].reshape(1, 1, -1)
            masks = torch.tril(torch.ones((1, total, total))).to(torch.bool)
            y, cache = model.llm.forward_one_step(lm_input, masks=masks, cache=cache)
            out.append(model.llm_decoder(y[:, -1]).log_softmax(dim=-1)[0])
            total += 1
    return out


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_log_probs_equal_the_official_lm_alone_and_batched() -> None:
    theirs = official_lm(SMALL, seed=0)
    ours = load_lm(SMALL, theirs.state_dict())
    g = torch.Generator().manual_seed(1)
    sessions = [(torch.randint(0, SMALL.vocab_size, (11,), generator=g), torch.randint(0, 50, (5,), generator=g)),
                (torch.randint(0, SMALL.vocab_size, (4,), generator=g), torch.randint(0, 50, (2,), generator=g))]
    tokens = [[3, 17, 42], [8, 0, 49]]
    want = [official_steps(theirs, text, speech, toks) for (text, speech), toks in zip(sessions, tokens, strict=True)]
    with torch.inference_mode():
        prompts = [ours.prompt(text, speech) for text, speech in sessions]
        # Alone: each session in its own cache row, one at a time.
        alone = KVCache.empty(SMALL, rows=2, capacity=32)
        for i, (prompt, toks) in enumerate(zip(prompts, tokens, strict=True)):
            row = torch.tensor([i])
            got = [ours(prompt[None], alone, row)[0]]
            for t in toks:
                got.append(ours(ours.speech_embedding.weight[t][None, None], alone, row)[0])
            for step, (a, b) in enumerate(zip(got, want[i], strict=True)):
                assert max_rel(a, b) <= 1e-4, (i, step, max_rel(a, b))
        # Batched: both prompts in one padded call (rows in reverse order), then every step together.
        batched = KVCache.empty(SMALL, rows=2, capacity=32)
        rows = torch.tensor([1, 0])
        lengths = torch.tensor([len(p) for p in prompts])
        x = torch.zeros(2, int(lengths.max()), SMALL.hidden_size)
        for i, p in enumerate(prompts):
            x[i, :len(p)] = p
        steps = [ours(x, batched, rows, lengths)]
        for k in range(3):
            feed = ours.speech_embedding.weight[torch.tensor([tokens[0][k], tokens[1][k]])][:, None]
            steps.append(ours(feed, batched, rows))
        for step, got_b in enumerate(steps):
            for i in range(2):
                assert max_rel(got_b[i], want[i][step]) <= 1e-4, (i, step, max_rel(got_b[i], want[i][step]))
        assert batched.lengths.tolist() == [len(prompts[1]) + 3, len(prompts[0]) + 3]


def test_sampling_draws_what_the_official_sampler_draws() -> None:
    """Same scores, same seed (ours from a session generator, theirs from the global RNG): the
    same tokens, through nucleus picks, repetition fallbacks and end-of-speech redraws. Ours
    take every step's candidates from one batch (`nuclei`), as the engine's token steps do."""
    ras_sampling = official("cosyvoice.utils.common").ras_sampling

    config = SamplingConfig()
    g = torch.Generator().manual_seed(3)
    # Peaked scores so that tokens repeat and the repetition rule fires.
    scores = [(torch.randn(SMALL.speech_vocab, generator=g) * 4).log_softmax(0) for _ in range(60)]
    eos = SMALL.speech_token_size
    for i in (5, 6):  # ends of speech the first steps must redraw
        scores[i][eos] = scores[i].max()
    theirs: list[int] = []
    redraws = 0
    torch.manual_seed(11)
    for i, s in enumerate(scores):
        for _ in range(101):
            top = int(ras_sampling(s, theirs, 25, top_p=config.top_p, top_k=config.top_k,
                                   win_size=config.win_size, tau_r=config.tau_r))
            if i >= 10 or top != eos:
                break
            redraws += 1
        theirs.append(top)
    assert redraws > 0
    ours: list[int] = []
    session = torch.Generator().manual_seed(11)
    for i, nucleus in enumerate(nuclei(torch.stack(scores), config)):
        ours.append(sample_token(nucleus, ours, config, session, redraw=eos if i < 10 else None))
    assert ours == theirs
    assert len(set(ours)) < len(ours)  # repeats happened, so the fallback path ran


def test_candidates_are_the_whole_stable_sorts_also_where_scores_tie() -> None:
    """`nuclei` takes the top_k + 1 largest scores, not a sort of the vocabulary: the same
    candidates, in the same order, as upstream's stable sort, for rows with ties in or at the
    edge of the nucleus too (those rows are sorted whole)."""
    config = SamplingConfig()
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(6, 400, generator=g) * 3
    scores[1, :40] = 9.0  # ties across the whole nucleus
    scores[2, 10] = scores[2, 11] = scores[2].max() + 1  # two tied leaders
    scores[3] = 0.0  # uniform: every score ties
    scores[4, 7] = scores[4, 8] = scores[4].topk(config.top_k).values[-1]  # a tie at the nucleus' last place
    logp = scores.log_softmax(-1)
    for row, nucleus in zip(logp, nuclei(logp, config), strict=True):
        probs = row.softmax(0)
        ranked, order = probs.sort(descending=True, stable=True)
        before = torch.cat([ranked.new_zeros(1), ranked.cumsum(0)[:-1]])
        count = max(1, min(config.top_k, int((before < config.top_p).sum())))
        assert torch.equal(nucleus.top, ranked[:count]) and torch.equal(nucleus.ids, order[:count])
        assert torch.equal(nucleus.probs, probs)


def test_generation_writes_the_official_tokens() -> None:
    """A whole session: prompt text and speech, then upstream's inference loop with its sampler
    against ours with a session generator, same seed: the same speech tokens, end included."""
    import functools

    theirs = official_lm(SMALL, seed=4)
    ours = load_lm(SMALL, theirs.state_dict())
    common = official("cosyvoice.utils.common")
    theirs.sampling = functools.partial(common.ras_sampling, top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    # Upstream's loop passes a one-position mask with each decode step; under the transformers
    # release upstream pins (4.51) that mask covers the cache too, under ours (5.x) the step would
    # see only itself. Give its steps the mask over cache and step that its pinned release builds.
    widen_step_masks(theirs)
    g = torch.Generator().manual_seed(2)
    text = torch.randint(0, SMALL.vocab_size, (3,), generator=g)
    prompt_text = torch.randint(0, SMALL.vocab_size, (2,), generator=g)
    prompt_speech = torch.randint(0, SMALL.speech_token_size, (4,), generator=g)
    with torch.inference_mode():
        # Random weights rarely end speech: bias the end-of-speech score so that it ends
        # somewhere between the minimum and maximum length.
        for model in (theirs, ours):
            model.llm_decoder.bias[SMALL.speech_token_size] += 4.0
        torch.manual_seed(9)
        want = list(theirs.inference(text[None], torch.tensor([3]), prompt_text[None], torch.tensor([2]),
                                     prompt_speech[None], torch.tensor([4]), embedding=torch.zeros(1, 0)))
        got = list(generate(ours, text, prompt_text, prompt_speech, SamplingConfig(), torch.Generator().manual_seed(9)))
    assert got == want
    assert 0 < len(got) < 60  # ended by end of speech before the maximum (20 per text token)
