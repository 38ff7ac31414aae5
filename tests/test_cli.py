"""The `cadenza` commands a new user runs first."""

from __future__ import annotations

import wave
from pathlib import Path

import pytest

from service.cli import main


def test_say_writes_a_wav(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hello.wav"
    assert main(["say", "Hello from Cadenza.", "-o", str(out), "--seed", "1", "--stream", "--words"]) == 0
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 22050 and wav.getsampwidth() == 2
        assert wav.getnframes() > 22050 // 2
    printed = capsys.readouterr().out
    assert "time to first audio" in printed and "Cadenza" in printed


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
