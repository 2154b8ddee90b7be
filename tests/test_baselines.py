"""Peer baselines on the real default model: `hf` greedy == our `ar`; `hf-pld` runs at b=1 and is
refused at b=4 (exit 2, one line)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specbench.engine.core import SamplingConfig
from specbench.errors import UserError

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def setup():
    from specbench.engine.loading import load_model
    from specbench.bench.workloads import load_workload, render_prompt

    target = load_model("smollm2-135m")
    wl = load_workload("code", limit=2)
    prompts = [render_prompt(target.tokenizer, wl, [("user", r.turns[0])]) for r in wl.requests]
    return target, prompts


@pytest.fixture(scope="module")
def ar_outputs(setup):
    from specbench.bench.runner import make_engine

    target, prompts = setup
    ar = make_engine("ar", target)
    cfg = SamplingConfig(max_new_tokens=24)
    return [ar.decode([p], cfg, target.eos_token_ids).requests[0].output_ids for p in prompts]


@pytest.mark.slow
def test_hf_greedy_equals_ar(setup, ar_outputs):
    from specbench.bench.runner import make_engine

    target, prompts = setup
    hf = make_engine("hf", target)
    cfg = SamplingConfig(max_new_tokens=24)
    single = [hf.decode([p], cfg, target.eos_token_ids).requests[0] for p in prompts]
    assert [r.output_ids for r in single] == ar_outputs
    batched = hf.decode(prompts, cfg, target.eos_token_ids)  # b=2, left padding
    assert [r.output_ids for r in batched.requests] == ar_outputs
    r = single[0]
    assert r.ttft_s is None and r.decode_s > 0 and r.tokens_per_s == pytest.approx(r.generated_tokens / r.decode_s)
    assert r.rounds == r.generated_tokens - 1 and r.drafted == r.accepted == 0


def test_hf_pld_b1_counts_and_equals_ar(setup, ar_outputs):
    from specbench.bench.runner import make_engine

    target, prompts = setup
    e = make_engine("hf-pld", target)
    assert e.max_batch_size == 1
    cfg = SamplingConfig(max_new_tokens=24)
    for p, ref in zip(prompts, ar_outputs):
        r = e.decode([p], cfg, target.eos_token_ids).requests[0]
        assert r.output_ids == ref  # greedy prompt lookup is lossless
        assert r.rounds == len(r.trace_verify_len) and r.drafted == sum(r.trace_verify_len) > 0
        assert 0 <= r.accepted <= r.drafted and r.accepted == sum(r.trace_accepted)
        assert r.tau == pytest.approx(r.generated_tokens / r.rounds)
    with pytest.raises(UserError, match="batch size 1"):
        e.decode(prompts, cfg, target.eos_token_ids)


@pytest.mark.slow
def test_hf_pld_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    bad = subprocess.run([sys.executable, "-m", "specbench", "run", "--policy", "hf-pld", "--workload", "code",
                          "--batch-size", "4", "--out", str(tmp_path / "x.jsonl")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and not (tmp_path / "x.jsonl").exists()
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specbench: error: ") and "batch size 1" in lines[0]
    ok = subprocess.run([sys.executable, "-m", "specbench", "run", "--policy", "hf-pld", "--workload", "code",
                         "--limit", "2", "--max-new-tokens", "24", "--no-progress", "--out", str(tmp_path / "p.jsonl")],
                        env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "p.jsonl").read_text().count("\n") == 2
    assert "hf-pld" in ok.stdout
