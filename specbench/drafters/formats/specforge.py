"""SpecForge's DSpark layout (`DSparkDraftModel`, specforge/modeling/draft/dspark.py).

A DFlash-layout checkpoint (formats/dflash.py: Qwen3Config, `block_size`, `num_target_layers`,
`dflash_config`, no embedding or output head) whose `dflash_config` also holds `projector_type
"dspark"`, `markov_rank`, `markov_head_type` (vanilla / gated / rnn), `enable_confidence_head`
(default: `confidence_head_alpha` > 0) and `confidence_head_with_markov`; heads under
`markov_head.*` and `confidence_head.proj.*` (older checkpoints: under `logit_head.`). SpecForge
trains DSpark with labels at anchor_pos + 1 … + block_size (algorithms/common/
dflash_family_model.py `_build_dspark_labels_and_mask`), so every slot predicts, as in DeepSpec.
SpecForge's EAGLE-3 layout is in formats/eagle3.py.
"""
from __future__ import annotations

from specbench.errors import UserError
from specbench.drafters.formats.block_drafter import PublishedBlockDrafter, load_block_drafter, published_state
from specbench.drafters.formats.dflash import check_neutral_extras, default_taps

ARCHITECTURES = ("DSparkDraftModel",)


def load(where: str, config: dict, state: dict, target) -> PublishedBlockDrafter:
    check_neutral_extras(where, config)
    dc = dict(config.get("dflash_config") or {})
    if dc.get("projector_type", "dspark") != "dspark":
        raise UserError(f"drafter {where}: DSparkDraftModel needs dflash_config.projector_type 'dspark'")
    taps = dc.get("target_layer_ids") or default_taps(int(config.get("num_target_layers") or target.model.args.n_layers),
                                                      int(config.get("num_hidden_layers", 1)))
    rank = int(dc.get("markov_rank", 0) or 0)
    alpha = float(dc.get("confidence_head_alpha", 0.0) or 0.0)
    return load_block_drafter(
        where, config, state, target, taps=taps, block_size=config.get("block_size", 16),
        mask_token_id=dc.get("mask_token_id"), markov_rank=rank,
        markov_head_type=str(dc.get("markov_head_type", "vanilla")).lower(),
        confidence_head=bool(dc.get("enable_confidence_head", alpha > 0.0)),
        confidence_with_markov=bool(dc.get("confidence_head_with_markov", False)), first_slot=0)


def export_config(drafter, target_config: dict, mask_token_id: int) -> dict:
    from specbench.drafters.formats import dflash

    a = drafter.args
    config = dflash.export_config(drafter, target_config, mask_token_id)
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"].update({
        "projector_type": "dspark", "markov_rank": a.markov_rank,
        "markov_head_type": getattr(drafter, "markov_head_type", "vanilla"),
        "enable_confidence_head": bool(a.confidence_head), "confidence_head_with_markov": bool(a.confidence_with_markov),
        "attention_mode": "gqa" if a.model_args.n_kv_heads < a.model_args.n_heads else "mha",
    })
    return config


def export_state(drafter) -> dict:
    return published_state(drafter, own_embedding=False)
