"""README quickstart: `cadenza serve` + `cadenza client` with the built-in voice, then SIGTERM drain."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import wave
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "service.cli"]


@pytest.mark.slow
def test_serve_client_quickstart_and_drain(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [*CLI, "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--threads", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert server.stdout is not None
        port = None
        for line in server.stdout:
            if m := re.search(r"serving on \S+:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "server did not start"
        out = tmp_path / "hello.wav"
        done = subprocess.run(
            [*CLI, "client", "Hello from Cadenza. This is a streaming test.", "-o", str(out),
             "--addr", f"127.0.0.1:{port}", "--seed", "1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "time to first audio" in done.stdout and "chunk   0" in done.stdout
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
