"""vLLM on the default model, through the suite's runner: `vllm` (AR) and `vllm-ngram` on two
HumanEval prompts at batch sizes 1 and 2, greedy. vLLM's n-gram speculative decoding must be
token-identical to vLLM's own AR (each engine lossless against itself), and the records must carry
vLLM's spec-decode counters.

Slow (two engine starts, ~2.5 min each on an idle 2-core CPU), so the default `python -m pytest`
skips it; .ci/run installs vLLM (scripts/setup_vllm.sh) and runs it by itself. Skipped when no
Python with vLLM is found (the setup script's venv), unless SPECBENCH_VLLM_PYTHON names one: then a
broken install fails the test."""
from __future__ import annotations

import os

import pytest

from specbench.errors import UserError

pytestmark = [pytest.mark.slow, pytest.mark.model]

MAX_NEW = 32


@pytest.fixture(scope="module")
def vllm_records(default_model, tmp_path_factory):
    from specbench.bench.runner import make_engine, read_records, run_sweep
    from specbench.bench.vllm_engine import find_vllm_python
    from specbench.bench.workloads import load_workload

    if os.environ.get("SPECBENCH_VLLM_PYTHON"):
        find_vllm_python()  # configured (as in .ci/run): a broken install fails, it is not skipped
    else:
        try:
            find_vllm_python()
        except UserError as e:
            pytest.skip(str(e))
    # enforce_eager: no graph compilation, which only lengthens the start here
    engines = [make_engine(name, default_model, {"enforce_eager": True}) for name in ("vllm", "vllm-ngram")]
    out = tmp_path_factory.mktemp("vllm") / "smoke.jsonl"
    try:
        run_sweep(default_model, engines, [load_workload("code", limit=2)], out, batch_sizes=(1, 2),
                  max_new_tokens=MAX_NEW, progress=False)
    finally:
        for e in engines:
            e.worker.close()
    return read_records(out)


def test_ngram_greedy_identical_to_vllm_ar(vllm_records):
    by_key = {r["key"]: r for r in vllm_records}
    ngram = [r for r in vllm_records if r["policy"] == "vllm-ngram"]
    assert len(ngram) == 4  # 2 prompts × batch sizes 1, 2
    for r in ngram:
        ar = by_key[r["key"].replace("vllm-ngram|", "vllm|", 1)]
        assert r["output_ids"] == ar["output_ids"], r["key"]
        assert 1 <= r["generated_tokens"] <= MAX_NEW


def test_records_carry_engine_and_counters(vllm_records):
    for r in vllm_records:
        p = r["policy_params"]
        assert p["engine"] == "vllm" and p["engine_version"] and p["dtype"] == "float32"
        assert r["batch_wall_s"] > 0 and r["tokens_per_s"] > 0 and r["ttft_s"] is not None
    ar = [r for r in vllm_records if r["policy"] == "vllm"]
    assert all(r["drafted"] in (0, None) and r["tau"] == pytest.approx(1.0) for r in ar)
    ngram = [r for r in vllm_records if r["policy"] == "vllm-ngram" and r["drafted"] is not None]
    assert sum(r["drafted"] for r in ngram) > 0  # HumanEval prompts repeat their own identifiers
    for r in ngram:
        assert 0 <= r["accepted"] <= r["drafted"]
        assert r["tau"] == pytest.approx(1 + r["accepted"] / r["rounds"])  # the batch's rounds and accepts
        if r["accepted_per_position"]:
            assert sum(r["accepted_per_position"]) == r["accepted"]
