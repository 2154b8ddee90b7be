"""Lossless with drafters in the published formats, loaded through the policies' own builders:
greedy output identical to `ar` at batch sizes 1 and 4 for DSpark (SpecForge, DeepSpec-style
own embedding not needed here), DFlash (z-lab), EAGLE-3 (SpecForge; chain and tree) and a plain HF
draft LM for fixed-K; at T = 1 the whole DSpark policy over a SpecForge-format drafter (RNN
Markov head, confidence-scheduled) samples the target's exact distribution (χ², tiny vocabulary).
A draft LM with another tokenizer is refused."""
from __future__ import annotations

import pytest
import torch

from published import hf_target_dir, hf_tokenizer, save, specforge_dspark, tiny_target, zlab_dflash
from specbench.engine.core import SamplingConfig, generate
from specbench.errors import UserError
from specbench.engine.loading import load_model
from specbench.policies.dspark import DSpark
from specbench.engine.policy import Policy
from specbench.policies.registry import build_dspark, build_eagle, build_eagle_chain, build_fixed_k
from published import specforge_eagle3
from helpers import N_SAMPLES, N_TOKENS, SMALL_VOCAB, chi_square, exact_joint
from tiny import random_prompts

VOCAB = 64


def decode(model, policy, prompts, batch_size, config):
    out = []
    for i in range(0, len(prompts), batch_size):
        out += generate(model, policy, prompts[i : i + batch_size], config).requests
    return [r.output_ids for r in out], sum(r.accepted for r in out)


@pytest.fixture(scope="module")
def published_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    # SpecForge's EAGLE-3 RMSNorm is @torch.compile'd; eager runs the same function.
    with torch._dynamo.config.patch(disable=True):
        return {"dspark": save(specforge_dspark("rnn"), root / "dspark"), "dflash": save(zlab_dflash(), root / "dflash"),
                "eagle3": save(specforge_eagle3(), root / "eagle3")}


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_identity_published_drafters(published_dirs, batch_size, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    target = tiny_target()
    prompts = random_prompts(8, VOCAB, seed=3)
    config = SamplingConfig(max_new_tokens=24)
    reference, _ = decode(target.model, Policy(), prompts, 1, config)
    policies = {
        "dspark": build_dspark(target, drafter=str(published_dirs["dspark"]), scheduler="threshold", threshold=0.3),
        "dflash": build_dspark(target, drafter=str(published_dirs["dflash"]), scheduler="fixed"),
        "eagle3-chain": build_eagle_chain(target, drafter=str(published_dirs["eagle3"]), depth=3),
        "eagle3-tree": build_eagle(target, drafter=str(published_dirs["eagle3"]), depth=3, top_k=3, total_tokens=8),
    }
    for name, pol in policies.items():
        out, _ = decode(target.model, pol, prompts, batch_size, config)
        assert out == reference, name


def test_dspark_format_sampling_matches_target(tmp_path):
    target = tiny_target(seed=10, vocab=SMALL_VOCAB, scale=2.0)
    ref = specforge_dspark("rnn", rank=4, block_size=3, vocab=SMALL_VOCAB, mask_id=4, std=0.4, seed=6)
    drafter = build_dspark(target, drafter=str(save(ref, tmp_path / "d")), scheduler="fixed").draft_model
    pol = DSpark(drafter, scheduler="algorithm1", step_seconds=lambda rows, q: 0.01 + 0.0001 * rows * q,
                 sts_temperatures=[1.5, 0.7, 1.0], group_size=4)
    prompt = [1, 3, 2]
    exact = exact_joint(target.model, prompt, N_TOKENS, 1.0, 1.0)
    config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=1.0, seed=99)
    result = generate(target.model, pol, [prompt] * N_SAMPLES, config)
    counts = {}
    for r in result.requests:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert 0 < sum(r.accepted for r in result.requests) < sum(r.drafted for r in result.requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"published-format DSpark distribution differs (p={pvalue:.2e}, TV={tv:.4f})"


def draft_lm_dir(path, tokenizer, seed=5, vocab=VOCAB):
    """A plain tiny LlamaForCausalLM saved with transformers, beside a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_fixed_k_with_hf_draft_lm(tmp_path, batch_size):
    target = load_model(str(hf_target_dir(tmp_path / "target")))
    pol = build_fixed_k(target, k=3, drafter=draft_lm_dir(tmp_path / "draft", hf_tokenizer()))
    prompts = random_prompts(8, VOCAB, seed=4)
    config = SamplingConfig(max_new_tokens=20)
    reference, _ = decode(target.model, Policy(), prompts, 1, config)
    out, _ = decode(target.model, pol, prompts, batch_size, config)
    assert out == reference


def test_fixed_k_refuses_other_tokenizer(tmp_path):
    target = load_model(str(hf_target_dir(tmp_path / "target")))
    with pytest.raises(UserError, match="tokenizer is not the target"):
        build_fixed_k(target, k=3, drafter=draft_lm_dir(tmp_path / "draft", hf_tokenizer(prefix="w")))
