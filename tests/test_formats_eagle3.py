"""Conformance of the suite's loader with SpecForge's EAGLE-3 layout (`LlamaForCausalLMEagle3`):
a tiny random head built and saved with SpecForge's code gives, in the suite, the same outputs
and draft logits over its reduced draft vocabulary (d2t map) for three unrolled training-time-test
steps, and the same hidden state at the last committed entry through the inference cache."""
from __future__ import annotations

import pytest
import torch

from published import DIM, VOCAB, context_inputs, randomize, save, tiny_target
from specbench.formats import load_published

TOL = 1e-5
DRAFT_VOCAB = 40
STEPS = 3


@pytest.fixture
def no_compile(monkeypatch):
    # SpecForge's LlamaRMSNorm.forward is @torch.compile'd: run it eagerly (the same function).
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


def specforge_eagle3(seed=4, fc_norm=False):
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.draft_vocab_size = DRAFT_VOCAB
    cfg.fc_norm = fc_norm
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    model = randomize(LlamaForCausalLMEagle3(cfg), seed, std=0.1)  # O(1) activations: fp32 rounding ≪ 1e-5
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # SpecForge's d2t: id − index
    model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
    model.t2d.zero_()
    model.t2d[ids] = True
    return model


def reference_ttt(ref, features, tokens, steps):
    """SpecForge's training-time test: step i feeds step i−1's output with the tokens shifted by i,
    its attention caching every step's keys (cache_hidden)."""
    B, T, _ = features.shape
    padded = torch.cat([tokens, tokens.new_zeros(B, steps + 1)], dim=1)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    positions = torch.arange(T)[None].expand(B, T)
    hidden = ref.project_hidden_states(features)
    cache = [[], []]
    outs = []
    with torch.no_grad():
        for i in range(steps):
            emb = ref.embed_input_ids(padded[:, 1 + i : T + 1 + i])
            hidden = ref.backbone(emb, hidden, cache, mask, positions)
            outs.append(hidden)
    return outs


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
