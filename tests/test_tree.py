"""Tree verification in the core: greedy identity and sampled losslessness (χ²), with a broken
tree verifier as the negative control; greedy identity and χ² also in bf16."""
from __future__ import annotations

import pytest
import torch

import specbench.engine.core as core
from specbench.engine.core import SamplingConfig, generate, tree_layout
from specbench.engine.policy import Policy
from helpers import N_TOKENS, SMALL_VOCAB, broken_verify_tree, chi_square, exact_joint, sampled_counts
from tiny import random_prompts, tiny_model
from tree_policy import TreeDraft

VOCAB = 64


def test_tree_layout():
    parents = torch.tensor([[-1, -1, 0, 1, 2]])
    depth, anc = tree_layout(parents, torch.tensor([5]))
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert anc[0, 5].tolist() == [True, True, False, True, False, True]  # root, node0, node2, node4
    depth, anc = tree_layout(parents, torch.tensor([2]))  # nodes 2.. are padding: hang off the root
    assert depth.tolist() == [[0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("batch_size,dtype", [(1, torch.float32), (4, torch.float32), (16, torch.float32),
                                              (4, torch.bfloat16)], ids=["b1-fp32", "b4-fp32", "b16-fp32", "b4-bf16"])
def test_tree_greedy_identity(batch_size, dtype):
    target = tiny_model(vocab=VOCAB, seed=0, scale=4.0, dtype=dtype)
    prompts = random_prompts(16, VOCAB, seed=5)
    config = SamplingConfig(max_new_tokens=24)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    for drafter, name in ((target, "self"), (tiny_model(vocab=VOCAB, seed=2, layers=1, scale=4.0, dtype=dtype), "random")):
        policy = TreeDraft(drafter, branching=(2, 2))
        out = []
        for i in range(0, 16, batch_size):
            out += generate(target, policy, prompts[i : i + batch_size], config).requests
        assert [r.output_ids for r in out] == reference, name
        if name == "self":  # the target's own top-1 child is always accepted down to depth 2
            assert all(r.tau > 2.5 for r in out)


@pytest.fixture(scope="module")
def small():
    return tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0), tiny_model(vocab=SMALL_VOCAB, seed=11, layers=1, scale=2.0)


@pytest.mark.parametrize("sampled,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
                         ids=["topk-children", "iid-children", "iid-children-bf16"])
def test_tree_sampling_matches_target(small, sampled, dtype):
    from helpers import SMALL_VOCAB

    if dtype == torch.float32:
        target, draft = small
    else:
        target = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0, dtype=dtype)
        draft = tiny_model(vocab=SMALL_VOCAB, seed=11, layers=1, scale=2.0, dtype=dtype)
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    counts, result = sampled_counts(target, TreeDraft(draft, branching=(2, 1), sampled=sampled), prompt, 1.0, 1.0)
    assert sum(r.accepted for r in result.requests) > 0
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"tree output distribution differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


def test_chi_square_rejects_broken_tree_verifier(small, monkeypatch):
    target, draft = small
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    monkeypatch.setattr(core, "verify_tree", broken_verify_tree)
    counts, _ = sampled_counts(target, TreeDraft(draft, branching=(2, 1)), prompt, 1.0, 1.0)
    pvalue, _ = chi_square(exact, counts)
    assert pvalue < 1e-6, f"the χ² test missed a tree verifier without exclusion (p={pvalue:.2e})"
