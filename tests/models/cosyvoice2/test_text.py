"""The CosyVoice2 text side: our Qwen2 tokenizer against transformers' (what upstream's
`QwenTokenizer` wraps, with its added special tokens) on the test directory's tokenizer files,
and how text becomes sentences."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.models.cosyvoice2.text import COSYVOICE_SPECIAL_TOKENS, MAX_SENTENCE_TOKENS, CosyVoice2Frontend

TEXTS = [
    "Hello world! It's 42 degrees, isn't it?",
    "Thank you [breath] for calling <strong>today</strong>. [laughter]",
    "Ünïcode café, 東京 and ﬁ ligatures",
    "tabs\tand  double spaces\n\nand new lines",
    "<|endofprompt|>prompted",
]


@pytest.fixture(scope="module")
def frontend(cosyvoice2_dir: Path) -> CosyVoice2Frontend:
    return CosyVoice2Frontend(cosyvoice2_dir / "CosyVoice-BlankEN")


def test_ids_equal_transformers_with_upstreams_special_tokens(cosyvoice2_dir: Path,
                                                               frontend: CosyVoice2Frontend) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(cosyvoice2_dir / "CosyVoice-BlankEN"))
    theirs.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                               "additional_special_tokens": list(COSYVOICE_SPECIAL_TOKENS)})
    for text in TEXTS:
        assert frontend.tokenizer.encode(text)[0] == theirs([text])["input_ids"][0], text
    breath = frontend.tokenizer.encode("[breath]")[0]
    assert breath == theirs.convert_tokens_to_ids(["[breath]"])  # one id, after Qwen2's own added tokens


def test_sentences_are_cut_at_their_ends_and_at_the_token_limit(frontend: CosyVoice2Frontend) -> None:
    got = frontend.sentences('Hello there. "How are you?" she asked.  Fine;\nthanks!')
    assert [s.text for s in got] == ["Hello there.", '"How are you?"', "she asked.", "Fine;", "thanks!"]
    for s in got:
        assert s.phoneme_ids == frontend.tokenizer.encode(s.text)[0] and s.words == []
    long = frontend.sentences(" ".join(["word"] * 3 * MAX_SENTENCE_TOKENS))
    assert len(long) >= 3 and all(len(s.phoneme_ids) <= MAX_SENTENCE_TOKENS for s in long)
    assert sum(len(s.phoneme_ids) for s in long) == len(frontend.tokenizer.encode(
        " ".join(["word"] * 3 * MAX_SENTENCE_TOKENS))[0])


def test_a_custom_dictionary_is_refused_with_what_to_do(frontend: CosyVoice2Frontend) -> None:
    with pytest.raises(ValueError, match="spelled as they should be read"):
        frontend.sentences("Hello.", {"hello": "h@loU"})


def test_the_voice_and_its_frontend_are_read_without_torch(cosyvoice2_dir: Path) -> None:
    """The server's API process lists voices and builds frontends; it never imports torch."""
    code = ("import sys; from pathlib import Path; from service.models import registry; "
            f"info = registry.recognise(Path({str(cosyvoice2_dir)!r})); "
            "registry.open_frontend(info.frontend_key).sentences('Hello there.'); "
            "print(info.name, info.num_speakers, dict(info.speaker_id_map), info.sample_rate, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout.strip()
    assert out == "cosyvoice2-test 2 {'prompt_a': 0, 'sft_b': 1} 24000 False"
