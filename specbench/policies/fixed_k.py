"""Fixed-K draft model (Leviathan et al. 2023; gpt-fast `speculative_decode`): a small LM that
shares the target's tokenizer proposes K tokens autoregressively, sampled from its own processed
distribution (same temperature / top-p as the target), and hands those exact distributions to the
verifier. The drafter keeps its own KV cache, synced per row to the committed sequence.

draft_vocab = n > 0 drafts from the draft LM's n most frequent training tokens only (its stored
`vocab_rank`; EAGLE-3's reduced draft vocabulary; a draft LM without one drafts from all): each draft step projects onto n rows of the
head instead of the whole vocabulary, which for the default target's 49 152 × 576 head is most of
a 2-layer draft LM's step. Still lossless: tokens outside the subset have draft probability 0, and
the verifier gets that exact (zero-padded) distribution.

lookup_ngram = n > 0 (off by default; as DSpark's lookup drafts, policies/dspark.py): a row whose last
n..max(n, 3) tokens occur earlier in its prompt + output drafts the `lookup_k` tokens that followed
(prompt lookup, policies/pld.py) instead of the draft LM's K, and when every active row has one the draft
LM does not run. Such a row's draft cache is not advanced past its committed tokens: the next round's
catch-up feeds it what was accepted. This is the control for `dspark-lookup`: the same lookup in front of
another drafter, so that a comparison of the two measures the drafters, not the lookup."""
from __future__ import annotations

import torch
from torch import Tensor

from specbench.engine.core import forward_new_tokens
from specbench.engine.model import Transformer, linear, pack_weight, round_to_bucket
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.engine.sampling import greedy_ids, probs_from_logits, sample
from specbench.policies.pld import check_lookup_settings, find_lookups, lookup_indexes, lookup_params, with_lookup_drafts


class FixedK(Policy):
    name = "fixed-k"

    def __init__(self, draft_model: Transformer, k: int = 4, drafter: str = "draft", draft_vocab: int = 0,
                 lookup_ngram: int = 0, lookup_k: int = 4):
        if k < 1:
            raise ValueError("fixed-k needs k >= 1")
        check_lookup_settings(lookup_ngram, lookup_k)
        self.draft_model, self.k, self.drafter = draft_model, k, drafter
        self.lookup_ngram, self.lookup_k = lookup_ngram, lookup_k
        self.max_draft = max(k, lookup_k if lookup_ngram else 0)
        self.extended: Tensor | None = None  # [b] bool: rows whose draft cache this round's drafting extended
        self.synced: Tensor | None = None  # [b] how many committed tokens the drafter's cache holds
        vocab_size = draft_model.args.vocab_size
        self.draft_vocab = int(draft_vocab) if 0 < int(draft_vocab) < vocab_size else 0
        self.vocab_ids = self.head = self.head_packs = None
        rank = getattr(draft_model, "vocab_rank", None)
        if rank is None:
            # `truncate:N`, `self` and draft LMs trained before session 16 store no ranking: they draft
            # from the whole vocabulary, and the records' policy_params say draft_vocab 0.
            self.draft_vocab = 0
        if self.draft_vocab:
            device = draft_model.lm_head.weight.device
            self.vocab_ids = rank[: self.draft_vocab].long().sort().values.to(device)
            self.head = draft_model.lm_head.weight[self.vocab_ids].contiguous()
            self.head_packs = pack_weight(self.head)

    def params(self) -> dict:
        return {"k": self.k, "draft_vocab": self.draft_vocab,
                **lookup_params(self.lookup_ngram, self.lookup_k)}

    def _next(self, tokens: Tensor, cache_lengths: Tensor, pick: Tensor | None = None) -> Tensor:
        """The draft LM's logits after `tokens` [b, q] (at `pick` [b] of q, else the last): over the
        whole vocabulary, or over `vocab_ids` without computing the rest of the head."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        pick = torch.full((b,), tokens.shape[1] - 1, device=tokens.device) if pick is None else pick
        if self.head is None:
            logits, _, _ = forward_new_tokens(self.draft_model, tokens, cache_lengths)
            return logits[rows, pick]
        _, _, hidden = forward_new_tokens(self.draft_model, tokens, cache_lengths, logits=False)
        return linear(hidden[rows, pick], self.head, None, self.head_packs)

    def begin(self, state: BatchState, prompt_features) -> None:
        b, cap = state.tokens.shape
        self.draft_model.setup_cache(b, round_to_bucket(cap + self.k + 2))
        self.synced = torch.zeros(b, dtype=torch.long, device=state.tokens.device)
        self.lookup_indexes = lookup_indexes(self.lookup_ngram, b)

    @torch.inference_mode()
    def propose(self, state: BatchState) -> Draft:
        b, device = state.batch_size, state.tokens.device
        lookups = find_lookups(self.lookup_indexes, state, self.lookup_k) if self.lookup_ngram else {}
        if lookups and len(lookups) == int(state.active.sum()):  # every active row has one: no draft LM call
            self.extended = torch.zeros(b, dtype=torch.bool, device=device)
            return with_lookup_drafts(None, lookups, state, self.lookup_k)
        # Catch up: feed each row the committed tokens its draft cache lacks (always ends with the anchor).
        pending = state.lengths - self.synced
        width = int(pending.max())
        idx = (self.synced[:, None] + torch.arange(width, device=device)[None]).clamp(max=state.tokens.shape[1] - 1)
        catch_up = state.tokens.gather(1, idx)
        next_logits = self._next(catch_up, self.synced, pending - 1)
        self.synced = state.lengths.clone()

        tokens, probs = [], []
        vocab_size = self.draft_model.args.vocab_size
        for step in range(self.k):
            if state.temperature > 0:
                p = probs_from_logits(next_logits, state.temperature, state.top_p)
                x = sample(p, state.generator)
                if self.vocab_ids is not None:  # the exact distribution drawn from, over the whole vocabulary
                    p = torch.zeros(b, vocab_size, dtype=p.dtype, device=device).index_copy_(1, self.vocab_ids, p)
                probs.append(p)
            else:  # both distributions one-hot: only the tokens matter
                x = greedy_ids(next_logits)
            if self.vocab_ids is not None:
                x = self.vocab_ids[x]
            tokens.append(x)
            if step + 1 < self.k:
                next_logits = self._next(x[:, None], state.lengths - 1 + step + 1)
        draft_tokens = torch.stack(tokens, dim=1)
        draft_probs = torch.stack(probs, dim=1) if probs else None
        lengths = torch.full((b,), self.k, dtype=torch.long, device=device)
        draft = Draft(tokens=draft_tokens, probs=draft_probs, lengths=lengths)
        self.extended = torch.ones(b, dtype=torch.bool, device=device)
        if not lookups:
            return draft
        self.extended[sorted(lookups)] = False
        return with_lookup_drafts(draft, lookups, state, self.lookup_k)

    def observe(self, state: BatchState, accepted: Tensor, verify_features) -> None:
        # The draft cache holds committed tokens + x_1..x_{K-1}; x_1..x_a were accepted, so it stays
        # valid through old_length + min(a, K-1). `synced` was set to old_length in propose. A row that
        # verified a lookup draft (or a round without drafting) holds none of the accepted tokens.
        self.synced = self.synced + accepted.clamp(max=self.k - 1) * self.extended
