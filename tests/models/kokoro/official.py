"""The official Kokoro model code (PyPI kokoro==0.9.4, installed by scripts/dev-setup without its
dependencies), loaded without `kokoro/__init__.py`: that imports the G2P pipeline (misaki[en]:
spaCy, espeak), which the model itself does not need. Missing, the parity tests fail, saying what
to install: they never skip."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def official_kmodel() -> type:
    if "kokoro.model" not in sys.modules:
        spec = importlib.util.find_spec("kokoro")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the official Kokoro model code is not installed: run scripts/dev-setup "
                               "(pip install --no-deps kokoro==0.9.4)")
        package = types.ModuleType("kokoro")
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        package.__spec__ = spec
        sys.modules["kokoro"] = package
    kmodel: type = importlib.import_module("kokoro.model").KModel
    return kmodel
