"""The CosyVoice2 runtime on CUDA: its CUDA graphs against eager calls (`GraphedLM`: the same
scores and cache for token steps and prefills, for batches that pad to a bucket and spans that
cross one; `GraphedSolve`:
the same mel for a padded batch of unequal rows), and steps the engine thread queues without
waiting for the device."""

from __future__ import annotations

import copy
import linecache
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from service.models import registry
from service.models.cosyvoice2.cfm import CfmConfig, GraphedSolve, fixed_noise, solve
from service.models.cosyvoice2.estimator import Estimator, EstimatorConfig
from service.models.cosyvoice2.flow import Flow
from service.models.cosyvoice2.hift import GraphedHiFT, HiFT, HiftConfig
from service.models.cosyvoice2.lm import KVCache, Qwen2Config, SpeechLM
from service.models.cosyvoice2.runtime import CosyVoice2Runtime, GraphedLM, SpeechUtterance
from service.models.cuda_graphs import GraphCapturer
from service.models.family import AcousticJob, StepRows, SynthesisParams, utterance_rng

CONFIG = Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     vocab_size=320, speech_token_size=200)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_steps_equal_eager_steps() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lm = SpeechLM(CONFIG).to(dev).eval()
    cache = KVCache.empty(CONFIG, rows=6, capacity=300, device=dev)
    prompts = {1: 50, 3: 12, 4: 61}  # rows and their prompt lengths: the steps cross span 64
    for row, n in prompts.items():
        lm(torch.randn(1, n, CONFIG.hidden_size, device=dev), cache, torch.tensor([row], device=dev))
    eager = copy.deepcopy(cache)
    graphed = GraphedLM(lm, cache, scratch=0)
    lengths = dict(prompts)
    for step in range(8):
        rows = [3, 1, 4] if step % 2 else [4, 1]  # 3 rows pad to 4 (the scratch row)
        x = torch.randn(len(rows), 1, CONFIG.hidden_size, device=dev)
        for r in rows:
            lengths[r] += 1
        span = max(lengths[r] for r in rows)
        at = torch.tensor(rows, device=dev)
        want = lm(x, eager, at, span=span)
        got = graphed(x, at, span)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert graphed.buckets(3, 1, 66) in graphed._graphs and graphed.buckets(2, 1, 60) in graphed._graphs
    real = list(prompts)
    torch.testing.assert_close(cache.lengths[real], eager.lengths[real], atol=0, rtol=0)
    for mine, theirs in zip(cache.layers, eager.layers, strict=True):  # [2 (keys, values), rows, ...]
        torch.testing.assert_close(mine[:, real], theirs[:, real], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_prefills_equal_eager_prefills() -> None:
    """Prompts of unequal lengths in one padded batch onto fresh rows, then again onto rows that
    hold positions (a prompt fed again): the same scores, lengths and cache as eager calls."""
    torch.manual_seed(1)
    dev = torch.device("cuda")
    lm = SpeechLM(CONFIG).to(dev).eval()
    cache = KVCache.empty(CONFIG, rows=6, capacity=300, device=dev)
    eager = copy.deepcopy(cache)
    graphed = GraphedLM(lm, cache, scratch=0)
    spans = {1: 0, 3: 0, 5: 0}
    for sizes in ({1: 20, 3: 7, 5: 33}, {3: 40, 5: 9}):
        rows = list(sizes)
        assert graphed.graphed(len(rows), max(sizes.values()))
        x = torch.randn(len(rows), max(sizes.values()), CONFIG.hidden_size, device=dev)
        lengths = torch.tensor(list(sizes.values()), device=dev)
        for r, n in sizes.items():
            spans[r] += n
        span = max(spans[r] for r in rows)
        at = torch.tensor(rows, device=dev)
        want = lm(x, eager, at, lengths, span=span)
        got = graphed(x, at, span, lengths)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.lengths[rows], eager.lengths[rows], atol=0, rtol=0)
        for mine, theirs in zip(cache.layers, eager.layers, strict=True):
            for r in rows:  # what the rows hold (past their lengths each holds padding)
                torch.testing.assert_close(mine[:, r, :, : spans[r]], theirs[:, r, :, : spans[r]], atol=1e-5,
                                           rtol=1e-4)
    assert graphed.buckets(3, 33, 33) in graphed._graphs and graphed.buckets(2, 40, 47) in graphed._graphs
    assert not graphed.graphed(9, 20) and not graphed.graphed(2, 513)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_solves_equal_eager_solves(no_tf32_convolutions: None) -> None:
    """A batch of unequal rows padded to its bucket (3 rows of up to 150 frames: 4 x 256) solves
    as the eager batch does, streaming and not."""
    solves_equal()


@pytest.fixture
def no_tf32_convolutions() -> Iterator[None]:
    """cuDNN's TF32 convolutions off (as for a served voice, `no_tf32`): their rounding depends on
    the shape, so a solve padded to its graph's bucket would part from the eager one by it."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def small_solver(seed: int) -> tuple[Estimator, CfmConfig, torch.Tensor]:
    """A small estimator on CUDA with random weights, the solver's config and its fixed noise."""
    torch.manual_seed(seed)
    config = EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2)
    cfm = CfmConfig()
    return Estimator(config).cuda().eval(), cfm, fixed_noise(cfm).cuda()


def solves_equal() -> None:
    dev = torch.device("cuda")
    estimator, cfm, noise = small_solver(0)
    graphed = GraphedSolve(estimator, noise, cfm)
    frames = torch.tensor([150, 90, 120], device=dev)
    mask = (torch.arange(150, device=dev)[None, :] < frames[:, None]).float()[:, None]
    mu = torch.randn(3, 80, 150, device=dev) * mask
    cond = torch.zeros(3, 80, 150, device=dev)
    cond[:, :, :40] = torch.randn(3, 80, 40, device=dev)
    spks = torch.randn(3, 80, device=dev)
    solved = []
    for streaming in (True, False):
        want = solve(estimator, noise, mu, mask, spks, cond, cfm, streaming=streaming)
        got = graphed(mu, mask, spks, cond, streaming)
        assert got.shape == want.shape == (3, 80, 150)
        for i, n in enumerate(frames.tolist()):
            torch.testing.assert_close(got[i, :, :n], want[i, :, :n], atol=1e-4, rtol=1e-4)
        solved.append((got, want))
    modes = [True, False, True]  # a step's chunks and last chunks in one replay
    mixed = graphed(mu, mask, spks, cond, torch.tensor(modes, device=dev))
    for i, n in enumerate(frames.tolist()):
        want = solved[0 if modes[i] else 1][1]
        torch.testing.assert_close(mixed[i, :, :n], want[i, :, :n], atol=1e-4, rtol=1e-4)
    assert set(graphed._graphs) == {(4, 256)}  # one graph for both modes
    for streaming in (True, False):  # replayed for other rows: what the first calls gave stays (mel tails are kept)
        graphed(mu.flip(0), mask.flip(0), spks.flip(0), cond.flip(0), streaming)
    for got, want in solved:
        for i, n in enumerate(frames.tolist()):
            torch.testing.assert_close(got[i, :, :n], want[i, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@torch.inference_mode()
def test_fp16_estimator_graphs_share_the_fp32_ones_memory_and_equal_eager_fp16(no_tf32_convolutions: None) -> None:
    """The unpinned flow's FP16 estimator (`HalfEstimator`) solves through its own graphs in the
    FP32 solver's capturer: each equals its eager solve, the FP16 mel stays within FP16's
    rounding of FP32's, and replays of one do not change what the other handed out."""
    from service.models.cosyvoice2.flow import HalfEstimator
    from service.models.mixed_precision import to_mixed_precision

    dev = torch.device("cuda")
    estimator, cfm, noise = small_solver(2)
    half = HalfEstimator(to_mixed_precision(estimator, ("final_proj",), torch.float16))
    fp32 = GraphedSolve(estimator, noise, cfm)
    fp16 = GraphedSolve(half, noise, cfm, fp32.capturer)
    mask = torch.ones(2, 1, 140, device=dev)
    mu, cond = torch.randn(2, 80, 140, device=dev), torch.zeros(2, 80, 140, device=dev)
    spks = torch.randn(2, 80, device=dev)
    got32 = fp32(mu, mask, spks, cond, True)
    got16 = fp16(mu, mask, spks, cond, True)
    eager16 = solve(half, noise, mu, mask, spks, cond, cfm, streaming=True)
    torch.testing.assert_close(got16, eager16, atol=2e-3, rtol=2e-3)
    want32 = solve(estimator, noise, mu, mask, spks, cond, cfm, streaming=True)
    torch.testing.assert_close(got32, want32, atol=1e-4, rtol=1e-4)
    error = (got16 - want32).pow(2).mean()
    assert 10 * torch.log10(want32.abs().max() ** 2 / error) >= 45.0
    fp32(mu.flip(0), mask, spks.flip(0), cond, True)
    fp16(mu.flip(0), mask, spks.flip(0), cond, True)
    torch.testing.assert_close(got32, want32, atol=1e-4, rtol=1e-4)  # a copy, not the graph's output


@pytest.mark.gpu
@torch.inference_mode()
def test_compiled_solves_equal_eager_ones_and_a_compiler_failure_falls_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_tf32_convolutions: None) -> None:
    """`compile_decoder`: the estimator's passes as inductor's kernels under the graphs give the eager
    graphs' mel (FP32 arithmetic, fused differently); a compiler that fails leaves eager kernels."""
    dev = torch.device("cuda")
    estimator, cfm, noise = small_solver(3)
    mask = torch.ones(2, 1, 200, device=dev)
    mu, cond = torch.randn(2, 80, 200, device=dev), torch.zeros(2, 80, 200, device=dev)
    spks = torch.randn(2, 80, device=dev)
    want = GraphedSolve(estimator, noise, cfm)(mu, mask, spks, cond, True)
    compiled = GraphedSolve(estimator, noise, cfm, compiled=True)
    torch.testing.assert_close(compiled(mu, mask, spks, cond, True), want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(compiled(mu[:1, :, :150], mask[:1, :, :150], spks[:1], cond[:1, :, :150], True),
                               want[:1, :, :150], atol=1e-3, rtol=1e-3)  # another bucket, the same compile

    def broken(*args: object, **kwargs: object) -> Callable[..., torch.Tensor]:
        def fail(*a: object, **k: object) -> torch.Tensor:
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING"):
        fallen = GraphedSolve(estimator, noise, cfm, compiled=True)
        torch.testing.assert_close(fallen(mu, mask, spks, cond, True), want, atol=1e-4, rtol=1e-4)
    assert "compiling the flow's estimator failed (RuntimeError: no compiler here)" in caplog.text


def host_waits(call: Callable[[], object]) -> list[str]:
    """Where `call` made the host wait for the device (torch's sync debug mode, as warnings;
    one the mode switch itself reports, from torch.cuda's own module, is not `call`'s)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {linecache.getline(w.filename, w.lineno).strip()}"
            for w in seen if "synchroniz" in str(w.message)
            and not w.filename.replace("\\", "/").endswith("torch/cuda/__init__.py")]


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_encoder_calls_equal_eager_ones(no_tf32_convolutions: None) -> None:
    """`GraphedEncoder`: rows of unequal lengths padded to the bucket give each row the
    condition its eager call alone gives, with and without lookahead, and an output survives
    the next replay."""
    from .test_flow import SMALL

    torch.manual_seed(0)
    dev = torch.device("cuda")
    flow = Flow(SMALL).to(dev).eval()
    flow.use_graphs()
    graphed = flow.graphed_encoder
    assert graphed is not None
    g = torch.Generator().manual_seed(3)
    for streaming, k in ((True, 3), (False, 0)):
        full = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).to(dev) for n in (40, 17, 70)]
        sizes = [f.shape[0] - k for f in full]
        alone = [flow.encode([f], [n], k, streaming) for f, n in zip(full, sizes, strict=True)]
        mu, frames = graphed(full, sizes, k, streaming)
        graphed(full[::-1], sizes[::-1], k, streaming)  # a replay after
        assert frames.tolist() == [2 * n for n in sizes]
        for i, (a, _) in enumerate(alone):
            torch.testing.assert_close(mu[i : i + 1, :, : a.shape[2]], a, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@torch.inference_mode()
def test_graphed_vocoder_calls_equal_eager_ones_and_other_shapes_run_eagerly(no_tf32_convolutions: None) -> None:
    """`GraphedHiFT`: a captured shape (rows padded to the bucket, with and without a cache)
    gives each row what the eager vocoder gives it from the same generator; outputs survive
    the next replay; a shape not captured runs eagerly and still draws from the rows' own
    generators."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    config = HiftConfig(base_channels=64, f0_cond_channels=32)
    hift = HiFT(config).to(dev).eval()
    graphed = GraphedHiFT(hift, GraphCapturer(dev))
    graphed.capture(4, 20, 960)
    graphed.capture(1, 30, 0)

    def generators(seed: int, rows: int) -> list[torch.Generator]:
        return [torch.Generator(device=dev).manual_seed(seed + r) for r in range(rows)]

    for rows, frames, cached, replayed in ((3, 20, True, True), (1, 30, False, True), (2, 26, False, False)):
        mel = torch.randn(rows, 80, frames, device=dev)
        cache = torch.randn(rows, 1, 960, device=dev) if cached else None
        assert graphed.graphed(rows, frames, cache) == replayed
        want = hift(mel, generators(rows, rows), cache)
        got = graphed(mel, generators(rows, rows), cache)
        graphed(torch.randn(rows, 80, frames, device=dev), generators(99, rows), cache)  # a replay after
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@torch.inference_mode()
def test_steps_are_queued_without_waiting_for_the_device(cosyvoice2_dir: Path) -> None:
    """A decoder step is queued and the engine thread goes on (token steps on their own stream,
    the next plan) while it runs: nothing in it reads the device back or copies from pageable
    memory. A token step waits only for its LM calls' scores (tokens are drawn on the host)."""
    rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cuda")
    assert isinstance(rt, CosyVoice2Runtime)
    rt.prepare(max_batch=2)
    frontend = registry.open_frontend(rt.info.frontend_key)
    texts = ["Thank you for calling, how can I help you today?", "Goodbye!"]
    sentences = [s for t in texts for s in frontend.sentences(t)]
    jobs = [AcousticJob(s, 0, SynthesisParams(seed=4), utterance_rng(4, s.phoneme_ids)) for s in sentences]
    utts = [u for u in rt.acoustic_batch(jobs) if isinstance(u, SpeechUtterance)]
    for _ in range(3):
        rt.tokens.step(utts)  # warm: the token graphs' first replays
    waits = host_waits(lambda: rt.tokens.step(utts))  # a prompt fed again is one more LM call, one more read
    assert waits and all("logp.cpu()" in w for w in waits), waits
    while not all(u.complete for u in utts):
        rt.tokens.step(utts)
    decoder = rt.streaming_decoder("fp16", 2, max_rows=2, graphs=True, graph_frames=())
    for slot, u in enumerate(utts):
        assert decoder.start(slot, u.prior)
    decoder.step(StepRows([0, 1], [0, 0], 20, None))  # warm: first chunks, allocations
    assert host_waits(lambda: decoder.step(StepRows([0, 1], [20, 20], 40, None))) == []


@pytest.mark.gpu
def test_on_cuda_batched_token_steps_give_each_sentence_what_it_gets_alone(cosyvoice2_dir: Path) -> None:
    """As on the CPU (`test_runtime.batched_equals_alone`): the same tokens batched and alone,
    but for a near-tie flip in one sentence, after its first 10 tokens."""
    from tests.models.cosyvoice2.test_runtime import batched_equals_alone

    rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cuda")
    assert isinstance(rt, CosyVoice2Runtime)
    with torch.inference_mode():
        batched_equals_alone(rt, registry.open_frontend(rt.info.frontend_key))


@pytest.mark.gpu
@torch.inference_mode()
def test_a_prepared_token_cache_serves_its_rows_without_capturing_again(cosyvoice2_dir: Path) -> None:
    """The start-up grows the KV cache to the rows it captures token steps for, so sentences
    taking every one of them keep those graphs; only a sentence past them grows the cache (and
    its graphs are captured anew)."""
    rt = registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cuda")
    assert isinstance(rt, CosyVoice2Runtime)
    stage = rt.tokens
    stage.capture(16)
    graphed = stage._graphed
    assert graphed is not None and len(stage.cache.lengths) == 16 and len(stage.free) == 15  # row 0: scratch
    assert graphed.buckets(16, 1, 64) in graphed._graphs
    rows = [stage._take_row() for _ in range(15)]
    assert stage._graphed is graphed and sorted(rows) == list(range(1, 16))
    stage._take_row()
    assert len(stage.cache.lengths) == 32 and stage._graphed is not graphed
