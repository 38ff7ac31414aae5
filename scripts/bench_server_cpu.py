"""CPU time the server's own process spends per audio message, side by side for two trees.

The server's process (gRPC, the event loop, the sessions' loop halves, the relay thread that
takes the core's output off its pipe) is what a burst of new streams queues behind once the core
runs in a process of its own. Its CPU time per message delivered is the same work on any machine
whatever the core's speed, so it can be compared here, on a small CPU, for the GPU host.

    .venv/bin/python scripts/bench_server_cpu.py [--old DIR] [--rounds N] [--sessions N] [--cached]
                                                 [--channels N] [--tokens] [--args "..."] [--old-args "..."]

Starts `cadenza serve` from this tree ("new") and, with --old, from DIR (a `git archive` of an
older commit's service/ and kernels/) on free ports, then runs a burst of `--sessions` streams
against each in turn, `--rounds` times, and prints per burst: the server process's CPU ms
(user + system, its threads included, the core's process and the frontend's not), the audio
messages its sessions received, the CPU per session and per message, and the client's TTFA.

The burst is `cadenza bench load --arrival burst` (live synthesis: on a small CPU the core is
the limit), or with --cached seeded sessions whose sentences the server's result cache already
holds: the core then answers at once and the server's process is the limit, as on a GPU host.
`--channels` deals the cached sessions over that many connections, `--tokens` sends their text as
word-sized deltas (an LLM's tokens: the server's cost per request message); `--args` and `--old-args` are
extra `cadenza serve` options for each side (with `--old-args` and no `--old`, both sides run this
tree: an A/B of options). With --cached the core's process CPU per session is printed too."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
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


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _core_pid(server_pid: int) -> int | None:
    """The synthesis core's process: the server's child with children of its own (the frontend's
    workers); the server's other child is multiprocessing's resource tracker."""
    return next((c for c in _children(server_pid) if _children(c)), None)


class Server:
    def __init__(self, name: str, tree: Path, log_dir: Path, extra: list[str]) -> None:
        self.name, self.port = name, _free_port()
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.log = (log_dir / f"serve-{name}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", str(self.port), *extra],
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

    def cached_burst(self, sessions: int, channels: int = 1, tokens: bool = False) -> tuple[float, int, float, float]:
        """Seeded sessions (their audio comes from the result cache) over `channels` connections:
        (server CPU seconds, audio messages, client TTFA p99 ms, the core's process CPU seconds)."""
        core = _core_pid(self.proc.pid)
        before, core_before = _cpu_s(self.proc.pid), _cpu_s(core) if core else 0.0
        ttfas, messages = asyncio.run(_cached_sessions(f"127.0.0.1:{self.port}", sessions, channels, tokens))
        cpu, core_cpu = _cpu_s(self.proc.pid) - before, _cpu_s(core) - core_before if core else math.nan
        p99 = statistics.quantiles(ttfas, n=100)[98] * 1000 if len(ttfas) > 1 else ttfas[0] * 1000
        return cpu, messages, p99, core_cpu

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


async def _cached_sessions(target: str, sessions: int, channels: int = 1, tokens: bool = False
                          ) -> tuple[list[float], int]:
    """`sessions` streams at once over `channels` connections, each two of bench load's sentences
    with seed 7 (`tokens`: sent as word-sized deltas, as an LLM's tokens come, without pauses);
    returns their TTFAs (seconds) and the audio messages received."""
    import grpc

    from service.api.gen.cadenza.v1 import tts_pb2 as pb
    from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
    from service.tools.bench_load import SENTENCES

    async def one(stub: pb_grpc.TextToSpeechStub, i: int) -> tuple[float, int]:
        text = " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(2))
        start = time.perf_counter()
        first, count = None, 0

        async def requests():  # type: ignore[no-untyped-def]
            yield pb.StreamingSynthesizeRequest(config=pb.SessionConfig(seed=7))
            for piece in re.findall(r"\s*\S+", text) if tokens else [text]:
                yield pb.StreamingSynthesizeRequest(text=piece)
            yield pb.StreamingSynthesizeRequest(end_input=True)

        async for response in stub.StreamingSynthesize(requests()):
            if response.WhichOneof("response") == "audio":
                first = first or time.perf_counter() - start
                count += 1
        assert first is not None
        return first, count

    # Separate connections: grpc shares one subchannel between channels with the same target and arguments.
    opened = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    try:
        stubs = [pb_grpc.TextToSpeechStub(c) for c in opened]
        results = await asyncio.gather(*(one(stubs[i % channels], i) for i in range(sessions)))
    finally:
        for c in opened:
            await c.close()
    return [t for t, _ in results], sum(n for _, n in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, default=None, help="an older tree to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--cached", action="store_true", help="seeded sessions served from the result cache")
    parser.add_argument("--channels", type=int, default=1, help="connections the cached sessions are dealt over")
    parser.add_argument("--tokens", action="store_true", help="cached sessions send their text as word deltas")
    parser.add_argument("--args", default="", help="extra `cadenza serve` options for this tree")
    parser.add_argument("--old-args", default=None, help="extra `cadenza serve` options for the old side")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cadenza-server-cpu-"))
    # Cached bursts are larger than this CPU's capacity estimate for live audio: no admission control.
    extra = ["--admission-wait", "0"] if args.cached else []
    servers = [Server("new", ROOT, work, extra + args.args.split())]
    core_ms: dict[str, list[float]] = {}
    if args.old is not None or args.old_args is not None:
        old = args.old.resolve() if args.old is not None else ROOT
        servers.append(Server("old", old, work, extra + (args.old_args or "").split()))
    per_session: dict[str, list[float]] = {s.name: [] for s in servers}
    try:
        for s in servers:  # warm: each waits for its server to say SERVING, then one burst not counted
            s.burst(1, work / "warm.json")
            if args.cached:  # every sentence of the cached bursts synthesised once
                asyncio.run(_cached_sessions(f"127.0.0.1:{s.port}", len_sentences()))
        for r in range(args.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                core = ""
                if args.cached:
                    cpu, messages, p99, core_cpu = s.cached_burst(args.sessions, args.channels, args.tokens)
                    core_ms.setdefault(s.name, []).append(core_cpu / args.sessions * 1e3)
                    core = f", core process {core_cpu / args.sessions * 1e3:.2f} ms per session"
                else:
                    cpu, messages, p99 = s.burst(args.sessions, work / f"{s.name}-{r}.json")
                per_session[s.name].append(cpu / args.sessions * 1e3)
                print(f"{s.name} round {r + 1}: server CPU {cpu * 1000:.0f} ms for {args.sessions} sessions, "
                      f"{messages} audio messages ({cpu / args.sessions * 1e3:.2f} ms per session, "
                      f"{cpu / messages * 1e6:.0f} us per message{core}), TTFA p99 {p99:.0f} ms", flush=True)
                time.sleep(0.5)
    finally:
        for s in servers:
            s.stop()
    for name, values in per_session.items():
        print(f"{name}: median {statistics.median(values):.2f} ms of server CPU per session "
              f"({', '.join(f'{v:.2f}' for v in values)})")
        if name in core_ms:
            print(f"{name}: median {statistics.median(core_ms[name]):.2f} ms of core-process CPU per session "
                  f"({', '.join(f'{v:.2f}' for v in core_ms[name])})")
    print(f"logs and reports in {work}")
    return 0


def len_sentences() -> int:
    from service.tools.bench_load import SENTENCES

    return len(SENTENCES)


if __name__ == "__main__":
    raise SystemExit(main())
