"""The decoder step graph (what the TensorRT backend builds its engines from), run in ONNX
Runtime on the CPU against the torch slot decoder: same audio, same state, step after step;
and the FP32 pins found among its nodes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from service.models.family import AcousticJob, StepRows, SynthesisParams, utterance_rng
from service.models.registry import open_voice
from service.models.vits.backends.step_graph import (
    GraphStepDecoder,
    cached_step_export,
    full_scope_names,
    node_module,
    pinned_nodes,
    state_names,
)
from service.models.vits.model import VitsModel
from service.models.vits.precision import VITS_FP32_PINS, pinned_modules
from service.models.vits.runtime import Utterance, VitsRuntime
from service.models.vits.streaming import VitsStreamingDecoder
from service.models.vits.voice import builtin_voice_info, read_piper_voice

TEXT = "Hello there, this is a streaming test. Short one. And a third sentence here."
# FP32 in both: the graph and the torch step differ only in how each library orders its
# float sums, well below this on audio in [-1, 1]; a wrong mask, slice or state is off by
# orders of magnitude more. The same bound as chunked vs full decode.
ATOL = 1e-4


class Voice:
    def __init__(self, path: str | None, speaker: int | None, cache: Path) -> None:
        info = read_piper_voice(Path(path)) if path else builtin_voice_info()
        runtime: VitsRuntime = open_voice(info, "torch", "cpu")  # type: ignore[assignment]
        self.model: VitsModel = runtime.voice.model
        params = SynthesisParams(seed=7, speaker=speaker)
        sid = info.speaker_index(speaker)
        sentences = runtime.voice.frontend.sentences(TEXT)
        self.utts: list[Utterance] = runtime.acoustic_batch(
            [AcousticJob(s, sid, params, utterance_rng(7, s.phoneme_ids)) for s in sentences])
        self.onnx = cached_step_export(self.model, info.model_path, cache)
        self.session = ort.InferenceSession(str(self.onnx), providers=["CPUExecutionProvider"])
        self.nodes = [n.name for n in onnx.load(str(self.onnx), load_external_data=False).graph.node]

    def run(self, feed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = [o.name for o in self.session.get_outputs()]
        out = self.session.run(names, {k: v.numpy() for k, v in feed.items()})
        return {k: torch.from_numpy(v) for k, v in zip(names, out, strict=True)}


@pytest.fixture(scope="module", params=[("tiny", 1), ("builtin", None)], ids=["tiny-multi", "builtin"])
def voice(request: pytest.FixtureRequest, tiny_voice_path: Path, onnx_cache_dir: str) -> Voice:
    name, speaker = request.param
    return Voice(str(tiny_voice_path) if name == "tiny" else None, speaker, Path(onnx_cache_dir))


def _start(dec: VitsStreamingDecoder, voice: Voice, slots: list[int]) -> None:
    for slot, u in zip(slots, voice.utts, strict=True):
        assert dec.start(slot, u.prior)


def _sids(voice: Voice) -> list[int] | None:
    return None if voice.utts[0].sid is None else [u.sid or 0 for u in voice.utts]


def test_the_graph_has_the_steps_inputs_and_outputs(voice: Voice) -> None:
    ins, outs = state_names(len(VitsStreamingDecoder(voice.model, "fp32", 1, torch.device("cpu"),
                                                     torch.float32).shapes))
    speaker = ["sid"] if voice.model.emb_g is not None else []
    assert [i.name for i in voice.session.get_inputs()] == ["z", "fed", "lengths", *speaker, *ins]
    assert [o.name for o in voice.session.get_outputs()] == ["audio", *outs]


def test_onnx_runtime_steps_equal_the_torch_steps(voice: Voice) -> None:
    """Three utterances side by side in steps of varying size (one graph: rows and frames are
    dynamic), from slots the torch decoder and the graph decoder each keep: every step's
    audio and every slot's state agree."""
    torch_dec = VitsStreamingDecoder(voice.model, "fp32", 4, torch.device("cpu"), torch.float32)
    graph_dec = GraphStepDecoder(voice.model, "fp32", 4, torch.device("cpu"), voice.run, max_frames=64)
    slots = [3, 0, 2]
    _start(torch_dec, voice, slots)
    _start(graph_dec, voice, slots)
    fed, sizes, k = 0, [8 + torch_dec.lag, 8, 21, 1, 40], 0
    while fed - torch_dec.lag <= max(u.frames for u in voice.utts):  # every edge is decoded
        n = sizes[min(k, len(sizes) - 1)]
        rows = StepRows(slots, [fed] * 3, n, _sids(voice))
        a, b = torch_dec.step(rows).numpy(), graph_dec.step(rows).numpy()
        assert a.shape == b.shape == (3, n * torch_dec.hop)
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
        fed, k = fed + n, k + 1
    for h_torch, h_graph in zip(torch_dec.history, graph_dec.history, strict=True):
        np.testing.assert_allclose(h_graph[slots].numpy(), h_torch[slots].numpy(), atol=ATOL, rtol=0)


def test_a_long_step_runs_as_steps_the_engine_takes(voice: Voice) -> None:
    """An FP32 redo replays a whole utterance in one step: longer than the engine's frames, it
    is cut into consecutive steps with the same audio."""
    torch_dec = VitsStreamingDecoder(voice.model, "fp32", 2, torch.device("cpu"), torch.float32)
    graph_dec = GraphStepDecoder(voice.model, "fp32", 2, torch.device("cpu"), voice.run, max_frames=16)
    u = voice.utts[0]
    torch_dec.start(1, u.prior)
    graph_dec.start(1, u.prior)
    n = u.frames + torch_dec.lag
    sids = None if u.sid is None else [u.sid]
    a = torch_dec.step(StepRows([1], [0], n, sids)).numpy()
    b = graph_dec.step(StepRows([1], [0], n, sids)).numpy()
    np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)


# --- FP32 pins -----------------------------------------------------------------------------------


def test_node_names_carry_their_modules_full_path() -> None:
    called = {"flow", "flow.flows.2", "flow.flows.2.enc", "dec", "dec.conv_post", "emb_g"}
    assert full_scope_names(["/flows.2/enc/Conv", "/conv_post/Conv", "/emb_g/Gather", "/Range", "Cast_7"], called) \
        == ["/model/flow/flows/2/enc/Conv", "/model/dec/conv_post/Conv", "/model/emb_g/Gather", "/Range", "Cast_7"]
    with pytest.raises(ValueError, match=r"flows\.2"):  # the duration predictor has flows too
        full_scope_names(["/flows.2/Conv"], called | {"dp.flows.2"})
    assert node_module("/model/dec/resblocks.1/convs1.0/Conv") == "dec.resblocks.1.convs1.0"
    assert node_module("/Range") == node_module("Cast_7") == node_module("/ups.0/Conv") == ""


def test_fp32_pins_pick_the_pinned_modules_nodes_and_no_others(voice: Voice) -> None:
    """Against the real export: the nodes pinned are those of the pinned modules the step runs
    (the speaker embedding, the generator's output conv), every such module has its nodes
    pinned, and nothing of the flow or the upsamplers is."""
    pinned = pinned_nodes(voice.nodes, VITS_FP32_PINS)
    modules = {node_module(n) for n in pinned}
    step_modules = [m for m in pinned_modules(voice.model, VITS_FP32_PINS) if m.split(".")[0] not in ("enc_p", "dp")]
    assert modules == set(step_modules)
    assert "/model/dec/conv_post/Conv" in pinned
    assert ("/model/emb_g/Gather" in pinned) == (voice.model.emb_g is not None)
    assert not any(n.startswith(("/model/flow/", "/model/dec/ups/")) for n in pinned)
    wider = {node_module(n) for n in pinned_nodes(voice.nodes, ("dec.ups.*", "flow.flows.*.enc"))}
    assert any(m.startswith("dec.ups.") for m in wider)
    assert any(m.startswith("flow.flows.") and ".enc" in m for m in wider)


def test_scopes_agree_with_the_weights_each_node_reads(voice: Voice) -> None:
    """The renamed scopes are the modules whose parameters the nodes read (the exporter keeps
    parameter names), so a pin names the same layers in the graph as in torch."""
    graph = onnx.load(str(voice.onnx), load_external_data=False).graph
    weights = {w.name for w in graph.initializer if w.name.startswith("model.")}
    checked = 0
    for node in graph.node:
        for name in node.input:
            if name in weights:
                assert node_module(node.name) == name.removeprefix("model.").rpartition(".")[0], (node.name, name)
                checked += 1
    assert checked > 10


def test_capture_all_times_each_step_shape_on_the_scratch_slot_only(voice: Voice) -> None:
    dec = GraphStepDecoder(voice.model, "fp16", 3, torch.device("cpu"), voice.run, max_frames=32,
                           graph_frames=(8, 8 + 17), buckets=(1, 2, 4))
    for h in dec.history:
        h[:3].fill_(0.25)
    dec.capture_all()
    assert set(dec.step_seconds) == {(b, f) for b in (1, 2) for f in (8, 25)}  # buckets fit the capacity
    assert all(s > 0 for s in dec.step_seconds.values())
    assert all(torch.all(h[:3] == 0.25) for h in dec.history)
