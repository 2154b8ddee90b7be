"""Prompt-lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`): no draft model.
Find the most recent earlier occurrence of the row's last n tokens (n from max_ngram down to
min_ngram) and propose the K tokens that followed it. Drafts are deterministic (one-hot)."""
from __future__ import annotations

import torch

from specbench.engine.policy import BatchState, Draft, Policy


def lookup(sequence: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    n_tokens = len(sequence)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        pattern = sequence[n_tokens - n :]
        # Scan right to left: recent context predicts the continuation best.
        for start in range(n_tokens - n - 1, -1, -1):
            if sequence[start : start + n] == pattern:
                follow = sequence[start + n : start + n + k]
                if follow:
                    return follow
    return []


class PromptLookup(Policy):
    name = "pld"

    def __init__(self, k: int = 4, min_ngram: int = 1, max_ngram: int = 3):
        if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError("pld needs k >= 1 and 1 <= min_ngram <= max_ngram")
        self.k, self.min_ngram, self.max_ngram = k, min_ngram, max_ngram
        self.max_draft = k

    def params(self) -> dict:
        return {"k": self.k, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram}

    def propose(self, state: BatchState) -> Draft:
        b = state.batch_size
        tokens = torch.zeros(b, self.k, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        for r in range(b):
            if not state.active[r]:
                continue
            follow = lookup(state.row(r), self.k, self.min_ngram, self.max_ngram)
            tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.long)
            lengths[r] = len(follow)
        device = state.tokens.device
        return Draft(tokens=tokens.to(device), probs=None, lengths=lengths.to(device))
