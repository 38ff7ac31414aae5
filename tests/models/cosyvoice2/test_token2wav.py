"""Streaming tokens to audio against upstream's own streaming path (`CosyVoice2Model.token2wav`
called as its `tts(stream=True)` loop calls it), on the same random flow and vocoder weights,
prompt, speaker and seed: every chunk's audio, the cross-fades and the last call included."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from service.models.cosyvoice2.flow import load_flow
from service.models.cosyvoice2.hift import load_hift
from service.models.cosyvoice2.official import official
from service.models.cosyvoice2.token2wav import Token2Wav, Token2WavState

from .test_flow import SMALL as SMALL_FLOW
from .test_flow import official_flow
from .test_hift import SMALL as SMALL_HIFT
from .test_hift import official_hift


def official_stream(model: Any, tokens: list[int], prompt_tokens: torch.Tensor,
                    prompt_mel: torch.Tensor, embedding: torch.Tensor) -> list[torch.Tensor]:
    """The chunks upstream's `tts(stream=True)` yields once the LM has written `tokens` (its
    loop, without the LM thread and the polling sleep)."""
    uid = "utt"
    model.hift_cache_dict[uid] = None
    out, offset = [], 0
    pad = int(np.ceil(prompt_tokens.shape[1] / model.token_hop_len) * model.token_hop_len - prompt_tokens.shape[1])
    while True:
        hop = model.token_hop_len + pad if offset == 0 else model.token_hop_len
        if len(tokens) - offset < hop + model.flow.pre_lookahead_len:
            break
        chunk = torch.tensor(tokens[:offset + hop + model.flow.pre_lookahead_len]).unsqueeze(0)
        out.append(model.token2wav(token=chunk, prompt_token=prompt_tokens, prompt_feat=prompt_mel,
                                   embedding=embedding, token_offset=offset, uuid=uid, stream=True, finalize=False))
        offset += hop
    out.append(model.token2wav(token=torch.tensor(tokens).unsqueeze(0), prompt_token=prompt_tokens,
                               prompt_feat=prompt_mel, embedding=embedding, token_offset=offset, uuid=uid,
                               finalize=True))
    return out


def test_streamed_audio_equals_the_official_streaming_path() -> None:
    flow, hift = official_flow(SMALL_FLOW, seed=0), official_hift(SMALL_HIFT, seed=1)
    with torch.no_grad():  # lift F0 into speech pitches (random weights give ~0 Hz)
        hift.f0_predictor.classifier.weight.mul_(300.0)
        hift.f0_predictor.classifier.bias.fill_(120.0)
    upstream = official("cosyvoice.cli.model").CosyVoice2Model(llm=None, flow=flow, hift=hift, fp16=False)
    ours = Token2Wav(load_flow(SMALL_FLOW, flow.state_dict()), load_hift(SMALL_HIFT, hift.state_dict()))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, SMALL_FLOW.vocab_size, (80,), generator=g).tolist()
    prompt_tokens = torch.randint(0, SMALL_FLOW.vocab_size, (1, 4), generator=g)
    prompt_mel = torch.randn(1, 8, 80, generator=g)
    embedding = torch.randn(1, SMALL_FLOW.spk_embed_dim, generator=g)
    torch.manual_seed(7)
    with torch.no_grad():
        want = official_stream(upstream, tokens, prompt_tokens, prompt_mel, embedding)
    state = Token2WavState(torch.Generator().manual_seed(7), prompt_tokens, prompt_mel, embedding)
    got = []
    with torch.no_grad():
        for n in range(1, len(tokens) + 1):  # tokens arrive one at a time, as the LM writes them
            while ours.ready(state, n):
                got.append(ours.chunk(state, torch.tensor([tokens[:n]]), finalize=False))
        got.append(ours.chunk(state, torch.tensor([tokens]), finalize=True))
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
    assert float(torch.cat(want, dim=1).abs().max()) > 0.01
