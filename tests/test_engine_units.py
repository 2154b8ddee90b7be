"""The engine's pieces on their own (the end-to-end lossless tests cover them together):
verify_chain, top-p filtering, KV-bucket sizing, move_cache, and committing tokens to a row."""
import pytest
import torch

from specbench.engine.core import RequestResult, commit_tokens
from specbench.engine.model import KV_BUCKET, round_to_bucket
from specbench.engine.policy import BatchState
from specbench.engine.sampling import probs_from_logits, top_p_filter
from specbench.engine.verify import verify_chain
from tiny import tiny_model

V = 5


def one_hot(tokens):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


# --------------------------------------------------------------------------- verify_chain


def test_greedy_chain_accepts_the_matching_prefix_then_corrects():
    # Target argmax after [anchor, x1, x2, x3] is 1, 2, 4, 0; the drafts are 1, 2, 3.
    target = one_hot([[1, 2, 4, 0]] * 3)
    drafts = torch.tensor([[1, 2, 3]] * 3)
    accepted, nxt = verify_chain(target, drafts, None, torch.tensor([3, 1, 0]), torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 1, 0]  # ragged: a row never accepts past its verify length
    assert nxt.tolist() == [4, 2, 1]  # the correction at the first mismatch, else the bonus token


def test_every_verified_draft_accepted_gives_the_bonus_token():
    target = one_hot([[1, 2, 3, 0]])
    accepted, nxt = verify_chain(target, torch.tensor([[1, 2, 3]]), None, torch.tensor([3]), None)
    assert accepted.tolist() == [3] and nxt.tolist() == [0]


def test_sampled_chain_keeps_the_target_distribution_and_accepts_min_p_q():
    """One draft from q, verified against p: P(accept) = Σ min(p, q) and the emitted token ~ p."""
    n = 200_000
    p = torch.tensor([0.5, 0.2, 0.2, 0.05, 0.05])
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    target = torch.stack([p, torch.full((V,), 1.0 / V)])[None].expand(n, 2, V)
    accepted, nxt = verify_chain(target, drafts, q[None, None].expand(n, 1, V), torch.ones(n, dtype=torch.long), g)
    first = torch.where(accepted == 1, drafts[:, 0], nxt)  # the token emitted at position 1
    assert abs(accepted.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.005
    freq = torch.bincount(first, minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.005), freq


# --------------------------------------------------------------------------- sampling


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert torch.allclose(top_p_filter(probs, 0.81), torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    assert torch.allclose(top_p_filter(probs, 0.3), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))  # the top token always stays


def test_probs_from_logits_temperature_and_greedy():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert probs_from_logits(logits, 0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(probs_from_logits(logits, 0.5), torch.softmax(logits / 0.5, -1))
    assert torch.allclose(probs_from_logits(logits, 1.0, top_p=0.5), torch.tensor([[0.0, 1.0, 0.0]]))


def test_round_to_bucket():
    assert [round_to_bucket(n) for n in (1, KV_BUCKET, KV_BUCKET + 1)] == [KV_BUCKET, KV_BUCKET, 2 * KV_BUCKET]
    assert round_to_bucket(KV_BUCKET + 1, cap=100) == 100


# --------------------------------------------------------------------------- KV cache and commit


def test_move_cache_copies_every_layer_and_leaves_other_slots():
    model = tiny_model(vocab=16, dim=32, layers=2)
    model.setup_cache(2, 8)
    caches = [c for layer in model.model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
    for i, c in enumerate(caches):
        c.copy_(torch.arange(c.numel(), dtype=c.dtype).reshape(c.shape) + 1000 * i)
    before = [c.clone() for c in caches]
    # row 0: a tree path verified at slots 3, 5, 6 commits to slots 3, 4, 5; row 1 moves 7 → 2
    rows = torch.tensor([[0], [1]])
    src, dst = torch.tensor([[3, 5, 6], [7, 7, 7]]), torch.tensor([[3, 4, 5], [2, 2, 2]])
    model.move_cache(rows, src, dst)
    for c, old in zip(caches, before):
        assert torch.equal(c[0, :, [3, 4, 5]], old[0, :, [3, 5, 6]])
        assert torch.equal(c[1, :, 2], old[1, :, 7])
        untouched = [s for s in range(8) if s not in (3, 4, 5)]
        assert torch.equal(c[0, :, untouched], old[0, :, untouched])
        assert torch.equal(c[1, :, [0, 1, 3, 4, 5, 6, 7]], old[1, :, [0, 1, 3, 4, 5, 6, 7]])


def _state(lengths, seq=12):
    b = len(lengths)
    return BatchState(tokens=torch.zeros(b, seq, dtype=torch.long), lengths=torch.tensor(lengths),
                      prompt_lengths=torch.tensor(lengths), active=torch.ones(b, dtype=torch.bool),
                      temperature=0.0, top_p=1.0, generator=torch.Generator(), max_new_tokens=4)


def test_commit_appends_cuts_at_eos_and_budget():
    state = _state([3, 3, 6])  # row 2: prompt of 3, three tokens emitted already
    results = [RequestResult(output_ids=[], prompt_tokens=3) for _ in range(3)]
    results[2].output_ids = [7, 7, 7]  # one token of budget left
    emitted = commit_tokens(state, results, [[5, 6], [5, 9, 6], [8, 8]], eos={9}, max_new=4)
    assert emitted == [2, 2, 1]
    assert [r.output_ids for r in results] == [[5, 6], [5, 9], [7, 7, 7, 8]]
    assert [r.finish_reason for r in results] == ["length", "eos", "length"]
    assert state.active.tolist() == [True, False, False]  # EOS (kept) and the budget both stop a row
    assert state.lengths.tolist() == [5, 5, 7]
    assert state.tokens[0, 3:5].tolist() == [5, 6] and state.tokens[1, 3:5].tolist() == [5, 9]
    assert state.tokens[2, 6].item() == 8


# --------------------------------------------------------------------------- packed q/k/v projections


def _decode_logits(model, prompt, steps=3):
    """Logits of a prefill then `steps` one-token decode steps (the GEMV path at b = 1)."""
    from specbench.engine.core import forward_new_tokens

    model.setup_cache(1, 64)
    tokens = torch.tensor([prompt])
    out = [forward_new_tokens(model, tokens, torch.zeros(1, dtype=torch.long))[0][:, -1]]
    length = len(prompt)
    for _ in range(steps):
        nxt = out[-1].argmax(-1, keepdim=True)
        out.append(forward_new_tokens(model, nxt, torch.tensor([length]))[0][:, -1])
        length += 1
    return torch.cat(out)


# (module of a layer, its packed tensor's attribute): q/k/v and gate/up each run as one product
PACKED = {"qkv": ("self_attn", "qkv_weight"), "gate_up": ("mlp", "gate_up_weight")}


@pytest.mark.parametrize("pack", sorted(PACKED))
def test_packed_projections_are_used_survive_casts_and_match_the_separate_ones(pack, monkeypatch):
    from specbench.engine import cpu_kernels

    part, attr = PACKED[pack]
    fused = []
    silu_mul = cpu_kernels.silu_mul
    monkeypatch.setattr(cpu_kernels, "silu_mul", lambda x: fused.append(x.shape) or silu_mul(x))
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype=dtype)
        module = getattr(model.model.layers[0], part)
        with torch.inference_mode():
            assert module._packed(), "a fresh (and cast) model runs the packed projection"
            packed = _decode_logits(model, [1, 2, 3, 4])
            for layer in model.model.layers:  # the separate projections, same weights
                setattr(getattr(layer, part), attr, None)
            assert not module._packed()
            separate = _decode_logits(model, [1, 2, 3, 4])
        assert torch.equal(packed, separate), dtype
    assert bool(fused) == cpu_kernels.available()  # bf16 on this CPU: the MLP's silu(gate) · up fused
    model = tiny_model().to(torch.bfloat16)  # .to() replaces parameter storage: _apply packs again
    assert getattr(model.model.layers[0], part)._packed()
    assert getattr(getattr(model.model.layers[0], part), attr).dtype == torch.bfloat16


def test_packed_gate_up_follows_weight_writes_falls_back_and_never_bypasses_gradients():
    mlp = tiny_model().model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)  # an in-place write lands in the pack
    assert torch.equal(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]:], mlp.up_proj.weight)
    mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight.detach().clone(), requires_grad=False)
    assert not mlp._packed()  # a replaced parameter: the separate projections, never a stale pack
    trainable = tiny_model().requires_grad_(True).model.layers[0].mlp
    assert not trainable._packed()  # grad enabled and trainable weights: the parameters themselves run
    trainable(torch.randn(1, 2, trainable.gate_proj.weight.shape[1])).sum().backward()
    assert trainable.gate_proj.weight.grad is not None and trainable.up_proj.weight.grad is not None


def test_packed_qkv_follows_weight_writes_and_falls_back_when_a_weight_is_replaced():
    model = tiny_model()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # an in-place write (what load_state_dict does) lands in the pack
    rows = attn.q_proj.weight.shape[0]
    assert torch.equal(attn.qkv_weight[rows:rows + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach().clone(), requires_grad=False)
    assert not attn._packed()  # a replaced parameter: the separate projections, never a stale pack
    with torch.inference_mode():
        _decode_logits(model, [1, 2, 3])


def test_packed_qkv_never_bypasses_gradients():
    model = tiny_model().requires_grad_(True)
    attn = model.model.layers[0].self_attn
    assert not attn._packed()  # grad enabled and trainable weights: the parameters themselves run
    x = torch.randn(1, 2, model.args.dim)
    cos, sin = torch.ones(1, 2, 1, attn.head_dim), torch.zeros(1, 2, 1, attn.head_dim)
    model.setup_cache(1, 64)
    mask = torch.ones(1, 2, 64, dtype=torch.bool)
    attn(x, cos, sin, torch.tensor([[0, 1]]), mask).sum().backward()
    assert attn.q_proj.weight.grad is not None and attn.v_proj.weight.grad is not None


def test_gemm_packs_are_used_in_bf16_and_refused_once_stale():
    """bf16 on a CPU: projections of more than cpu_kernels.max_rows() rows run on weights pre-packed for oneDNN's GEMM, with the
    same bits as F.linear; an in-place weight write makes the pack stale and the plain path runs."""
    from specbench.engine.model import _onednn_packs_bf16, fresh_pack, linear

    model = tiny_model(dtype=torch.bfloat16)
    head = model.lm_head
    x = torch.randn(3, 30, model.args.dim, dtype=torch.bfloat16)  # 90 rows: more than the bf16 GEMV takes
    if not _onednn_packs_bf16():  # e.g. an AVX2-only CPU: oneDNN refuses to pack bf16, F.linear runs
        assert head.gemm_pack is None or head.gemm_pack.gemm is None
        with torch.inference_mode():
            assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
        return
    assert head.gemm_pack is not None and fresh_pack(head.weight, head.gemm_pack) is not None
    attn = model.model.layers[0].self_attn
    assert attn.qkv_gemm_pack is not None and attn.q_proj.gemm_pack is None  # q/k/v run packed together
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
    with torch.no_grad():
        head.weight.mul_(0.5)
    assert fresh_pack(head.weight, head.gemm_pack) is None  # stale: never the old weights
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
        assert torch.equal(linear(x, head.weight), head(x))
    assert tiny_model().lm_head.gemm_pack is None  # fp32: no pack


def test_greedy_ids_is_argmax_with_ties_and_nan():
    """sampling.greedy_ids (max(dim).indices, the fast route) gives argmax's index: the first
    maximum on ties, NaN as the maximum, in bf16 and fp32, for every row count the core uses."""
    from specbench.engine.sampling import greedy_ids

    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 61):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(2, rows, 4099, generator=g).to(dtype)
            coarse = (x * 2).round()  # many exact ties, including at the maximum
            tied = x.clone()
            tied[..., 7] = tied.amax(-1)
            tied[..., 4000] = tied.amax(-1)
            nan = x.clone()
            nan[0, 0, 99] = float("nan")
            for t in (x, coarse, tied, nan):
                assert torch.equal(greedy_ids(t), t.argmax(-1))


def test_cpu_kernels_only_where_the_cpu_has_them_and_torchs_routes_otherwise():
    """Without AVX-512 BF16 (or with SPECBENCH_CPU_KERNELS=0) no GEMV pack is made and a bf16
    projection is F.linear's; with it the kernels build (tests/test_cpu_kernels.py tests them)."""
    from specbench.engine import cpu_kernels
    from specbench.engine.model import linear

    model = tiny_model(dtype=torch.bfloat16)
    head = model.lm_head
    assert cpu_kernels.available() == cpu_kernels.cpu_has_avx512_bf16()
    assert (head.gemm_pack is not None and head.gemm_pack.gemv is not None) == cpu_kernels.available()
    x = torch.randn(1, 1, model.args.dim, dtype=torch.bfloat16)
    cpu_kernels.ENABLED = False
    try:
        off = tiny_model(dtype=torch.bfloat16).lm_head
        assert off.gemm_pack is None or off.gemm_pack.gemv is None  # None: no oneDNN bf16 pack either
        with torch.inference_mode():
            assert torch.equal(linear(x, off.weight, None, off.gemm_pack), torch.nn.functional.linear(x, off.weight))
    finally:
        cpu_kernels.ENABLED = True


def test_kernels_build_from_a_copy_named_by_their_code(tmp_path, monkeypatch):
    """Two checkouts of the same kernel source share one build (torch's loader rebuilds whenever the
    source path changes); other code or other flags get another."""
    from specbench.engine.cpu_kernels import kernel_source

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }\n")
    copy, digest = kernel_source(first, ["-O3"])
    assert kernel_source(second, ["-O3"]) == (copy, digest)
    assert copy.read_text() == first.read_text() and copy.name == "k.cpp"
    assert kernel_source(first, ["-O2"])[1] != digest
    second.write_text("int f() { return 2; }\n")
    other, other_digest = kernel_source(second, ["-O3"])
    assert other_digest != digest and other.read_text() == second.read_text()
    assert copy.read_text() == first.read_text()  # the first build's copy is left as it was


# --------------------------------------------------------------------------- rope tables and chain masks


@pytest.mark.parametrize("theta, head_dim, scaling", [
    (100000.0, 64, None),  # the default model's
    (500000.0, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),  # Llama-3.1-8B's
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tables_hold_what_rope_cos_sin_gives_each_position(theta, head_dim, scaling, dtype):
    """The one-call forward looks rope's cos / sin up in tables of every cache position: each row
    must be bit for bit what rope_cos_sin computes for that position inside any [b, q] block (a
    prefill, a decode step, a verify block), or a token's K would depend on which path wrote it."""
    from specbench.engine.model import ModelArgs, Transformer, rope_cos_sin

    args = ModelArgs(vocab_size=16, dim=4 * head_dim, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=32,
                     head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
    model = Transformer(args)
    model.setup_cache(1, 4096)
    cos_table, sin_table = model.rope_tables(dtype)
    assert cos_table.shape == sin_table.shape == (4096, head_dim) and cos_table.dtype == dtype
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (1, 8), (16, 1), (16, 8), (3, 17), (1, 300), (2, 1000)]:
        positions = torch.randint(0, 4096, shape, generator=g)
        cos, sin = rope_cos_sin(model.inv_freq, positions, dtype)
        assert torch.equal(cos_table[positions], cos[:, :, 0]) and torch.equal(sin_table[positions], sin[:, :, 0])
    assert model.rope_tables(dtype)[0] is cos_table  # kept while the cache size and dtype stay
    model.setup_cache(1, 8192)
    assert model.rope_tables(dtype)[0].shape[0] == 8192


def test_a_chain_mask_from_given_positions_is_the_one_it_would_compute():
    from specbench.engine.core import chain_mask

    lengths = torch.tensor([3, 0, 7])
    positions = lengths[:, None] + torch.arange(4)[None]
    assert torch.equal(chain_mask(lengths, 4, 16, positions), chain_mask(lengths, 4, 16))
    assert chain_mask(lengths, 4, 16)[0, 1].tolist() == [True] * 5 + [False] * 11
