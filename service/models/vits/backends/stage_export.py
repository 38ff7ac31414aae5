"""Export our VITS stages to ONNX (dynamic batch and length axes).

Three graphs, named by what they produce: `prior` (phoneme ids -> prior stats
and log-durations), `latent` (prior sample window -> latent window, the flow) and
`audio` (latent window -> waveform, the vocoder); plus one graph per decoder
stage for the staged streaming decoder: `latent_s<i>` (one flow coupling each)
and `audio_s<i>` (one generator stage each). The same files feed the
onnxruntime backend and TensorRT engine builds."""

from __future__ import annotations

import copy
import hashlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from service.models.compiled import cache_home
from service.models.vits.flow import fold_couplings
from service.models.vits.generator import polyphase_upsamplers
from service.models.vits.model import VitsModel
from service.models.vits.receptive_field import decoder_stage_table

log = logging.getLogger(__name__)

STAGES = ("prior", "latent", "audio")
EXPORT_VERSION = "5"


class PriorStage(nn.Module):
    def __init__(self, model: VitsModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, ids: torch.Tensor, lengths: torch.Tensor, dp_noise: torch.Tensor, sid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m_p, logs_p, logw, _ = self.model.encode(ids, lengths, dp_noise, sid if self.model.emb_g else None)
        return m_p, logs_p, logw


class LatentStage(nn.Module):
    def __init__(self, model: VitsModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, z_p: torch.Tensor, sid: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(z_p[:, :1])
        return self.model.flow_reverse(z_p, mask, sid if self.model.emb_g else None)


class AudioStage(nn.Module):
    def __init__(self, model: VitsModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, z: torch.Tensor, sid: torch.Tensor) -> torch.Tensor:
        return self.model.vocode(z, sid if self.model.emb_g else None)


class DecoderStage(nn.Module):
    """One staged-decoder stage (see VitsModel.decoder_stage)."""

    def __init__(self, model: VitsModel, index: int) -> None:
        super().__init__()
        self.model = model
        self.index = index

    def forward(self, x: torch.Tensor, sid: torch.Tensor) -> torch.Tensor:
        g = self.model.speaker_embedding(sid) if self.model.uses_speaker(self.index) else None
        return self.model.decoder_stage(self.index, x, g)


def decoder_stage_names(model: VitsModel) -> list[str]:
    """Staged-decoder graphs in run order: flow couplings, then generator stages."""
    return [f"latent_s{i}" for i in range(model.flow.num_stages)] + [
        f"audio_s{i}" for i in range(model.dec.num_stages)
    ]


def voice_digest(onnx_path: Path) -> str:
    h = hashlib.sha256()
    with open(onnx_path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def export_stages(model: VitsModel, out_dir: Path, opset: int = 17) -> dict[str, Path]:
    """Write prior.onnx, latent.onnx and audio.onnx for `model` into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.float().eval()
    # The graphs carry inference forms of the same function: folded flow couplings
    # (14% less flow time) and polyphase upsamplers (about 2% less synthesis time on
    # ONNX Runtime CPU). The voice's own model stays as trained for the torch backend;
    # stage tables are read from it.
    folded = copy.deepcopy(model)
    fold_couplings(folded.flow)
    polyphase_upsamplers(folded.dec)
    c = model.hp.inter_channels
    t_ph, t_fr = 13, 40
    ids = torch.randint(3, 100, (2, t_ph))
    lengths = torch.tensor([t_ph, t_ph - 3])
    sid = torch.zeros(2, dtype=torch.long)
    specs: dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], list[str], list[str], dict]] = {
        "prior": (
            PriorStage(model), (ids, lengths, torch.zeros(2, 2, t_ph), sid),
            ["ids", "lengths", "dp_noise", "sid"], ["m_p", "logs_p", "logw"],
            {"ids": {0: "batch", 1: "phonemes"}, "lengths": {0: "batch"},
             "dp_noise": {0: "batch", 2: "phonemes"}, "sid": {0: "batch"},
             "m_p": {0: "batch", 2: "phonemes"}, "logs_p": {0: "batch", 2: "phonemes"},
             "logw": {0: "batch", 2: "phonemes"}},
        ),
        "latent": (
            LatentStage(folded), (torch.randn(2, c, t_fr), sid), ["z_p", "sid"], ["z"],
            {"z_p": {0: "batch", 2: "frames"}, "sid": {0: "batch"}, "z": {0: "batch", 2: "frames"}},
        ),
        "audio": (
            AudioStage(folded), (torch.randn(2, c, t_fr), sid), ["z", "sid"], ["audio"],
            {"z": {0: "batch", 2: "frames"}, "sid": {0: "batch"}, "audio": {0: "batch", 1: "samples"}},
        ),
    }
    table = decoder_stage_table(model)
    channels = [c] + [int(ch) for _, _, ch in table[:-1]]
    stage_lengths = [t_fr]
    for factor, _, _ in table[:-1]:
        stage_lengths.append(stage_lengths[-1] * factor)
    for i, name in enumerate(decoder_stage_names(model)):
        specs[name] = (
            DecoderStage(folded, i), (torch.randn(2, channels[i], stage_lengths[i]), sid), ["x", "sid"], ["y"],
            {"x": {0: "batch", 2: "length"}, "sid": {0: "batch"}, "y": {0: "batch", 2: "out_length"}},
        )
    paths = {}
    for name, (module, args, inputs, outputs, axes) in specs.items():
        path = out_dir / f"{name}.onnx"
        with torch.no_grad():
            torch.onnx.export(
                module, args, str(path), input_names=inputs, output_names=outputs,
                dynamic_axes=axes, opset_version=opset, do_constant_folding=True, dynamo=False,
            )
        paths[name] = path
    return paths


# Where an image keeps the exports it made at build time (read-only, any user can read them):
# looked up before the writable cache, so a pod running as a random UID finds them too.
PREBUILT_DIR = Path("/opt/cadenza/onnx")


def export_dir_name(onnx_path: Path) -> str:
    """<voice>-<digest>-v<version>: a changed voice file or export code never reuses old graphs."""
    return f"{onnx_path.name.removesuffix('.onnx')}-{voice_digest(onnx_path)}-v{EXPORT_VERSION}"


def default_cache_dir() -> Path:
    """Where stage exports are kept when no --cache-dir is given."""
    return cache_home() / "onnx"


def writable_cache_dir(cache_dir: Path) -> Path:
    """cache_dir if it can be created and written, else a temporary directory (with a warning):
    an unwritable cache (read-only root filesystem, a file in the way, a random UID without a
    home) costs an export per start, never the server."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache_dir):
            pass
        return cache_dir
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / "cadenza-onnx"
        try:
            fallback.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=fallback):
                pass
        except OSError:
            fallback = Path(tempfile.mkdtemp(prefix="cadenza-onnx-"))
        log.warning("ONNX export cache %s is not writable (%s); using %s instead (--cache-dir)",
                    cache_dir, exc.strerror or exc, fallback)
        return fallback


def find_graphs(names: Sequence[str], dirs: Sequence[Path]) -> dict[str, Path] | None:
    """The graphs `names` (<name>.onnx) from the first of `dirs` that has them all, or None."""
    for base in dirs:
        found = {name: base / f"{name}.onnx" for name in names}
        if all(p.is_file() for p in found.values()):
            return found
    return None


def make_graphs(names: Sequence[str], out_dir: Path, make: Callable[[Path], object]) -> dict[str, Path]:
    """The graphs `names` written by `make(dir)` into a private temporary dir next to `out_dir`
    (concurrent makers never mix their files), then moved into `out_dir`."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        make(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            (tmp / f"{name}.onnx").replace(out_dir / f"{name}.onnx")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {name: out_dir / f"{name}.onnx" for name in names}


def cached_stage_exports(
    model: VitsModel, onnx_path: Path, cache_dir: Path, prebuilt: Sequence[Path] = (PREBUILT_DIR,),
) -> dict[str, Path]:
    """Stage exports for a voice: complete ones from a prebuilt (read-only) dir or cache_dir, else
    made once and kept under cache_dir/<voice>-<digest>-v<version> (see writable_cache_dir)."""
    name = export_dir_name(onnx_path)
    stages = (*STAGES, *decoder_stage_names(model))
    found = find_graphs(stages, [base / name for base in (*prebuilt, cache_dir)])
    if found is not None:
        return found
    out_dir = writable_cache_dir(cache_dir) / name
    voice = onnx_path.name.removesuffix(".onnx")

    def export(tmp: Path) -> None:
        # The one slow step of a first run: say that it happens once, then how long it took (its
        # time depends on the machine and the voice, so none is promised beforehand).
        log.info("exporting ONNX stages for voice %s into %s (once: later runs load them from there) ...", voice,
                 out_dir)
        start = time.perf_counter()
        written = export_stages(model, tmp)
        log.info("exported %d ONNX stages for voice %s in %.1f s (cached for later runs)", len(written), voice,
                 time.perf_counter() - start)

    # The fallback dir may have them already.
    return find_graphs(stages, [out_dir]) or make_graphs(stages, out_dir, export)
