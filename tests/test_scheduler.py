"""DSpark schedulers, including the paper's Appendix A counterexample (docs/dspark.md §4.3)."""
from __future__ import annotations

import torch

from specbench.policies.scheduler import (algorithm1_lengths, capacity_lengths, fixed_lengths, prefix_survival,
                                 sps_from_table, threshold_lengths)
from specbench.engine.verify import verify_chain

APPENDIX_A_SPS = sps_from_table({1: 1.0, 2: 0.5, 3: 0.45})


def appendix_a_first_token_distribution(early_stop: bool, n: int = 200_000, seed: int = 0) -> float:
    """One request, γ = 2, target p = (0.7, 0.3), draft q = (0.5, 0.5), a_1 = 0.8; c_2 = 0.9 if
    x_1 = A else 0. Returns the empirical P(first emitted token = A)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.tensor([0.7, 0.3])
    draft = torch.tensor([0.5, 0.5])
    x1 = torch.multinomial(draft, n, replacement=True, generator=g)
    x2 = torch.multinomial(draft, n, replacement=True, generator=g)
    confidence = torch.stack([torch.full((n,), 0.8), torch.where(x1 == 0, 0.9, 0.0)], dim=1)
    lengths = torch.empty(n, dtype=torch.long)
    # Decide per request (each is its own R = 1 batch); only two distinct confidence rows exist.
    for value in (0, 1):
        rows = x1 == value
        ell = algorithm1_lengths(confidence[rows][:1], torch.tensor([2]), APPENDIX_A_SPS, early_stop=early_stop)
        lengths[rows] = int(ell[0])
    target_probs = target.expand(n, 3, 2).contiguous()  # context-free target: same p at every position
    draft_probs = draft.expand(n, 2, 2).contiguous()
    accepted, next_token = verify_chain(target_probs, torch.stack([x1, x2], 1), draft_probs, lengths, g)
    first = torch.where(accepted > 0, x1, next_token)
    return float((first == 0).float().mean())


def test_appendix_a_global_search_without_early_stop_is_biased():
    p_a = appendix_a_first_token_distribution(early_stop=False)
    assert abs(p_a - 0.85) < 0.005, p_a  # the paper's distorted (0.85, 0.15)


def test_appendix_a_algorithm1_with_early_stop_is_lossless():
    p_a = appendix_a_first_token_distribution(early_stop=True)
    assert abs(p_a - 0.7) < 0.005, p_a  # the target's (0.7, 0.3)


def test_appendix_a_decisions():
    conf_a = torch.tensor([[0.8, 0.9]])
    conf_b = torch.tensor([[0.8, 0.0]])
    two = torch.tensor([2])
    assert algorithm1_lengths(conf_a, two, APPENDIX_A_SPS, early_stop=False).item() == 2  # Θ_2 = 1.134 > 1
    assert algorithm1_lengths(conf_b, two, APPENDIX_A_SPS, early_stop=False).item() == 0
    assert algorithm1_lengths(conf_a, two, APPENDIX_A_SPS).item() == 0  # Θ_1 = 0.9 < Θ_0 = 1: stop


def test_algorithm1_admits_globally_most_confident_prefixes():
    conf = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.5, 0.9, 0.9, 0.9], [0.9, 0.2, 0.9, 0.9]])
    flat = sps_from_table({b: 1.0 for b in range(1, 20)})  # verifying is free: admit everything with a > 0
    assert algorithm1_lengths(conf, torch.tensor([4, 4, 4]), flat).tolist() == [4, 4, 4]
    # Each extra verify token costs 10%: only prefixes whose survival beats the marginal cost stay.
    costly = sps_from_table({b: 1.0 / (1 + 0.1 * (b - 3)) for b in range(3, 20)})
    lengths = algorithm1_lengths(conf, torch.tensor([4, 4, 4]), costly).tolist()
    survival = prefix_survival(conf)
    assert lengths[0] == 4 and lengths[1] < 4 and lengths[2] <= 1
    # prefix-closed and monotone in cost: the admitted survivals all exceed every rejected one
    admitted = [survival[r, j] for r in range(3) for j in range(lengths[r])]
    rejected = [survival[r, j] for r in range(3) for j in range(lengths[r], 4)]
    assert min(admitted) >= max(rejected)


def test_verify_length_falls_with_load():
    """With a cost that grows with total verify tokens, bigger batches get shorter drafts each."""
    torch.manual_seed(0)
    step_ms = lambda total: 10.0 + 0.5 * total  # noqa: E731  (fixed cost + per-token cost)
    sps = lambda total: 1000.0 / step_ms(total)  # noqa: E731
    means = []
    for batch in (1, 4, 16, 64):
        conf = torch.rand(batch, 6) * 0.3 + 0.65
        means.append(algorithm1_lengths(conf, torch.full((batch,), 6), sps).float().mean().item())
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_threshold_fixed_and_capacity():
    conf = torch.tensor([[0.9, 0.3, 0.9], [0.2, 0.9, 0.9], [0.9, 0.9, 0.9]])
    maxl = torch.tensor([3, 3, 2])
    assert threshold_lengths(conf, maxl, 0.5).tolist() == [1, 0, 2]
    assert fixed_lengths(maxl).tolist() == [3, 3, 2]
    assert capacity_lengths(conf, maxl, 3).tolist() == [1, 0, 2]
    assert capacity_lengths(conf, maxl, 0).tolist() == [0, 0, 0]
