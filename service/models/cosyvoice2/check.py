"""A CosyVoice2 voice against the official code (`cadenza voices check`): upstream's `Qwen2LM`,
`CausalMaskedDiffWithXvec` and `HiFTGenerator` hold the directory's weights; the same sentence,
speaker and seed go through upstream's inference loop and its streaming token-to-audio
(`CosyVoice2Model.token2wav` driven as `tts(stream=True)` drives it) and through ours, so they
differ only by the port. Upstream draws from torch's global generator; ours from per-sentence
generators seeded alike.

Upstream's decode step passes a one-position mask that only the transformers release it pins
(4.51) widens over the KV cache; under later releases its step would attend only to itself, so
its steps get the mask over cache and step that its pinned release builds."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from service.models.cosyvoice2.official import official, official_models
from service.models.cosyvoice2.runtime import CosyVoice2Runtime, SpeechUtterance
from service.text.frontend import PhonemizedSentence

SEED = 0


def widen_step_masks(lm: Any) -> None:
    """Give an official `Qwen2LM`'s decode steps the causal mask over cache and step."""
    step = lm.llm.forward_one_step

    def forward_one_step(xs: torch.Tensor, masks: torch.Tensor, cache: Any = None) -> Any:
        past = 0 if cache is None else cache.get_seq_length()
        total = past + xs.shape[1]
        return step(xs, masks=torch.ones(1, total, total, dtype=torch.bool, device=xs.device).tril(), cache=cache)

    lm.llm.forward_one_step = forward_one_step


def official_stream(model: Any, tokens: list[int], prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                    embedding: torch.Tensor) -> list[torch.Tensor]:
    """The chunks upstream's `tts(stream=True)` yields once its LM has written `tokens` (its loop,
    without the LM thread and the polling sleep)."""
    uid = "utt"
    model.hift_cache_dict[uid] = None
    out, offset = [], 0
    pad = int(np.ceil(prompt_tokens.shape[1] / model.token_hop_len) * model.token_hop_len - prompt_tokens.shape[1])
    while True:
        hop = model.token_hop_len + pad if offset == 0 else model.token_hop_len
        if len(tokens) - offset < hop + model.flow.pre_lookahead_len:
            break
        chunk = torch.tensor(tokens[:offset + hop + model.flow.pre_lookahead_len], device=prompt_tokens.device)
        out.append(model.token2wav(token=chunk[None], prompt_token=prompt_tokens, prompt_feat=prompt_mel,
                                   embedding=embedding, token_offset=offset, uuid=uid, stream=True, finalize=False))
        offset += hop
    out.append(model.token2wav(token=torch.tensor(tokens, device=prompt_tokens.device)[None],
                               prompt_token=prompt_tokens, prompt_feat=prompt_mel, embedding=embedding,
                               token_offset=offset, uuid=uid, finalize=True))
    return out


class CosyVoice2Parity:
    description = ("official Qwen2LM + CosyVoice2Model streaming token2wav (upstream tree) with the same "
                   "weights and seed")

    def __init__(self, runtime: CosyVoice2Runtime, threads: int | None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.runtime = runtime
        model = runtime.model
        lm: Any
        lm, flow, hift = official_models(model.config)
        lm.load_state_dict(torch.load(runtime.info.model_path / "llm.pt", map_location="cpu", weights_only=True))
        flow.load_state_dict(torch.load(runtime.info.model_path / "flow.pt", map_location="cpu", weights_only=True))
        hift.load_state_dict(torch.load(runtime.info.model_path / "hift.pt", map_location="cpu", weights_only=True))
        s = model.config.sampling
        lm.sampling = functools.partial(official("cosyvoice.utils.common").ras_sampling, top_p=s.top_p,
                                        top_k=s.top_k, win_size=s.win_size, tau_r=s.tau_r)
        widen_step_masks(lm)
        device = runtime.device
        self.lm = lm.to(device)
        self.model = official("cosyvoice.cli.model").CosyVoice2Model(
            llm=self.lm, flow=flow.to(device), hift=hift.to(device), fp16=False)

    @torch.inference_mode()
    def pair(self, sentence: PhonemizedSentence) -> tuple[np.ndarray, np.ndarray]:
        from service.models.family import AcousticJob, SynthesisParams, utterance_rng

        job = AcousticJob(sentence, None, SynthesisParams(seed=SEED), utterance_rng(SEED, sentence.phoneme_ids))
        utt = self.runtime.acoustic_batch([job])[0]
        assert isinstance(utt, SpeechUtterance)
        while not utt.complete:
            self.runtime.tokens.step([utt])
        ours = self.runtime.reference(utt)
        theirs = self._official(utt)
        return theirs, ours

    def _official(self, utt: SpeechUtterance) -> np.ndarray:
        """Upstream's tokens for the sentence (its global generator seeded with the sentence's
        sampling seed) and its streamed audio (seeded with the sentence's vocoder key)."""
        device = self.runtime.device
        sp = utt.speaker
        text = torch.tensor(utt.text_ids, device=device)[None]
        prompt_text = sp.prompt_text.to(device)[None]
        prompt_speech = sp.llm_prompt_speech.to(device)[None]
        torch.manual_seed(utt.seed)
        tokens = list(self.lm.inference(
            text, torch.tensor([text.shape[1]]), prompt_text, torch.tensor([prompt_text.shape[1]]),
            prompt_speech, torch.tensor([prompt_speech.shape[1]]), embedding=torch.zeros(1, 0, device=device)))
        torch.manual_seed(utt.key)
        chunks = official_stream(self.model, tokens, sp.flow_prompt_tokens.to(device), sp.prompt_mel.to(device),
                                 sp.embedding.to(device))
        return torch.cat(chunks, dim=1)[0].float().cpu().numpy()
