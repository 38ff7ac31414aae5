"""Intelligibility of the Kokoro voices against the built-in Piper voice, as an offline recogniser
hears them: pocketsphinx (US English, `tests.asr`) transcribes the fixed corpus
`tests/data/english20.txt`, one sentence a session, as the engine serves each voice (seeded), and
each Kokoro voice's corpus word error rate must be no worse than Piper's, with no slack.

The references are `english20.spoken.txt`: the same sentences as the words a reader says
(numbers, times, dates and amounts spelt out), lower case, no punctuation. A voice whose frontend
reads "$24" as "dollar twenty four" (Piper's espeak-ng does) pays for it: the figure is the served
voice's, frontend included.

The shipped int8 graph (`kokoro-v1.0.int8.onnx`, the file our weights are dequantised from) run
in ONNX Runtime on our frontend's phoneme ids is the reference our port is held to: its WER must be
finite and ours within `INT8_MARGIN` of it. The two differ by more than the port: the graph has no
random operator (its audio is the same every run) where our sine source draws seeded noise, and
it runs whole sentences where the served path cuts a long sentence's first clause off (as for
every stream). Seeds alone move our WER by up to 9 words of 287 (over three seed sets: bf_emma
0.268-0.300, af_heart 0.070-0.084, bm_george 0.105-0.125; Piper 0.132-0.146); ours less the
graph's was -5 to +11 words (the +11 bf_emma's at seeds 101 + i), so the margin is 0.04, 11.5
words (bench/RESULTS.md, "Kokoro intelligibility"). CADENZA_WER_INT8_VOICES (comma-separated
packs) picks the voices run that way; af_heart alone by default, for time.

bf_emma is worse than Piper here (about 0.27 against 0.14), and the int8 graph gives the same
figure: the recogniser's US acoustic model misses her non-rhotic British vowels ("order",
"corner", "locker room"); bm_george, also British, trips it far less. Her case is a strict xfail
that still prints her figure, so a change that makes her pass is noticed."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from service.audio.encoding import AudioEncoding
from service.engine.config import EngineConfig
from service.engine.contract import AudioOut, SessionConfig
from service.engine.frontend_pool import FrontendPoolConfig
from service.engine.local import LocalEngine
from service.models.kokoro import weights as kw
from service.models.kokoro.voices import MODEL_FILE, VOICE_ROWS
from service.models.registry import open_frontend, recognise
from service.voices import BUILTIN_VOICE
from tests.asr import transcribe, word_error_rate

pytestmark = pytest.mark.slow  # five voices x 20 sentences synthesised and recognised on the CPU

DATA = Path(__file__).parents[2] / "data"
CORPUS = DATA / "english20.txt"
SPOKEN = DATA / "english20.spoken.txt"
KOKORO = ("af_heart", "am_michael", "bf_emma", "bm_george")
INT8_VOICES = tuple(os.environ.get("CADENZA_WER_INT8_VOICES", "af_heart").split(","))
# Ours may be this much (absolute WER) worse than the int8 graph's: the largest gap measured over
# three seed sets, above the seed-only spread (module docstring).
INT8_MARGIN = 0.04
# Voices known to be worse than Piper to this recogniser (module docstring): strict xfails.
KNOWN_WORSE = {"bf_emma": "US-English recogniser against a British RP voice: the int8 graph scores the same"}


@dataclass(frozen=True)
class Score:
    voice: str
    path: str  # "served" (the engine) or "int8 ORT" (the shipped graph in ONNX Runtime)
    errors: int  # word edits against the spoken references, the whole corpus
    words: int
    audio_s: float
    synth_s: float

    @property
    def wer(self) -> float:
        return self.errors / self.words


@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    refs: list[list[str]]


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(lines(CORPUS), [line.split() for line in lines(SPOKEN)])


@pytest.fixture(scope="module")
def home(kokoro_home: Path) -> Path:
    return kokoro_home


def scored(voice: str, path: str, corpus: Corpus, audio: list[np.ndarray], rate: int, synth_s: float) -> Score:
    """Corpus WER: each sentence transcribed alone (pocketsphinx at 16 kHz, `transcribe`
    resamples), the edits summed over the corpus."""
    errors = sum(round(word_error_rate(ref, transcribe(a, rate)) * len(ref))
                 for ref, a in zip(corpus.refs, audio, strict=True))
    return Score(voice, path, errors, sum(map(len, corpus.refs)), sum(map(len, audio)) / rate, synth_s)


def table(scores: list[Score]) -> str:
    rows = [f"| {s.voice} | {s.path} | {s.wer:.3f} | {s.errors} / {s.words} | {s.audio_s:.1f} | {s.synth_s:.1f} |"
            for s in scores]
    return "\n".join(["| voice | path | WER | errors / words | audio s | synthesis s |",
                      "|---|---|---|---|---|---|", *rows])


@pytest.fixture(scope="module")
def served(home: Path, corpus: Corpus) -> dict[str, Score]:
    """Piper and the four Kokoro voices through one engine, sentence i seeded 1 + i."""
    config = EngineConfig(voices_dir=home, device="cpu", threads=2, core="thread", cache_bytes=0,
                          frontend=FrontendPoolConfig(workers=0), warmup_text="Hello.")
    scores: dict[str, Score] = {}
    with LocalEngine(config) as local:
        for voice in (BUILTIN_VOICE, *(f"kokoro-{pack}" for pack in KOKORO)):
            start, audio, rate = time.perf_counter(), [], 0
            for i, text in enumerate(corpus.texts):
                session = SessionConfig(voice=voice, seed=1 + i, encoding=AudioEncoding.FLOAT32)
                events = [e for e in local.stream(text, session) if isinstance(e, AudioOut)]
                rate = events[0].sample_rate
                audio.append(np.concatenate([np.frombuffer(e.audio, dtype="<f4") for e in events]))
            scores[voice] = scored(voice, "served", corpus, audio, rate, time.perf_counter() - start)
    print("\n" + table(list(scores.values())))
    return scores


@pytest.fixture(scope="module")
def int8(home: Path, corpus: Corpus) -> dict[str, Score]:
    """The shipped int8 graph in ONNX Runtime: tokens [1, N] (our ids, boundary 0s included),
    the pack's row for len(phonemes) - 1 as `style` [1, 256], `speed` [1]; sentence by sentence
    as our frontend cuts each line."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    graph = ort.InferenceSession(str(home / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    scores: dict[str, Score] = {}
    for pack_name in INT8_VOICES:
        info = recognise(home / "voices" / f"{pack_name}.bin")
        frontend = open_frontend(info.frontend_key)
        pack = kw.load_voice_pack(info.model_path).numpy()[:, 0]  # [510, 256]
        speed = np.array([1.0 / info.length_scale], dtype=np.float32)
        start, audio = time.perf_counter(), []
        for text in corpus.texts:
            pieces = []
            for sent in frontend.sentences(text):
                style = pack[min(max(len(sent.phonemes) - 1, 0), VOICE_ROWS - 1)][None]
                tokens = np.array([sent.phoneme_ids], dtype=np.int64)
                (out,) = graph.run(None, {"tokens": tokens, "style": style, "speed": speed})
                pieces.append(out.reshape(-1))
            audio.append(np.concatenate(pieces))
        scores[info.name] = scored(info.name, "int8 ORT", corpus, audio, info.sample_rate,
                                   time.perf_counter() - start)
    print("\n" + table(list(scores.values())))
    return scores


def test_the_corpus_is_twenty_sentences_the_recogniser_can_spell(corpus: Corpus) -> None:
    """Every reference word is in pocketsphinx's dictionary (a word it cannot output would be an
    error for every voice); long sentences, questions and numbers are there."""
    from pocketsphinx import get_model_path

    assert len(corpus.texts) == len(corpus.refs) == 20
    known = set()
    with open(Path(get_model_path()) / "en-us" / "cmudict-en-us.dict", encoding="utf-8") as dictionary:
        for entry in dictionary:
            known.add(entry.split(maxsplit=1)[0].split("(")[0])
    assert {w for ref in corpus.refs for w in ref} <= known
    assert sum(len(ref) >= 25 for ref in corpus.refs) >= 3
    assert sum(t.endswith("?") for t in corpus.texts) >= 3
    assert sum(any(c.isdigit() for c in t) for t in corpus.texts) >= 5
    assert any("$" in t for t in corpus.texts)


@pytest.mark.parametrize("pack", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WORSE[p])) if p in KNOWN_WORSE else p
    for p in KOKORO
])
def test_a_kokoro_voice_is_as_intelligible_as_piper(served: dict[str, Score], pack: str) -> None:
    ours, piper = served[f"kokoro-{pack}"], served[BUILTIN_VOICE]
    assert ours.wer <= piper.wer, f"kokoro-{pack} is harder to recognise than Piper:\n{table(list(served.values()))}"


def test_the_int8_graph_in_onnx_runtime_scores_like_ours(served: dict[str, Score], int8: dict[str, Score]) -> None:
    report = table([*served.values(), *int8.values()])
    for name, reference in int8.items():
        assert math.isfinite(reference.wer) and reference.audio_s > 0, report
        assert served[name].wer <= reference.wer + INT8_MARGIN, f"{name} served is worse than the int8 graph:\n{report}"
