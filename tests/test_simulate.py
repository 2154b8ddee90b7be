"""specbench.analysis.simulate: replaying recorded traces against a cost profile.

Synthetic traces check the arithmetic (AR throughput = rows / step time, static vs continuous
batching, recorded rounds replayed as recorded, prefill and whole-round costs, the acceptance rule
for re-scheduled rounds); tiny DSpark runs check that the simulator's DSpark makes the recorded
decisions from the recorded confidences; the committed CPU sweep checks the 10% agreement with
measurement (docs/performance.md); bad input is one line and exit 2."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from specbench.analysis import simulate
from specbench.cli.main import main
from specbench.bench.engines import PolicyEngine
from specbench.bench.runner import read_records, run_sweep
from helpers import make_target, make_workload

REPO = Path(__file__).resolve().parent.parent
BATCHES, QS = (1, 2, 4, 8, 16), (1, 2, 4, 8)


def step_ms(b, q):
    return 10.0 + 1.0 * b * q


def write_profile(path: Path, step=step_ms, round_factor=None, prefill_ms_per_token=None) -> Path:
    data = {"context": 256, "device_name": "test device",
            "entries": [{"batch": b, "q": q, "median_ms": step(b, q)} for b in BATCHES for q in QS]}
    if round_factor is not None:
        data["round"] = [{"batch": b, "q": q, "median_ms": round_factor * step(b, q)} for b in BATCHES for q in QS]
    if prefill_ms_per_token is not None:
        data["prefill"] = [{"batch": b, "tokens": p, "median_ms": prefill_ms_per_token * b * p} for b, p in ((1, 64), (4, 64))]
    path.write_text(json.dumps(data))
    return path


def record(policy, prompt_id, verify_len, accepted, *, generated=None, batch_size=1, confidence=None,
           prompt_tokens=10, params=None, drafter=None, max_new=64):
    trace = {"verify_len": verify_len, "accepted": accepted}
    if confidence is not None:
        trace["confidence"] = confidence
    if generated is None:
        generated = 1 + sum(a + 1 for a in accepted)
    return {"key": f"{policy}|w|{prompt_id}|0|{batch_size}|0|0|0", "policy": policy, "policy_params": params or {},
            "workload": "w", "prompt_id": prompt_id, "turn": 0, "batch_size": batch_size, "temperature": 0.0,
            "max_new_tokens": max_new, "drafter": drafter, "prompt_tokens": prompt_tokens,
            "generated_tokens": generated, "rounds": len(verify_len), "trace": trace}


def ar(prompt_id, generated, **kw):
    return record("ar", prompt_id, [0] * (generated - 1), [0] * (generated - 1), **kw)


def sim(recs, c, mode, tmp_path, **profile_kw):
    costs = simulate.load_costs(write_profile(tmp_path / "profile.json", **profile_kw))
    return simulate.simulate_cell(recs, c, mode, costs)


def test_ar_throughput_is_rows_over_step_time(tmp_path):
    recs = [ar(f"p{i}", 33) for i in range(4)]
    for mode in simulate.MODES:
        out = sim(recs, 4, mode, tmp_path)
        step = step_ms(4, 1) / 1e3
        # no prefill in this profile: the first token is free, the other 32 take a round each
        assert out["throughput_tok_s"] == pytest.approx(4 * 33 / (32 * step))
        assert out["per_user_tok_s"] == pytest.approx(1 / step)
        assert out["tau"] == pytest.approx(1.0) and out["mean_verify_len"] == 0
        assert not out["prefill_modeled"] and not out["overheads_modeled"]
    one = sim(recs, 1, "static", tmp_path)
    assert one["throughput_tok_s"] == pytest.approx(33 / (32 * step_ms(1, 1) / 1e3))


def test_continuous_refills_slots_static_waits_for_the_batch(tmp_path):
    recs = [ar("a", 3), ar("b", 9), ar("c", 3), ar("d", 9)]  # 2, 8, 2, 8 rounds
    s1, s2 = step_ms(1, 1) / 1e3, step_ms(2, 1) / 1e3
    static = sim(recs, 2, "static", tmp_path)
    assert static["requests"] == 4
    # two batches [a, b], [c, d]: a stays in the forward until b is done
    assert static["throughput_tok_s"] == pytest.approx(24 / (16 * s2))
    cont = simulate.simulate_cell(recs, 2, "continuous", simulate.load_costs(tmp_path / "profile.json"), requests=4)
    # a, b start; a ends after 2 rounds, c runs rounds 3-4, d rounds 5-12; b ends at 8; d alone for 4 rounds
    assert cont["throughput_tok_s"] == pytest.approx(24 / (8 * s2 + 4 * s1))
    assert cont["throughput_tok_s"] > static["throughput_tok_s"]


def test_recorded_rounds_are_replayed(tmp_path):
    rec = record("pld", "p", [3, 3, 0, 3], [3, 0, 0, 1])  # emits 4, 1, 1, 2 after the first token
    out = sim([rec], 1, "static", tmp_path, round_factor=1.5)
    rounds_s = 1.5 * (3 * step_ms(1, 4) + step_ms(1, 1)) / 1e3
    assert rec["generated_tokens"] == 9
    assert out["per_user_tok_s"] == pytest.approx(8 / rounds_s)
    assert out["tau"] == pytest.approx(2.0) and out["mean_verify_len"] == pytest.approx(9 / 4)
    assert out["overheads_modeled"] and out["drawn_frac"] == 0


def test_prefill_counts_in_throughput_not_in_per_user_rate(tmp_path):
    recs = [ar("a", 5, prompt_tokens=20), ar("b", 5, prompt_tokens=50)]
    out = sim(recs, 2, "static", tmp_path, prefill_ms_per_token=2.0)
    prefill = 2.0 * 2 * 50 / 1e3  # right-padded to the longest prompt
    decode = 4 * step_ms(2, 1) / 1e3
    assert out["prefill_modeled"]
    assert out["throughput_tok_s"] == pytest.approx(10 / (prefill + decode))
    assert out["per_user_tok_s"] == pytest.approx(4 / decode)


def test_accepted_at_uses_the_record_and_draws_only_past_it():
    rng = random.Random(0)
    rejected = ([0.9, 0.9, 0.9, 0.9], 3, 1)  # verified 3, the 2nd was rejected
    assert [simulate.accepted_at(rejected, n, rng) for n in (0, 1, 2, 4)] == [(0, 0), (1, 0), (1, 0), (1, 0)]
    clean = ([1.0, 1.0, 1.0, 0.0], 2, 2)  # verified 2, both accepted
    assert simulate.accepted_at(clean, 1, rng) == (1, 0)
    assert simulate.accepted_at(clean, 2, rng) == (2, 0)
    assert simulate.accepted_at(clean, 4, rng) == (3, 2)  # position 3 drawn (c=1), position 4 drawn (c=0)
    sure = ([1.0] * 4, 2, 2)
    assert simulate.accepted_at(sure, 4, rng) == (4, 2)
    half = ([0.5] * 8, 0, 0)
    draws = [simulate.accepted_at(half, 8, random.Random(s))[0] for s in range(2000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.1)  # Σ 0.5^k ≈ 1


def dspark_record(prompt_id, rounds, conf, gamma=4, **kw):
    params = {"scheduler": "algorithm1", "gamma": gamma, "threshold": 0.5}
    return record("dspark", prompt_id, [gamma] * rounds, [gamma] * rounds, confidence=[[conf] * gamma] * rounds,
                  params=params, **kw)


def test_dspark_verifies_less_as_load_grows(tmp_path):
    # Verifying costs 1 ms per token: free at batch 1 next to the 10 ms launch, dear at batch 64.
    recs = [dspark_record(f"p{i}", 12, 0.8) for i in range(4)]
    costs = simulate.load_costs(write_profile(tmp_path / "p.json"))
    lengths = [simulate.simulate_cell(recs, c, "continuous", costs)["mean_verify_len"] for c in (1, 4, 16, 64)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert lengths[0] == pytest.approx(4.0)  # at batch 1 Algorithm 1 takes the whole block


def test_dspark_draws_beyond_the_recorded_verify_length(tmp_path):
    recs = [record("dspark", "p", [1] * 10, [1] * 10, confidence=[[0.9] * 4] * 10,
                   params={"scheduler": "fixed", "gamma": 4})]
    out = sim(recs, 1, "static", tmp_path)
    assert out["rescheduled"] and out["mean_verify_len"] > 1 and out["drawn_frac"] > 0


def test_profile_times_whole_rounds_and_prefill():
    from specbench.costs import profile as profiles
    from tiny import tiny_model

    model = tiny_model()
    rounds = profiles.measure_rounds(model, [1, 2], [1, 4], context=16, iters=2, warmup=1)
    assert [(e["batch"], e["q"], e["n"]) for e in rounds] == [(1, 4, 2), (1, 1, 2), (2, 4, 2), (2, 1, 2)]
    assert all(e["median_ms"] > 0 for e in rounds)
    pre = profiles.measure_prefill(model, [(1, 8), (2, 8)], iters=1)
    assert [(e["batch"], e["tokens"]) for e in pre] == [(1, 8), (2, 8)]
    # prefill is priced by the total tokens of the forward, linear between and past the points
    f = profiles.prefill_time_model([{"batch": 1, "tokens": 64, "median_ms": 100.0}, {"batch": 4, "tokens": 64, "median_ms": 400.0}])
    assert f(2, 64) == pytest.approx(0.2) and f(8, 64) == pytest.approx(0.8) and f(1, 32) == pytest.approx(0.05)


# ---------------------------------------------------------------------------------------------
# The simulator's DSpark makes the recorded decisions on the recorded confidences


@pytest.mark.parametrize("scheduler,gate", [("algorithm1", True), ("capacity", False)])
def test_dspark_replay_reproduces_the_run(tmp_path, scheduler, gate):
    from specbench.policies.dspark import DSpark
    from specbench.costs.profile import draft_time_model, step_time_model
    from helpers import make_drafter

    # Cheap verification, a drafter costing ~half a step: Algorithm 1 picks varied lengths and the
    # draft gate skips rounds. The drafter's cost reaches the simulator through drafters.json.
    profile = write_profile(tmp_path / "profile.json", step=lambda b, q: 10.0 + 0.1 * b * q)
    draft = [{"batch": b, "median_ms": 6.0 * (1 + 0.1 * b)} for b in (1, 4, 16)]
    (tmp_path / "drafters.json").write_text(json.dumps({"tiny|test device": draft}))
    target = make_target()
    pol = DSpark(make_drafter(target.model), scheduler=scheduler, step_seconds=step_time_model(json.loads(profile.read_text())),
                 draft_seconds=draft_time_model(draft), drafter_name="tiny", sts_temperatures=[1.3, 0.8, 1.0, 1.1],
                 draft_gate=gate)
    out = tmp_path / "r.jsonl"
    run_sweep(target, [PolicyEngine(target.model, pol, "dspark")], [make_workload(8)], out, batch_sizes=[4], progress=False)
    recs = read_records(out)
    lengths = {v for r in recs for v in r["trace"]["verify_len"]}
    skipped = sum(not c for r in recs for c in r["trace"]["confidence"])
    assert len(lengths) >= 3 and (skipped > 0) == gate  # the run made real decisions
    (row,) = simulate.simulate(out, profile, [4], ("static",))
    assert row["rescheduled"] and row["draft_cost_modeled"] and row["measured_requests"] == 8
    assert row["mean_verify_len"] == pytest.approx(row["measured_mean_verify_len"], abs=1e-12)
    assert row["drawn_frac"] == 0
    assert row["tau"] == pytest.approx(sum(r["generated_tokens"] - 1 for r in recs) / sum(r["rounds"] for r in recs))


# ---------------------------------------------------------------------------------------------
# Against measurement (the committed CPU sweep and the profile measured with it)


def test_within_ten_percent_of_the_committed_measurement():
    rows = simulate.simulate(REPO / "results/sweeps/simcheck", REPO / "results/profiles/smollm2-135m-amd-epyc-x1-threads.json",
                             [1, 4], ("static",))
    assert {r["policy"] for r in rows} == {"ar", "pld", "dspark"}
    for r in rows:
        assert r["measured_requests"] == 4
        for m in ("per_user_tok_s", "throughput_tok_s"):
            assert r[m] == pytest.approx(r[f"measured_{m}"], rel=0.10), (r["policy"], r["concurrency"], m)


def test_a_profile_from_another_device_works(tmp_path):
    # A profile without the round/prefill sections (as older `specbench profile` wrote them), on a
    # device with no drafter cost for these records, and a GPU-like profile knowing no drafter cost:
    # all simulate, and the rows say what was left out.
    traces = REPO / "results/sweeps/simcheck"
    bare = json.loads((REPO / "results/profiles/smollm2-135m-amd-epyc-x2-threads.json").read_text())
    bare = {k: v for k, v in bare.items() if k not in ("round", "prefill")}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    rows = simulate.simulate(traces, tmp_path / "bare.json", [1, 64], ("continuous",))
    assert all(not r["overheads_modeled"] and not r["prefill_modeled"] for r in rows)
    gpu = tmp_path / "h200.json"
    gpu.write_text(json.dumps({"device_name": "NVIDIA H200", "entries": [
        {"batch": b, "q": q, "median_ms": 6.0 + 0.002 * b * q} for b in (1, 16, 256) for q in (1, 2, 8)]}))
    rows = simulate.simulate(traces, gpu, [1, 256], ("continuous", "static"))
    assert {r["policy"] for r in rows} == {"ar", "pld", "dspark"}
    assert all(r["draft_cost_modeled"] == (r["policy"] != "dspark") for r in rows)
    assert all(r["throughput_tok_s"] > 0 and r["per_user_tok_s"] > 0 for r in rows)


def test_report_draws_the_simulation(tmp_path):
    import shutil

    from specbench.analysis import report
    shutil.copy(REPO / "results/sweeps/simcheck/records.jsonl", tmp_path / "records.jsonl")
    rows = simulate.simulate(tmp_path, REPO / "results/profiles/smollm2-135m-amd-epyc-x1-threads.json", [1, 4, 16],
                             simulate.MODES)
    simulate.write_outputs(rows, tmp_path / "simulation", {})
    report.write_report(tmp_path, html_path=tmp_path / "r.html", n_resamples=100)
    assert "Simulated load" in (tmp_path / "r.html").read_text()


# ---------------------------------------------------------------------------------------------
# CLI


def _one_error_line(capsys, rc, *needles):
    _, err = capsys.readouterr()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specbench: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_writes_csv_and_settings(tmp_path, capsys):
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [ar("a", 9), ar("b", 5)]))
    profile = write_profile(tmp_path / "profile.json")
    assert main(["simulate", "--trace", str(d), "--profile", str(profile), "--concurrency", "1,2", "--mode", "both"]) == 0
    assert "written" in capsys.readouterr().out
    with open(d / "simulation" / "simulation.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("continuous", "1"), ("continuous", "2"), ("static", "1"), ("static", "2")]
    assert set(rows[0]) == set(simulate.COLUMNS)
    assert json.loads((d / "simulation" / "simulation.json").read_text())["device_name"] == "test device"


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    profile = write_profile(tmp_path / "profile.json")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(ar("a", 5)) + "\n")
    base = ["simulate", "--profile", str(profile), "--trace"]
    _one_error_line(capsys, main(base + [str(tmp_path / "nope")]), "trace path not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_error_line(capsys, main(base + [str(empty)]), "no *.jsonl")
    (empty / "r.jsonl").write_text("")
    _one_error_line(capsys, main(base + [str(empty)]), "no results records")
    notrace = tmp_path / "notrace.jsonl"
    notrace.write_text(json.dumps({**ar("a", 5), "trace": {}}) + "\n")
    _one_error_line(capsys, main(base + [str(notrace)]), "per-round traces")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _one_error_line(capsys, main(["simulate", "--trace", str(good), "--profile", str(bad)]), "invalid JSON")
    bad.write_text(json.dumps({"entries": [{"batch": 1}]}))
    _one_error_line(capsys, main(["simulate", "--trace", str(good), "--profile", str(bad)]), "not a cost profile")
    _one_error_line(capsys, main(["simulate", "--trace", str(good), "--profile", str(tmp_path / "none.json")]), "not found")
    for conc in ("1,x", "0", "", "4,4"):
        _one_error_line(capsys, main(["simulate", "--trace", str(good), "--profile", str(profile), "--concurrency", conc]),
                        "--concurrency")
    _one_error_line(capsys, main(["simulate", "--trace", str(good), "--profile", str(profile), "--source-batch-size", "8"]),
                    "no records at batch size 8")


def test_drafter_costs_of_the_current_checkpoint_are_read_and_older_ones_skipped(tmp_path):
    """drafters.json keys carry the checkpoint's digest, then the engine's and any variant's after dots
    (profile.load_or_measure): the simulator keeps an entry whose checkpoint digest is the current one's,
    whatever follows it, and skips one measured for an older checkpoint at the same path."""
    from specbench.costs import profile as profiles
    from specbench.costs.schema import drafter_cost_key

    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    (ckpt / "drafter.json").write_text(json.dumps({"format": 1, "kind": "dspark"}))
    current = profiles.drafter_digest(str(ckpt))
    assert current != "-"
    old = [{"batch": 1, "median_ms": 50.0}]
    new = [{"batch": 1, "median_ms": 2.0}]
    (tmp_path / "drafters.json").write_text(json.dumps({
        drafter_cost_key(str(ckpt), "0ld0ld0ld0ld.e1e1e1e1e1e1", "test device"): old,
        drafter_cost_key(str(ckpt), f"{current}.e2e2e2e2e2e2", "test device"): new,
    }))
    costs = simulate.load_costs(write_profile(tmp_path / "profile.json"))
    assert costs.drafters[str(ckpt)](1) == pytest.approx(0.002)


def test_a_cut_draft_vocabulary_has_its_own_drafter_cost(tmp_path):
    """Costs of one checkpoint loaded whole and loaded with its draft vocabulary cut (load_or_measure's
    variant) are kept apart, and a cell's records pick theirs by policy_params' draft_vocab: the cut
    drafter's cost for a cut run, the whole one's otherwise."""
    from specbench.costs import profile as profiles
    from specbench.costs.schema import cut_variant, drafter_cost_key

    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    (ckpt / "drafter.json").write_text(json.dumps({"format": 1, "kind": "dspark"}))
    current = profiles.drafter_digest(str(ckpt))
    (tmp_path / "drafters.json").write_text(json.dumps({
        drafter_cost_key(str(ckpt), f"{current}.e1e1e1e1e1e1", "test device"): [{"batch": 1, "median_ms": 9.0}],
        drafter_cost_key(str(ckpt), f"{current}.e1e1e1e1e1e1.{cut_variant(2)}", "test device"):
            [{"batch": 1, "median_ms": 3.0}],
    }))
    costs = simulate.load_costs(write_profile(tmp_path / "profile.json"))
    assert simulate.draft_cost(costs, str(ckpt), {"draft_vocab": 2})(1) == pytest.approx(0.003)
    assert simulate.draft_cost(costs, str(ckpt), {"draft_vocab": 8})(1) == pytest.approx(0.009)  # not cut
    assert simulate.draft_cost(costs, str(ckpt), {})(1) == pytest.approx(0.009)  # records before draft_vocab


def test_a_cut_block_has_its_own_drafter_cost(tmp_path):
    """A drafter loaded with its block cut (build_dspark's block) has its own cost entry, picked by records
    whose policy_params say block = n, with or without a cut draft vocabulary."""
    from specbench.costs import profile as profiles
    from specbench.costs.schema import cut_variant, drafter_cost_key

    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    (ckpt / "drafter.json").write_text(json.dumps({"format": 1, "kind": "dspark"}))
    current = profiles.drafter_digest(str(ckpt))
    entry = lambda variant, ms: (drafter_cost_key(str(ckpt), f"{current}.e1e1e1e1e1e1" + (f".{variant}" if variant else ""),  # noqa: E731
                                                  "test device"), [{"batch": 1, "median_ms": ms}])
    (tmp_path / "drafters.json").write_text(json.dumps(dict([
        entry("", 9.0), entry(cut_variant(2), 3.0), entry(cut_variant(2, 4), 2.0), entry(cut_variant(0, 4), 6.0)])))
    assert cut_variant(2, 4) == "vocab2-block4" and cut_variant(0, 0) == ""
    costs = simulate.load_costs(write_profile(tmp_path / "profile.json"))
    assert simulate.draft_cost(costs, str(ckpt), {"draft_vocab": 2, "block": 4})(1) == pytest.approx(0.002)
    assert simulate.draft_cost(costs, str(ckpt), {"draft_vocab": 2, "block": 0})(1) == pytest.approx(0.003)
    assert simulate.draft_cost(costs, str(ckpt), {"draft_vocab": 8, "block": 4})(1) == pytest.approx(0.006)


def test_lookup_rounds_cost_no_drafter_call(tmp_path):
    """A policy without confidences that records which rounds took prompt-lookup drafts (trace `lookup`:
    fixed-k / EAGLE chains with lookup drafts) pays the drafter only in rounds where some row of the
    simulated batch took the drafter's draft, as the core calls it; records without the flag pay every round."""
    (tmp_path / "drafters.json").write_text(json.dumps({"tiny|test device": [{"batch": 1, "median_ms": 5.0},
                                                                             {"batch": 2, "median_ms": 5.0}]}))
    looked_up = record("fixed-k-lookup", "p", [3, 3, 3], [3, 3, 3], drafter="tiny")
    looked_up["trace"]["lookup"] = [1, 0, 1]
    plain = record("fixed-k", "p", [3, 3, 3], [3, 3, 3], drafter="tiny")
    one_forward = step_ms(1, 4) / 1e3
    out = sim([looked_up], 1, "static", tmp_path)
    assert out["per_user_tok_s"] == pytest.approx(12 / (3 * one_forward + 0.005))
    out = sim([plain], 1, "static", tmp_path)
    assert out["per_user_tok_s"] == pytest.approx(12 / (3 * one_forward + 3 * 0.005))
    # two rows in one batch: a round calls the drafter unless both replay a lookup round
    other = record("fixed-k-lookup", "q", [3, 3, 3], [3, 3, 3], drafter="tiny")
    other["trace"]["lookup"] = [1, 1, 0]
    out = sim([looked_up, other], 2, "static", tmp_path)
    assert out["drafted_round_frac"] == pytest.approx(2 / 3)
