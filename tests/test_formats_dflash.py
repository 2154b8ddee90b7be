"""Conformance of the suite's loader with the DFlash layout (z-lab's `dflash` package and
SpecForge's `DFlashDraftModel`) and with DeepSpec's `Qwen3DSparkModel` layout: the same draft
hidden states, logits and drafts as the reference modules (fp32, max abs difference ≤ 1e-5)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from published import deepspec_checkpoint, MASK_ID, VOCAB, DIM, context_inputs, save, specforge_dflash, specforge_dspark, tiny_target, zlab_dflash
from specbench.drafters.formats import load_published

TOL = 1e-5
N_CTX = 6


def reference_hidden(ref, embed, features, anchors, n_ctx):
    slots = ref.block_size
    block = torch.full((len(anchors), slots), MASK_ID)
    block[:, 0] = anchors
    positions = torch.arange(n_ctx + slots)[None].expand(len(anchors), -1)
    with torch.no_grad():
        return ref(position_ids=positions, noise_embedding=embed[block], target_hidden=features, attention_mask=None)


@pytest.mark.parametrize("build", [zlab_dflash, specforge_dflash], ids=["z-lab", "specforge"])
def test_dflash_import(tmp_path, build):
    target = tiny_target()
    ref = build(block_size=5)
    kind, drafter = load_published(str(save(ref, tmp_path / "d")), target)
    assert kind == "dflash" and drafter.first_slot == 1 and drafter.block_size == 4
    features, anchors = context_inputs(target, N_CTX)
    h_ref = reference_hidden(ref, target.model.model.embed_tokens.weight, features, anchors, N_CTX)[:, 1:]
    drafter.setup_cache(len(anchors), 64)
    drafter.append_context(features)
    h = drafter.block_hidden(anchors)
    assert (h - h_ref).abs().max() <= TOL
    logits_ref = h_ref @ target.model.lm_head.weight.T  # dflash_generate: the target's head on the mask slots
    tokens, probs, conf, logits = drafter.draft_block(anchors, None, 0.0, return_logits=True)
    assert conf is None
    assert (logits - logits_ref).abs().max() <= TOL * 10
    assert torch.equal(tokens, logits_ref.argmax(-1))


@pytest.mark.parametrize("head", ["vanilla", "rnn", None])
def test_deepspec_import(tmp_path, head):
    target = tiny_target()
    rank = 6 if head else 0
    ref = specforge_dspark(markov_head_type=head or "vanilla", rank=rank, confidence=bool(head), with_markov=bool(head))
    path, state = deepspec_checkpoint(tmp_path, ref)
    kind, drafter = load_published(str(path), target)
    assert kind == ("dspark" if head else "dflash") and drafter.first_slot == 0
    features, anchors = context_inputs(target, N_CTX)
    embed, lm_head = state["embed_tokens.weight"], state["lm_head.weight"]
    h_ref = reference_hidden(ref, embed, features, anchors, N_CTX)
    drafter.setup_cache(len(anchors), 64)
    drafter.append_context(features)
    h = drafter.block_hidden(anchors)
    assert (h - h_ref).abs().max() <= TOL
    base_ref = h_ref @ lm_head.T
    with torch.no_grad():
        if head:
            tokens_ref, logits_ref = ref.markov_head.sample_block_tokens(base_ref, first_prev_token_ids=anchors,
                                                                         hidden_states=h_ref)
            prev = torch.cat([anchors[:, None], tokens_ref[:, :-1]], dim=1)
            conf_ref = ref.predict_confidence(h_ref, prev_token_ids=prev)
        else:
            tokens_ref, logits_ref, conf_ref = base_ref.argmax(-1), base_ref, None
    tokens, _, conf, logits = drafter.draft_block(anchors, None, 0.0, return_logits=True)
    assert torch.equal(tokens, tokens_ref)
    assert (logits - logits_ref).abs().max() <= TOL * 10
    if head:
        assert (conf - conf_ref).abs().max() <= TOL
    else:
        assert conf is None
