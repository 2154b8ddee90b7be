"""EAGLE: a trained one-layer head drafting from the target's own features (docs/eagle.md), as a
chain (EAGLE-1/3 style, depth K) or as an EAGLE-2 dynamic draft tree, verified in one target pass.

Per row the head keeps its own KV cache over the committed sequence (specbench.drafters.eagle:
entry t = (target taps f_t, token x_{t+1}) at rope position t). `begin` fills it with the prompt's
features; `observe` appends the round's newly committed entries with the *target's* features
(verify_features rows [anchor, accepted...], which the core hands over), so the head never drafts
from its own features across rounds. Drafting starts from the output of the last committed entry.

Chain (mode "chain", K = depth): K sequential head steps, each feeding its own output hidden as
the next step's feature. T = 0: argmax, probs None; T > 0: sampled from the head's processed
distribution (the run's temperature / top-p) and those exact distributions are passed to the
chain verifier (lossless rejection sampling).

Tree (mode "tree", EAGLE-2 `topK_genrate`): level 1 = the top_k tokens after the anchor; then
for each further level, the frontier (the top_k nodes of the previous level by cumulative draft
log-probability, log-softmax of the raw head logits along the path) is run through the head in
one pass — each frontier node attends to the committed context and its own ancestors (a tree mask
over scratch cache slots) at rope position ctx + depth − 1 — and each gets its top_k children.
Reranking keeps the total_tokens generated nodes with the highest cumulative score (a stable
sort in generation order: a child never outranks its parent, since log-probs are ≤ 0, so the set
is ancestor-closed), listed in generation order (parents before children; siblings best first).
Siblings are chosen, not sampled: `probs=None`, which the core's tree verifier makes lossless at
any temperature by sequential exclusion. Depth = the number of draft levels (the longest path);
EAGLE's scripts' `depth 5` means 6 levels and their `total_token 60` counts the root (59 nodes).
Generated nodes per round: top_k + (depth − 1)·top_k².

draft_vocab = n > 0 drafts from the head's n most frequent training tokens only (EAGLE-3's reduced
draft vocabulary, as rows of the target's lm_head): the per-level vocabulary projection, which
dominates the head's cost for a 49k vocabulary on a CPU, shrinks by V/n. draft_vocab = -1 (the
default) takes the vocabulary the head was trained on (`EagleArgs.trained_vocab`; 0 = all). Still lossless: trees
need no draft probabilities, and chain drafts at T > 0 pass the exact (zero-padded) distribution.

lookup_ngram = n > 0 (chain mode only; off by default; as DSpark's lookup drafts, policies/dspark.py): a
row whose last n..max(n, 3) tokens occur earlier in its prompt + output drafts the `lookup_k` tokens that
followed (prompt lookup, policies/pld.py) instead of the head's chain, and when every active row has one
the head does not run. The head's context needs nothing more: `observe` appends the committed tokens'
target features whichever draft they were accepted from.

Everything is batched over rows with per-row context lengths; no per-row Python in propose (bar the lookup).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specbench.drafters.eagle import EagleHead
from specbench.engine.model import round_to_bucket
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.engine.sampling import greedy_ids, probs_from_logits, sample
from specbench.policies.pld import check_lookup_settings, find_lookups, lookup_indexes, lookup_params, with_lookup_drafts

MODES = ("tree", "chain")


class Eagle(Policy):
    name = "eagle"

    def __init__(self, head: EagleHead, mode: str = "tree", depth: int = 5, top_k: int = 10,
                 total_tokens: int = 60, draft_vocab: int = -1, drafter: str = "eagle", lookup_ngram: int = 0,
                 lookup_k: int = 4):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError("depth, top_k and total_tokens must be >= 1")
        check_lookup_settings(lookup_ngram, lookup_k)
        if lookup_ngram and mode != "chain":
            raise ValueError("lookup drafts (lookup_ngram) are for the chain mode only")
        self.lookup_ngram, self.lookup_k = int(lookup_ngram), int(lookup_k)
        self.head, self.mode, self.depth, self.drafter = head, mode, int(depth), drafter
        if int(draft_vocab) < 0:  # the head's own training vocabulary
            draft_vocab = head.args.trained_vocab
        self.vocab = head.draft_vocab(int(draft_vocab))  # None: the whole vocabulary
        self.draft_vocab = 0 if self.vocab is None else len(self.vocab[0])
        self.top_k = min(int(top_k), self.draft_vocab or head.args.model_args.vocab_size)
        generated = self.top_k + (self.depth - 1) * self.top_k ** 2
        self.total_tokens = min(int(total_tokens), generated)
        self.max_draft = self.total_tokens if mode == "tree" else max(self.depth, self.lookup_k if lookup_ngram else 0)
        self.target_taps = head.tap_layers
        # Scratch slots after a row's context: the nodes run through the head this round.
        self.scratch = (self.depth - 1) * (self.top_k if mode == "tree" else 1)

    def params(self) -> dict:
        if self.mode == "chain":
            return {"mode": "chain", "depth": self.depth, "draft_vocab": self.draft_vocab,
                    **lookup_params(self.lookup_ngram, self.lookup_k)}
        return {"mode": "tree", "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens,
                "draft_vocab": self.draft_vocab}

    # ------------------------------------------------------------------------------------------
    def begin(self, state: BatchState, prompt_features: Tensor | None) -> None:
        b, cap = state.tokens.shape
        room = cap + max(self.scratch, self.max_draft + 1) + 1  # + the sink slot
        self.head.setup_cache(b, round_to_bucket(room))
        p = prompt_features.shape[1]
        # Entry t = (f_t, x_{t+1}) for t < prompt length: the last one carries the first sampled token.
        self.head.append_context(prompt_features, state.tokens[:, 1 : p + 1], state.prompt_lengths)
        self.lookup_indexes = lookup_indexes(self.lookup_ngram, b)

    def observe(self, state: BatchState, accepted: Tensor, verify_features: Tensor | None) -> None:
        # The anchor and the accepted drafts are committed: entries t = old ctx .. new length − 2.
        head = self.head
        b, q = state.batch_size, verify_features.shape[1]
        counts = torch.where(state.active, accepted + 1, 0).clamp(max=q)
        idx = (head.ctx_len[:b, None] + 1 + torch.arange(q, device=state.tokens.device)[None])
        tokens = state.tokens.gather(1, idx.clamp(max=state.tokens.shape[1] - 1))
        head.append_context(verify_features, tokens, counts)

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: BatchState) -> Draft:
        if self.mode == "tree":
            return self._tree(state)
        if not self.lookup_ngram:
            return self._chain(state)
        lookups = find_lookups(self.lookup_indexes, state, self.lookup_k)
        if lookups and len(lookups) == int(state.active.sum()):  # every active row has one: no head call
            return with_lookup_drafts(None, lookups, state, self.lookup_k)
        draft = self._chain(state)
        return with_lookup_drafts(draft, lookups, state, self.lookup_k) if lookups else draft

    def _chain(self, state: BatchState) -> Draft:
        head, b = self.head, state.batch_size
        device = state.tokens.device
        ctx = head.ctx_len[:b]
        hidden = head.h_last[:b]
        kv_len = head.kv_len(int(ctx.max()) + self.scratch)
        keys = torch.arange(kv_len, device=device)[None, None]
        tokens, probs = [], []
        vocab = head.args.model_args.vocab_size
        for step in range(self.depth):
            logits, ids = head.draft_logits(hidden, self.vocab)
            if state.temperature > 0:
                p = probs_from_logits(logits, state.temperature, state.top_p)
                x = sample(p, state.generator)
                if ids is not None:  # the exact distribution drawn from, over the whole vocabulary
                    p = torch.zeros(b, vocab, device=device).index_copy_(1, ids, p)
                probs.append(p)
            else:
                x = greedy_ids(logits)
            if ids is not None:
                x = ids[x]
            tokens.append(x)
            if step + 1 < self.depth:  # node `step` sits at slot / position ctx + step, sees context + the chain so far
                pos = (ctx + step)[:, None]
                hidden = head.step(hidden[:, None], x[:, None], pos, pos, keys <= pos[..., None])[:, 0]
        return Draft(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1) if probs else None,
                     lengths=torch.full((b,), self.depth, dtype=torch.long, device=device))

    def _tree(self, state: BatchState) -> Draft:
        head, b, k = self.head, state.batch_size, self.top_k
        device = state.tokens.device
        ctx = head.ctx_len[:b]
        rows = torch.arange(b, device=device)[:, None]
        kv_len = head.kv_len(int(ctx.max()) + self.scratch)
        offset = torch.arange(kv_len, device=device)[None, None] - ctx[:, None, None]  # key slot − ctx: [b, 1, kv]

        # Level 1: the anchor's top_k children.
        logits, ids = head.draft_logits(head.h_last[:b], self.vocab)
        scores, tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [b, k]
        if ids is not None:
            tokens = ids[tokens]
        all_scores, all_tokens = [scores], [tokens]
        all_parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]
        f_hidden = head.h_last[:b, None].expand(b, k, -1)  # each frontier node's hidden input (its parent's output)
        f_tokens, f_scores = tokens, scores
        f_ids = torch.arange(k, device=device).expand(b, k)  # generation ids
        f_anc = torch.zeros(b, k, max(self.scratch, 1), dtype=torch.bool, device=device)  # ancestor scratch slots
        n_gen = k
        for level in range(1, self.depth):
            slot = (level - 1) * k + torch.arange(k, device=device)  # this frontier's scratch slots
            f_anc = f_anc.clone()
            f_anc[:, torch.arange(k, device=device), slot] = True
            in_tree = f_anc.gather(2, offset.clamp(0, self.scratch - 1).expand(b, k, kv_len))
            mask = (offset < 0) | ((offset < self.scratch) & in_tree)
            pos = (ctx + level - 1)[:, None].expand(b, k)  # depth `level` → position ctx + level − 1
            out = head.step(f_hidden, f_tokens, pos, ctx[:, None] + slot, mask)  # [b, k, d]
            logits, ids = head.draft_logits(out, self.vocab)
            child_lp, child_tok = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [b, k, k]
            if ids is not None:
                child_tok = ids[child_tok]
            cum = (f_scores[..., None] + child_lp).reshape(b, k * k)
            child_tok = child_tok.reshape(b, k * k)
            all_scores.append(cum)
            all_tokens.append(child_tok)
            all_parents.append(f_ids.repeat_interleave(k, dim=1))
            if level + 1 < self.depth:  # the next frontier: the best top_k children of this level
                sel = cum.topk(k, dim=-1).indices  # [b, k]
                parent = sel // k
                f_hidden = out[rows, parent]
                f_tokens, f_scores = child_tok.gather(1, sel), cum.gather(1, sel)
                f_anc = f_anc[rows, parent]
                f_ids = n_gen + sel
            n_gen += k * k

        # Rerank: the total_tokens best nodes (stable: parents, generated first, win ties), then
        # back to generation order, which is topological.
        scores = torch.cat(all_scores, dim=1)  # [b, G]
        order = scores.sort(dim=1, descending=True, stable=True).indices[:, : self.total_tokens]
        keep = order.sort(dim=1).values  # [b, N] generation ids, ascending
        tokens = torch.cat(all_tokens, dim=1).gather(1, keep)
        parent_gen = torch.cat(all_parents, dim=1).gather(1, keep)
        new_index = torch.full((b, n_gen + 1), -1, dtype=torch.long, device=device)  # gen id + 1 → node index
        new_index[rows, keep + 1] = torch.arange(keep.shape[1], device=device).expand_as(keep)
        parents = new_index.gather(1, parent_gen + 1)  # −1 (root) stays −1
        n = keep.shape[1]
        return Draft(tokens=tokens, probs=None, lengths=torch.full((b,), n, dtype=torch.long, device=device),
                     parents=parents)

