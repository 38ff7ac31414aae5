"""The slot decoder's step as one ONNX graph, and a slot decoder that runs it.

`DecoderStep` is the step the torch backend captures as a CUDA graph
(`VitsStreamingDecoder._run`) with the slot state made explicit: it takes every row's
gathered per-stage history, the step's prior frames, the rows' positions and speaker ids,
and returns the audio and the new histories. Exported once per voice with dynamic rows
and frames; an engine (TensorRT, or ONNX Runtime in the tests) runs it, and
`GraphStepDecoder` keeps the slots, the prior memory and the noise exactly as the torch
decoder does, so both backends decode the same function.

`pinned_nodes` says which of the graph's nodes (TensorRT names its layers after them)
belong to a pinned module, so the FP16 engine keeps them in FP32 as the torch FP16 model does."""

from __future__ import annotations

import fnmatch
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from service.models.vits.backends.stage_export import export_dir_name, writable_cache_dir
from service.models.vits.model import VitsModel
from service.models.vits.streaming import StageShape, VitsStreamingDecoder, run_stages, stage_shapes

log = logging.getLogger(__name__)

# Bumped when the step graph changes, so an old export is not reused.
STEP_EXPORT_VERSION = "1"

# The exported module holds the voice as `model`: node names are scoped /model/<module path>/.
MODEL_SCOPE = "model"

StepRunner = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


def state_names(stages: int) -> tuple[list[str], list[str]]:
    """(input, output) names of the per-stage histories."""
    return [f"state{s}" for s in range(stages)], [f"next_state{s}" for s in range(stages)]


class DecoderStep(nn.Module):
    """One decoder step over explicit state. Inputs: z [B, C, F] (the step's prior frames),
    fed [B] and lengths [B] (latent frames already fed, and the utterance's length), sid [B]
    (multi-speaker voices only), state<s> [B, C_s, H_s]. Outputs: audio [B, F x hop] and
    next_state<s>. The arithmetic is `run_stages`, the slot decoder's own."""

    def __init__(self, model: VitsModel) -> None:
        super().__init__()
        self.model = model
        self.shapes: list[StageShape] = stage_shapes(model)
        self.lag_before = [sum(s.lead // s.rate for s in self.shapes[:i]) for i in range(len(self.shapes))]
        self.multi_speaker = model.emb_g is not None

    def forward(self, z: torch.Tensor, fed: torch.Tensor, lengths: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model = self.model
        sid, states = (rest[0], rest[1:]) if self.multi_speaker else (None, rest)
        g = model.speaker_embedding(sid) if sid is not None else None
        audio, new_states = run_stages(model, self.shapes, self.lag_before, z, fed, lengths, g, states)
        return (audio, *new_states)


def export_step(model: VitsModel, path: Path, opset: int = 17) -> Path:
    """Write the step graph of `model` (FP32, as trained: the graph the torch step runs) to
    `path`, with dynamic rows and frames."""
    step = DecoderStep(model.float().eval()).eval()
    dev = next(model.parameters()).device
    rows, frames = 2, 8
    ins, outs = state_names(len(step.shapes))
    args: list[torch.Tensor] = [torch.zeros(rows, model.hp.inter_channels, frames, device=dev),
                                torch.zeros(rows, dtype=torch.long, device=dev),
                                torch.full((rows,), frames, dtype=torch.long, device=dev)]
    names = ["z", "fed", "lengths"]
    if step.multi_speaker:
        args.append(torch.zeros(rows, dtype=torch.long, device=dev))
        names.append("sid")
    args += [torch.zeros(rows, s.channels, s.history, device=dev) for s in step.shapes]
    names += ins
    axes: dict[str, dict[int, str]] = {name: {0: "rows"} for name in [*names, "audio", *outs]}
    axes["z"][2] = "frames"
    axes["audio"][1] = "samples"
    path.parent.mkdir(parents=True, exist_ok=True)
    called: set[str] = set()
    hooks = [m.register_forward_pre_hook(lambda *_, name=name: called.add(name))
             for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            torch.onnx.export(step, tuple(args), str(path), input_names=names, output_names=["audio", *outs],
                              dynamic_axes=axes, opset_version=opset, do_constant_folding=True, dynamo=False)
    finally:
        for hook in hooks:
            hook.remove()
    import onnx

    graph = onnx.load(str(path))
    for node, name in zip(graph.graph.node, full_scope_names([n.name for n in graph.graph.node], called),
                          strict=True):
        node.name = name
    onnx.save(graph, str(path))
    return path


def full_scope_names(node_names: Sequence[str], called: Collection[str]) -> list[str]:
    """The exporter scopes a node by the modules called on the way to it, each named relative
    to the one before ('/flows.2/enc/Conv': `decoder_stage` reaches the coupling without
    calling `flow`). Rename it by its module's full path under /model/
    ('/model/flow/flows.2/enc/Conv'), resolving each scope among the `called` modules (the
    acoustic stage's modules, never called by the step, have look-alike names)."""
    out = []
    for name in node_names:
        *scopes, op = name.split("/")[1:] if name.startswith("/") else [name]
        module = ""
        for part in scopes:
            prefix = f"{module}." if module else ""
            found = [m for m in called if m.startswith(prefix) and
                     (m[len(prefix):] == part or m[len(prefix):].endswith("." + part))]
            if len(found) != 1:
                raise ValueError(f"node {name!r}: scope {part!r} matches {sorted(found) or 'no'} called modules")
            module = found[0]
        out.append("/".join(["", MODEL_SCOPE, *module.split("."), op]) if module else name)
    if len(set(out)) != len(out):
        raise ValueError("full scope names collide; the step graph's node names would not be unique")
    return out


def cached_step_export(model: VitsModel, onnx_path: Path, cache_dir: Path) -> Path:
    """The step graph for a voice, exported once and kept under
    cache_dir/<voice>-<digest>-v<stage version>/step-v<step version>.onnx."""
    path = writable_cache_dir(cache_dir) / export_dir_name(onnx_path) / f"step-v{STEP_EXPORT_VERSION}.onnx"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("exporting the decoder step graph of %s to %s", onnx_path.name, path)
    tmp = Path(tempfile.mkdtemp(prefix=".step-", dir=path.parent))  # concurrent exporters never mix files
    try:
        export_step(model, tmp / path.name).replace(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# --- FP32 pins -----------------------------------------------------------------------------------


def node_module(node_name: str) -> str:
    """The model module a node of the step graph belongs to: '/model/dec/conv_post/Conv' ->
    'dec.conv_post'; '' for nodes outside the model (the step's masks and slicing) and for
    unscoped names."""
    parts = [p for p in node_name.split("/") if p][:-1] if node_name.startswith("/") else []
    if not parts or parts[0] != MODEL_SCOPE:
        return ""
    return ".".join(parts[1:])


def is_pinned(node_name: str, pins: Sequence[str]) -> bool:
    """True when the node belongs to a module matching a pin (fnmatch), or to one inside it."""
    module = node_module(node_name)
    while module:
        if any(fnmatch.fnmatchcase(module, p) for p in pins):
            return True
        module = module.rpartition(".")[0]
    return False


def pinned_nodes(node_names: Sequence[str], pins: Sequence[str]) -> list[str]:
    return [n for n in node_names if is_pinned(n, pins)]


# --- the decoder ---------------------------------------------------------------------------------


class GraphStepDecoder(VitsStreamingDecoder):
    """The slot decoder with its step run by an engine over the exported graph: `run` takes
    the graph's inputs and gives its outputs (tensors on `device`). Slots, prior memory and
    noise are the torch decoder's; a step of more than `max_frames` frames (an FP32 redo's
    replay) runs as consecutive steps, which give the same audio."""

    def __init__(self, model: VitsModel, precision: str, capacity: int, device: torch.device, run: StepRunner,
                 max_frames: int, graph_frames: Sequence[int] = (), buckets: Sequence[int] = (1, 8, 64),
                 prior_columns: int | None = None) -> None:
        """`graph_frames` and `buckets`: the step shapes `capture_all` warms up and times."""
        super().__init__(model, precision, capacity, device, torch.float32, graph_frames=graph_frames,
                         buckets=buckets, prior_columns=prior_columns)
        self.run = run
        self.max_frames = max_frames
        self._state_in, self._state_out = state_names(len(self.shapes))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Run every (bucket, frames) step once on the scratch slot, then time it (`step_seconds`:
        the capacity estimate starts from these), so the engine's first use is not a session's."""
        for frames in sorted(self.graph_frames):
            for bucket in self.buckets:
                ints = torch.zeros(5 + frames, bucket, dtype=torch.long, device=self.device)
                ints[0].fill_(self._scratch)
                ints[5:].fill_(self.prior.zero)
                best = float("inf")
                for _ in range(3):
                    self._sync()
                    t0 = time.perf_counter()
                    self._run(*self._inputs(ints))
                    self._sync()
                    best = min(best, time.perf_counter() - t0)
                self.step_seconds[(bucket, frames)] = best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run(self, slots: torch.Tensor, z: torch.Tensor, fed: torch.Tensor, lengths: torch.Tensor,
             sids: torch.Tensor) -> torch.Tensor:
        pieces = []
        for at in range(0, z.shape[2], self.max_frames):
            feed = {"z": z[:, :, at : at + self.max_frames].contiguous(), "fed": fed + at, "lengths": lengths}
            if self.multi_speaker:
                feed["sid"] = sids
            for name, hist in zip(self._state_in, self.history, strict=True):
                feed[name] = hist.index_select(0, slots)
            out = self.run(feed)
            for name, hist in zip(self._state_out, self.history, strict=True):
                hist.index_copy_(0, slots, out[name])
            pieces.append(out["audio"])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
