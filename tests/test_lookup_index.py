"""LookupIndex (specbench/policies/pld.py), the prompt lookup of `pld` and of DSpark's lookup drafts,
against the plain right-to-left scan it replaces, on random sequences growing round by round."""
import random

import pytest

from specbench.policies.pld import LookupIndex


def scan(sequence: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The most recent earlier occurrence of the last n tokens, longest n first; the k tokens after it."""
    n_tokens = len(sequence)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        pattern = sequence[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):
            if sequence[start : start + n] == pattern:
                return sequence[start + n : start + n + k]
    return []


def test_lookup_index_answers_as_the_scan():
    rng = random.Random(0)
    found = 0
    for _ in range(2000):
        vocab, min_ngram = rng.choice([2, 3, 5, 20]), rng.randint(1, 3)
        max_ngram, k = rng.randint(min_ngram, 4), rng.randint(1, 6)
        sequence = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        index = LookupIndex(min_ngram, max_ngram)
        for _ in range(rng.randint(1, 15)):
            expected = scan(sequence, k, min_ngram, max_ngram)
            assert index.find(sequence, k) == expected, (sequence, k, min_ngram, max_ngram)
            found += bool(expected)
            sequence = sequence + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    assert found > 1000  # both answers were exercised


def test_lookup_index_refuses_a_shorter_sequence():
    index = LookupIndex(1, 3)
    index.find([1, 2, 1, 2], 2)
    with pytest.raises(ValueError, match="got shorter"):
        index.find([1, 2], 2)
