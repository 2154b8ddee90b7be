"""Conformance of the suite's loader with SpecForge's DSpark and DeepSpec's layout: tiny random
drafters built and saved with SpecForge's own code give, in the suite, the same draft hidden
states, base and Markov-corrected logits (teacher-forced and sampled left to right), and confidence
logits as in SpecForge's modules (fp32, max abs difference ≤ 1e-5), for every Markov head."""
from __future__ import annotations

import pytest
import torch

from published import MASK_ID, context_inputs, save, specforge_dspark, tiny_target
from specbench.drafters.formats import load_published

TOL = 1e-5
N_CTX = 7


def reference_hidden(ref, target, features, anchors, n_ctx):
    """SpecForge's forward for one block after a context of n_ctx positions: every context
    position and every block slot visible (its inference call: attention_mask None)."""
    emb = target.model.model.embed_tokens.weight
    slots = ref.block_size
    block = torch.full((len(anchors), slots), MASK_ID)
    block[:, 0] = anchors
    positions = torch.arange(n_ctx + slots)[None].expand(len(anchors), -1)
    with torch.no_grad():
        return ref(position_ids=positions, noise_embedding=emb[block], target_hidden=features, attention_mask=None)


def suite_hidden(drafter, features, anchors):
    drafter.setup_cache(len(anchors), 64)
    drafter.append_context(features)
    return drafter.block_hidden(anchors)


@pytest.mark.parametrize("head,confidence,with_markov", [
    ("vanilla", True, True), ("gated", True, True), ("rnn", True, True), ("vanilla", True, False), (None, True, False),
])
def test_specforge_dspark_import(tmp_path, head, confidence, with_markov):
    target = tiny_target()
    rank = 6 if head else 0
    ref = specforge_dspark(markov_head_type=head or "vanilla", rank=rank, confidence=confidence, with_markov=with_markov)
    kind, drafter = load_published(str(save(ref, tmp_path / "d")), target)
    assert kind == "dspark" and drafter.block_size == 4 and drafter.first_slot == 0
    features, anchors = context_inputs(target, N_CTX)
    h_ref = reference_hidden(ref, target, features, anchors, N_CTX)
    h = suite_hidden(drafter, features, anchors)
    assert (h - h_ref).abs().max() <= TOL

    lm_head = target.model.lm_head.weight
    base_ref = h_ref @ lm_head.T
    assert (drafter.base_logits(h) - base_ref).abs().max() <= TOL * 10
    g = torch.Generator().manual_seed(5)
    prev = torch.cat([anchors[:, None], torch.randint(0, 64, (len(anchors), 3), generator=g)], dim=1)
    with torch.no_grad():
        corrected_ref = base_ref if ref.markov_head is None else ref.apply_logits_head(base_ref, prev_token_ids=prev, hidden_states=h_ref)
        conf_ref = ref.predict_confidence(h_ref, prev_token_ids=prev)
        # Left to right, greedy: SpecForge's own sampler feeds each argmax into the next step.
        if ref.markov_head is not None:
            tokens_ref, logits_ref = ref.markov_head.sample_block_tokens(base_ref, first_prev_token_ids=anchors,
                                                                         hidden_states=h_ref)
        else:
            tokens_ref, logits_ref = base_ref.argmax(-1), base_ref
    assert (drafter.teacher_forced_logits(h, prev) - corrected_ref).abs().max() <= TOL * 10
    assert (drafter.confidence_logits(h, prev) - conf_ref).abs().max() <= TOL
    tokens, probs, conf, logits = drafter.draft_block(anchors, None, 0.0, return_logits=True)
    assert torch.equal(tokens, tokens_ref)
    assert (logits - logits_ref).abs().max() <= TOL * 10
    # At T = 1 the drafted distributions are softmax of those same corrected logits.
    _, probs1, _, logits1 = drafter.draft_block(anchors, None, 1.0, generator=torch.Generator().manual_seed(0),
                                                return_logits=True)
    assert (probs1 - torch.softmax(logits1, -1)).abs().max() <= TOL
