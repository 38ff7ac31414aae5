"""A long text read by a fast client on the default server completes: the stall rule restarts its
clock whenever the client reads, however much larger one chunk is than `--max-ahead`."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from tests.serve_process import start_serve, stop_process

CORPUS = Path(__file__).resolve().parents[2] / "service" / "data" / "corpus_cpu.txt"


def test_long_text_fast_reader_completes() -> None:
    base = CORPUS.read_text(encoding="utf-8")
    text = (base + "\n") * (20_000 // len(base) + 1)
    assert len(text) >= 20_000
    server, port = start_serve("--threads", "1", "--stall-timeout", "10")
    try:
        stub = pb_grpc.TextToSpeechStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        requests = iter([pb.StreamingSynthesizeRequest(config=pb.SessionConfig()),  # no seed: not cached
                         pb.StreamingSynthesizeRequest(text=text), pb.StreamingSynthesizeRequest(end_input=True)])
        audio_s, summary, start = 0.0, None, time.monotonic()
        for response in stub.StreamingSynthesize(requests, timeout=900):
            if response.WhichOneof("response") == "audio":
                audio_s += response.audio.duration_seconds
            elif response.WhichOneof("response") == "summary":
                summary = response.summary
        assert summary is not None and summary.characters == len(text)
        assert summary.cache_hits == 0
        assert abs(summary.audio_seconds - audio_s) < 1e-3 and audio_s > 600
        print(f"{len(text)} characters, {audio_s:.0f} s of audio in {time.monotonic() - start:.0f} s")
    finally:
        stop_process(server)
