"""The pruned word-alignment search returns what scoring every candidate returns."""

from __future__ import annotations

import difflib
import random

from service.text.frontend import _align_dp, _strip_stress


def plain_align(solo: list[tuple[str, ...]], pwords: list[str]) -> list[int] | None:
    """Every candidate scored in (token, start, count) order: the reference."""
    m, n, band, inf = len(solo), len(pwords), 8, float("inf")
    cost = [[inf] * (n + 1) for _ in range(m + 1)]
    choice = [[0] * (n + 1) for _ in range(m + 1)]
    cost[0][0] = 0.0
    expected = 0
    for i, words in enumerate(solo):
        want = len(words)
        solo_text = _strip_stress("".join(words))
        low, high = max(0, expected - band), min(n, expected + want + band)
        expected += want
        for j in range(low, high + 1):
            if cost[i][j] == inf:
                continue
            for k in range(0, min(n - j, want + 3) + 1):
                step = float(abs(k - want))
                if k:
                    context = _strip_stress("".join(pwords[j : j + k]))
                    step += 0.5 * (1.0 - difflib.SequenceMatcher(None, solo_text, context).ratio())
                if cost[i][j] + step < cost[i + 1][j + k]:
                    cost[i + 1][j + k] = cost[i][j] + step
                    choice[i + 1][j + k] = k
    if cost[m][n] == inf:
        return None
    takes, j = [], n
    for i in range(m, 0, -1):
        takes.append(choice[i][j])
        j -= choice[i][j]
    return takes[::-1]


def test_pruned_alignment_equals_the_plain_search() -> None:
    rng = random.Random(0)
    alphabet = "abdefhiklmnoprstuvwzæðŋəɛɪʊʌˈˌ"

    def word() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))

    differed = 0
    for _ in range(400):
        solo = [tuple(word() for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))) for _ in range(rng.randint(1, 18))]
        pwords = [w for s in solo for w in s]
        for _ in range(rng.randint(1, 4)):  # espeak merges, splits and adds words in context
            r = rng.random()
            if r < 0.4 and len(pwords) > 1:
                i = rng.randrange(len(pwords) - 1)
                pwords[i : i + 2] = [pwords[i] + pwords[i + 1]]
            elif r < 0.7 and pwords:
                i = rng.randrange(len(pwords))
                cut = max(1, len(pwords[i]) // 2)
                pwords[i : i + 1] = [pwords[i][:cut], pwords[i][cut:] or "a"]
            else:
                pwords.insert(rng.randrange(len(pwords) + 1), word())
        want = plain_align(solo, pwords)
        assert _align_dp(solo, pwords) == want
        differed += want is not None and want != [len(s) for s in solo]
    assert differed > 100  # the cases exercise real re-alignments, not the 1:1 path
