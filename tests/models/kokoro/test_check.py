"""`cadenza voices check` on a Kokoro voice: ours against the official KModel holding the same
(dequantised) weights, same phonemes, style row and source noise, on the real weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import main


def test_voices_check_kokoro_af_heart(kokoro_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["voices", "check", "--voices", str(kokoro_home), "--voice", "kokoro-af_heart", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "official KModel" in lines[0] and len(lines) == 5
    assert lines[-1].startswith("min_psnr_db=")
    # Rounding, amplified over a sentence by the sine source's running phase, moves this with the
    # CPU (bench/RESULTS.md, Open questions); a porting fault gives far less.
    assert float(lines[-1].split("=")[1]) >= 55.0, "\n".join(lines)
