"""The DFlash layout of z-lab's `dflash` package and SpecForge (`DFlashDraftModel`).

Both write the same checkpoint (dflash/model.py, specforge/modeling/draft/dflash.py): a
Qwen3Config with `architectures ["DFlashDraftModel"]`, `num_hidden_layers` = draft layers,
`num_target_layers`, `block_size` and a `dflash_config` dict holding `target_layer_ids` (default:
DFlash's rule, evenly spaced from layer 1 to L − 3) and `mask_token_id`; weights: the draft layers,
`fc`, `hidden_norm`, `norm` — no embedding or output head (the target's are used). The block is
[anchor, mask × (γ − 1)] and only the mask slots predict: slot k ≥ 1 → token anchor_pos + k,
γ − 1 drafts per block (dflash_generate reads `draft_hidden[:, 1 - block_size:]`).

z-lab's extras that change the drafted distribution are refused unless neutral:
`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`, causal or sliding-window
draft layers, and DFlash-2 (`DFlash2DraftModel`, a different architecture).
"""
from __future__ import annotations

from specbench.errors import UserError
from specbench.drafters.formats.block_drafter import PublishedBlockDrafter, load_block_drafter, published_state

ARCHITECTURES = ("DFlashDraftModel",)


def default_taps(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default tapped layers (dflash/model.py `build_target_layer_ids`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def draft_value(config: dict, name: str, default=None):
    """A field of `dflash_config`, else the top-level config (dflash/model.py `_draft_value`)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def check_neutral_extras(where: str, config: dict) -> None:
    for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        if float(draft_value(config, name, neutral)) != neutral:
            raise UserError(f"drafter {where}: {name} = {draft_value(config, name)} is not supported")
    if draft_value(config, "final_logit_softcapping") not in (None, 0, 0.0):
        raise UserError(f"drafter {where}: final_logit_softcapping is not supported")
    if config.get("is_causal"):
        raise UserError(f"drafter {where}: causal draft layers (is_causal) are not supported")


def load(where: str, config: dict, state: dict, target) -> PublishedBlockDrafter:
    check_neutral_extras(where, config)
    taps = draft_value(config, "target_layer_ids")
    if taps is None:
        taps = default_taps(int(config.get("num_target_layers") or target.model.args.n_layers),
                            int(config.get("num_hidden_layers", 1)))
    return load_block_drafter(where, config, state, target, taps=taps, block_size=draft_value(config, "block_size", 16),
                              mask_token_id=draft_value(config, "mask_token_id"), markov_rank=0,
                              markov_head_type="vanilla", confidence_head=False, confidence_with_markov=False,
                              first_slot=1)


def export_config(drafter, target_config: dict, mask_token_id: int) -> dict:
    """Only drafters that read their mask slots can be written in this layout (formats/export.py)."""
    m = drafter.args.model_args
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.intermediate_size,
        "rms_norm_eps": m.norm_eps, "vocab_size": m.vocab_size, "rope_theta": m.rope_theta,
        "rope_scaling": m.rope_scaling, "max_position_embeddings": m.max_position_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * m.n_layers, "use_sliding_window": False, "sliding_window": None,
        "num_target_layers": int(target_config.get("num_hidden_layers", 0)), "block_size": drafter.args.block_size,
        "dflash_config": {"target_layer_ids": list(drafter.args.tap_layers), "mask_token_id": int(mask_token_id)},
    }


def export_state(drafter) -> dict:
    return published_state(drafter, own_embedding=False)
