"""Our Kokoro modules against the official `kokoro.model.KModel` (PyPI kokoro 0.9.4), FP32.

Both are built from the Kokoro-82M configuration with random weights (no download): ours
loads the official model's state dict strictly, weight-norm pairs and all.

The official sine source draws its noise from the global generator: `torch.rand` for an
initial phase (which its frame-rate phase accumulation never reads), then `randn_like` of a
[B, samples, 9] tensor laid out harmonic-major, which fills values in a different order than
`torch.randn` of that shape. `official_noise` reproduces those draws after the same seed, so
both decoders get identical noise."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from service.models.kokoro.hparams import KokoroHParams
from service.models.kokoro.model import KokoroModel
from service.models.kokoro.official import official_kmodel
from service.models.kokoro.weights import KOKORO_V1_CONFIG
from service.models.weight_norm import fold_weight_norm

# Kokoro-82M v1.0's config.json (its vocabulary is not needed: the tests feed ids).
CONFIG: dict[str, Any] = {**KOKORO_V1_CONFIG, "vocab": {}}

# (token count, speed)
SEQUENCES = [(5, 1.0), (16, 1.3), (40, 2.2)]


@pytest.fixture(scope="module")
def models() -> tuple[Any, KokoroModel]:
    kmodel_class = official_kmodel()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.pth"
        torch.save({}, empty)  # KModel loads its weights from a file: give it none
        official = kmodel_class(repo_id="hexgrad/Kokoro-82M", config=CONFIG, model=str(empty)).eval()
    with torch.no_grad():
        for p in official.parameters():
            # Break the identity initialisations (norm affines, Snake alphas) so that a
            # mixed-up parameter shows.
            p.mul_(1 + 0.05 * torch.randn_like(p))
        # Random weights give ~25 frames a phoneme; about 5 keeps the decodes short.
        official.predictor.duration_proj.linear_layer.bias.sub_(2.2)
    ours = KokoroModel(KokoroHParams.from_config(CONFIG))
    ours.load_state_dict(official.state_dict(), strict=True)
    return official, ours.eval()


def _ids(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CONFIG["n_token"], (1, count), generator=g)
    ids[0, 0] = ids[0, -1] = 0  # the boundary token KModel puts around every utterance
    return ids


def _style(seed: int) -> torch.Tensor:
    return torch.randn(1, 256, generator=torch.Generator().manual_seed(1000 + seed)) * 0.5


def official_noise(seed: int, batch: int, samples: int) -> torch.Tensor:
    """The sine-source noise the official decoder draws after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    torch.rand(batch, 9)  # its initial phase draw
    return torch.randn_like(torch.empty(batch, 9, samples).transpose(1, 2))


def psnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    mse = (reference - other).pow(2).mean().item()
    peak = reference.abs().max().item()
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def test_config_and_frame_size() -> None:
    hp = KokoroHParams.from_config(CONFIG)
    assert hp == KokoroHParams()
    assert hp.samples_per_frame == 600 and hp.source_upsample == 300


@pytest.mark.parametrize(("count", "speed"), SEQUENCES)
def test_acoustic_and_end_to_end(models: tuple[Any, KokoroModel], count: int, speed: float) -> None:
    official, ours = models
    ids, style = _ids(count, count), _style(count)
    captured: dict[str, torch.Tensor] = {}

    def grab(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured["asr"], captured["f0"], captured["n"] = (a.clone() for a in args[:3])

    hook = official.decoder.register_forward_pre_hook(grab)
    try:
        torch.manual_seed(count)
        audio, durations = official.forward_with_tokens(ids, style, speed)
    finally:
        hook.remove()

    with torch.no_grad():
        out = ours.acoustic(ids, style, speed)
    assert torch.equal(out.durations, durations.reshape(-1))
    frames = int(durations.sum())
    assert out.asr.shape == (1, 512, frames) and out.f0.shape == out.n.shape == (1, 2 * frames)
    for name in ("asr", "f0", "n"):
        torch.testing.assert_close(getattr(out, name), captured[name], rtol=1e-4, atol=1e-5, msg=name)

    # The whole model: our decoder on our acoustic output, the official noise.
    with torch.no_grad():
        ours_audio = ours.decode(out.asr, out.f0, out.n, style, official_noise(count, 1, frames * 600))
    assert ours_audio.shape == (1, frames * 600)
    assert psnr(audio.reshape(1, -1), ours_audio) >= 60.0


@pytest.mark.parametrize("frames", [7, 24])
def test_decoder_voiced(models: tuple[Any, KokoroModel], frames: int) -> None:
    """Same decoder input on both, with a voiced F0 contour (random weights predict F0 near 0,
    all unvoiced, which would leave the sine path untested) and two utterances in a batch."""
    official, ours = models
    g = torch.Generator().manual_seed(frames)
    steps = torch.arange(2 * frames, dtype=torch.float32)
    contour = 150 + 70 * torch.sin(steps / 7.0 + torch.rand(2, 1, generator=g) * 6)
    f0 = contour * ((steps % 40) > 9)  # voiced stretches with unvoiced gaps
    n = torch.randn(2, 2 * frames, generator=g) * 0.5
    asr = torch.randn(2, 512, frames, generator=g) * 0.3
    style = torch.cat([_style(frames), _style(frames + 1)])
    with torch.no_grad():
        torch.manual_seed(frames)
        expected = official.decoder(asr, f0, n, style[:, :128]).squeeze(1)
        got = ours.decode(asr, f0, n, style, official_noise(frames, 2, frames * 600))
    assert got.shape == expected.shape == (2, frames * 600)
    for row in range(2):
        assert psnr(expected[row], got[row]) >= 60.0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_decode_is_seeded(models: tuple[Any, KokoroModel]) -> None:
    _, ours = models
    asr, f0, n = torch.randn(1, 512, 5), torch.full((1, 10), 200.0), torch.zeros(1, 10)
    with torch.no_grad():
        a = ours.decode(asr, f0, n, _style(0), generator=torch.Generator().manual_seed(3))
        b = ours.decode(asr, f0, n, _style(0), generator=torch.Generator().manual_seed(3))
        c = ours.decode(asr, f0, n, _style(0), generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_weight_norm_spellings(models: tuple[Any, KokoroModel]) -> None:
    """An already-folded dict and the parametrisation API's names load to the same weights."""
    official, ours = models
    legacy = official.state_dict()
    parametrized = {k.replace("weight_g", "parametrizations.weight.original0")
                     .replace("weight_v", "parametrizations.weight.original1"): v for k, v in legacy.items()}
    reference = ours.state_dict()
    for source in (fold_weight_norm(legacy), parametrized):
        with torch.device("meta"):  # no initialisation: every parameter comes from `source`
            other = KokoroModel()
        other.load_state_dict(source, strict=True, assign=True)
        for key, value in other.state_dict().items():
            assert torch.equal(value, reference[key]), key
    # The fold is w = g v / |v| over all but the output dim (ConvTranspose: its input dim).
    for name in ("decoder.generator.conv_post", "decoder.generator.ups.0", "decoder.F0_conv"):
        g, v = legacy[name + ".weight_g"], legacy[name + ".weight_v"]
        torch.testing.assert_close(reference[name + ".weight"], g * v / v.norm(dim=(1, 2), keepdim=True))


def test_padded_rows_decode_as_alone(models: tuple[Any, KokoroModel]) -> None:
    """Utterances of different lengths padded into one batch (what the slot decoder runs) give
    each its decode alone: every norm takes its row's own frames, the STFTs reflect at its own
    end, the inverse STFT normalises by its own windows; the padding is silent."""
    _, ours = models
    lengths = [9, 4, 13]
    g = torch.Generator().manual_seed(5)
    rows = []
    for t in lengths:
        steps = torch.arange(2 * t, dtype=torch.float32)
        rows.append((torch.randn(1, 512, t, generator=g) * 0.3, (160 + 60 * torch.sin(steps / 5)) * (steps % 9 > 2),
                     torch.randn(1, 2 * t, generator=g) * 0.5, torch.randn(1, t * 600, 9, generator=g)))
    styles = torch.cat([_style(i) for i in range(len(lengths))])
    top = max(lengths)
    asr = torch.zeros(len(lengths), 512, top)
    f0, n = torch.zeros(len(lengths), 2 * top), torch.zeros(len(lengths), 2 * top)
    noise = torch.zeros(len(lengths), top * 600, 9)
    for b, (a, f, e, z) in enumerate(rows):
        t = lengths[b]
        asr[b, :, :t], f0[b, :2 * t], n[b, :2 * t], noise[b, :t * 600] = a[0], f, e[0], z[0]

    # The excitation's first STFT frame is centred on its first sample and reflected there, so it
    # is even: its bins are real, and where one is negative its phase is +pi or -pi by the sign of
    # a rounding-level imaginary part. The network reads that phase as a number, so a row batched
    # and alone, rounding apart in the excitation (as on some CPUs), can read inputs 2 pi apart;
    # upstream's decoder has the same property. The padding is what is tested here: both runs take
    # such phases on the +pi side.
    def one_side_of_the_wrap(module: Any, inputs: Any, out: torch.Tensor) -> torch.Tensor:
        half = out.shape[1] // 2
        phase = out[:, half:]
        return torch.cat([out[:, :half], torch.where(phase < -math.pi + 1e-5, phase + 2 * math.pi, phase)], dim=1)

    hook = ours.decoder.generator.source_stft.register_forward_hook(one_side_of_the_wrap)
    try:
        with torch.no_grad():
            batch = ours.decode(asr, f0, n, styles, noise, frames=torch.tensor(lengths))
            for b, (a, f, e, z) in enumerate(rows):
                alone = ours.decode(a, f[None], e, styles[b:b + 1], z)[0]
                t = lengths[b] * 600
                torch.testing.assert_close(batch[b, :t], alone, rtol=0, atol=1e-4)
                assert torch.count_nonzero(batch[b, t:]) == 0
    finally:
        hook.remove()


def test_padded_rows_acoustic_as_alone(models: tuple[Any, KokoroModel]) -> None:
    """Sentences of different lengths padded into one acoustic batch (what the engine's acoustic
    stage runs), each with its own style and speed, give each its run alone: same durations, and
    features, F0 and energy within float rounding."""
    _, ours = models
    rows = [(_ids(12, 1), _style(1), 1.0), (_ids(5, 2), _style(2), 1.3), (_ids(20, 3), _style(3), 0.8)]
    top = max(ids.shape[1] for ids, _, _ in rows)
    ids = torch.zeros(len(rows), top, dtype=torch.long)
    for b, (row, _, _) in enumerate(rows):
        ids[b, : row.shape[1]] = row[0]
    lengths = torch.tensor([row.shape[1] for row, _, _ in rows])
    styles = torch.cat([style for _, style, _ in rows])
    speeds = torch.tensor([speed for _, _, speed in rows])
    with torch.no_grad():
        batch = ours.acoustic_batch(ids, lengths, styles, speeds)
        for got, (row, style, speed) in zip(batch, rows, strict=True):
            alone = ours.acoustic(row, style, speed)
            assert torch.equal(got.durations, alone.durations)
            for name in ("asr", "f0", "n"):
                torch.testing.assert_close(getattr(got, name), getattr(alone, name), rtol=1e-4, atol=1e-4, msg=name)
