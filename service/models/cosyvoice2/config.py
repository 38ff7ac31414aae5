"""The official CosyVoice2 model directory's configuration, read without running it:
`cosyvoice2.yaml` as data (`hyperyaml`) and the Qwen2 backbone's shape from the tokenizer
folder's `config.json` (`CosyVoice-BlankEN/` in the release)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.models.cosyvoice2.cfm import CfmConfig
from service.models.cosyvoice2.encoder import EncoderConfig
from service.models.cosyvoice2.estimator import EstimatorConfig
from service.models.cosyvoice2.flow import FlowConfig
from service.models.cosyvoice2.hift import HiftConfig
from service.models.cosyvoice2.hyperyaml import ConfigError, Tagged, read_yaml
from service.models.cosyvoice2.lm import Qwen2Config, SamplingConfig
from service.models.cosyvoice2.prompt import MelConfig, mel_config
from service.models.cosyvoice2.token2wav import StreamConfig
from service.models.cosyvoice2.voices import CONFIG_FILE, QWEN_DIR

__all__ = ["CONFIG_FILE", "QWEN_DIR", "ConfigError", "CosyVoice2Config", "MelConfig", "read_config", "read_yaml"]


@dataclass(frozen=True)
class CosyVoice2Config:
    sample_rate: int = 24000
    lm: Qwen2Config = field(default_factory=Qwen2Config)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    prompt_mel: MelConfig = field(default_factory=MelConfig)


def _node(data: dict[str, Any], key: str, target: str) -> dict[str, Any]:
    node = data.get(key)
    if not isinstance(node, Tagged) or not node.target.endswith(target) or not isinstance(node.args, dict):
        raise ConfigError(f"{CONFIG_FILE}: '{key}' is not a {target} (found {getattr(node, 'target', node)!r}); "
                          "Cadenza serves CosyVoice2 model directories")
    args: dict[str, Any] = node.args
    return args


def _frozen(value: Any) -> Any:
    """YAML lists as tuples (the configs are frozen dataclasses), nested too."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _pick(args: dict[str, Any], cls: type) -> dict[str, Any]:
    """The arguments `cls` (a dataclass) has fields for; the others are training settings."""
    names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return {k: _frozen(v) for k, v in args.items() if k in names and not isinstance(v, Tagged)}


def read_config(model_dir: Path) -> CosyVoice2Config:
    """The configuration of an official CosyVoice2 directory (`cosyvoice2.yaml` and the Qwen2
    `config.json`)."""
    data = read_yaml(Path(model_dir) / CONFIG_FILE)
    llm = _node(data, "llm", "Qwen2LM")
    flow = _node(data, "flow", "CausalMaskedDiffWithXvec")
    hift = _node(data, "hift", "HiFTGenerator")
    encoder = flow["encoder"].args
    if encoder.get("use_cnn_module", True) or encoder.get("macaron_style", True) \
            or encoder.get("pos_enc_layer_type") != "rel_pos_espnet" or encoder.get("input_layer") != "linear":
        raise ConfigError(f"{CONFIG_FILE}: the flow encoder variant is not CosyVoice2's (linear input, "
                          "rel_pos_espnet, no convolution module, no macaron feed-forward)")
    cfm = flow["decoder"].args
    estimator = cfm["estimator"].args
    if estimator.get("act_fn", "gelu") != "gelu":
        raise ConfigError(f"{CONFIG_FILE}: estimator act_fn {estimator['act_fn']!r} (CosyVoice2 uses gelu)")
    f0 = hift["f0_predictor"].args
    istft = hift.get("istft_params", {})
    qwen_path = Path(model_dir) / QWEN_DIR / "config.json"
    try:
        qwen = json.loads(qwen_path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Qwen2 configuration {qwen_path}: {exc}") from exc
    lm = Qwen2Config(
        hidden_size=qwen["hidden_size"], num_layers=qwen["num_hidden_layers"], num_heads=qwen["num_attention_heads"],
        num_kv_heads=qwen.get("num_key_value_heads", qwen["num_attention_heads"]),
        intermediate_size=qwen["intermediate_size"], vocab_size=qwen["vocab_size"],
        rope_theta=float(qwen.get("rope_theta", qwen.get("rope_parameters", {}).get("rope_theta", 10000.0))),
        rms_norm_eps=float(qwen.get("rms_norm_eps", 1e-6)), speech_token_size=int(llm["speech_token_size"]))
    if lm.hidden_size != llm["llm_input_size"] or lm.hidden_size != llm["llm_output_size"]:
        raise ConfigError(f"{CONFIG_FILE}: llm sizes {llm['llm_input_size']}/{llm['llm_output_size']} do not match "
                          f"the Qwen2 hidden size {lm.hidden_size}")
    sampling = llm.get("sampling")
    sampling_args = sampling.args if isinstance(sampling, Tagged) and isinstance(sampling.args, dict) else {}
    chunk = int(data.get("chunk_size", encoder.get("static_chunk_size", 25)))
    return CosyVoice2Config(
        sample_rate=int(hift.get("sampling_rate", data.get("sample_rate", 24000))),
        lm=lm,
        sampling=SamplingConfig(**_pick(sampling_args, SamplingConfig)),
        flow=FlowConfig(
            vocab_size=int(flow["vocab_size"]), output_size=int(flow.get("output_size", 80)),
            spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
            encoder=EncoderConfig(
                size=int(encoder["output_size"]), attention_heads=int(encoder["attention_heads"]),
                linear_units=int(encoder["linear_units"]), num_blocks=int(encoder["num_blocks"]),
                static_chunk_size=int(encoder.get("static_chunk_size", chunk)),
                pre_lookahead_len=int(flow.get("pre_lookahead_len", 3)),
                up_stride=int(flow.get("token_mel_ratio", 2))),
            estimator=EstimatorConfig(**_pick(estimator, EstimatorConfig)),
            cfm=CfmConfig(**_pick(cfm["cfm_params"].args.get("content", {}), CfmConfig))),
        hift=HiftConfig(**_pick(hift, HiftConfig), n_fft=int(istft.get("n_fft", 16)),
                        hop_len=int(istft.get("hop_len", 4)), f0_cond_channels=int(f0.get("cond_channels", 512))),
        stream=StreamConfig(token_hop_len=chunk),
        prompt_mel=mel_config(data),
    )
