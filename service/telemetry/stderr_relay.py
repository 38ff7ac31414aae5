"""The stderr relay of `--log-format json` (started by `service.telemetry.logs.relay_stderr`):
reads the server's fd 2 from stdin and writes JSON lines to stdout (the real stderr). A line
that is a JSON object already (a log record) passes as it is; any other line (gRPC's C core,
torch's C++, a crash's traceback) becomes {"time", "level", "logger": "stderr", "message"}.

Standard library only, run by path: it starts quickly and imports nothing of the server. It
ignores SIGINT and SIGTERM (they are for the server, which still logs while it drains) and ends
when the server says at its exit, or else when every writer has closed the pipe, so a crashed
server's last lines still come out."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from datetime import UTC, datetime

# glog's prefix, as gRPC's core (absl) writes it: "I1203 08:41:27.961142 5625 file.cc:2563] ..."
_GLOG = re.compile(rb"([IWEF])\d{4} \d\d:\d\d:\d\d")
_LEVELS = {b"I": "INFO", b"W": "WARNING", b"E": "ERROR", b"F": "CRITICAL"}


def record(line: bytes) -> bytes:
    """`line` (without its newline) as one JSON line."""
    if line.startswith(b"{"):
        try:
            if isinstance(json.loads(line), dict):
                return line + b"\n"
        except ValueError:
            pass
    glog = _GLOG.match(line)
    out = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "level": _LEVELS[glog.group(1)] if glog else "WARNING",
        "logger": "stderr",
        "message": line.decode("utf-8", "replace"),
    }
    return json.dumps(out).encode("ascii") + b"\n"  # ASCII: every control character escaped


def main(end: bytes) -> None:
    """Relay until EOF, or until the line `end`: the server's exit, once its own lines are out
    (a process it started that lingers, such as multiprocessing's resource tracker, keeps the
    pipe open after it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = sys.stdout.buffer
    writing = True
    rest = b""
    while True:
        chunk = os.read(0, 1 << 16)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop() if chunk else b""  # an unfinished line waits for its end (at EOF: as it is)
        ended = end in lines
        if writing:
            try:
                out.write(b"".join(record(line.rstrip(b"\r")) for line in lines if line.strip() and line != end))
                out.flush()
            except OSError:  # nobody reads stderr any more: keep draining, so the server never blocks
                writing = False
        if not chunk or ended:
            return


if __name__ == "__main__":
    main(sys.argv[1].encode())
