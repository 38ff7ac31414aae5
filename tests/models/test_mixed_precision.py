"""`strict_fp32`: what runs inside gets no TF32, and the process's settings come back after."""

from __future__ import annotations

import pytest
import torch

from service.models.mixed_precision import strict_fp32


def test_strict_fp32_turns_tf32_off_inside_and_restores_it() -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with pytest.raises(RuntimeError, match="inside"), strict_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            raise RuntimeError("inside")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
