"""`cadenza bench cpu` end to end on short corpora: real voices, real piper-tts and kokoro-onnx."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from service.engine.config import EngineConfig
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.family import SynthesisParams, VoiceRuntime
from service.models.kokoro import weights as kw
from service.models.vits.voice import builtin_voice_info
from service.tools.bench_cpu import Playback, load_corpus, open_peer, run_cpu_bench, time_cadenza
from tests.engine.conftest import prepare


def test_bench_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("# comment\nThank you for calling.\n\nOne moment, please.\n", "utf-8")
    assert load_corpus(corpus) == ["Thank you for calling.", "One moment, please."]
    assert run_cpu_bench(corpus, threads=1, repeats=2, backend="onnxruntime", settle_s=0.0, stat="min") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [ln for ln in lines if re.match(r"\s*\d+ ", ln)]
    assert len(rows) == 2 and all(len(r.split()) >= 11 for r in rows)
    # gap columns: a player's waits for late chunks, never negative
    assert all(float(f.removesuffix("ms")) >= 0 for r in rows for f in r.split()[7:9])
    gaps = next(ln for ln in lines if ln.startswith("worst gap"))
    assert re.search(r"cadenza \d+\.\d ms, piper \d+\.\d ms$", gaps)
    overall = next(ln for ln in lines if ln.startswith("ttfa, all 2 texts: cadenza median"))
    assert "piper median" in overall and "highest ratio" in overall
    last = re.fullmatch(r"ttfa_ratio=(\S+) rtf_ratio=(\d+\.\d+) ttfa_ratio_all=(\d+\.\d+) total_ratio=\d+\.\d+",
                        lines[-1])
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
    text = "The weather tomorrow will be mostly sunny and warm all day long."  # one utterance
    with LocalEngine(EngineConfig(threads=1, cache_bytes=0, frontend=FrontendPoolConfig(workers=0))) as local:
        streamed = time_cadenza(local, text, 3)
    (utt,) = prepare(builtin_ort, text, SynthesisParams(seed=3))
    whole = len(builtin_ort.reference(utt)) / builtin_ort.sample_rate
    assert streamed.audio_seconds == pytest.approx(whole, abs=1e-9)
    assert streamed.ttfa <= streamed.total and whole > 3.0
    assert 0.0 <= streamed.gap < streamed.total


def test_playback_gap_is_the_silence_of_a_player_that_waits() -> None:
    """Chunks of 0.2 s: the second arrives 0.35 s after the first (0.15 s late), the third on
    time for the clock that waited."""
    clock = Playback()
    clock.start = 0.0
    clock.arrivals, clock.durations = [1.0, 1.35, 1.45], [0.2, 0.2, 1.0]
    run = clock.run()
    assert run.ttfa == 1.0 and run.audio_seconds == pytest.approx(1.4)
    assert run.gap == pytest.approx(0.15)


def test_kokoro_voice_is_benched_against_kokoro_onnx(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Kokoro voice's peer is kokoro-onnx, fed our phonemes (it checks its tokens are ours):
    both sides make the same audio length of the same sentences."""
    home = kw.default_cache_dir()
    kw.fetch_model(home)
    kw.fetch_voices(home)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Thank you for calling. One moment, please.\n", "utf-8")
    assert run_cpu_bench(corpus, threads=2, repeats=1, backend="auto", settle_s=0.0,
                         voice="kokoro-af_heart", voices_dir=home) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("cadenza (kokoro-af_heart: torch") and " vs kokoro-onnx, 1 runs" in lines[0]
    (row,) = [ln for ln in lines if re.match(r"\s*\d+ ", ln)]
    fields = row.split()
    assert fields[0] == "42" and len(fields) >= 9 and all(float(f.removesuffix("ms")) > 0 for f in fields[1:7])
    assert any(ln.startswith("ttfa, all 1 texts: cadenza median") and "kokoro-onnx median" in ln for ln in lines)
    audio = next(re.search(r"cadenza (\d+\.\d+) s, kokoro-onnx (\d+\.\d+) s", ln) for ln in lines
                 if ln.startswith("total time, median ratio"))
    assert audio is not None
    ours, theirs = float(audio.group(1)), float(audio.group(2))
    assert ours > 1.5 and ours == pytest.approx(theirs, rel=0.03)
    assert any(ln.startswith("kokoro-onnx 0.6.1:") and "G2P" in ln for ln in lines)
    assert re.fullmatch(r"ttfa_ratio=nan rtf_ratio=\d+\.\d+ ttfa_ratio_all=\d+\.\d+ total_ratio=\d+\.\d+",
                        lines[-1])


def test_a_family_without_a_peer_is_refused() -> None:
    info = dataclasses.replace(builtin_voice_info(), family="other")
    with pytest.raises(ValueError, match="no peer engine for other voices"):
        open_peer(info, 1)
