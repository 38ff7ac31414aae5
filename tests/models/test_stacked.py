"""Stacked Linears: one kernel for several projections, the checkpoint's names kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from service.models.stacked import stack_linears


class Apart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(6, 4)
        self.k = nn.Linear(6, 2)
        self.out = nn.Linear(6, 3, bias=False)


class Together(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(6, 6)
        stack_linears(self, "qk", (("q", 4), ("k", 2)))
        self.out = nn.Linear(6, 3, bias=False)


class Outer(nn.Module):
    def __init__(self, inner: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([inner(), inner()])


def test_a_checkpoint_of_parts_loads_and_saves_as_it_was() -> None:
    torch.manual_seed(0)
    apart = Outer(Apart)
    together = Outer(Together)
    together.load_state_dict(apart.state_dict(), strict=True)
    x = torch.randn(5, 6)
    for a, t in zip(apart.layers, together.layers, strict=True):
        q, k = t.qk(x).split([4, 2], dim=-1)
        torch.testing.assert_close(q, a.q(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(k, a.k(x), rtol=0, atol=1e-6)
    saved, original = together.state_dict(), apart.state_dict()
    assert sorted(saved) == sorted(original)
    for key, value in original.items():
        assert torch.equal(saved[key], value), key


def test_a_model_made_stacked_saves_the_parts_names() -> None:
    assert sorted(Together().state_dict()) == sorted(Apart().state_dict())


def test_a_checkpoint_missing_a_part_is_refused() -> None:
    state = Apart().state_dict()
    del state["k.bias"]
    with pytest.raises(RuntimeError, match=r"qk\.bias"):
        Together().load_state_dict(state, strict=True)
