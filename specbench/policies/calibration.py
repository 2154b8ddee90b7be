"""Calibration of DSpark's confidence head: Sequential Temperature Scaling (STS) and its metrics.

The head's score c_k = σ(z_k) predicts the *conditional* acceptance of draft k given drafts
1..k−1 were accepted; the scheduler multiplies them into prefix survivals a_k = Π_{i≤k} c_i, so
what must be calibrated is that product. STS (the DSpark paper's rule; the choices it leaves open, docs/dspark.md §3.2)
fits one temperature per position, left to right: T_k minimises the ECE of Π_{i≤k} σ(z_i / T_i)
against the empirical prefix-acceptance labels y_k = 1[drafts 1..k all accepted], earlier
temperatures held fixed. Temperature scaling keeps each position's ranking, so AUC is unchanged.

Inputs are held-out rollouts verified over the full block (no scheduler): per proposal the
confidence logits z [γ], how many drafts were verified, and how many were accepted.

Fitting (`python -m specbench calibrate`, :func:`calibrate`). Rollouts: the drafter verifies its
full block every round (scheduler "fixed", so every position's label is observed) on prompts held
out from the drafter's training (the validation split of its training data) — never on
evaluation workloads. Each round gives the raw confidence logits z [γ] and how many drafts were
accepted; STS fits per-position temperatures.

One fit per deployment temperature (default 0 and 1): acceptance is a different event at T = 0
(argmax agreement) than at T > 0 (min(1, p/q)), and the head is trained on one of them; the
policy uses the fit nearest to each batch's temperature. The result is stored next to the drafter
as `calibration.json`; ECE/AUC per position before and after go with it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specbench import atomic
from specbench.engine.core import SamplingConfig, generate
from specbench.errors import UserError

GRID = np.round(np.arange(0.05, 5.0001, 0.05), 2)  # candidate temperatures
N_BINS = 15


def prefix_labels(verified: np.ndarray, accepted: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """labels[n, k] = 1 if drafts 1..k+1 were all accepted; valid[n, k] if position k+1 was verified."""
    k = np.arange(1, gamma + 1)[None]
    return (accepted[:, None] >= k).astype(float), verified[:, None] >= k


def expected_calibration_error(pred: np.ndarray, label: np.ndarray, n_bins: int = N_BINS) -> float:
    """Equal-width-bin ECE: Σ_b (n_b / N) · |mean prediction_b − mean label_b|."""
    if len(pred) == 0:
        return float("nan")
    bins = np.minimum((pred * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in np.unique(bins):
        in_bin = bins == b
        total += in_bin.sum() * abs(pred[in_bin].mean() - label[in_bin].mean())
    return total / len(pred)


def auc(pred: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    from scipy.stats import rankdata

    pos, neg = label == 1, label == 0
    if pos.sum() == 0 or neg.sum() == 0:
        return float("nan")
    ranks = rankdata(pred)
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * neg.sum()))


def cumulative_predictions(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    return np.cumprod(1.0 / (1.0 + np.exp(-logits / temperatures[None])), axis=1)


def fit_sts(logits: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Per-position temperatures [γ], fitted left to right by grid search (ties → closest to 1)."""
    gamma = logits.shape[1]
    labels, valid = prefix_labels(verified, accepted, gamma)
    temperatures = np.ones(gamma)
    order = np.argsort(np.abs(GRID - 1.0), kind="stable")  # try T = 1 first so ties keep it
    for k in range(gamma):
        rows = valid[:, k]
        if rows.sum() == 0:
            continue
        best_t, best_ece = 1.0, np.inf
        for t in GRID[order]:
            temperatures[k] = t
            pred = cumulative_predictions(logits[rows, : k + 1], temperatures[: k + 1])[:, k]
            ece = expected_calibration_error(pred, labels[rows, k])
            if ece < best_ece - 1e-12:
                best_t, best_ece = t, ece
        temperatures[k] = best_t
    return temperatures


def calibration_table(logits: np.ndarray, verified: np.ndarray, accepted: np.ndarray,
                      temperatures: np.ndarray | None = None) -> list[dict]:
    """Per position: n, ECE and AUC of the cumulative prediction, before (T = 1) and after STS."""
    gamma = logits.shape[1]
    labels, valid = prefix_labels(verified, accepted, gamma)
    raw = cumulative_predictions(logits, np.ones(gamma))
    scaled = cumulative_predictions(logits, temperatures) if temperatures is not None else None
    rows = []
    for k in range(gamma):
        m = valid[:, k]
        row = {"position": k + 1, "n": int(m.sum()), "label_rate": float(labels[m, k].mean()) if m.any() else float("nan"),
               "ece_before": expected_calibration_error(raw[m, k], labels[m, k]), "auc": auc(raw[m, k], labels[m, k])}
        if scaled is not None:
            row["temperature"] = float(temperatures[k])
            row["ece_after"] = expected_calibration_error(scaled[m, k], labels[m, k])
        rows.append(row)
    return rows


def load_sts(path: str | Path) -> dict[float, list[float]]:
    """A drafter's calibration.json → {sampling temperature: per-position STS temperatures}.

    One fit per deployment temperature: what "accepted" means depends on it (at T = 0 a draft is
    accepted when it is the target's argmax; at T > 0 with probability min(1, p/q)), so a head
    calibrated at one temperature is not calibrated at another. Files written before per-temperature
    fits hold a single `temperatures` list, fitted at `sampling_temperature`."""
    try:
        data = json.loads(Path(path).read_text())
        if "fits" in data:
            fits = {float(f["sampling_temperature"]): [float(t) for t in f["temperatures"]] for f in data["fits"]}
        else:
            fits = {float(data.get("sampling_temperature", 1.0)): [float(t) for t in data["temperatures"]]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read STS calibration {path}: {type(e).__name__}: {e}") from None
    if not fits or any(not t or min(t) <= 0 for t in fits.values()):
        raise UserError(f"cannot read STS calibration {path}: no fit, or a temperature that is not positive")
    return fits


def nearest_fit(fitted: list[float], temperature: float) -> float:
    """The fitted sampling temperature to use at `temperature`: the nearest one (ties → the lower)."""
    return min(fitted, key=lambda t: (abs(t - temperature), t))


def sts_for(sts: list | dict, temperature: float) -> list[float]:
    """STS temperatures as a record's `policy_params.sts` holds them (one list, or one list per
    fitted sampling temperature keyed by its string) for a run at `temperature`."""
    if not isinstance(sts, dict):
        return [float(t) for t in sts]
    fits = {float(k): v for k, v in sts.items()}
    return [float(t) for t in fits[nearest_fit(list(fits), temperature)]]


def calibration_from_traces(traces: list[dict], temperatures: list[float], n_resamples: int = 0,
                            seed: int = 0) -> list[dict]:
    """Per-position ECE / AUC on the rounds of real runs (held-out evaluation prompts).

    traces: the records' `trace` dicts (`confidence` = per round the calibrated c_k = σ(z_k / T_k),
    `verify_len`, `accepted`); temperatures: the STS temperatures the run used (policy params
    `sts`), to recover the uncalibrated σ(z_k) for the "before" column. Rounds that drafted nothing
    are skipped. Under a scheduler, position k is labelled only in rounds that verified ≥ k drafts:
    the labels are censored exactly as the scheduler's decisions make them, which is what the
    scheduler needs calibrated.

    n_resamples > 0 adds, per position, the change ECE after − before with a 95% percentile
    bootstrap interval that resamples whole requests (rounds of one request are not independent):
    `ece_change`, `ece_change_lo`, `ece_change_hi`."""
    temps = np.asarray(temperatures, dtype=float)
    logits, verified, accepted, request = [], [], [], []
    for i, tr in enumerate(traces):
        for conf, v, a in zip(tr.get("confidence") or [], tr["verify_len"], tr["accepted"]):
            if not conf:
                continue
            c = np.clip(np.asarray(conf, dtype=float), 1e-6, 1 - 1e-6)
            g = min(len(c), len(temps))
            z = np.log(c[:g] / (1 - c[:g])) * temps[:g]  # the raw logit z_k = T_k · logit(c_k)
            logits.append(z)
            verified.append(v)
            accepted.append(a)
            request.append(i)
    if not logits:
        return []
    gamma = min(len(z) for z in logits)
    z = np.stack([x[:gamma] for x in logits])
    verified, accepted, request = np.asarray(verified), np.asarray(accepted), np.asarray(request)
    rows = calibration_table(z, verified, accepted, temps[:gamma])
    if n_resamples > 0:
        for row, (lo, hi) in zip(rows, _ece_change_ci(z, verified, accepted, request, temps[:gamma], n_resamples, seed)):
            row.update(ece_change=row["ece_after"] - row["ece_before"], ece_change_lo=lo, ece_change_hi=hi)
    return rows


def _ece_change_ci(z, verified, accepted, request, temps, n_resamples: int, seed: int) -> list[tuple[float, float]]:
    """Per position, the 2.5 / 97.5 percentiles of ECE after − before over request resamples."""
    gamma = z.shape[1]
    labels, valid = prefix_labels(verified, accepted, gamma)
    raw, scaled = cumulative_predictions(z, np.ones(gamma)), cumulative_predictions(z, temps)
    ids = np.unique(request)
    rounds_of = [np.flatnonzero(request == i) for i in ids]
    rng = np.random.default_rng(seed)
    changes = np.full((n_resamples, gamma), np.nan)
    for b in range(n_resamples):
        pick = np.concatenate([rounds_of[j] for j in rng.integers(0, len(ids), len(ids))])
        for k in range(gamma):
            m = pick[valid[pick, k]]
            if len(m):
                changes[b, k] = (expected_calibration_error(scaled[m, k], labels[m, k])
                                 - expected_calibration_error(raw[m, k], labels[m, k]))
    out = []
    for k in range(gamma):
        c = changes[:, k][~np.isnan(changes[:, k])]
        out.append((float(np.percentile(c, 2.5)), float(np.percentile(c, 97.5))) if len(c) else (float("nan"), float("nan")))
    return out


# ---------------------------------------------------------------------------------------------
# Fitting on held-out rollouts


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
    """Run the (fixed-ℓ) DSpark policy; returns confidence logits [N, γ], verified [N], accepted [N],
    one row per drafted round: the raw logits the core records per round
    (`RequestResult.trace_confidence_logits`) beside that round's verify length and accepted count."""
    logits, verified, accepted = [], [], []
    for start in tqdm(range(0, len(prompts), batch_size), desc="calibration rollouts", unit="batch"):
        batch = prompts[start : start + batch_size]
        config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start)
        result = generate(target.model, policy, batch, config, target.eos_token_ids)
        for res in result.requests:
            for z, v, a in zip(res.trace_confidence_logits, res.trace_verify_len, res.trace_accepted, strict=True):
                if z:  # a round that drafted (the fixed scheduler drafts every round)
                    logits.append(z)
                    verified.append(v)
                    accepted.append(a)
    return np.array(logits, dtype=float), np.array(verified), np.array(accepted)


def calibrate(target, policy, drafter: str, data, n_prompts: int = 64, temperatures: tuple[float, ...] = (0.0, 1.0),
              max_new_tokens: int = 384, batch_size: int = 8, seed: int = 0, write: bool = True) -> dict:
    """Fit STS for `policy` (a DSpark policy over `drafter`, built uncalibrated with scheduler
    "fixed": `registry.build_dspark(..., scheduler="fixed", calibrated=False)`) and store the fits
    as the drafter's calibration.json."""
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
