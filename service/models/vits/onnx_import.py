"""Load a Piper voice (.onnx + .onnx.json) into our VitsModel.

Named initializers map to parameters by name. Piper's export folds some weights
(weight-normalised convs, the phoneme embedding, exp(-logs) of the affine flow)
into anonymous constants; those map through the graph node that consumes them:
`/flow/flows.0/enc/in_layers.0/Conv` input 1 is `flow.flows.0.enc.in_layers.0.weight`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from service.models.vits.hparams import VitsHParams
from service.models.vits.model import VitsModel


class VoiceMappingError(ValueError):
    """The ONNX graph does not match the VITS architecture we implement."""


@dataclass
class OnnxWeights:
    tensors: dict[str, np.ndarray]  # our parameter name -> value
    conv_attrs: dict[str, dict[str, list[int]]]  # weight name -> Conv attributes
    unmapped: list[str]  # parameter-like initializers we could not place


_PARAM_SLOTS = {("Conv", 1): "weight", ("Conv", 2): "bias", ("ConvTranspose", 1): "weight",
                ("ConvTranspose", 2): "bias", ("Gather", 0): "weight"}


def _module_path(node_name: str) -> str:
    """'/flow/flows.0/enc/in_layers.0/Conv' -> 'flow.flows.0.enc.in_layers.0'."""
    parts = [p for p in node_name.split("/") if p]
    return ".".join(parts[:-1])


def read_onnx_weights(path: str | Path) -> OnnxWeights:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[tuple[object, int]]] = defaultdict(list)
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name in inits:
                consumers[name].append((node, slot))

    tensors: dict[str, np.ndarray] = {}
    conv_attrs: dict[str, dict[str, list[int]]] = {}
    unmapped: list[str] = []
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
            attrs = {
                a.name: list(onnx.helper.get_attribute_value(a))
                for a in node.attribute
                if a.type == onnx.AttributeProto.INTS
            }
            conv_attrs[node.input[1]] = attrs
            conv_attrs[f"{_module_path(node.name)}.weight"] = attrs
    for name, init in inits.items():
        value = numpy_helper.to_array(init)
        if value.dtype not in (np.float32, np.float16, np.float64) or value.ndim == 0:
            continue  # shape constants, indices, scalars
        target: str | None = None
        named = re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)+", name) is not None
        for node, slot in [] if named else consumers.get(name, []):
            op = node.op_type  # type: ignore[attr-defined]
            if (op, slot) in _PARAM_SLOTS:
                target = f"{_module_path(node.name)}.{_PARAM_SLOTS[(op, slot)]}"  # type: ignore[attr-defined]
                break
            if op == "Exp" and _module_path(node.name).endswith("flows.0"):  # type: ignore[attr-defined]
                # ElementwiseAffine: exp(-logs) with the negation folded in.
                target = f"{_module_path(node.name)}.logs"  # type: ignore[attr-defined]
                value = -value
                break
            if op == "Mul" and name.endswith("/Exp_output_0"):
                # ElementwiseAffine folded exp(-logs); store logs.
                target = f"{_module_path(node.name)}.logs"  # type: ignore[attr-defined]
                value = -np.log(value)
                break
        if named:
            target = name
        if target is None:
            if value.ndim >= 2 or value.size > 8:
                unmapped.append(name)
            continue
        tensors[target] = value.astype(np.float32)
    return OnnxWeights(tensors=tensors, conv_attrs=conv_attrs, unmapped=unmapped)


def _count(tensors: dict[str, np.ndarray], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in tensors if (m := rx.fullmatch(k))})


def infer_hparams(w: OnnxWeights) -> VitsHParams:
    """Read every size the architecture needs from the tensors and conv attributes."""
    t = w.tensors

    def need(name: str) -> np.ndarray:
        if name not in t:
            raise VoiceMappingError(f"voice is missing tensor {name!r}; is this a Piper VITS voice?")
        return t[name]

    n_vocab, hidden = need("enc_p.emb.weight").shape
    rel = need("enc_p.encoder.attn_layers.0.emb_rel_k")
    ffn = need("enc_p.encoder.ffn_layers.0.conv_1.weight")
    dp_proj = need("dp.flows.3.proj.weight")
    wn0 = need("flow.flows.0.enc.in_layers.0.weight")
    n_wn = _count(t, r"flow\.flows\.0\.enc\.in_layers\.(\d+)\.weight")
    dil_rate = 1
    if n_wn > 1:
        dil_rate = w.conv_attrs.get("flow.flows.0.enc.in_layers.1.weight", {}).get("dilations", [1])[0]

    n_ups = _count(t, r"dec\.ups\.(\d+)\.weight")
    n_blocks = _count(t, r"dec\.resblocks\.(\d+)\..*weight")
    num_kernels = n_blocks // max(n_ups, 1)
    resblock = "1" if "dec.resblocks.0.convs1.0.weight" in t else "2"
    conv_key = "convs1" if resblock == "1" else "convs"
    kernels, dilations = [], []
    for j in range(num_kernels):
        n_convs = _count(t, rf"dec\.resblocks\.{j}\.{conv_key}\.(\d+)\.weight")
        kernels.append(int(need(f"dec.resblocks.{j}.{conv_key}.0.weight").shape[2]))
        dilations.append(tuple(
            w.conv_attrs.get(f"dec.resblocks.{j}.{conv_key}.{i}.weight", {}).get("dilations", [1])[0]
            for i in range(n_convs)
        ))
    ups_k = tuple(int(need(f"dec.ups.{i}.weight").shape[2]) for i in range(n_ups))
    ups_r = tuple(
        w.conv_attrs.get(f"dec.ups.{i}.weight", {}).get("strides", [0])[0] for i in range(n_ups)
    )
    if any(r <= 0 for r in ups_r):
        raise VoiceMappingError("could not read the upsample strides from the ONNX graph")
    emb_g = t.get("emb_g.weight")
    return VitsHParams(
        n_vocab=int(n_vocab),
        hidden_channels=int(hidden),
        inter_channels=int(need("enc_p.proj.weight").shape[0] // 2),
        filter_channels=int(ffn.shape[0]),
        n_heads=int(hidden // rel.shape[2]),
        n_layers=_count(t, r"enc_p\.encoder\.attn_layers\.(\d+)\.conv_q\.weight"),
        kernel_size=int(ffn.shape[2]),
        window_size=int((rel.shape[1] - 1) // 2),
        heads_share=bool(rel.shape[0] == 1),
        dp_filter_channels=int(need("dp.pre.weight").shape[0]),
        dp_kernel_size=int(need("dp.convs.convs_sep.0.weight").shape[2]),
        dp_n_flows=1 + _count(t, r"dp\.flows\.(\d+)\.pre\.weight"),
        dp_num_bins=int((dp_proj.shape[0] + 1) // 3),
        flow_n_flows=_count(t, r"flow\.flows\.(\d+)\.pre\.weight"),
        flow_kernel_size=int(wn0.shape[2]),
        flow_dilation_rate=int(dil_rate),
        flow_n_layers=n_wn,
        resblock=resblock,
        resblock_kernel_sizes=tuple(kernels),
        resblock_dilation_sizes=tuple(dilations),
        upsample_rates=ups_r,
        upsample_initial_channel=int(need("dec.conv_pre.weight").shape[0]),
        upsample_kernel_sizes=ups_k,
        conv_pre_kernel=int(need("dec.conv_pre.weight").shape[2]),
        conv_post_kernel=int(need("dec.conv_post.weight").shape[2]),
        n_speakers=int(emb_g.shape[0]) if emb_g is not None else 1,
        gin_channels=int(emb_g.shape[1]) if emb_g is not None else 0,
    )


def _known_patterns() -> set[str]:
    """Parameter names any supported VITS variant has, with indices as '#'."""
    names: set[str] = set()
    for hp in (VitsHParams(n_speakers=2, gin_channels=4), VitsHParams(resblock="1")):
        names |= {re.sub(r"\.\d+", ".#", k) for k in VitsModel(hp).state_dict()}
    return names


def load_vits_from_onnx(path: str | Path) -> VitsModel:
    """Build a VitsModel with the voice's weights; fail naming any tensor that does
    not fit (missing, unexpected or wrongly shaped)."""
    w = read_onnx_weights(path)
    try:
        hp = infer_hparams(w)
    except VoiceMappingError as exc:
        known = _known_patterns()
        strange = sorted(k for k in w.tensors if re.sub(r"\.\d+", ".#", k) not in known)
        strange += sorted(w.unmapped)
        extra = f"\n  unexpected tensors: {', '.join(strange)}" if strange else ""
        raise VoiceMappingError(f"cannot map voice {path} onto the VITS model: {exc}{extra}") from exc
    model = VitsModel(hp)
    own = model.state_dict()
    missing = sorted(k for k in own if k not in w.tensors)
    unexpected = sorted(k for k in w.tensors if k not in own) + sorted(w.unmapped)
    bad_shape = sorted(
        f"{k} {tuple(w.tensors[k].shape)} != {tuple(own[k].shape)}"
        for k in own
        if k in w.tensors and tuple(w.tensors[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or bad_shape:
        lines = [f"cannot map voice {path} onto the VITS model:"]
        if missing:
            lines.append(f"  missing tensors: {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors: {', '.join(unexpected)}")
        if bad_shape:
            lines.append(f"  wrong shapes: {', '.join(bad_shape)}")
        raise VoiceMappingError("\n".join(lines))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.tensors.items()})
    return model.eval()
