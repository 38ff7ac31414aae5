"""Streaming tokens to audio against upstream's own streaming path (`CosyVoice2Model.token2wav`
called as its `tts(stream=True)` loop calls it), on the same random flow and vocoder weights,
prompt, speaker and seed: every chunk's audio, the cross-fades and the last call included."""

from __future__ import annotations

import torch

from service.models.cosyvoice2.check import official_stream
from service.models.cosyvoice2.flow import load_flow
from service.models.cosyvoice2.hift import load_hift
from service.models.cosyvoice2.official import official
from service.models.cosyvoice2.token2wav import Token2Wav, Token2WavState

from .test_flow import SMALL as SMALL_FLOW
from .test_flow import official_flow
from .test_hift import SMALL as SMALL_HIFT
from .test_hift import official_hift


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
