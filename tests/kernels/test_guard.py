"""Guard: the torch reference (and `guard` on CPU, which runs it) against values worked out by
hand; on a GPU, the CUDA kernel against the reference bit for bit (`gpu` tests, skipped without
one: on CPU `guard` *is* the reference, so comparing the two there would prove nothing)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.guard import GuardResult, guard, guard_reference

NAN, INF = math.nan, math.inf


def test_counts_nonfinite_per_row() -> None:
    x = torch.tensor([[0.1, NAN, INF, -INF, 0.2], [0.0, 0.0, 0.0, 0.0, NAN], [0.3] * 5])
    r = guard_reference(x)
    assert r.nonfinite.dtype == torch.int32
    assert r.nonfinite.tolist() == [3, 1, 0]
    assert r.tripped() == [True, True, False]


def test_peak_ignores_nonfinite() -> None:
    x = torch.tensor([[0.1, NAN, -0.7, INF], [NAN, INF, -INF, NAN], [-2.5, 0.5, 1.0, 0.0]])
    r = guard_reference(x)
    assert r.peak.dtype == torch.float32
    assert r.peak.tolist() == pytest.approx([0.7, 0.0, 2.5])


def test_pcm_clips_and_zeroes_nonfinite() -> None:
    x = torch.tensor([[1.0, -1.0, 3.0, -7.0, NAN, INF, -INF, 0.0]])
    r = guard_reference(x)
    assert r.pcm.dtype == torch.int16
    assert r.pcm.tolist() == [[32767, -32767, 32767, -32767, 0, 0, 0, 0]]


# float32 inputs whose product with 32767 is exactly k + 0.5 in float32 (bit patterns), and
# the PCM value round-half-to-even gives (half-up would give 1, 2, 3, 4, 0, -1, -2, 101, 102, 32767).
HALF_TICKS = [
    (0x37800100, 0.5, 0),
    (0x38400180, 1.5, 2),
    (0x38A00140, 2.5, 2),
    (0x38E001C0, 3.5, 4),
    (0xB7800100, -0.5, 0),
    (0xB8400180, -1.5, -2),
    (0xB8A00140, -2.5, -2),
    (0x3B490192, 100.5, 100),
    (0x3B4B0196, 101.5, 102),
    (0x3F7FFF00, 32766.5, 32766),
]


def test_pcm_rounds_half_to_even_in_float32() -> None:
    x = np.array([b for b, _, _ in HALF_TICKS], dtype=np.uint32).view(np.float32)
    # Precondition, in numpy's float32: each product lands exactly on the half tick.
    assert (x * np.float32(32767.0)).tolist() == [t for _, t, _ in HALF_TICKS]
    r = guard_reference(torch.from_numpy(x))
    assert r.pcm.tolist() == [want for _, _, want in HALF_TICKS]


def test_hand_made_rows_with_nonfinite_and_overflow() -> None:
    big = 3.0e38  # finite float32; times 32767 it would overflow, so clipping must come first
    x = torch.tensor(
        [
            [0.5, -0.25, NAN, 1.0, -1.0, 0.0],
            [big, -big, INF, 2.0, -0.0, 1e-6],
            [NAN, NAN, NAN, NAN, NAN, NAN],
            [-INF, 0.999, -0.999, 0.25, 1.5e-5, -3.0],
        ],
        dtype=torch.float32,
    )
    r = guard_reference(x)
    assert r.nonfinite.tolist() == [1, 1, 6, 1]
    assert r.tripped() == [True, True, True, True]
    assert r.peak.tolist() == [1.0, np.float32(big).item(), 0.0, 3.0]
    # 0.5 * 32767 = 16383.5 -> 16384 (even); -0.25 * 32767 = -8191.75 -> -8192;
    # 0.999 * 32767 = 32734.233 -> 32734; 1e-6 * 32767 = 0.033 -> 0; 1.5e-5 * 32767 = 0.49 -> 0.
    assert r.pcm.tolist() == [
        [16384, -8192, 0, 32767, -32767, 0],
        [32767, -32767, 0, 32767, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 32734, -32734, 8192, 0, -32767],
    ]


def test_fp16_overflow_to_inf_trips_the_row() -> None:
    # A chunk computed in FP16 that overflowed (70000 > 65504) arrives as +-Inf: tripped, PCM 0.
    x = torch.tensor([[70000.0, -70000.0, 0.5], [65504.0, -0.5, 0.0]]).half()
    r = guard_reference(x)
    assert r.nonfinite.tolist() == [2, 0]
    assert r.peak.tolist() == [0.5, 65504.0]
    assert r.pcm.tolist() == [[0, 0, 16384], [32767, -16384, 0]]


def test_bfloat16_is_upcast_like_fp16() -> None:
    x = torch.tensor([[0.5, -2.0, INF, 0.25]], dtype=torch.bfloat16)
    r = guard_reference(x)
    assert r.nonfinite.tolist() == [1]
    assert r.peak.tolist() == [2.0]
    assert r.pcm.tolist() == [[16384, -32767, 0, 8192]]


def test_matches_numpy_float32_arithmetic() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 1001)) * 0.8).astype(np.float32)
    r = guard_reference(torch.from_numpy(x))
    want = np.rint(np.clip(x, -1, 1) * np.float32(32767.0)).astype(np.int16)
    assert np.array_equal(r.pcm.numpy(), want)
    assert np.array_equal(r.peak.numpy(), np.abs(x).max(axis=1))


def test_fp16_input_is_upcast_first() -> None:
    x16 = torch.tensor([[0.3333, -0.9999, 65504.0, -65504.0, NAN, 6e-8]], dtype=torch.float16)
    r16 = guard_reference(x16)
    r32 = guard_reference(x16.float())
    assert torch.equal(r16.pcm, r32.pcm)
    assert torch.equal(r16.nonfinite, r32.nonfinite)
    assert torch.equal(r16.peak, r32.peak)
    assert r16.peak.item() == 65504.0


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8191])
def test_odd_lengths_and_1d(n: int) -> None:
    x = torch.linspace(-1.5, 1.5, n) if n else torch.zeros(0)
    r = guard_reference(x)
    assert r.pcm.shape == (n,)
    assert r.nonfinite.tolist() == [0]
    assert r.peak.tolist() == ([1.5] if n else [0.0])


def test_rejects_other_dtypes_and_shapes() -> None:
    with pytest.raises(TypeError):
        guard_reference(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        guard_reference(torch.zeros(2, 2, 2))


def test_guard_on_cpu_gives_the_hand_computed_values() -> None:
    # guard() on a CPU tensor: checked against numbers worked out by hand, not against
    # guard_reference (which it calls on CPU).
    x = torch.tensor([[0.25, NAN, -3.0, 0.5], [1.0, -INF, -0.75, 0.0]])
    r = guard(x)
    assert r.nonfinite.tolist() == [1, 1]
    assert r.peak.tolist() == [3.0, 1.0]
    assert r.pcm.dtype == torch.int16
    # 0.25 * 32767 = 8191.75 -> 8192; 0.5 * 32767 = 16383.5 -> 16384; -0.75 * 32767 = -24575.25 -> -24575.
    assert r.pcm.tolist() == [[8192, 0, -32767, 16384], [32767, 0, -24575, 0]]
    one_d = guard(torch.tensor([0.5, NAN]))
    assert one_d.pcm.tolist() == [16384, 0]
    assert one_d.nonfinite.tolist() == [1]


# --- GPU: the CUDA kernel against the reference --------------------------------------------


def _assert_same(got: GuardResult, want: GuardResult) -> None:
    assert torch.equal(got.nonfinite.cpu(), want.nonfinite.cpu())
    # Peak compared as bit patterns: bit-exact, not approximately equal.
    assert torch.equal(got.peak.cpu().view(torch.int32), want.peak.float().cpu().view(torch.int32))
    assert got.pcm.dtype == torch.int16
    assert torch.equal(got.pcm.cpu(), want.pcm.cpu())


def _noisy_batch(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random audio that clips, with NaN/+Inf/-Inf injected at random places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 0.7
    if n:
        hits = torch.randint(0, rows * n, (max(1, rows * n // 500),), generator=g)
        kinds = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, hits.shape, generator=g)]
        x.view(-1)[hits] = kinds
    x[0, : min(n, 4)] = torch.tensor([1.0, -1.0, 0.5 / 32767, -0.0])[: min(n, 4)]
    return x.to(dtype)


def _kernel(x: torch.Tensor) -> GuardResult:
    from kernels import loader

    nonfinite, peak, pcm = loader.guard_cuda(x)
    return GuardResult(nonfinite=nonfinite, peak=peak, pcm=pcm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (3, 5), (64, 8192), (7, 8191), (5, 100_003)])
def test_kernel_bit_exact(dtype: torch.dtype, rows: int, n: int) -> None:
    x = _noisy_batch(rows, n, dtype, seed=rows * 7919 + n).cuda()
    got = _kernel(x)
    want = guard_reference(x)
    _assert_same(got, want)
    _assert_same(got, guard_reference(x.cpu()))  # the CPU path agrees too


@pytest.mark.gpu
def test_kernel_fp16_misaligned_view() -> None:
    # A view starting one half into the storage: the row start is not 4-byte aligned.
    flat = _noisy_batch(1, 4 * 1001 + 1, torch.float16, seed=5).cuda().view(-1)
    x = flat[1:].view(4, 1001)
    assert x.data_ptr() % 4 == 2
    _assert_same(_kernel(x), guard_reference(x))


@pytest.mark.gpu
def test_kernel_all_nonfinite_and_edge_values() -> None:
    x = torch.tensor(
        [[NAN, INF, -INF, NAN], [65504.0, -65504.0, 6e-8, -6e-8], [0.99998, -0.99998, 1.0, 0.0]]
    )
    for dtype in (torch.float16, torch.float32):
        _assert_same(_kernel(x.to(dtype).cuda()), guard_reference(x.to(dtype)))


@pytest.mark.gpu
def test_kernel_on_side_stream_and_guard_dispatch() -> None:
    x = _noisy_batch(16, 4099, torch.float16, seed=11).cuda()
    want = guard_reference(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = guard(x)
        got2 = guard(x.float())
    torch.cuda.current_stream().wait_stream(side)
    _assert_same(got, want)
    _assert_same(got2, want)
    from kernels import guard as guard_module

    assert not guard_module._kernel_broken  # the kernel, not the fallback, ran
