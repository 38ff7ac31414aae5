"""FP16 with the family's FP32 pins against FP32 on the served path (engine sessions, slot decoder,
guard), over the fixed 20-sentence English corpus: the floor README states."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import main
from service.models.kokoro import weights as kw

CORPUS = Path(__file__).parents[2] / "data" / "english20.txt"
FLOOR_DB = 45.0


@pytest.mark.gpu
def test_fp16_with_pins_against_fp32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = kw.default_cache_dir()
    kw.fetch_model(home)
    if not (home / "voices" / "af_heart.bin").is_file():
        kw.fetch_voices(home)
    assert main(["compare", "--device", "cuda", "--voices", str(home), "--voice", "kokoro-af_heart",
                 "--corpus", str(CORPUS), "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    with capsys.disabled():  # the per-sentence figures, for the report (pytest -s)
        print("\n".join(lines))
    assert len([ln for ln in lines if "psnr_db=" in ln and not ln.startswith("min_")]) == 20, "\n".join(lines)
    assert float(lines[-1].split("=")[1]) >= FLOOR_DB, "\n".join(lines)
