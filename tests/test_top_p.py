"""top_p_filter's candidate fast path keeps exactly the tokens a full sort keeps."""
from __future__ import annotations

import torch

from specbench.engine.sampling import top_p_filter


def _full_sort_nucleus(probs, top_p):
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def test_fast_path_and_wide_rows_match_a_full_sort():
    g = torch.Generator().manual_seed(0)
    # rows from peaked (nucleus of a few tokens) to flat (nucleus of thousands: the fallback)
    scales = torch.tensor([12.0, 8.0, 4.0, 1.0, 0.3, 6.0])[:, None]
    probs = torch.softmax(torch.randn(6, 5000, generator=g) * scales, -1)
    for top_p in (0.5, 0.8, 0.95):
        got = top_p_filter(probs, top_p, candidates=16)
        assert torch.equal(got, _full_sort_nucleus(probs, top_p))
        sizes = (got > 0).sum(-1)
        assert sizes.min() <= 16 < sizes.max()  # both paths taken
        assert torch.allclose(got.sum(-1), torch.ones(6))
    # all candidates of the vocabulary: plain sort semantics
    assert torch.equal(top_p_filter(probs[:, :10], 0.8, candidates=64), _full_sort_nucleus(probs[:, :10], 0.8))
