"""The core's CUDA-graph path, exercised on the CPU: a stand-in with GraphedForward's interface
(specbench/engine/cuda_graphs.py) that runs the model directly receives exactly the forwards a graph
would replay (static full-cache masks, decode and verify widths up to max_q; prefill stays
eager), and decoding through it stays token-identical to plain AR."""
from __future__ import annotations

import pytest
import torch

from specbench.engine.core import SamplingConfig, generate
from specbench.engine.cuda_graphs import enable_cuda_graphs, uses_cuda_graphs
from specbench.policies.fixed_k import FixedK
from specbench.policies.pld import PromptLookup
from specbench.engine.policy import Policy
from tiny import random_prompts, tiny_model
from tree_policy import TreeDraft

VOCAB = 64


class EagerStandIn:
    """GraphedForward's call signature and bucketing, without capture: records each call's shapes."""

    def __init__(self, model, max_q: int):
        self.model, self.max_q, self.calls = model, max_q, []

    def __call__(self, tokens, positions, slots, mask, taps=(), logits=True):
        self.calls.append((tuple(tokens.shape), mask.shape[-1] == self.model.max_seq))
        return self.model(tokens, positions, slots, mask, taps=taps, logits=logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_path_is_lossless_and_buckets_like_graphs(dtype):
    target = tiny_model(vocab=VOCAB, seed=0, scale=4.0, dtype=dtype)
    prompts = [p * 3 for p in random_prompts(4, VOCAB, seed=4, max_len=5)] + random_prompts(4, VOCAB, seed=3)
    config = SamplingConfig(max_new_tokens=24)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    stand_in = EagerStandIn(target, max_q=8)
    target.graphed = stand_in
    try:
        assert uses_cuda_graphs(target)
        policies = [Policy(), PromptLookup(k=4, max_ngram=3), FixedK(target, k=3),
                    TreeDraft(tiny_model(vocab=VOCAB, seed=2, layers=1, scale=4.0, dtype=dtype), branching=(2, 2))]
        for policy in policies:
            out = generate(target, policy, prompts, config).requests
            assert [r.output_ids for r in out] == reference, policy.name
    finally:
        target.graphed = None
    assert stand_in.calls
    assert all(q <= 8 and whole_cache for (_, q), whole_cache in stand_in.calls)  # static shapes only
    longest_prompt = max(len(p) for p in prompts)
    assert longest_prompt > 8 and all(q != longest_prompt for (_, q), _ in stand_in.calls)  # prefill stayed eager


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        enable_cuda_graphs(tiny_model())
    assert not uses_cuda_graphs(tiny_model()) and not uses_cuda_graphs(None)
