"""`cadenza serve` as a subprocess, for the tests that need the real command (signals, ports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]


def start_serve(*args: str, stderr: int | IO[str] = subprocess.STDOUT,
                new_group: bool = False) -> tuple[subprocess.Popen[str], int]:
    """`cadenza serve --host 127.0.0.1 --port 0 ARGS` from the repository root: the process and
    the port it printed once serving (killed, and the test failed with its output, if it never did).
    `new_group`: in a process group of its own, as a terminal's foreground job is."""
    server = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=stderr, text=True,
        start_new_session=new_group)
    assert server.stdout is not None
    lines = []
    for line in server.stdout:
        lines.append(line)
        if m := re.search(r"serving on \S+:(\d+)", line):
            return server, int(m.group(1))
    server.kill()
    server.wait()
    raise AssertionError("cadenza serve printed no port:\n" + "".join(lines))


def stop_process(process: subprocess.Popen[str], timeout: float = 30) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL if it is still there after `timeout`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def json_lines(text: str) -> list[dict[str, object]]:
    """Every line of a `--log-format json` log as a record (the test fails at a line that is not one)."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{text}") from None
        assert isinstance(records[-1], dict), line
    return records
