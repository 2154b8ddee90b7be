"""What every peer engine (transformers, vLLM, llama.cpp: specbench/bench/baselines.py,
vllm_engine.py, llamacpp_engine.py) shares: parameter merging, a result whose counters may be
unknown, counting one verify round, and the fixed-k policy's draft LM as a transformers model."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from specbench.engine.core import RequestResult
from specbench.errors import UserError


def fixed_k_defaults() -> dict:
    try:
        from specbench.policies.registry import read_spec

        return dict(read_spec("fixed-k").get("params", {}))
    except UserError:
        return {"k": 4, "drafter": "truncate:8"}


def merge_params(name: str, defaults: dict, overrides: dict) -> dict:
    """`defaults` updated with `overrides`; UserError naming the first override that is not a parameter."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        valid = ", ".join(defaults) or "none"
        raise UserError(f"baseline {name!r} has no parameter {unknown[0]!r} (parameters: {valid})")
    return {**defaults, **overrides}


@dataclass
class PeerRequestResult(RequestResult):
    """A peer engine's RequestResult: counters and TTFT may be unknown (None), τ is given."""

    ttft_s: float | None = None
    rounds: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    tau_value: float | None = None

    @property
    def tau(self):
        return self.tau_value


def add_round(res: RequestResult, drafted: int, accepted: int) -> None:
    """Count one verify round of `drafted` drafts of which the first `accepted` were accepted."""
    res.drafted += drafted
    res.accepted += accepted
    res.trace_verify_len.append(drafted)
    res.trace_accepted.append(accepted)
    for pos_list, m in ((res.drafted_per_position, drafted), (res.accepted_per_position, accepted)):
        if len(pos_list) < m:
            pos_list.extend([0] * (m - len(pos_list)))
        for k in range(m):
            pos_list[k] += 1


def hf_draft_model(drafter: str, target, hf_target):
    """The fixed-k draft LM as a transformers model: `self`, `truncate:N`, or a trained checkpoint."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(hf_target.config)
    base_state = hf_target.state_dict()
    n_target = cfg.num_hidden_layers
    if drafter == "self" or drafter.startswith("truncate:"):
        n = n_target
        if drafter != "self":
            try:
                n = int(drafter.split(":", 1)[1])
            except ValueError:
                raise UserError(f"drafter {drafter!r}: expected truncate:N with an integer N") from None
            if not 1 <= n <= n_target:
                raise UserError(f"drafter {drafter!r}: N must be between 1 and {n_target}")
        state = {k: v for k, v in base_state.items()
                 if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < n}
        overrides = {"num_hidden_layers": n}
    else:
        from specbench.drafters.checkpoints import read_draft_lm

        config, ckpt, _ = read_draft_lm(drafter, target)  # the token ranking is not a weight
        a = config["model_args"]
        overrides = {"num_hidden_layers": a["n_layers"], "hidden_size": a["dim"], "num_attention_heads": a["n_heads"],
                     "num_key_value_heads": a["n_kv_heads"], "intermediate_size": a["intermediate_size"],
                     "head_dim": a.get("head_dim") or a["dim"] // a["n_heads"], "rms_norm_eps": a.get("norm_eps", 1e-5)}
        state = dict(ckpt)
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            if k in base_state:
                state[k] = base_state[k]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[: cfg.num_hidden_layers]
    dtype = next(hf_target.parameters()).dtype
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise UserError(f"drafter {drafter!r} does not fit a transformers {cfg.model_type} model "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.to(hf_target.device).eval().requires_grad_(False)
    return model
