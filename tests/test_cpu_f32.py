"""The fp32 kernels (specbench/engine/cpu_f32.py): the GEMV (F.linear's products to fp32 rounding) and
every decoder layer in one call (the per-module path's forward to fp32 rounding), each giving a row
the same bits alone or among others (so a verify forward computes each token as the AR step it
replaces), taken only where they apply. Collected only on a CPU with AVX2 + FMA (conftest.py)."""
import pytest
import torch

from specbench.engine import cpu_f32, cpu_kernels
from specbench.engine.core import forward_new_tokens
from specbench.engine.model import linear
from helpers import attention_reference, scattered_slot_cases
from tests.tiny import tiny_model


def test_builds_here():
    assert cpu_f32.available()


def test_products_match_float64_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    # the default target's projection shapes, odd sizes (k not a multiple of 8, n not of 3)
    for n, k in [(960, 576), (1536, 576), (576, 1536), (49152, 576), (37, 13), (5, 8), (1, 17)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(11, k, generator=g)
        y = cpu_f32.gemv(x, w)
        exact = (x.double() @ w.double().T)
        assert (y.double() - exact).abs().max() <= 1e-5 * k ** 0.5 * (1 + exact.abs().max())
        alone = torch.cat([cpu_f32.gemv(x[i:i + 1], w) for i in range(len(x))])
        assert torch.equal(alone, y)  # bits: a row's result does not depend on the rows beside it
        for m in range(9):  # the one-pass path (<= 8 rows) against the blocked one (11 rows); 0 rows too
            assert torch.equal(cpu_f32.gemv(x[:m], w), y[:m])
        threads = torch.get_num_threads()
        try:
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                assert torch.equal(cpu_f32.gemv(x[3:7], w), y[3:7])  # nor on the split over threads
        finally:
            torch.set_num_threads(threads)


def test_applies_to_decode_and_verify_forwards_only():
    w = torch.randn(16, 64)
    assert cpu_f32.applies(torch.randn(1, 1, 64), w)  # AR step
    assert cpu_f32.applies(torch.randn(4, 8, 64), w)  # verify at b = 4
    assert cpu_f32.applies(torch.randn(1, cpu_kernels.MAX_ATTEND_TOKENS, 64), w)  # a tree
    assert not cpu_f32.applies(torch.randn(1, cpu_kernels.MAX_ATTEND_TOKENS + 1, 64), w)  # prefill: F.linear
    assert cpu_f32.applies(torch.randn(cpu_f32.MAX_FLAT_ROWS, 64), w)
    assert not cpu_f32.applies(torch.randn(cpu_f32.MAX_FLAT_ROWS + 1, 64), w)
    assert not cpu_f32.applies(torch.randn(1, 1, 64).bfloat16(), w.bfloat16())  # bf16: cpu_kernels' business
    assert not cpu_f32.applies(torch.randn(1, 1, 64), w.T)  # a non-contiguous weight
    x = torch.randn(1, 1, 64, requires_grad=True)
    assert not cpu_f32.applies(x, w)  # training: F.linear, which has a backward
    with torch.no_grad():
        assert cpu_f32.applies(x, w)
    cpu_kernels.ENABLED = False
    try:
        assert not cpu_f32.applies(torch.randn(1, 1, 64), w)  # SPECBENCH_CPU_KERNELS=0
        assert torch.equal(linear(torch.ones(1, 1, 64), w), torch.nn.functional.linear(torch.ones(1, 1, 64), w))
    finally:
        cpu_kernels.ENABLED = True


# ---- every decoder layer in one call (cpu_f32.decoder_layers) ---------------------------------------

def _counting(monkeypatch):
    calls = []
    layers = cpu_f32.decoder_layers
    monkeypatch.setattr(cpu_f32, "decoder_layers", lambda *a: calls.append(tuple(a[0].shape)) or layers(*a))
    return calls


def _prefilled(model, prefix):
    b = prefix.shape[0]
    model.setup_cache(b, 96)
    for layer in model.model.layers:
        layer.self_attn.k_cache.zero_()
        layer.self_attn.v_cache.zero_()
    forward_new_tokens(model, prefix, torch.zeros(b, dtype=torch.long))


@pytest.mark.parametrize("b,q", [(1, 8), (1, 20), (16, 5)])
def test_a_verify_forward_gives_the_bits_of_the_ar_steps_it_replaces(b, q, monkeypatch):
    """A forward over q new tokens a row and q forwards of one token give identical logits, taps and
    caches: what keeps greedy speculative decoding token-identical to AR in fp32 (chain verify at
    b = 1, a tree-sized verify, a chain verify at load)."""
    model = tiny_model(vocab=96, dim=256, layers=2, seed=3)  # 4 heads of 64
    calls = _counting(monkeypatch)
    g = torch.Generator().manual_seed(b * 100 + q)
    prefix, new = torch.randint(0, 96, (b, 70), generator=g), torch.randint(0, 96, (b, q), generator=g)
    at = torch.full((b,), 70, dtype=torch.long)
    with torch.inference_mode():
        _prefilled(model, prefix)  # 70 tokens a row: a prefill, torch's ops
        assert not calls
        logits, taps, hidden = forward_new_tokens(model, new, at, taps=(0, 1))
        caches = [layer.self_attn.k_cache[:, :, :70 + q].clone() for layer in model.model.layers]
        assert calls == [(b, q, 256)]
        _prefilled(model, prefix)
        steps = [forward_new_tokens(model, new[:, i:i + 1], at + i, taps=(0, 1)) for i in range(q)]
    assert torch.equal(logits, torch.cat([s[0] for s in steps], 1))
    assert torch.equal(taps, torch.cat([s[1] for s in steps], 1))
    assert torch.equal(hidden, torch.cat([s[2] for s in steps], 1))
    assert all(torch.equal(c, layer.self_attn.k_cache[:, :, :70 + q]) for c, layer in zip(caches, model.model.layers))


def test_one_call_is_the_per_module_path_to_fp32_rounding(monkeypatch):
    """The one call computes what DecoderLayer.forward's torch ops do (SDPA, F.silu, ...), to fp32
    rounding: logits, taps and the K/V written."""
    from specbench.engine import model as model_module

    model = tiny_model(vocab=96, dim=256, layers=3, seed=4, scale=4.0)
    calls = _counting(monkeypatch)
    prefix, new = torch.randint(0, 96, (3, 70)), torch.randint(0, 96, (3, 6))
    lengths = torch.tensor([70, 68, 66])  # ragged rows

    def run(fused):
        monkeypatch.setattr(model_module, "FUSED_LAYERS", fused)
        with torch.inference_mode():
            _prefilled(model, prefix)
            out = forward_new_tokens(model, new, lengths, taps=(2, 0))
            return out, [layer.self_attn.v_cache.clone() for layer in model.model.layers]

    (logits, taps, _), caches = run(True)
    assert calls == [(3, 6, 256)]
    (ref_logits, ref_taps, _), ref_caches = run(False)
    assert len(calls) == 1
    assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
    assert (taps - ref_taps).abs().max() <= 1e-4 * ref_taps.abs().max()
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert all((c - r).abs().max() <= 1e-4 * r.abs().max() for c, r in zip(caches, ref_caches))


@pytest.mark.parametrize("b,nh,nkv,q,hd,kv_len", [(1, 9, 3, 1, 64, 320), (1, 9, 3, 8, 64, 77), (2, 8, 2, 3, 128, 203),
                                                  (3, 4, 4, 8, 64, 16), (1, 9, 3, 20, 64, 90)])
@torch.inference_mode()
def test_attention_is_exact_to_fp32_rounding_and_row_invariant(b, nh, nkv, q, hd, kv_len):
    g = torch.Generator().manual_seed(kv_len)
    xq = torch.randn(b, nh, q, hd, generator=g) * 2
    keys, values = (torch.randn(b + 1, nkv, kv_len + 5, hd, generator=g) for _ in range(2))
    mask = torch.rand(b, q, kv_len, generator=g) < 0.7
    mask[:, :, 0] = True
    mask[0, -1, :] = False  # a query that sees nothing: zeros
    out = cpu_f32.attend(xq, keys, values, mask)
    ref = attention_reference(xq, keys, values, mask, torch.float64).nan_to_num(0.0)
    assert (out.double() - ref).abs().max() <= 1e-5
    assert torch.equal(out[0, -1], torch.zeros(nh * hd))
    for r in range(b):  # a row's bits: alone, one token at a time, with a shorter cache past its last visible key
        for t in range(q):
            last = int(mask[r, t].nonzero().max()) + 1 if mask[r, t].any() else 1
            one = cpu_f32.attend(xq[r:r + 1, :, t:t + 1].contiguous(), keys[r:r + 1], values[r:r + 1],
                                 mask[r:r + 1, t:t + 1, :last].contiguous())
            assert torch.equal(one[0, 0], out[r, t])


@torch.inference_mode()
def test_attention_bits_depend_on_the_keys_a_query_sees_not_on_their_slots():
    """A tree node sees the prefix and its ancestors at scattered slots; the AR step that computes the
    same token saw the same keys in consecutive slots. Same keys in the same order: same bits."""
    for xq, keys, values, scattered, packed_keys, packed_values, consecutive in scattered_slot_cases(torch.float32):
        assert torch.equal(cpu_f32.attend(xq, keys, values, scattered),
                           cpu_f32.attend(xq, packed_keys, packed_values, consecutive))


@pytest.mark.parametrize("branching", [(4, 4), (3, 3, 3)])  # 20 and 39 draft nodes
def test_a_tree_verify_takes_the_one_call_and_stays_token_identical_to_ar(branching, monkeypatch):
    """Greedy tree decoding with the target drafting for itself (deep paths accepted, ancestors at
    scattered slots, then moved to consecutive ones) gives AR's tokens in fp32."""
    import copy

    from specbench.engine.core import SamplingConfig, generate
    from specbench.engine.policy import Policy
    from tests.tiny import random_prompts
    from tests.tree_policy import TreeDraft

    target = tiny_model(vocab=96, dim=256, layers=2, seed=6, scale=2.0)
    calls = _counting(monkeypatch)
    prompts = random_prompts(6, 96, seed=7)
    config = SamplingConfig(max_new_tokens=16)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    policy = TreeDraft(copy.deepcopy(target), branching=branching)
    out = [generate(target, policy, [p], config).requests[0] for p in prompts]
    assert [r.output_ids for r in out] == reference
    assert max(c[1] for c in calls) == 1 + policy.max_draft <= cpu_kernels.MAX_ATTEND_TOKENS
    assert sum(r.tau for r in out) / len(out) > 2


def test_the_one_call_applies_only_where_every_layer_can_take_it(monkeypatch):
    calls = _counting(monkeypatch)
    model = tiny_model(vocab=96, dim=256, layers=2)
    with torch.inference_mode():
        model.setup_cache(2, 128)
        forward_new_tokens(model, torch.randint(0, 96, (2, cpu_kernels.MAX_ATTEND_TOKENS + 1)),
                           torch.zeros(2, dtype=torch.long))
        assert not calls  # a prefill longer than a decode or verify forward: torch's ops
        forward_new_tokens(model, torch.randint(0, 96, (2, 1)), torch.full((2,), 65, dtype=torch.long))
        assert calls == [(2, 1, 256)]
    for other in (tiny_model(vocab=96, dim=64, layers=2),  # head size 16
                  tiny_model(vocab=96, dim=256, layers=2, qk_norm=True),
                  tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)):
        with torch.inference_mode():
            other.setup_cache(1, 16)
            forward_new_tokens(other, torch.randint(0, 96, (1, 1)), torch.zeros(1, dtype=torch.long))
    assert len(calls) == 1
    x = torch.randn(1, 1, 256, requires_grad=True)  # training: torch's ops, which have a backward
    assert not cpu_f32.decoder_layers_apply(model.args, x, torch.ones(1, 1, 1, dtype=torch.bool))
    with torch.no_grad():
        assert cpu_f32.decoder_layers_apply(model.args, x, torch.ones(1, 1, 1, dtype=torch.bool))
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(True)  # a weight being trained
    with torch.no_grad():
        forward_new_tokens(model, torch.randint(0, 96, (2, 1)), torch.full((2,), 66, dtype=torch.long))
    assert len(calls) == 2  # under no_grad the weight's flag does not matter
    forward_new_tokens(model, torch.randint(0, 96, (2, 1)), torch.full((2,), 67, dtype=torch.long))
    assert len(calls) == 2  # grad enabled and a weight that wants it: torch's ops
