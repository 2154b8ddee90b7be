"""The embedded default target with real prompts (HumanEval and MT-Bench through the chat
template): every chain policy is token-identical to AR under greedy decoding at batch sizes 1
and 4 (16 is covered by the slow CLI test); the shipped drafters at 1, 4 and 16."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench.engine.core import SamplingConfig, generate
from specbench.policies.registry import build_policy
from specbench.bench.workloads import load_workload, render_prompt

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def real_prompts(default_model):
    prompts = []
    for name, n in (("code", 3), ("chat", 1)):
        workload = load_workload(name, limit=n)
        prompts += [render_prompt(default_model.tokenizer, workload, [("user", r.turns[0])]) for r in workload.requests]
    return prompts


@pytest.fixture(scope="module")
def ar_reference(default_model, real_prompts):
    config = SamplingConfig(max_new_tokens=32)
    ar = build_policy("ar", default_model)
    return [generate(default_model.model, ar, [p], config, default_model.eos_token_ids).requests[0].output_ids
            for p in real_prompts]


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("policy,params", [("pld", {}), ("fixed-k", {"drafter": "truncate:8", "k": 3})])
def test_greedy_identity_default_model(default_model, real_prompts, ar_reference, policy, params, batch_size):
    config = SamplingConfig(max_new_tokens=32)
    pol = build_policy(policy, default_model, params)
    out = []
    for i in range(0, len(real_prompts), batch_size):
        out += generate(default_model.model, pol, real_prompts[i : i + batch_size], config,
                        default_model.eos_token_ids).requests
    assert [r.output_ids for r in out] == ar_reference
    assert sum(r.drafted for r in out) > 0


PROFILE = str(Path(__file__).resolve().parent.parent / "results" / "profiles" / "smollm2-135m-amd-epyc-x2-threads.json")
SHIPPED = [  # every policy over a drafter shipped in drafters/smollm2-135m/
    ("fixed-k", {}),
    ("eagle-chain", {}),
    ("eagle-t16", {}),
    ("dflash", {}),
    ("dspark-fixed", {}),
    ("dspark-960-fixed", {}),
    ("dspark", {"profile": PROFILE}),  # Algorithm 1 + the draft gate, on the committed CPU profile
    ("dspark", {"profile": "cheap verify"}),  # the same on a profile where drafting must pay
    ("dspark-lookup", {"profile": "cheap verify"}),  # with lookup drafts, mixed with drafted rows at b = 4 and 16
]
DRAFTING_MAY_BE_GATED_OFF = {("dspark", PROFILE)}  # a weak drafter on a real CPU profile: the gate may skip it


@pytest.fixture(scope="module")
def cheap_verify_profile(tmp_path_factory):
    """A cost profile on which verifying more tokens costs almost nothing and drafting is cheap:
    Algorithm 1 verifies drafts and the draft gate keeps the drafter on."""
    entries = [{"batch": b, "q": q, "median_ms": 20.0 + 0.01 * b * q} for b in (1, 4, 16) for q in (1, 2, 4, 8)]
    path = tmp_path_factory.mktemp("profile") / "cheap.json"
    path.write_text(json.dumps({"context": 256, "entries": entries,
                                "draft": [{"batch": b, "median_ms": 0.1} for b in (1, 4, 16)]}))
    return str(path)


@pytest.mark.parametrize("policy", ["fixed-k-lookup", "eagle-chain-lookup"])
def test_lookup_controls_greedy_identity(default_model, real_prompts, ar_reference, policy):
    """dspark-lookup's controls, the same lookup drafts in front of the draft LM and the EAGLE head, on real
    prompts at b = 1 and 4 (mixed lookup and drafted rows): token-identical to AR, and lookup drafts of 6
    tokens, longer than either drafter's 3, were verified."""
    config = SamplingConfig(max_new_tokens=32)
    pol = build_policy(policy, default_model)
    for batch_size in (1, 4):
        out = []
        for i in range(0, len(real_prompts), batch_size):
            out += generate(default_model.model, pol, real_prompts[i : i + batch_size], config,
                            default_model.eos_token_ids).requests
        assert [r.output_ids for r in out] == ar_reference, batch_size
        assert any(v == 6 for r in out for v in r.trace_verify_len), batch_size


@pytest.mark.parametrize("policy,params", SHIPPED, ids=[p + (f"-{v['profile'].split('/')[-1]}" if v else "") for p, v in SHIPPED])
def test_shipped_drafters_greedy_identity(default_model, real_prompts, ar_reference, policy, params, cheap_verify_profile):
    """The shipped drafters on real prompts at batch sizes 1, 4 and 16 (the 4 prompts repeated
    four times fill the batch of 16): token-identical to AR, and they drafted."""
    config = SamplingConfig(max_new_tokens=32)
    may_skip_drafting = (policy, params.get("profile")) in DRAFTING_MAY_BE_GATED_OFF
    if params.get("profile") == "cheap verify":
        params = {**params, "profile": cheap_verify_profile}
    pol = build_policy(policy, default_model, params)
    for batch_size in (1, 4, 16):
        prompts = real_prompts * (4 if batch_size == 16 else 1)
        out = []
        for i in range(0, len(prompts), batch_size):
            out += generate(default_model.model, pol, prompts[i : i + batch_size], config,
                            default_model.eos_token_ids).requests
        assert [r.output_ids for r in out] == ar_reference * (4 if batch_size == 16 else 1), batch_size
        if not may_skip_drafting:
            assert sum(r.drafted for r in out) > 0, batch_size
