"""Drafters in the formats the field publishes, loaded into the suite's modules and exported.

    load_published(spec, target) → (kind, module)   kind "dspark" / "dflash" / "eagle" / "draft-lm"

`spec` is a local directory with config.json + safetensors or a hub id (formats/checkpoint.py).
The layout is chosen by the config's `architectures[0]`:

    Qwen3DSparkModel, DFlashQwen3DSparkModel   DeepSpec DSpark / DFlash    formats/deepspec.py
    DSparkDraftModel                           SpecForge DSpark            formats/specforge.py
    DFlashDraftModel                           z-lab / SpecForge DFlash    formats/dflash.py
    LlamaForCausalLMEagle3                     SpecForge / SafeAILab EAGLE-3 formats/eagle3.py
    any *ForCausalLM                           a plain draft LM (fixed-K)  formats/hf_draft_lm.py

docs/formats.md describes each layout and how the suite's own architectures differ.
"""
from __future__ import annotations

from pathlib import Path

from specbench.errors import UserError
from specbench.drafters.formats import checkpoint


# Published layouts this suite knows of but does not load, and why (docs/formats.md).
UNSUPPORTED = {
    "Qwen3Eagle3Model": "DeepSpec's own EAGLE-3 layout (its modeling file was not available to implement it from; "
                        "SpecForge's LlamaForCausalLMEagle3 is supported)",
    "Gemma4DSparkModel": "DeepSpec's Gemma-4 DSpark (Gemma layers, softcapping: the suite's decoder is Llama/Qwen-family)",
    "Gemma4Eagle3Model": "DeepSpec's Gemma-4 EAGLE-3 (the suite's decoder is Llama/Qwen-family)",
    "DFlash2DraftModel": "z-lab's DFlash-2 (dynamic convolutions and a candidate selector, not DFlash)",
}


def is_published(spec: str) -> bool:
    """True when `spec` names a published-format drafter (config.json) rather than a suite
    checkpoint (drafter.json) or a built-in draft-LM spec."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return (path / checkpoint.CONFIG).is_file() and not (path / "drafter.json").is_file()
    from specbench import resources

    shipped = resources.find(spec)
    if (shipped is not None and (shipped / "drafter.json").is_file()) or spec == "self" or spec.startswith("truncate:"):
        return False
    return not path.exists() and bool(checkpoint.HUB_ID.fullmatch(spec))


def architecture(config: dict, where: str) -> str:
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UserError(f"drafter {where}: config.json names no architectures")
    return archs[0]


def load_published(spec: str, target):
    """(kind, module) for a published drafter, checked against `target` (a loading.LoadedModel)."""
    from specbench.drafters.formats import deepspec, dflash, eagle3, hf_draft_lm, specforge

    path = checkpoint.resolve(spec)
    config = checkpoint.read_config(path)
    arch = architecture(config, spec)
    layouts = [("dspark", deepspec), ("dflash", dflash), ("dspark", specforge), ("eagle", eagle3)]
    for kind, layout in layouts:
        if arch in layout.ARCHITECTURES:
            module = layout.load(spec, config, checkpoint.read_weights(path), target)
            if kind == "dspark" and module.args.markov_rank == 0 and not module.args.confidence_head:
                kind = "dflash"
            return kind, module
    if arch in UNSUPPORTED:
        raise UserError(f"drafter {spec}: architecture {arch!r} is not supported: {UNSUPPORTED[arch]}")
    if hf_draft_lm.is_causal_lm(arch):
        return "draft-lm", hf_draft_lm.load(spec, path, config, target)
    known = [a for _, layout in layouts for a in layout.ARCHITECTURES] + ["*ForCausalLM"]
    raise UserError(f"drafter {spec}: unknown architecture {arch!r} (supported: {', '.join(known)})")


def load_drafter_any(spec: str, target, kinds: tuple[str, ...], suite_loader):
    """A published-format drafter (checked to be one of `kinds`) or else the suite's own checkpoint
    through `suite_loader(spec, target)`: the one place the policy builders dispatch on format."""
    if not is_published(spec):
        return suite_loader(spec, target)
    found, module = load_published(spec, target)
    if found not in kinds:
        raise UserError(f"drafter {spec} is a published {found!r} drafter, not {' / '.join(kinds)}")
    return module
