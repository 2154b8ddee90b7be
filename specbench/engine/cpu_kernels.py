"""bf16 kernels for a decode step on a CPU (cpu_kernels.cpp): a GEMV for up to `max_rows()` rows
that streams the weights at close to the machine's read rate, and the small per-row ops around it
(RMSNorm, residual add + RMSNorm, q/k/v split + rope + KV-cache write, attention over the cache,
the MLP's silu(gate) · up) fused into one call each.

Built once per machine, torch and kernel source with torch's C++ extension loader (g++ and ninja;
torch keeps the build in its extensions folder; `build` below) and used only where it
applies: bf16 on a CPU with AVX-512 BF16, no gradient needed. Everywhere else, or when the build
fails (one line on stderr says why), model.py takes torch's routes. `SPECBENCH_CPU_KERNELS=0`
turns the kernels off (A/B runs, bisecting); benchmarks flip `ENABLED`.

Everything here works row by row in a fixed order, so a row gets the same bits alone or in a
batch: at b = 1 a chain or tree verify forward of up to `MAX_ATTEND_TOKENS` tokens computes exactly
what the AR steps it replaces would (tests/test_cpu_kernels.py). The GEMV and the norm's sum of squares round in other
orders than torch's, so their bits are not torch's; rope and the residual add are.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from specbench.atomic import write_bytes
from specbench.resources import cache_dir

# Up to this many rows the GEMV took no more time than oneDNN's pre-packed GEMM on the projections
# of the default model on the AMX Xeon: 64 with AMX tiles (at 128 oneDNN won on the 49152-row head), 8
# with AVX-512 BF16 only, whose 16 rows lost to oneDNN's AMX GEMM (docs/performance.md "A bf16 GEMV of
# our own"). Decode and verify forwards take any number: DECODE_ROWS.
MAX_ROWS_AMX, MAX_ROWS_AVX512 = 64, 8
# Forwards of at most MAX_ATTEND_TOKENS new tokens a row (decode and verify steps) take the GEMV and the
# attention kernel at any number of rows: a verify forward must compute each row as the AR steps it
# replaces, which take the kernels, or bf16 greedy decoding stops being token-identical (EAGLE trees at
# b = 1 were, on 23 of 72 requests, while their ~60-token verify ran on torch's routes). Until session 16
# this held up to 256 rows with AMX and 128 without, where the kernels were measured as fast or faster
# than oneDNN's GEMM route: 2-core Xeon (AMX), session 12, interleaved, context 256: b = 16 × q = 5 52
# against 61 ms, 16 × 8 71–74 against 74–76, 32 × 4 83 against 91, 32 × 8 130 against 130; 2-core AMD
# EPYC (Zen 4, AVX-512 BF16), the real target's projections, 16 rows 14.9 against 27.2 ms, 32 rows 25.6
# against 35.2, 64 rows 49 against 68, 128 rows 100 against 115 (docs/performance.md "Session 12",
# "Session 13"); on the EPYC one 1536 × 576 projection still took no longer on the GEMV at 256, 512 and
# 1 024 rows (2.3 / 4.7 / 9.6 ms against 2.6 / 4.8 / 10.3, one thread, session 16). Beyond 256 rows
# with AMX oneDNN's tiles may be faster; the bits come first. Longer forwards (prefill) keep
# MAX_ROWS_AMX / MAX_ROWS_AVX512: a 200-token prefill took 86 ms on the GEMV against 74 ms on oneDNN's GEMM.
DECODE_ROWS = sys.maxsize
# Forwards of up to this many new tokens per row attend with `attend` instead of SDPA and project on
# the GEMV, at any number of rows: AR steps, chain verification and tree verification (EAGLE's 60
# nodes + the anchor). Longer ones (prefill) take torch's routes. 64, not 8 (sessions 7–15):
# a tree verified on torch's routes rounds otherwise than the AR steps it replaces, and greedy EAGLE
# trees in bf16 were token-identical to `ar` on 23 of 72 requests (docs/performance.md "Session 16").
# Speed is second to that; median µs per layer, attend vs SDPA, 320 cached slots, 2-core Xeon (AMX),
# one run: b = 1: q = 1 20 vs 68, q = 8 83 vs 113; b = 8: q = 1 100 vs 295, q = 8 553 vs 556;
# b = 16, q = 8: 1153 vs 990; b = 1, q = 64 (a tree): 578 vs 365.
MAX_ATTEND_TOKENS = 64
BLOCK = 32  # output features per packed block (cpu_kernels.cpp: kBlock)
ENABLED = os.environ.get("SPECBENCH_CPU_KERNELS", "1") != "0"
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp"]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere): which kernels can run here."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            return frozenset(next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw", "avx512vl"} <= cpu_flags()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True once the kernels are built and loaded; False (with one line on stderr) where they can't be."""
    return cpu_has_avx512_bf16() and build("specbench_cpu_kernels", SOURCE, FLAGS, "the bf16 CPU kernels")


def build(name: str, source: Path, flags: list[str], what: str) -> bool:
    """Build and load a C++ op library once per machine, torch and source. False, with one line on
    stderr, where it can't be built: no compiler, no ninja, an assembler without the instructions;
    torch's routes then remain.

    torch's loader keys a build by the extension's name and rebuilds whenever the source path in it
    changes, so two checkouts of the same code (a fresh clone beside a working tree) rebuilt each
    other's kernels in turn, ~13 s each. The source is therefore built from a copy named by its
    content and flags (`kernel_source`), under a name with the same digest: the same code builds once."""
    from torch.utils import cpp_extension

    t0 = time.time()
    try:
        stable, digest = kernel_source(source, flags)
        cpp_extension.load(name=f"{name}_{digest}", sources=[str(stable)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if "error:" in line), lines[0][:200] if lines else type(e).__name__)
        print(f"specbench: {what} not built ({first}); using torch's routes", file=sys.stderr, flush=True)
        return False
    if time.time() - t0 > 5:
        print(f"specbench: built {what} in {time.time() - t0:.0f} s (once per machine, torch and kernel source)",
              file=sys.stderr, flush=True)
    return True


def kernel_source(source: Path, flags: list[str]) -> tuple[Path, str]:
    """(a copy of `source` at a path named by the digest of its bytes and `flags`, the digest), under
    the suite's cache folder (SPECBENCH_CACHE or ~/.cache/specbench), written atomically."""
    code = source.read_bytes()
    digest = hashlib.sha256(code + "\0".join(flags).encode()).hexdigest()[:12]
    copy = cache_dir() / "kernels" / f"{source.stem}-{digest}" / source.name
    if not copy.is_file() or copy.read_bytes() != code:
        copy.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(copy, code)
    return copy, digest


def applies(*tensors: Tensor) -> bool:
    """Whether the kernels may stand in for torch's ops on these tensors: all bf16 on a CPU, none
    needing a gradient (the kernels have no backward)."""
    if not ENABLED:
        return False
    grad = torch.is_grad_enabled()
    return (all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and not (grad and t.requires_grad)
                for t in tensors) and available())


def pack(weight: Tensor) -> Tensor | None:
    """`weight` [N, K] in the GEMV's layout [ceil(N/32), K/2, 32, 2] (zero rows pad N), or None
    where the GEMV does not apply (not bf16, not a CPU, odd K, kernels unavailable)."""
    if (not ENABLED or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[1] % 2 or not available()):
        return None
    n, k = weight.shape
    with torch.no_grad(), torch.inference_mode(False):
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=weight.dtype)
        padded[:n] = weight.detach()
        return padded.view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@functools.lru_cache(maxsize=None)
def max_rows(tokens: int | None = None) -> int:
    """The most rows the GEMV takes (0 where the kernels are unavailable), in a forward of `tokens` new
    tokens a row (None: any forward): for a decode or verify forward (at most MAX_ATTEND_TOKENS tokens
    a row) any number (DECODE_ROWS); else MAX_ROWS_AMX with AMX, MAX_ROWS_AVX512 without."""
    if not available():
        return 0
    if tokens is not None and tokens <= MAX_ATTEND_TOKENS:
        return DECODE_ROWS
    return MAX_ROWS_AMX if torch.ops.specbench_cpu.amx_available() else MAX_ROWS_AVX512


def tokens_per_row(x: Tensor) -> int | None:
    """New tokens a row of a [b, q, ...features] activation carries (q), None for a flat [rows, K]."""
    return x.shape[-2] if x.dim() >= 3 else None


def gemv_takes(rows: int, k: int, tokens: int | None = None) -> bool:
    """The GEMV's shape rule: `rows` rows of length `k` (even) in a forward of `tokens` new tokens a row
    (None: a flat [rows, k] input). On an AMX machine, where k is not a multiple of 32 the AMX route
    does not apply and the AVX-512 one takes at most MAX_ROWS_AVX512 rows."""
    limit = max_rows(tokens)
    if k % 32 and limit and torch.ops.specbench_cpu.amx_available():
        limit = min(limit, MAX_ROWS_AVX512)  # the AVX-512 route, whose limit beside AMX's GEMM is its own
    return k % 2 == 0 and rows <= limit


def gemv_applies(x: Tensor, packed: Tensor | None) -> bool:
    """Whether `gemv(x, packed, n)` may stand in for F.linear(x, weight) (`gemv_takes` for x's shape)."""
    if packed is None or not applies(x):
        return False
    return gemv_takes(x.numel() // x.shape[-1], x.shape[-1], tokens_per_row(x))


def gemv(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """x · weightᵀ over x's last axis (any leading shape) for the weight `packed` came from."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.specbench_cpu.gemv_bf16(rows, packed, n).view(*x.shape[:-1], n)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.ops.specbench_cpu.rms_norm_bf16(x, weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta))."""
    return torch.ops.specbench_cpu.add_rms_norm_bf16(x, delta, weight, eps)


def qkv_rope_cache(qkv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
                   n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """rope(q) as [b, nh, q, hd] from the packed projection qkv [b, q, (nh + 2·nkv)·hd]; rope(k) and
    v written into the caches at `slots` [b, q]."""
    return torch.ops.specbench_cpu.qkv_rope_cache_bf16(qkv, cos, sin, slots, k_cache, v_cache,
                                                       n_heads, n_kv_heads, head_dim)


def attend_applies(xq: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> bool:
    """Whether `attend` may stand in for the SDPA of Attention._attend: bf16 on a CPU, at most
    MAX_ATTEND_TOKENS new tokens per row and `max_rows(q)` in all, head size 64 or 128."""
    b, nh, q, hd = xq.shape
    return (q <= MAX_ATTEND_TOKENS and hd in (64, 128) and nh % k_cache.shape[1] == 0
            and mask.dtype == torch.bool and applies(xq, k_cache, v_cache) and b * q <= max_rows(q))


def attend(xq: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> Tensor:
    """softmax(xq·kᵀ/√hd, where mask) · v over the first mask.shape[-1] cache slots of each row:
    xq [b, nh, q, hd], caches [B >= b, nkv, S, hd], mask [b, q, kv_len] bool → [b, q, nh·hd]
    (o_proj's input). Query head h reads KV head h // (nh // nkv). A row's bits do not depend on
    the number of rows, of tokens per row, or on kv_len beyond its last visible slot."""
    return torch.ops.specbench_cpu.attend_bf16(xq, k_cache, v_cache, mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) · up for gate_up = [..., gate | up] (MLP.pack_gate_up's product), with torch's
    roundings: bf16(bf16(silu(gate)) · up), silu in fp32."""
    return torch.ops.specbench_cpu.silu_mul_bf16(gate_up)


def decoder_layers_apply(args, rows: int, tokens: int) -> bool:
    """Whether `decoder_layers` takes layers of shape `args` (a model.ModelArgs) for `rows` rows of
    `tokens` new tokens each: gemv_applies' and attend_applies' shape rules for every projection and
    the attention, and no bias or q/k norm (the kernel has neither). Dtype, device, gradient and
    pack freshness are the caller's to check."""
    if args.attention_bias or args.qk_norm or not available() or rows > max_rows(tokens):
        return False
    if tokens > MAX_ATTEND_TOKENS or args.head_dim not in (64, 128) or args.n_heads % args.n_kv_heads:
        return False
    return all(gemv_takes(rows, k, tokens) for k in (args.dim, args.n_heads * args.head_dim, args.intermediate_size))


def decoder_layers(x: Tensor, input_norms, qkv, o, post_norms, gate_up, down, k_caches, v_caches, cos: Tensor,
                   sin: Tensor, slots: Tensor, mask: Tensor, eps: float, n_heads: int, n_kv_heads: int, head_dim: int,
                   intermediate: int, taps: list[int]) -> tuple[Tensor, list[Tensor]]:
    """Every decoder layer in one call (cpu_kernels.cpp: decoder_layers_bf16), with the bits of
    model.DecoderLayer's kernel routes: lists hold one tensor per layer (norm weights, the packed
    q|k|v, o, gate|up and down weights, the caches). Returns the last layer's output and the
    outputs of the layers in `taps` (sorted)."""
    return torch.ops.specbench_cpu.decoder_layers_bf16(x, input_norms, qkv, o, post_norms, gate_up, down, k_caches,
                                                       v_caches, cos, sin, slots, mask, eps, n_heads, n_kv_heads,
                                                       head_dim, intermediate, taps)



def decoder_forward(tokens: Tensor, embed: Tensor, cos_table: Tensor, sin_table: Tensor, positions: Tensor,
                    layers: tuple[list[Tensor], ...], slots: Tensor | None, mask: Tensor | None, norm: Tensor,
                    head: Tensor | None, head_rows: int, eps: float, n_heads: int, n_kv_heads: int, head_dim: int,
                    intermediate: int, taps: list[int]) -> tuple[Tensor | None, list[Tensor], Tensor]:
    """A whole decode or verify forward in one call (cpu_kernels.cpp: decoder_forward_bf16): the
    embeddings of `tokens` [b, q], rope's cos / sin rows at `positions` from the tables [S, hd],
    `decoder_layers` over `layers` (its eight per-layer lists) with `slots` and `mask`, the final norm
    and, with a `head` (the LM head's GEMV pack, head_rows outputs), the logits. No mask: a chain,
    `positions` the rows' cache lengths [b], from which the kernel makes positions, slots and the
    mask as core.forward_new_tokens does. Returns (logits or None, the outputs of the layers in `taps`,
    the final normed hidden state): model.Transformer.forward's, bit for bit."""
    none = torch.empty(0, dtype=torch.long)
    logits, tapped, hidden = torch.ops.specbench_cpu.decoder_forward_bf16(
        tokens, embed, cos_table, sin_table, positions, *layers, none if slots is None else slots,
        torch.empty(0, dtype=torch.bool) if mask is None else mask, norm,
        head if head is not None else torch.empty(0, dtype=torch.bfloat16), head_rows, eps, n_heads, n_kv_heads,
        head_dim, intermediate, taps)
    return (logits if head is not None else None), tapped, hidden

def argmax(x: Tensor) -> Tensor:
    """[..., V] bf16 → [...] int64: the first maximum's index, NaN counting as the maximum (the first
    NaN), as x.max(-1).indices gives (sampling.greedy_ids)."""
    return torch.ops.specbench_cpu.argmax_bf16(x)


def markov_draft(base: Tensor, anchors: Tensor, w1: Tensor, w2_packed: Tensor, vocab_ids: Tensor | None,
                 h: Tensor | None = None, conf_weight: Tensor | None = None, conf_bias: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """DSpark's greedy Markov head (drafters/dspark.py: draft_block at temperature 0) in one call:
    base [b, γ, Vd] bf16 logits U_k, anchors [b], w1 [V, r] (markov_w1's table), w2_packed (markov_w2's
    GEMV pack), vocab_ids [Vd] or None → (tokens [b, γ], previous tokens [b, γ], the confidence
    head's logits [b, γ] bf16 from h [b, γ, d] and its weight [1, d (+ r)] and bias, or None without
    them). The tokens are the Python loop's; z sums in fp32 in index order (nn.Linear's bf16 GEMM may
    round its last bit otherwise)."""
    none = torch.empty(0, dtype=base.dtype)
    ids = vocab_ids if vocab_ids is not None else torch.empty(0, dtype=torch.long)
    tokens, prevs, z = torch.ops.specbench_cpu.markov_draft_bf16(
        base, anchors, w1, w2_packed, ids, h if h is not None else none,
        conf_weight.reshape(-1) if conf_weight is not None else none, conf_bias if conf_bias is not None else none)
    return tokens, prevs, (z if conf_weight is not None else None)


def dspark_round(features: Tensor | None, counts: Tensor | None, ctx_len: Tensor, fc: Tensor | None,
                 hidden_norm: Tensor | None,
                 kv: list[Tensor], anchors: Tensor, embed: Tensor, mask_embedding: Tensor,
                 layers: tuple[list[Tensor], ...],
                 k_caches: list[Tensor], v_caches: list[Tensor], inv_freq: Tensor, norm: Tensor, head: Tensor,
                 head_rows: int, markov_w1: Tensor, markov_w2: Tensor, vocab_ids: Tensor, conf_weight: Tensor,
                 conf_bias: Tensor, eps: float, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int,
                 block: int, max_ctx: int, uniforms: Tensor | None = None, temperature: float = 0.0
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A DSpark drafting round in one call (cpu_kernels.cpp: dspark_round_bf16): the context
    append of `features` [b, n, m·d] (first counts[r] entries of row r; None: nothing to append) with
    the fc / hidden_norm / per-layer k|v GEMV packs, advancing ctx_len in place; then the block pass over
    the draft layers (`layers`: decoder_layers' six per-layer lists), the final norm, the draft head's
    GEMV pack (head_rows outputs), the Markov head and the confidence head. Greedy (no `uniforms`):
    returns (tokens [b, γ], previous tokens [b, γ], confidence logits [b, γ] bf16, None), draft_block's
    with its bits. Sampled (`uniforms` [b, γ] float64 in [0, 1), `temperature` > 0, top_p = 1): each
    token is drawn by inverting its position's softmax(logits / T) at its uniform, and the fourth
    result is those distributions, [b, γ, Vd] float32 over the draft vocabulary, exactly the ones the
    tokens came from (computed in the kernel, so equal to draft_block's up to fp32 rounding)."""
    none = torch.empty(0, dtype=torch.bfloat16)
    tokens, prevs, z, probs = torch.ops.specbench_cpu.dspark_round_bf16(
        features if features is not None else none, counts if counts is not None else torch.empty(0, dtype=torch.long),
        ctx_len, fc if fc is not None else none, hidden_norm if hidden_norm is not None else none, kv, anchors, embed,
        mask_embedding, *layers, k_caches, v_caches, inv_freq, norm, head, head_rows, markov_w1, markov_w2, vocab_ids,
        conf_weight.reshape(-1), conf_bias, eps, n_heads, n_kv_heads, head_dim, intermediate, block, max_ctx,
        uniforms if uniforms is not None else torch.empty(0, dtype=torch.float64), float(temperature))
    return tokens, prevs, z, (probs if uniforms is not None else None)
