"""Tests for specbench.analysis.stats: pairing, CIs (coverage), tests vs scipy, Holm, acceptance."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as st

from specbench.analysis import stats
from specbench.errors import UserError

from fakerecords import make_records, rec, write_records


def frame(records) -> pd.DataFrame:
    return pd.DataFrame(records)


# ---------------------------------------------------------------------------------------------
# Coverage of the bootstrap CI (the whole pipeline: records -> pairing -> summarize)


def test_ci_coverage_of_true_geometric_mean_speedup():
    """300 simulated sweeps, n=40 prompts each, lognormal per-prompt effects around a known
    geometric-mean speedup; the 95% CI must cover it in 90%..99% of data sets
    (binomial sd at 300 trials is 1.3 points). Uses 999 resamples (not the default 2000) to
    keep the test fast; each data set is one 'workload' so one summarize call does all 300."""
    rng = np.random.default_rng(12345)
    n_sets, n = 300, 40
    true_gm = 1.6
    records = []
    for k in range(n_sets):
        base = rng.lognormal(np.log(10.0), 0.3, n)  # per-prompt AR rate
        effect = rng.lognormal(np.log(true_gm), 0.25, n)  # per-prompt true speedup
        noise_a, noise_p = rng.lognormal(0, 0.05, n), rng.lognormal(0, 0.05, n)
        for i in range(n):
            records.append(rec("ar", f"p{i:02d}", base[i] * noise_a[i], workload=f"set{k:03d}"))
            records.append(rec("x", f"p{i:02d}", base[i] * effect[i] * noise_p[i], workload=f"set{k:03d}"))
    s = stats.summarize(frame(records), n_resamples=999, seed=1)
    s = s[s["policy"] == "x"]
    assert len(s) == n_sets and (s["n"] == n).all()
    covered = ((s["speedup_ci_low"] <= true_gm) & (true_gm <= s["speedup_ci_high"])).mean()
    assert 0.90 <= covered <= 0.99, covered
    # the point estimate is unbiased on the log scale
    assert abs(np.log(s["speedup"]).mean() - np.log(true_gm)) < 0.01


# ---------------------------------------------------------------------------------------------
# Equality with scipy called directly


def _two_policy_records(n=25, seed=3):
    rng = np.random.default_rng(seed)
    base = rng.lognormal(np.log(8), 0.2, n)
    s_pld = rng.lognormal(np.log(1.3), 0.3, n)
    s_fk = rng.lognormal(np.log(1.1), 0.2, n)
    recs = []
    for i in range(n):
        pid = f"q{i:02d}"
        recs += [rec("ar", pid, base[i]), rec("pld", pid, base[i] * s_pld[i]), rec("fixed-k", pid, base[i] * s_fk[i])]
    return frame(recs), base, s_pld, s_fk


def test_wilcoxon_and_bootstrap_equal_scipy_direct():
    df, base, s_pld, _ = _two_policy_records()
    logs = np.log((base * s_pld) / base)  # prompt order q00..q24 = the analysis' sorted order
    out = stats.summarize(df, n_resamples=2000, seed=7)
    r = out[out["policy"] == "pld"].iloc[0]
    assert r["n"] == len(logs)
    assert r["p"] == pytest.approx(st.wilcoxon(logs).pvalue, rel=1e-12)
    boot = st.bootstrap((logs,), np.mean, n_resamples=2000, method="BCa", confidence_level=0.95, rng=np.random.default_rng(7))
    assert r["speedup_ci_low"] == pytest.approx(math.exp(boot.confidence_interval.low), rel=1e-12)
    assert r["speedup_ci_high"] == pytest.approx(math.exp(boot.confidence_interval.high), rel=1e-12)
    assert r["speedup"] == pytest.approx(math.exp(logs.mean()), rel=1e-12)
    assert r["median_log_speedup"] == pytest.approx(np.median(logs))
    assert r["speedup_ratio_of_means"] == pytest.approx((base * s_pld).mean() / base.mean())
    # percentile method is passed through too
    lo, hi, note = stats.bootstrap_ci(logs, np.mean, n_resamples=2000, method="percentile", seed=7)
    boot = st.bootstrap((logs,), np.mean, n_resamples=2000, method="percentile", rng=np.random.default_rng(7))
    assert (lo, hi, note) == (pytest.approx(boot.confidence_interval.low), pytest.approx(boot.confidence_interval.high), "")


def test_compare_policies_equals_scipy_wilcoxon():
    df, base, s_pld, s_fk = _two_policy_records()
    c = stats.compare_policies(df, "pld", "fixed-k")
    assert len(c) == 1
    d = np.log(s_pld / s_fk)
    assert c["p"].iloc[0] == pytest.approx(st.wilcoxon(d).pvalue, rel=1e-12)
    assert c["ratio"].iloc[0] == pytest.approx(math.exp(d.mean()))
    assert c["ratio_ci_low"].iloc[0] < c["ratio"].iloc[0] < c["ratio_ci_high"].iloc[0]
    assert c["p_holm"].iloc[0] == c["p"].iloc[0]  # family of one
    with pytest.raises(UserError, match="eagle"):
        stats.compare_policies(df, "pld", "eagle")


def test_compare_policies_on_tau_equals_scipy_wilcoxon():
    """metric="tau" pairs per-request τ (drafter quality) instead of tokens/s; repeats are averaged
    per prompt first, exactly as for speed."""
    rng = np.random.default_rng(5)
    tau_a, tau_b = 1 + rng.gamma(2.0, 0.2, 20), 1 + rng.gamma(2.0, 0.15, 20)
    recs = []
    for i in range(20):
        for repeat in (0, 1):  # same τ on both repeats, different speeds: only τ may matter
            recs += [rec("dspark", f"q{i:02d}", 5.0 + repeat, tau=tau_a[i], repeat=repeat),
                     rec("dflash", f"q{i:02d}", 9.0 - repeat, tau=tau_b[i], repeat=repeat)]
    c = stats.compare_policies(frame(recs), "dspark", "dflash", metric="tau")
    d = np.log(tau_a / tau_b)
    assert c["metric"].iloc[0] == "tau" and c["n"].iloc[0] == 20
    assert c["ratio"].iloc[0] == pytest.approx(math.exp(d.mean()))
    assert c["p"].iloc[0] == pytest.approx(st.wilcoxon(d).pvalue, rel=1e-12)
    with pytest.raises(UserError, match="unknown metric"):
        stats.compare_policies(frame(recs), "dspark", "dflash", metric="rounds")


# ---------------------------------------------------------------------------------------------
# Holm, rank-biserial


def test_holm_hand_checked():
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone max 0.06
    adj = stats.holm([0.01, 0.04, 0.03, 0.005])
    np.testing.assert_allclose(adj, [0.03, 0.06, 0.06, 0.02])
    adj = stats.holm([0.01, np.nan, 0.04, 0.03, 0.005])  # NaN ignored, m stays 4
    np.testing.assert_allclose(adj, [0.03, np.nan, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(stats.holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1
    assert stats.holm([]).size == 0


def test_summarize_applies_holm_across_cells():
    df, *_ = _two_policy_records()
    out = stats.summarize(df, n_resamples=200)
    spec = out[out["policy"] != "ar"]
    np.testing.assert_allclose(spec["p_holm"], stats.holm(spec["p"]))
    assert out.loc[out["policy"] == "ar", "p_holm"].isna().all()
    assert (out["significant"] == (out["p_holm"] < 0.05)).all()


def test_rank_biserial_hand_checked():
    # zeros dropped; |d| ranks 1,2,3; T+ = 1+3, T- = 2 -> (4-2)/6
    assert stats.rank_biserial([1.0, -2.0, 3.0, 0.0]) == pytest.approx(1 / 3)
    assert stats.rank_biserial([1.0, 2.0]) == 1.0
    assert math.isnan(stats.rank_biserial([0.0, 0.0]))


# ---------------------------------------------------------------------------------------------
# Pairing rules


def test_repeats_averaged_turns_geometric_and_unpaired_dropped():
    recs = [
        # p0: policy repeats 10 and 30 (mean 20) vs ar 10 -> s = 2
        rec("ar", "p0", 10.0), rec("x", "p0", 10.0, repeat=0), rec("x", "p0", 30.0, repeat=1),
        # p1: two turns with s = 2 and s = 8 -> prompt's s = geometric mean 4
        rec("ar", "p1", 5.0, turn=0), rec("x", "p1", 10.0, turn=0),
        rec("ar", "p1", 5.0, turn=1), rec("x", "p1", 40.0, turn=1),
        # p2: no ar record -> not paired
        rec("x", "p2", 99.0),
        # p3: ar at another batch size only -> not paired
        rec("ar", "p3", 5.0, batch_size=4), rec("x", "p3", 50.0),
    ]
    df = frame(recs)
    pr = stats.paired_log_ratios(df, "x")
    assert list(pr["prompt_id"]) == ["p0", "p1"]
    np.testing.assert_allclose(np.exp(pr["log_ratio"]), [2.0, 4.0])
    row = stats.summarize(df, n_resamples=200).query("policy == 'x' and batch_size == 1").iloc[0]
    assert row["n"] == 2
    assert row["speedup"] == pytest.approx(math.sqrt(8.0))


def test_degenerate_cells_do_not_crash():
    recs = [
        # n = 1
        rec("ar", "a", 10.0, workload="one"), rec("x", "a", 12.0, workload="one"),
        # all speedups identical
        *[r for i in range(5) for r in (rec("ar", f"p{i}", 10.0 + i, workload="same"), rec("x", f"p{i}", 2 * (10.0 + i), workload="same"))],
        # policy without any ar
        rec("x", "z", 10.0, workload="noar"),
    ]
    out = stats.summarize(frame(recs), n_resamples=200).set_index(["workload", "policy"])
    one = out.loc[("one", "x")]
    assert one["n"] == 1 and one["speedup"] == pytest.approx(1.2)
    assert math.isnan(one["speedup_ci_low"]) and math.isnan(one["p"]) and "n<2" in one["note"]
    same = out.loc[("same", "x")]
    assert same["speedup"] == pytest.approx(2.0) and math.isnan(same["speedup_ci_low"])
    assert "identical" in same["note"]
    assert same["p"] == pytest.approx(st.wilcoxon(np.full(5, np.log(2.0))).pvalue)
    noar = out.loc[("noar", "x")]
    assert noar["n"] == 0 and "no ar records" in noar["note"]


def test_by_category_and_cell_metrics():
    recs = make_records(
        workloads={"mix": ["code", "writing", "math"]}, policies=("ar", "pld"), batch_sizes=(1, 4), n_prompts=12, seed=5
    )
    df = frame(recs)
    per_cat = stats.summarize(df, by_category=True, n_resamples=300)
    assert set(per_cat["category"]) == {"code", "writing", "math"}
    assert (per_cat["n"] == 4).all()
    same = stats.summarize(df, by=("workload", "category", "batch_size", "temperature"), n_resamples=300)
    pd.testing.assert_frame_equal(per_cat, same)
    whole = stats.summarize(df, n_resamples=300)
    r = whole.query("policy == 'pld' and batch_size == 4").iloc[0]
    d = df.query("policy == 'pld' and batch_size == 4")
    assert r["acceptance_rate"] == pytest.approx(d["accepted"].sum() / d["drafted"].sum())
    b = d.drop_duplicates("batch_id")
    assert r["n_batches"] == 3
    assert r["throughput"] == pytest.approx(b["batch_generated_tokens"].sum() / b["batch_wall_s"].sum())
    assert r["tau"] == pytest.approx(d["tau"].mean())
    assert r["tau_pooled"] == pytest.approx((d["generated_tokens"] - 1).sum() / d["rounds"].sum())
    assert r["tps_median"] == pytest.approx(d["tokens_per_s"].median())
    assert r["tau_ci_low"] <= r["tau"] <= r["tau_ci_high"]
    assert r["acceptance_ci_low"] <= r["acceptance_rate"] <= r["acceptance_ci_high"]


# ---------------------------------------------------------------------------------------------
# Per-position acceptance


def test_position_acceptance_hand_example():
    recs = [
        rec("x", "a", 10.0, drafted_per_position=[4, 4, 2], accepted_per_position=[3, 2, 1]),
        rec("x", "b", 10.0, drafted_per_position=[6, 2], accepted_per_position=[3, 1]),
        rec("ar", "a", 8.0),
    ]
    pa = stats.position_acceptance(frame(recs))
    assert set(pa["policy"]) == {"x"}  # ar has no positions
    assert list(pa["position"]) == [1, 2, 3]
    assert list(pa["drafted"]) == [10, 6, 2] and list(pa["accepted"]) == [6, 3, 1]
    np.testing.assert_allclose(pa["acceptance"], [0.6, 0.5, 0.5])
    np.testing.assert_allclose(pa["conditional"], [0.6, 0.5 / 0.6, 1.0])
    np.testing.assert_allclose(pa["acceptance_vllm"], [0.6, 0.3, 0.1])


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_results_dir_lists_env_and_duplicates(tmp_path):
    recs = make_records(workloads={"w": ["w"]}, policies=("ar", "pld"), batch_sizes=(1,), n_prompts=3)
    write_records(tmp_path / "a" / "one.jsonl", recs[:3])
    write_records(tmp_path / "b" / "deep" / "two.jsonl", recs[3:] + recs[:1])  # one duplicate key
    (tmp_path / "notes.txt").write_text("ignored")
    df = stats.load_results(tmp_path)
    assert len(df) == len(recs) and df.attrs["duplicates_dropped"] == 1
    assert isinstance(df["output_ids"].iloc[0], list) and isinstance(df["drafted_per_position"].iloc[0], list)
    assert "env.torch" in df.columns and "env" not in df.columns
    assert isinstance(df["policy_params"].iloc[-1], dict)
    single = stats.load_results(tmp_path / "a" / "one.jsonl")
    assert len(single) == 3


def test_load_results_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "r.jsonl"
    good = json.dumps(rec("ar", "p", 1.0))
    f.write_text(good + "\n\n" + good[:-5] + "\n")
    with pytest.raises(UserError) as e:
        stats.load_results(f)
    msg = str(e.value)
    assert f"{f}:3:" in msg and "\n" not in msg
    f.write_text(good + "\n[1, 2]\n")
    with pytest.raises(UserError, match=r"r\.jsonl:2: .*not a JSON object"):
        stats.load_results(f)
    f.write_text(json.dumps({"policy": "ar"}) + "\n")
    with pytest.raises(UserError, match=r"r\.jsonl:1: .*lacks field"):
        stats.load_results(f)
    with pytest.raises(UserError, match="not found"):
        stats.load_results(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.jsonl"):
        stats.load_results(tmp_path / "empty")


def test_paired_throughput_ratio_pairs_batches_by_id_up_to_the_policy():
    """The throughput ratio pairs each policy batch with the baseline batch of the same id (up to
    the policy name): its geometric mean is the mean log of those per-batch rate ratios, n is
    batches, and a batch the baseline lacks is not paired."""
    recs = make_records(workloads={"mix": ["code"]}, policies=("ar", "pld"), batch_sizes=(4,), n_prompts=16, seed=9)
    df = frame(recs)
    d = df[df["policy"] == "pld"].drop_duplicates("batch_id")
    base = df[df["policy"] == "ar"].drop_duplicates("batch_id")
    assert all(i.endswith("|pld") for i in d["batch_id"])  # the id format the pairing relies on
    rate = lambda t: dict(zip(t["batch_id"].str.rsplit("|", n=1).str[0], t["batch_generated_tokens"] / t["batch_wall_s"]))
    a, b = rate(d), rate(base)
    want = math.exp(np.mean([math.log(a[k] / b[k]) for k in a]))
    r = stats.summarize(df, n_resamples=300).query("policy == 'pld'").iloc[0]
    assert r["n_batch_pairs"] == len(a) == 4
    assert r["throughput_ratio"] == pytest.approx(want)
    assert r["throughput_ratio_ci_low"] <= r["throughput_ratio"] <= r["throughput_ratio_ci_high"]
    # The baseline's own row is 1 by definition; drop one baseline batch: one pair fewer.
    assert stats.summarize(df, n_resamples=300).query("policy == 'ar'").iloc[0]["throughput_ratio"] == 1.0
    first = base["batch_id"].iloc[0]
    fewer = stats.summarize(df[df["batch_id"] != first], n_resamples=300).query("policy == 'pld'").iloc[0]
    assert fewer["n_batch_pairs"] == 3
