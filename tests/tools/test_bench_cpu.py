"""`cadenza bench cpu` end to end on a two-line corpus: real voice, real piper-tts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.engine.config import EngineConfig
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import SynthesisParams, VoiceRuntime
from service.tools.bench_cpu import load_corpus, run_cpu_bench, time_cadenza
from tests.engine.conftest import prepare


def test_bench_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("# comment\nThank you for calling.\n\nOne moment, please.\n", "utf-8")
    assert load_corpus(corpus) == ["Thank you for calling.", "One moment, please."]
    assert run_cpu_bench(corpus, threads=1, repeats=2, backend="onnxruntime", settle_s=0.0, stat="min") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [ln for ln in lines if re.match(r"\s*\d+ ", ln)]
    assert len(rows) == 2 and all(len(r.split()) >= 9 for r in rows)
    overall = next(ln for ln in lines if ln.startswith("ttfa, all 2 texts: cadenza median"))
    assert "piper median" in overall and "highest ratio" in overall
    last = re.fullmatch(r"ttfa_ratio=(\S+) rtf_ratio=(\d+\.\d+) ttfa_ratio_all=(\d+\.\d+)", lines[-1])
    assert last is not None and float(last.group(2)) > 0
    assert last.group(1) == "nan"  # no text of 150+ characters in this corpus
    # TTFA over all texts is still there: the median of the rows' TTFA ratios.
    ratios = sorted(float(r.split()[3]) for r in rows)
    assert float(last.group(3)) == pytest.approx(sum(ratios) / 2, abs=1.5e-3)
    assert re.search(r"median ttfa ratio, all texts: " + last.group(3), "\n".join(lines))


def test_packaged_corpus_loads_from_anywhere_and_has_late_comma_long_texts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = load_corpus()
    monkeypatch.chdir(tmp_path)  # outside the repository
    assert load_corpus(None) == texts
    assert load_corpus(Path("bench/corpus_cpu.txt")) == texts  # the CLI's default
    assert len(texts) >= 15 and all(not t.startswith("#") for t in texts)
    late = [t for t in texts if 150 <= len(t) <= 250 and "," not in t[:120]]
    assert len(late) >= 3


def test_the_timed_stream_gives_the_whole_utterance_audio(builtin_ort: VoiceRuntime) -> None:
    """The bench times the engine the server runs: one sentence streamed through it gives as
    much audio as the family's reference decode of the same sentence (same seed) makes at once."""
    text = "The weather tomorrow will be mostly sunny with a high of seventy two degrees."
    with LocalEngine(EngineConfig(threads=1, cache_bytes=0, frontend=FrontendPoolConfig(workers=0))) as local:
        streamed = time_cadenza(local, text, 3)
    (utt,) = prepare(builtin_ort, text, SynthesisParams(seed=3))
    whole = len(builtin_ort.reference(utt)) / builtin_ort.sample_rate
    assert streamed.audio_seconds == pytest.approx(whole, abs=1e-9)
    assert streamed.ttfa <= streamed.total and whole > 3.0
