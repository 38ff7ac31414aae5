"""`cadenza serve --api-servers N`: API server processes on one port around one engine core
(a real `cadenza serve`, the tiny voice). The kernel spreads connections over the processes;
each serves every API with the same audio; the first one's metrics endpoint adds up all of
theirs; a process that dies costs only its own sessions; a drain ends them all cleanly."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api.client import stream
from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.api.server import ServerConfig
from service.engine.proc import ApiSlot
from service.telemetry import Telemetry
from tests.serve_process import start_serve
from tests.telemetry.conftest import DATA, TIMEOUT_S, HeldStream

TEXT = "Still here, and on time."
SERVERS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _channel(port: int) -> grpc.Channel:
    """A connection of its own (grpc shares one between channels with the same target and options)."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def _open_sessions(channel: grpc.Channel, until: int) -> int:
    """GetServerInfo's open sessions once they reach `until` (within a few of the core's figure
    periods), else the last answer."""
    stub = pb_grpc.TextToSpeechStub(channel)
    deadline = time.monotonic() + 2.0
    while (n := stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).open_sessions) != until \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


class Serve:
    """`cadenza serve --api-servers 3` with the tiny voice, its log in a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log_path = tmp / "serve.log"
        self.metrics_port = _free_port()
        self._log = self.log_path.open("w")
        try:
            self.process, self.port = start_serve(
                "--voices", str(DATA), "--voice", "tiny-multi", "--backend", "torch", "--device", "cpu",
                "--threads", "1", "--api-servers", str(SERVERS), "--metrics-port", str(self.metrics_port),
                "--drain-grace", "20", *args, stderr=self._log)
        except AssertionError:
            self._log.close()
            raise AssertionError(self.log_path.read_text()) from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def others(self) -> list[int]:
        """The pids of the API server processes after the first (from their log lines)."""
        return [int(pid) for pid in re.findall(r"API server process \d+ of \d+ \(pid (\d+)\) serving", self.log())]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._log.close()
        return code


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("api-servers")
    s = Serve(tmp, "--timeline", str(tmp / "timeline"))
    yield s
    s.stop()


def test_connections_spread_over_the_processes_and_each_serves_the_same_audio(serve: Serve) -> None:
    assert len(serve.others()) == SERVERS - 1, serve.log()
    channels = [_channel(serve.port) for _ in range(12)]
    try:
        results = [stream(pb_grpc.TextToSpeechStub(c), pb.SessionConfig(seed=1), [TEXT], timeout=TIMEOUT_S)
                   for c in channels]
        # Open sessions count every process's (the others' as of the core's last figures).
        held = [HeldStream(pb_grpc.TextToSpeechStub(c), TEXT) for c in channels[:6]]
        assert all(h.first_audio.wait(TIMEOUT_S) for h in held)
        while_open = _open_sessions(channels[6], until=6)
        for h in held:
            h.release()
        after = _open_sessions(channels[7], until=0)
    finally:
        for c in channels:
            c.close()
    assert all(r.summary is not None and r.audio and r.audio == results[0].audio for r in results)
    assert all(h.summary is not None and h.audio == results[0].audio for h in held)
    assert (while_open, after) == (6, 0)
    # Each process writes its sessions' stages when its busy period ends (`--timeline`): 12
    # connections on one of three processes has odds of 3 x 3^-12.
    timeline = Path(re.search(r"--timeline (\S+)", " ".join(serve.process.args)).group(1))  # type: ignore[union-attr,arg-type]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = {int(p.name.split("-")[1]) for p in timeline.glob("api-*.jsonl") if '"text_in"' in p.read_text()}
        if len(pids) > 1:
            break
        time.sleep(0.2)
    assert len(pids) > 1 and pids <= {serve.process.pid, *serve.others()}, pids


def test_the_first_process_metrics_add_up_every_process(serve: Serve) -> None:
    def admitted() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{serve.metrics_port}/metrics", timeout=10).read().decode()
        assert len(re.findall(r"^# TYPE target_info ", text, re.M)) == 1  # one target, one resource
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return sum(s.value for s in families["cadenza_sessions_admitted"].samples if s.name.endswith("_total"))

    before = admitted()
    channels = [_channel(serve.port) for _ in range(9)]
    try:
        for c in channels:
            stream(pb_grpc.TextToSpeechStub(c), pb.SessionConfig(seed=2), ["Counted."], timeout=TIMEOUT_S)
    finally:
        for c in channels:
            c.close()
    assert admitted() - before == 9


def test_a_process_that_dies_costs_only_its_own_sessions_and_a_drain_ends_the_rest(tmp_path: Path) -> None:
    serve = Serve(tmp_path)
    code = None
    try:
        ref = stream(pb_grpc.TextToSpeechStub(c := _channel(serve.port)), pb.SessionConfig(seed=1), [TEXT],
                     timeout=TIMEOUT_S).audio
        c.close()
        channels = [_channel(serve.port) for _ in range(9)]
        held = [HeldStream(pb_grpc.TextToSpeechStub(c), TEXT) for c in channels]
        assert all(h.first_audio.wait(TIMEOUT_S) for h in held)
        victim = serve.others()[0]
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        deadline = time.monotonic() + 20
        while f"(pid {victim}) exited with code -9" not in serve.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"(pid {victim}) exited with code -9; its sessions ended, the other processes keep serving" \
            in serve.log()
        # New sessions still work (the kernel no longer hands the dead process connections).
        fresh = [_channel(serve.port) for _ in range(6)]
        after = [stream(pb_grpc.TextToSpeechStub(c), pb.SessionConfig(seed=1), [TEXT], timeout=TIMEOUT_S)
                 for c in fresh]
        for c in fresh:
            c.close()
        assert all(r.summary is not None and r.audio == ref for r in after)
        # A drain lets the survivors finish: SIGTERM, then their input ends.
        serve.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        for h in held:
            h.release()
        for c in channels:
            c.close()
        survived = [h for h in held if h.error is None]
        cut = [h for h in held if h.error is not None]
        assert survived, "every held stream was on the killed process (odds 3^-9)"
        assert all(h.summary is not None and h.audio == ref for h in survived)
        assert all(h.error.code() == grpc.StatusCode.UNAVAILABLE for h in cut), [h.error for h in cut]
        code = serve.process.wait(60)
    finally:
        if code is None:
            serve.stop()
    assert code == 0, serve.log()
    assert "Traceback" not in serve.log(), serve.log()


def test_session_ids_of_the_processes_never_meet() -> None:
    slots = [ApiSlot(i, 4, None if i == 0 else object()) for i in range(4)]  # type: ignore[arg-type]
    ids = [{next(s) for _ in range(100)} for s in (slot.session_ids() for slot in slots)]
    assert all(min(x) >= 1 for x in ids) and len(set().union(*ids)) == 400


def test_api_servers_out_of_range_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="--api-servers"):
        ServerConfig(api_servers=0)


def test_a_process_that_exits_or_never_comes_is_named() -> None:
    import multiprocessing

    from service.api.processes import ApiServers

    servers = ApiServers(ServerConfig(api_servers=3), 0, [], Telemetry())
    ctx = multiprocessing.get_context("spawn")
    servers.procs = [ctx.Process(target=time.sleep, args=(30,)), ctx.Process(target=sys.exit, args=(3,))]
    for p in servers.procs:
        p.start()
    try:
        servers.procs[1].join(30)
        assert servers._not_starting({1, 2}, time.monotonic() + 60) == (2, None, "exited with code 3")
        assert servers._not_starting({1}, time.monotonic() + 60) == (0, None, None)
        assert servers._not_starting({1}, time.monotonic() - 1)[::2] == (1, f"did not start within "
                                                                           f"{ApiServers.START_TIMEOUT_S:.0f} s")
    finally:
        servers.procs[0].kill()
        servers.procs[0].join(5)
