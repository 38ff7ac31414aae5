"""`no_tf32`: on CUDA, FP32 means FP32 for every family once a voice opens there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.models import registry
from service.models.mixed_precision import no_tf32


@pytest.fixture()
def tf32_allowed() -> Iterator[None]:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.usefixtures("tf32_allowed")
def test_no_tf32_turns_it_off_for_products_and_convolutions() -> None:
    no_tf32()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.usefixtures("tf32_allowed")
def test_opening_a_voice_on_the_cpu_leaves_the_settings_alone(cosyvoice2_dir: Path) -> None:
    registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cpu")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


@pytest.mark.gpu
@pytest.mark.usefixtures("tf32_allowed")
def test_opening_a_voice_on_cuda_turns_tf32_off(cosyvoice2_dir: Path) -> None:
    registry.open_voice(registry.recognise(cosyvoice2_dir), "auto", "cuda")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
