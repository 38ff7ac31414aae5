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
