"""A CosyVoice2 directory as the official release lays it out: its configuration read as data
(the full-size file gives CosyVoice2-0.5B's shapes, our defaults), and a random-weight one
written by scripts/make_cosyvoice2_checkpoint.py loaded into our modules, which then compute what
the official classes compute from the same files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.models.cosyvoice2.config import ConfigError, CosyVoice2Config, read_config
from service.models.cosyvoice2.model import load_model
from service.models.cosyvoice2.official import official_models

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "make_cosyvoice2_checkpoint.py"


def make(out: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(SCRIPT), str(out), *args], check=True, capture_output=True, text=True)
    return out


def test_the_full_size_configuration_is_cosyvoice2_0_5b(tmp_path: Path) -> None:
    config = read_config(make(tmp_path / "full", "--size", "full", "--config-only"))
    assert config == CosyVoice2Config()
    assert (config.lm.hidden_size, config.lm.num_layers, config.lm.speech_token_size) == (896, 24, 6561)
    assert config.flow.estimator.static_chunk_size == 50  # `!ref <chunk_size> * <token_mel_ratio>`
    assert config.hift.samples_per_frame == 480 and config.sample_rate == 24000


@pytest.fixture(scope="module")
def small(cosyvoice2_dir: Path) -> Path:
    return cosyvoice2_dir


def test_a_random_weight_directory_loads_and_matches_the_official_classes(small: Path) -> None:
    ours = load_model(small)
    lm, flow, hift = official_models(ours.config)
    for module, name in ((lm, "llm"), (flow, "flow"), (hift, "hift")):
        module.load_state_dict(torch.load(small / f"{name}.pt", weights_only=True))
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, ours.config.lm.vocab_size, (9,), generator=g)
    with torch.inference_mode():
        prompt = ours.lm.prompt(text)
        from service.models.cosyvoice2.lm import KVCache

        got = ours.lm(prompt[None], KVCache.empty(ours.config.lm, 1, 16), torch.tensor([0]))[0]
        emb = lm.llm.model.model.embed_tokens(text[None])
        lm_input = torch.cat([lm.llm_embedding.weight[0][None, None], emb, lm.llm_embedding.weight[1][None, None]], 1)
        y, _ = lm.llm.forward_one_step(lm_input, masks=torch.ones(1, 11, 11).tril().bool())
        want = lm.llm_decoder(y[:, -1]).log_softmax(-1)[0]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
    tokens = torch.randint(0, ours.config.flow.vocab_size, (1, 30), generator=g)
    spk = torch.randn(1, 192, generator=g)
    none_t, none_mel = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, 80)
    with torch.inference_mode():
        mel = ours.flow(tokens, none_t, none_mel, spk)
        want_mel, _ = flow.inference(tokens, torch.tensor([30]), none_t, torch.tensor([0]), none_mel,
                                     torch.tensor([0]), spk, streaming=False, finalize=True)
        torch.manual_seed(1)
        want_audio, _ = hift.inference(want_mel)
        audio, _ = ours.hift(want_mel, torch.Generator().manual_seed(1))  # the same mel into both vocoders
    assert float((mel - want_mel).abs().max() / want_mel.abs().max()) <= 1e-4
    assert float((audio - want_audio).abs().max()) <= 1e-4 * max(1.0, float(want_audio.abs().max()))


def test_a_directory_without_weights_says_what_is_missing(small: Path, tmp_path: Path) -> None:
    broken = make(tmp_path / "noweights", "--size", "small", "--config-only")
    with pytest.raises(ConfigError, match=r"has no llm\.pt"):
        load_model(broken)
    (broken / "llm.pt").write_bytes((small / "flow.pt").read_bytes())  # the wrong file under the name
    with pytest.raises(ConfigError, match=r"do not fit cosyvoice2\.yaml"):
        load_model(broken)
    (broken / "cosyvoice2.yaml").write_text("llm: 3\n")
    with pytest.raises(ConfigError, match="not a Qwen2LM"):
        read_config(broken)


def test_the_end_of_speech_bias_moves_only_the_lms_end_of_speech_score(tmp_path: Path) -> None:
    """A served benchmark's checkpoint (`--end-of-speech-bias`) differs from the tests' in that
    one score's bias and nothing else."""
    base = make(tmp_path / "base", "--weights", "own")
    raised = make(tmp_path / "raised", "--weights", "own", "--end-of-speech-bias", "7.5")
    eos = read_config(base).lm.speech_token_size
    for name in ("llm", "flow", "hift"):
        a = torch.load(base / f"{name}.pt", weights_only=True)
        b = torch.load(raised / f"{name}.pt", weights_only=True)
        assert a.keys() == b.keys()
        for key in a:
            if key == "llm_decoder.bias":
                diff = b[key] - a[key]
                assert float(diff[eos]) == pytest.approx(4.5)
                diff[eos] = 0
                assert not diff.any()
            else:
                assert torch.equal(a[key], b[key]), f"{name}.pt {key}"
