"""Our token-to-mel flow against the official `CausalMaskedDiffWithXvec` (conformer encoder,
estimator, solver) on the same random weights, tokens, prompt and speaker: full context, and the
streaming calls upstream makes (chunk masks; lookahead tokens held back until the last call)."""

from __future__ import annotations

import logging

import pytest
import torch

from service.models.cosyvoice2.encoder import EncoderConfig
from service.models.cosyvoice2.estimator import EstimatorConfig
from service.models.cosyvoice2.flow import FlowConfig, FlowRequest, GraphedEncoder, load_flow
from service.models.cosyvoice2.official import official_flow as official_flow_class
from service.models.cuda_graphs import GraphCapturer

from .test_estimator import official as official_estimator

# Upstream fixes the encoder's width at 512 (its lookahead and upsample layers); the rest is small.
SMALL = FlowConfig(
    vocab_size=97,
    encoder=EncoderConfig(attention_heads=8, linear_units=64, num_blocks=2, num_up_blocks=1, static_chunk_size=5),
    estimator=EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2,
                              static_chunk_size=10),
)


def official_flow(config: FlowConfig, seed: int) -> torch.nn.Module:
    """The official class with `config`'s shapes and random weights (the estimator's from
    test_estimator's rule)."""
    model = official_flow_class(config, estimator=official_estimator(config.estimator, seed=seed + 1))
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("decoder."):
                continue  # the estimator's own random weights (official_estimator)
            if "norm" in name or name.endswith("out.1.weight") or name.endswith("out.1.bias"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=rng))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 16
                p.copy_(torch.randn(p.shape, generator=rng) / fan_in ** 0.5)
    return model.eval()


@pytest.mark.parametrize(("streaming", "finalize"), [(False, True), (True, True), (True, False)])
def test_mel_equals_the_official_flow(streaming: bool, finalize: bool) -> None:
    theirs = official_flow(SMALL, seed=0)
    ours = load_flow(SMALL, theirs.state_dict())
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, SMALL.vocab_size, (1, 13), generator=g)
    prompt_tokens = torch.randint(0, SMALL.vocab_size, (1, 4), generator=g)
    prompt_mel = torch.randn(1, 8, 80, generator=g)
    embedding = torch.randn(1, SMALL.spk_embed_dim, generator=g)
    with torch.no_grad():
        want, _ = theirs.inference(tokens, torch.tensor([13]), prompt_tokens, torch.tensor([4]), prompt_mel,
                                   torch.tensor([8]), embedding, streaming=streaming, finalize=finalize)
        got = ours(tokens, prompt_tokens, prompt_mel, embedding, streaming=streaming, finalize=finalize)
    assert got.shape == want.shape
    assert float(want.abs().max()) > 0.1
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


@pytest.mark.parametrize(("streaming", "finalize"), [(True, False), (False, True)])
def test_a_batch_of_utterances_gives_each_its_mel_alone(streaming: bool, finalize: bool) -> None:
    """Other prompts, speakers and token counts in one call (the slot decoder's step): each
    row's mel equals its call alone, to kernel rounding."""
    flow = load_flow(SMALL, official_flow(SMALL, seed=0).state_dict())
    g = torch.Generator().manual_seed(1)
    requests = [FlowRequest(torch.randint(0, SMALL.vocab_size, (1, t), generator=g),
                            torch.randint(0, SMALL.vocab_size, (1, p), generator=g),
                            torch.randn(1, 2 * p, 80, generator=g), torch.randn(1, 192, generator=g))
                for t, p in ((23, 7), (13, 0), (33, 2))]
    with torch.inference_mode():
        alone = [flow(r.tokens, r.prompt_tokens, r.prompt_mel, r.embedding, streaming=streaming, finalize=finalize)
                 for r in requests]
        together = flow.batch(requests, streaming=streaming, finalize=finalize)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def test_a_batch_of_chunks_and_last_chunks_gives_each_its_mel_alone() -> None:
    """A step's chunks (streaming, lookahead held back) and last chunks (full context) in one
    call, their rows interleaved: each row's mel equals its call alone, to kernel rounding."""
    flow = load_flow(SMALL, official_flow(SMALL, seed=0).state_dict())
    g = torch.Generator().manual_seed(3)
    requests = [FlowRequest(torch.randint(0, SMALL.vocab_size, (1, t), generator=g),
                            torch.randint(0, SMALL.vocab_size, (1, p), generator=g),
                            torch.randn(1, 2 * p, 80, generator=g), torch.randn(1, 192, generator=g))
                for t, p in ((23, 7), (13, 0), (33, 2), (9, 4))]
    finals = [False, True, True, False]
    with torch.inference_mode():
        alone = [flow(r.tokens, r.prompt_tokens, r.prompt_mel, r.embedding, streaming=not final, finalize=final)
                 for r, final in zip(requests, finals, strict=True)]
        together = flow.batch(requests, streaming=[not final for final in finals], finalize=finals)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())
    with pytest.raises(ValueError, match="3 modes for 4 calls"):
        flow.batch(requests, streaming=False, finalize=finals[:3])


@pytest.mark.parametrize(("streaming", "lookahead"), [(True, 3), (False, 0)])
def test_the_encoder_graphs_form_gives_each_row_its_condition_alone(streaming: bool, lookahead: int) -> None:
    """What `GraphedEncoder` replays: rows padded past the longest (to the bucket) and their
    lengths on the device (nothing read back): each row's condition mu over its own frames
    equals its call alone, to kernel rounding."""
    flow = load_flow(SMALL, official_flow(SMALL, seed=0).state_dict())
    g = torch.Generator().manual_seed(2)
    full = [torch.randint(0, SMALL.vocab_size, (n,), generator=g) for n in (30, 16, 41)]
    sizes = [f.shape[0] - lookahead for f in full]
    with torch.inference_mode():
        alone = [flow.encode([f], [n], lookahead, streaming)[0] for f, n in zip(full, sizes, strict=True)]
        ids = torch.zeros(4, 64, dtype=torch.long)  # one padding row, as a graph's bucket has
        for i, (f, n) in enumerate(zip(full, sizes, strict=True)):
            ids[i, :n] = f[:n]
        lengths = torch.tensor([*sizes, 64])
        context = torch.stack([f[-lookahead:] for f in full] + [full[0][:lookahead]]) if lookahead else None
        mu, frames = flow.encode_ids(ids, lengths, context, streaming)
    assert frames.tolist() == [2 * n for n in sizes] + [128]
    for i, a in enumerate(alone):
        b = mu[i : i + 1, :, : a.shape[2]]
        assert float(a.abs().max()) > 0.1
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), i


def test_an_encoder_call_that_cannot_be_captured_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    """`GraphedEncoder` where capturing fails (here: no CUDA): a warning, then the call runs
    the encoder eagerly and gives what `Flow.encode` gives."""
    flow = load_flow(SMALL, official_flow(SMALL, seed=0).state_dict())
    graphed = GraphedEncoder(flow, GraphCapturer(torch.device("cpu")))
    g = torch.Generator().manual_seed(4)
    full = [torch.randint(0, SMALL.vocab_size, (n,), generator=g) for n in (20, 9)]
    sizes = [f.shape[0] - 3 for f in full]
    with torch.inference_mode(), caplog.at_level(logging.INFO):
        mu, frames = graphed(full, sizes, 3, True)
        want_mu, want_frames = flow.encode(full, sizes, 3, True)
    assert "cannot be captured" in caplog.text
    assert "capturing the flow's encoder for shape (2, 64) while serving took" in caplog.text
    assert "the flow's encoder calls of shape (2, 64) have no CUDA graph" in caplog.text
    assert torch.equal(mu, want_mu) and torch.equal(frames, want_frames)
