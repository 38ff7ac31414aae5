"""CosyVoice2 model directories as voices, read without torch (the server's API process lists them).

A directory in the official release's layout (`cosyvoice2.yaml`, `llm.pt`, `flow.pt`, `hift.pt`,
`CosyVoice-BlankEN/`, optionally `spk2info.pt`) is one voice; its saved speakers (`spk2info.pt`,
upstream's SFT speakers and the zero-shot ones `add_zero_shot_spk` saves) are its speakers, in
name order. Without saved speakers it speaks with an empty prompt.

A sentence's first audio waits for its first chunk of speech tokens (25 and 3 of lookahead), most
of a short sentence: the segmenter cuts its streams into growing pieces (`decodes_whole_utterances`).
It reads text at its own pace: no speaking rate, no phoneme dictionary. A session may bring its own
speaker as a recording (`voice_prompts`, `prompt.py`)."""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from service.models.family import VoiceInfo

FAMILY_NAME = "cosyvoice2"
CONFIG_FILE = "cosyvoice2.yaml"
QWEN_DIR = "CosyVoice-BlankEN"
SPEAKERS_FILE = "spk2info.pt"
REQUIRED = (CONFIG_FILE, "llm.pt", "flow.pt", "hift.pt")


class _Skeleton(pickle.Unpickler):
    """Unpickles a `torch.save` archive's structure without torch: tensors come out as None."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return dict
        if module.startswith("torch"):
            return lambda *args, **kwargs: None
        raise pickle.UnpicklingError(f"{module}.{name} is not expected in a speaker file")

    def persistent_load(self, pid: Any) -> None:
        return None


def speaker_names(path: Path) -> list[str]:
    """The speakers saved in `spk2info.pt`, sorted ([] for no file)."""
    if not path.is_file():
        return []
    try:
        with zipfile.ZipFile(path) as archive:
            data = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            speakers = _Skeleton(archive.open(data)).load()
    except (OSError, StopIteration, zipfile.BadZipFile, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"{path} is not a CosyVoice2 speaker file (a torch.save'd dict of speakers): {exc}") from exc
    if not isinstance(speakers, dict):
        raise ValueError(f"{path} holds a {type(speakers).__name__}, not a dict of speakers")
    return sorted(str(name) for name in speakers)


def _sample_rate(config: Path) -> int:
    found = re.search(r"^sample_rate:\s*(\d+)", config.read_text("utf-8"), re.MULTILINE)
    return int(found.group(1)) if found else 24_000


def voice_name(directory: Path) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", directory.name.lower()).strip("-")
    return slug if slug.startswith(FAMILY_NAME) else f"{FAMILY_NAME}-{slug}"


def read_directory(path: Path) -> VoiceInfo | None:
    """The voice of a CosyVoice2 directory (or of its cosyvoice2.yaml); None: not one."""
    directory = path.parent if path.name == CONFIG_FILE else path
    if not directory.is_dir() or not all((directory / name).is_file() for name in REQUIRED):
        return None
    names = speaker_names(directory / SPEAKERS_FILE)
    return VoiceInfo(
        name=voice_name(directory), family=FAMILY_NAME, model_path=directory, config_path=directory / CONFIG_FILE,
        frontend_key=f"{FAMILY_NAME}:{directory / QWEN_DIR}", sample_rate=_sample_rate(directory / CONFIG_FILE),
        language="en-US", num_speakers=max(1, len(names)),
        speaker_id_map={name: i for i, name in enumerate(names)} if len(names) > 1 else {},
        length_scale=1.0, decodes_whole_utterances=True, pace=False, pronunciations=False, voice_prompts=True,
    )


def discover(directory: Path) -> list[VoiceInfo]:
    """CosyVoice2 directories directly under `directory` (and `directory` itself)."""
    candidates = [directory, *sorted(p for p in directory.iterdir() if p.is_dir())] if directory.is_dir() else []
    return [info for p in candidates if (info := read_directory(p)) is not None]
