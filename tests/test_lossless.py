"""Losslessness of the shared core with every chain policy.

Greedy: token-identical to AR at batch sizes 1, 4, 16 (tiny random models; the default model is
covered in test_default_model.py). Sampled: the joint distribution of the first generated tokens
matches the target's exact distribution (enumerated) in a χ² test over many samples, and the same
test rejects a verifier without residual resampling, so it has power.

Both in fp32 and in bf16 (target and drafters in bf16, probabilities and verification in fp32:
specbench/engine/dtypes.py); bf16 runs a representative subset to keep the suite's time.
"""
from __future__ import annotations

from functools import cache

import pytest
import torch

import specbench.engine.core as core
from specbench.engine.core import SamplingConfig, generate
from specbench.policies.fixed_k import FixedK
from specbench.policies.pld import PromptLookup
from specbench.engine.policy import Policy
from specbench.engine.sampling import sample
from helpers import (N_TOKENS, SMALL_VOCAB, assert_lossless_or_caught, chi_square, decode_in_batches, exact_joint,
                     lookup_merge_spy, sampled_counts)
from tiny import random_prompts, tiny_model

VOCAB = 64
FP32, BF16 = torch.float32, torch.bfloat16


@cache
def target_in(dtype: torch.dtype, dim: int = 32):
    return tiny_model(vocab=VOCAB, dim=dim, seed=0, scale=4.0, dtype=dtype)


@pytest.fixture(scope="module")
def target():
    return target_in(FP32)


@pytest.fixture(scope="module")
def prompts():
    # Repetitive prompts give prompt lookup something to find; random ones exercise ragged lengths.
    base = random_prompts(12, VOCAB, seed=3)
    return base + [p * 3 for p in random_prompts(4, VOCAB, seed=4, max_len=5)]


def policies(target):
    dtype = target.lm_head.weight.dtype
    return {
        "pld": PromptLookup(k=4, max_ngram=3),
        "fixed-k(random draft)": FixedK(tiny_model(vocab=VOCAB, seed=1, layers=1, scale=4.0, dtype=dtype), k=4),
        "fixed-k(self draft)": FixedK(target, k=3),
        "fixed-k(reduced draft vocabulary)": FixedK(ranked(tiny_model(vocab=VOCAB, seed=1, layers=1, scale=4.0,
                                                                       dtype=dtype)), k=4, draft_vocab=VOCAB // 2),
        # lookup drafts in place of the draft LM's where a row's last token occurs earlier (rounds without a
        # draft LM call at b = 1, mixed rows at b > 1); the draft cache must resync after them
        "fixed-k(lookup drafts)": FixedK(tiny_model(vocab=VOCAB, seed=1, layers=1, scale=4.0, dtype=dtype), k=3,
                                         lookup_ngram=1, lookup_k=4),
    }


def ranked(draft, seed: int = 5):
    """A draft LM with a token ranking, as trained draft LMs store (`vocab_rank`)."""
    draft.vocab_rank = torch.randperm(draft.args.vocab_size, generator=torch.Generator().manual_seed(seed)).int()
    return draft


# dim 256 = 4 heads of 64: the head size the CPU kernels' attention takes (fp32 on AVX2, bf16 on AVX-512
# BF16), so decode and verify forwards run every layer in one kernel call there.
@pytest.mark.parametrize("batch_size,dtype,dim", [(1, FP32, 32), (4, FP32, 32), (16, FP32, 32), (1, BF16, 32),
                                                  (16, BF16, 32), (1, FP32, 256), (16, FP32, 256)],
                         ids=["b1-fp32", "b4-fp32", "b16-fp32", "b1-bf16", "b16-bf16", "b1-fp32-hd64", "b16-fp32-hd64"])
def test_greedy_identity_tiny(prompts, batch_size, dtype, dim):
    target = target_in(dtype, dim)
    config = SamplingConfig(max_new_tokens=40, temperature=0.0)
    reference = [r.output_ids for r in decode_in_batches(target, Policy(), prompts, 1, config)]
    for name, policy in policies(target).items():
        got = decode_in_batches(target, policy, prompts, batch_size, config)
        for i, (res, ref) in enumerate(zip(got, reference)):
            assert res.output_ids == ref, f"{name} b={batch_size} prompt {i} diverged from AR"
        if name == "fixed-k(self draft)":  # the target drafting for itself is always accepted
            assert sum(r.accepted for r in got) == sum(r.drafted for r in got) > 0
        if name in ("pld", "fixed-k(lookup drafts)"):
            assert sum(r.accepted for r in got) > 0
        if name == "fixed-k(lookup drafts)":  # some rounds verified more than the draft LM's k = 3: lookup drafts
            assert policy.params()["lookup_k"] == 4 and any(v == 4 for r in got for v in r.trace_verify_len)
            # ... and the core recorded which: every round of 4 took a lookup draft, the round's own flag
            assert all(len(r.trace_lookup) == len(r.trace_verify_len) for r in got)
            assert all(f for r in got for v, f in zip(r.trace_verify_len, r.trace_lookup) if v == 4)
            assert any(not f for r in got for f in r.trace_lookup)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_greedy_eos_and_budget(prompts, dtype):
    """EOS ends a row (kept as its last token) mid-round; rows stop independently; the budget holds."""
    target = target_in(dtype)
    config = SamplingConfig(max_new_tokens=30)
    ar = decode_in_batches(target, Policy(), prompts, 1, config)
    eos = ar[0].output_ids[7]  # a token AR emits: some rows will stop on it mid-draft
    reference = [r.output_ids for r in [generate(target, Policy(), [p], config, eos_ids=[eos]).requests[0] for p in prompts]]
    for policy in policies(target).values():
        got = generate(target, policy, prompts, config, eos_ids=[eos]).requests
        for res, ref in zip(got, reference):
            assert res.output_ids == ref
            assert len(res.output_ids) <= 30
            if eos in res.output_ids:
                assert res.output_ids.index(eos) == len(res.output_ids) - 1 and res.finish_reason == "eos"


# ---------- sampled losslessness ----------


@cache
def small_models_in(dtype: torch.dtype):
    target = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0, dtype=dtype)
    draft = tiny_model(vocab=SMALL_VOCAB, seed=11, layers=1, scale=2.0, dtype=dtype)
    return target, draft


@pytest.fixture(scope="module")
def small_models():
    return small_models_in(FP32)


@pytest.mark.parametrize("temperature,top_p,dtype", [(1.0, 1.0, FP32), (0.8, 0.9, FP32), (1.0, 1.0, BF16)],
                         ids=["T1-fp32", "T0.8-p0.9-fp32", "T1-bf16"])
def test_fixed_k_sampling_matches_target(temperature, top_p, dtype):
    """In bf16 the exact joint is enumerated with the bf16 target's own forward: lossless means
    distributed as the model that runs, whatever its precision."""
    target, draft = small_models_in(dtype)
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, temperature, top_p)
    counts, result = sampled_counts(target, FixedK(draft, k=3), prompt, temperature, top_p)
    drafted = sum(r.drafted for r in result.requests)
    accepted = sum(r.accepted for r in result.requests)
    assert drafted > 0 and 0 < accepted < drafted  # both accept and reject paths are exercised
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"fixed-k output distribution differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


def test_fixed_k_with_a_reduced_draft_vocabulary_matches_target():
    """Drafting from half the vocabulary (tokens outside it have draft probability 0) stays lossless."""
    target, draft = small_models_in(FP32)
    vocab = draft.args.vocab_size
    policy = FixedK(ranked(tiny_model(vocab=vocab, seed=11, layers=1, scale=2.0)), k=3, draft_vocab=vocab // 2)
    subset = set(policy.vocab_ids.tolist())
    assert len(subset) == vocab // 2 and policy.params()["draft_vocab"] == vocab // 2
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    counts, result = sampled_counts(target, policy, prompt, 1.0, 1.0)
    assert sum(r.accepted for r in result.requests) > 0
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"fixed-k (reduced vocabulary) differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"
    # a draft LM with no ranking (truncate:N, self, trained before session 16) drafts from all tokens, and says so
    assert FixedK(tiny_model(vocab=vocab, seed=11, layers=1), k=3, draft_vocab=vocab // 2).params()["draft_vocab"] == 0


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_prompt_lookup_sampling_matches_target(dtype):
    target, _ = small_models_in(dtype)
    prompt = [1, 2, 1, 2, 1]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    counts, result = sampled_counts(target, PromptLookup(k=3), prompt, 1.0, 1.0)
    assert sum(r.drafted for r in result.requests) > 0
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"pld output distribution differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("broken", [False, True], ids=["honest", "lookup-rows-claim-uniform"])
def test_fixed_k_with_lookup_drafts_matches_target(monkeypatch, broken):
    """χ² at T = 1 for fixed-K with lookup drafts: in one batch some rows verify a one-hot lookup draft and
    others the draft LM's sampled tokens, and rounds where every row has a lookup draft run no draft LM.
    Negative control: the lookup rows claim a uniform draft distribution instead of their one-hot one, and
    the same test rejects it."""
    import specbench.policies.fixed_k as fixed_k

    target, draft = small_models_in(FP32)
    calls = lookup_merge_spy(fixed_k, monkeypatch, broken, SMALL_VOCAB)
    prompt = [1, 2, 1, 2, 1]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    counts, result = sampled_counts(target, FixedK(draft, k=3, lookup_ngram=1, lookup_k=2), prompt, 1.0, 1.0)
    assert calls["mixed"] > 0 and sum(r.accepted for r in result.requests) > 0
    assert_lossless_or_caught(exact, counts, broken, "fixed-k with lookup drafts")


def broken_verify_chain(target_probs, draft_tokens, draft_probs, verify_lengths, generator):
    """Accept/reject as usual but, on rejection, sample from p instead of norm(max(0, p − q))."""
    b = target_probs.shape[0]
    k_max = min(draft_tokens.shape[1], target_probs.shape[1] - 1)
    rows = torch.arange(b)
    if k_max == 0:
        return torch.zeros(b, dtype=torch.long), sample(target_probs[:, 0], generator)
    drafts = draft_tokens[:, :k_max]
    p = target_probs[:, :k_max].gather(-1, drafts[..., None]).squeeze(-1)
    q = draft_probs[:, :k_max].gather(-1, drafts[..., None]).squeeze(-1)
    accept = (torch.rand(b, k_max, generator=generator) * q < p) & (torch.arange(k_max)[None] < verify_lengths[:, None])
    accepted = accept.long().cumprod(1).sum(1)
    return accepted, sample(target_probs[rows, accepted], generator)


def test_chi_square_rejects_broken_verifier(small_models, monkeypatch):
    target, draft = small_models
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    monkeypatch.setattr(core, "verify_chain", broken_verify_chain)
    counts, _ = sampled_counts(target, FixedK(draft, k=3), prompt, 1.0, 1.0)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue < 1e-6, f"the χ² test failed to notice a verifier without residual resampling (p={pvalue:.2e})"
