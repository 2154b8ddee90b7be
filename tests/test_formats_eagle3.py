"""Conformance of the suite's loader with SpecForge's EAGLE-3 layout (`LlamaForCausalLMEagle3`):
a tiny random head built and saved with SpecForge's code gives, in the suite, the same outputs
and draft logits over its reduced draft vocabulary (d2t map) for three unrolled training-time-test
steps, and the same hidden state at the last committed entry through the inference cache."""
from __future__ import annotations

import pytest
import torch

from published import specforge_eagle3, reference_ttt, DIM, VOCAB, context_inputs, randomize, save, tiny_target
from specbench.drafters.formats import load_published

TOL = 1e-5
DRAFT_VOCAB = 40
STEPS = 3


@pytest.fixture
def no_compile(monkeypatch):
    # SpecForge's LlamaRMSNorm.forward is @torch.compile'd: run it eagerly (the same function).
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


@pytest.mark.parametrize("fc_norm", [False, True])
def test_specforge_eagle3_import(tmp_path, no_compile, fc_norm):
    target = tiny_target()
    ref = specforge_eagle3(fc_norm=fc_norm)
    kind, head = load_published(str(save(ref, tmp_path / "e")), target)
    assert kind == "eagle" and head.tap_layers == (0, 1, 2)
    T = 6
    features, _ = context_inputs(target, T, taps=[0, 1, 2])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, T), generator=g)
    outs_ref = reference_ttt(ref, features, tokens, STEPS)
    with torch.no_grad():
        outs = head.forward_ttt(features, tokens, STEPS)
    vocab = head.draft_vocab()
    assert torch.equal(vocab[0], torch.arange(DRAFT_VOCAB) + ref.d2t)
    for h, h_ref in zip(outs, outs_ref):
        assert (h - h_ref).abs().max() <= TOL
        logits, ids = head.draft_logits(h, vocab)
        with torch.no_grad():
            assert (logits - ref.compute_logits(h_ref)).abs().max() <= TOL * 10
        assert torch.equal(ids, vocab[0])
    # Inference path: the committed entries through the head's cache give step 0's last output.
    head.setup_cache(2, 64)
    next_tokens = torch.cat([tokens[:, 1:], tokens.new_zeros(2, 1)], dim=1)  # entry t carries x_{t+1}
    head.append_context(features, next_tokens, torch.full((2,), T))
    assert (head.h_last[:2] - outs_ref[0][:, -1]).abs().max() <= TOL
