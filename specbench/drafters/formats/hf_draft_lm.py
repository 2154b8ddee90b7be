"""A plain causal LM as the fixed-K draft model (Qwen3-0.6B beside Qwen3-8B, SmolLM2-135M beside
SmolLM2-1.7B): any local HF directory or hub id with a `*ForCausalLM` config of a family the
suite's own decoder runs (llama / qwen2 / qwen3 / mistral, specbench/engine/model.py), and a tokenizer.

The draft must speak the target's token ids: its tokenizer must have the same vocabulary (token →
id) and the same special tokens as the target's, and its output layer the same number of rows.
Anything else is refused with a one-line error (a draft with another tokenizer would propose ids
that mean other strings to the target: still lossless, but a meaningless benchmark).
"""
from __future__ import annotations

from specbench.errors import UserError


def is_causal_lm(architecture: str) -> bool:
    return architecture.endswith("ForCausalLM")


def tokenizer_mismatch(draft_tok, target_tok) -> str | None:
    """Why the two tokenizers differ, or None when they map every token to the same id."""
    if target_tok is None:
        return "the target has no tokenizer to compare with"
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        only = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:1]
        return f"vocabularies differ ({len(dv)} vs {len(tv)} tokens, e.g. {only[0][0]!r})" if only else "vocabularies differ"
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(draft_tok, name, None) != getattr(target_tok, name, None):
            return f"{name} differs ({getattr(draft_tok, name, None)!r} vs {getattr(target_tok, name, None)!r})"
    return None


def load(spec: str, path, config: dict, target):
    """The draft LM as the suite's Transformer on the target's device and dtype (own embedding and
    head: a draft LM is a model of its own), after the tokenizer and vocabulary checks."""
    from specbench.engine.loading import load_model

    base = target.model
    draft = load_model(str(path), device=base.device, dtype=base.lm_head.weight.dtype)
    why = tokenizer_mismatch(draft.tokenizer, target.tokenizer)
    if why:
        raise UserError(f"draft LM {spec}: its tokenizer is not the target {target.name!r}'s: {why}")
    if draft.model.args.vocab_size != base.args.vocab_size:
        raise UserError(f"draft LM {spec} scores {draft.model.args.vocab_size} token ids, "
                        f"target {target.name!r} scores {base.args.vocab_size}")
    return draft.model
