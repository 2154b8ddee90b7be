"""`specbench export`: write one of the suite's drafters in a published layout, so that another
engine (vLLM, SGLang, DeepSpec's eval.py, SpecForge) can run the very drafter the suite measured.

    python -m specbench export --drafter DIR --format deepspec  --out OUT   DSpark / DFlash
    python -m specbench export --drafter DIR --format specforge --out OUT   EAGLE-3 head

What is exact, and what is refused (docs/formats.md, "Export"):
  * deepspec: the suite's DSpark / DFlash → `Qwen3DSparkModel`. The layout stores its own copies of
    the target's embedding and lm_head, so the suite's learned mask vector is written into the
    copy's row `mask_token_id`, which is the target's first end-of-sequence id: a token after which
    generation stops, so it is never an anchor of a drafted block (an anchor equal to it would see
    the mask vector instead of its embedding). Both layouts predict from every slot.
  * specforge: the suite's EAGLE head → `LlamaForCausalLMEagle3` with the whole vocabulary as its
    draft vocabulary (d2t all zeros) and the target's embedding and lm_head as its copies.
  * DeepSpec's layout is Qwen3's: a drafter whose layers have no q/k norms (a Llama-family target,
    e.g. the shipped SmolLM2 drafters) or q/k/v biases (Qwen2) is refused;
  * a drafter with a reduced draft vocabulary (the shipped ones: 8192 of 49152 tokens) cannot be
    written exactly (the published block layouts score the whole vocabulary: nothing gives the other
    tokens zero probability); it is refused unless `--full-vocabulary` asks to lift it: W2 gets
    zero rows outside the subset, so on the subset the logits are exactly the suite's, and the other
    tokens are scored by the target's own lm_head rows with no Markov bias (a different drafter
    outside the subset, said on the command's output);
  * refused: DSpark / DFlash in the SpecForge or z-lab DFlash layouts (they take the mask slots'
    input from the target's own embedding row, which cannot carry a learned vector, and z-lab's
    DFlash reads the mask slots only), and fixed-K draft LMs (already plain causal LMs).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specbench.errors import UserError

FORMATS = ("deepspec", "specforge", "dflash")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a suite drafter in a published format (deepspec, specforge)",
                              description="Write one of the suite's drafters in a published checkpoint layout.")
    p.add_argument("--drafter", required=True, help="the suite's drafter checkpoint directory (drafter.json)")
    p.add_argument("--format", required=True, choices=FORMATS, help="deepspec (DSpark/DFlash), specforge (EAGLE-3)")
    p.add_argument("--out", required=True, help="a new (or empty) directory to write config.json + model.safetensors")
    p.add_argument("--target", help="the drafter's target (default: the target its drafter.json names)")
    p.add_argument("--full-vocabulary", action="store_true",
                   help="lift a reduced draft vocabulary to the whole one (exact on the subset; docs/formats.md)")
    p.add_argument("--device", default="cpu", help="where to load the drafter and target to check them (default cpu)")
    p.set_defaults(func=main)
    return p


def target_spec(drafter: str) -> str:
    from specbench.drafters.checkpoints import CONFIG_NAME, resolve_checkpoint

    path = resolve_checkpoint(drafter)
    try:
        name = json.loads((path / CONFIG_NAME).read_text()).get("target_name")
    except json.JSONDecodeError as e:
        raise UserError(f"drafter {path}: corrupt {CONFIG_NAME}: {e}") from None
    if not name:
        raise UserError(f"drafter {path}: its {CONFIG_NAME} names no target; pass --target")
    return name


def export(drafter_spec: str, fmt: str, out: Path, target, full_vocabulary: bool = False) -> Path:
    """Write the suite drafter `drafter_spec` (for `target`, a loading.LoadedModel) as `fmt`."""
    from specbench.drafters.checkpoints import CONFIG_NAME, resolve_checkpoint
    from specbench.drafters.formats import checkpoint, deepspec, eagle3

    path = resolve_checkpoint(drafter_spec)
    kind = json.loads((path / CONFIG_NAME).read_text()).get("kind")
    target_config = json.loads((Path(target.path) / "config.json").read_text())
    if kind in ("dspark", "dflash"):
        if fmt != "deepspec":
            raise UserError(f"a {kind} drafter is exported with --format deepspec: the {fmt} layout takes the mask "
                            "slots' input from the target's embedding and cannot carry the suite's learned mask vector")
        from specbench.drafters.dspark import load_dspark_drafter

        drafter = load_dspark_drafter(drafter_spec, target)
        m = drafter.args.model_args
        if not m.qk_norm or m.attention_bias:
            raise UserError(f"drafter {drafter_spec}: DeepSpec's Qwen3DSparkModel has Qwen3 layers (q/k norms, no "
                            f"q/k/v bias); this drafter's layers follow its {m.extra.get('model_type', 'llama')} target "
                            f"(qk_norm={m.qk_norm}, attention_bias={m.attention_bias}), so it cannot be written exactly; "
                            "train one with q/k norms (specbench train --qk-norm, e.g. --init this drafter)")
        if drafter.args.draft_vocab and not full_vocabulary:
            raise UserError(f"drafter {drafter_spec} drafts from a reduced vocabulary of {drafter.args.draft_vocab} "
                            "tokens; the DeepSpec layout scores the whole vocabulary, so it cannot be exported exactly "
                            "(--full-vocabulary lifts it: exact on the subset, the target's head elsewhere)")
        if not target.eos_token_ids:
            raise UserError(f"target {target.name!r} has no end-of-sequence id to serve as the mask token")
        mask_id = int(target.eos_token_ids[0])
        state = deepspec.export_state(drafter)
        embed = state["embed_tokens.weight"].detach().clone()
        embed[mask_id] = drafter.mask_embedding.detach().to(embed.dtype)
        state["embed_tokens.weight"] = embed
        if drafter.args.draft_vocab and drafter.markov_w2 is not None:
            w2 = state["markov_head.markov_w2.weight"]  # [V_d, r]: row j is token vocab_ids[j]
            lifted = w2.new_zeros(drafter.args.model_args.vocab_size, w2.shape[1])
            lifted[drafter.vocab_ids.to(w2.device)] = w2
            state["markov_head.markov_w2.weight"] = lifted
        config = deepspec.export_config(drafter, target_config, mask_id)
    elif kind == "eagle":
        if fmt != "specforge":
            raise UserError("an eagle drafter is exported with --format specforge (LlamaForCausalLMEagle3)")
        from specbench.drafters.eagle import load_eagle_head

        head = load_eagle_head(drafter_spec, target)
        m = head.args.model_args
        if m.qk_norm or m.attention_bias or len(head.args.tap_layers) != 3:
            raise UserError(f"drafter {drafter_spec}: LlamaForCausalLMEagle3 has no q/k norms or q/k/v biases and fuses "
                            f"exactly 3 target layers; this head has qk_norm={m.qk_norm}, "
                            f"attention_bias={m.attention_bias}, {len(head.args.tap_layers)} taps")
        state, config = eagle3.export_state(head), eagle3.export_config(head, target_config)
    else:
        raise UserError(f"drafter {drafter_spec} is a {kind!r} drafter; export writes dspark, dflash and eagle drafters")
    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu() for k, v in state.items()}
    checkpoint.write_checkpoint(out, config, state)
    return out


def main(args) -> int:
    from specbench.engine.loading import load_model

    target = load_model(args.target or target_spec(args.drafter), device=args.device)
    out = export(args.drafter, args.format, Path(args.out), target, full_vocabulary=args.full_vocabulary)
    lifted = " with its draft vocabulary lifted to the whole vocabulary" if args.full_vocabulary else ""
    print(f"wrote {out} ({args.format}){lifted}")
    return 0
