"""CosyVoice2's text side: the Qwen2 tokenizer of the model directory, as upstream's
`QwenTokenizer` builds it, and the sentences the engine synthesises.

The LM reads text as Qwen2 token ids (no phonemes): a sentence's `phoneme_ids` are those ids and
its `phonemes` their token strings. Upstream adds its paralinguistic tags (`[breath]`,
`<laughter>`, ...) as special tokens after Qwen2's own, so they reach the LM as one id each.
Word timings are not known (the LM has no durations), so sentences carry no word spans.

Torch-free: the server's API process builds frontends."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from service.text.frontend import PhonemizedSentence

# Qwen2's pre-tokenizer (transformers' Qwen2Tokenizer): contractions, letter runs with one
# leading non-letter, single digits, punctuation runs, newlines, spaces.
_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# What upstream's QwenTokenizer adds to Qwen2's tokens (cosyvoice/tokenizer/tokenizer.py), in its order.
COSYVOICE_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)
# The most text tokens in one sentence (upstream cuts paragraphs at 80 tokens): the LM makes at
# most 20 speech tokens per text token, and the KV cache holds a whole sentence.
MAX_SENTENCE_TOKENS = 80
_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；…])\s+|(?<=[.!?;。！？；…][\"'”’)\]])\s+|\n+")


class QwenTokenizer:
    """Text -> Qwen2 ids, equal to `transformers.AutoTokenizer` on the folder plus upstream's
    added special tokens."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE

        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            try:
                tok = Tokenizer(BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"),
                                              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                              byte_fallback=False))
            except Exception as exc:  # tokenizers raises its own types for missing or corrupt files
                raise ValueError(f"{folder}: no Qwen2 tokenizer (tokenizer.json, or vocab.json and merges.txt): "
                                 f"{exc}") from exc
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tok.decoder = decoders.ByteLevel()
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        added = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
        tok.add_special_tokens([AddedToken(entry["content"], special=True, normalized=False)
                                for _, entry in added])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in COSYVOICE_SPECIAL_TOKENS])
        self.tokenizer = tok

    def encode(self, text: str) -> tuple[list[int], list[str]]:
        out = self.tokenizer.encode(text, add_special_tokens=False)
        return list(out.ids), list(out.tokens)


class CosyVoice2Frontend:
    """Text to sentences of Qwen2 ids (a `service.models.family.TextFrontend`)."""

    def __init__(self, folder: str | Path) -> None:
        self.tokenizer = QwenTokenizer(Path(folder))

    def sentences(self, text: str, custom_dictionary: Mapping[str, str] | None = None,
                  words: bool = True) -> list[PhonemizedSentence]:
        if custom_dictionary:
            raise ValueError("CosyVoice2 voices read text, not phonemes: a custom pronunciation dictionary "
                             "does not apply to them (send the words spelled as they should be read)")
        out: list[PhonemizedSentence] = []
        for piece in _SENTENCE_END.split(text):
            piece = " ".join(piece.split())
            if not piece:
                continue
            ids, tokens = self.tokenizer.encode(piece)
            for a in range(0, len(ids), MAX_SENTENCE_TOKENS):
                part_ids, part_tokens = ids[a:a + MAX_SENTENCE_TOKENS], tokens[a:a + MAX_SENTENCE_TOKENS]
                shown = self.tokenizer.tokenizer.decode(part_ids, skip_special_tokens=False).strip()
                out.append(PhonemizedSentence(text=shown, phonemes=part_tokens, phoneme_ids=part_ids, words=[]))
        return out
