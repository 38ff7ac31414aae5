"""A CosyVoice2 model directory loaded into our modules: the LM (`llm.pt`), the flow (`flow.pt`)
and the vocoder (`hift.pt`), with the streaming token-to-audio stage over the last two.

The directory is the official release's layout (`CosyVoice2-0.5B`): `cosyvoice2.yaml`,
`llm.pt`, `flow.pt`, `hift.pt` and the Qwen2 folder `CosyVoice-BlankEN/`. The weights come
from the user; `scripts/make_cosyvoice2_checkpoint.py` writes a random-weight one for tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from service.models.cosyvoice2.config import ConfigError, CosyVoice2Config, read_config
from service.models.cosyvoice2.flow import Flow, load_flow
from service.models.cosyvoice2.hift import HiFT, load_hift
from service.models.cosyvoice2.lm import SpeechLM, load_lm
from service.models.cosyvoice2.token2wav import Token2Wav

WEIGHT_FILES = ("llm.pt", "flow.pt", "hift.pt")


@dataclass
class CosyVoice2:
    config: CosyVoice2Config
    lm: SpeechLM
    flow: Flow
    hift: HiFT
    token2wav: Token2Wav


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path.parent} has no {path.name}: a CosyVoice2 directory holds "
                          f"{', '.join(WEIGHT_FILES)} beside cosyvoice2.yaml") from exc
    except Exception as exc:  # torch raises several types for a corrupt or foreign file
        raise ConfigError(f"cannot read {path} as a PyTorch state dict: {exc}") from exc
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def load_model(model_dir: Path) -> CosyVoice2:
    """Our modules with the directory's weights, FP32 on the CPU, in eval mode."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    try:
        lm = load_lm(config.lm, _state_dict(model_dir / "llm.pt"))
        flow = load_flow(config.flow, _state_dict(model_dir / "flow.pt"))
        hift = load_hift(config.hift, _state_dict(model_dir / "hift.pt"))
    except RuntimeError as exc:  # load_state_dict: missing, unexpected or misshapen weights
        raise ConfigError(f"{model_dir}: the weights do not fit cosyvoice2.yaml: {str(exc)[:400]}") from exc
    return CosyVoice2(config, lm, flow, hift, Token2Wav(flow, hift, config.stream))
