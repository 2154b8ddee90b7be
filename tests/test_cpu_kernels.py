"""The bf16 CPU kernels (specbench/engine/cpu_kernels.py): the GEMV as accurate as F.linear, the same
bits for a row whatever the number of rows beside it, used by `linear` exactly where it applies and
never with a stale pack; the fused norm / rope / cache ops equal to torch's ops they replace.
Collected only on a CPU with AVX-512 BF16 (conftest.py); elsewhere torch's routes run, which every
other test covers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbench.engine import cpu_kernels
from specbench.engine.core import forward_new_tokens
from specbench.engine.model import RMSNorm, apply_rope, fresh_pack, linear, pack_weight, rope_cos_sin
from helpers import attention_reference, scattered_slot_cases
from tests.tiny import tiny_model



def test_the_kernels_build_on_this_cpu():
    """This module is collected only on a CPU with AVX-512 BF16 (conftest.py); there the kernels
    must build (g++ and ninja are part of the set-up), or every bf16 step silently runs slower."""
    assert cpu_kernels.available()
    assert cpu_kernels.max_rows() in (cpu_kernels.MAX_ROWS_AMX, cpu_kernels.MAX_ROWS_AVX512)


@pytest.fixture(autouse=True)
def _built():
    if not cpu_kernels.available():
        pytest.fail("the bf16 CPU kernels did not build (see test_the_kernels_build_on_this_cpu)")


def _record_one_call_forwards(monkeypatch) -> list[tuple[int, int]]:
    """Transformer.forward's one-call routes in bf16 (cpu_kernels.decoder_forward: the whole forward;
    cpu_kernels.decoder_layers: the layers alone, where the final norm is off the kernels) patched to
    record each call's (rows, tokens a row); returns that list."""
    calls = []
    forward, layers = cpu_kernels.decoder_forward, cpu_kernels.decoder_layers
    monkeypatch.setattr(cpu_kernels, "decoder_forward", lambda *a: calls.append(tuple(a[0].shape[:2])) or forward(*a))
    monkeypatch.setattr(cpu_kernels, "decoder_layers", lambda *a: calls.append(tuple(a[0].shape[:2])) or layers(*a))
    return calls


def _relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.float() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("n,k", [(96, 64), (100, 64), (7, 18), (49, 576), (33, 1536)])
def test_kernel_is_as_accurate_as_f_linear_and_row_invariant(n, k):
    torch.manual_seed(n * k)
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = cpu_kernels.pack(w)
    assert packed.shape == (-(-n // 32), k // 2, 32, 2)
    for m in (1, 2, 5, 8, 13, 16, 21, 40, 64):  # beyond 8 (AVX-512) or 16 (AMX) rows: more passes; AMX pairs 16-row chunks
        x = torch.randn(m, k).to(torch.bfloat16)
        y = cpu_kernels.gemv(x, packed, n)
        exact = x.double() @ w.double().T
        # fp32 sums of exact bf16 products, rounded once to bf16: within F.linear's own error
        assert _relative_error(y, exact) <= 2 * _relative_error(F.linear(x, w), exact) + 1e-2
        alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], packed, n) for i in range(m)])
        assert torch.equal(y, alone), f"rows changed bits in a batch of {m}"
        assert torch.equal(cpu_kernels.gemv(x.view(1, m, k), packed, n), y.view(1, m, n))  # leading shape kept


def test_padding_rows_of_the_last_block_are_never_written():
    w = torch.randn(40, 32).to(torch.bfloat16)  # 40 = one full block + 8 features of a padded one
    y = cpu_kernels.gemv(torch.randn(3, 32).to(torch.bfloat16), cpu_kernels.pack(w), 40)
    assert y.shape == (3, 40) and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("k", [64, 48])  # 48: not a multiple of 32, so never AMX: at most 8 rows
def test_linear_takes_the_kernel_up_to_max_rows_and_torch_above(k):
    torch.manual_seed(0)
    w = torch.randn(64, k).to(torch.bfloat16)
    packs = pack_weight(w)
    assert packs.gemv is not None and packs.gemm is not None
    limit = cpu_kernels.max_rows() if k % 32 == 0 else cpu_kernels.MAX_ROWS_AVX512
    assert limit in (cpu_kernels.MAX_ROWS_AMX, cpu_kernels.MAX_ROWS_AVX512)
    few = torch.randn(limit, k).to(torch.bfloat16)
    many = torch.randn(limit + 1, k).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(few, w, None, packs), cpu_kernels.gemv(few, packs.gemv, 64))
        assert torch.equal(linear(many, w, None, packs), F.linear(many, w))  # oneDNN's GEMM: F.linear's bits
        assert torch.equal(cpu_kernels.gemv(many, packs.gemv, 64)[:1], cpu_kernels.gemv(many[:1], packs.gemv, 64))
        bias = torch.randn(64).to(torch.bfloat16)
        assert torch.equal(linear(few, w, bias, packs), cpu_kernels.gemv(few, packs.gemv, 64) + bias)
        cpu_kernels.ENABLED = False
        try:
            assert torch.equal(linear(few[:1], w, None, packs), F.linear(few[:1], w))  # torch.mv: F.linear's bits
        finally:
            cpu_kernels.ENABLED = True
    x = few.clone().requires_grad_(True)  # a gradient must reach x: torch's route, which has a backward
    linear(x, w, None, packs).sum().backward()
    assert x.grad is not None


def test_a_stale_pack_is_never_used():
    model = tiny_model(dtype=torch.bfloat16)
    head = model.lm_head
    assert head.gemm_pack.gemv is not None
    x = torch.randn(1, 2, model.args.dim).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(0.5)
    assert fresh_pack(head.weight, head.gemm_pack) is None
    with torch.inference_mode():
        assert torch.equal(head(x), F.linear(x, head.weight))


@pytest.mark.parametrize("dim", [64, 256])  # head size 16: SDPA; 64: the attention kernel too
def test_verify_forward_gives_the_bits_of_the_ar_steps_it_replaces(dim, monkeypatch):
    """At b = 1 a forward over q tokens and q forwards of one token give identical logits in bf16:
    the property that keeps a greedy speculative policy token-identical to AR in bf16 at b = 1."""
    model = tiny_model(vocab=96, dim=dim, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    attend = cpu_kernels.attend
    monkeypatch.setattr(cpu_kernels, "attend", lambda *a: calls.append(a[0].shape) or attend(*a))
    prefix = torch.randint(0, 96, (1, 11))
    new = torch.randint(0, 96, (1, cpu_kernels.MAX_ROWS_AVX512))

    def prefilled():
        model.setup_cache(1, 64)
        forward_new_tokens(model, prefix, torch.zeros(1, dtype=torch.long))

    with torch.inference_mode():
        prefilled()
        together = forward_new_tokens(model, new, torch.full((1,), 11, dtype=torch.long))[0]
        prefilled()
        steps = torch.cat([forward_new_tokens(model, new[:, i:i + 1], torch.full((1,), 11 + i, dtype=torch.long))[0]
                           for i in range(new.shape[1])], dim=1)
    assert torch.equal(together, steps)
    assert bool(calls) == (dim == 256)  # the kernels took the verify and the steps where they apply


def test_a_batched_verify_forward_gives_the_bits_of_the_ar_steps_it_replaces(monkeypatch):
    """b = 16 rows verifying 5 tokens each (80 rows: a chain verify at load), and 48 rows of 40 tokens
    (1 920 rows: EAGLE trees at load), compute each row as the AR steps of the same rows do: decode and
    verify forwards take the kernels at any number of rows."""
    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    b, q = 16, 5
    prefix = torch.randint(0, 96, (b, 6))
    new = torch.randint(0, 96, (b, q))
    lengths = torch.full((b,), 6, dtype=torch.long)

    def prefilled():
        model.setup_cache(b, 32)
        forward_new_tokens(model, prefix, torch.zeros(b, dtype=torch.long))

    with torch.inference_mode():
        prefilled()
        together = forward_new_tokens(model, new, lengths)[0]
        prefilled()
        steps = torch.cat([forward_new_tokens(model, new[:, i:i + 1], lengths + i)[0] for i in range(q)], dim=1)
    assert torch.equal(together, steps)
    assert (b, q) in calls
    b, q = 48, 40
    prefix, new = torch.randint(0, 96, (b, 3)), torch.randint(0, 96, (b, q))
    lengths = torch.full((b,), 3, dtype=torch.long)
    with torch.inference_mode():
        model.setup_cache(b, 48)
        forward_new_tokens(model, prefix, torch.zeros(b, dtype=torch.long))
        together = forward_new_tokens(model, new, lengths)[0]
        model.setup_cache(b, 48)
        forward_new_tokens(model, prefix, torch.zeros(b, dtype=torch.long))
        steps = torch.cat([forward_new_tokens(model, new[:, i:i + 1], lengths + i)[0] for i in range(q)], dim=1)
    assert torch.equal(together, steps) and (b, q) in calls


@pytest.mark.parametrize("nh,nkv,q,hd,kv_len", [(9, 3, 1, 64, 320), (9, 3, 4, 64, 260), (9, 3, 8, 64, 77),
                                                (8, 2, 3, 128, 200), (4, 4, 8, 64, 16)])
@torch.inference_mode()
def test_attention_kernel_is_as_accurate_as_sdpa_and_row_invariant(nh, nkv, q, hd, kv_len):
    torch.manual_seed(3)
    b, max_seq = max(1, min(2, cpu_kernels.max_rows() // q)), kv_len + 40  # within the rows the kernel takes here
    xq = torch.randn(b, nh, q, hd).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(b + 1, nkv, max_seq, hd).to(torch.bfloat16) for _ in range(2))
    mask = torch.rand(b, q, kv_len) < 0.7
    mask[..., 0] = True
    assert cpu_kernels.attend_applies(xq, k_cache, v_cache, mask)
    out = cpu_kernels.attend(xq, k_cache, v_cache, mask)
    exact = attention_reference(xq, k_cache, v_cache, mask, torch.float32)
    group = nh // nkv
    sdpa = F.scaled_dot_product_attention(xq, k_cache[:b, :, :kv_len].repeat_interleave(group, 1),
                                          v_cache[:b, :, :kv_len].repeat_interleave(group, 1), attn_mask=mask[:, None])
    sdpa_error = float((sdpa.transpose(1, 2).reshape(b, q, nh * hd).float() - exact).abs().max())
    assert float((out.float() - exact).abs().max()) <= max(sdpa_error, 2 ** -8)
    for r in range(b):  # each token of each row alone, over a longer cache whose extra slots are masked
        for t in range(q):
            longer = torch.cat([mask[r:r + 1, t:t + 1], torch.zeros(1, 1, 40, dtype=torch.bool)], dim=-1)
            alone = cpu_kernels.attend(xq[r:r + 1, :, t:t + 1].contiguous(), k_cache[r:], v_cache[r:], longer)
            assert torch.equal(alone[0, 0], out[r, t])
    nothing = torch.zeros(1, 1, kv_len, dtype=torch.bool)  # a query that sees no slot: zeros, not NaN
    assert not cpu_kernels.attend(xq[:1, :, :1].contiguous(), k_cache, v_cache, nothing).any()
    assert not cpu_kernels.attend_applies(torch.zeros(1, nh, cpu_kernels.MAX_ATTEND_TOKENS + 1, hd, dtype=torch.bfloat16),
                                          k_cache, v_cache, mask[:1])
    many = 600 // q + 1  # a decode or verify forward takes the kernel at any number of rows
    assert cpu_kernels.attend_applies(xq[:1].expand(many, -1, -1, -1), k_cache[:1].expand(many, -1, -1, -1),
                                      v_cache[:1].expand(many, -1, -1, -1), mask[:1].expand(many, -1, -1))
    assert not cpu_kernels.attend_applies(torch.zeros(1, nh, cpu_kernels.MAX_ATTEND_TOKENS + 1, hd, dtype=torch.bfloat16),
                                          k_cache, v_cache, mask)


@torch.inference_mode()
def test_attention_bits_depend_on_the_keys_a_query_sees_not_on_their_slots():
    """A tree node sees the prefix and its ancestors at scattered slots; the AR step that computes
    the same token saw the same keys in consecutive slots. Same keys in the same order: same bits."""
    for xq, keys, values, scattered, packed_keys, packed_values, consecutive in scattered_slot_cases(torch.bfloat16):
        assert torch.equal(cpu_kernels.attend(xq, keys, values, scattered),
                           cpu_kernels.attend(xq, packed_keys, packed_values, consecutive))


@pytest.mark.parametrize("branching", [(4, 4), (3, 3, 3)])  # 20 and 39 draft nodes: more than a chain verifies
def test_a_tree_verify_takes_the_kernels_and_stays_token_identical_to_ar(branching, monkeypatch):
    """Greedy tree decoding (the target drafting for itself, so paths are accepted deep and a node's
    ancestors sit at scattered slots) gives AR's tokens in bf16: the tree's verify forward takes the
    kernels of the AR steps (up to MAX_ATTEND_TOKENS tokens a row), whose bits are a row's own."""
    import copy

    from specbench.engine.core import SamplingConfig, generate
    from specbench.engine.policy import Policy
    from tests.tiny import random_prompts
    from tests.tree_policy import TreeDraft

    target = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    prompts = random_prompts(6, 96, seed=7)
    config = SamplingConfig(max_new_tokens=16)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    policy = TreeDraft(copy.deepcopy(target), branching=branching)
    out = [generate(target, policy, [p], config).requests[0] for p in prompts]
    assert [r.output_ids for r in out] == reference
    assert max(q for _, q in calls) == 1 + policy.max_draft <= cpu_kernels.MAX_ATTEND_TOKENS
    assert sum(r.tau for r in out) / len(out) > 2  # paths were accepted below the first level


def _torch_routes(fn):
    cpu_kernels.ENABLED = False
    try:
        return fn()
    finally:
        cpu_kernels.ENABLED = True


@torch.inference_mode()
def test_norms_match_torch_to_a_rounding_and_the_residual_add_exactly():
    torch.manual_seed(1)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.copy_(torch.rand(576) + 0.5)
    x, delta = torch.randn(3, 5, 576).to(torch.bfloat16), torch.randn(3, 5, 576).to(torch.bfloat16)
    fused, reference = norm(x), _torch_routes(lambda: norm(x))
    # the sum of squares runs in another order: at most one bf16 rounding step apart
    assert torch.allclose(fused.float(), reference.float(), rtol=2 ** -7, atol=0)
    assert (fused != reference).float().mean() < 0.05
    total, normed = cpu_kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta))
    assert torch.equal(cpu_kernels.rms_norm(x[1:2, 3:4], norm.weight, norm.eps), fused[1:2, 3:4])  # row alone


@torch.inference_mode()
def test_qkv_rope_cache_gives_torchs_bits_and_writes_each_rows_slots():
    torch.manual_seed(2)
    b, q, nh, nkv, hd, max_seq = 3, 4, 6, 2, 16, 32
    qkv = torch.randn(b, q, (nh + 2 * nkv) * hd).to(torch.bfloat16)
    positions = torch.randint(0, 200, (b, q))
    slots = torch.stack([torch.randperm(max_seq)[:q] for _ in range(b)])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    cos, sin = rope_cos_sin(inv_freq, positions, torch.bfloat16)
    k_cache, v_cache = torch.zeros(b + 1, nkv, max_seq, hd, dtype=torch.bfloat16), torch.zeros(b + 1, nkv, max_seq, hd,
                                                                                                 dtype=torch.bfloat16)
    xq = cpu_kernels.qkv_rope_cache(qkv, cos, sin, slots, k_cache, v_cache, nh, nkv, hd)
    tq, tk, tv = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    tq, tk = apply_rope(tq.reshape(b, q, nh, hd), cos, sin), apply_rope(tk.reshape(b, q, nkv, hd), cos, sin)
    assert torch.equal(xq, tq.transpose(1, 2))
    rows = torch.arange(b)[:, None]
    assert torch.equal(k_cache[rows, :, slots], tk) and torch.equal(v_cache[rows, :, slots], tv.reshape(b, q, nkv, hd))
    written = torch.zeros(b + 1, max_seq, dtype=torch.bool)
    written[rows, slots] = True
    assert not k_cache.permute(0, 2, 1, 3)[~written].any() and not v_cache.permute(0, 2, 1, 3)[~written].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.qkv_rope_cache(qkv, cos, sin, slots + max_seq, k_cache, v_cache, nh, nkv, hd)


def test_a_forward_with_the_kernels_is_torchs_to_bf16_rounding():
    model = tiny_model(vocab=96, dim=64, layers=2, scale=4.0, dtype=torch.bfloat16)
    tokens = torch.randint(0, 96, (2, 6))

    def logits():
        with torch.inference_mode():
            model.setup_cache(2, 32)
            return forward_new_tokens(model, tokens, torch.zeros(2, dtype=torch.long))[0].float()

    fused, reference = logits(), _torch_routes(logits)
    assert (fused - reference).abs().max() <= 0.05 * reference.abs().max()
    assert (fused.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("b, q", [(1, 1), (1, 8), (2, 3), (8, 1)])
def test_all_layers_in_one_call_give_the_bits_of_the_per_module_path(b, q, monkeypatch):
    """model.FUSED_LAYERS: cpu_kernels.decoder_layers runs every layer in one call. Logits, taps,
    the final hidden state and every K/V-cache entry must be bit-identical to DecoderLayer.forward's
    kernel routes, or greedy identity between policies would hang on which path a forward took."""
    from specbench.engine import model as model_module

    model = tiny_model(vocab=96, dim=256, layers=3, dtype=torch.bfloat16)  # head size 64: attention kernel
    prefix = torch.randint(0, 96, (b, 9))
    new = torch.randint(0, 96, (b, q))
    lengths = torch.tensor([9 - (r % 3) for r in range(b)])  # ragged rows
    calls = _record_one_call_forwards(monkeypatch)

    def run(fused: bool):
        monkeypatch.setattr(model_module, "FUSED_LAYERS", fused)
        with torch.inference_mode():
            model.setup_cache(b, 64)
            for layer in model.model.layers:
                layer.self_attn.k_cache.zero_()
                layer.self_attn.v_cache.zero_()
            forward_new_tokens(model, prefix, torch.zeros(b, dtype=torch.long))
            out = forward_new_tokens(model, new, lengths, taps=(2, 0))
            caches = [t.clone() for layer in model.model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
        return out, caches

    # The forward over new tokens, and the 9-token prefill where the one call takes it (never: more
    # tokens per row than the attention kernel's; the shape rule says so on every machine kind).
    expected = 1 + cpu_kernels.decoder_layers_apply(model.args, b * 9, 9)
    (logits, taps, hidden), caches = run(True)
    assert len(calls) == expected
    (ref_logits, ref_taps, ref_hidden), ref_caches = run(False)
    assert len(calls) == expected  # the per-module path never calls it
    assert torch.equal(logits, ref_logits) and torch.equal(taps, ref_taps) and torch.equal(hidden, ref_hidden)
    assert taps.shape[-1] == 2 * 256
    assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches))


def test_all_layers_in_one_call_leave_their_input_alone_and_give_each_tap_its_own_tensor():
    """decoder_layers_bf16 updates the residual stream in a buffer of its own: the caller's x is not
    written, and a tapped layer's output is not overwritten by the layers after it."""
    model = tiny_model(vocab=96, dim=256, layers=3, dtype=torch.bfloat16)
    a = model.args
    with torch.inference_mode():
        model.setup_cache(1, 64)
        forward_new_tokens(model, torch.randint(0, 96, (1, 4)), torch.zeros(1, dtype=torch.long))
        lists = model._build_kernel_stack()
        assert lists is not None
        x = torch.randn(1, 1, a.dim).to(torch.bfloat16)
        before = x.clone()
        cos_table, sin_table = model.rope_tables(torch.bfloat16)
        cos, sin = cos_table[4:5].reshape(1, 1, 1, -1), sin_table[4:5].reshape(1, 1, 1, -1)
        last, tapped = cpu_kernels.decoder_layers(x, *lists, cos, sin, torch.tensor([[4]]),
                                                  torch.ones(1, 1, 5, dtype=torch.bool), a.norm_eps, a.n_heads,
                                                  a.n_kv_heads, a.head_dim, a.intermediate_size, [0, 1])
    assert torch.equal(x, before)
    assert len(tapped) == 2 and not torch.equal(tapped[0], tapped[1]) and not torch.equal(tapped[1], last)


def test_all_layers_in_one_call_apply_only_where_every_layer_takes_the_kernels(monkeypatch):
    """A prefill, fp32 (cpu_f32's one call, not this one), or one layer's stale pack: not this call; a
    decode step at any number of rows takes it."""
    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    with torch.inference_mode():
        model.setup_cache(1, 128)
        # a prefill: more tokens a row than a decode or verify forward has
        forward_new_tokens(model, torch.randint(0, 96, (1, cpu_kernels.MAX_ATTEND_TOKENS + 1)), torch.zeros(1, dtype=torch.long))
        assert not calls
        many = 300  # a decode step over many rows
        model.setup_cache(many, 16)
        forward_new_tokens(model, torch.randint(0, 96, (many, 1)), torch.zeros(many, dtype=torch.long))
        assert len(calls) == 1
        calls.clear()
        model.setup_cache(1, 128)
        forward_new_tokens(model, torch.randint(0, 96, (1, 1)), torch.zeros(1, dtype=torch.long))
        assert len(calls) == 1
    with torch.no_grad():  # an in-place write makes layer 1's MLP packs stale
        model.model.layers[1].mlp.down_proj.weight.mul_(1.0)
    with torch.inference_mode():
        forward_new_tokens(model, torch.randint(0, 96, (1, 1)), torch.zeros(1, dtype=torch.long))
    assert len(calls) == 1
    fp32 = tiny_model(vocab=96, dim=256, layers=2)
    with torch.inference_mode():
        fp32.setup_cache(1, 16)
        forward_new_tokens(fp32, torch.randint(0, 96, (1, 1)), torch.zeros(1, dtype=torch.long))
    assert len(calls) == 1


def test_a_drafters_block_pass_in_one_call_is_the_sdpa_path_to_bf16_rounding(monkeypatch):
    """dspark.FUSED_BLOCK: a DSpark block pass on the kernels (the block's K/V written after each
    row's context, visible to the whole block) computes the SDPA path's function: hidden states
    to bf16 rounding, the same greedy drafts, the context part of the cache left as it was, and a
    later append and block pass unaffected by the scratch entries."""
    from specbench.drafters import dspark
    from specbench.drafters.dspark import DSparkArgs, build_drafter

    target = tiny_model(vocab=96, dim=256, layers=3, dtype=torch.bfloat16)  # head size 64
    args = DSparkArgs.for_target(target.args, tap_layers=[0, 1, 2], n_layers=2, block_size=4, markov_rank=8)
    drafter = build_drafter(args, target).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1 and p.shape[0] == 256
                    else 0.2 * torch.randn(p.shape, generator=g))
    calls = []
    layers = cpu_kernels.decoder_layers
    monkeypatch.setattr(cpu_kernels, "decoder_layers", lambda *a: calls.append(1) or layers(*a))
    feats = torch.randn(2, 12, 3 * 256, generator=g).bfloat16()
    anchors = torch.tensor([7, 42])

    def two_rounds(fused: bool):
        monkeypatch.setattr(dspark, "FUSED_BLOCK", fused)
        with torch.inference_mode():
            drafter.setup_cache(2, 32)
            drafter.append_context(feats, torch.tensor([12, 9]))
            context = [c[:, :, :9].clone() for c in drafter.k_cache + drafter.v_cache]
            h1 = drafter.block_hidden(anchors)
            tokens1 = drafter.draft_block(anchors, None, temperature=0.0)[0]
            unchanged = all(torch.equal(c[:, :, :9], ref) for c, ref in zip(drafter.k_cache + drafter.v_cache, context))
            drafter.append_context(feats[:, :3], torch.tensor([2, 3]))
            h2 = drafter.block_hidden(anchors)
        return h1.float(), h2.float(), tokens1, unchanged

    fused = two_rounds(True)
    assert len(calls) == 3  # two block passes and the draft
    reference = two_rounds(False)
    assert len(calls) == 3
    assert fused[3] and reference[3]
    for h, ref in zip(fused[:2], reference[:2]):
        assert (h - ref).abs().max() <= 0.03 * ref.abs().max()
    assert (fused[2] == reference[2]).float().mean() >= 0.75


def test_the_one_call_stack_is_rebuilt_when_anything_it_read_changes(monkeypatch):
    """Transformer._kernel_stack keeps its per-layer checks' outcome while nothing they read changed.
    A write through a view (q_proj.weight of the packed q|k|v), a replaced parameter or new caches
    must each be noticed: stale packs take the per-module path, and a forward after setup_cache
    writes the new caches, with the bits of the per-module path."""
    from specbench.engine import model as model_module

    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    step = lambda: forward_new_tokens(model, torch.tensor([[5]]), torch.tensor([3]))  # noqa: E731
    with torch.inference_mode():
        model.setup_cache(1, 16)
        step()
        kept = model._stack_cache
        step()
        assert len(calls) == 2 and model._stack_cache is kept  # nothing changed: the checks' outcome reused
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.0)  # bumps the packed q|k|v's version
    with torch.inference_mode():
        step()
        assert len(calls) == 2  # stale q|k|v pack: the per-module path
    model.pack_weights()
    with torch.inference_mode():
        step()
        assert len(calls) == 3
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach().clone(), requires_grad=False)  # a replaced parameter
    with torch.inference_mode():
        step()
        assert len(calls) == 3
    model.pack_weights()
    with torch.inference_mode():
        model.setup_cache(2, 32)  # new cache tensors
        fused = step()
        cache = model.model.layers[1].self_attn.k_cache[0, :, 3].clone()
        monkeypatch.setattr(model_module, "FUSED_LAYERS", False)
        model.model.layers[1].self_attn.k_cache.zero_()
        reference = step()
    assert len(calls) == 4
    assert torch.equal(fused[0], reference[0]) and cache.abs().sum() > 0
    assert torch.equal(cache, model.model.layers[1].self_attn.k_cache[0, :, 3])


@pytest.mark.parametrize("v", [1, 7, 16, 33, 8192, 49152 + 5])
def test_argmax_is_the_first_maximum_with_nan_as_the_largest(v):
    """cpu_kernels.argmax (sampling.greedy_ids on bf16 CPU logits) = torch's max(-1).indices: the first
    of tied maxima, the first NaN where there is one, -inf rows and ±inf entries included."""
    g = torch.Generator().manual_seed(v)
    for trial in range(12):
        x = torch.randn(3, 4, v, generator=g).bfloat16()
        if trial % 3 == 1:  # many ties
            x = (2 * x).round().clamp(-2, 2).bfloat16()
        if trial % 4 == 2:
            x[0, 1, v // 2] = float("nan")
            x[0, 1, v // 3] = float("nan")
        if trial % 5 == 3:
            x[1] = float("-inf")
        if trial % 6 == 4:
            x[2, 0, -1] = x[2, 0, 0] = float("inf")
        assert torch.equal(cpu_kernels.argmax(x), x.max(-1).indices), trial
    from specbench.engine.sampling import greedy_ids
    assert torch.equal(greedy_ids(x[:, 0]), x[:, 0].max(-1).indices)


def _random_dspark(rank: int, draft_vocab, block: int = 5):
    from specbench.drafters.dspark import DSparkArgs, build_drafter

    target = tiny_model(vocab=96, dim=256, layers=3, dtype=torch.bfloat16)
    args = DSparkArgs.for_target(target.args, tap_layers=[0, 1, 2], n_layers=2, block_size=block, markov_rank=rank,
                                 draft_vocab=draft_vocab)
    drafter = build_drafter(args, target).eval()
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dtype.is_floating_point:
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1 and p.shape[0] == 256
                        else 0.3 * torch.randn(p.shape, generator=g))
        if draft_vocab:
            drafter.set_draft_vocab(torch.randperm(96, generator=g)[:draft_vocab])
    drafter.pack_weights()  # the writes above made the packs stale (as a checkpoint load does, before its repack)
    return drafter, g


@pytest.mark.parametrize("rank, draft_vocab", [(8, 0), (32, 40)])
def test_the_markov_head_in_one_call_drafts_the_loops_tokens(rank, draft_vocab, monkeypatch):
    """dspark.FUSED_MARKOV: cpu_kernels.markov_draft runs draft_block's greedy Markov loop and the
    confidence head in one call: the same tokens and one-hot probs as the loop, the confidence
    logits within one bf16 rounding of nn.Linear's."""
    from specbench.drafters import dspark

    drafter, g = _random_dspark(rank, draft_vocab)
    calls = []
    markov = cpu_kernels.markov_draft
    monkeypatch.setattr(cpu_kernels, "markov_draft", lambda *a: calls.append(1) or markov(*a))
    anchors = torch.tensor([7, 42, 3])
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(dspark, "FUSED_MARKOV", fused)
        with torch.inference_mode():
            drafter.setup_cache(3, 32)
            drafter.append_context(torch.randn(3, 10, 3 * 256, generator=torch.Generator().manual_seed(1)).bfloat16(),
                                   torch.tensor([10, 6, 8]))
            outs.append(drafter.draft_block(anchors, None, temperature=0.0))
    assert len(calls) == 1
    (tokens, probs, z), (ref_tokens, ref_probs, ref_z) = outs
    assert torch.equal(tokens, ref_tokens) and torch.equal(probs, ref_probs)
    assert len(set(tokens.flatten().tolist())) > 3  # the drafts are not all one token
    if draft_vocab:
        assert set(tokens.flatten().tolist()) <= set(drafter.vocab_ids.tolist())
    assert torch.allclose(z.float(), ref_z.float(), rtol=2 ** -7, atol=1e-3)


def test_a_context_append_on_the_kernels_writes_the_loops_cache(monkeypatch):
    """DSparkDrafter.append_context's kernel route (one k|v GEMV and one rope + cache-write call per
    layer) writes every context slot with the bits of the per-layer torch loop (the padding sink
    slot aside, whose contents nothing reads), for ragged rows, a prompt and later rounds."""
    from specbench.drafters import dspark

    drafter, g = _random_dspark(8, 0)
    calls = []
    write = cpu_kernels.qkv_rope_cache
    monkeypatch.setattr(cpu_kernels, "qkv_rope_cache", lambda *a: calls.append(1) or write(*a))
    prompt = torch.randn(3, 12, 3 * 256, generator=g).bfloat16()
    # 3 rows × 2 tokens: within the GEMV's reach on every machine kind (8 rows without AMX)
    rounds = [(torch.randn(3, 2, 3 * 256, generator=g).bfloat16(), torch.tensor(c)) for c in ([1, 2, 2], [2, 0, 1])]
    caches = []
    for fused in (True, False):
        dspark.FUSED_BLOCK = fused
        try:
            with torch.inference_mode():
                drafter.setup_cache(3, 40)
                for c in drafter.k_cache + drafter.v_cache:
                    c.zero_()
                drafter.append_context(prompt[:, :3], torch.tensor([3, 2, 1]))  # 9 rows: within the GEMV's reach
                for features, counts in rounds:
                    drafter.append_context(features, counts)
                caches.append(([c[:, :, :drafter.max_ctx].clone() for c in drafter.k_cache + drafter.v_cache],
                               drafter.ctx_len.clone()))
        finally:
            dspark.FUSED_BLOCK = True
    assert len(calls) >= 2 * 2  # both layers, at least in the two rounds (the prompt's 9 rows need AMX)
    (fused, fused_len), (ref, ref_len) = caches
    assert torch.equal(fused_len, ref_len) and fused_len.tolist() == [6, 4, 4]
    assert all(torch.equal(a, b) for a, b in zip(fused, ref))
    assert fused[0][:, :, :6].abs().sum() > 0


@pytest.mark.parametrize("draft_vocab,cut_block", [(40, 0), (0, 0), (40, 2)])
def test_a_drafting_round_in_one_call_gives_the_bits_of_append_and_draft_block(draft_vocab, cut_block, monkeypatch):
    """dspark.FUSED_ROUND: DSparkDrafter.draft_round (a greedy round: the last rounds' features join the
    context, then draft_block) in one kernel call gives the two-call path's tokens, one-hot probs and
    confidence logits bit for bit, and leaves the same context cache and lengths, over ragged rounds and
    a round with nothing to append; also with the block cut at load time (keep_block). Without a reduced
    draft vocabulary (F.linear's head) it is not used."""
    from specbench.drafters import dspark

    drafter, g = _random_dspark(8, draft_vocab, block=4)
    if cut_block:
        drafter.keep_block(cut_block)
    calls = []
    fused_round = cpu_kernels.dspark_round
    monkeypatch.setattr(cpu_kernels, "dspark_round", lambda *a: calls.append(1) or fused_round(*a))
    prompt = torch.randn(3, 12, 3 * 256, generator=g).bfloat16()
    rounds = [(torch.randn(3, 2, 3 * 256, generator=g).bfloat16(), torch.tensor(c)) for c in ([1, 2, 2], [2, 0, 1])]
    rounds.append((None, None))
    anchors = torch.tensor([7, 42, 3])
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(dspark, "FUSED_ROUND", fused)
        with torch.inference_mode():
            drafter.setup_cache(3, 40)
            for c in drafter.k_cache + drafter.v_cache:
                c.zero_()
            drafter.append_context(prompt, torch.tensor([12, 9, 5]))
            outs = [drafter.draft_round(features, counts, anchors, 0.0, with_probs=True) for features, counts in rounds]
            runs.append((outs, [c[:, :, :drafter.max_ctx].clone() for c in drafter.k_cache + drafter.v_cache],
                         drafter.ctx_len.clone()))
    assert len(calls) == (len(rounds) if draft_vocab else 0)
    (outs, cache, lengths), (ref_outs, ref_cache, ref_lengths) = runs
    assert torch.equal(lengths, ref_lengths) and lengths.tolist() == [15, 11, 8]
    assert all(torch.equal(a, b) for a, b in zip(cache, ref_cache))
    for (tokens, probs, z), (ref_tokens, ref_probs, ref_z) in zip(outs, ref_outs):
        assert torch.equal(tokens, ref_tokens) and torch.equal(probs, ref_probs) and torch.equal(z, ref_z)
        assert tokens.shape == (3, cut_block or 4) and z.shape == (3, cut_block or 4)
    assert len(set(torch.cat([o[0] for o in outs]).flatten().tolist())) > 3  # the drafts are not all one token



def test_pinned_round_routes_decide_once_per_shape_and_give_the_same_rounds(monkeypatch):
    """DSparkDrafter.round_routes_pinned (entered by core.generate through Policy.decoding): draft_round
    checks its kernel route once per round shape, not every round, and drafts the same bits; a
    setup_cache that allocates new caches inside the block makes it check again (and use them)."""
    drafter, g = _random_dspark(8, 40, block=4)
    checks = []
    check = drafter._round_kernel_args
    monkeypatch.setattr(drafter, "_round_kernel_args", lambda *a: checks.append(1) or check(*a))
    prompt = torch.randn(2, 12, 3 * 256, generator=g).bfloat16()
    rounds = [(torch.randn(2, 2, 3 * 256, generator=g).bfloat16(), torch.tensor(c)) for c in ([1, 2], [2, 2], [2, 1])]
    anchors = torch.tensor([7, 42])

    def decode(max_ctx: int) -> list:
        drafter.setup_cache(2, max_ctx)
        for c in drafter.k_cache + drafter.v_cache:
            c.zero_()
        drafter.append_context(prompt, torch.tensor([12, 9]))
        return [drafter.draft_round(f, c, anchors, 0.0, with_probs=False) for f, c in rounds + [(None, None)]]

    with torch.inference_mode():
        reference = decode(40)
        assert len(checks) == 4  # unpinned: every round
        checks.clear()
        with drafter.round_routes_pinned():
            pinned = decode(40)
            assert len(checks) == 2  # one shape of features [2, 2, F], and a round with none
            bigger = decode(80)  # new caches: the routes are checked again
            assert len(checks) == 4
        assert drafter._round_routes is None
    for outs in (pinned, bigger):
        for (tokens, _, z), (ref_tokens, _, ref_z) in zip(outs, reference):
            assert torch.equal(tokens, ref_tokens) and torch.equal(z, ref_z)

def _sampled_rounds(drafter, g, b, fused, monkeypatch, temperature=1.0, top_p=1.0, seed=5):
    """Three drafting rounds at `temperature` from the same start and seed (fused or two calls):
    (outs, context cache, lengths, the uniforms the first round's kernel drew)."""
    from specbench.drafters import dspark

    monkeypatch.setattr(dspark, "FUSED_ROUND", fused)
    data = torch.Generator().manual_seed(11)
    prompt = torch.randn(b, 12, 3 * 256, generator=data).bfloat16()
    rounds = [(torch.randn(b, 2, 3 * 256, generator=data).bfloat16(), torch.randint(0, 3, (b,), generator=data))
              for _ in range(2)] + [(None, None)]
    anchors = torch.randint(0, 96, (b,), generator=data)
    sampler = torch.Generator().manual_seed(seed)
    first_uniforms = torch.rand(b, drafter.block_size, generator=torch.Generator().set_state(sampler.get_state()),
                                dtype=torch.float64)
    with torch.inference_mode():
        drafter.setup_cache(b, 40)
        for c in drafter.k_cache + drafter.v_cache:
            c.zero_()
        drafter.append_context(prompt, torch.full((b,), 12))
        outs = [drafter.draft_round(f, c, anchors, temperature, top_p, sampler, with_probs=True) for f, c in rounds]
    return outs, [c[:, :, :drafter.max_ctx].clone() for c in drafter.k_cache + drafter.v_cache], drafter.ctx_len.clone(), \
        first_uniforms


def test_a_sampled_drafting_round_in_one_call_draws_from_the_probs_it_returns(monkeypatch):
    """A sampled round (temperature > 0, top_p = 1) in one kernel call: at b = 1, with the same seed, the
    two-call path's tokens, confidence logits and context cache, and its distributions to fp32 rounding
    (the kernel computes its own softmax); at b = 3, every token is exactly the inversion of the returned
    distribution (over the draft vocabulary, in its order) at the generator's uniform, and no mass lies
    outside the draft vocabulary. With a nucleus (top_p < 1) the round keeps the two calls."""
    drafter, g = _random_dspark(8, 40, block=4)
    calls = []
    fused_round = cpu_kernels.dspark_round
    monkeypatch.setattr(cpu_kernels, "dspark_round", lambda *a: calls.append(1) or fused_round(*a))
    for temperature in (1.0, 0.7):
        (outs, cache, lengths, _), (ref_outs, ref_cache, ref_lengths, _) = (
            _sampled_rounds(drafter, g, 1, fused, monkeypatch, temperature) for fused in (True, False))
        assert torch.equal(lengths, ref_lengths) and all(torch.equal(a, b) for a, b in zip(cache, ref_cache))
        for (tokens, probs, z), (ref_tokens, ref_probs, ref_z) in zip(outs, ref_outs):
            assert torch.equal(tokens, ref_tokens) and torch.equal(z, ref_z)
            torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    assert len(calls) == 6
    calls.clear()
    outs, _, _, uniforms = _sampled_rounds(drafter, g, 3, True, monkeypatch)
    assert len(calls) == 3
    tokens, probs, _ = outs[0]
    ids = drafter.vocab_ids
    in_draft_order = probs[..., ids].double()
    torch.testing.assert_close(in_draft_order.sum(-1), torch.ones(3, 4, dtype=torch.float64))
    outside = probs.clone()
    outside[..., ids] = 0.0
    assert not outside.any()  # no mass outside the draft vocabulary
    cdf = in_draft_order.cumsum(-1)
    index = torch.searchsorted(cdf, (uniforms * cdf[..., -1])[..., None], right=True)[..., 0]
    assert torch.equal(ids[index], tokens)
    calls.clear()
    _sampled_rounds(drafter, g, 1, True, monkeypatch, top_p=0.9)
    assert calls == []


def test_dspark_sampling_with_the_one_call_round_matches_the_target(monkeypatch):
    """The whole policy at temperature 1 in bf16 with its drafting rounds in one kernel call (sampled
    Markov head, a reduced draft vocabulary): χ² of its outputs against the target's exact joint."""
    from helpers import N_SAMPLES, N_TOKENS, SMALL_VOCAB, chi_square, exact_joint
    from specbench.drafters.dspark import DSparkArgs, build_drafter
    from specbench.engine.core import SamplingConfig, generate
    from specbench.policies.dspark import DSpark

    target = tiny_model(vocab=SMALL_VOCAB, dim=256, layers=2, dtype=torch.bfloat16, seed=10, scale=2.0)
    args = DSparkArgs.for_target(target.args, tap_layers=[0, 1], n_layers=1, block_size=3, markov_rank=8, draft_vocab=3)
    drafter = build_drafter(args, target).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        drafter.set_draft_vocab(torch.tensor([4, 0, 2]))
    drafter.pack_weights()
    calls = []
    fused_round = cpu_kernels.dspark_round
    monkeypatch.setattr(cpu_kernels, "dspark_round", lambda *a: calls.append(1) or fused_round(*a))
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    pol = DSpark(drafter, scheduler="algorithm1", step_seconds=lambda rows, q: 0.01 + 0.0001 * rows * q,
                 sts_temperatures=[1.5, 0.7, 1.0], group_size=4)
    # Batches of 8: the round's Markov GEMV takes at most that many rows (cpu_kernels.gemv_takes), so larger
    # batches keep the two calls. Each batch its own seed.
    requests = []
    for i in range(0, N_SAMPLES, 8):
        config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=1.0, seed=99 + i)
        requests += generate(target, pol, [prompt] * min(8, N_SAMPLES - i), config).requests
    assert calls, "the one-call sampled round was not taken"
    counts = {}
    for r in requests:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    assert 0 < sum(r.accepted for r in requests) < sum(r.drafted for r in requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"DSpark with the one-call sampled round differs from the target (p={pvalue:.2e}, TV={tv:.4f})"


def test_a_pinned_stack_skips_its_checks_and_still_sees_new_caches_and_stale_packs_at_entry(monkeypatch):
    """Transformer.kernel_stack_pinned (core.generate, timing.time_forward): inside the block the one-call
    outcome is reused without its snapshot check; a stale outcome is dropped on entry (a stale pack then
    takes the per-module path), and setup_cache inside the block drops it too (new caches are written)."""
    from specbench.engine import model as model_module

    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    calls = _record_one_call_forwards(monkeypatch)
    checks = []
    holds = model_module.Snapshot.holds
    monkeypatch.setattr(model_module.Snapshot, "holds", lambda self: checks.append(1) or holds(self))
    step = lambda: forward_new_tokens(model, torch.tensor([[5]]), torch.tensor([3]))  # noqa: E731
    with torch.inference_mode():
        model.setup_cache(1, 16)
        with model.kernel_stack_pinned():
            step()
            step()
        assert len(calls) == 2 and checks == []  # built once, then trusted
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.0)  # stale pack
    with torch.inference_mode(), model.kernel_stack_pinned():
        assert len(checks) == 1  # the entry check
        step()
        assert len(calls) == 2  # the per-module path
    model.pack_weights()
    with torch.inference_mode(), model.kernel_stack_pinned():
        step()
        model.setup_cache(2, 32)  # new caches inside the block
        fused = step()
        cache = model.model.layers[1].self_attn.k_cache[0, :, 3].clone()
        assert len(calls) == 4 and cache.abs().sum() > 0
        monkeypatch.setattr(model_module, "FUSED_LAYERS", False)
        model.model.layers[1].self_attn.k_cache.zero_()
        reference = step()
    assert torch.equal(fused[0], reference[0]) and torch.equal(cache, model.model.layers[1].self_attn.k_cache[0, :, 3])


@pytest.mark.parametrize("case", ["no logits", "stale head pack"])
def test_the_one_call_forward_without_its_head_gives_the_per_module_bits(case, monkeypatch):
    """logits=False skips the LM head (None, the same hidden state); a stale LM-head pack leaves the
    head to the module (F.linear's route), still bit for bit the per-module path's."""
    from specbench.engine import model as model_module

    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    if case == "stale head pack":
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)
    calls = _record_one_call_forwards(monkeypatch)
    tokens, lengths = torch.randint(0, 96, (2, 3)), torch.tensor([4, 6])

    def run(fused: bool):
        monkeypatch.setattr(model_module, "FUSED_LAYERS", fused)
        with torch.inference_mode():
            model.setup_cache(2, 32)
            return forward_new_tokens(model, tokens, lengths, taps=(1,), logits=case != "no logits")

    (logits, taps, hidden), reference = run(True), run(False)
    assert calls == [(2, 3)]
    assert torch.equal(taps, reference[1]) and torch.equal(hidden, reference[2])
    if case == "no logits":
        assert logits is None
    else:
        assert torch.equal(logits, reference[0])


def test_the_one_call_forward_refuses_a_token_or_position_outside_its_tables():
    """The kernel gathers embedding and rope rows itself: an id past the vocabulary or a cache length
    whose positions run past the rope tables is a clear error, never a read outside the table."""
    model = tiny_model(vocab=96, dim=256, layers=2, dtype=torch.bfloat16)
    with torch.inference_mode():
        model.setup_cache(1, 64)
        forward_new_tokens(model, torch.tensor([[5]]), torch.tensor([3]))  # fine
        with pytest.raises(RuntimeError, match="token 96 is outside"):
            forward_new_tokens(model, torch.tensor([[96]]), torch.tensor([3]))
        with pytest.raises(RuntimeError, match="position 64 is outside"):
            model.chain_in_one_call(torch.tensor([[5, 6]]), torch.tensor([63]))
