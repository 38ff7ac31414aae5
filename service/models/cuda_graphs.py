"""Capturing a function of static tensors as a CUDA graph (shared by the decoder steps and
the acoustic and token stages): warm it up first, so lazy initialisation and the allocator's
first allocations stay out of the graph, then capture into a shared pool on the capturer's own
stream."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

# Streams handed out by `own_stream`: (device index, raw stream) -> its holder.
_HELD: dict[tuple[int, int], weakref.ref[object]] = {}
_HELD_LOCK = threading.Lock()
_POOL_STREAMS = 32  # PyTorch's pool per device and priority, handed out round-robin


def own_stream(holder: object, device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A stream from PyTorch's pool that no other live holder of `own_stream` has.

    `torch.cuda.Stream()` hands out the pool's streams round-robin, so the 33rd call gets the
    first one again. Two holders on one stream share cuBLAS's workspace for it: a graph
    captured there keeps the workspace's address, eager work there writes into the same memory,
    and destroying one graph frees the workspace that another graph on the stream still uses
    (pytorch/pytorch#193402: failed or wrong GEMMs later). A stream is taken back when its holder
    is garbage. Past the pool's size, a held one is shared (with a warning)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _HELD_LOCK:
        stream = torch.cuda.Stream(device=device, priority=priority)
        for _ in range(_POOL_STREAMS):
            key = (index, stream.cuda_stream)
            held = _HELD.get(key)
            if held is None or held() is None:
                _HELD[key] = weakref.ref(holder)
                return stream
            stream = torch.cuda.Stream(device=device, priority=priority)
    log.warning("more than %d CUDA streams of priority %d are held on device %d: two holders share one",
                _POOL_STREAMS, priority, index)
    return stream


class GraphCapturer:
    """Captures graphs on `device` into one memory pool (graphs that never run at the same
    time can share it), on a capture stream of its own.

    PyTorch keys cuBLAS's workspace by stream, and a captured graph keeps the address of the
    workspace of the stream it was captured on. Graphs captured on one stream (torch's default
    capture stream, say) that replay at the same time on different streams (the token stage's
    beside the decoder's) write over each other's partial products: slightly wrong results, no
    error. So each capturer captures on a stream that runs nothing else: its workspace is made
    inside the first capture, in the capturer's pool. Warm-ups run eagerly on the caller's
    stream (where the graphs will replay), never on the capture stream: an eager workspace
    there would be the one captured, memory the graphs do not own (graphs captured after
    warm-ups on their own capture stream faulted with illegal addresses)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None
        self._eager_seen: set[tuple[str, tuple[int, ...]]] = set()

    def note_eager(self, what: str, shape: tuple[int, ...]) -> None:
        """Say once per shape that calls of `what` run eagerly (no graph for that shape): where
        launches still cost the engine thread under load."""
        if (what, shape) not in self._eager_seen:
            self._eager_seen.add((what, shape))
            log.info("%s calls of shape %s have no CUDA graph: they run eagerly", what, shape)

    @contextmanager
    def while_serving(self, what: str, shape: tuple[int, ...]) -> Iterator[None]:
        """Around a capture made for a call's shape while serving: say so with its time, because
        the engine thread, and every session with it, waits for it (a bucket the start-up did not
        prepare)."""
        start = time.perf_counter()
        yield
        log.info("capturing %s for shape %s while serving took %.0f ms: the start-up did not prepare it", what,
                 shape, 1000 * (time.perf_counter() - start))

    def capture(
        self, fn: Callable[..., Any], *static: torch.Tensor, warmups: int = 2
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        """(graph, outputs): replaying the graph recomputes `outputs` from `static`'s contents."""
        for _ in range(warmups):
            fn(*static)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = own_stream(self, self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            out = fn(*static)
        return graph, out


    def capture_or_none(self, what: str, fn: Callable[..., Any], *static: torch.Tensor,
                        warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, Any] | None:
        """`capture`, or None where `fn` cannot be captured (a warning names `what`; the caller
        then runs it eagerly: slower, not wrong)."""
        try:
            return self.capture(fn, *static, warmups=warmups)
        except Exception as exc:
            log.warning("%s cannot be captured as a CUDA graph (%s: %s); it runs eagerly", what,
                        type(exc).__name__, exc)
            return None


K = TypeVar("K", bound=tuple[Any, ...])
G = TypeVar("G")


class GraphTable(Generic[K, G]):
    """One callable's graphs by bucket key: what a graph replays (`G`), or None where the call
    could not be captured and runs eagerly. The start-up fills it (`prepare`); a call whose key
    it did not prepare is captured then, timed and logged (`capture_while_serving`), or runs
    eagerly (said once per shape) where shapes are not bucketed and a graph per call would not
    pay."""

    def __init__(self, capturer: GraphCapturer, what: str, make: Callable[[K], G | None],
                 capture_while_serving: bool = True) -> None:
        self.capturer, self.what, self._make = capturer, what, make
        self.capture_while_serving = capture_while_serving
        self._graphs: dict[K, G | None] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[K]:
        return iter(self._graphs)

    def prepare(self, key: K) -> None:
        if key not in self._graphs:
            self._graphs[key] = self._make(key)

    def has_graph(self, key: K) -> bool:
        """Whether a call of `key` replays a graph now (without capturing one)."""
        return self._graphs.get(key) is not None

    def get(self, key: K, shape: tuple[int, ...]) -> G | None:
        """The graph for a call of `key` (`shape` names it in the log), or None: run it eagerly."""
        if key not in self._graphs and self.capture_while_serving:
            with self.capturer.while_serving(self.what, shape):
                self.prepare(key)
        found = self._graphs.get(key)
        if found is None:
            self.capturer.note_eager(self.what, shape)
        return found


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two at least `n` (and at least `smallest`): graphs are captured per bucket
    and inputs padded up to it."""
    return max(smallest, 1 << max(0, n - 1).bit_length())


def buckets_up_to(n: int, smallest: int = 1) -> list[int]:
    """Every bucket from `smallest` up to `n`'s (what a warm-up captures)."""
    out = [bucket(1, smallest)]
    while out[-1] < bucket(n, smallest):
        out.append(2 * out[-1])
    return out
