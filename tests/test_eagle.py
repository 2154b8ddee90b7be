"""The EAGLE policy (chain and EAGLE-2 dynamic trees) and its head's training, on tiny models:
training-time test = cached inference, the dynamic tree against a slow reference expansion,
greedy identity to AR, χ² losslessness at T = 1 (with a broken tree verifier as the negative
control), training lowers the loss and raises τ, checkpoints, refusals, determinism and resume."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specbench.engine.core as core
from specbench.engine.core import SamplingConfig, forward_new_tokens, generate
from specbench.drafters.eagle import EagleArgs, build_head, load_eagle_head
from specbench.errors import UserError
from specbench.engine.model import ModelArgs
from specbench.policies.eagle import Eagle
from specbench.engine.policy import BatchState, Policy
from specbench.policies.registry import build_policy, read_spec
from specbench.train.common import get_budget
from specbench.train.eagle import evaluate, options, train
from helpers import (N_TOKENS, SMALL_VOCAB, VOCAB, broken_verify_tree, chi_square, decode_in_batches, exact_joint,
                     assert_lossless_or_caught, lookup_merge_spy, sampled_counts, tiny_target, tiny_training_data)
from tiny import random_prompts, tiny_model

TAPS = [0, 1, 2]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_head(target_model, taps, seed=0, std=0.3):
    """Drawn in fp32 (the same head whatever the target's dtype), then in the target's dtype."""
    head = build_head(EagleArgs.for_target(target_model.args, taps), target_model, dtype=torch.float32)
    head.init_weights(torch.Generator().manual_seed(seed), std=std)
    head = head.to(target_model.lm_head.weight.dtype)
    head.inv_freq = head.inv_freq.float()  # rope frequencies stay fp32 (specbench/engine/dtypes.py cast_model)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    return tiny_training_data(target, tmp_path_factory.mktemp("data") / "d", TAPS)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("eagle")
    result = train(target, data, out, budget=get_budget("tiny", steps=60), seed=0, progress=False)
    return out, result


# ---------------------------------------------------------------------------------------------
# The head: training-time test computes what drafting computes


def test_training_time_test_matches_cached_drafting():
    model = tiny_model(vocab=VOCAB, layers=3, seed=0, scale=4.0)
    head = random_head(model, TAPS)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    model.setup_cache(2, 64)
    _, taps, _ = forward_new_tokens(model, ids, torch.zeros(2, dtype=torch.long), taps=tuple(TAPS))
    steps = 4
    with torch.no_grad():
        outs = head.forward_ttt(taps, ids, steps)
        q_index = torch.tensor([[3, 7, 10], [0, 5, 12]])
        sub = head.forward_ttt(taps, ids, steps, q_index)
        for i in range(steps):  # unrolling only some query indices gives the same outputs there
            assert torch.allclose(outs[i].gather(1, q_index[..., None].expand(-1, -1, 32)), sub[i], atol=1e-6)
        for r in range(2):
            for t in (3, 9):  # context entries 0..t, then a chain x_{t+2}, x_{t+3}, ... of own outputs
                head.setup_cache(1, 128)
                head.append_context(taps[r:r + 1, :t + 1], ids[r:r + 1, 1:t + 2], torch.tensor([t + 1]))
                h = head.h_last[:1]
                assert torch.allclose(h, outs[0][r, t], atol=1e-5)
                for i in range(1, steps):
                    pos = torch.tensor([[t + i]])
                    mask = torch.arange(64)[None, None] <= pos[..., None]
                    h = head.step(h[:, None], ids[r:r + 1, t + 1 + i, None], pos, pos, mask)[:, 0]
                    assert torch.allclose(h, outs[i][r, t], atol=1e-4), (r, t, i)


def test_smollm2_head_size():
    """Sized for the default target (SmolLM2-135M: d 576, 9 / 3 heads, MLP 1536, taps [1, 14, 27]):
    one target-shaped layer + fc, 5.09 M parameters, ~10 MB in bf16 — one checkpoint file."""
    smol = ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536)
    args = EagleArgs.for_target(smol, [1, 14, 27])
    with torch.device("meta"):
        from specbench.drafters.eagle import EagleHead

        head = EagleHead(args, torch.empty(49152, 576), torch.empty(49152, 576))
    n = head.num_parameters()
    assert 5.0e6 < n < 5.2e6 and 2 * n < 16 * 2**20
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())


# ---------------------------------------------------------------------------------------------
# The dynamic tree


def _begin(policy, model, prompts):
    """Prefill + begin as the core does, returning the BatchState (first token = greedy)."""
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    cap = 128
    tokens = torch.zeros(b, cap, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = torch.tensor(p)
    model.setup_cache(b, cap)
    logits, feats, _ = forward_new_tokens(model, tokens[:, :int(lengths.max())], torch.zeros(b, dtype=torch.long),
                                          policy.target_taps)
    tokens[torch.arange(b), lengths] = logits[torch.arange(b), lengths - 1].argmax(-1)
    state = BatchState(tokens=tokens, lengths=lengths + 1, prompt_lengths=lengths, active=torch.ones(b, dtype=torch.bool),
                       temperature=0.0, top_p=1.0, generator=torch.Generator().manual_seed(0), max_new_tokens=32)
    policy.begin(state, feats)
    return state


def _reference_tree(head, feats, state, r, depth, top_k, total, draft_vocab):
    """EAGLE-2 expansion for row r, slowly: every node's distribution from a fresh chain pass over
    its own path; returns {(path tokens): cumulative log-prob} of the `total` best nodes."""
    p = int(state.prompt_lengths[r])
    vocab = head.draft_vocab(draft_vocab)

    def logp(path):
        head.setup_cache(1, 128)
        head.append_context(feats[r:r + 1, :p], state.tokens[r:r + 1, 1:p + 1], torch.tensor([p]))
        h = head.h_last[:1]
        for i, x in enumerate(path):
            pos = torch.tensor([[p + i]])
            h = head.step(h[:, None], torch.tensor([[x]]), pos, pos, torch.arange(128)[None, None] <= pos[..., None])[:, 0]
        logits, ids = head.draft_logits(h, vocab)
        lp = torch.log_softmax(logits[0].float(), -1)
        return lp if ids is None else torch.full((VOCAB,), float("-inf")).index_copy_(0, ids, lp)

    nodes = {}
    frontier = [((), 0.0)]
    for level in range(depth):
        children = []
        for path, score in frontier:
            lp = logp(path)
            vals, toks = lp.topk(top_k)
            children += [(path + (int(t),), score + float(v)) for v, t in zip(vals, toks)]
        nodes.update(children)
        frontier = sorted(children, key=lambda c: -c[1])[:top_k]
    best = sorted(nodes.items(), key=lambda c: -c[1])[:total]
    return dict(best)


@pytest.mark.parametrize("depth,top_k,total,draft_vocab", [(4, 3, 10, 0), (3, 4, 40, 0), (1, 5, 3, 0), (5, 2, 60, 0),
                                                            (4, 3, 20, 16)])
def test_dynamic_tree_is_the_eagle2_tree(depth, top_k, total, draft_vocab):
    model = tiny_model(vocab=VOCAB, layers=3, seed=0, scale=4.0)
    head = random_head(model, TAPS, std=0.5)
    head.vocab_rank.copy_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2)).int())
    policy = Eagle(head, "tree", depth=depth, top_k=top_k, total_tokens=total, draft_vocab=draft_vocab)
    prompts = random_prompts(3, VOCAB, seed=7)
    state = _begin(policy, model, prompts)
    with torch.no_grad():
        _, feats, _ = forward_new_tokens(model, state.tokens[:, :max(map(len, prompts))],
                                         torch.zeros(3, dtype=torch.long), policy.target_taps)
    draft = policy.propose(state)
    n = int(draft.lengths[0])
    assert draft.probs is None and draft.parents.shape == draft.tokens.shape
    assert n == min(total, top_k + (depth - 1) * top_k ** 2) == policy.max_draft
    for r in range(3):
        parents, tokens = draft.parents[r, :n].tolist(), draft.tokens[r, :n].tolist()
        paths = []
        for i, par in enumerate(parents):
            assert -1 <= par < i  # topologically ordered, ancestor-closed (every parent is a kept node)
            paths.append((paths[par] if par >= 0 else ()) + (tokens[i],))
        assert max(len(pt) for pt in paths) <= depth
        assert len(set(paths)) == n  # siblings are distinct tokens
        if draft_vocab:
            assert set(tokens) <= set(head.vocab_rank[:draft_vocab].tolist())
        reference = _reference_tree(head, feats, state, r, depth, top_k, n, draft_vocab)
        assert set(paths) == set(reference), r
        # siblings are listed best first (the verifier tries them in this order)
        for i in range(n):
            sibs = [j for j in range(n) if parents[j] == parents[i]]
            scores = [reference[paths[j]] for j in sibs]
            assert scores == sorted(scores, reverse=True)


# ---------------------------------------------------------------------------------------------
# Greedy identity


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_greedy_identity(target, trained, batch_size):
    model = target.model
    prompts = random_prompts(16, VOCAB, seed=5)
    config = SamplingConfig(max_new_tokens=24)
    reference = [generate(model, Policy(), [p], config).requests[0].output_ids for p in prompts]
    heads = {"trained": load_eagle_head(str(trained[0]), target), "random": random_head(model, TAPS)}
    for name, head in heads.items():
        for policy in (Eagle(head, "tree", depth=4, top_k=3, total_tokens=12), Eagle(head, "chain", depth=4),
                       Eagle(head, "tree", depth=3, top_k=2, total_tokens=6, draft_vocab=24),
                       Eagle(head, "chain", depth=3, lookup_ngram=1, lookup_k=4)):
            out = decode_in_batches(model, policy, prompts, batch_size, config)
            assert [r.output_ids for r in out] == reference, (name, policy.params())
            if name == "trained":
                assert sum(r.accepted for r in out) > 0
            if policy.lookup_ngram:  # lookup drafts (4 tokens) were verified in place of the head's 3
                assert any(v == 4 for r in out for v in r.trace_verify_len), (name, batch_size)


def test_greedy_identity_bf16(target):
    """bf16 target and head (random head: a trained one is covered in fp32 above)."""
    from specbench.engine.dtypes import cast_model

    model = cast_model(tiny_model(vocab=VOCAB, seed=0, layers=3, scale=4.0), torch.bfloat16)
    prompts = random_prompts(8, VOCAB, seed=5)
    config = SamplingConfig(max_new_tokens=24)
    reference = [generate(model, Policy(), [p], config).requests[0].output_ids for p in prompts]
    head = random_head(model, TAPS)
    assert head.dtype == torch.bfloat16
    for policy in (Eagle(head, "tree", depth=4, top_k=3, total_tokens=12), Eagle(head, "chain", depth=4),
                   Eagle(head, "chain", depth=3, lookup_ngram=1, lookup_k=4)):
        for batch_size in (1, 4):
            got = decode_in_batches(model, policy, prompts, batch_size, config)
            assert [r.output_ids for r in got] == reference, (policy.params(), batch_size)


def test_greedy_eos_and_ragged_budget(target, trained):
    model = target.model
    prompts = random_prompts(12, VOCAB, seed=9)
    config = SamplingConfig(max_new_tokens=20)
    ar = decode_in_batches(model, Policy(), prompts, 1, config)
    eos = ar[0].output_ids[5]
    reference = [generate(model, Policy(), [p], config, eos_ids=[eos]).requests[0].output_ids for p in prompts]
    head = load_eagle_head(str(trained[0]), target)
    for policy in (Eagle(head, "tree", depth=5, top_k=4, total_tokens=20), Eagle(head, "chain", depth=5)):
        got = generate(model, policy, prompts, config, eos_ids=[eos]).requests
        assert [r.output_ids for r in got] == reference
        stopped = [r for r in got if r.finish_reason == "eos"]
        assert stopped and all(r.output_ids[-1] == eos for r in stopped), "no row hit EOS: the test lost its point"
        assert any(r.finish_reason != "eos" for r in got)  # and others ran on to the budget (ragged)
        assert sum(r.accepted for r in got) > 0


# ---------------------------------------------------------------------------------------------
# Sampled losslessness (χ² against the exact joint of the first N_TOKENS tokens)


@pytest.fixture(scope="module")
def small():
    torch.set_num_threads(1)
    model = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0)
    head = random_head(model, [0, 1], seed=3, std=0.5)
    exact = exact_joint(model, [1, 3, 2], N_TOKENS, 1.0, 1.0)
    return model, head, exact


def test_tree_sampling_matches_target(small):
    model, head, exact = small
    counts, result = sampled_counts(model, Eagle(head, "tree", depth=3, top_k=2, total_tokens=5), [1, 3, 2], 1.0, 1.0)
    accepted = sum(r.accepted for r in result.requests)
    assert 0 < accepted < sum(r.drafted for r in result.requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"eagle tree output differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


def test_tree_sampling_matches_target_bf16():
    model = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0, dtype=torch.bfloat16)
    head = random_head(model, [0, 1], seed=3, std=0.5)
    exact = exact_joint(model, [1, 3, 2], N_TOKENS, 1.0, 1.0)
    counts, result = sampled_counts(model, Eagle(head, "tree", depth=3, top_k=2, total_tokens=5), [1, 3, 2], 1.0, 1.0)
    assert 0 < sum(r.accepted for r in result.requests) < sum(r.drafted for r in result.requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"bf16 eagle tree output differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("draft_vocab", [0, 3])
def test_chain_sampling_matches_target(small, draft_vocab):
    model, head, exact = small
    policy = Eagle(head, "chain", depth=3, draft_vocab=draft_vocab)  # 3: zero-padded draft distributions
    counts, result = sampled_counts(model, policy, [1, 3, 2], 1.0, 1.0)
    assert 0 < sum(r.accepted for r in result.requests) < sum(r.drafted for r in result.requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"eagle chain output differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("broken", [False, True], ids=["honest", "lookup-rows-claim-uniform"])
def test_chain_with_lookup_drafts_sampling_matches_target(small, monkeypatch, broken):
    """χ² at T = 1 for the chain with lookup drafts (lookup_ngram): rows with a match verify their one-hot
    lookup draft beside rows verifying the head's sampled chain. Negative control: the lookup rows claim a
    uniform draft distribution instead of their one-hot one, and the same test rejects it."""
    import specbench.policies.eagle as eagle

    model, head, exact = small
    calls = lookup_merge_spy(eagle, monkeypatch, broken, SMALL_VOCAB)
    policy = Eagle(head, "chain", depth=3, lookup_ngram=1, lookup_k=2)
    counts, result = sampled_counts(model, policy, [1, 3, 2], 1.0, 1.0)
    assert calls["mixed"] > 0 and sum(r.accepted for r in result.requests) > 0
    assert_lossless_or_caught(exact, counts, broken, "eagle chain with lookup drafts")
    with pytest.raises(ValueError, match="chain mode only"):
        Eagle(head, "tree", lookup_ngram=3)


def test_chi_square_rejects_broken_tree_verifier(small, monkeypatch):
    model, head, exact = small
    monkeypatch.setattr(core, "verify_tree", broken_verify_tree)
    counts, _ = sampled_counts(model, Eagle(head, "tree", depth=3, top_k=2, total_tokens=5), [1, 3, 2], 1.0, 1.0)
    pvalue, _ = chi_square(exact, counts)
    assert pvalue < 1e-6, f"the χ² test missed a tree verifier without exclusion (p={pvalue:.2e})"


# ---------------------------------------------------------------------------------------------
# Training, checkpoints, loading


def test_options_per_budget():
    assert options(get_budget("tiny"))["ttt_steps"] == 3
    assert options(get_budget("small"))["ttt_steps"] == 5
    assert options(get_budget("full"))["ttt_steps"] == 7
    assert options(get_budget("tiny", ttt_steps=2))["ttt_steps"] == 2


def test_reduced_vocabulary_loss_from_cached_target_stats_and_training(target, data, tmp_path):
    """draft_vocab = V_d: the loss from the cached per-token target normalisers equals the one from
    the target's whole-vocabulary softmax restricted to the draft vocabulary; training on it lowers
    the loss and the card says which policy setting the head is for."""
    from specbench.train.common import TARGET_STATS_FILE, attach_target_stats, vocab_rank
    from specbench.train.data import TrainingData
    from specbench.train.eagle import _batch, ttt_loss

    n_vocab = target.model.args.vocab_size // 4
    head = random_head(target.model, TAPS, std=0.1).float()
    idx = [0, 2, 5]
    head.vocab_rank.copy_(vocab_rank(data, idx, target.model.args.vocab_size))
    vocab = head.vocab_rank[:n_vocab].long().sort().values
    fresh = TrainingData(data.path, target)
    (fresh.path / TARGET_STATS_FILE).unlink(missing_ok=True)
    plain = _batch(fresh, idx, "cpu")
    attach_target_stats(fresh, target.model.lm_head.weight, None, progress=False)
    with_stats = _batch(fresh, idx, "cpu")
    assert {"target_lse", "target_argmax"} <= set(with_stats) and not {"target_lse"} & set(plain)
    with torch.no_grad():
        ref, ref_m = ttt_loss(head, plain, 3, with_stats=True, vocab=vocab)
        got, got_m = ttt_loss(head, with_stats, 3, with_stats=True, vocab=vocab)
        whole, _ = ttt_loss(head, plain, 3, vocab=None)
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref)) and abs(float(got) - float(whole)) > 1e-4
    for k in ("acc0_t1", "acc1_t1", "acc2_t0"):
        assert abs(float(got_m[k]) - float(ref_m[k])) < 1e-5, k
    result = train(target, data, tmp_path / "v", budget=get_budget("tiny", steps=40, draft_vocab=n_vocab), seed=0,
                   progress=False)
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    assert f"draft_vocab = {n_vocab}" in result.extra["loss"]
    reduced = load_eagle_head(str(tmp_path / "v"), target)
    assert reduced.args.trained_vocab == n_vocab
    assert Eagle(reduced, "chain").draft_vocab == n_vocab  # the default drafts from the training vocabulary
    assert Eagle(reduced, "chain", draft_vocab=0).draft_vocab == 0


def test_training_lowers_loss_and_raises_tau(target, data, trained):
    path, result = trained
    _, val = data.split(options(get_budget("tiny"))["val_fraction"], 0)
    untrained = random_head(target.model, TAPS, std=0.02)
    head = load_eagle_head(str(path), target)
    before, after = evaluate(untrained, data, val, 4, 3), evaluate(head, data, val, 4, 3)
    assert after["loss"] < 0.7 * before["loss"]
    assert after["tau_est_t1"] > before["tau_est_t1"]
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    assert result.kind == "eagle" and result.steps == 60
    # τ measured by the suite itself, on the training prompts' responses' own prompts (greedy)
    prompts = [data.sequence(i, ("input_ids", "loss_mask")) for i in val + list(range(6))]
    prompts = [s["input_ids"][: int((~s["loss_mask"]).sum())].tolist() for s in prompts]
    config = SamplingConfig(max_new_tokens=24)
    for mode in ("chain", "tree"):
        tau = {}
        for name, h in (("untrained", untrained), ("trained", head)):
            res = generate(target.model, Eagle(h, mode, depth=4, top_k=3, total_tokens=12), prompts, config,
                           eos_ids=target.eos_token_ids).requests
            tau[name] = sum(r.generated_tokens - 1 for r in res) / sum(r.rounds for r in res)
        assert tau["trained"] > tau["untrained"] + 0.3, (mode, tau)


def test_checkpoint_and_registry(target, trained, tmp_path):
    path, _ = trained
    cfg = json.loads((path / "drafter.json").read_text())
    assert cfg["kind"] == "eagle" and cfg["target_fingerprint"] == target.fingerprint
    assert EagleArgs.from_dict(cfg["model_args"]).tap_layers == TAPS
    weights = load_file(next(path.glob("*.safetensors")))
    assert all(t.dtype == torch.bfloat16 for k, t in weights.items() if k != "vocab_rank")
    assert weights["vocab_rank"].dtype == torch.int32
    assert not any("embed" in k or "lm_head" in k for k in weights)
    head = load_eagle_head(str(path), target)
    assert head.lm_head_weight is target.model.lm_head.weight and head.embed_weight is target.model.model.embed_tokens.weight
    for k, v in head.state_dict().items():
        assert torch.equal(v, weights[k].to(v.dtype))
    assert (path / "loss_curve.png").is_file()
    # the built-in specs
    for name, mode in (("eagle", "tree"), ("eagle-chain", "chain")):
        spec = read_spec(name)
        assert spec["builder"] == f"specbench.policies.registry:build_{name.replace('-', '_')}"
        policy = build_policy(name, target, {"drafter": str(path)})
        assert policy.name == name and policy.mode == mode and policy.target_taps == tuple(TAPS)
    tree = build_policy("eagle", target, {"drafter": str(path)})
    assert tree.params() == {"mode": "tree", "depth": 5, "top_k": 10, "total_tokens": 60, "draft_vocab": 0}
    assert tree.max_draft == 60
    rank = head.vocab_rank.tolist()
    assert sorted(rank) == list(range(VOCAB)) and rank != sorted(rank)  # the response tokens' frequency order
    chain = build_policy("eagle-chain", target, {"drafter": str(path), "depth": 3})
    assert chain.max_draft == 3


def test_refuses_other_target_wrong_kind_and_corrupt_files(target, trained, tmp_path):
    path, _ = trained
    with pytest.raises(UserError, match="trained for target"):
        load_eagle_head(str(path), tiny_target(fingerprint="another-target"))
    with pytest.raises(UserError, match="trained for target"):
        build_policy("eagle", tiny_target(fingerprint="another-target"), {"drafter": str(path)})
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((path / "drafter.json").read_text())
    cfg["kind"] = "dspark"
    (bad / "drafter.json").write_text(json.dumps(cfg))
    shard = next(path.glob("*.safetensors"))
    (bad / shard.name).write_bytes(shard.read_bytes())
    with pytest.raises(UserError, match="not 'eagle'"):
        load_eagle_head(str(bad), target)
    (bad / "drafter.json").write_text((path / "drafter.json").read_text())
    (bad / shard.name).write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match="corrupt"):
        load_eagle_head(str(bad), target)


def test_same_seed_bit_identical_and_resume(target, data, tmp_path):
    b = get_budget("tiny", steps=8, ckpt_every=4)
    a = train(target, data, tmp_path / "a", budget=b, seed=3, progress=False)
    again = train(target, data, tmp_path / "b", budget=b, seed=3, progress=False)
    wa, wb = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("a", "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in again.history]
    part = train(target, data, tmp_path / "r", budget=b, seed=3, progress=False, stop_after=5)
    assert part.steps == 5 and not (tmp_path / "r" / "drafter.json").exists()
    done = train(target, data, tmp_path / "r", budget=b, seed=3, progress=False, resume=True)
    wr = load_file(next((tmp_path / "r").glob("*.safetensors")))
    assert done.steps == 8 and all(torch.equal(wa[k], wr[k]) for k in wa)
    assert [h["loss"] for h in done.history] == [h["loss"] for h in a.history]


# ---------------------------------------------------------------------------------------------
# The default target's shapes (9 / 3 heads, d 576, taps [1, 14, 27]); an untrained head, so this
# checks the mechanics on real prompts, not acceptance (the shipped head's τ is in its card).


@pytest.mark.model
@pytest.mark.slow  # ~50 s on the 2-core CPU
def test_greedy_identity_default_model(default_model):
    from specbench.bench.workloads import load_workload, render_prompt

    prompts = []
    for name in ("code", "chat"):
        wl = load_workload(name, limit=2)
        prompts += [render_prompt(default_model.tokenizer, wl, [("user", r.turns[0])]) for r in wl.requests]
    model = default_model.model
    config = SamplingConfig(max_new_tokens=16)
    reference = [generate(model, Policy(), [p], config).requests[0].output_ids for p in prompts]
    head = load_eagle_head("drafters/smollm2-135m/eagle", default_model)  # the shipped, trained head
    for policy in (Eagle(head, "tree", depth=3, top_k=4, total_tokens=10), Eagle(head, "chain", depth=3)):
        for batch_size in (1, 4):
            out = decode_in_batches(model, policy, prompts, batch_size, config)
            assert [r.output_ids for r in out] == reference, (policy.mode, batch_size)
            assert sum(r.drafted for r in out) > 0 and sum(r.accepted for r in out) > 0, (policy.mode, batch_size)


def test_reduced_vocabulary_rows_are_kept_and_score_like_the_full_head():
    """The draft vocabulary's lm_head rows are built once per head (so their packed copy, keyed by
    storage, is never stale) and score every token as the whole head does, to bf16 rounding."""
    model = tiny_model(vocab=96, dim=256, layers=3, seed=0, dtype=torch.bfloat16)
    head = random_head(model, TAPS).to(torch.bfloat16)
    head.vocab_rank.copy_(torch.randperm(96, generator=torch.Generator().manual_seed(2)).int())
    vocab = head.draft_vocab(40)
    assert head.draft_vocab(40) is vocab and head.draft_vocab(20) is not vocab
    hidden = torch.randn(3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        logits, ids = head.draft_logits(hidden, vocab)
        full, _ = head.draft_logits(hidden)
        again, _ = head.draft_logits(hidden, vocab)
    assert torch.equal(ids, vocab[0]) and torch.equal(logits, again)
    assert (logits.float() - full[:, ids].float()).abs().max() <= 0.02 * full.float().abs().max()
    head.vocab_rank.copy_(torch.arange(96, dtype=torch.int32))  # another ranking: other rows
    assert not torch.equal(head.draft_vocab(40)[0], vocab[0])
