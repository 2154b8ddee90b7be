"""specbench.drafters.dspark: the DSpark / DFlash drafter (docs/dspark.md §2) on tiny models.

Training-time block forward = inference path; attention visibility; exact sampling distributions;
the confidence head never sees the token it scores; Markov rank 0 is DFlash."""
from __future__ import annotations

import pytest
import torch

from specbench.drafters.dspark import DSparkArgs, DSparkDrafter, build_drafter
from specbench.engine.model import RMSNorm
from specbench.engine.sampling import make_generator, probs_from_logits
from tiny import tiny_model

TAPS = [0, 1, 2]


def make_drafter(target, block_size=4, rank=8, variant="dspark", layers=2, std=0.2, seed=0) -> DSparkDrafter:
    """A drafter with weights large enough that attention, the Markov bias and the confidence head
    all matter (the HF init's 0.02 makes everything near-uniform)."""
    args = DSparkArgs.for_target(target.args, tap_layers=TAPS, variant=variant, n_layers=layers,
                                 block_size=block_size, markov_rank=rank)
    drafter = build_drafter(args, target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in drafter.modules():
            for p in m.parameters(recurse=False):
                if isinstance(m, RMSNorm):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(std * torch.randn(p.shape, generator=g))
    return drafter.eval()


def sequence(target, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.args.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, len(TAPS) * target.args.dim, generator=g)
    return ids, feats


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_forward_matches_inference_path(qk_norm):
    target = tiny_model(vocab=64, dim=32, layers=3, qk_norm=qk_norm)
    drafter = make_drafter(target)
    ids, feats = sequence(target)
    anchor_list = [5, 9, 13, 20]
    anchors = torch.tensor([anchor_list])
    h_train = drafter.forward_blocks(feats, ids, anchors)[0]  # [N, γ, d], all blocks in one pass
    # One block per batch row: same result as all blocks of one sequence together.
    h_rows = drafter.forward_blocks(feats.expand(4, -1, -1), ids.expand(4, -1), anchors.T)[:, 0]
    torch.testing.assert_close(h_rows, h_train, rtol=1e-5, atol=1e-5)

    # Inference: each row's context is the sequence up to its anchor, appended in two ragged chunks.
    b = len(anchor_list)
    drafter.setup_cache(b, 40)
    first = torch.tensor([3, 0, 6, 11])
    second = torch.tensor(anchor_list) - first
    drafter.append_context(feats.expand(b, -1, -1)[:, : int(first.max())], first)
    chunk = torch.stack([feats[0, f: f + int(second.max())] for f in first.tolist()])
    drafter.append_context(chunk, second)
    assert drafter.ctx_len.tolist() == anchor_list
    anchor_tokens = ids[0, anchors[0]]
    tokens, probs, conf, logits = drafter.draft_block(anchor_tokens, anchors[0], temperature=0.0, return_logits=True)
    assert tokens.shape == (b, 4) and probs.shape == (b, 4, 64) and conf.shape == (b, 4)

    # The training path, teacher-forced on the prefixes the greedy draft realised, gives the same
    # bias-corrected logits and confidences; the greedy tokens are their argmaxes.
    prev = torch.cat([anchor_tokens[:, None], tokens[:, :-1]], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(drafter.block_logits(h_train, prev), logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(drafter.confidence_logits(h_train, prev), conf, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 64).float())


def test_attention_visibility():
    target = tiny_model(vocab=64, dim=32, layers=3)
    drafter = make_drafter(target)
    ids, feats = sequence(target)
    anchors = torch.tensor([[6, 12, 18]])
    with torch.no_grad():
        base = drafter.forward_blocks(feats, ids, anchors)[0]
        for j in (5, 6, 11, 12, 17, 18, 23):
            f2 = feats.clone()
            f2[0, j] += 3.0
            out = drafter.forward_blocks(f2, ids, anchors)[0]
            for n, p in enumerate(anchors[0].tolist()):
                changed = not torch.allclose(out[n], base[n], rtol=0, atol=1e-6)
                # context is visible strictly before the anchor: never the anchor's own features
                assert changed == (j < p), (j, p)
        # A block depends on its own anchor token, not on other blocks' tokens or on later tokens.
        ids2 = ids.clone()
        ids2[0, 12] = (ids2[0, 12] + 1) % 64
        ids2[0, 13] = (ids2[0, 13] + 1) % 64
        out = drafter.forward_blocks(feats, ids2, anchors)[0]
        assert torch.allclose(out[0], base[0]) and torch.allclose(out[2], base[2])
        assert not torch.allclose(out[1], base[1])


def test_sampled_probs_are_the_sampling_distributions():
    """Empirical check on a tiny vocabulary: x_1 ~ probs[:, 0], and x_2 given x_1 ~ probs[:, 1]
    (which depends on x_1 through the Markov bias); and probs are exactly the processed
    distributions of U_k + W1[x_{k−1}]·W2."""
    V = 8
    target = tiny_model(vocab=V, dim=16, layers=3, scale=2.0)
    drafter = make_drafter(target, block_size=3, rank=4, std=0.5)
    with torch.no_grad():
        drafter.markov_w2.weight.mul_(3.0)  # a strong prefix dependence
    ids, feats = sequence(target, T=10)
    b = 6000
    drafter.setup_cache(b, 16)
    drafter.append_context(feats[:, :7].expand(b, -1, -1))
    anchor = ids[0, 7].expand(b)
    for temperature, top_p in ((1.0, 1.0), (0.8, 0.7)):
        tokens, probs, conf, logits = drafter.draft_block(anchor, None, temperature, top_p, make_generator(0, "cpu"),
                                                          return_logits=True)
        torch.testing.assert_close(probs, probs_from_logits(logits, temperature, top_p))
        h = drafter.block_hidden(anchor[:1])
        prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
        with torch.no_grad():
            torch.testing.assert_close(logits, drafter.block_logits(h.expand(b, -1, -1), prev), rtol=1e-5, atol=1e-5)
        p1 = probs[0, 0]
        assert torch.allclose(probs[:, 0], p1.expand(b, V))
        freq1 = torch.bincount(tokens[:, 0], minlength=V).float() / b
        assert (freq1 - p1).abs().max() < 0.025
        assert not bool(((probs[:, 0] == 0) & (torch.nn.functional.one_hot(tokens[:, 0], V) == 1)).any())
        seen_dependence = False
        for x1 in range(V):
            rows = tokens[:, 0] == x1
            n = int(rows.sum())
            if n < 400:
                continue
            p2 = probs[rows, 1]
            assert torch.allclose(p2, p2[0].expand_as(p2))  # a function of the realised prefix
            freq2 = torch.bincount(tokens[rows, 1], minlength=V).float() / n
            assert (freq2 - p2[0]).abs().max() < 4 / n ** 0.5
            seen_dependence |= not torch.allclose(p2[0], p1, atol=1e-3)
        assert seen_dependence


def test_confidence_never_sees_the_token_it_scores():
    target = tiny_model(vocab=64, dim=32, layers=3)
    drafter = make_drafter(target, block_size=5)
    ids, feats = sequence(target)
    p = 9
    anchors = torch.tensor([[p]])
    with torch.no_grad():
        h = drafter.forward_blocks(feats, ids, anchors)[0, 0]
        prev = ids[0, p: p + 5]  # teacher-forced [x_0, x_1..x_4]
        z = drafter.confidence_logits(h, prev)
        for k in range(1, 5):  # change draft token x_k
            ids2 = ids.clone()
            ids2[0, p + k] = (ids2[0, p + k] + 7) % 64
            h2 = drafter.forward_blocks(feats, ids2, anchors)[0, 0]
            assert torch.equal(h2, h)  # the parallel backbone only sees [anchor, MASK...]
            z2 = drafter.confidence_logits(h2, ids2[0, p: p + 5])
            # c_1..c_k (slots 0..k−1) are unchanged; c_{k+1} (slot k) may change, and does here.
            assert torch.equal(z2[:k], z[:k])
            assert not torch.allclose(z2[k], z[k])


def test_markov_rank_zero_is_dflash():
    target = tiny_model(vocab=64, dim=32, layers=3)
    dspark = make_drafter(target, rank=8)
    dflash_args = DSparkArgs.for_target(target.args, tap_layers=TAPS, variant="dflash", n_layers=2, block_size=4)
    assert dflash_args.markov_rank == 0 and not dflash_args.confidence_head and dflash_args.kind == "dflash"
    dflash = build_drafter(dflash_args, target)
    names = set(dflash.state_dict())
    assert not any("markov" in n or "confidence" in n for n in names)
    assert names < set(dspark.state_dict())
    dflash.load_state_dict({k: v for k, v in dspark.state_dict().items() if k in names})
    with torch.no_grad():
        dspark.markov_w2.weight.zero_()  # a zero Markov bias: DSpark's logits are DFlash's
    ids, feats = sequence(target)
    anchors = torch.tensor([[4, 10]])
    prev = ids[0, 4:8]
    with torch.no_grad():
        h1 = dspark.forward_blocks(feats, ids, anchors)
        h0 = dflash.forward_blocks(feats, ids, anchors)
        torch.testing.assert_close(h1, h0)
        torch.testing.assert_close(dspark.block_logits(h1[0, 0], prev), dflash.block_logits(h0[0, 0], prev))
    for d in (dspark, dflash):
        d.setup_cache(1, 16)
        d.append_context(feats[:, :10])
    t1, p1, c1 = dspark.draft_block(ids[0, 10:11], None, 1.0, 1.0, make_generator(3, "cpu"))
    t0, p0, c0 = dflash.draft_block(ids[0, 10:11], None, 1.0, 1.0, make_generator(3, "cpu"))
    assert torch.equal(t1, t0) and torch.allclose(p1, p0) and c0 is None and c1 is not None


def test_frozen_target_tensors_are_shared_not_owned():
    target = tiny_model(vocab=64, dim=32, layers=3)
    drafter = make_drafter(target)
    state = drafter.state_dict()
    assert drafter.embed_weight is target.model.embed_tokens.weight
    assert drafter.lm_head_weight is target.lm_head.weight
    ptrs = {target.model.embed_tokens.weight.data_ptr(), target.lm_head.weight.data_ptr()}
    assert not any(t.data_ptr() in ptrs for t in state.values())
    assert not any(p.data_ptr() in ptrs for p in drafter.parameters())
    assert "mask_embedding" in state and not any("embed_tokens" in k or "lm_head" in k for k in state)


def test_reduced_draft_vocabulary():
    """draft_vocab = V_d: tokens come from vocab_ids only; probs are full-vocabulary distributions,
    zero outside the subset and equal to the processed V_d-way distribution inside it; the
    Markov bias is indexed by (full) token ids; training-time logits match the inference path."""
    V, Vd = 12, 5
    target = tiny_model(vocab=V, dim=16, layers=3, scale=2.0)
    args = DSparkArgs.for_target(target.args, tap_layers=TAPS, n_layers=1, block_size=3, markov_rank=4, draft_vocab=Vd)
    drafter = build_drafter(args, target)
    drafter.init_weights(torch.Generator().manual_seed(0))
    subset = torch.tensor([11, 3, 7, 0, 9])
    drafter.set_draft_vocab(subset)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert drafter.markov_w2.weight.shape == (Vd, 4) and drafter.markov_w1.weight.shape == (V, 4)
    torch.testing.assert_close(drafter.draft_head_weight(), target.lm_head.weight[subset])
    ids, feats = sequence(target, T=10)
    b = 64
    drafter.setup_cache(b, 16)
    drafter.append_context(feats[:, :7].expand(b, -1, -1))
    tokens, probs, conf, logits = drafter.draft_block(ids[0, 7].expand(b), None, 1.0, 1.0, make_generator(0, "cpu"),
                                                      return_logits=True)
    assert set(tokens.flatten().tolist()) <= set(subset.tolist())
    assert probs.shape == (b, 3, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[subset] = False
    assert float(probs[:, :, outside].abs().max()) == 0.0
    torch.testing.assert_close(probs[:, :, subset], probs_from_logits(logits, 1.0, 1.0))
    assert drafter.token_to_draft_index(torch.tensor([7, 8])).tolist() == [2, -1]
    greedy, onehot, _ = drafter.draft_block(ids[0, 7].expand(2), None, 0.0)
    assert torch.equal(onehot.argmax(-1), greedy)


def test_cutting_the_draft_vocabulary_keeps_its_first_tokens():
    """keep_draft_vocab(n): the first n draft tokens (the trainer ranks them most frequent first), their
    head and Markov rows as they were, so their logits are the first n columns of the uncut drafter's;
    greedy drafts come from those n tokens; a bad n or a drafter without a draft vocabulary is refused."""
    V, Vd = 12, 5
    target = tiny_model(vocab=V, dim=16, layers=3, scale=2.0)
    args = DSparkArgs.for_target(target.args, tap_layers=TAPS, n_layers=1, block_size=3, markov_rank=4, draft_vocab=Vd)
    drafter = build_drafter(args, target)
    drafter.init_weights(torch.Generator().manual_seed(0))
    drafter.set_draft_vocab(torch.tensor([11, 3, 7, 0, 9]))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    h = torch.randn(6, 16, generator=torch.Generator().manual_seed(5))
    prev = torch.tensor([1, 11, 3, 0, 9, 4])
    with torch.no_grad():
        full = drafter.block_logits(h, prev)
    for bad in (0, Vd + 1):
        with pytest.raises(ValueError):
            drafter.keep_draft_vocab(bad)
    drafter.keep_draft_vocab(3)
    assert drafter.vocab_ids.tolist() == [11, 3, 7] and drafter.draft_vocab_size == 3
    assert drafter.markov_w2.weight.shape == (3, 4)
    with torch.no_grad():
        torch.testing.assert_close(drafter.block_logits(h, prev), full[:, :3], rtol=0, atol=0)
    ids, feats = sequence(target, T=10)
    drafter.setup_cache(4, 16)
    drafter.append_context(feats[:, :7].expand(4, -1, -1))
    tokens, _, _ = drafter.draft_block(ids[0, 7].expand(4), None, 0.0)
    assert set(tokens.flatten().tolist()) <= {11, 3, 7}
    whole = build_drafter(DSparkArgs.for_target(target.args, tap_layers=TAPS, n_layers=1, block_size=3, markov_rank=4),
                          target)
    with pytest.raises(ValueError, match="whole vocabulary"):
        whole.keep_draft_vocab(3)
