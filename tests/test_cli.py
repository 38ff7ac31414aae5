"""The `cadenza` commands a new user runs first."""

from __future__ import annotations

import re
import struct
import wave
from pathlib import Path

import pytest

from service.audio.wav import UNKNOWN_SIZE
from service.cli import main

_ROOT = Path(__file__).resolve().parents[1]
_TINY_VOICE = _ROOT / "tests" / "data" / "tiny-multi.onnx"


def test_say_writes_a_wav(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hello.wav"
    assert main(["say", "Hello from Cadenza.", "-o", str(out), "--seed", "1", "--stream", "--words"]) == 0
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 22050 and wav.getsampwidth() == 2
        assert wav.getnframes() > 22050 // 2
    printed = capsys.readouterr().out
    assert "time to first audio" in printed and "Cadenza" in printed


def test_say_int8_runs_the_quantized_decoder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hello.wav"
    assert main(["say", "Hello from Cadenza.", "-o", str(out), "--seed", "1", "--int8",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    with wave.open(str(out)) as wav:
        assert wav.getnframes() > 22050 // 2
    assert "(onnxruntime on cpu, int8," in capsys.readouterr().out


def test_say_options_set_the_voice_family_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--option NAME=VALUE` reaches the voice: with both VITS noise scales at 0 the same seed
    gives the same WAV, and so does another seed (no noise left to draw); at the voice's
    defaults the seed changes the audio. A name the voice does not take is one line, exit 2."""
    def say(name: str, seed: int, *options: str) -> bytes:
        out = tmp_path / f"{name}.wav"
        args = ["say", "Options reach the voice.", "-o", str(out), "--voice", str(_TINY_VOICE), "--threads", "1",
                "--seed", str(seed)]
        assert main([*args, *(a for o in options for a in ("--option", o))]) == 0
        return out.read_bytes()

    quiet = ("noise_scale=0", "noise_w=0")
    first, again, other_seed = say("a", 1, *quiet), say("b", 1, *quiet), say("c", 2, *quiet)
    assert first == again == other_seed and len(first) > 44 + 1000
    assert say("d", 1) != say("e", 2)
    capsys.readouterr()
    assert main(["say", "hi", "--voice", str(_TINY_VOICE), "--option", "temperature=1", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "config.options" in err and "temperature" in err and "noise_scale, noise_w" in err


def test_voices_list_prints_family_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["voices", "list", "--voices", str(_TINY_VOICE.parent)]) == 0
    lines = {ln.split("\t")[0]: ln.split("\t") for ln in capsys.readouterr().out.strip().splitlines()}
    tiny = lines["tiny-multi"]
    assert tiny[1] == "vits" and tiny[5] == "options: noise_scale=0.667 noise_w=0.8"
    assert tiny[-1] == str(_TINY_VOICE)


def test_voices_check_builtin_psnr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["voices", "check"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("min_psnr_db=")
    assert float(last.split("=")[1]) >= 60.0


def test_unknown_voice_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["say", "hi", "--voice", "nope", "-o", "/dev/null"]) == 2
    assert "unknown voice 'nope'" in capsys.readouterr().err


def test_compare_fp16_reports_psnr_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = tmp_path / "cmp"
    assert main(["compare", "--precision", "fp16", "--limit", "1", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("min_psnr_db=") and float(last.split("=")[1]) >= 45.0
    report = json.loads((out / "compare.json").read_text())
    assert report["precision"] == "fp16" and len(report["sentences"]) == 1
    assert (out / "compare.png").stat().st_size > 10_000


# --- Command-line conventions (issue 13), run as a user runs them: in a subprocess ---------------------------


def _cadenza(*args: str, stdin: bytes | None = None, cwd: Path | None = None, timeout: float = 180,
             prelude: str = "") -> tuple[int, bytes, str, float]:
    """Run `cadenza ARGS` (optionally after `prelude` code): exit code, stdout bytes, stderr, seconds."""
    import os
    import subprocess
    import sys
    import time

    code = f"import sys\n{prelude}\nfrom service.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, env=env,
                          cwd=cwd or _ROOT, timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr.decode(errors="replace"), time.monotonic() - start


def _no_traceback(err: str) -> None:
    for noise in ("Traceback", "Event loop is closed", "was never awaited", "UserWarning"):
        assert noise not in err, err


def test_version_matches_the_package() -> None:
    from importlib import metadata

    code, out, err, _ = _cadenza("--version")
    assert code == 0, err
    assert out.decode().strip() == f"cadenza {metadata.version('cadenza')}"


@pytest.mark.parametrize("command", [["say", "hi"], ["serve"], ["voices", "check"], ["bench", "streams"]])
def test_bad_device_is_a_usage_error(command: list[str]) -> None:
    code, out, err, _ = _cadenza(*command, "--device", "gpu")
    assert code == 2 and not out
    _no_traceback(err)
    assert f"usage: cadenza {' '.join(command[:2 if command[0] in ('voices', 'bench') else 1])}" in err
    assert err.strip().splitlines()[-1].endswith(
        "error: argument --device: invalid device 'gpu' (choose from auto, cpu, cuda, cuda:N)"), err


def test_bad_backend_is_a_usage_error() -> None:
    code, _, err, _ = _cadenza("serve", "--backend", "bogus")
    assert code == 2
    _no_traceback(err)
    assert "argument --backend: invalid choice: 'bogus'" in err


@pytest.mark.parametrize("command", [["say"], ["voices", "list"], ["bench", "load"]])
def test_an_unknown_option_shows_its_subcommands_usage(command: list[str]) -> None:
    code, out, err, _ = _cadenza(*command, "--bogus")
    assert code == 2 and not out
    _no_traceback(err)
    name = f"cadenza {' '.join(command)}"
    assert err.startswith(f"usage: {name} [-h]"), err
    assert err.strip().splitlines()[-1] == f"{name}: error: unrecognized arguments: --bogus", err


def test_every_option_has_help() -> None:
    import argparse

    from service.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    missing += walk(child, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(build_parser(), "cadenza") == []


def test_serve_help_shows_the_config_defaults() -> None:
    from service.engine.config import BatchConfig, Limits

    code, out, err, _ = _cadenza("serve", "--help")
    assert code == 0, err
    text = " ".join(out.decode().split())
    assert f"(default: {Limits().max_sessions})" in text and f"(default: {BatchConfig().step_frames})" in text
    assert "(default: 50051)" in text


_SERVE_GROUPS = ("network and security", "voices and devices", "engine", "limits", "telemetry",
                 "advanced engine tuning")


def test_serve_help_groups_every_option_once() -> None:
    """serve has about forty options: its --help shows them under headings, each option under exactly one
    (argparse's own "options" keeps only -h), so none is lost or listed twice when the groups change."""
    import argparse
    import re

    from service.cli import build_parser

    code, out, err, _ = _cadenza("serve", "--help")
    assert code == 0, err
    sections = re.split(r"^(\S[^\n]*):\n", out.decode(), flags=re.M)  # [usage, title, body, title, body, ...]
    bodies = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert [t for t in bodies if t != "options"] == list(_SERVE_GROUPS), list(bodies)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    options = [a.option_strings[0] for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 35
    for option in options:
        found = [t for t, body in bodies.items() if re.search(rf"^  {re.escape(option)}(?=[ ,\n])", body, re.M)]
        assert found != ["options"] and len(found) == 1, f"{option} is under {found}"


@pytest.mark.parametrize("text_arg", [[], ["-"]], ids=["no-text", "dash"])
def test_say_reads_stdin_and_writes_a_wav_to_stdout(text_arg: list[str]) -> None:
    import io

    code, out, err, _ = _cadenza("say", *text_arg, "-o", "-", "--voice", str(_TINY_VOICE), "--seed", "1",
                                 "--threads", "1", stdin=b"Hello from standard input.\n")
    assert code == 0, err
    _no_traceback(err)
    assert "wrote a WAV to stdout" in err  # the messages go to stderr: stdout is the WAV alone
    with wave.open(io.BytesIO(out)) as wav:
        assert wav.getframerate() == 16000 and wav.getsampwidth() == 2 and wav.getnchannels() == 1
    # A pipe: written as it was made, so the sizes are the streaming placeholder ("read to the end").
    assert out[4:8] == out[40:44] == struct.pack("<I", UNKNOWN_SIZE)
    assert len(out) > 44 + 2 * 1000 and len(out) % 2 == 0


def test_say_without_any_text_is_a_usage_error() -> None:
    code, _, err, _ = _cadenza("say", "-o", "-", stdin=b"  \n")
    assert code == 2
    _no_traceback(err)
    assert err.strip() == "cadenza: error: no text to speak: give it as an argument, or on stdin"


# A prelude for `_cadenza`: the engine stops after its first audio chunk until a line comes on stdin.
_HOLD_AFTER_FIRST_CHUNK = """
from service.engine import local as _local
from service.engine.contract import AudioOut as _AudioOut
_stream = _local.LocalEngine.stream
def _held(self, text, config):
    held = False
    for event in _stream(self, text, config):
        yield event
        if not held and isinstance(event, _AudioOut):
            held = True
            sys.stdin.readline()
_local.LocalEngine.stream = _held
"""


def test_say_to_stdout_writes_each_chunk_as_it_is_made() -> None:
    """`say -o -` into a pipe: the WAV header and the first chunk's samples reach the reader while
    the engine is still held after that chunk (so before the rest is made), not at the end."""
    import os
    import select
    import subprocess
    import sys

    code = f"import sys\n{_HOLD_AFTER_FIRST_CHUNK}\nfrom service.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    text = "The first sentence comes out at once. The second one follows it, and a third one ends the text."
    proc = subprocess.Popen([sys.executable, "-c", code, "say", text, "-o", "-", "--voice", str(_TINY_VOICE),
                             "--seed", "1", "--threads", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(_ROOT)}, cwd=_ROOT)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        first = b""
        while len(first) <= 44:  # the header, then samples
            ready, _, _ = select.select([proc.stdout], [], [], 180)
            assert ready, "no audio on stdout while the engine waits after its first chunk"
            piece = os.read(proc.stdout.fileno(), 1 << 16)
            assert piece, proc.stderr.read().decode() if proc.stderr else ""
            first += piece
        assert proc.poll() is None  # still held: these bytes came before the rest was made
        rest, err = proc.communicate(b"go on\n", timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    _no_traceback(err.decode())
    out = first + rest
    assert out[:4] == b"RIFF" and out[4:8] == out[40:44] == struct.pack("<I", UNKNOWN_SIZE)
    assert len(rest) > len(first) - 44 and len(out) % 2 == 0


@pytest.mark.parametrize("text", ["...", "?!", " -- ", "___"])
def test_say_text_without_words_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["say", text, "-o", "/dev/null"]) == 2
    assert capsys.readouterr().err.strip() == "cadenza: error: nothing to say: the text has no words"


@pytest.mark.parametrize("value", ["0", "-1", "100", "nan"])
def test_say_length_scale_outside_the_voices_range_is_a_usage_error(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The range is the engine's speaking-rate bounds around the voice's own length scale."""
    from service.engine.contract import MAX_SPEAKING_RATE, MIN_SPEAKING_RATE
    from service.voices import builtin_voice_info

    own = builtin_voice_info().length_scale
    assert main(["say", "Hi there.", "--length-scale", value, "-o", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"cadenza: error: --length-scale {float(value):g} is outside "
                          f"{own / MAX_SPEAKING_RATE:g}..{own / MIN_SPEAKING_RATE:g} for voice "), err
    assert not (tmp_path / "x.wav").exists()


@pytest.mark.parametrize("command", [["say", "hi", "-o", "/dev/null"], ["voices", "list"]])
def test_a_missing_voices_directory_is_a_usage_error(command: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nonexistent"
    assert main([*command, "--voices", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"cadenza: error: voices directory {missing} does not exist (--voices)"


def test_serve_refuses_a_missing_voices_directory_at_once(tmp_path: Path) -> None:
    code, out, err, _ = _cadenza("serve", "--host", "127.0.0.1", "--port", "0", "--voices", str(tmp_path / "none"),
                                 timeout=60)
    assert code == 2 and not out
    _no_traceback(err)
    assert err.strip() == f"cadenza: error: voices directory {tmp_path / 'none'} does not exist (--voices)"


@pytest.mark.parametrize("host", ["127.0.0.1", None], ids=["loopback", "default-host"])
def test_serve_refuses_a_busy_port_at_once(host: str | None) -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1" if host else "0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err, seconds = _cadenza("serve", *(["--host", host] if host else []), "--port", str(port))
    assert code != 0 and not out
    _no_traceback(err)
    assert f"port {port}" in err, err
    assert len(err.strip().splitlines()) == 1, err  # refused before loading anything: no log lines either
    assert seconds < 10  # Python start-up included; the check itself comes before torch is imported


@pytest.mark.parametrize("args", [["--voice", "nosuch"], ["--device", "cuda"], ["--backend", "tensorrt"]],
                         ids=["unknown-voice", "cuda-without-gpu", "tensorrt-here"])
def test_serve_start_up_errors_are_one_line(args: list[str]) -> None:
    if args[0] != "--voice":
        import importlib.util

        import torch

        if torch.cuda.is_available() and (args[1] == "cuda" or importlib.util.find_spec("tensorrt")):
            pytest.skip("this machine can run it")
    code, out, err, _ = _cadenza("serve", "--host", "127.0.0.1", "--port", "0", *args)
    assert code != 0 and not out
    _no_traceback(err)
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("cadenza: error: "), err
    if args[0] == "--voice":
        assert "'nosuch'" in errors[0]


@pytest.mark.parametrize("args", [["--device", "cuda"], ["--backend", "tensorrt"]],
                         ids=["cuda-without-gpu", "tensorrt-here"])
def test_say_start_up_errors_are_one_line(args: list[str]) -> None:
    """A backend or device that cannot start here is one line saying what to use instead; the
    engine's clean-up after the failed start (its core never started) adds nothing."""
    import importlib.util

    import torch

    if torch.cuda.is_available() and (args[1] == "cuda" or importlib.util.find_spec("tensorrt")):
        pytest.skip("this machine can run it")
    code, out, err, _ = _cadenza("say", "Hi", "-o", "-", *args)
    assert code == 1 and not out
    _no_traceback(err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("cadenza: error: "), err
    assert "--device cpu" in err or "--backend onnxruntime" in err, err


@pytest.mark.slow
def test_precision_sensitivity_completes_on_cpu() -> None:
    """On the served path: the family's pins, each taken out, each other candidate added, no pins."""
    from service.models.vits.precision import VITS_FP32_PINS, VITS_PIN_CANDIDATES

    code, out, err, _ = _cadenza("precision", "sensitivity", "--device", "cpu", "--voice", str(_TINY_VOICE),
                                 "--limit", "1", "--threads", "1", timeout=600)
    assert code == 0, err
    _no_traceback(err)
    lines = out.decode().strip().splitlines()
    assert "served path" in lines[0]
    assert lines[1].split() == ["FP16", "run", "min_db", "median_db", "redos", "len_changes"]
    rows = [(" ".join(line.split()[:-4]), line.split()[-4:]) for line in lines[2:]]
    expected = ["with the family's pins", *(f"without {p}" for p in VITS_FP32_PINS),
                *(f"with {c} added" for c in VITS_PIN_CANDIDATES if c not in VITS_FP32_PINS), "no pins"]
    assert [label for label, _ in rows] == expected
    for _, (min_db, median_db, redos, changes) in rows:
        assert float(min_db) > 0 and float(median_db) >= float(min_db) and int(redos) >= 0 and int(changes) >= 0


@pytest.mark.slow
def test_compare_without_matplotlib_writes_json_under_a_temp_dir(tmp_path: Path) -> None:
    import json
    import re
    import shutil

    code, out, err, _ = _cadenza("compare", "--voice", str(_TINY_VOICE), "--limit", "1", cwd=tmp_path,
                                 prelude="sys.modules['matplotlib'] = None  # as on a plain install",
                                 timeout=600)
    assert code == 0, err
    _no_traceback(err)
    lines = out.decode().strip().splitlines()
    assert lines[-1].startswith("min_psnr_db=") and float(lines[-1].split("=")[1]) > 0
    assert "needs matplotlib (pip install matplotlib)" in lines[-2]
    match = re.search(r"wrote (\S+compare\.json)", lines[-2])
    assert match, lines[-2]
    report = Path(match.group(1))
    try:
        assert report.parent != tmp_path and report.parent.name.startswith("cadenza-compare-")
        assert json.loads(report.read_text())["precision"] == "fp16"
        assert not (report.parent / "compare.png").exists()
        assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
    finally:
        shutil.rmtree(report.parent, ignore_errors=True)


def test_client_metadata_option() -> None:
    import argparse

    from service.cli import build_parser, metadata_arg

    args = build_parser().parse_args(["client", "hi", "--metadata", "Authorization=Bearer x=y",
                                      "--metadata", "trace-bin=\u00e9"])
    assert args.metadata == [("authorization", "Bearer x=y"), ("trace-bin", "\u00e9".encode())]
    for bad in ("novalue", "=v", "bad key=v", "grpc-timeout=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            metadata_arg(bad)


@pytest.mark.slow
def test_fp32_pins_choose_what_fp16_keeps_in_fp32_and_a_pin_naming_nothing_is_refused(cosyvoice2_dir: Path) -> None:
    voices = ("--voices", str(cosyvoice2_dir.parent), "--voice", "cosyvoice2-test")
    code, out, err, _ = _cadenza("compare", *voices, "--fp32-pins", "hift.conv_post, flow.decoder.estimator.final_proj",
                                 "--limit", "1", timeout=600)
    assert code == 0, err
    lines = out.decode().splitlines()
    assert lines[0].endswith("FP32 pins: hift.conv_post, flow.decoder.estimator.final_proj")
    assert re.fullmatch(r"min_psnr_db=\d+\.\d+", lines[-1])
    code, out, err, _ = _cadenza("say", *voices, "--fp32-pins", "lm", "Hello there.", "-o", "-")
    assert code == 1 and not out
    _no_traceback(err)
    assert "FP32 pin 'lm' names no part that runs in FP16: pin flow (the whole solve)" in err
