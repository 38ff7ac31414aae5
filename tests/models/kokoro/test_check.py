"""`cadenza voices check` on a Kokoro voice: ours against the official KModel holding the same
(dequantised) weights, same phonemes, style row and source noise, on the real weights."""

from __future__ import annotations

import pytest

from service.cli import main
from service.models.kokoro import weights as kw


def test_voices_check_kokoro_af_heart(capsys: pytest.CaptureFixture[str]) -> None:
    home = kw.default_cache_dir()
    kw.fetch_model(home)
    kw.fetch_voices(home)
    assert main(["voices", "check", "--voices", str(home), "--voice", "kokoro-af_heart", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "official KModel" in lines[0] and len(lines) == 5
    assert lines[-1].startswith("min_psnr_db=")
    assert float(lines[-1].split("=")[1]) >= 60.0, "\n".join(lines)
