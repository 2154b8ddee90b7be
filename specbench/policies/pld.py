"""Prompt-lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`): no draft model.
Find the most recent earlier occurrence of the row's last n tokens (n from max_ngram down to
min_ngram) and propose the K tokens that followed it. Drafts are deterministic (one-hot)."""
from __future__ import annotations

import torch

from specbench.engine.policy import BatchState, Draft, Policy


class LookupIndex:
    """The lookup for one growing sequence (a request's prompt + output): find(sequence, k) gives the K
    tokens after the most recent earlier occurrence of its last n tokens, n from max_ngram down to
    min_ngram, or []. Kept up to date round by round (per n, the latest start of every n-gram with a
    token after it), so a round indexes only the tokens it committed; scanning the whole sequence
    instead cost ~0.1 ms a row and round at 300 tokens in Python, 2% of a b = 1 round on the 2-core
    CPU. tests/test_lookup_index.py checks it against that scan."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.lengths = range(max_ngram, min_ngram - 1, -1)  # longest first: the longest match wins
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in self.lengths}
        self.indexed = {n: 0 for n in self.lengths}  # starts below this are in latest[n]
        self.seen = 0

    def find(self, sequence: list[int], k: int) -> list[int]:
        n_tokens = len(sequence)
        if n_tokens < self.seen:
            raise ValueError("LookupIndex: the sequence got shorter (a new request needs a new index)")
        self.seen = n_tokens
        for n in self.lengths:
            table = self.latest[n]
            for start in range(self.indexed[n], n_tokens - n):  # n-grams with a token after them
                table[tuple(sequence[start : start + n])] = start
            self.indexed[n] = max(self.indexed[n], n_tokens - n)
            if n < n_tokens:
                start = table.get(tuple(sequence[n_tokens - n :]))
                if start is not None:
                    return sequence[start + n : start + n + k]
        return []


def check_lookup_settings(ngram: int, k: int) -> None:
    """A learned policy's lookup settings (lookup_ngram n, lookup_k): n >= 0 (0: off), k >= 1 when on."""
    if ngram < 0 or (ngram and k < 1):
        raise ValueError("lookup_ngram must be >= 0 (0: off) and lookup_k >= 1")


def lookup_indexes(ngram: int, rows: int) -> list[LookupIndex]:
    """One index per row of a batch for a learned policy's lookup drafts: matches of the last n..max(n, 3)
    tokens; none when lookup drafts are off (ngram 0)."""
    return [LookupIndex(ngram, max(ngram, 3)) for _ in range(rows)] if ngram else []


def lookup_params(ngram: int, k: int) -> dict:
    """The lookup settings a learned policy's records carry (policy_params), none when off."""
    return {"lookup_ngram": ngram, "lookup_k": k} if ngram else {}


def find_lookups(indexes: list[LookupIndex], state: BatchState, k: int) -> dict[int, list[int]]:
    """Each active row's lookup draft of up to k tokens, by row, for the rows that have one."""
    found = {}
    for r, on in enumerate(state.active.tolist()):
        if on:
            follow = indexes[r].find(state.row(r), k)
            if follow:
                found[r] = follow
    return found


def with_lookup_drafts(drafted: Draft | None, lookups: dict[int, list[int]], state: BatchState, k: int) -> Draft:
    """A learned policy's round draft with each looked-up row's lookup draft (up to k tokens) in place of
    its drafted tokens; with `drafted` None (no drafter call this round) rows without a lookup draft verify
    nothing. A lookup draft is deterministic: at T > 0 its rows of the drafted distributions become one-hot
    on its tokens, so the verifier sees the exact distribution each token was drawn from."""
    b, device = state.batch_size, state.tokens.device
    width = max(k, drafted.tokens.shape[1] if drafted is not None else 0)
    tokens = torch.zeros(b, width, dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    if drafted is not None:
        tokens[:, : drafted.tokens.shape[1]] = drafted.tokens.cpu()
        lengths[:] = drafted.lengths.cpu()
    rows = sorted(lookups)
    for r in rows:  # what a row's drafted tokens leave past its lookup draft is padding, never verified
        follow = lookups[r]
        tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.long)
        lengths[r] = len(follow)
    looked_up = torch.zeros(b, dtype=torch.bool)
    looked_up[rows] = True
    tokens, lengths = tokens.to(device), lengths.to(device)
    if drafted is None:
        return Draft(tokens=tokens, probs=None, lengths=lengths, lookup_rows=looked_up)
    probs = drafted.probs
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(b, width - probs.shape[1], probs.shape[2])], dim=1)
        probs[rows] = torch.nn.functional.one_hot(tokens[rows], probs.shape[2]).to(probs.dtype)
    return Draft(tokens=tokens, probs=probs, lengths=lengths, confidence=drafted.confidence,
                 confidence_logits=drafted.confidence_logits, lookup_rows=looked_up)


class PromptLookup(Policy):
    name = "pld"

    def __init__(self, k: int = 4, min_ngram: int = 1, max_ngram: int = 3):
        if k < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError("pld needs k >= 1 and 1 <= min_ngram <= max_ngram")
        self.k, self.min_ngram, self.max_ngram = k, min_ngram, max_ngram
        self.max_draft = k

    def params(self) -> dict:
        return {"k": self.k, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram}

    def begin(self, state: BatchState, prompt_features) -> None:
        self.indexes = [LookupIndex(self.min_ngram, self.max_ngram) for _ in range(state.batch_size)]

    def propose(self, state: BatchState) -> Draft:
        b = state.batch_size
        tokens = torch.zeros(b, self.k, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        for r in range(b):
            if not state.active[r]:
                continue
            follow = self.indexes[r].find(state.row(r), self.k)
            tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.long)
            lengths[r] = len(follow)
        device = state.tokens.device
        return Draft(tokens=tokens.to(device), probs=None, lengths=lengths.to(device))
