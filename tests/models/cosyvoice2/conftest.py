"""The official CosyVoice tree (token2wav-cosyvoice) is installed without its training and
serving dependencies. Two of its modules import logging glue from packages that pull those in:
`cosyvoice.utils.file_utils` (which imports torchaudio, whose wheels are built against an older
torch, for reading WAVs) and `matcha.utils.pylogger` (which imports Lightning and Hydra). The model
files take only a logger from them (and the serving module `cosyvoice.cli.model`, imported by the
class registry the encoder needs, the names of two export helpers for TensorRT and vLLM), so those
two modules are given exactly those names before any official model file is imported: the
standard logging module, and export helpers that refuse. Nothing the tests compare runs through
them."""

from __future__ import annotations

import logging
import sys
import types


def _logging_glue(name: str, **names: object) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    for key, value in names.items():
        setattr(module, key, value)
    sys.modules[name] = module


def _no_export(*args: object, **kwargs: object) -> None:
    raise RuntimeError("model export is not part of the parity tests")


_logging_glue("cosyvoice.utils.file_utils", logging=logging, convert_onnx_to_trt=_no_export,
              export_cosyvoice2_vllm=_no_export)
_logging_glue("matcha.utils", __path__=[])
_logging_glue("matcha.utils.pylogger", get_pylogger=logging.getLogger)
