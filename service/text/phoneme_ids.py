"""Phonemes to model ids, identical to Piper's ``phonemes_to_ids``.

Piper writes ``^ _ p1 _ p2 _ ... pn _ $`` and silently skips symbols that are missing from the
voice's map. We do the same for espeak output (with a logged warning), but a symbol the user
wrote in an annotation must not vanish silently, so that is an error naming the symbol.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.text.annotations import AnnotationError

_LOGGER = logging.getLogger(__name__)

PAD = "_"
BOS = "^"
EOS = "$"


@dataclass(frozen=True)
class PhonemeIds:
    """Ids plus, per input phoneme, the index of its first id (-1 when it was skipped)."""

    ids: list[int]
    positions: list[int]


def phonemes_to_ids(
    phonemes: Sequence[str],
    id_map: Mapping[str, Sequence[int]],
    from_user: Sequence[bool] | None = None,
) -> PhonemeIds:
    """Convert phonemes to ids with BOS/PAD/EOS interleaving exactly like Piper.

    ``from_user[k]`` marks phoneme k as coming from an annotation: if it is not in the map,
    an ``AnnotationError`` is raised instead of skipping it.
    """
    ids: list[int] = [*id_map[BOS], *id_map[PAD]]
    positions: list[int] = []
    for k, phoneme in enumerate(phonemes):
        mapped = id_map.get(phoneme)
        if mapped is None:
            if from_user is not None and from_user[k]:
                raise AnnotationError(
                    f"phoneme {phoneme!r} (U+{ord(phoneme[0]):04X}) is not known to this voice"
                )
            _LOGGER.warning("Missing phoneme from id map: %r", phoneme)
            positions.append(-1)
            continue
        positions.append(len(ids))
        ids.extend(mapped)
        ids.extend(id_map[PAD])
    ids.extend(id_map[EOS])
    return PhonemeIds(ids=ids, positions=positions)
