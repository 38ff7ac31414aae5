"""`cadenza voices install kokoro --from DIR`: the official layouts, built from the fetched files,
install into a cache folder offline and speak exactly as the registry install does; a folder
without a model, or with a voice of the wrong shape, is a one-line error that writes nothing."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from service.audio.quality import psnr_db
from service.cli import main
from service.models.family import AcousticJob, SynthesisParams, utterance_rng
from service.models.kokoro import runtime as kr
from service.models.kokoro import weights as kw
from service.models.kokoro.install import NPZ_VOICES
from service.models.kokoro.official import official_model
from service.models.kokoro.voices import CHECKPOINT_FILE, MODEL_FILE, model_file
from service.models.registry import discover, open_frontend, recognise

TEXT = "Thank you for calling."
VOICES = ("af_heart", "bm_george")  # installed; the first one speaks (a voice is its bytes, checked equal)
Registry = tuple[dict[str, torch.Tensor], np.ndarray]  # the registry install's weights and speech


@pytest.fixture(autouse=True)
def own_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's models are dropped after it (each install would keep a 330 MB model)."""
    monkeypatch.setattr(kr, "_MODELS", {})


def runtime_of(home: Path) -> kr.KokoroRuntime:
    return kr.KokoroRuntime(recognise(home / "voices" / f"{VOICES[0]}.bin"), "cpu")


def speak(runtime: kr.KokoroRuntime) -> np.ndarray:
    """TEXT in the runtime's voice (seeded: the sine source's noise is the same)."""
    (sent,) = open_frontend(runtime.info.frontend_key).sentences(TEXT)
    job = AcousticJob(sent, None, SynthesisParams(seed=1), utterance_rng(1, sent.phoneme_ids))
    (utt,) = runtime.acoustic_batch([job])
    return runtime.reference(utt)


@pytest.fixture(scope="module")
def registry_install(kokoro_home: Path) -> Registry:
    """The registry install's weights and speech, the reference of both layouts."""
    runtime = runtime_of(kokoro_home)
    return runtime.model.state_dict(), speak(runtime)


def install(source: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The real command line; (exit code, its stderr's error line or '')."""
    code = main(["voices", "install", "kokoro", "--from", str(source), "--dir", str(target)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cadenza: error:")]
    return code, "\n".join(errors)


def assert_same_install(installed: Path, home: Path, reference: np.ndarray) -> None:
    """The voices are the registry install's bytes; the model speaks as the registry's does."""
    assert sorted(v.name for v in discover(installed)) == [f"kokoro-{v}" for v in VOICES]
    for voice in VOICES:
        assert (installed / "voices" / f"{voice}.bin").read_bytes() == (home / "voices" / f"{voice}.bin").read_bytes()
    ours = speak(runtime_of(installed))
    assert ours.shape == reference.shape
    error = float(np.abs(ours - reference).max())
    assert error <= 1e-4 or psnr_db(reference, ours) >= 90, error


def exact_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each g the very norm weight norm's kernel divides v by, so g v / |v| is v bit for bit: the
    checkpoint then holds exactly the registry install's weights. (With g from `norm_except_dim`,
    as `official_model` sets it, a weight comes back 1 ulp off, and the audio ~73 dB from it.)"""
    out = dict(state)
    for key in state:
        if key.endswith(".weight_g"):
            g, v = state[key], state[key[: -len("g")] + "v"]
            _, norm = torch._weight_norm_interface(v, torch.ones_like(g), 0)
            out[key] = torch.where(g == 0, g, norm.view_as(g))  # g = 0: a filter of zeros stays one
    return out


def test_official_checkpoint_and_pt_voices(kokoro_home: Path, registry_install: Registry,
                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Layout (a): `kokoro-v1_0.pth` as KModel saves and loads it (one state dict per module,
    weight norm as g/v) and `voices/*.pt`; no vocab.json in it."""
    source = tmp_path / "official"
    (source / "voices").mkdir(parents=True)
    weights, reference = registry_install
    kmodel = official_model(weights)
    checkpoint = {name: exact_weight_norm(getattr(kmodel, name).state_dict()) for name in kw.KMODEL_MODULES}
    del kmodel
    # One module as a training run may leave it, and KModel's loader takes it: keys under a
    # DataParallel `module.` prefix, and a buffer older transformers saved (ours has no use for it).
    bert = {"embeddings.position_ids": torch.arange(512)[None], **checkpoint["bert"]}
    checkpoint["bert"] = {f"module.{key}": value for key, value in bert.items()}
    torch.save(checkpoint, source / CHECKPOINT_FILE)
    for voice in VOICES:
        torch.save(kw.load_voice_pack(kokoro_home / "voices" / f"{voice}.bin"), source / "voices" / f"{voice}.pt")

    target = tmp_path / "cache"
    assert install(source, target, capsys) == (0, "")
    assert model_file(target) == target / CHECKPOINT_FILE
    assert (target / "vocab.json").read_text("utf-8") == (kokoro_home / "vocab.json").read_text("utf-8")
    assert_same_install(target, kokoro_home, reference)


def test_onnx_model_and_npz_voices(kokoro_home: Path, registry_install: Registry,
                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Layout (b): kokoro-onnx's files, the int8 graph and `voices-v1.0.bin` (an .npz)."""
    source = tmp_path / "kokoro-onnx"
    source.mkdir()
    (source / MODEL_FILE).symlink_to(kokoro_home / MODEL_FILE)
    packs = {v: kw.load_voice_pack(kokoro_home / "voices" / f"{v}.bin").numpy() for v in VOICES}
    with open(source / NPZ_VOICES, "wb") as f:  # a file object: np.savez would add .npz to a name
        np.savez(f, **packs)  # type: ignore[arg-type]

    target = tmp_path / "cache"
    assert install(source, target, capsys) == (0, "")
    assert (target / MODEL_FILE).read_bytes() == (kokoro_home / MODEL_FILE).read_bytes()
    assert_same_install(target, kokoro_home, registry_install[1])


def test_errors_are_one_line_and_write_nothing(kokoro_home: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    source, target = tmp_path / "downloads", tmp_path / "cache"
    (source / "voices").mkdir(parents=True)
    pack = kw.load_voice_pack(kokoro_home / "voices" / "af_heart.bin")
    torch.save(pack, source / "voices" / "af_heart.pt")
    code, error = install(source, target, capsys)
    assert code == 1 and "\n" not in error
    assert f"no Kokoro model in {source}" in error and CHECKPOINT_FILE in error

    (source / MODEL_FILE).symlink_to(kokoro_home / MODEL_FILE)
    torch.save(pack[:, 0], source / "voices" / "af_heart.pt")
    code, error = install(source, target, capsys)
    assert code == 1 and "\n" not in error
    assert str(source / "voices" / "af_heart.pt") in error and "[510, 256]" in error and "[510, 1, 256]" in error
    assert not target.exists()


def test_checkpoint_keys_lose_the_module_prefix(tmp_path: Path) -> None:
    """The official loader strips a `module.` prefix (a DataParallel training run's) from keys."""
    weight, bias = torch.randn(512, 768), torch.randn(512)
    torch.save({"bert_encoder": {"module.weight": weight, "module.bias": bias}}, tmp_path / "a.pth")
    state = kw.checkpoint_state_dict(tmp_path / "a.pth")
    assert set(state) == {"bert_encoder.weight", "bert_encoder.bias"}
    assert torch.equal(state["bert_encoder.weight"], weight)
    torch.save({"encoder": {}}, tmp_path / "b.pth")
    with pytest.raises(ValueError, match="not a Kokoro checkpoint"):
        kw.checkpoint_state_dict(tmp_path / "b.pth")


class _TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Conv1d(6, 6, 3, padding=1)
        self.lstm = nn.LSTM(6, 4, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.cnn(x.transpose(1, 2)).transpose(1, 2))
        return h


class _Encoder(nn.Module):
    """Float LSTM, Linear and Conv layers at the scopes of kokoro-onnx's graph: the exporter names
    each node by the modules called (`/encoder/text_encoder/lstm/LSTM`)."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = _TextEncoder()
        self.shared = nn.LSTM(8, 3, batch_first=True)  # the predictor's, at `encoder.shared` in the graph
        self.bert_encoder = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.shared(self.text_encoder(x))
        out: torch.Tensor = self.bert_encoder(h[:, 0])
        return out


class _FloatGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(x)
        return out


def test_float_graph_layers_read_as_torch_wrote_them(tmp_path: Path) -> None:
    """The float graph's layers as torch's exporter writes them (float LSTM W [dirs, 4H, in] in
    gates i, o, f, c; Linear as Gemm; Conv) read back as the modules' own weights."""
    model = _FloatGraph().eval()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 7, 6),), str(tmp_path / "float.onnx"), dynamo=False)
    got = kw.read_onnx_kokoro(tmp_path / "float.onnx").state_dict
    expected = {("predictor." + k if k.startswith("shared.") else k): v
                for k, v in model.encoder.state_dict().items()}
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
