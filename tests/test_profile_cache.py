"""specbench.costs.profile.load_or_measure_target: a cached cost profile is reused only when the
target, device, dtype and the engine's code all match; one from other engine code is measured again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbench.cli.main import main
from specbench.costs import profile
from specbench.policies import registry
from specbench.engine.dtypes import dtype_name
from helpers import tiny_target

REPO = Path(__file__).resolve().parent.parent
CI_COSTS = REPO / "results" / "baseline" / "ci" / "dspark-costs.json"


def test_cached_profile_is_reused_only_for_the_same_engine_code(tmp_path, monkeypatch):
    target = tiny_target()
    measured = []

    def fake_measure(t):
        measured.append(t.name)
        return {"entries": [], "target_fingerprint": t.fingerprint, "marker": "new",
                "device_name": profile.device_name(t.model.device),
                "dtype": dtype_name(t.model.lm_head.weight.dtype), "engine_digest": profile.engine_digest()}

    monkeypatch.setattr(profile, "measure_profile", fake_measure)
    monkeypatch.setattr(profile, "committed_profiles", lambda: [])
    folder = tmp_path / "profiles"
    folder.mkdir()
    stale = {"entries": [], "target_fingerprint": target.fingerprint, "marker": "stale",
             "device_name": profile.device_name(target.model.device),
             "dtype": dtype_name(target.model.lm_head.weight.dtype), "engine_digest": "0123456789ab"}
    (folder / "old.json").write_text(json.dumps(stale))
    assert profile.load_or_measure_target(target, tmp_path)["marker"] == "new"
    assert measured == [target.name]
    assert profile.load_or_measure_target(target, tmp_path)["marker"] == "new"  # cached now, not measured again
    assert measured == [target.name]
    assert len(profile.engine_digest()) == 12 and profile.engine_digest() == profile.engine_digest()


def test_the_engine_digest_covers_the_cpu_kernels_source(tmp_path, monkeypatch):
    """A change to cpu_kernels.cpp changes step times, so it must change the digest profiles are keyed by."""
    from pathlib import Path

    engine = Path(profile.__file__).resolve().parent.parent / "engine"
    before = profile.engine_digest()
    real_read = Path.read_bytes

    def edited(self):
        data = real_read(self)
        return data + b"// edited" if self.name == "cpu_kernels.cpp" and self.parent == engine else data

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert profile.engine_digest() != before


def test_profile_times_the_q_values_of_a_batch_in_turn(monkeypatch):
    """The grid's q values are timed one forward each per pass, so a change of the machine's read rate
    during the measurement hits every q alike (the T(q)/T(1) ratios the scheduler reads)."""
    order = []

    def fake_time_forward(model, batch, q, context, iters=10, warmup=2):
        order.append((batch, q, iters))
        return [0.001 * q] * iters

    monkeypatch.setattr(profile, "time_forward", fake_time_forward)
    data = profile.profile(None, [1, 2], [1, 4, 8], context=16, iters=3)
    timed = [(b, q) for b, q, n in order if n == 1]
    assert timed == [(1, 1), (1, 4), (1, 8)] * 3 + [(2, 1), (2, 4), (2, 8)] * 3
    assert [(e["batch"], e["q"], e["n"], e["median_ms"]) for e in data["entries"]] == [
        (b, q, 3, q) for b in (1, 2) for q in (1, 4, 8)]


def test_profile_takes_more_passes_of_a_batch_size_until_its_time_budget(monkeypatch):
    """Cheap (small-batch) cells get extra passes up to max_iters while a batch size has taken less than
    min_seconds; every q still gets the same number of timings."""
    clock = iter(range(10_000))
    monkeypatch.setattr(profile.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(profile, "time_forward", lambda model, batch, q, context, iters=10, warmup=2: [0.001] * iters)
    data = profile.profile(None, [1], [1, 2], context=16, iters=2, min_seconds=5.0, max_iters=64)
    assert [e["n"] for e in data["entries"]] == [6, 6]  # read at 0, then after passes 2-6: 1 ... 5 s
    data = profile.profile(None, [1], [1, 2], context=16, iters=2, min_seconds=1e9, max_iters=7)
    assert [e["n"] for e in data["entries"]] == [7, 7]


def test_drafter_cost_takes_more_rounds_until_its_time_budget(monkeypatch):
    """measure_drafter: at least `iters` timed rounds after one warm-up, more until a batch size has taken
    `min_seconds`, never more than `max_iters`."""
    import types

    import torch

    calls = []
    fake = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                                 args=types.SimpleNamespace(model_args=types.SimpleNamespace(vocab_size=7)),
                                 setup_cache=lambda b, n: None, append_context=lambda f: None,
                                 ctx_len=torch.zeros(2, dtype=torch.long),
                                 draft_round=lambda features, counts, anchors, temperature, with_probs:
                                 calls.append(len(anchors)))
    clock = iter(range(100_000))
    monkeypatch.setattr(profile.time, "perf_counter", lambda: float(next(clock)))
    out = profile.measure_drafter(fake, 4, [1, 2], context=3, iters=2, min_seconds=9.0, max_iters=50)
    assert [e["n"] for e in out] == [3, 3]  # the clock moves 3 s a round: 9 s after 3 timed rounds
    assert calls == [1] * 4 + [2] * 4  # one warm-up round each
    out = profile.measure_drafter(fake, 4, [1], context=3, iters=2, min_seconds=1e9, max_iters=5)
    assert [e["n"] for e in out] == [5]


@pytest.mark.model
def test_profile_policy_stores_the_drafting_cost_a_pinned_spec_then_schedules_from(tmp_path, monkeypatch):
    """`specbench profile --policy SPEC` adds the drafting round's cost SPEC schedules from to the target's
    profile; a spec whose `profile` is that file schedules from exactly those costs (the CI gate's
    dspark-pinned: its greedy decisions do not depend on the machine)."""
    monkeypatch.setattr(profile, "measure_profile", lambda target, **kw: {
        "entries": [{"batch": b, "q": q, "median_ms": 10.0 + q} for b in (1, 2) for q in (1, 2, 4)],
        "target": target.name, "target_fingerprint": target.fingerprint, "engine_digest": profile.engine_digest()})
    source = tmp_path / "source.toml"
    source.write_text(f'name = "pinned-source"\nbuilder = "specbench.policies.registry:build_dspark"\n[params]\n'
                      f'drafter = "{REPO / "drafters" / "smollm2-135m" / "dspark"}"\nprofile = "{CI_COSTS}"\n'
                      f'draft_vocab = 2048\nblock = 4\n')
    out = tmp_path / "costs.json"
    assert main(["profile", "--policy", str(source), "--dtype", "float32", "--batches", "1,2", "--qs", "1,2,4",
                 "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["draft"] == json.loads(CI_COSTS.read_text())["draft"]
    assert written["draft_policy"] == {"name": "pinned-source", "params": {
        "drafter": str(REPO / "drafters" / "smollm2-135m" / "dspark"), "draft_vocab": 2048, "block": 4}}
    pinned = tmp_path / "pinned.toml"
    pinned.write_text(source.read_text().replace(str(CI_COSTS), str(out)))
    from specbench.engine.loading import load_model
    policy = registry.build_policy(str(pinned), load_model("smollm2-135m", dtype="float32"))
    assert policy.cost_profile["draft"] == written["draft"]
    assert policy.cost_profile["entries"] == written["entries"]
