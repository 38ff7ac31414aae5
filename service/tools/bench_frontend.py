"""Frontend throughput: many different call-center sentences submitted to a FrontendPool at
once, as when hundreds of sessions start together; workers=0 is the in-process frontend.

    python -m service.tools.bench_frontend --workers 0 2

The timed span is from the first submit to the last result; starting the workers (and
loading the voice in each) is reported on its own line before it."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import wait

from service.engine.frontend_pool import FrontendPool, FrontendPoolConfig
from service.voices import BUILTIN_VOICE

_NAMES = ["Maria", "James", "Priya", "Daniel", "Aiko", "Robert", "Fatima", "Olivia"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday", "tomorrow"]
_TEMPLATES = [
    "Thank you for calling, {name}. Your order {n} shipped on {day} and should arrive within {k} business days.",
    "I can see a payment of ${n}.{k:02d} on your account, received {day} at {k}:30 p.m.",
    "Your appointment {n} with Dr. {name} is confirmed for {day} at {k} o'clock; please arrive ten minutes early.",
    "For security, can you confirm the last {k} digits of the card ending in {n}?",
    "I'm sorry, {name}, the flight to Boston on {day} is delayed by {k} hours. Would you like to rebook?",
    "Your balance is ${n} and the minimum payment of ${k}0 is due {day}.",
    "One moment while I transfer case {n} to billing, {name}; the wait time is about {k} minutes.",
    "We've opened ticket number {n} for the outage reported {day}, and a technician will call within {k} hours.",
]


def call_center_sentences(count: int) -> list[str]:
    """`count` different sentences, templates taken in turn with other names, days and
    numbers; deterministic."""
    texts = []
    for i in range(count):
        template = _TEMPLATES[i % len(_TEMPLATES)]
        rest = i // len(_TEMPLATES)
        name, day = _NAMES[rest % len(_NAMES)], _DAYS[(rest // len(_NAMES)) % len(_DAYS)]
        texts.append(template.format(name=name, day=day, k=2 + rest % 8, n=1000 + 37 * i))
    return texts


def run_frontend_bench(workers: int, sentences: int = 256, voice: str = BUILTIN_VOICE) -> int:
    """Phonemise `sentences` different texts submitted at once with `workers` processes
    (0: in process, one thread). Last line: sentences=<n> workers=<w> seconds=<s> per_s=<x>."""
    texts = call_center_sentences(sentences)
    start = time.perf_counter()
    pool = FrontendPool(FrontendPoolConfig(workers=workers, preload=(voice,)))
    try:
        pool.wait_ready()
        ready_s = time.perf_counter() - start
        print(f"workers={workers}: started and warm in {ready_s:.2f}s")
        start = time.perf_counter()
        futures = [pool.submit(voice, text) for text in texts]
        wait(futures)
        seconds = time.perf_counter() - start
        out = sum(len(f.result()) for f in futures)  # raises a frontend error, if any
    finally:
        pool.close()
    print(f"phonemised {len(texts)} texts into {out} sentences")
    print(f"sentences={len(texts)} workers={workers} seconds={seconds:.3f} per_s={len(texts) / seconds:.1f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--voice", default=BUILTIN_VOICE)
    args = parser.parse_args(argv)
    for workers in args.workers:
        run_frontend_bench(workers, args.sentences, args.voice)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
