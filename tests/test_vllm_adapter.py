"""The vLLM baselines' adapter without vLLM: parameters, counter differencing, record building,
the worker protocol (against tests/fake_vllm_worker.py), the runner and the one-line errors when
vLLM is not installed. The real engine is tested in tests/test_vllm_smoke.py (slow)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specbench.bench import vllm_engine
from specbench.engine.core import SamplingConfig
from specbench.errors import UserError
from specbench.bench.runner import read_records, run_sweep
from specbench.bench.vllm_engine import SpecCounters, batch_results, check_params, engine_args
from specbench.bench.vllm_worker import read_counters, request_timing
from cli_errors import assert_one_line_error
from helpers import make_target, make_workload

FAKE_WORKER = Path(__file__).resolve().parent / "fake_vllm_worker.py"


def counters(drafts=0, tokens=0, accepted=0, per_pos=()):
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "accepted_per_pos": list(per_pos)}


# ---------------------------------------------------------------------------------------------
# Parameters and engine arguments


def test_params_defaults_and_errors():
    assert check_params("vllm", {})["dtype"] is None  # the target's
    assert check_params("vllm-ngram-schedule", {})["k_schedule"] == vllm_engine.DEFAULT_K_SCHEDULE
    assert check_params("vllm-ngram", {"k_schedule": "[[1, 4, 3], [5, 9, 1]]"})["k_schedule"] == [[1, 4, 3], [5, 9, 1]]
    p = check_params("vllm-ngram", {"k": 3})
    assert (p["k"], p["min_ngram"], p["max_ngram"]) == (3, 1, 3)
    assert check_params("vllm-draft", {})["drafter"]  # the fixed-k policy's draft LM
    with pytest.raises(UserError, match="no parameter 'k'"):
        check_params("vllm", {"k": 4})  # AR has no k
    with pytest.raises(UserError, match="positive integer"):
        check_params("vllm-ngram", {"k": 0})
    with pytest.raises(UserError, match="min_ngram 4 > max_ngram 3"):
        check_params("vllm-ngram", {"min_ngram": 4})
    with pytest.raises(UserError, match="dtype"):
        check_params("vllm", {"dtype": "int8"})
    with pytest.raises(UserError, match="k_schedule"):
        check_params("vllm-ngram", {"k_schedule": [[4, 1, 2]]})
    for bad in ([[2, 4, 2]], [[1, 4, 2], [3, 8, 1]], "[[1, 2", [[1, 2]]):
        with pytest.raises(UserError, match="k_schedule"):
            check_params("vllm-ngram", {"k_schedule": bad})
    for name in ("vllm-dflash", "vllm-dspark"):
        with pytest.raises(UserError, match="needs drafter=PATH"):
            check_params(name, {})
    assert check_params("vllm-eagle3", {})["drafter"] == "drafters/smollm2-135m/eagle"  # the eagle policy's head


def test_engine_args():
    ar = engine_args("vllm", check_params("vllm", {"dtype": "float32"}), "/m", None)
    assert ar["model"] == "/m" and "speculative_config" not in ar and ar["enable_prefix_caching"] is False
    ng = engine_args("vllm-ngram", check_params("vllm-ngram", {"k_schedule": [[1, 1, 4], [2, 16, 2]]}), "/m", None)
    assert ng["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3,
                                        "num_speculative_tokens_per_batch_size": [(1, 1, 4), (2, 16, 2)]}
    dr = engine_args("vllm-draft", check_params("vllm-draft", {}), "/m", "/d")
    assert dr["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 4, "model": "/d"}


# ---------------------------------------------------------------------------------------------
# Counters


def test_counters_differenced():
    c = SpecCounters.between(counters(10, 40, 25, [9, 8, 5, 3]), counters(14, 56, 30, [12, 10, 5, 3]))
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (4, 16, 5)
    assert c.accepted_per_pos == (3, 2, 0, 0)
    assert c.drafted_per_position(4) == [4, 4, 4, 4]  # 16 tokens in 4 drafts of k = 4: all full
    assert c.accepted_per_position() == [3, 2]
    short = SpecCounters.between(counters(), counters(4, 13, 5, [3, 2]))
    assert short.drafted_per_position(4) == [4]  # some drafts were short: only position 1 is known
    assert SpecCounters.between(counters(), counters()).drafted_per_position(4) == []
    with pytest.raises(RuntimeError, match="backwards"):
        SpecCounters.between(counters(5, 20, 10), counters(4, 16, 10))


def test_read_counters_from_metric_snapshot():
    snapshot = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=3),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=12),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=7),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2, 1, 1]),
                SimpleNamespace(name="vllm:generation_tokens", value=99)]
    llm = SimpleNamespace(get_metrics=lambda: snapshot)
    assert read_counters(llm) == counters(3, 12, 7, [3, 2, 1, 1])
    assert read_counters(SimpleNamespace(get_metrics=lambda: [])) == counters()


def test_request_timing():
    m = SimpleNamespace(first_token_ts=10.0, last_token_ts=10.5, first_token_latency=0.2)
    assert request_timing(SimpleNamespace(metrics=m)) == (0.2, 0.5)
    assert request_timing(SimpleNamespace(metrics=None)) == (None, None)


# ---------------------------------------------------------------------------------------------
# Building results


def test_batch_results_counters_on_first_row():
    reply = {"wall_s": 2.0,
             "outputs": [{"ids": [5, 6, 7, 2], "finish_reason": "stop", "ttft_s": 0.1, "decode_s": 0.3},
                         {"ids": [8, 9, 10, 11, 12, 13], "finish_reason": "length", "ttft_s": 0.1, "decode_s": 0.5}],
             "counters_before": counters(), "counters_after": counters(3, 12, 4, [3, 1])}
    b = batch_results([[1, 2, 3], [4]], reply, [2], max_new_tokens=6, k=4)
    first, second = b.requests
    assert first.output_ids == [5, 6, 7, 2] and first.finish_reason == "eos" and second.finish_reason == "length"
    assert (first.prompt_tokens, second.prompt_tokens) == (3, 1)
    emitted = 3 + 5  # tokens after each request's first
    assert first.rounds == emitted - 4 and first.drafted == 12 and first.accepted == 4
    assert first.drafted_per_position == [3, 3, 3, 3] and first.accepted_per_position == [3, 1]
    assert second.rounds is None and second.drafted is None and second.accepted is None
    assert first.tau == second.tau == pytest.approx(emitted / (emitted - 4))
    assert first.tokens_per_s == pytest.approx(3 / 0.3) and b.wall_s == 2.0
    ar = batch_results([[1]], {"wall_s": 1.0, "outputs": [{"ids": [5, 6, 7], "finish_reason": "length",
                                                           "ttft_s": None, "decode_s": None}],
                               "counters_before": counters(), "counters_after": counters()}, [2], 8, 0)
    r = ar.requests[0]
    assert (r.rounds, r.drafted, r.accepted, r.tau, r.decode_s) == (2, 0, 0, 1.0, 1.0)
    assert r.drafted_per_position == [] and r.accepted_per_position == []


# ---------------------------------------------------------------------------------------------
# The worker protocol and the runner, against the fake worker


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_engine, "WORKER_SCRIPT", FAKE_WORKER)
    monkeypatch.setattr(vllm_engine, "find_vllm_python", lambda: sys.executable)
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    return SimpleNamespace(**vars(make_target()), path=str(tmp_path / "model"))


def test_sweep_records_through_the_worker(fake_vllm, tmp_path):
    target = fake_vllm
    engines = [vllm_engine.make_vllm_baseline("vllm", target, {}),
               vllm_engine.make_vllm_baseline("vllm-ngram", target, {"k": 3})]
    out = tmp_path / "r.jsonl"
    run_sweep(target, engines, [make_workload(n=3)], out, batch_sizes=(1, 2), progress=False)
    for e in engines:
        e.worker.close()
    recs = read_records(out)
    assert len(recs) == 2 * 3 * 2
    ng = [r for r in recs if r["policy"] == "vllm-ngram"]
    assert {r["policy_params"]["engine"] for r in recs} == {"vllm"}
    assert ng[0]["policy_params"]["engine_version"] == "0.0-fake" and ng[0]["policy_params"]["dtype"] == "float32"
    assert ng[0]["policy_params"]["method"] == "ngram"
    assert "method" not in [r for r in recs if r["policy"] == "vllm"][0]["policy_params"]
    for r in ng:
        assert r["generated_tokens"] == 24 and r["ttft_s"] == 0.01 and r["batch_wall_s"] == 0.5
    b1 = [r for r in ng if r["batch_size"] == 1]
    assert all(r["drafted"] == 3 and r["accepted"] == 2 and r["rounds"] == 23 - 2 for r in b1)
    assert all(r["drafted_per_position"] == [1, 1, 1] and r["accepted_per_position"] == [1, 1] for r in b1)
    b2 = [r for r in ng if r["batch_size"] == 2]
    by_batch = {}
    for r in b2:
        by_batch.setdefault(r["batch_id"], []).append(r)
    sizes = sorted(len(v) for v in by_batch.values())
    assert sizes == [1, 2]
    for rows in by_batch.values():  # counters of the batch on its first record only
        n = len(rows)
        assert rows[0]["drafted"] == 3 * n and rows[0]["accepted"] == 2 * n
        assert all(r["drafted"] is None for r in rows[1:])
        assert len({r["tau"] for r in rows}) == 1


def test_worker_errors_are_one_line(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "init")
    e = vllm_engine.make_vllm_baseline("vllm", fake_vllm, {})  # returns at once; init is awaited on first use
    with pytest.raises(UserError, match="vllm: vLLM: ValueError: no such model"):
        e.max_batch_size
    e.worker.close()
    monkeypatch.setenv("FAKE_VLLM_FAIL", "generate")
    e = vllm_engine.make_vllm_baseline("vllm", fake_vllm, {})
    with pytest.raises(UserError, match="RuntimeError: boom"):
        e.decode([[1, 2]], SamplingConfig(max_new_tokens=4), [2])
    e.worker.proc.kill()
    e.worker.proc.wait()
    with pytest.raises(UserError, match="the vLLM worker exited"):
        e.decode([[1, 2]], SamplingConfig(max_new_tokens=4), [2])
    e.worker.close()


# ---------------------------------------------------------------------------------------------
# vLLM not installed


def test_find_python_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBENCH_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(UserError, match="does not exist"):
        vllm_engine.find_vllm_python()
    monkeypatch.setenv("SPECBENCH_VLLM_PYTHON", sys.executable)
    if vllm_engine._has_vllm(sys.executable):
        pytest.skip("this Python has vllm")
    with pytest.raises(UserError, match="cannot import vllm"):
        vllm_engine.find_vllm_python()


def test_cli_without_vllm_exits_2_one_line(tmp_path):
    out = tmp_path / "x.jsonl"
    assert_one_line_error(["run", "--policy", "vllm-ngram", "--workload", "code", "--limit", "1", "--out", str(out),
                           "--no-progress"], tmp_path, "SPECBENCH_VLLM_PYTHON", out,
                          env_extra={"SPECBENCH_VLLM_PYTHON": str(tmp_path / "missing-python")})
