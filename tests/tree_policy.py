"""A test-only tree drafter: expands each node with a draft LM's top-k (or sampled) children,
level by level, recomputing the draft from scratch on each prefix (tiny models only)."""
from __future__ import annotations

import torch

from specbench.engine.core import forward_new_tokens
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.engine.sampling import probs_from_logits, sample


class TreeDraft(Policy):
    name = "test-tree"

    def __init__(self, draft_model, branching=(2, 2), sampled=False):
        self.draft_model, self.branching, self.sampled = draft_model, branching, sampled
        self.max_draft = sum(int(torch.tensor(branching[: i + 1]).prod()) for i in range(len(branching)))

    def _next_probs(self, state: BatchState, suffixes: torch.Tensor) -> torch.Tensor:
        """Draft distribution after each row's committed tokens + `suffixes` [b, s]."""
        b = state.batch_size
        width = int(state.lengths.max()) + suffixes.shape[1]
        seq = torch.zeros(b, width, dtype=torch.long)
        for r in range(b):
            row = state.row(r) + suffixes[r].tolist()
            seq[r, : len(row)] = torch.tensor(row)
        self.draft_model.setup_cache(b, width + 64)
        logits, _, _ = forward_new_tokens(self.draft_model, seq, torch.zeros(b, dtype=torch.long))
        last = logits[torch.arange(b), state.lengths + suffixes.shape[1] - 1]
        return probs_from_logits(last, max(state.temperature, 0.0), state.top_p if state.temperature > 0 else 1.0)

    @torch.inference_mode()
    def propose(self, state: BatchState) -> Draft:
        b = state.batch_size
        tokens, parents, probs = [], [], []
        frontier = [(-1, torch.zeros(b, 0, dtype=torch.long))]  # (node index, path tokens)
        for k in self.branching:
            next_frontier = []
            for node, path in frontier:
                p = self._next_probs(state, path)
                if self.sampled:  # i.i.d. children from q (SpecInfer)
                    children = torch.stack([sample(p, state.generator) for _ in range(k)], dim=1)
                else:  # deterministic top-k children
                    children = p.topk(k, dim=-1).indices
                for c in range(k):
                    tokens.append(children[:, c])
                    parents.append(torch.full((b,), node, dtype=torch.long))
                    probs.append(p)
                    next_frontier.append((len(tokens) - 1, torch.cat([path, children[:, c : c + 1]], dim=1)))
            frontier = next_frontier
        n = len(tokens)
        return Draft(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1) if self.sampled else None,
                     lengths=torch.full((b,), n, dtype=torch.long), parents=torch.stack(parents, 1))
