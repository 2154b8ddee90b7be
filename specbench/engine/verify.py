"""Lossless verification of chain drafts: speculative (rejection) sampling, batched and ragged.

Leviathan et al. 2023 / Chen et al. 2023: accept draft x_k with probability min(1, p_k(x_k) / q_k(x_k));
at the first rejection sample from norm(max(0, p_k − q_k)); if every verified draft is accepted,
sample a bonus token from the target's next distribution. The output is distributed exactly as the
target's. With a one-hot (greedy) target this reduces to "accept while the draft equals the
target's argmax, then emit the target's argmax".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specbench.engine.sampling import sample


@dataclass
class RoundOutcome:
    """What one verify round decided, per row of the batch, on the host.

    The decode core (specbench/engine/core.py) builds one per round, for a chain or a tree, and
    commits from it. Rows that were not active this round carry entries nothing reads.

    accepted_paths: per row, the accepted drafts as indices into `draft_tokens` (a chain: 0..a−1;
        a tree: the node indices along the accepted path, root first).
    next_tokens: per row, the token drawn from the target after the accepted drafts (the
        correction at the first rejection, or the bonus token).
    draft_tokens: per row, the proposal's tokens (chain positions or tree nodes).
    verified: per row, how many drafts the target verified (chain: ℓ; tree: its nodes).
    depths: per row, the deepest draft position verified (chain: ℓ; tree: the longest path).
    features: [b, Q, F] target taps at the verified inputs, committed first: row r's
        [anchor, accepted drafts...] are its first 1 + len(accepted_paths[r]) entries (what
        `Policy.observe` receives), or None when the policy taps no layers.
    """

    accepted_paths: list[list[int]]
    next_tokens: list[int]
    draft_tokens: list[list[int]]
    verified: list[int]
    depths: list[int]
    features: Tensor | None

    def emitted(self, r: int) -> list[int]:
        """Row r's new tokens this round: its accepted drafts, then the target's next token."""
        return [self.draft_tokens[r][i] for i in self.accepted_paths[r]] + [self.next_tokens[r]]


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


def verify_tree(
    target_probs: Tensor,
    node_tokens: Tensor,
    parents: Tensor,
    node_probs: Tensor | None,
    n_nodes: Tensor,
    generator: torch.Generator | None,
) -> tuple[list[list[int]], Tensor]:
    """Verify one draft tree per row by recursive rejection sampling, walking down from the root.

    target_probs: [b, 1+N, V]; index 0 is the anchor (root), index i+1 is node i.
    node_tokens, parents: [b, N]; parents[r, i] is the parent node of node i (−1: the root), with
        parents before children; siblings are tried in node order.
    node_probs: None when siblings are *chosen* (e.g. the draft's top-k): each candidate is then a
        point mass, and after a rejection the target's distribution excludes it and renormalises
        (sequential sampling: the emitted token is distributed exactly as p). Otherwise [b, N, V]:
        the distribution each node was drawn from, i.i.d. among siblings (SpecInfer, Miao et al. 2024:
        accept min(1, p/q), else p ← norm(max(0, p − q))).
    n_nodes: [b] nodes of row r that are part of the tree (a prefix of the node list).
    Returns (accepted path per row as node indices, next_token [b]).
    """
    b = target_probs.shape[0]
    next_dists = torch.empty(b, target_probs.shape[-1], dtype=target_probs.dtype, device=target_probs.device)
    parents_list, tokens_list, limits = parents.tolist(), node_tokens.tolist(), n_nodes.tolist()
    paths = []
    for r in range(b):
        children: dict[int, list[int]] = {}
        for i in range(limits[r]):
            children.setdefault(parents_list[r][i], []).append(i)
        node, path = -1, []
        p = target_probs[r, 0].clone()
        while True:
            chosen = None
            for child in children.get(node, []):
                x = tokens_list[r][child]
                u = float(torch.rand((), generator=generator, device=target_probs.device))
                if node_probs is None:
                    mass = float(p.sum())
                    if u * mass < float(p[x]):
                        chosen = child
                        break
                    p[x] = 0.0
                else:
                    q = node_probs[r, child].to(p.dtype)
                    if u * float(q[x]) < float(p[x]):
                        chosen = child
                        break
                    residual = (p - q).clamp_min(0.0)
                    if float(residual.sum()) > 1e-12:  # else p == q on the support: keep p
                        p = residual
                    p = p / p.sum()
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
            p = target_probs[r, chosen + 1].clone()
        paths.append(path)
        next_dists[r] = p / p.sum()
    return paths, sample(next_dists, generator)


def verify_chain_greedy(target_argmax: list[list[int]], draft_tokens: list[list[int]], verify_lengths: list[int]
                        ) -> tuple[list[int], list[int]]:
    """verify_chain for a greedy target (temperature 0), on host lists: per row the target's argmax ids
    at [anchor, drafts...] (Q of them), the drafts and ℓ. No one-hot [b, Q, V] distributions and no
    noise: with p one-hot at a, u·q(x) < p(x) holds exactly when x = a, and the residual
    norm(max(0, p − q)) is p again, so a row accepts while its draft equals the target's argmax and
    emits the argmax after the last accepted draft (correction or bonus). Same (accepted, next_token)
    as verify_chain, whatever the draft probabilities. Lists, because the core brings the round's ids
    to the host in one transfer anyway, and a handful of comparisons in Python costs less than the
    torch calls that did them on tensors."""
    accepted, next_tokens = [], []
    for ids, drafts, length in zip(target_argmax, draft_tokens, verify_lengths):
        limit, a = min(length, len(ids) - 1, len(drafts)), 0
        while a < limit and drafts[a] == ids[a]:
            a += 1
        accepted.append(a)
        next_tokens.append(ids[a])
    return accepted, next_tokens


def verify_tree_greedy(target_argmax: Tensor, node_tokens: Tensor, parents: Tensor, n_nodes: Tensor
                       ) -> tuple[list[list[int]], Tensor]:
    """verify_tree for a greedy target on its argmax ids [b, 1+N] (index 0: the root): from the
    root, step to the first child (in node order) whose token is the argmax there, as the one-hot
    recursive rejection sampling does with either kind of sibling; the next token is the argmax at
    the last node reached. One device-to-host transfer of the ids for the whole batch."""
    argmax_list, parents_list = target_argmax.tolist(), parents.tolist()
    tokens_list, limits = node_tokens.tolist(), n_nodes.tolist()
    paths, next_tokens = [], []
    for r in range(target_argmax.shape[0]):
        children: dict[int, list[int]] = {}
        for i in range(limits[r]):
            children.setdefault(parents_list[r][i], []).append(i)
        node, path = -1, []
        while True:
            wanted = argmax_list[r][node + 1]
            chosen = next((c for c in children.get(node, []) if tokens_list[r][c] == wanted), None)
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
        paths.append(path)
        next_tokens.append(argmax_list[r][node + 1])
    return paths, torch.tensor(next_tokens, dtype=torch.long, device=target_argmax.device)
