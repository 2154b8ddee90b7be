"""STS calibration: recovers miscalibrated temperatures, lowers ECE, keeps AUC."""
from __future__ import annotations

import numpy as np

from specbench.calibration import auc, calibration_table, expected_calibration_error, fit_sts


def simulated_rollouts(n=20000, gamma=4, true_scale=(0.5, 2.0, 1.0, 0.7), seed=0):
    """True conditional acceptance σ(s_k · z_k); the head reports z_k (miscalibrated by 1/s_k)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.0, 1.5, size=(n, gamma))
    p_true = 1 / (1 + np.exp(-logits * np.array(true_scale)[None]))
    accepted_step = rng.random((n, gamma)) < p_true
    accepted = np.cumprod(accepted_step, axis=1).sum(axis=1)
    verified = np.full(n, gamma)
    return logits, verified, accepted


def test_sts_recovers_temperatures_and_lowers_ece():
    logits, verified, accepted = simulated_rollouts()
    temps = fit_sts(logits, verified, accepted)
    np.testing.assert_allclose(temps, 1 / np.array([0.5, 2.0, 1.0, 0.7]), rtol=0.15)
    table = calibration_table(logits, verified, accepted, temps)
    for row in table:
        assert row["ece_after"] <= row["ece_before"] + 1e-9
        assert row["ece_after"] < 0.02
    assert np.mean([r["ece_before"] for r in table]) > 2 * np.mean([r["ece_after"] for r in table])


def test_ece_and_auc_basics():
    pred = np.array([0.1, 0.4, 0.35, 0.8])
    label = np.array([0, 0, 1, 1])
    assert abs(auc(pred, label) - 0.75) < 1e-12
    perfect = np.array([0.0, 1.0, 0.0, 1.0])
    assert expected_calibration_error(perfect, perfect) == 0.0
    assert abs(expected_calibration_error(np.full(4, 0.75), label) - 0.25) < 1e-12


def test_calibration_from_run_traces_matches_rollout_table():
    """The report's held-out table, from records' traces (calibrated confidences + the STS
    temperatures), equals the table computed from the raw logits directly."""
    from specbench.calibration import calibration_from_traces

    logits, verified, accepted = simulated_rollouts(n=3000)
    temps = fit_sts(logits, verified, accepted)
    calibrated = 1 / (1 + np.exp(-logits / temps[None]))
    traces = [{"confidence": calibrated[i : i + 100].round(6).tolist(), "verify_len": verified[i : i + 100].tolist(),
               "accepted": accepted[i : i + 100].tolist()} for i in range(0, 3000, 100)]
    traces[0]["confidence"][0] = []  # a round the draft gate skipped: ignored
    direct = calibration_table(logits[1:], verified[1:], accepted[1:], temps)
    from_traces = calibration_from_traces(traces, temps.tolist())
    for a, b in zip(direct, from_traces):
        assert a["n"] == b["n"]
        np.testing.assert_allclose([a["ece_before"], a["ece_after"], a["auc"]],
                                   [b["ece_before"], b["ece_after"], b["auc"]], atol=2e-3)
    assert np.mean([b["ece_after"] for b in from_traces]) < 0.5 * np.mean([b["ece_before"] for b in from_traces])
