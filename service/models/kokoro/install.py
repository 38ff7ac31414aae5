"""`cadenza voices install kokoro --from SRC`: Kokoro's official files, downloaded elsewhere,
installed into the layout the family serves from (`service.models.kokoro.voices`), offline.

What SRC may hold (the names the official releases use):

* the model, one of `MODEL_FILES`: `kokoro-v1_0.pth` (the official `KModel` checkpoint),
  `kokoro-v1.0.onnx` (kokoro-onnx's float graph) or `kokoro-v1.0.int8.onnx`. The first found is
  copied as it is (the loader reads all three, `weights.model_state_dict`), after it has loaded
  into our model: a wrong file fails here, not when a server starts;
* the voices: `voices/<name>.pt` (official: a float32 tensor [510, 1, 256] each) and/or
  `voices-v1.0.bin` (kokoro-onnx: an .npz archive, one such array per name), written as our
  `voices/<name>.bin` (raw float32).

Each file is written under a temporary name and renamed, so `discover()` never sees half a voice;
the registry fetch's `voices/.complete` (all 54 packs are there) is left to that fetch. The
phoneme vocabulary is ours (`frontend.KOKORO_VOCAB`, the model's published one): `vocab.json` is
written from it when absent, for the tools that read the file (kokoro-onnx in `cadenza bench`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from service.models.kokoro.voices import (
    CHECKPOINT_FILE,
    LANGUAGES,
    MODEL_FILES,
    VOICE_DIM,
    VOICE_ROWS,
    model_file,
)

NPZ_VOICES = "voices-v1.0.bin"
VOICE_SHAPE = (VOICE_ROWS, 1, VOICE_DIM)
_VOICE_NAME = re.compile(r"[a-z]{2}_[a-z0-9_]+")


def _log(message: str) -> None:
    print(f"[kokoro] {message}", file=sys.stderr, flush=True)


def _not_a_voice(source: Path, name: str, dtype: object, shape: Iterable[int]) -> ValueError:
    return ValueError(f"{source}: voice {name!r} is {dtype} {list(shape)}; a Kokoro voice is float32 "
                      f"{list(VOICE_SHAPE)}")


def _checked_voice(name: str, value: object, source: Path) -> np.ndarray:
    """`value` as the pack's float32 array, or a one-line error naming `source` and the fix."""
    if not _VOICE_NAME.fullmatch(name) or name[0] not in LANGUAGES:
        raise ValueError(f"{source}: voice {name!r} is not named <language><gender>_<name> (e.g. af_heart; "
                         f"languages {' '.join(LANGUAGES)}); rename it")
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{source}: voice {name!r} is a {type(value).__name__}; save the [510, 1, 256] float32 "
                         "tensor itself")
    if value.shape != VOICE_SHAPE or value.dtype != np.float32:
        raise _not_a_voice(source, name, value.dtype, value.shape)
    return value


def _read_pt(path: Path) -> np.ndarray:
    import torch

    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors: a truncated download or another file
        raise ValueError(f"{path} is not a readable torch file ({type(exc).__name__}); download it again") from None
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:  # numpy has no bfloat16: say so before converting
            raise _not_a_voice(path, path.stem, str(value.dtype).removeprefix("torch."), value.shape)
        value = value.detach().numpy()
    return _checked_voice(path.stem, value, path)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as exc:  # TypeError: one .npy
        raise ValueError(f"{path} is not kokoro-onnx's voices archive (an .npz of [510, 1, 256] float32 arrays; "
                         f"{type(exc).__name__}); download it again") from None
    return {name: _checked_voice(name, array, path) for name, array in arrays.items()}


def read_voices(source: Path) -> dict[str, np.ndarray]:
    """Every voice in `source` (`voices/*.pt`, `voices-v1.0.bin`), checked, by name."""
    voices: dict[str, np.ndarray] = {}
    if (source / NPZ_VOICES).is_file():
        voices.update(_read_npz(source / NPZ_VOICES))
    for path in sorted((source / "voices").glob("*.pt")):
        voices[path.stem] = _read_pt(path)
    if not voices:
        raise ValueError(f"no Kokoro voices in {source}: put the official voices/<name>.pt or kokoro-onnx's "
                         f"{NPZ_VOICES} there")
    return voices


def _write(out: Path, data: bytes | Path) -> None:
    """`out` from bytes or a file's copy, renamed into place when whole."""
    partial = out.with_name(out.name + ".partial")
    if isinstance(data, Path):
        shutil.copyfile(data, partial)
    else:
        partial.write_bytes(data)
    os.replace(partial, out)


def install_from(source: str | Path, cache_dir: str | Path) -> tuple[Path, list[str]]:
    """Install the model and voices in `source` into `cache_dir`: (the model installed, the voice
    names). Everything is read and checked before anything is written."""
    from service.models.kokoro.frontend import KOKORO_VOCAB
    from service.models.kokoro.runtime import load_model

    source, cache = Path(source), Path(cache_dir)
    if not source.is_dir():
        raise ValueError(f"--from {source}: give the folder that holds the Kokoro files")
    model = model_file(source)
    if model is None:
        raise ValueError(f"no Kokoro model in {source}: put {CHECKPOINT_FILE} (official) or kokoro-onnx's "
                         f"{' or '.join(MODEL_FILES[1:])} there")
    voices = read_voices(source)
    _log(f"loading {model} to check it")
    load_model(model)
    (cache / "voices").mkdir(parents=True, exist_ok=True)
    installed = cache / model.name
    if not (installed.exists() and installed.samefile(model)):
        _write(installed, model)
    for name, pack in voices.items():
        _write(cache / "voices" / f"{name}.bin", pack.astype("<f4").tobytes())
    if not (cache / "vocab.json").is_file():
        _write(cache / "vocab.json", json.dumps({"vocab": KOKORO_VOCAB}, ensure_ascii=False).encode())
    served = model_file(cache)
    if served != installed:
        _log(f"note: {served} is there too and is the one served; remove it to serve {installed.name}")
    return installed, sorted(voices)
