"""`run`'s answer to "faster than plain decoding?": the paired speedup over ar and the verdict line."""
from __future__ import annotations

import numpy as np

from specbench.cli.main import versus_ar


def _records(policy, speed, tau, n=12, trace=None, gate=False, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tps = speed * float(np.exp(rng.normal(0, 0.05)))
        out.append({"policy": policy, "workload": "code", "category": "code", "prompt_id": f"p{i}", "turn": 0,
                    "batch_size": 1, "temperature": 0.0, "repeat": 0, "tokens_per_s": tps, "tau": tau,
                    "generated_tokens": 49, "decode_s": 48 / tps, "policy_params": {"draft_gate": gate},
                    "trace": trace or {"verify_len": [], "accepted": []}})
    return out


def test_paid_not_paid_and_undecided():
    ar = _records("ar", 20.0, 1.0, seed=1)
    text = versus_ar(_records("dspark", 30.0, 2.6, seed=2) + ar, "dspark")
    assert "1.5" in text.splitlines()[0] and "n = 12" in text and "tau 2.60 vs 1.00" in text
    assert "dspark paid here" in text
    slow = versus_ar(_records("dspark", 15.0, 1.2, seed=2) + ar, "dspark")
    assert "did not pay" in slow and "too few drafts accepted" in slow
    level = versus_ar(_records("dspark", 20.0, 1.6, n=3, seed=3) + _records("ar", 20.0, 1.0, n=3, seed=4), "dspark")
    assert "not decided at n = 3" in level and "more requests" in level


def test_verdict_names_the_draft_gate_and_the_scheduler():
    # 6 of 10 rounds skipped by the gate (nothing drafted), 2 drafted but none verified
    trace = {"verify_len": [0] * 6 + [0, 0, 3, 2], "accepted": [0] * 10,
             "confidence": [[]] * 6 + [[0.2, 0.1]] * 4}
    text = versus_ar(_records("dspark", 17.0, 1.1, trace=trace, gate=True, seed=2)
                     + _records("ar", 20.0, 1.0, seed=1), "dspark")
    assert "the draft gate skipped 60% of rounds" in text
    assert "verified no draft in another 20% of rounds" in text
    # the same trace from a policy without a gate (pld finding no match) is not blamed on a gate
    text = versus_ar(_records("pld", 17.0, 1.1, trace=trace, gate=False, seed=2)
                     + _records("ar", 20.0, 1.0, seed=1), "pld")
    assert "gate" not in text and "verified no draft in 80% of rounds" in text


def test_a_run_that_paid_does_not_say_drafting_does_not_pay():
    # 1 round in 10 gated in a run twice as fast as ar: the verdict says it paid, and the gate clause
    # says which rounds were skipped, without claiming that drafting does not pay at all
    trace = {"verify_len": [0] + [4] * 9, "accepted": [0] + [3] * 9, "confidence": [[]] + [[0.9] * 4] * 9}
    text = versus_ar(_records("dspark", 40.0, 3.0, trace=trace, gate=True, seed=2)
                     + _records("ar", 20.0, 1.0, seed=1), "dspark")
    verdict = text.splitlines()[-1]
    assert "dspark paid here" in verdict and "the draft gate skipped 10% of rounds" in verdict
    assert "does not pay" not in verdict and "would not pay at the acceptance seen so far" in verdict


def test_batched_run_reports_throughput_over_paired_batches():
    """At b > 1 the run also prints the throughput ratio over paired batches, with its n, and says
    when there are too few batches to decide."""
    recs = []
    for policy, wall in (("dspark", 2.0), ("ar", 2.5)):
        for i, r in enumerate(_records(policy, 20.0, 1.0, n=8, seed=len(policy))):
            batch = i // 4
            recs.append({**r, "batch_size": 4, "batch_id": f"code|b4|t0|s0|r0|batch{batch}|turn0|{policy}",
                         "batch_wall_s": wall + 0.1 * batch, "batch_generated_tokens": 4 * 49})
    text = versus_ar(recs, "dspark")
    line = next(x for x in text.splitlines() if x.strip().startswith("throughput"))
    assert "n = 2 paired batches" in line and "too few to decide" in line
    want = np.exp(np.mean([np.log((2.5 + 0.1 * b) / (2.0 + 0.1 * b)) for b in (0, 1)]))
    assert f"{want:.2f}x ar's" in line
    assert not any(x.strip().startswith("throughput") for x in versus_ar(_records("dspark", 30.0, 2.6) + _records("ar", 20.0, 1.0), "dspark").splitlines())
