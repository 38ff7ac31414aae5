"""The ONNX Runtime backend's lanes: a stage call cut in time and run in one-thread
sessions at once gives the samples of the whole call, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.models.vits.backends.ort_backend import OrtBackend, run_session
from service.models.vits.voice import Voice, builtin_voice_info


@pytest.fixture(scope="module")
def backend(onnx_cache_dir: str) -> OrtBackend:
    # Three lanes: the cut is tested with two pieces and with three.
    return OrtBackend(Voice(builtin_voice_info()), threads=3, cache_dir=Path(onnx_cache_dir))


def test_lane_pieces_equal_the_whole_call(backend: OrtBackend) -> None:
    rng = np.random.default_rng(0)
    stages = backend.decoder_stages()
    cut = [i for i, least in enumerate(backend.lane_minimums) if least is not None]
    assert cut, "no stage is ever cut into lanes"
    sid = np.zeros(1, dtype=np.int64)
    for i in cut:
        least = backend.lane_minimums[i]
        assert least is not None
        name = backend._stage_names[i]
        channels = 192 if i == 0 else stages[i - 1][2]
        for length in (2 * least, 3 * least + 7, 5 * least + 3):  # two pieces, then three (twice)
            x = (rng.standard_normal((1, channels, length)) * 0.5).astype(np.float32)
            got = backend.decode_stage(i, x, None)
            # The cut itself is exact: the whole call in a one-thread session (the lanes' kind)
            # gives the same bits.
            whole_one_thread = run_session(backend._lane_sessions["fp32"][name], {"x": x, "sid": sid})[0]
            assert got.shape == whole_one_thread.shape
            assert np.array_equal(got, whole_one_thread), (name, length)
            # Against the backend's multi-thread session: equal bits for the generator stages and
            # for long flow calls, but for flow calls of about 100-200 frames ONNX Runtime's
            # threaded convolution rounds differently from its one-thread one (measured: up to
            # 3.8e-6 at a peak of 8.6, a few float32 ulps), with or without the cut.
            whole = backend._run(name, {"x": x, "sid": sid})[0]
            peak = float(np.abs(whole).max())
            assert float(np.abs(got - whole).max()) <= 2e-6 * max(1.0, peak), (name, length)
