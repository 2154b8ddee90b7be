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
