"""README quickstart: `cadenza serve` + `cadenza client` with the built-in voice, then SIGTERM drain;
Ctrl-C (SIGINT to the whole process group) stops the server and its core process quietly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import grpc
import pytest

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from tests.serve_process import start_serve

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "service.cli"]


@pytest.mark.slow
def test_serve_client_quickstart_and_drain(tmp_path: Path) -> None:
    """README's `cadenza serve` (the default `--device auto`, resolved by the core's process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server, port = start_serve("--threads", "2")
    try:
        out = tmp_path / "hello.wav"
        done = subprocess.run(
            [*CLI, "client", "Hello from Cadenza. This is a streaming test.", "-o", str(out),
             "--addr", f"127.0.0.1:{port}", "--seed", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "time to first audio" in done.stdout and "chunk   0" in done.stdout
        # torch lives in the core's process only: the server's (one per API server) never loads it,
        # and it reports the device the core resolved "auto" to
        assert "libtorch" not in Path(f"/proc/{server.pid}/maps").read_text()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = pb_grpc.TextToSpeechStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        assert (info.device, info.backend) == ("cpu", "onnxruntime")
        with wave.open(str(out)) as w:
            assert w.getframerate() == 22050 and w.getnframes() > 22050
        streamed = subprocess.run(
            [*CLI, "client", "--stdin", "-o", str(tmp_path / "lines.wav"), "--addr", f"127.0.0.1:{port}",
             "--encoding", "mulaw", "--rate", "8000"],
            input="First line of text\nand a second one.\n", cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=120,
        )
        assert streamed.returncode == 0, streamed.stderr
        assert "8000 Hz mulaw" in streamed.stdout
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_ctrl_c_stops_the_server_and_its_core_process_quietly() -> None:
    """A terminal's Ctrl-C reaches every process of the group (the server, its core process, the
    frontend workers): the server drains and exits 0, no process is left, no traceback is shown."""
    server, port = start_serve("--device", "cpu", "--threads", "1", new_group=True)
    try:
        done = subprocess.run([*CLI, "client", "Hello.", "-o", os.devnull, "--addr", f"127.0.0.1:{port}"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert server.stdout is not None
        output = server.stdout.read()
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        deadline = time.monotonic() + 10
        while True:  # the group is gone once its last process (core, frontend workers) exited
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "processes of the server's group are still running"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


class _HeldServer(pb_grpc.TextToSpeechServicer):
    """Sends an utterance's chunk, waits until the test lets it go on, then the stream's tail
    (utterance -1) and the summary."""

    def __init__(self) -> None:
        import threading

        self.go_on = threading.Event()

    def StreamingSynthesize(self, request_iterator, context):  # type: ignore[no-untyped-def]
        next(request_iterator)  # the config
        chunk = dict(sample_rate_hz=8000, precision=pb.Precision.FP32)
        yield pb.StreamingSynthesizeResponse(audio=pb.AudioChunk(
            audio=b"\x01\x02" * 800, seq=0, num_samples=800, duration_seconds=0.1, utterance=0, **chunk))
        assert self.go_on.wait(180)
        yield pb.StreamingSynthesizeResponse(audio=pb.AudioChunk(
            audio=b"\x03\x04" * 40, seq=1, offset_samples=800, num_samples=40, duration_seconds=0.005, utterance=-1,
            **chunk))
        yield pb.StreamingSynthesizeResponse(summary=pb.SessionSummary(chunks=2, utterances=1))


def test_client_to_stdout_writes_each_chunk_as_it_arrives_and_names_the_tail() -> None:
    """`client -o -` into a pipe: the first chunk reaches the reader while the server still
    holds the rest back; the last chunk (utterance -1) is printed as the stream's end."""
    import select
    import struct
    from concurrent.futures import ThreadPoolExecutor

    from service.audio.wav import UNKNOWN_SIZE

    servicer = _HeldServer()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TextToSpeechServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = subprocess.Popen([*CLI, "client", "Hello.", "-o", "-", "--addr", f"127.0.0.1:{port}"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert client.stdout is not None
    try:
        first = b""
        while len(first) < 44 + 1600:  # the header and the first chunk
            ready, _, _ = select.select([client.stdout], [], [], 120)
            assert ready, "nothing on stdout while the server holds back the rest of the stream"
            piece = os.read(client.stdout.fileno(), 1 << 16)
            assert piece, client.stderr.read().decode() if client.stderr else ""
            first += piece
        servicer.go_on.set()
        rest, err = client.communicate(timeout=120)
    finally:
        servicer.go_on.set()
        if client.poll() is None:
            client.kill()
            client.wait()
        server.stop(None)
    assert client.returncode == 0, err.decode()
    assert first[:4] == b"RIFF" and first[4:8] == first[40:44] == struct.pack("<I", UNKNOWN_SIZE)
    assert first[44:] == b"\x01\x02" * 800 and rest == b"\x03\x04" * 40
    lines = err.decode().splitlines()
    assert "utterance 0, FP32" in lines[0], lines
    assert "end of stream" in lines[1] and "utterance -1" not in lines[1], lines
