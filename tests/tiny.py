"""Tiny random Llama-family models for mechanics and losslessness tests (no downloads)."""
from __future__ import annotations

import torch

from specbench.engine.dtypes import cast_model
from specbench.engine.model import ModelArgs, Transformer


def tiny_model(vocab: int = 64, dim: int = 32, layers: int = 2, seed: int = 0, scale: float = 1.0,
               qk_norm: bool = False, dtype: torch.dtype = torch.float32) -> Transformer:
    """Random weights drawn in fp32 (the same model whatever `dtype`), then cast to `dtype`."""
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                     intermediate_size=2 * dim, rope_theta=10000.0, qk_norm=qk_norm)
    model = Transformer(args)
    with torch.no_grad():
        # Sharper-than-default output layer so distributions are far from uniform (no argmax near-ties).
        model.lm_head.weight.mul_(scale)
    return cast_model(model, dtype).eval().requires_grad_(False)


def random_prompts(n: int, vocab: int, seed: int = 0, min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]
