"""How many drafted tokens each request verifies: DSpark's load-aware schedulers.

All take per-request *conditional* acceptance confidences c[r, k] (k = 1..γ, calibrated;
docs/dspark.md §2.4) and return verify lengths ℓ_r ∈ {0..γ}. Losslessness needs the decision to verify draft
x_{r,k} not to depend on the value of x_{r,k} itself (docs/dspark.md §4.3). c[r, k] is computed from
x_{r,<k} only, so a rule that admits position k by looking at c[r, ≤k] (and at other requests)
is safe; looking at c[r, k+1] — which depends on x_{r,k} — is not, and the Appendix A
counterexample (tests/test_scheduler.py) shows the bias that follows.

Variants (docs/dspark.md §4.5):
  fixed_lengths        ℓ = γ for every request
  threshold_lengths    the public repo's rule: stop at the first c_k < threshold
  algorithm1_lengths   DSpark Algorithm 1: global greedy admission by prefix survival
                       a[r, j] = Π_{i≤j} c[r, i], maximising Θ = E[tokens] · SPS(B), with the
                       early stop (early_stop=False reproduces the biased global search);
                       algorithm1_admit is the same search on host lists, with its E[tokens]
  capacity_lengths     production variant: admit the K most confident prefixes (K from stale
                       confidences), no early stop
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def prefix_survival(confidence: Tensor) -> Tensor:
    """a[r, j] = Π_{i ≤ j} c[r, i]: the probability that drafts 1..j of request r are all accepted."""
    return confidence.clamp(0.0, 1.0).cumprod(dim=-1)


def fixed_lengths(max_lengths: Tensor) -> Tensor:
    return max_lengths.clone()


def threshold_lengths(confidence: Tensor, max_lengths: Tensor, threshold: float) -> Tensor:
    """Verify the drafts before the first one whose per-step confidence is below `threshold`."""
    below = (confidence < threshold) | (torch.arange(confidence.shape[1], device=confidence.device)[None] >= max_lengths[:, None])
    return (~below).long().cumprod(dim=1).sum(dim=1)


def _admission_order(survival: list[list[float]], limits: list[int]) -> tuple[list[int], list[int], list[float]]:
    """Candidates (r, j) sorted by a[r, j] descending; ties go to the shallower position first so the
    admitted set stays prefix-closed and never looks at a deeper position first."""
    items = []
    for r, (a, limit) in enumerate(zip(survival, limits)):
        for j in range(min(len(a), limit)):
            if a[j] > 0:
                items.append((-a[j], j, r))
    items.sort()
    return [r for _, _, r in items], [j + 1 for _, j, _ in items], [-neg for neg, _, _ in items]


def algorithm1_admit(
    survival: list[list[float]], limits: list[int], sps: Callable[[int], float], early_stop: bool = True,
    padded: bool = False,
) -> tuple[list[int], float]:
    """Algorithm 1 on host lists: survival a[r][j] (prefix_survival(...).tolist()) and each row's
    longest allowed ℓ. Returns (ℓ per row, E[tokens] at that ℓ: one per row for its anchor plus the
    survival of every admitted draft), so a caller that also needs the expectation (the draft gate)
    does not compute it again. Plain Python: a round's search is a few dozen candidates, where each
    torch call on a cold cache costs more than the whole loop."""
    n_rows = len(survival)
    order_r, order_j, order_a = _admission_order(survival, limits)
    current = [0] * n_rows
    best_lengths = list(current)
    verify_tokens, expected_tokens, longest = n_rows, float(n_rows), 0
    best_expected = expected_tokens
    best = expected_tokens * sps(verify_tokens)
    for r, j, a in zip(order_r, order_j, order_a):
        current[r] = j
        verify_tokens += 1
        longest = max(longest, j)
        expected_tokens += a
        theta = expected_tokens * sps(n_rows * (1 + longest) if padded else verify_tokens)
        if theta > best:
            best, best_lengths, best_expected = theta, list(current), expected_tokens
        elif early_stop:
            break  # required for losslessness: never look past the first non-improvement
    return best_lengths, best_expected


def algorithm1_lengths(
    confidence: Tensor, max_lengths: Tensor, sps: Callable[[int], float], early_stop: bool = True,
    padded: bool = False,
) -> Tensor:
    """DSpark Algorithm 1 (docs/dspark.md §4.2). B counts every request's anchor; Θ(B) = τ(B)·SPS(B).

    padded: the engine verifies a right-padded [R, 1 + max ℓ] batch (specbench's core does), so
    the forward it pays for carries B = R·(1 + max_r ℓ_r) tokens rather than the packed Σ(1 + ℓ_r)."""
    lengths, _ = algorithm1_admit(prefix_survival(confidence.float()).tolist(), max_lengths.tolist(), sps,
                                  early_stop=early_stop, padded=padded)
    return torch.tensor(lengths, dtype=torch.long, device=confidence.device)


def capacity_lengths(confidence: Tensor, max_lengths: Tensor, capacity: int) -> Tensor:
    """Admit the `capacity` most confident draft positions across the batch (prefix-closed)."""
    n_rows = confidence.shape[0]
    order_r, order_j, _ = _admission_order(prefix_survival(confidence.float()).tolist(), max_lengths.tolist())
    lengths = [0] * n_rows
    for r, j in list(zip(order_r, order_j))[: max(capacity, 0)]:
        lengths[r] = max(lengths[r], j)
    return torch.tensor(lengths, dtype=torch.long, device=confidence.device)


def best_capacity(confidence: Tensor, max_lengths: Tensor, sps: Callable[[int], float], padded: bool = False) -> int:
    """The production variant's capacity K: the global argmax of Θ over the greedy path (no early
    stop), computed from confidences of an *earlier* step so it cannot depend on current drafts."""
    lengths = algorithm1_lengths(confidence, max_lengths, sps, early_stop=False, padded=padded)
    return int(lengths.sum())


def sps_from_table(table: dict[int, float]) -> Callable[[int], float]:
    """SPS(B) lookup; beyond the table, time grows linearly with B from the last two entries."""
    keys = sorted(table)

    def sps(verify_tokens: int) -> float:
        if verify_tokens in table:
            return table[verify_tokens]
        if verify_tokens < keys[0]:
            return table[keys[0]]
        b1, b2 = keys[-2], keys[-1]
        t1, t2 = 1 / table[b1], 1 / table[b2]
        return 1 / (t2 + (t2 - t1) / (b2 - b1) * (verify_tokens - b2))

    return sps
