"""Lossless verification of chain drafts: speculative (rejection) sampling, batched and ragged.

Leviathan et al. 2023 / Chen et al. 2023: accept draft x_k with probability min(1, p_k(x_k) / q_k(x_k));
at the first rejection sample from norm(max(0, p_k − q_k)); if every verified draft is accepted,
sample a bonus token from the target's next distribution. The output is distributed exactly as the
target's. With a one-hot (greedy) target this reduces to "accept while the draft equals the
target's argmax, then emit the target's argmax".
"""
from __future__ import annotations

import torch
from torch import Tensor

from specbench.sampling import sample


def verify_chain(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    verify_lengths: Tensor,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Verify one chain of drafts per row.

    target_probs: [b, Q, V] target distributions at the verified inputs [anchor, x_1, ..., x_{Q-1}]:
        target_probs[:, k] is the distribution of the token after input k.
    draft_tokens: [b, K] drafts x_1..x_K (K may exceed what a row verifies).
    draft_probs: [b, K, V] the exact distributions the drafts were sampled from, or None when the
        drafter is deterministic (a one-hot distribution on each draft token, e.g. prompt lookup).
    verify_lengths: [b] ℓ_r ≤ min(K, Q−1), how many drafts row r verifies.
    Returns (accepted [b]: number of accepted drafts, next_token [b]: the correction or bonus token).
    """
    b, q, vocab = target_probs.shape
    k_max = min(draft_tokens.shape[1], q - 1)
    rows = torch.arange(b, device=target_probs.device)
    if k_max == 0:
        return torch.zeros(b, dtype=torch.long, device=rows.device), sample(target_probs[:, 0], generator)

    drafts = draft_tokens[:, :k_max]
    p_of_draft = target_probs[:, :k_max].gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs[:, :k_max].gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(b, k_max, generator=generator, device=rows.device)
    # u < p/q without dividing by q (q > 0 for any token actually drawn from q).
    accept = u * q_of_draft < p_of_draft
    accept &= torch.arange(k_max, device=rows.device)[None] < verify_lengths[:, None]
    accepted = accept.long().cumprod(dim=1).sum(dim=1)

    p_next = target_probs[rows, accepted]  # [b, V]
    rejected = accepted < verify_lengths
    # Residual at the first rejection; where a row accepted everything it keeps p_next (bonus).
    position = accepted.clamp(max=k_max - 1)
    if draft_probs is None:
        q_next = torch.nn.functional.one_hot(drafts[rows, position], vocab).float()
    else:
        q_next = draft_probs[rows, position].float()
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A residual with no mass only arises when p == q on the support; then p itself is the answer.
    residual = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-30), p_next)
    next_dist = torch.where(rejected[:, None], residual, p_next)
    return accepted, sample(next_dist, generator)
