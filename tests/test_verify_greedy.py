"""The greedy fast path (argmax ids, no one-hot distributions) decides exactly what one-hot
rejection sampling decides, for chains and trees, with and without draft distributions."""
from __future__ import annotations

import pytest
import torch

from specbench.engine.sampling import probs_from_logits
from specbench.engine.verify import verify_chain, verify_chain_greedy, verify_tree, verify_tree_greedy

VOCAB = 6  # small, so drafts often match the argmax and every accept length occurs


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_chain_greedy_equals_one_hot_verification(with_draft_probs):
    g = torch.Generator().manual_seed(0)
    lengths_seen = set()
    for trial in range(200):
        b, k = 5, 4
        logits = torch.randn(b, k + 1, VOCAB, generator=g)
        argmax = logits.argmax(-1)
        drafts = torch.where(torch.rand(b, k, generator=g) < 0.7, argmax[:, :k], torch.randint(0, VOCAB, (b, k), generator=g))
        draft_probs = None
        if with_draft_probs:  # a distribution that gave each draft positive mass
            draft_probs = torch.rand(b, k, VOCAB, generator=g) + torch.nn.functional.one_hot(drafts, VOCAB)
            draft_probs /= draft_probs.sum(-1, keepdim=True)
        verify_lengths = torch.randint(0, k + 1, (b,), generator=g)
        q = int(verify_lengths.max()) + 1
        expected = verify_chain(probs_from_logits(logits[:, :q], 0.0), drafts, draft_probs, verify_lengths,
                                torch.Generator().manual_seed(trial))
        got = verify_chain_greedy(argmax[:, :q].tolist(), drafts.tolist(), verify_lengths.tolist())
        assert got == (expected[0].tolist(), expected[1].tolist())
        lengths_seen.update(got[0])
    assert lengths_seen == set(range(k + 1))  # every outcome from "reject the first" to "accept all"


@pytest.mark.parametrize("with_node_probs", [False, True])
def test_tree_greedy_equals_one_hot_verification(with_node_probs):
    g = torch.Generator().manual_seed(1)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 2]])
    depths_seen = set()
    for trial in range(200):
        n = parents.shape[1]
        logits = torch.randn(1, n + 1, VOCAB, generator=g)
        argmax = logits.argmax(-1)
        # node i's token: often the argmax at its parent (input index parent + 1), else random
        at_parent = argmax[0, parents[0] + 1]
        tokens = torch.where(torch.rand(n, generator=g) < 0.6, at_parent, torch.randint(0, VOCAB, (n,), generator=g))[None]
        node_probs = None
        if with_node_probs:
            node_probs = torch.rand(1, n, VOCAB, generator=g) + torch.nn.functional.one_hot(tokens, VOCAB)
            node_probs /= node_probs.sum(-1, keepdim=True)
        n_nodes = torch.randint(1, n + 1, (1,), generator=g)
        expected = verify_tree(probs_from_logits(logits, 0.0), tokens, parents, node_probs, n_nodes,
                               torch.Generator().manual_seed(trial))
        got = verify_tree_greedy(argmax, tokens, parents, n_nodes)
        assert got[0] == expected[0] and torch.equal(got[1], expected[1])
        depths_seen.add(len(got[0][0]))
    assert depths_seen == {0, 1, 2, 3}
