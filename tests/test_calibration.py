"""STS calibration: recovers miscalibrated temperatures, lowers ECE, keeps AUC."""
from __future__ import annotations

import numpy as np

from specbench.policies.calibration import auc, calibration_table, expected_calibration_error, fit_sts


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
    from specbench.policies.calibration import calibration_from_traces

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


def test_ece_change_interval_resamples_requests():
    """A miscalibrated head fitted by STS: the change's bootstrap interval lies below 0 at position
    1 (true scale 0.5: ECE 0.10 before; later positions' prefix products are partly calibrated by
    accident, over- and under-confidence cancelling, so they need not improve). Fitting on
    the same data the interval is scored on would be cheating, so the fit comes from other rollouts;
    a head that is already calibrated (temperatures 1) gives a change of exactly 0."""
    from specbench.policies.calibration import calibration_from_traces

    temps = fit_sts(*simulated_rollouts(n=6000, seed=1))
    logits, verified, accepted = simulated_rollouts(n=3000, seed=2)
    for used, expect_below_zero in ((temps, True), (np.ones(4), False)):
        calibrated = 1 / (1 + np.exp(-logits / used[None]))
        traces = [{"confidence": calibrated[i : i + 100].tolist(), "verify_len": verified[i : i + 100].tolist(),
                   "accepted": accepted[i : i + 100].tolist()} for i in range(0, 3000, 100)]
        rows = calibration_from_traces(traces, used.tolist(), n_resamples=200)
        for r in rows:
            assert r["ece_change_lo"] <= r["ece_change"] <= r["ece_change_hi"]
            if expect_below_zero and r["position"] == 1:
                assert r["ece_change_hi"] < 0, r
            elif not expect_below_zero:
                assert r["ece_change"] == r["ece_change_lo"] == r["ece_change_hi"] == 0.0


def test_sts_file_per_temperature_and_nearest_fit(tmp_path):
    import json

    import pytest

    from specbench.policies.calibration import load_sts, nearest_fit, sts_for
    from specbench.errors import UserError

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"fits": [{"sampling_temperature": 0.0, "temperatures": [0.5, 0.7]},
                                         {"sampling_temperature": 1.0, "temperatures": [1.2, 0.9]}]}))
    fits = load_sts(path)
    assert fits == {0.0: [0.5, 0.7], 1.0: [1.2, 0.9]}
    assert [nearest_fit(list(fits), t) for t in (0.0, 0.3, 0.5, 0.7, 1.0, 2.0)] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # records' policy_params hold the fits keyed by strings; older records hold one list
    assert sts_for({"0": [0.5, 0.7], "1": [1.2, 0.9]}, 0.0) == [0.5, 0.7]
    assert sts_for({"0": [0.5, 0.7], "1": [1.2, 0.9]}, 0.8) == [1.2, 0.9]
    assert sts_for([1.1, 1.0], 0.0) == [1.1, 1.0]
    # a file from before per-temperature fits: one list, fitted at its sampling temperature
    path.write_text(json.dumps({"temperatures": [0.85, 1.05], "sampling_temperature": 1.0}))
    assert load_sts(path) == {1.0: [0.85, 1.05]}
    for bad in ("{not json", json.dumps({"fits": [{"temperatures": [1.0]}]}), json.dumps({"fits": []}),
                json.dumps({"temperatures": [1.0, -2.0]})):
        path.write_text(bad)
        with pytest.raises(UserError, match="cannot read STS calibration"):
            load_sts(path)
