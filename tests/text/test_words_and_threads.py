"""Word spans and thread safety of the frontend."""

from __future__ import annotations

import threading

from service.text.frontend import Frontend, PhonemizedSentence


def _check_spans(sentence: PhonemizedSentence) -> None:
    last = 2
    for word in sentence.words:
        assert last <= word.start_id < word.end_id <= len(sentence.phoneme_ids) - 1
        last = word.end_id


def _word_ipa(sentence: PhonemizedSentence) -> list[tuple[str, str]]:
    # Phoneme k sits at id index 2 + 2k.
    return [
        (w.text, "".join(sentence.phonemes[(w.start_id - 2) // 2 : (w.end_id - 1) // 2]))
        for w in sentence.words
    ]


def test_spans_valid_on_corpus(frontend: Frontend, corpus: list[str]) -> None:
    for line in corpus:
        for sentence in frontend.sentences(line):
            _check_spans(sentence)
    for sentence in frontend.sentences(" ".join(corpus)):
        _check_spans(sentence)


def test_without_words_only_the_spans_differ(frontend: Frontend, corpus: list[str]) -> None:
    """words=False skips the word alignment and nothing else: same sentences, texts and ids
    (annotations and dictionary entries included), no spans."""
    texts = [*corpus, " ".join(corpus), "Say [[ həlˈoʊ ]] twice, then tomato at 10:30."]
    for text in texts:
        full = frontend.sentences(text, {"tomato": "[T][AH0][M][EY1][T][OW2]"})
        bare = frontend.sentences(text, {"tomato": "[T][AH0][M][EY1][T][OW2]"}, words=False)
        assert [(s.text, s.phonemes, s.phoneme_ids) for s in bare] == [(s.text, s.phonemes, s.phoneme_ids)
                                                                          for s in full]
        assert all(not s.words for s in bare) and any(s.words for s in full)


def test_one_to_one_words(frontend: Frontend) -> None:
    (sentence,) = frontend.sentences("Hello, brave new world!")
    assert _word_ipa(sentence) == [
        ("Hello", "həlˈoʊ"),
        ("brave", "bɹˈeɪv"),
        ("new", "nˈuː"),
        ("world", "wˈɜːld"),
    ]


def test_numbers_expand_into_one_word(frontend: Frontend) -> None:
    (sentence,) = frontend.sentences("I have 123 apples and $3.50.")
    words = dict(_word_ipa(sentence))
    assert list(words) == ["I", "have", "123", "apples", "and", "$3.50"]
    assert words["123"] == "wˈʌnhˈʌndɹɪd twˈɛnti θɹˈiːʲ"
    assert words["$3.50"].startswith("dˈɑːlɚ θɹˈiː")


def test_merged_words_share_a_span(frontend: Frontend) -> None:
    sentences = frontend.sentences("Dr. Smith lives on Main St. now")
    assert [s.text for s in sentences] == ["Dr.", "Smith lives on Main St. now"]
    words = _word_ipa(sentences[1])
    assert ("Main St", "mˈeɪnstɹˌiːt") in words
    assert words[-1] == ("now", "nˈaʊ")


def test_number_with_merged_words(frontend: Frontend) -> None:
    # 1999 expands to three words while "was the" and "of the" merge: counts match 1:1 by
    # coincidence, so the alignment must not trust it.
    (sentence,) = frontend.sentences("The year 1999 was the end of the millennium.")
    words = dict(_word_ipa(sentence))
    assert words["1999"] == "nˈaɪntiːnhˈʌndɹɪd nˈaɪnti nˈaɪn"
    assert words["millennium"] == "mɪlˈɛniəm"
    assert words["end"] == "ˈɛnd"


def test_words_across_sentences(frontend: Frontend) -> None:
    sentences = frontend.sentences("One. Two three! Four?")
    assert [[w.text for w in s.words] for s in sentences] == [["One"], ["Two", "three"], ["Four"]]


def test_concurrent_equals_serial(frontend: Frontend, corpus: list[str]) -> None:
    texts = [" ".join(corpus[i::8]) for i in range(8)]
    serial = [frontend.sentences(t, {"tomato": "T AH0 M AA1 T OW2"}) for t in texts]
    results: list[list[object]] = [[] for _ in texts]
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for _ in range(20):
                results[index].append(
                    frontend.sentences(texts[index], {"tomato": "T AH0 M AA1 T OW2"})
                )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, runs in enumerate(results):
        assert len(runs) == 20
        assert all(run == serial[index] for run in runs)
