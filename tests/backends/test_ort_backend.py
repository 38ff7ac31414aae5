"""The ONNX Runtime backend's lanes: a stage call cut in time and run in one-thread
sessions at once gives the samples of the whole call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.backends.ort_backend import OrtBackend
from service.voices import Voice, builtin_voice_info


@pytest.fixture(scope="module")
def backend(onnx_cache_dir: str) -> OrtBackend:
    # Three lanes: the cut is tested with two pieces and with three.
    return OrtBackend(Voice(builtin_voice_info()), threads=3, cache_dir=Path(onnx_cache_dir))


def test_lane_pieces_equal_the_whole_call(backend: OrtBackend) -> None:
    rng = np.random.default_rng(0)
    stages = backend.decoder_stages()
    cut = [i for i, least in enumerate(backend.lane_minimums) if least is not None]
    assert cut, "no stage is ever cut into lanes"
    for i in cut:
        least = backend.lane_minimums[i]
        assert least is not None
        channels = 192 if i == 0 else stages[i - 1][2]
        for length in (2 * least, 3 * least + 7):  # two pieces, then three
            x = (rng.standard_normal((1, channels, length)) * 0.5).astype(np.float32)
            whole = backend._run(backend._stage_names[i], {"x": x, "sid": np.zeros(1, dtype=np.int64)})[0]
            got = backend.decode_stage(i, x, None)
            assert got.shape == whole.shape
            assert float(np.abs(got - whole).max()) <= 1e-5 * max(1.0, float(np.abs(whole).max()))
