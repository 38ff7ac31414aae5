"""Linear layers that read the same input, computed as one.

A checkpoint keeps a model's projections apart (a query, key and value projection; a gate and
an up projection); on a GPU at small batches each is a kernel launch of its own, and a step of a
token LM or a flow solve is bound by how many kernels it launches. The module holds one Linear
whose output rows are the parts' rows in order; checkpoints load and save under the parts' names,
so the official state dict fits as it is and what we save is the official layout again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def stack_linears(owner: nn.Module, stacked: str, parts: Sequence[tuple[str, int]]) -> None:
    """An nn.Linear `owner.<stacked>` standing for the Linears `parts` (name, output size) of
    `owner` in state dicts: their weights (and biases) are concatenated along the output rows on
    load and split on save."""
    linear = getattr(owner, stacked)
    assert isinstance(linear, nn.Linear) and linear.out_features == sum(size for _, size in parts)
    names, sizes = [name for name, _ in parts], [size for _, size in parts]

    def load(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for field in ("weight", "bias"):
            keys = [f"{prefix}{name}.{field}" for name in names]
            if all(key in state for key in keys):
                state[f"{prefix}{stacked}.{field}"] = torch.cat([state.pop(key) for key in keys])

    def save(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for field in ("weight", "bias"):
            key = f"{prefix}{stacked}.{field}"
            if key in state:
                for name, piece in zip(names, state.pop(key).split(sizes), strict=True):
                    state[f"{prefix}{name}.{field}"] = piece

    owner.register_load_state_dict_pre_hook(load)
    owner.register_state_dict_post_hook(save)
