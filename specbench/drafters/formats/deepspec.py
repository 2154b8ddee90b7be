"""DeepSeek's DeepSpec layout (`Qwen3DSparkModel`): DSpark, and DFlash as the same model with the
Markov and confidence heads off (DeepSpec's config/dflash sets markov_rank 0, no confidence head).

What DeepSpec's `save_pretrained` writes (deepspec/modeling/dspark/qwen3/{config,modeling}.py in
deepseek-ai/DeepSpec): a Qwen3Config deep-copied from the target with `architectures
["Qwen3DSparkModel"]`, `num_hidden_layers` = draft layers, `num_target_layers`, `block_size`,
`mask_token_id`, `target_layer_ids`, `num_anchors`, `markov_rank`, `markov_head_type` (when the
rank is > 0), `enable_confidence_head`, `confidence_head_with_markov` (when the head is on); the
weights hold frozen copies of the target's `embed_tokens` and `lm_head`, the draft layers, `fc`,
`hidden_norm`, `norm`, `markov_head.*` and `confidence_head.proj.*`. Every slot predicts
(slot k → token anchor_pos + k + 1), as in the suite's own drafter.
"""
from __future__ import annotations

from pathlib import Path

from specbench.errors import UserError
from specbench.drafters.formats.block_drafter import PublishedBlockDrafter, load_block_drafter, published_state

ARCHITECTURES = ("Qwen3DSparkModel", "DFlashQwen3DSparkModel")
REQUIRED = ("target_layer_ids", "mask_token_id", "block_size", "markov_rank", "enable_confidence_head")


def load(where: str, config: dict, state: dict, target) -> PublishedBlockDrafter:
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise UserError(f"drafter {where}: a {config['architectures'][0]} config needs {', '.join(missing)}")
    rank = int(config["markov_rank"] or 0)
    return load_block_drafter(
        where, config, state, target, taps=config["target_layer_ids"], block_size=config["block_size"],
        mask_token_id=config["mask_token_id"], markov_rank=rank,
        markov_head_type=str(config.get("markov_head_type", "vanilla")).lower(),
        confidence_head=bool(config["enable_confidence_head"]),
        confidence_with_markov=bool(config.get("confidence_head_with_markov", False)), first_slot=0)


def export_config(drafter, target_config: dict, mask_token_id: int) -> dict:
    """The DeepSpec config for one of the suite's DSpark / DFlash drafters (the target's config
    with the draft fields, as deepspec/modeling/dspark/qwen3/config.py builds it)."""
    a = drafter.args
    m = a.model_args
    config = {k: v for k, v in target_config.items() if k not in ("auto_map", "quantization_config", "_name_or_path")}
    config.update({
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
        "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.intermediate_size,
        "rms_norm_eps": m.norm_eps, "vocab_size": m.vocab_size, "rope_theta": m.rope_theta,
        "rope_scaling": m.rope_scaling, "max_position_embeddings": m.max_position_embeddings,
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * m.n_layers,
        "num_target_layers": int(target_config.get("num_hidden_layers", 0)),
        "block_size": a.block_size, "mask_token_id": int(mask_token_id), "target_layer_ids": list(a.tap_layers),
        "num_anchors": 512, "markov_rank": a.markov_rank, "enable_confidence_head": bool(a.confidence_head),
    })
    config.pop("rope_parameters", None)
    if a.markov_rank > 0:
        config["markov_head_type"] = getattr(drafter, "markov_head_type", "vanilla")
    if a.confidence_head:
        config["confidence_head_with_markov"] = bool(a.confidence_with_markov)
    return config


def export_state(drafter) -> dict:
    return published_state(drafter, own_embedding=True)


def describe(path: Path) -> str:
    return f"DeepSpec Qwen3DSparkModel at {path}"
