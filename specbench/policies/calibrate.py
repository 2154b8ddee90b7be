"""`python -m specbench calibrate`: fit DSpark's Sequential Temperature Scaling on held-out rollouts.

Rollouts: the drafter verifies its full block every round (scheduler "fixed", so every position's
label is observed) on prompts held out from the drafter's training (the validation split of its
training data) — never on evaluation workloads. Each round gives the raw confidence logits z [γ]
and how many drafts were accepted; STS (specbench/policies/calibration.py) fits per-position temperatures.

One fit per deployment temperature (default 0 and 1): acceptance is a different event at T = 0
(argmax agreement) than at T > 0 (min(1, p/q)), and the head is trained on one of them; the
policy uses the fit nearest to each batch's temperature. The result is stored next to the drafter
as `calibration.json`; ECE/AUC per position before and after go with it.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from tqdm import tqdm

from specbench import atomic
from specbench.policies.calibration import calibration_table, fit_sts
from specbench.engine.core import SamplingConfig, generate


def held_out_prompts(data, n: int, val_fraction: float = 0.05, seed: int = 0) -> list[list[int]]:
    """Prompt token ids (the part before the first supervised token) of validation sequences."""
    _, val = data.split(val_fraction, seed)
    prompts = []
    for i in val[:n]:
        seq = data.sequence(i, ("input_ids", "loss_mask"))
        first = int(seq["loss_mask"].nonzero()[0]) if seq["loss_mask"].any() else len(seq["input_ids"])
        prompts.append(seq["input_ids"][:first].tolist())
    return prompts


def collect_rollouts(target, policy, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                     batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the (fixed-ℓ) DSpark policy; returns confidence logits [N, γ], verified [N], accepted [N]."""
    logits, verified, accepted = [], [], []
    for start in tqdm(range(0, len(prompts), batch_size), desc="calibration rollouts", unit="batch"):
        batch = prompts[start : start + batch_size]
        config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start)
        result = generate(target.model, policy, batch, config, target.eos_token_ids)
        for r, res in enumerate(result.requests):
            log = policy.confidence_log[r]
            assert len(log) == len(res.trace_verify_len)  # one logged block per verify round
            logits += log
            verified += res.trace_verify_len
            accepted += res.trace_accepted
    return np.array(logits, dtype=float), np.array(verified), np.array(accepted)


def calibrate(target, drafter: str, data, n_prompts: int = 64, temperatures: tuple[float, ...] = (0.0, 1.0),
              max_new_tokens: int = 384, batch_size: int = 8, seed: int = 0, write: bool = True) -> dict:
    from specbench.policies.registry import build_dspark

    policy = build_dspark(target, drafter=drafter, scheduler="fixed", calibrated=False)
    prompts = held_out_prompts(data, n_prompts)
    fits = []
    for temperature in temperatures:
        logits, verified, accepted = collect_rollouts(target, policy, prompts, temperature, max_new_tokens, batch_size, seed)
        sts = fit_sts(logits, verified, accepted)
        table = calibration_table(logits, verified, accepted, sts)
        fits.append({
            "sampling_temperature": float(temperature), "temperatures": [float(t) for t in sts], "per_position": table,
            "rollouts": int(len(logits)),
            "ece_before_mean": float(np.nanmean([r["ece_before"] for r in table])),
            "ece_after_mean": float(np.nanmean([r["ece_after"] for r in table])),
        })
    result = {
        "fits": fits, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "prompt_source": f"{data.path} (validation split)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
    }
    if write:
        from specbench.drafters.checkpoints import resolve_checkpoint

        path = resolve_checkpoint(drafter) / "calibration.json"
        atomic.write_json(path, result)
        result["path"] = str(path)
    return result
