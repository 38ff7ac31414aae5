"""CPU time the server's own process spends per audio message, side by side for two trees.

The server's process (gRPC, the event loop, the sessions' loop halves, the relay thread that
takes the core's output off its pipe) is what a burst of new streams queues behind once the core
runs in a process of its own. Its CPU time per message delivered is the same work on any machine
whatever the core's speed, so it can be compared here, on a small CPU, for the GPU host.

    .venv/bin/python scripts/bench_server_cpu.py [--old DIR] [--rounds N] [--sessions N]

Starts `cadenza serve` from this tree ("new") and, with --old, from DIR (a `git archive` of an
older commit's service/ and kernels/) on free ports, then runs `cadenza bench load --arrival burst`
against each in turn, `--rounds` times, and prints per burst: the server process's CPU ms
(user + system, its threads included, the core's process and the frontend's not), the audio
messages its sessions received, and the CPU microseconds per message."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15)


class Server:
    def __init__(self, name: str, tree: Path, log_dir: Path) -> None:
        self.name, self.port = name, _free_port()
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.log = (log_dir / f"serve-{name}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", str(self.port)],
            cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def burst(self, sessions: int, out: Path) -> tuple[float, int, float]:
        """One burst: (server CPU seconds, audio messages received, client TTFA p99 ms)."""
        before = _cpu_s(self.proc.pid)
        subprocess.run(
            [sys.executable, "-m", "service.cli", "bench", "load", "--target", f"127.0.0.1:{self.port}",
             "--sessions", str(sessions), "--arrival", "burst", "--connect-timeout", "180", "--json", str(out)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        cpu = _cpu_s(self.proc.pid) - before
        report = json.loads(out.read_text())
        messages = sum(s["chunks"] for s in report["sessions"])
        return cpu, messages, float(report["summary"]["ttfa_p99_ms"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, default=None, help="an older tree to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cadenza-server-cpu-"))
    servers = [Server("new", ROOT, work)] + ([Server("old", args.old.resolve(), work)] if args.old else [])
    per_message: dict[str, list[float]] = {s.name: [] for s in servers}
    try:
        for s in servers:  # warm: each waits for its server to say SERVING, then one burst not counted
            s.burst(1, work / "warm.json")
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                cpu, messages, p99 = s.burst(args.sessions, work / f"{s.name}-{r}.json")
                per_message[s.name].append(cpu / messages * 1e6)
                print(f"{s.name} round {r + 1}: server CPU {cpu * 1000:.0f} ms for {messages} audio messages "
                      f"({cpu / messages * 1e6:.0f} us each), TTFA p99 {p99:.0f} ms", flush=True)
                time.sleep(0.5)
    finally:
        for s in servers:
            s.stop()
    for name, values in per_message.items():
        print(f"{name}: median {statistics.median(values):.0f} us of server CPU per audio message "
              f"({', '.join(f'{v:.0f}' for v in values)})")
    print(f"logs and reports in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
