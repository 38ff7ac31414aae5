"""The official CosyVoice2 model classes (the upstream tree as packaged in PyPI
token2wav-cosyvoice==0.1.0), built with a configuration's shapes: the oracle of the parity tests,
of `scripts/make_cosyvoice2_checkpoint.py` and of checks against upstream's streaming path.

The tree is installed without its training and serving dependencies (scripts/dev-setup does).
Two of its modules import glue from packages that pull those in: `cosyvoice.utils.file_utils`
(torchaudio, for reading WAVs; its wheels are built against an older torch than ours) and
`matcha.utils.pylogger` (Lightning, Hydra). The model files take only a logger from them, and
the serving module the class registry imports takes two export helpers (TensorRT, vLLM). So
before any official file is imported those two modules are given exactly these names: the
standard logging module, and export helpers that refuse. No model arithmetic runs through them."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import torch

from service.models.cosyvoice2.config import CosyVoice2Config
from service.models.cosyvoice2.estimator import EstimatorConfig
from service.models.cosyvoice2.flow import FlowConfig
from service.models.cosyvoice2.hift import HiftConfig
from service.models.cosyvoice2.lm import Qwen2Config

INSTALL = "pip install --no-deps token2wav-cosyvoice==0.1.0 (scripts/dev-setup installs it)"


def _no_export(*args: object, **kwargs: object) -> None:
    raise RuntimeError("model export is not available through Cadenza's use of the official tree")


def _glue(name: str, **names: object) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    for key, value in names.items():
        setattr(module, key, value)
    sys.modules[name] = module


def official(module: str) -> Any:
    """An official module by name (e.g. "cosyvoice.flow.decoder"), its glue given first."""
    if importlib.util.find_spec("cosyvoice") is None:
        raise RuntimeError(f"the official CosyVoice2 model code is not installed: {INSTALL}")
    _glue("cosyvoice.utils.file_utils", logging=logging, convert_onnx_to_trt=_no_export,
          export_cosyvoice2_vllm=_no_export)
    matcha = importlib.util.find_spec("matcha")
    utils = [f"{d}/utils" for d in (matcha.submodule_search_locations or [])] if matcha else []
    _glue("matcha.utils", __path__=utils)  # its submodules (audio.py) import; its __init__ (Hydra) does not run
    _glue("matcha.utils.pylogger", get_pylogger=logging.getLogger)
    return importlib.import_module(module)


def official_hift(config: HiftConfig) -> torch.nn.Module:
    generator = official("cosyvoice.hifigan.generator")
    f0 = official("cosyvoice.hifigan.f0_predictor")
    return generator.HiFTGenerator(
        in_channels=config.in_channels, base_channels=config.base_channels, nb_harmonics=config.nb_harmonics,
        sampling_rate=config.sampling_rate, nsf_alpha=config.nsf_alpha, nsf_sigma=config.nsf_sigma,
        nsf_voiced_threshold=config.nsf_voiced_threshold, upsample_rates=list(config.upsample_rates),
        upsample_kernel_sizes=list(config.upsample_kernel_sizes),
        istft_params={"n_fft": config.n_fft, "hop_len": config.hop_len},
        resblock_kernel_sizes=list(config.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in config.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(config.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in config.source_resblock_dilation_sizes],
        lrelu_slope=config.lrelu_slope, audio_limit=config.audio_limit,
        f0_predictor=f0.ConvRNNF0Predictor(in_channels=config.in_channels, cond_channels=config.f0_cond_channels))


def official_estimator(config: EstimatorConfig) -> torch.nn.Module:
    decoder = official("cosyvoice.flow.decoder")
    return decoder.CausalConditionalDecoder(
        in_channels=config.in_channels, out_channels=config.out_channels, channels=list(config.channels),
        dropout=0.0, attention_head_dim=config.attention_head_dim, n_blocks=config.n_blocks,
        num_mid_blocks=config.num_mid_blocks, num_heads=config.num_heads, act_fn="gelu",
        static_chunk_size=config.static_chunk_size, num_decoding_left_chunks=-1)


def official_flow(config: FlowConfig, estimator: torch.nn.Module | None = None) -> torch.nn.Module:
    enc = config.encoder
    encoder = official("cosyvoice.transformer.upsample_encoder").UpsampleConformerEncoder(
        input_size=enc.size, output_size=enc.size, attention_heads=enc.attention_heads,
        linear_units=enc.linear_units, num_blocks=enc.num_blocks, dropout_rate=0.0, positional_dropout_rate=0.0,
        attention_dropout_rate=0.0, normalize_before=True, input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn", use_cnn_module=False, macaron_style=False,
        static_chunk_size=enc.static_chunk_size)
    encoder.up_encoders = encoder.up_encoders[:enc.num_up_blocks]  # upstream builds 4
    params = SimpleNamespace(solver="euler", sigma_min=1e-6, t_scheduler=config.cfm.t_scheduler,
                             training_cfg_rate=0.2, inference_cfg_rate=config.cfm.inference_cfg_rate)
    cfm = official("cosyvoice.flow.flow_matching").CausalConditionalCFM(
        in_channels=240, cfm_params=params, n_spks=1, spk_emb_dim=config.output_size,
        estimator=estimator if estimator is not None else official_estimator(config.estimator))
    return official("cosyvoice.flow.flow").CausalMaskedDiffWithXvec(
        input_size=enc.size, output_size=config.output_size, spk_embed_dim=config.spk_embed_dim,
        vocab_size=config.vocab_size, input_frame_rate=25, token_mel_ratio=enc.up_stride,
        pre_lookahead_len=enc.pre_lookahead_len, encoder=encoder, decoder=cfm)


def qwen2_json(config: Qwen2Config) -> dict[str, Any]:
    """The Qwen2 `config.json` of a backbone with `config`'s shape."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "torch_dtype": "float32",
    }


def official_lm(config: Qwen2Config) -> torch.nn.Module:
    from transformers import Qwen2Config as HFQwen2Config
    from transformers import Qwen2ForCausalLM

    llm = official("cosyvoice.llm.llm")
    hf = {k: v for k, v in qwen2_json(config).items() if k not in ("architectures", "model_type", "torch_dtype")}
    encoder = llm.Qwen2Encoder.__new__(llm.Qwen2Encoder)  # its __init__ loads pretrained weights by path
    torch.nn.Module.__init__(encoder)
    encoder.model = Qwen2ForCausalLM(HFQwen2Config(**hf))
    return llm.Qwen2LM(config.hidden_size, config.hidden_size, config.speech_token_size,
                       encoder, sampling=None)


def official_models(config: CosyVoice2Config) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(LM, flow, vocoder) as upstream's classes, eval mode, with their own initial weights."""
    return official_lm(config.lm).eval(), official_flow(config.flow).eval(), official_hift(config.hift).eval()
