#!/usr/bin/env python3
"""Write a random-weight CosyVoice2 model directory in the official release's layout:
cosyvoice2.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt (saved speakers), the Qwen2 folder
CosyVoice-BlankEN/ (config.json, and a small byte-level BPE tokenizer in Qwen2's files:
vocab.json, merges.txt, tokenizer_config.json), and stand-ins for the two ONNX front models that
make zero-shot speakers (speech_tokenizer_v2.onnx, campplus.onnx: random networks with the
release's inputs and outputs).

The weights are the official classes' (the upstream tree, a test dependency) with every
parameter drawn from a seeded generator, saved as upstream saves them, so Cadenza's loader and
the official code can be compared on the same files without the real weights (which come from
the user). --size full gives CosyVoice2-0.5B's shapes (about 2 GB; for GPU measurements);
--size small shrinks every width a CPU test does not need (the flow encoder stays 512 wide, as
upstream's lookahead and upsample layers require).

--weights own draws the same kinds of weights with Cadenza's own modules and saves their state
dicts, which Cadenza loads as it loads upstream's: for a host without the official tree (the GPU
image), where only Cadenza is measured. Parity tests need the default.

Run it with the checkout's Python after scripts/dev-setup, e.g.
  .venv/bin/python scripts/make_cosyvoice2_checkpoint.py --size small /tmp/cv2-small
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from service.models.cosyvoice2.config import QWEN_DIR, CosyVoice2Config  # noqa: E402
from service.models.cosyvoice2.encoder import EncoderConfig  # noqa: E402
from service.models.cosyvoice2.estimator import EstimatorConfig  # noqa: E402
from service.models.cosyvoice2.flow import FlowConfig  # noqa: E402
from service.models.cosyvoice2.hift import HiftConfig  # noqa: E402
from service.models.cosyvoice2.lm import Qwen2Config  # noqa: E402

SIZES = {
    "full": CosyVoice2Config(),
    "small": CosyVoice2Config(
        lm=Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                       vocab_size=320),
        flow=FlowConfig(encoder=EncoderConfig(linear_units=64, num_blocks=1),
                        estimator=EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1,
                                                  num_mid_blocks=1, num_heads=2)),
        hift=HiftConfig(base_channels=64, f0_cond_channels=32),
    ),
}


def yaml_text(c: CosyVoice2Config) -> str:
    """cosyvoice2.yaml for `c`, in upstream's HyperPyYAML form (the inference-time sections)."""
    enc, est, h, m = c.flow.encoder, c.flow.estimator, c.hift, c.prompt_mel

    def seq(values: tuple[int, ...]) -> str:
        return "[" + ", ".join(str(v) for v in values) + "]"

    return f"""# CosyVoice2 model configuration (random-weight test checkpoint, scripts/make_cosyvoice2_checkpoint.py)
__set_seed1: !apply:random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]

sample_rate: {c.sample_rate}
llm_input_size: {c.lm.hidden_size}
llm_output_size: {c.lm.hidden_size}
spk_embed_dim: {c.flow.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: {enc.up_stride}

chunk_size: {c.stream.token_hop_len}
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {c.lm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {c.sampling.top_p}
        top_k: {c.sampling.top_k}
        win_size: {c.sampling.win_size}
        tau_r: {c.sampling.tau_r}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {enc.size}
    output_size: {c.flow.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {c.flow.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {enc.pre_lookahead_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {enc.size}
        attention_heads: {enc.attention_heads}
        linear_units: {enc.linear_units}
        num_blocks: {enc.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {enc.size}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {c.flow.output_size}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: '{c.flow.cfm.t_scheduler}'
                training_cfg_rate: 0.2
                inference_cfg_rate: {c.flow.cfm.inference_cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {est.in_channels}
            out_channels: {est.out_channels}
            channels: {seq(est.channels)}
            dropout: 0.0
            attention_head_dim: {est.attention_head_dim}
            n_blocks: {est.n_blocks}
            num_mid_blocks: {est.num_mid_blocks}
            num_heads: {est.num_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {h.nsf_alpha}
    nsf_sigma: {h.nsf_sigma}
    nsf_voiced_threshold: {h.nsf_voiced_threshold:g}
    upsample_rates: {seq(h.upsample_rates)}
    upsample_kernel_sizes: {seq(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.n_fft}
        hop_len: {h.hop_len}
    resblock_kernel_sizes: {seq(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: [{", ".join(seq(d) for d in h.resblock_dilation_sizes)}]
    source_resblock_kernel_sizes: {seq(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: [{", ".join(seq(d) for d in h.source_resblock_dilation_sizes)}]
    lrelu_slope: {h.lrelu_slope}
    audio_limit: {h.audio_limit}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: {h.in_channels}
        cond_channels: {h.f0_cond_channels}

# processor functions (inference uses the prompt mel's)
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {m.fmin:g}
    fmax: {m.fmax:g}
    center: False
"""


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a seeded generator: norm gains near 1, Snake alphas and weight-norm
    gains in [0.5, 1.5), biases small, weights scaled by their fan-in."""
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "alpha" or ".alphas" in name or name.endswith("original0") or name.endswith("weight_g"):
                p.copy_(0.5 + torch.rand(p.shape, generator=rng))
            elif p.dim() == 1 and ("norm" in name or name.endswith("out.1.weight") or "block.2." in name):
                p.copy_((1.0 if leaf == "weight" else 0.0) + 0.1 * torch.randn(p.shape, generator=rng))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=rng))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=rng) / fan_in ** 0.5)


# What the test tokenizer learns its merges from (any English text would do).
CORPUS = """The quick brown fox jumps over the lazy dog. Thank you for calling; how can I help you today?
Hello from Cadenza, a streaming text to speech server. Please hold while I check the weather in the city.
Your appointment is on Monday at three o'clock. We have received your payment, and the order is on its way."""
# Qwen2's own added tokens (`added_tokens_decoder` in its tokenizer_config.json), in id order after the vocabulary.
QWEN_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SPECIALS_ADDED_BY_COSYVOICE = 16  # upstream's QwenTokenizer adds these after QWEN_ADDED
PROMPT_TEXT = "This is the prompt speaker talking."
# Added to the end-of-speech score of the random LM, so that speech does not always run to the LM's
# limit of 20 tokens per text token (--end-of-speech-bias; the tests' checkpoints keep this value).
END_OF_SPEECH_BIAS = 3.0
# The random vocoder's F0 (Hz) and spectral logits brought into a trained one's ranges (`speech_like`).
F0_CENTRE_HZ, F0_SPREAD_HZ = 160.0, 60.0
SPECTRAL_SCALE, LOG_MAGNITUDE = 0.1, -1.0


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE in Qwen2's file layout, its vocabulary leaving room for Qwen2's added
    tokens and the ones upstream's QwenTokenizer adds, all below the LM's `vocab_size`."""
    from tokenizers import ByteLevelBPETokenizer

    base = min(vocab_size - len(QWEN_ADDED) - SPECIALS_ADDED_BY_COSYVOICE, 256 + 400)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS.splitlines(), vocab_size=base, min_frequency=1, show_progress=False)
    bpe.model.save(str(folder))
    added = {str(base + i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                             "single_word": False, "special": True} for i, t in enumerate(QWEN_ADDED)}
    config = {"add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
              "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
              "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")


def speakers(config: CosyVoice2Config, folder: Path, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """spk2info.pt's entries as upstream writes them: a zero-shot speaker (`add_zero_shot_spk`:
    prompt text and speech tokens, prompt mel, embeddings) and an SFT one (an embedding only)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    text = torch.tensor([tok.encode(PROMPT_TEXT).ids], dtype=torch.int32)
    rng = torch.Generator().manual_seed(seed)
    n = 40  # prompt speech tokens (1.6 s)
    speech = torch.randint(0, config.lm.speech_token_size, (1, n), generator=rng, dtype=torch.int32)
    feat = torch.randn(1, 2 * n, config.flow.output_size, generator=rng) - 5.0
    embedding = torch.randn(1, config.flow.spk_embed_dim, generator=rng)
    length = lambda t: torch.tensor([t.shape[1]], dtype=torch.int32)  # noqa: E731
    zero_shot = {"prompt_text": text, "prompt_text_len": length(text),
                 "llm_prompt_speech_token": speech, "llm_prompt_speech_token_len": length(speech),
                 "flow_prompt_speech_token": speech, "flow_prompt_speech_token_len": length(speech),
                 "prompt_speech_feat": feat, "prompt_speech_feat_len": length(feat),
                 "llm_embedding": embedding, "flow_embedding": embedding}
    return {"prompt_a": zero_shot, "sft_b": {"embedding": torch.randn(1, config.flow.spk_embed_dim, generator=rng)}}


def write_front_models(out: Path, config: CosyVoice2Config, seed: int) -> None:
    """Random stand-ins for the release's two ONNX front models, with their inputs and outputs:
    speech_tokenizer_v2.onnx (feats [1, 128, T] Whisper log-mel, feats_length [1] int32 -> indices
    [1, T // 4], speech tokens at 25 Hz) and campplus.onnx (input [1, T, 80] mean-removed Kaldi
    fbank -> output [1, 192] speaker embedding). Each is a small network over the same features,
    so a wrong feature changes what comes out."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from service.models.cosyvoice2.prompt import CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE

    rng = torch.Generator().manual_seed(seed + 100)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((torch.randn(*shape, generator=rng) / shape[0] ** 0.5).numpy(), name)

    def save(graph: onnx.GraphProto, name: str) -> None:
        # IR version 8 goes with opset 17; without it the file takes the installed onnx package's
        # newest IR version, which an older ONNX Runtime refuses to load.
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model)
        onnx.save(model, str(out / name))

    save(helper.make_graph(
        [helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[4], strides=[4]),
         helper.make_node("ReduceMean", ["pooled"], ["level"], axes=[1], keepdims=1),
         helper.make_node("Sub", ["pooled", "level"], ["shape"]),  # the spectrum's shape, not its level
         helper.make_node("Transpose", ["shape"], ["frames"], perm=[0, 2, 1]),
         helper.make_node("MatMul", ["frames", "codebook"], ["scores"]),
         helper.make_node("ArgMax", ["scores"], ["indices"], axis=2, keepdims=0)],
        "speech_tokenizer_stand_in",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])],
        [weight("codebook", 128, config.lm.speech_token_size)]), SPEECH_TOKENIZER_FILE)
    save(helper.make_graph(
        [helper.make_node("MatMul", ["input", "w1"], ["h"]),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("ReduceMean", ["r"], ["pooled"], axes=[1], keepdims=0),
         helper.make_node("MatMul", ["pooled", "w2"], ["output"])],
        "campplus_stand_in",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, config.flow.spk_embed_dim])],
        [weight("w1", 80, 64), weight("w2", 64, config.flow.spk_embed_dim)]), CAMPPLUS_FILE)


def speech_like(hift: torch.nn.Module, bins: int, official: bool) -> None:
    """Random vocoder weights in a trained one's ranges: F0 at speaking pitches (random weights
    give ~1 Hz, no sine at all) and spectral logits near zero (random ones reach +-25: every
    magnitude at its clip and the audio at its limit, clipped noise that says nothing of precision).
    `bins`: the iSTFT's frequency bins (the magnitude half of conv_post's channels)."""
    with torch.no_grad():
        hift.f0_predictor.classifier.weight.mul_(F0_SPREAD_HZ)
        hift.f0_predictor.classifier.bias.fill_(F0_CENTRE_HZ)
        post = hift.conv_post
        gain = post.parametrizations.weight.original0 if official else post.weight  # ours: weight norm folded
        gain.mul_(SPECTRAL_SCALE)
        post.bias[:bins].fill_(LOG_MAGNITUDE)


def own_models(config: CosyVoice2Config) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(LM, flow, vocoder) as Cadenza's own modules."""
    from service.models.cosyvoice2.flow import Flow
    from service.models.cosyvoice2.hift import HiFT
    from service.models.cosyvoice2.lm import SpeechLM

    return SpeechLM(config.lm).eval(), Flow(config.flow).eval(), HiFT(config.hift).eval()


def write(out: Path, config: CosyVoice2Config, seed: int, weights: str | None = "official",
          end_of_speech_bias: float = END_OF_SPEECH_BIAS) -> None:
    """`weights`: "official" (upstream's classes), "own" (Cadenza's) or None (no weight files)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cosyvoice2.yaml").write_text(yaml_text(config), "utf-8")
    from service.models.cosyvoice2.official import official_models, qwen2_json

    qwen = out / QWEN_DIR
    qwen.mkdir(exist_ok=True)
    (qwen / "config.json").write_text(json.dumps(qwen2_json(config.lm), indent=2) + "\n", "utf-8")
    write_tokenizer(qwen, config.lm.vocab_size)
    torch.save(speakers(config, qwen, seed), out / "spk2info.pt")
    write_front_models(out, config, seed)
    if weights is None:
        return
    models = official_models(config) if weights == "official" else own_models(config)
    for k, (name, model) in enumerate(zip(("llm", "flow", "hift"), models, strict=True)):
        randomize(model, seed + k)
        if name == "llm":  # random scores almost never end speech
            with torch.no_grad():
                model.llm_decoder.bias[config.lm.speech_token_size] += end_of_speech_bias
        if name == "hift":
            speech_like(model, config.hift.n_fft // 2 + 1, official=weights == "official")
        torch.save(model.state_dict(), out / f"{name}.pt")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/make_cosyvoice2_checkpoint.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write (created; files in it are replaced)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model shapes (default: small)")
    p.add_argument("--seed", type=int, default=0, help="weights' generator seed (default: 0)")
    p.add_argument("--config-only", action="store_true",
                   help="write everything but the weights (llm.pt, flow.pt, hift.pt)")
    p.add_argument("--weights", choices=("official", "own"), default="official",
                   help="whose modules draw the weights: upstream's classes (default; parity tests need "
                        "them) or Cadenza's own (a host without the official tree)")
    p.add_argument("--end-of-speech-bias", type=float, default=END_OF_SPEECH_BIAS, metavar="B",
                   help="added to the random LM's end-of-speech score (default: %(default)s). The default "
                        "lets speech run several times longer per character than a trained model's; "
                        "served benchmarks want trained lengths (bench/RESULTS.md gives the value)")
    args = p.parse_args(argv)
    write(args.out, SIZES[args.size], args.seed, weights=None if args.config_only else args.weights,
          end_of_speech_bias=args.end_of_speech_bias)
    print(f"wrote a random-weight CosyVoice2 ({args.size}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
