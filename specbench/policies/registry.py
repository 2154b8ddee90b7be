"""Policy specs → policy objects.

A spec is a TOML file in the top-level `policies/` folder (or a path to one) naming a builder and
its parameters, e.g. `policies/fixed-k.toml`:

    name = "fixed-k"
    builder = "specbench.policies.registry:build_fixed_k"
    [params]
    k = 4
    drafter = "drafters/smollm2-135m/fixed-k"

Third-party policies plug in the same way (a builder given by import path in their own TOML), or
through the `specbench.policies` entry-point group (name → builder). A builder is called as
`builder(target, **params)` with the loaded target (`specbench.engine.loading.LoadedModel`) and returns a
`specbench.engine.policy.Policy`.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from specbench import resources
from specbench.errors import UserError
from specbench.engine.policy import Policy

def builtin_specs() -> dict[str, Path]:
    """{name: spec} of `policies/*.toml` in the shipped folders (specbench/resources.py)."""
    return resources.files("policies", "*.toml")


def entry_point_builders() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="specbench.policies")}


def list_policies() -> list[str]:
    return sorted(set(builtin_specs()) | set(entry_point_builders()))


def read_spec(name_or_path: str) -> dict:
    """The spec dict (`name`, `builder`, `params`) for a policy name or a TOML path."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml"):
        if not path.is_file():
            raise UserError(f"policy spec {name_or_path} does not exist")
    elif name_or_path in builtin_specs():
        path = builtin_specs()[name_or_path]
    elif name_or_path in entry_point_builders():
        ep = entry_point_builders()[name_or_path]
        return {"name": name_or_path, "builder": ep.value, "params": {}}
    else:
        raise UserError(f"unknown policy {name_or_path!r} (valid: {', '.join(list_policies())}, or a path to a .toml spec)")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}") from None
    if "builder" not in spec:
        raise UserError(f"{path}: a policy spec needs a `builder = \"module:function\"` entry")
    spec.setdefault("name", path.stem)
    spec.setdefault("params", {})
    return spec


def import_object(dotted: str):
    module_name, _, attr = dotted.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UserError(f"cannot import {dotted!r}: {e}") from None
    return obj


def build_policy(name_or_path: str, target, overrides: dict | None = None) -> Policy:
    spec = read_spec(name_or_path)
    params = {**spec["params"], **(overrides or {})}
    # Generic debug knob (any policy): an artificial delay per round, to test the regression gate.
    try:
        delay_ms = float(params.pop("debug_round_delay_ms", 0.0))
    except (TypeError, ValueError):
        raise UserError(f"policy {spec['name']!r}: debug_round_delay_ms must be a number") from None
    builder = import_object(spec["builder"])
    try:
        policy = builder(target, **params)
    except TypeError as e:
        raise UserError(f"policy {spec['name']!r}: bad parameters {sorted(params)}: {e}") from None
    except ValueError as e:
        raise UserError(f"policy {spec['name']!r}: {e}") from None
    policy.name = spec["name"]
    if delay_ms > 0:
        policy.debug_round_delay_s = delay_ms / 1e3
    return policy


# ---------------------------------------------------------------------------------------------
# Builders of the built-in policies


def build_ar(target) -> Policy:
    return Policy()


def build_pld(target, k: int = 4, min_ngram: int = 1, max_ngram: int = 3) -> Policy:
    from specbench.policies.pld import PromptLookup

    return PromptLookup(k=k, min_ngram=min_ngram, max_ngram=max_ngram)


def build_fixed_k(target, k: int = 4, drafter: str = "truncate:8", draft_vocab: int = 0, lookup_ngram: int = 0,
                  lookup_k: int = 4) -> Policy:
    """A fixed-K draft LM; lookup_ngram = n > 0: a row whose last n tokens occur earlier in it drafts the
    lookup_k tokens that followed instead (policies/fixed_k.py; 0: off)."""
    from specbench.drafters.checkpoints import load_draft_lm
    from specbench.drafters.formats import load_drafter_any
    from specbench.policies.fixed_k import FixedK

    check_counts(("k", k, 1, ""), ("draft_vocab", draft_vocab, 0, " (0: the whole vocabulary)"),
                 ("lookup_ngram", lookup_ngram, 0, " (0: off)"), ("lookup_k", lookup_k, 1, ""))
    return FixedK(load_drafter_any(drafter, target, ("draft-lm",), load_draft_lm), k=k, drafter=drafter,
                  draft_vocab=draft_vocab, lookup_ngram=lookup_ngram, lookup_k=lookup_k)


def check_counts(*checks: tuple[str, object, int, str]) -> None:
    """One clear error for the first (name, value, least, meaning) whose value is not a whole number >= least."""
    for name, value, least, meaning in checks:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"{name} must be a whole number >= {least}{meaning}, got {value!r}")


def build_eagle(target, drafter: str = "drafters/smollm2-135m/eagle", mode: str = "tree", depth: int = 5,
                top_k: int = 10, total_tokens: int = 60, draft_vocab: int = -1, lookup_ngram: int = 0,
                lookup_k: int = 4) -> Policy:
    """EAGLE over a trained EAGLE-3-style head (the suite's or a published one): a dynamic draft tree
    (mode "tree", EAGLE-2's depth / top_k / total_tokens) or a chain of `depth` drafts; docs/eagle.md §4.
    lookup_ngram = n > 0 (chains): a row whose last n tokens occur earlier in it drafts the lookup_k tokens
    that followed instead (policies/eagle.py; 0: off)."""
    from specbench.drafters.eagle import load_eagle_head
    from specbench.drafters.formats import load_drafter_any
    from specbench.policies.eagle import Eagle

    check_counts(("lookup_ngram", lookup_ngram, 0, " (0: off)"), ("lookup_k", lookup_k, 1, ""))
    if lookup_ngram and mode != "chain":
        raise UserError("lookup drafts (lookup_ngram) are for EAGLE's chain mode only")
    return Eagle(load_drafter_any(drafter, target, ("eagle",), load_eagle_head), mode=mode, depth=depth, top_k=top_k,
                 total_tokens=total_tokens, draft_vocab=draft_vocab, drafter=drafter, lookup_ngram=lookup_ngram,
                 lookup_k=lookup_k)


def build_eagle_chain(target, drafter: str = "drafters/smollm2-135m/eagle", depth: int = 5,
                      draft_vocab: int = -1, lookup_ngram: int = 0, lookup_k: int = 4) -> Policy:
    return build_eagle(target, drafter=drafter, mode="chain", depth=depth, draft_vocab=draft_vocab,
                       lookup_ngram=lookup_ngram, lookup_k=lookup_k)


def build_dspark(target, drafter: str = "drafters/smollm2-135m/dspark", scheduler: str = "algorithm1",
                 threshold: float = 0.5, gamma: int | None = None, profile: str = "auto", calibrated: bool = True,
                 draft_gate: bool | None = None, draft_vocab: int = 0, block: int = 0, lookup_ngram: int = 0,
                 lookup_k: int = 4) -> Policy:
    """DSpark / DFlash over a trained drafter; `profile` is "auto" (this device's cost profile,
    measured once and cached) or a path to a profile json from `specbench profile`. draft_gate
    (policies/dspark.py): skip the drafter while it does not pay; default on with the cost-model
    schedulers (algorithm1, capacity), off otherwise. draft_vocab = n > 0: at most the first n of the
    drafter's ranked draft tokens (0: all it was trained with). block = n > 0: draft n slots a round instead of
    the γ it was trained with (keep_block; 0 or n ≥ γ: all γ). lookup_ngram = n > 0: a row whose last n tokens
    occur earlier in it drafts the lookup_k tokens that followed instead of its drafted block (policies/dspark.py,
    "Lookup drafts"; 0: off)."""
    from specbench.costs import profile as profiles
    from specbench.costs.schema import cut_variant, read_profile
    from specbench.policies.calibration import load_sts
    from specbench.drafters.checkpoints import resolve_checkpoint
    from specbench.drafters.dspark import load_dspark_drafter
    from specbench.policies.dspark import DSpark

    from specbench.drafters.formats import is_published, load_drafter_any

    check_counts(("draft_vocab", draft_vocab, 0, " (0: all the drafter's draft tokens)"),
                 ("block", block, 0, " (0: the block the drafter was trained with)"),
                 ("lookup_ngram", lookup_ngram, 0, ""), ("lookup_k", lookup_k, 1, ""))
    model = load_drafter_any(drafter, target, ("dspark", "dflash"), load_dspark_drafter)
    # draft_vocab = n > 0: draft from at most the first n of its ranked draft tokens (keep_draft_vocab). A drafter
    # with fewer, or drafting from the whole vocabulary (nothing ranked to cut), is used whole; the records'
    # policy_params give the size it drafted from.
    cut = 0 < draft_vocab < model.draft_vocab_size and getattr(model, "vocab_ids", None) is not None
    if cut:
        model.keep_draft_vocab(draft_vocab)
    block_cut = 0 < block < model.block_size
    if block_cut:
        model.keep_block(block)
    temperatures = None  # STS: {sampling temperature: per-position temperatures}
    # STS fitted by `specbench calibrate` lives beside the drafter (a published one: in its directory).
    calibration = (Path(drafter) if is_published(drafter) else resolve_checkpoint(drafter)) / "calibration.json"
    if calibrated and calibration.is_file():
        temperatures = load_sts(calibration)
    step_seconds = draft_seconds = data = None
    if scheduler in ("algorithm1", "capacity"):
        if profile == "auto":
            data = profiles.load_or_measure(target, drafter=model, drafter_name=drafter,
                                            variant=cut_variant(draft_vocab if cut else 0, block if block_cut else 0))
        else:
            data = read_profile(profile)
        step_seconds = profiles.step_time_model(data)
        if "draft" in data:
            draft_seconds = profiles.draft_time_model(data["draft"])
    policy = DSpark(model, scheduler=scheduler, threshold=threshold, sts_temperatures=temperatures,
                    step_seconds=step_seconds, draft_seconds=draft_seconds, max_length=gamma, drafter_name=drafter,
                    draft_gate=(scheduler in ("algorithm1", "capacity")) if draft_gate is None else draft_gate,
                    lookup_ngram=lookup_ngram, lookup_k=lookup_k)
    policy.cost_profile = data  # what it schedules from (`specbench profile --policy` stores it)
    return policy
