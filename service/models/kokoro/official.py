"""The official Kokoro model (PyPI kokoro==0.9.4, `KModel`), the oracle of `cadenza voices check`
and of the parity tests. Loaded without `kokoro/__init__.py`, which imports the G2P pipeline
(misaki[en]: spaCy, espeak) the model itself does not need; installed without its dependencies
(scripts/dev-setup does). Missing, it fails saying what to install."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import torch


def official_kmodel() -> type:
    if "kokoro.model" not in sys.modules:
        spec = importlib.util.find_spec("kokoro")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the official Kokoro model code is not installed: pip install --no-deps "
                               "kokoro==0.9.4 (scripts/dev-setup installs it)")
        package = types.ModuleType("kokoro")
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        package.__spec__ = spec
        sys.modules["kokoro"] = package
    kmodel: type = importlib.import_module("kokoro.model").KModel
    return kmodel


def official_model(state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A `KModel` (eval, FP32) holding `state_dict`, ours (weight norm folded): each weight-normed
    official layer gets v = our weight and g = its norm per output channel, which its forward
    turns back into our weight bit for bit (`weights.split_weight_norm`)."""
    from service.models.kokoro.weights import KOKORO_V1_CONFIG, split_weight_norm

    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.pth"
        torch.save({}, empty)  # KModel loads its weights from a file: give it none, they come next
        config = {**KOKORO_V1_CONFIG, "vocab": {}}
        model: torch.nn.Module = official_kmodel()(repo_id="hexgrad/Kokoro-82M", config=config, model=str(empty))
    keys = list(model.state_dict())
    split = split_weight_norm(state_dict, keys)
    model.load_state_dict({key: split[key] for key in keys}, strict=True)
    return model.eval()
