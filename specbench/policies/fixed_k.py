"""Fixed-K draft model (Leviathan et al. 2023; gpt-fast `speculative_decode`): a small LM that
shares the target's tokenizer proposes K tokens autoregressively, sampled from its own processed
distribution (same temperature / top-p as the target), and hands those exact distributions to the
verifier. The drafter keeps its own KV cache, synced per row to the committed sequence."""
from __future__ import annotations

import torch
from torch import Tensor

from specbench.engine.core import forward_new_tokens
from specbench.engine.model import Transformer, round_to_bucket
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.engine.sampling import probs_from_logits, sample


class FixedK(Policy):
    name = "fixed-k"

    def __init__(self, draft_model: Transformer, k: int = 4, drafter: str = "draft"):
        if k < 1:
            raise ValueError("fixed-k needs k >= 1")
        self.draft_model, self.k, self.drafter = draft_model, k, drafter
        self.max_draft = k
        self.synced: Tensor | None = None  # [b] how many committed tokens the drafter's cache holds

    def params(self) -> dict:
        return {"k": self.k}

    def begin(self, state: BatchState, prompt_features) -> None:
        b, cap = state.tokens.shape
        self.draft_model.setup_cache(b, round_to_bucket(cap + self.k + 2))
        self.synced = torch.zeros(b, dtype=torch.long, device=state.tokens.device)

    @torch.inference_mode()
    def propose(self, state: BatchState) -> Draft:
        b, device = state.batch_size, state.tokens.device
        # Catch up: feed each row the committed tokens its draft cache lacks (always ends with the anchor).
        pending = state.lengths - self.synced
        width = int(pending.max())
        idx = (self.synced[:, None] + torch.arange(width, device=device)[None]).clamp(max=state.tokens.shape[1] - 1)
        catch_up = state.tokens.gather(1, idx)
        logits, _, _ = forward_new_tokens(self.draft_model, catch_up, self.synced)
        next_logits = logits[torch.arange(b, device=device), pending - 1]
        self.synced = state.lengths.clone()

        tokens, probs = [], []
        for step in range(self.k):
            p = probs_from_logits(next_logits, state.temperature, state.top_p)
            x = sample(p, state.generator)
            tokens.append(x)
            probs.append(p)
            if step + 1 < self.k:
                logits, _, _ = forward_new_tokens(self.draft_model, x[:, None], state.lengths - 1 + step + 1)
                next_logits = logits[:, 0]
        draft_tokens = torch.stack(tokens, dim=1)
        # At temperature 0 both distributions are one-hot and only the tokens matter.
        draft_probs = torch.stack(probs, dim=1) if state.temperature > 0 else None
        lengths = torch.full((b,), self.k, dtype=torch.long, device=device)
        return Draft(tokens=draft_tokens, probs=draft_probs, lengths=lengths)

    def observe(self, state: BatchState, accepted: Tensor, verify_features) -> None:
        # The draft cache holds committed tokens + x_1..x_{K-1}; x_1..x_a were accepted, so it stays
        # valid through old_length + min(a, K-1). `synced` was set to old_length in propose.
        self.synced = self.synced + accepted.clamp(max=self.k - 1)
