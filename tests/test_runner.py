"""Runner: interleaved order, seeds, multi-turn history, records, resume, crash safety (SIGKILL),
sweep settings. Tiny random models and a fake character tokenizer: no real model needed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specbench.errors import UserError
from specbench.policies.pld import PromptLookup
from specbench.engine.policy import Policy
from specbench.bench.engines import PolicyEngine
from specbench.bench.runner import (derive_seed, read_records, record_key, run_cell, run_sweep)
from helpers import make_target, make_workload

REPO = Path(__file__).resolve().parent.parent
RECORD_FIELDS = [  # docs/records.md
    "key", "policy", "policy_params", "workload", "prompt_id", "category", "turn", "batch_size", "batch_id", "repeat",
    "temperature", "top_p", "seed", "max_new_tokens", "target", "drafter", "device", "prompt_tokens",
    "generated_tokens", "output_ids", "finish_reason", "rounds", "drafted", "accepted", "drafted_per_position",
    "accepted_per_position", "tau", "ttft_s", "decode_s", "tokens_per_s", "batch_wall_s", "batch_generated_tokens",
    "trace", "env",
]


def engines(target):
    return [PolicyEngine(target.model, Policy(), "ar"), PolicyEngine(target.model, PromptLookup(k=3), "pld")]


@pytest.fixture(scope="module")
def target():
    return make_target()


def test_record_fields_and_counts(target, tmp_path):
    wl = make_workload(5)
    out = tmp_path / "r.jsonl"
    res = run_sweep(target, engines(target), [wl], out, batch_sizes=[2], progress=False, env={"x": 1})
    recs = read_records(out)
    assert res.written == len(recs) == 10 and res.skipped == 0
    for r in recs:
        for f in RECORD_FIELDS:
            assert f in r, f
        assert r["key"] == record_key(r["policy"], "toy", r["prompt_id"], r["turn"], 2, 0.0, 0, 0)
        assert r["generated_tokens"] == len(r["output_ids"]) <= 24
        assert r["finish_reason"] in ("eos", "length")
        assert r["rounds"] == len(r["trace"]["verify_len"]) == len(r["trace"]["accepted"])
        assert r["drafted"] == sum(r["trace"]["verify_len"]) and r["accepted"] == sum(r["trace"]["accepted"])
        if r["rounds"]:
            assert r["tau"] == pytest.approx((r["generated_tokens"] - 1) / r["rounds"])
        assert r["env"] == {"x": 1}
    # last batch is smaller: 5 requests in batches of 2
    assert sorted({r["batch_rows"] for r in recs}) == [1, 2]
    assert all(r["batch_size"] == 2 for r in recs)
    # throughput bookkeeping is per batch
    by_batch = {}
    for r in recs:
        by_batch.setdefault(r["batch_id"], []).append(r)
    for rs in by_batch.values():
        assert sum(r["generated_tokens"] for r in rs) == rs[0]["batch_generated_tokens"]
    # ... and the same batch of two policies differs only in the trailing policy name, which is
    # how the stats pair batches for the throughput ratio (stats.py::paired_throughput)
    assert all(r["batch_id"].endswith("|" + r["policy"]) for r in recs)
    stems = {p: {r["batch_id"].rsplit("|", 1)[0] for r in recs if r["policy"] == p} for p in ("ar", "pld")}
    assert stems["ar"] == stems["pld"] and len(stems["ar"]) == 3
    # greedy pld == ar on the same prompts
    ar = {r["prompt_id"]: r["output_ids"] for r in recs if r["policy"] == "ar"}
    assert all(r["output_ids"] == ar[r["prompt_id"]] for r in recs if r["policy"] == "pld")


def test_interleaved_order_and_seeds(target, tmp_path):
    calls = []
    wl = make_workload(7)
    eng = engines(target) + [PolicyEngine(target.model, PromptLookup(k=2), "pld2")]
    eng[2].policy.name = "pld2"
    run_sweep(target, eng, [wl], tmp_path / "r.jsonl", batch_sizes=[2, 3], repeats=2, progress=False,
              on_decode=lambda *a: calls.append(a))
    timed = [(name, bi) for name, bi, turn, warm in calls if not warm]
    warm = [(name, bi) for name, bi, turn, w in calls if w]
    # one warm-up per policy per batch size, before that policy's first timed decode at that size
    assert len(warm) == 3 * 2
    # per (batch size, repeat): batch by batch, every policy on the batch, order rotating per batch
    expected = []
    for bs in (2, 3):
        n_batches = -(-7 // bs)
        for rep in range(2):
            for bi in range(n_batches):
                order = ["ar", "pld", "pld2"]
                order = order[bi % 3:] + order[: bi % 3]
                expected += [(p, bi) for p in order]
    assert timed == expected
    recs = read_records(tmp_path / "r.jsonl")
    # same prompt, same batch seed under every policy; different across repeats
    seeds = {}
    for r in recs:
        seeds.setdefault((r["prompt_id"], r["batch_size"], r["repeat"]), set()).add(r["batch_seed"])
    assert all(len(s) == 1 for s in seeds.values())
    assert derive_seed(0, 0, 1) != derive_seed(0, 1, 1) != derive_seed(1, 1, 1)
    assert recs[0]["batch_seed"] == derive_seed(0, recs[0]["repeat"], 0, 0)


def test_multi_turn_history_uses_own_answer(target, tmp_path):
    wl = make_workload(3, turns=2)
    seen = []
    tok = target.tokenizer

    class Spy(PolicyEngine):
        def decode(self, prompts, config, eos_ids):
            seen.append(prompts)
            return super().decode(prompts, config, eos_ids)

    recs = list(run_cell(target, Spy(target.model, Policy(), "ar"), wl, batch_size=3, warmup=False))
    assert [(r["prompt_id"], r["turn"]) for r in recs] == [("q0", 0), ("q1", 0), ("q2", 0), ("q0", 1), ("q1", 1), ("q2", 1)]
    turn1_prompts = seen[1]
    for r0, p1 in zip(recs[:3], turn1_prompts):
        answer = tok.decode(r0["output_ids"], skip_special_tokens=True)
        expect = tok.apply_chat_template([
            {"role": "user", "content": wl.requests[int(r0["prompt_id"][1:])].turns[0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": wl.requests[int(r0["prompt_id"][1:])].turns[1]}])
        assert p1 == expect


def test_resume_skips_done_and_reruns_partial_batch(target, tmp_path):
    wl = make_workload(6)
    out = tmp_path / "r.jsonl"
    full = run_sweep(target, engines(target), [wl], out, batch_sizes=[3], progress=False)
    recs = read_records(out)
    assert full.written == 12
    # drop one record of the second ar batch and truncate the last line as a kill would
    keep = [r for r in recs if r["key"] != record_key("ar", "toy", "q4", 0, 3, 0.0, 0, 0)]
    text = "".join(json.dumps(r) + "\n" for r in keep)
    out.write_text(text + '{"key": "pld|toy|q5|0|3|0|0|0", "policy": "pl')
    calls = []
    again = run_sweep(target, engines(target), [wl], out, batch_sizes=[3], progress=False,
                      on_decode=lambda *a: calls.append(a))
    after = read_records(out)
    keys = [r["key"] for r in after]
    assert len(keys) == len(set(keys)) == 12
    assert again.written == 1 and again.skipped == 11
    # only the partially done (ar, batch 1) was decoded again (plus its warm-up)
    assert [(n, bi) for n, bi, _, w in calls if not w] == [("ar", 1)]
    by_key = {r["key"]: r["output_ids"] for r in recs}
    assert all(r["output_ids"] == by_key[r["key"]] for r in after)
    assert out.read_text().endswith("\n")


def test_truncated_last_line_is_repaired_atomically(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"key": "a", "x": 1}\n{"key": "b", "x": 2}\n{"key": "c", "x"')
    assert [r["key"] for r in read_records(out)] == ["a", "b"]
    assert out.read_text() == '{"key": "a", "x": 1}\n{"key": "b", "x": 2}\n'
    assert not [p for p in tmp_path.iterdir() if p.name != "r.jsonl"]  # no temp file left
    out.write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(UserError, match="line 2"):
        read_records(out)


def test_resume_refuses_mixed_settings(target, tmp_path):
    wl = make_workload(2)
    out = tmp_path / "r.jsonl"
    run_sweep(target, engines(target)[:1], [wl], out, progress=False, max_new_tokens=8)
    with pytest.raises(UserError, match="max_new_tokens"):
        run_sweep(target, engines(target)[:1], [wl], out, progress=False, max_new_tokens=16)


def test_batch_limited_engine_refused(target, tmp_path):
    e = engines(target)[0]
    e.max_batch_size = 1
    with pytest.raises(UserError, match="batch size"):
        run_sweep(target, [e], [make_workload(2)], tmp_path / "r.jsonl", batch_sizes=[4], progress=False)
    assert not (tmp_path / "r.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# SIGKILL mid-sweep, resume, compare with an uninterrupted run

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from test_runner import make_target, make_workload, engines
    from specbench.bench.runner import run_sweep
    import specbench.bench.runner as runner

    target = make_target(dim=64, layers=2)
    eng = engines(target)
    delay = float(sys.argv[2])
    for e in eng:
        orig = e.decode
        def slow(prompts, config, eos_ids, orig=orig):
            time.sleep(delay)
            return orig(prompts, config, eos_ids)
        e.decode = slow
    run_sweep(target, eng, [make_workload(12, turns=2)], sys.argv[1], batch_sizes=[1, 4], repeats=1,
              max_new_tokens=20, progress=False)
""")


def _expected_keys():
    wl = make_workload(12, turns=2)
    return {record_key(p, wl.name, r.prompt_id, t, b, 0.0, 0, 0)
            for p in ("ar", "pld") for r in wl.requests for t in range(2) for b in (1, 4)}


def test_sigkill_then_resume_completes_exactly(tmp_path):
    script = tmp_path / "sweep.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    killed_file, clean_file = tmp_path / "killed.jsonl", tmp_path / "clean.jsonl"

    proc = subprocess.Popen([sys.executable, str(script), str(killed_file), "0.05"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    n_before = 0
    while time.time() < deadline:
        if killed_file.exists():
            n_before = killed_file.read_bytes().count(b"\n")
            if n_before >= 10:
                break
        if proc.poll() is not None:
            pytest.fail(f"sweep ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    expected = _expected_keys()
    partial = read_records(killed_file, repair=False)
    assert 10 <= len(partial) < len(expected), "kill came too late to test resume"

    # resume to completion, and an uninterrupted run for comparison
    for path in (killed_file, clean_file):
        done = subprocess.run([sys.executable, str(script), str(path), "0"], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    resumed, clean = read_records(killed_file), read_records(clean_file)
    keys = [r["key"] for r in resumed]
    assert len(keys) == len(set(keys)), "a key was written twice"
    assert set(keys) == expected
    clean_out = {r["key"]: r["output_ids"] for r in clean}
    assert {r["key"]: r["output_ids"] for r in resumed} == clean_out
