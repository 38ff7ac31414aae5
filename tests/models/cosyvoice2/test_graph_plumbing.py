"""The plumbing around CosyVoice2's encoder and vocoder CUDA graphs, on the CPU: what goes into a
graph's static tensors (rows padded to the bucket, a cache only where captured with one), what
comes out (each row's part, copied before the next replay writes it again), and which calls
replay at all. A CUDA graph cannot run here, so `Replaying` stands in for one with its semantics:
outputs are fixed tensors that each replay rewrites from whatever the static inputs hold then.
The graphs themselves are tested on a GPU (`test_runtime_gpu.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from service.models.cosyvoice2.flow import GraphedEncoder, load_flow
from service.models.cosyvoice2.hift import GraphedHiFT, load_hift
from service.models.cuda_graphs import GraphCapturer

from .test_flow import SMALL as SMALL_FLOW
from .test_flow import official_flow
from .test_hift import SMALL as SMALL_HIFT
from .test_hift import official_hift


class Replaying(GraphCapturer):
    """A `GraphCapturer` whose graphs run `fn` again at each replay, writing into the outputs
    of the first run."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def capture_or_none(self, what: str, fn: Callable[..., Any], *static: torch.Tensor,
                        warmups: int = 2) -> tuple[Any, Any]:
        out = fn(*static)

        class Graph:
            def replay(self) -> None:
                for kept, new in zip(out, fn(*static), strict=True):
                    kept.copy_(new)

        return Graph(), out


def generators(seed: int, rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(rows)]


@torch.inference_mode()
def test_vocoder_graph_calls_give_each_row_its_eager_audio_and_keep_it_past_the_next_replay() -> None:
    hift = load_hift(SMALL_HIFT, official_hift(SMALL_HIFT, seed=0).state_dict())
    graphed = GraphedHiFT(hift, Replaying())
    graphed.capture(4, 12, 960)
    graphed.capture(1, 16, 0)
    assert not graphed.graphed(3, 12, None)  # captured with a cache only
    assert not graphed.graphed(3, 12, torch.zeros(3, 1, 480))  # another cache length
    assert not graphed.graphed(3, 13, torch.zeros(3, 1, 960))  # frames are not padded
    for rows, frames, cache in ((3, 12, torch.randn(3, 1, 960)), (1, 16, None), (4, 12, torch.randn(4, 1, 960))):
        assert graphed.graphed(rows, frames, cache)
        mel = torch.randn(rows, 80, frames)
        got = graphed(mel, generators(rows, rows), cache)
        kept = [t.clone() for t in got]
        graphed(torch.randn(rows, 80, frames), generators(50, rows), cache)  # the next replay
        want = hift(mel, generators(rows, rows), cache)
        for a, k, b in zip(got, kept, want, strict=True):
            assert a.shape == b.shape
            assert torch.equal(a, k)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # a padded batch: kernel rounding


@torch.inference_mode()
def test_encoder_graph_calls_give_each_row_its_condition_alone_and_keep_it_past_the_next_replay() -> None:
    flow = load_flow(SMALL_FLOW, official_flow(SMALL_FLOW, seed=0).state_dict())
    graphed = GraphedEncoder(flow, Replaying())
    g = torch.Generator().manual_seed(6)
    for streaming, k in ((True, 3), (False, 0)):
        full = [torch.randint(0, SMALL_FLOW.vocab_size, (n,), generator=g) for n in (33, 12, 50)]
        sizes = [f.shape[0] - k for f in full]
        mu, frames = graphed(full, sizes, k, streaming)
        kept = mu.clone()
        graphed(full[::-1], sizes[::-1], k, streaming)  # the next replay, rows in another order
        assert torch.equal(mu, kept)
        assert frames.tolist() == [2 * n for n in sizes]
        assert mu.shape == (3, 80, 2 * max(sizes))
        for i, (f, n) in enumerate(zip(full, sizes, strict=True)):
            alone, _ = flow.encode([f], [n], k, streaming)
            assert float(alone.abs().max()) > 0.1
            assert float((mu[i : i + 1, :, : 2 * n] - alone).abs().max()) <= 1e-5 * float(alone.abs().max())
