"""The DSpark policy end to end on tiny models: greedy identity for every scheduler at batch sizes
1, 4 and 16; the whole policy (drafting + STS-calibrated confidence + Algorithm 1) is
distribution-identical to the target at T = 1 for scheduling batches of 1 and 4 (χ²); and the
load-aware scheduler verifies less per request as the batch grows. Greedy identity and χ² also in
bf16 (target and drafter in bf16; probabilities and verification stay fp32)."""
from __future__ import annotations


import pytest
import torch

from specbench.engine.core import SamplingConfig, generate
import specbench.policies.dspark as dspark_module
from specbench.policies.dspark import DSpark
from specbench.engine.policy import Policy
from helpers import N_SAMPLES, N_TOKENS, SMALL_VOCAB, chi_square, exact_joint, lookup_merge_spy, make_drafter
from tiny import random_prompts, tiny_model

VOCAB = 64


def linear_cost(rows: int, q: int) -> float:
    return 0.010 + 0.0015 * rows * q  # a fixed launch/weights cost plus a per-token cost


def policy(drafter, scheduler, **kw):
    return DSpark(drafter, scheduler=scheduler, threshold=0.4, step_seconds=linear_cost,
                  sts_temperatures=[1.3, 0.8, 1.0, 1.1], **kw)


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=0, scale=4.0)


@pytest.fixture(scope="module")
def target_bf16():
    return tiny_model(vocab=VOCAB, seed=0, scale=4.0, dtype=torch.bfloat16)


@pytest.mark.parametrize("batch_size,dtype", [(1, "fp32"), (4, "fp32"), (16, "fp32"), (4, "bf16")])
def test_greedy_identity_every_scheduler(request, batch_size, dtype):
    target = request.getfixturevalue("target" if dtype == "fp32" else "target_bf16")
    prompts = random_prompts(16, VOCAB, seed=7)
    config = SamplingConfig(max_new_tokens=32)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    drafter = make_drafter(target)
    for scheduler in ("fixed", "threshold", "algorithm1", "capacity"):
        pol = policy(drafter, scheduler)
        out = []
        for i in range(0, 16, batch_size):
            out += generate(target, pol, prompts[i : i + batch_size], config).requests
        assert [r.output_ids for r in out] == reference, scheduler
    dflash = DSpark(make_drafter(target, variant="dflash"), scheduler="fixed")
    out = []
    for i in range(0, 16, batch_size):
        out += generate(target, dflash, prompts[i : i + batch_size], config).requests
    assert [r.output_ids for r in out] == reference, "dflash"


def test_greedy_identity_self_consistent_drafter(target):
    """A drafter the target agrees with (the test makes the target copy a short cycle) gets drafts
    accepted, so the accept-and-commit path with draft-context updates is exercised under greedy."""
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 6]
    config = SamplingConfig(max_new_tokens=24)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    out = generate(target, policy(make_drafter(target, seed=2), "fixed"), prompts, config).requests
    assert [r.output_ids for r in out] == reference
    assert sum(r.accepted for r in out) > 0, "no draft was accepted: the accept-and-commit path did not run"


@pytest.fixture(scope="module")
def small():
    target = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0)
    return target, make_drafter(target, seed=1, block_size=3, std=0.3)


@pytest.mark.parametrize("group_size", [1, 4])
def test_whole_policy_sampling_matches_target(small, group_size):
    _whole_policy_chi_square(*small, group_size)


def test_whole_policy_sampling_matches_target_bf16():
    target = tiny_model(vocab=SMALL_VOCAB, seed=10, scale=2.0, dtype=torch.bfloat16)
    drafter = make_drafter(target, seed=1, block_size=3, std=0.3)
    assert drafter.dtype == torch.bfloat16
    _whole_policy_chi_square(target, drafter, 4)


@pytest.mark.parametrize("keep", [3, 2])
def test_reduced_draft_vocabulary_sampling_matches_target(small, keep):
    """A drafter that can propose only 3 of the 5 tokens, or only the first 2 of those (its draft
    vocabulary cut at load time, build_dspark's draft_vocab): still the target's distribution."""
    target, _ = small
    drafter = make_drafter(target, seed=1, block_size=3, std=0.3, draft_vocab=3)
    drafter.set_draft_vocab(torch.tensor([4, 0, 2]))
    drafter.keep_draft_vocab(keep)
    assert drafter.vocab_ids.tolist() == [4, 0, 2][:keep]
    _whole_policy_chi_square(target, drafter, 4)


def test_a_cut_block_keeps_greedy_identity_and_the_target_distribution(target, small):
    """keep_block(n) (build_dspark's block): the drafter drafts n slots a round instead of the γ it was
    trained with, a different proposal that is verified like any other: greedy output equal to AR's
    (fp32 and bf16) and, sampled, the target's distribution (χ²)."""
    prompts = random_prompts(8, VOCAB, seed=7)
    config = SamplingConfig(max_new_tokens=24)
    for tgt in (target, tiny_model(vocab=VOCAB, seed=0, scale=4.0, dtype=torch.bfloat16)):
        reference = [generate(tgt, Policy(), [p], config).requests[0].output_ids for p in prompts]
        drafter = make_drafter(tgt)
        drafter.keep_block(2)
        for scheduler in ("fixed", "algorithm1"):
            pol = policy(drafter, scheduler)
            assert pol.gamma == 2 and pol.params()["block"] == 2
            out = [r.output_ids for i in range(0, 8, 4) for r in generate(tgt, pol, prompts[i : i + 4], config).requests]
            assert out == reference, (tgt.dtype, scheduler)
    small_target, _ = small
    drafter = make_drafter(small_target, seed=1, block_size=3, std=0.3)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="block must be in 1..3"):
            drafter.keep_block(bad)
    drafter.keep_block(2)
    assert drafter.block_size == 2
    _whole_policy_chi_square(small_target, drafter, 4)


def _whole_policy_chi_square(target, drafter, group_size):
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    pol = DSpark(drafter, scheduler="algorithm1", step_seconds=lambda rows, q: 0.01 + 0.0001 * rows * q,
                 sts_temperatures=[1.5, 0.7, 1.0], group_size=group_size)
    config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=1.0, seed=99)
    result = generate(target, pol, [prompt] * N_SAMPLES, config)
    counts = {}
    for r in result.requests:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    verify_lengths = [v for r in result.requests for v in r.trace_verify_len]
    assert len(set(verify_lengths)) >= 2  # the scheduler really varies ℓ
    assert 0 < sum(r.accepted for r in result.requests) < sum(r.drafted for r in result.requests)
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"DSpark (group {group_size}) distribution differs (p={pvalue:.2e}, TV={tv:.4f})"


def test_verify_length_falls_as_batch_grows(target):
    """Padded verification makes the first extra token of a round cost every row a slot, so with a
    per-token cost comparable to the fixed cost big batches verify nothing: use a cheap one."""
    drafter = make_drafter(target, seed=2)
    cheap = lambda rows, q: 0.010 + 0.0001 * rows * q  # noqa: E731
    config = SamplingConfig(max_new_tokens=16)
    prompts = random_prompts(16, VOCAB, seed=11)  # the same requests at every batch size
    means = []
    for batch_size in (1, 4, 16):
        pol = DSpark(drafter, scheduler="algorithm1", step_seconds=cheap, sts_temperatures=[1.3, 0.8, 1.0, 1.1])
        lengths = []
        for i in range(0, len(prompts), batch_size):
            out = generate(target, pol, prompts[i : i + batch_size], config).requests
            lengths += [v for r in out for v in r.trace_verify_len]
        means.append(sum(lengths) / len(lengths))
    assert means[0] > means[1] > means[2], means


@pytest.mark.parametrize("draft_cost", [0.0, 0.004, 100.0])
def test_draft_gate_greedy_identity(target, draft_cost):
    """The draft gate (skip the drafter while it does not pay) keeps greedy identity whether it
    never skips (free drafting), toggles, or skips with exponential back-off (drafting ruinous)."""
    prompts = random_prompts(8, VOCAB, seed=5)
    config = SamplingConfig(max_new_tokens=40)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    cheap = lambda rows, q: 0.010 + 0.0001 * rows * q  # noqa: E731  (verifying drafts pays)
    pol = DSpark(make_drafter(target, seed=4), scheduler="algorithm1", step_seconds=cheap,
                 draft_seconds=lambda rows: draft_cost, sts_temperatures=[1.3, 0.8, 1.0, 1.1], draft_gate=True)
    out = generate(target, pol, prompts, config).requests
    assert [r.output_ids for r in out] == reference
    skipped = sum(1 for r in out for c in r.trace_confidence if not c)
    drafted = sum(1 for r in out for c in r.trace_confidence if c)
    assert drafted > 0
    if draft_cost == 0.0:
        assert skipped < drafted / 4
    if draft_cost == 100.0:
        # back-off 1, 2, 4 … : far more skipped rounds than probes
        assert skipped > 2 * drafted / len(prompts)
        assert all(v == 0 for r in out for v, c in zip(r.trace_verify_len, r.trace_confidence) if not c)


def test_algorithm1_runs_once_a_gated_round_and_schedules_as_before(target, monkeypatch):
    """With the draft gate, propose() already runs Algorithm 1 on the round's confidences (what would
    the scheduler admit?); _schedule takes that answer instead of searching again. One search per
    drafted round, and the same verify lengths and outputs as when the schedule searches itself."""
    import specbench.policies.dspark as dspark_policy

    prompts = random_prompts(4, VOCAB, seed=6)
    config = SamplingConfig(max_new_tokens=32)
    cheap = lambda rows, q: 0.010 + 0.0001 * rows * q  # noqa: E731

    def run(reuse: bool):
        calls = []
        for name in ("algorithm1_lengths", "algorithm1_admit"):  # the schedule's search and the gate's
            search = getattr(dspark_policy, name)
            monkeypatch.setattr(dspark_policy, name, lambda *a, _search=search, **k: calls.append(1) or _search(*a, **k))
        pol = DSpark(make_drafter(target, seed=4), scheduler="algorithm1", step_seconds=cheap,
                     draft_seconds=lambda rows: 0.002, sts_temperatures=[1.3, 0.8, 1.0, 1.1], draft_gate=True)
        if not reuse:
            update = pol.gate.update
            monkeypatch.setattr(pol.gate, "update", lambda *a: [update(*a), None][1])  # the schedule searches itself
        out = generate(target, pol, prompts, config).requests
        drafted = sum(1 for r in out for c in r.trace_confidence if c)
        return [r.output_ids for r in out], [r.trace_verify_len for r in out], len(calls), drafted

    ids, lengths, calls, drafted = run(True)
    ref_ids, ref_lengths, ref_calls, ref_drafted = run(False)
    assert ids == ref_ids and lengths == ref_lengths and drafted == ref_drafted > 0
    assert calls > 0 and ref_calls == 2 * calls


def test_draft_gate_remembers_its_back_off_per_batch_size():
    """Where drafting never pays, a batch probes at rounds 0, 2, 5, 10, 19, 36 (back-off 1, 2, 4 …);
    the next batch of the same size probes at once, then backs off as far as the last one ended;
    a batch of another size starts from a back-off of 1."""
    from specbench.policies.dspark import DraftGate

    gate = DraftGate(3, lambda rows, q: 0.01, lambda rows: 100.0)

    def batch(rows: int, rounds: int = 40) -> list[int]:
        gate.reset()
        drafted = []
        for _ in range(rounds):
            if gate.skip():
                drafted.append(0)
                continue
            drafted.append(1)
            gate.update(torch.full((rows, 3), 0.9), torch.ones(rows, dtype=torch.bool))
        return drafted

    first = batch(4)
    assert [i for i, d in enumerate(first) if d] == [0, 2, 5, 10, 19, 36]
    assert batch(4) == [1] + [0] * 39
    assert batch(2) == first


def test_draft_gate_sampling_matches_target(small):
    """χ² at T = 1 with the gate skipping and probing (a ruinous draft cost: draft, skip 1, draft,
    skip 2, …): mixing drafter-free rounds into the policy leaves the distribution the target's."""
    target, drafter = small
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    pol = DSpark(drafter, scheduler="algorithm1", step_seconds=lambda rows, q: 0.01 + 0.0001 * rows * q,
                 draft_seconds=lambda rows: 100.0, sts_temperatures=[1.5, 0.7, 1.0], group_size=4, draft_gate=True)
    config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=1.0, seed=123)
    result = generate(target, pol, [prompt] * N_SAMPLES, config)
    rounds = [bool(c) for r in result.requests for c in r.trace_confidence]
    assert True in rounds and False in rounds  # both kinds of round happened
    counts = {}
    for r in result.requests:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    pvalue, tv = chi_square(exact, counts)
    assert pvalue > 1e-3, f"DSpark with the draft gate differs (p={pvalue:.2e}, TV={tv:.4f})"


def test_sts_fit_follows_the_sampling_temperature(target):
    """With one STS fit per sampling temperature, each batch's confidences are σ(z / T_k) with the
    fit nearest its temperature (T = 0 → the greedy fit; T = 0.9 → the T = 1 fit); params record both."""
    fits = {0.0: [0.5, 0.6, 0.7, 0.8], 1.0: [1.5, 1.6, 1.7, 1.8]}
    pol = DSpark(make_drafter(target), scheduler="fixed", sts_temperatures=fits)
    assert pol.params()["sts"] == {"0": fits[0.0], "1": fits[1.0]}
    prompts = random_prompts(3, VOCAB, seed=3)
    for temperature, fit in ((0.0, 0.0), (0.9, 1.0)):
        result = generate(target, pol, prompts, SamplingConfig(max_new_tokens=12, temperature=temperature, seed=1))
        for req in result.requests:
            raw = torch.tensor(req.trace_confidence_logits)
            assert len(raw) == len(req.trace_confidence) > 0
            expected = torch.sigmoid(raw / torch.tensor(fits[fit]))
            torch.testing.assert_close(torch.tensor(req.trace_confidence), expected, atol=1e-4, rtol=0)  # traces keep 4 decimals


def test_deferred_context_equals_per_round_appends(target):
    """With the draft gate, the features of skipped rounds reach the draft context in one append when
    drafting resumes (DSpark._flush_context). Ragged rounds (a drafted round's 4, 2 and 0 entries,
    then one-token rounds while a row has finished) must land in the slots, with the K/V, that one
    append per round gives."""
    import copy

    drafter = make_drafter(target, seed=4)
    twin = copy.deepcopy(drafter)
    width = drafter.fc.in_features
    gen = torch.Generator().manual_seed(3)
    feats = lambda n: torch.randn(3, n, width, generator=gen)  # noqa: E731
    prompt = feats(5)
    rounds = [(feats(4), torch.tensor([4, 2, 0])), (feats(1), torch.tensor([1, 1, 0])), (feats(1), torch.tensor([1, 0, 0]))]
    for d in (drafter, twin):
        d.setup_cache(3, 64)
        d.append_context(prompt, counts=torch.tensor([5, 3, 2]))
    for f, c in rounds:
        drafter.append_context(f, counts=c)
    pol = DSpark(twin, scheduler="fixed")
    pol.pending_context = list(rounds)
    pol._flush_context()
    assert pol.pending_context == []
    assert twin.ctx_len.tolist() == drafter.ctx_len.tolist() == [11, 6, 2]
    for r, n in enumerate(drafter.ctx_len.tolist()):
        for mine, theirs in ((twin.k_cache, drafter.k_cache), (twin.v_cache, drafter.v_cache)):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a[r, :, :n], b[r, :, :n])


def test_draft_gate_defers_context_without_changing_drafts(target):
    """Decoding with the deferred context proposes the same drafts (the confidences of every drafted
    round) as appending after every round, and the context holds as many entries whenever the
    drafter runs (the committed prefix: ctx_len == lengths − 1, which the eager appends keep)."""
    prompts = random_prompts(4, VOCAB, seed=6)
    config = SamplingConfig(max_new_tokens=40)
    runs = []
    for eager in (False, True):
        pol = DSpark(make_drafter(target, seed=4), scheduler="algorithm1", step_seconds=lambda rows, q: 0.01,
                     draft_seconds=lambda rows: 100.0, sts_temperatures=[1.3, 0.8, 1.0, 1.1], draft_gate=True)
        observe, draft_block = pol.observe, pol.draft_model.draft_block
        if eager:  # the reference: every round's features appended at once
            def observe_now(*a, _observe=observe, _pol=pol):
                _observe(*a)
                _pol._flush_context()
            pol.observe = observe_now
        seen = []

        def check(anchors, *a, _pol=pol, _draft=draft_block, **k):
            seen.append(_pol.draft_model.ctx_len[: len(anchors)].clone())
            return _draft(anchors, *a, **k)
        pol.draft_model.draft_block = check
        out = generate(target, pol, prompts, config).requests
        runs.append(([r.trace_confidence for r in out], [r.output_ids for r in out], [x.tolist() for x in seen]))
        assert len(seen) > 2 and any(not c for r in out for c in r.trace_confidence)  # it skipped and drafted
    (deferred, ids, ctx), (eager, eager_ids, eager_ctx) = runs
    assert ids == eager_ids
    assert ctx == eager_ctx  # the context length at every drafting round: the committed prefix's
    assert [[len(c) for c in row] for row in deferred] == [[len(c) for c in row] for row in eager]
    for row_d, row_e in zip(deferred, eager):
        for c_d, c_e in zip(row_d, row_e):
            assert c_d == pytest.approx(c_e, abs=1e-3)


def test_draft_gate_judges_by_what_the_scheduler_admits():
    """In a padded verify the first admitted draft costs every row a slot, so Algorithm 1's early stop
    admits nothing where only a whole column of drafts would pay. The gate must judge drafting by
    what the scheduler would verify (skip), not by the global optimum the early stop never reaches
    (what kept DSpark probing at b = 16); the capacity variant, which searches the whole path, drafts."""
    from specbench.policies.dspark import DraftGate

    step = lambda rows, q: 0.01 + 0.004 * rows * q  # noqa: E731
    conf, active = torch.full((4, 3), 0.9), torch.ones(4, dtype=torch.bool)
    for early_stop, skips in ((True, True), (False, False)):
        gate = DraftGate(3, step, lambda rows: 0.0, early_stop=early_stop)
        gate.reset()
        gate.update(conf, active)
        assert gate.skip() is skips, early_stop
    assert policy_gate("algorithm1").early_stop and not policy_gate("capacity").early_stop


def policy_gate(scheduler):
    drafter = make_drafter(tiny_model(vocab=VOCAB, seed=0), seed=1)
    return DSpark(drafter, scheduler=scheduler, step_seconds=linear_cost, draft_gate=True).gate


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lookup_drafts_keep_greedy_identity(request, monkeypatch, dtype):
    """lookup_ngram (policies/dspark.py, "Lookup drafts"): rows whose last tokens occur earlier verify the
    tokens that followed instead of the drafted block; rounds where every row has one (or the draft gate
    skips) make no drafter call. Greedy output equals AR's at b = 1 and 4, with and without the gate."""
    target = request.getfixturevalue("target" if dtype == "fp32" else "target_bf16")
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 6, [3, 1, 4, 1, 5, 9, 2, 6]] + random_prompts(5, VOCAB, seed=3)
    config = SamplingConfig(max_new_tokens=32)
    reference = [generate(target, Policy(), [p], config).requests[0].output_ids for p in prompts]
    cheap = lambda rows, q: 0.010 + 0.0001 * rows * q  # noqa: E731
    seen = lookup_merge_spy(dspark_module, monkeypatch, False, VOCAB)  # rounds merged without / with a drafter call
    for scheduler, draft_cost in (("algorithm1", 0.0), ("algorithm1", 100.0), ("fixed", 0.0)):  # gate never / often skips
        for batch_size in (1, 4):
            pol = DSpark(make_drafter(target, seed=2), scheduler=scheduler, step_seconds=cheap,
                         draft_seconds=lambda rows: draft_cost, sts_temperatures=[1.3, 0.8, 1.0, 1.1],
                         draft_gate=scheduler == "algorithm1", lookup_ngram=1, lookup_k=3)
            assert pol.params()["lookup_ngram"] == 1 and pol.max_draft == 4
            seen.update(free=0, mixed=0)
            out = [r for i in range(0, len(prompts), batch_size)
                   for r in generate(target, pol, prompts[i : i + batch_size], config).requests]
            assert [r.output_ids for r in out] == reference, (scheduler, draft_cost, batch_size)
            assert pol.lookup_outcomes[0][0] > 0 and pol.lookup_outcomes[0][1] > 0
            assert seen["free"] > 0, "no round went without the drafter"
            if batch_size == 4 and draft_cost == 0.0 and scheduler == "algorithm1":
                assert seen["mixed"] > 0, "no round mixed lookup rows with drafted ones"
            # lookup rounds without a drafter call verify drafts but record no confidences
            assert any(v > 0 and not c for r in out for v, c in zip(r.trace_verify_len, r.trace_confidence))
    with pytest.raises(ValueError, match="lookup_ngram"):
        DSpark(make_drafter(target), scheduler="fixed", lookup_ngram=-1)


def test_lookup_drafts_are_scheduled_by_their_past_acceptance_and_the_cost(target):
    """With Algorithm 1 a lookup draft's confidences are the acceptance rates of earlier lookup drafts,
    position by position: where verifying is free every lookup draft is verified whole; where each
    verified token doubles a round's cost, none is."""
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 6]
    config = SamplingConfig(max_new_tokens=24)
    for step, whole in ((lambda rows, q: 0.01, True), (lambda rows, q: 0.01 * 2.0 ** q, False)):
        pol = DSpark(make_drafter(target, seed=2), scheduler="algorithm1", step_seconds=step,
                     sts_temperatures=[1.3, 0.8, 1.0, 1.1], lookup_ngram=1, lookup_k=3)
        survival = pol.lookup_survival()
        assert survival == pytest.approx([0.5, 0.25, 0.125])  # the Beta(1, 1) prior before any outcome
        lengths = []
        spy = pol.schedule

        def schedule(draft, state):
            out = spy(draft, state)
            lengths.extend(out[r].item() for r in pol.lookups)
            return out

        pol.schedule = schedule
        out = generate(target, pol, prompts, config).requests
        assert lengths, "no lookup draft was scheduled"
        if whole:
            assert all(n > 0 for n in lengths) and sum(r.accepted for r in out) > 0
            verified, accepted = pol.lookup_outcomes[0]
            assert pol.lookup_survival()[0] == pytest.approx((accepted + 1) / (verified + 2))
        else:
            assert set(lengths) == {0} and pol.lookup_outcomes[0][0] == 0
            # none admitted: the policy backed off looking up (1, 2, 4 … rounds), so it looked up in few rounds
            assert len(lengths) < sum(r.rounds for r in out) / 2 and pol.lookup_backoff > 1


@pytest.mark.parametrize("draft_cost,broken", [(0.0, False), (100.0, False), (0.0, True)])
def test_lookup_drafts_sampling_matches_target(small, monkeypatch, draft_cost, broken):
    """χ² at T = 1 with lookup drafts mixed into drafted rounds (draft cost 0: rows with a match verify
    their one-hot lookup draft beside rows verifying drafted blocks) and in rounds the gate skips (a
    ruinous draft cost): the distribution stays the target's. Negative control (broken): the lookup rows
    claim a uniform draft distribution instead of their one-hot one, and the same test rejects it."""
    target, drafter = small
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, N_TOKENS, 1.0, 1.0)
    pol = DSpark(drafter, scheduler="algorithm1", step_seconds=lambda rows, q: 0.01 + 0.0001 * rows * q,
                 draft_seconds=lambda rows: draft_cost, sts_temperatures=[1.5, 0.7, 1.0], group_size=4,
                 draft_gate=True, lookup_ngram=1, lookup_k=2)
    seen = lookup_merge_spy(dspark_module, monkeypatch, broken, SMALL_VOCAB)
    config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=1.0, seed=321)
    result = generate(target, pol, [prompt] * N_SAMPLES, config)
    assert seen["free" if draft_cost else "mixed"] > 0
    counts = {}
    for r in result.requests:
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
    pvalue, tv = chi_square(exact, counts)
    if broken:
        assert pvalue < 1e-6 and tv > 0.05, f"the broken lookup drafts were not caught (p={pvalue:.2e}, TV={tv:.4f})"
    else:
        assert pvalue > 1e-3, f"DSpark with lookup drafts differs (p={pvalue:.2e}, TV={tv:.4f})"
