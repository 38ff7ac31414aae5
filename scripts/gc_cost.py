"""What a full garbage collection costs in a process holding what the core holds, and after
`gc.freeze` (what the server does once warm, `service.engine.host.settle_heap`).

A collection holds the GIL, so every thread of the process waits for it. This loads the built-in
voice on the torch backend (CPU; the core on a GPU holds more: CUDA graphs, two precisions), then
times a collection of each generation, freezes, and times a full one again.

    .venv/bin/python scripts/gc_cost.py
"""

from __future__ import annotations

import gc
import time

from service.backends.registry import create_backend
from service.voices import Voice, list_voices


def _collect_ms(generation: int) -> float:
    t0 = time.perf_counter()
    gc.collect(generation)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    voice = Voice(list_voices(None)[0])
    backend = create_backend("torch", voice, "cpu")
    for precision in backend.supported_precisions():
        backend.model_for(precision)
    print(f"objects the collector tracks: {len(gc.get_objects())}")
    for generation in (0, 1, 2):
        print(f"  collection of generation {generation}: {_collect_ms(generation):.1f} ms")
    gc.freeze()
    print(f"after gc.freeze() ({gc.get_freeze_count()} objects frozen): full collection {_collect_ms(2):.2f} ms")


if __name__ == "__main__":
    main()
