"""CUDA graph capture (service/models/cuda_graphs.py): graphs of different capturers replayed at
the same time on different streams (a token stage's beside a decoder's) give what each gives
alone, bit for bit. Captured on one shared stream they would share cuBLAS's workspace."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from service.models.cuda_graphs import GraphCapturer, bucket, buckets_up_to, own_stream


def test_buckets_are_powers_of_two_from_the_smallest() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, smallest=64) == 64 and bucket(65, smallest=64) == 128
    assert buckets_up_to(5) == [1, 2, 4, 8] and buckets_up_to(100, 64) == [64, 128]


def _products(weights: torch.Tensor):  # type: ignore[no-untyped-def]
    def run(x: torch.Tensor) -> torch.Tensor:
        # few rows, a long inner dimension: the shape for which cuBLAS splits the sum and
        # keeps partial products in its workspace (a token step's projections)
        return torch.stack([x @ w for w in weights])
    return run


@pytest.mark.gpu
@torch.inference_mode()
def test_graphs_of_two_capturers_replayed_at_once_equal_each_alone() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    side = torch.cuda.Stream(device=dev, priority=-1)
    graphs, wanted, inputs = [], [], []
    for capturer in (GraphCapturer(dev), GraphCapturer(dev)):
        weights = torch.randn(16, 8192, 1024, device=dev) / 90
        x = torch.randn(4, 8192, device=dev)
        graph, out = capturer.capture(_products(weights), x)
        # a graph holds its inputs' addresses, not the tensors: they must outlive it (the next
        # capture empties the allocator's cache, and memory freed by then is unmapped)
        inputs.append((weights, x))
        graph.replay()
        torch.cuda.synchronize()
        graphs.append((graph, out))
        wanted.append(out.clone())
    main = torch.cuda.current_stream(dev)
    for _ in range(50):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            graphs[0][0].replay()
        graphs[1][0].replay()  # on the default stream, at the same time
        main.wait_stream(side)
        torch.cuda.synchronize()
        for (_, out), want in zip(graphs, wanted, strict=True):
            assert torch.equal(out, want)


class _Holder:
    pass


@pytest.mark.gpu
def test_streams_held_at_once_are_distinct_and_taken_back_from_garbage() -> None:
    """PyTorch's pool hands its 32 streams per priority out round-robin; held ones are skipped
    (12 here, few enough beside what other tests of the process may still hold)."""
    dev = torch.device("cuda")
    holders = [_Holder() for _ in range(8)]
    streams = [own_stream(h, dev) for h in holders]
    for _ in range(40):  # others take pool streams meanwhile, as torch.cuda.Stream() users do
        torch.cuda.Stream(device=dev)
    streams += [own_stream(h, dev) for h in holders[:4]]
    assert len({s.cuda_stream for s in streams}) == 12
    held = {s.cuda_stream for s in streams}
    del holders, streams
    gc.collect()
    again = [_Holder() for _ in range(32)]
    assert held & {own_stream(h, dev).cuda_stream for h in again}, "streams of dead holders are handed out again"


@pytest.mark.gpu
@torch.inference_mode()
def test_a_graph_keeps_its_results_while_other_capturers_come_and_go() -> None:
    """More capturers than the pool has streams, each captured and destroyed (as a token stage's
    are when its cache grows): none shares the first graph's stream, so destroying theirs never
    frees the cuBLAS workspace the first graph replays with (pytorch/pytorch#193402)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    keep = GraphCapturer(dev)
    weights, x = torch.randn(4, 8192, 1024, device=dev) / 90, torch.randn(4, 8192, device=dev)
    graph, out = keep.capture(_products(weights), x)
    graph.replay()
    torch.cuda.synchronize()
    want = out.clone()
    for _ in range(40):
        other = GraphCapturer(dev)
        w2, x2 = torch.randn(4, 8192, 1024, device=dev) / 90, torch.randn(4, 8192, device=dev)
        g2, _ = other.capture(_products(w2), x2)
        g2.replay()
        torch.cuda.synchronize()
        del other, g2
        gc.collect()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_a_capture_while_serving_is_said_with_its_shape(caplog: pytest.LogCaptureFixture) -> None:
    """Every session waits while a graph is captured for a shape the start-up did not prepare:
    the log names it, so an operator can see which bucket to prepare."""
    capturer = GraphCapturer(torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="service.models.cuda_graphs"):
        with capturer.while_serving("the flow's solve", (16, 512)):
            pass
    assert "capturing the flow's solve for shape (16, 512) while serving took" in caplog.text
