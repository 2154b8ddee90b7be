"""llama.cpp baselines: round counting and parameters without llama-cpp-python, the one-line error
when it is missing, and (when it is installed) counters on the default model's shipped GGUF and
whether `llama-cpp-pld` greedy equals `llama-cpp` greedy (it does not here: xfail, see its reason)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from cli_errors import assert_one_line_error
from specbench.bench.baselines import PeerRequestResult
from specbench.errors import UserError
from specbench.bench.llamacpp_engine import RoundCounter, check_params, fill_counters

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_params():
    assert check_params("llama-cpp-pld", {})["k"] == 4
    with pytest.raises(UserError, match="no parameter 'k'"):
        check_params("llama-cpp", {"k": 2})
    with pytest.raises(UserError, match="positive integer"):
        check_params("llama-cpp-pld", {"max_ngram": 0})


class FakeLlama:
    """generate() with llama-cpp-python's control flow: eval the pending tokens, yield the tokens
    the target agrees with (the script says how many drafts each round accepts), then draft."""

    def __init__(self, accepts, draft_len):
        self.accepts, self.draft_len = accepts, draft_len
        self.draft_model = lambda ids: np.arange(draft_len)

    def eval(self, tokens):
        pass

    def generate(self):
        self.eval([1, 2, 3])  # the prompt
        yield 10
        for a in self.accepts:
            self.draft_model(np.zeros(4))
            self.eval([0] * (1 + self.draft_len))
            for j in range(a + 1):
                yield 11 + j


def test_round_counter_and_counters():
    llm = FakeLlama(accepts=[2, 0, 3], draft_len=3)
    counter = RoundCounter(llm, llm.draft_model)
    ids = []
    for t in llm.generate():
        counter.token()
        ids.append(t)
    assert counter.evals == 4 and counter.emitted == [1, 3, 1, 4] and counter.draft_lengths == [3, 3, 3]
    res = PeerRequestResult(output_ids=ids, prompt_tokens=3)
    fill_counters(res, counter.emitted, counter.draft_lengths)
    assert (res.rounds, res.drafted, res.accepted) == (3, 9, 5)
    assert res.trace_verify_len == [3, 3, 3] and res.trace_accepted == [2, 0, 3]
    assert res.drafted_per_position == [3, 3, 3] and res.accepted_per_position == [2, 2, 1]
    assert res.tau == pytest.approx((len(ids) - 1) / 3)
    ar = PeerRequestResult(output_ids=[5, 6, 7], prompt_tokens=2)
    fill_counters(ar, [1, 1, 1], [])
    assert (ar.rounds, ar.drafted, ar.accepted, ar.tau) == (2, 0, 0, 1.0)


@pytest.mark.skipif(HAVE_LLAMA_CPP, reason="llama-cpp-python is installed here")
def test_cli_without_llama_cpp_exits_2_one_line(tmp_path):
    out = tmp_path / "x.jsonl"
    assert_one_line_error(["run", "--policy", "llama-cpp-pld", "--workload", "code", "--limit", "1", "--out", str(out),
                           "--no-progress"], tmp_path, "llama-cpp-python is not installed", out)


@pytest.fixture(scope="module")
def llama_runs(default_model):
    from specbench.engine.core import SamplingConfig
    from specbench.bench.runner import make_engine
    from specbench.bench.workloads import load_workload, render_prompt

    wl = load_workload("code", limit=2)
    prompts = [render_prompt(default_model.tokenizer, wl, [("user", r.turns[0])]) for r in wl.requests]
    ar, pld = make_engine("llama-cpp", default_model), make_engine("llama-cpp-pld", default_model)
    cfg = SamplingConfig(max_new_tokens=48)
    runs = [(ar.decode([p], cfg, default_model.eos_token_ids).requests[0],
             pld.decode([p], cfg, default_model.eos_token_ids).requests[0]) for p in prompts]
    return ar, pld, prompts, cfg, runs


# llama-cpp-python compiles llama.cpp from source (30-45 min on 2 cores), so CI does not install it:
# these run in the slow set, where a missing install is a skip.
needs_llama = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")


@pytest.mark.slow
@pytest.mark.model
@needs_llama
def test_llama_cpp_counters(llama_runs, default_model):
    ar, pld, prompts, cfg, runs = llama_runs
    assert ar.params()["dtype"] == "q4_1" and ar.params()["engine"] == "llama.cpp"
    for a, b in runs:
        assert a.rounds == a.generated_tokens - 1 and a.drafted == 0
        assert 0 <= b.accepted <= b.drafted and b.rounds == len(b.trace_verify_len)
        assert b.tau == pytest.approx((b.generated_tokens - 1) / b.rounds)
    assert sum(b.drafted for _, b in runs) > 0
    with pytest.raises(UserError, match="batch size 1"):
        pld.decode(prompts, cfg, default_model.eos_token_ids)


@pytest.mark.slow
@pytest.mark.model
@needs_llama
@pytest.mark.xfail(reason="llama.cpp verifies drafts in a multi-token eval whose kernels round differently from "
                          "its one-token evals; on the Q4_1 default model greedy prompt lookup diverged from its AR "
                          "at token 24 of HumanEval/0 (llama-cpp-python 0.3.36, portable AVX2 build)", strict=False)
def test_pld_greedy_identical_to_llama_cpp_ar(llama_runs):
    for a, b in llama_runs[4]:
        assert b.output_ids == a.output_ids
