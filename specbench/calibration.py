"""Calibration of DSpark's confidence head: Sequential Temperature Scaling (STS) and its metrics.

The head's score c_k = σ(z_k) predicts the *conditional* acceptance of draft k given drafts
1..k−1 were accepted; the scheduler multiplies them into prefix survivals a_k = Π_{i≤k} c_i, so
what must be calibrated is that product. STS (DSpark §3.2.1; concrete choices in dspark.md §3.4)
fits one temperature per position, left to right: T_k minimises the ECE of Π_{i≤k} σ(z_i / T_i)
against the empirical prefix-acceptance labels y_k = 1[drafts 1..k all accepted], earlier
temperatures held fixed. Temperature scaling keeps each position's ranking, so AUC is unchanged.

Inputs are held-out rollouts verified over the full block (no scheduler): per proposal the
confidence logits z [γ], how many drafts were verified, and how many were accepted.
"""
from __future__ import annotations

import numpy as np

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


def calibration_from_traces(traces: list[dict], temperatures: list[float]) -> list[dict]:
    """Per-position ECE / AUC on the rounds of real runs (held-out evaluation prompts).

    traces: the records' `trace` dicts (`confidence` = per round the calibrated c_k = σ(z_k / T_k),
    `verify_len`, `accepted`); temperatures: the STS temperatures the run used (policy params
    `sts`), to recover the uncalibrated σ(z_k) for the "before" column. Rounds that drafted nothing
    are skipped. Under a scheduler, position k is labelled only in rounds that verified ≥ k drafts:
    the labels are censored exactly as the scheduler's decisions make them, which is what the
    scheduler needs calibrated."""
    temps = np.asarray(temperatures, dtype=float)
    logits, verified, accepted = [], [], []
    for tr in traces:
        for conf, v, a in zip(tr.get("confidence") or [], tr["verify_len"], tr["accepted"]):
            if not conf:
                continue
            c = np.clip(np.asarray(conf, dtype=float), 1e-6, 1 - 1e-6)
            g = min(len(c), len(temps))
            z = np.log(c[:g] / (1 - c[:g])) * temps[:g]  # the raw logit z_k = T_k · logit(c_k)
            logits.append(z)
            verified.append(v)
            accepted.append(a)
    if not logits:
        return []
    gamma = min(len(z) for z in logits)
    z = np.stack([x[:gamma] for x in logits])
    return calibration_table(z, np.asarray(verified), np.asarray(accepted), temps[:gamma])
