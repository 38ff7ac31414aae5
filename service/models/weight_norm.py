"""Weight-norm folding: official checkpoints store weight-normed layers as (g, v) pairs; our
modules are plain convolutions and load the weight those pairs compute."""

from __future__ import annotations

from collections.abc import Mapping

import torch

_LEGACY = ("weight_g", "weight_v")
_PARAMETRIZED = ("parametrizations.weight.original0", "parametrizations.weight.original1")


def fold_weight_norm(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every weight-normed layer's (g, v) pair replaced by its `weight`.

    Both spellings are accepted: `torch.nn.utils.weight_norm`'s `weight_g`/`weight_v` (the
    official checkpoint and `KModel` as built today) and the parametrisation API's
    `parametrizations.weight.original0/1`. The official layers all normalise over dim 0; the
    fold uses the same kernel as their forward (`torch._weight_norm`), so the weight is the one
    the official layer computes, bit for bit."""
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        for names in (_LEGACY, _PARAMETRIZED):
            matched = next((n for n in names if key.endswith("." + n) or key == n), None)
            if matched is not None:
                base = key[: len(key) - len(matched)]
                pairs.setdefault(base, {})["g" if matched == names[0] else "v"] = value
                break
        else:
            out[key] = value
    for base, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            raise KeyError(f"weight norm of {base or 'the module'} has only {sorted(gv)}")
        g, v = gv["g"], gv["v"]
        if g.dim() != v.dim() or g.shape[0] != v.shape[0] or g[0].numel() != 1:
            raise ValueError(f"{base}: weight norm g {tuple(g.shape)} is not over dim 0 of v {tuple(v.shape)}")
        out[base + "weight"] = torch._weight_norm(v, g, 0)
    return out
