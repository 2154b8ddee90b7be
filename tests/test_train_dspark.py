"""specbench.train.dspark: DSpark / DFlash training on tiny synthetic data (a tiny random target
answering its own prompts, features cached by specbench.train.data)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specbench.drafters.dspark import DSparkArgs, build_drafter, load_dspark_drafter
from specbench.errors import UserError
from specbench.train.common import get_budget
from specbench.train.dspark import LOSS_WEIGHTS, _batch, block_loss, evaluate, make_blocks, sample_anchors, train
from helpers import tiny_target, tiny_training_data

TAPS = [0, 1, 2]


def budget(**kw):
    return get_budget("tiny", **{"anchors": 8, "block_size": 4, "markov_rank": 8, **kw})


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    return tiny_training_data(target, tmp_path_factory.mktemp("data") / "d", TAPS)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    """One dspark and one dflash drafter at the tiny budget (60 steps)."""
    out = {}
    for variant in ("dspark", "dflash"):
        d = tmp_path_factory.mktemp(variant)
        out[variant] = (d, train(target, data, d, budget=budget(steps=60), seed=0, policy=variant, progress=False))
    return out


def _weights(path):
    return load_file(next(path.glob("*.safetensors")))


def test_anchor_sampling_and_supervision_mask(data):
    g = torch.Generator().manual_seed(0)
    batch = data.batch(list(range(6)), ("input_ids", "loss_mask"))
    anchors, sup = make_blocks(batch, 8, 4, g)
    for b in range(6):
        length, mask = int(batch["lengths"][b]), batch["loss_mask"][b]
        a = anchors[b][sup[b, :, 0]]
        assert 0 < len(a) <= 8 and torch.equal(a, a.unique())  # sorted, no repeats
        assert bool(mask[a].all() and mask[a + 1].all())  # anchor and its next token are response tokens
        valid = int((mask[: length - 1] & mask[1:length]).sum())
        assert len(a) == min(8, valid)
        assert not sup[b, len(a):].any()  # padding blocks are never supervised
        for n, p in enumerate(a.tolist()):
            k = int(sup[b, n].sum())
            assert sup[b, n, :k].all()  # a contiguous prefix ...
            expect = 0
            while expect < 4 and p + expect + 1 < length and mask[p + expect + 1]:
                expect += 1
            assert k == expect  # ... of the slots whose label is a response token
    # Multi-turn style mask with a gap: supervision stops at the first non-response label.
    gapped = {"lengths": torch.tensor([10]), "loss_mask": torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]]).bool()}
    anchors, sup = make_blocks(gapped, 10, 4, g)
    assert anchors[0].tolist() == [1, 2, 5, 6, 7]
    assert sup[0].sum(-1).tolist() == [2, 1, 3, 2, 1]
    # Uniform without replacement: every valid anchor is drawn sometimes.
    m = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    seen = torch.zeros(8)
    for _ in range(200):
        a = sample_anchors(m, 8, 2, g)
        assert len(a) == 2 and set(a.tolist()) <= {2, 3, 4, 5}
        seen[a] += 1
    assert (seen[2:6] > 60).all()


def _reference_loss(drafter, data, idx, anchors, sup, variant):
    """The loss of docs/dspark.md §6.2 computed block by block through the inference path (context cache)."""
    w_all = torch.exp(-torch.arange(drafter.block_size) / 4.0)
    wts = LOSS_WEIGHTS[variant]
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    den = 0.0
    for b, i in enumerate(idx):
        s = data[i]
        ids, taps, last = s["input_ids"], s["taps"], s["last_hidden"]
        for n, p in enumerate(anchors[b].tolist()):
            kmax = int(sup[b, n].sum())
            if kmax == 0:
                continue
            drafter.setup_cache(1, len(ids) + drafter.block_size)  # room for the longest sequence's context
            drafter.append_context(taps[None, :p])
            h = drafter.block_hidden(ids[p: p + 1])[0]
            for k in range(kmax):
                prev = ids[p + k]
                logits = drafter.block_logits(h[k], prev)
                logp = F.log_softmax(logits.float(), -1)
                p_t = torch.softmax(F.linear(last[p + k].float(), drafter.lm_head_weight), -1)
                l1 = (logp.exp() - p_t).abs().sum()
                w = float(w_all[k])
                num["ce"] += w * float(-logp[ids[p + k + 1]])
                num["l1"] += w * float(l1)
                if drafter.confidence_head is not None:
                    z = drafter.confidence_logits(h[k], prev)
                    c = float((1 - 0.5 * l1).clamp(0, 1))
                    num["conf"] += w * float(F.binary_cross_entropy_with_logits(z, torch.tensor(c)))
                den += w
    return sum(wts[k] * num[k] / den for k in num)


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_loss_matches_blockwise_reference(target, data, variant):
    args = DSparkArgs.for_target(target.model.args, tap_layers=TAPS, variant=variant, n_layers=1, block_size=4,
                                 markov_rank=8)
    drafter = build_drafter(args, target.model)
    drafter.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():  # make the Markov bias and confidence non-trivial
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    idx = [0, 3, 5]
    batch = _batch(data, idx, "cpu")
    anchors, sup = make_blocks(batch, 5, 4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss, metrics = block_loss(drafter, batch, anchors, sup, variant)
        ref = _reference_loss(drafter, data, idx, anchors, sup, variant)
    assert math.isclose(float(loss), ref, rel_tol=1e-4)
    assert set(metrics) >= ({"ce", "l1", "conf"} if variant == "dspark" else {"ce"})


def test_training_lowers_loss(target, data, trained):
    _, val = data.split(budget()["val_fraction"], 0)
    for variant, (path, result) in trained.items():
        args = DSparkArgs.for_target(target.model.args, tap_layers=TAPS, variant=variant, n_layers=1,
                                     block_size=4, markov_rank=8)
        untrained = build_drafter(args, target.model, dtype=torch.float32)
        untrained.init_weights(torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = evaluate(untrained, data, val, 4, 8, variant, 0)
            after = evaluate(load_dspark_drafter(str(path), target), data, val, 4, 8, variant, 0)
        assert after["loss"] < 0.8 * before["loss"], (variant, before["loss"], after["loss"])
        assert after["tau_est_t1"] > before["tau_est_t1"]
        losses = [h["loss"] for h in result.history]
        assert sum(losses[-10:]) < 0.9 * sum(losses[:10])
        assert result.final["val_loss"] == pytest.approx(after["loss"], rel=0.05)  # bf16 storage only
        assert result.kind == variant and result.steps == 60


def test_checkpoint_contents_and_loading(target, trained):
    path, result = trained["dspark"]
    cfg = json.loads((path / "drafter.json").read_text())
    assert cfg["kind"] == "dspark" and cfg["target_fingerprint"] == target.fingerprint
    assert DSparkArgs.from_dict(cfg["model_args"]).markov_rank == 8
    weights = _weights(path)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not any("embed" in k and "mask" not in k or "lm_head" in k for k in weights)
    assert {"markov_w1.weight", "markov_w2.weight", "confidence_head.weight", "mask_embedding"} <= set(weights)
    drafter = load_dspark_drafter(str(path), target)
    assert drafter.kind == "dspark" and drafter.lm_head_weight is target.model.lm_head.weight
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, weights[k].float())
    dflash_path, _ = trained["dflash"]
    dflash = load_dspark_drafter(str(dflash_path), target)
    assert dflash.kind == "dflash" and dflash.markov_w1 is None and dflash.confidence_head is None
    assert not any("markov" in k or "confidence" in k for k in _weights(dflash_path))
    assert (path / "loss_curve.png").is_file()


def test_refuses_other_target_wrong_kind_and_corrupt_files(target, trained, tmp_path):
    path, _ = trained["dspark"]
    other = tiny_target(fingerprint="another-target")
    with pytest.raises(UserError, match="trained for target"):
        load_dspark_drafter(str(path), other)
    with pytest.raises(UserError, match="not 'dflash'"):
        load_dspark_drafter(str(path), target, kind="dflash")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "drafter.json").write_text((path / "drafter.json").read_text())
    shard = next(path.glob("*.safetensors"))
    (bad / shard.name).write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match="corrupt"):
        load_dspark_drafter(str(bad), target)
    (bad / "drafter.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        load_dspark_drafter(str(bad), target)
    cfg = json.loads((path / "drafter.json").read_text())
    cfg["kind"] = "draft-lm"
    (bad / "drafter.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="draft-lm"):
        load_dspark_drafter(str(bad), target)


def test_same_seed_bit_identical_and_resume(target, data, tmp_path):
    b = budget(steps=12, ckpt_every=4)
    a = train(target, data, tmp_path / "a", budget=b, seed=3, policy="dspark", progress=False)
    again = train(target, data, tmp_path / "b", budget=b, seed=3, policy="dspark", progress=False)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in again.history]
    other = train(target, data, tmp_path / "c", budget=b, seed=4, policy="dspark", progress=False)
    assert not torch.equal(_weights(tmp_path / "c")["fc.weight"], wa["fc.weight"])
    assert other.steps == 12

    # Interrupted after 5 steps, then resumed: ends exactly where the uninterrupted run ends.
    part = train(target, data, tmp_path / "r", budget=b, seed=3, policy="dspark", progress=False, stop_after=5)
    assert part.steps == 5 and not (tmp_path / "r" / "drafter.json").exists()
    with pytest.raises(UserError, match="resume"):
        train(target, data, tmp_path / "r", budget=b, seed=3, policy="dspark", progress=False)
    done = train(target, data, tmp_path / "r", budget=b, seed=3, policy="dspark", progress=False, resume=True)
    wr = _weights(tmp_path / "r")
    assert done.steps == 12 and all(torch.equal(wa[k], wr[k]) for k in wa)
    assert [h["loss"] for h in done.history] == [h["loss"] for h in a.history]


def test_reduced_draft_vocabulary_trains_saves_and_loads(target, data, tmp_path):
    """budget draft_vocab = V_d: the subset is the training split's most frequent response tokens,
    stored with the weights (int64, not cast to bf16), restored on load; the loss is finite and
    falls; the loaded drafter drafts from the subset only."""
    from specbench.train.common import vocab_rank

    V = target.model.args.vocab_size
    Vd = V // 4
    result = train(target, data, tmp_path / "d", budget=budget(steps=30, draft_vocab=Vd), seed=0, policy="dspark",
                   progress=False)
    losses = [h["loss"] for h in result.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    weights = _weights(tmp_path / "d")
    train_idx, _ = data.split(get_budget("tiny")["val_fraction"], 0)
    assert weights["vocab_ids"].dtype == torch.int64
    assert torch.equal(weights["vocab_ids"], vocab_rank(data, train_idx, V)[:Vd].long())
    drafter = load_dspark_drafter(str(tmp_path / "d"), target)
    assert torch.equal(drafter.vocab_ids, weights["vocab_ids"])
    drafter.setup_cache(4, 64)
    feats = torch.randn(4, 5, len(TAPS) * target.model.args.dim)
    drafter.append_context(feats)
    tokens, probs, _ = drafter.draft_block(torch.tensor([1, 2, 3, 4]), None, 1.0)
    assert set(tokens.flatten().tolist()) <= set(weights["vocab_ids"].tolist())
    # build_dspark's draft_vocab = n: the first n of these ranked tokens; n >= V_d (or 0) leaves all V_d.
    from specbench.policies.registry import build_dspark

    for n, size in ((0, Vd), (Vd, Vd), (Vd + 5, Vd), (3, 3)):
        policy = build_dspark(target, drafter=str(tmp_path / "d"), scheduler="fixed", draft_vocab=n)
        assert policy.params()["draft_vocab"] == size
        assert policy.draft_model.vocab_ids.tolist() == weights["vocab_ids"][:size].tolist()


def test_calibrate_fits_each_sampling_temperature(target, data, trained, tmp_path):
    """`specbench calibrate` writes one STS fit per sampling temperature beside the drafter, from
    rollouts on the validation split; build_dspark then uses the fit for each batch's temperature."""
    import shutil

    from specbench.policies.calibration import calibrate, held_out_prompts
    from specbench.policies.registry import build_dspark

    path = tmp_path / "drafter"
    shutil.copytree(trained["dspark"][0], path)
    uncalibrated = build_dspark(target, drafter=str(path), scheduler="fixed", calibrated=False)
    result = calibrate(target, uncalibrated, str(path), data, n_prompts=8, temperatures=(0.0, 1.0), max_new_tokens=24,
                       batch_size=4)
    saved = json.loads((path / "calibration.json").read_text())
    assert [f["sampling_temperature"] for f in saved["fits"]] == [0.0, 1.0]
    assert saved["prompts"] == len(held_out_prompts(data, 8)) > 0
    for fit in saved["fits"]:
        assert len(fit["temperatures"]) == 4 and all(t > 0 for t in fit["temperatures"])
        assert 0 < fit["per_position"][0]["n"] <= fit["rollouts"]  # the last round may verify nothing (budget)
        assert fit["ece_after_mean"] <= fit["ece_before_mean"] + 1e-9  # fitted on these rollouts
    assert result["path"] == str(path / "calibration.json")
    policy = build_dspark(target, drafter=str(path), scheduler="fixed")
    assert policy.params()["sts"] == {"0": [round(t, 3) for t in saved["fits"][0]["temperatures"]],
                                      "1": [round(t, 3) for t in saved["fits"][1]["temperatures"]]}


def test_target_stats_give_the_whole_vocabulary_loss_and_are_cached(target, data):
    """With a reduced draft vocabulary, the loss from the cached per-token log-normalisers and
    greedy tokens (common.attach_target_stats) equals the loss from the target's whole-vocabulary
    logits; the stats are written once and read back, and recomputed under another dtype."""
    from specbench.train.common import TARGET_STATS_FILE, attach_target_stats
    from specbench.train.data import TrainingData

    args = DSparkArgs.for_target(target.model.args, tap_layers=TAPS, n_layers=1, block_size=4, markov_rank=8,
                                 draft_vocab=target.model.args.vocab_size // 4)
    drafter = build_drafter(args, target.model)
    drafter.init_weights(torch.Generator().manual_seed(0))
    fresh = TrainingData(data.path, target)
    (fresh.path / TARGET_STATS_FILE).unlink(missing_ok=True)
    idx = [0, 3, 5]
    plain = _batch(fresh, idx, "cpu")
    anchors, sup = make_blocks(plain, 5, 4, torch.Generator().manual_seed(1))
    attach_target_stats(fresh, target.model.lm_head.weight, None, progress=False)
    with_stats = _batch(fresh, idx, "cpu")
    assert set(with_stats) - set(plain) == {"target_lse", "target_argmax"}
    with torch.no_grad():
        ref, ref_m = block_loss(drafter, plain, anchors, sup, "dspark", with_stats=True)
        got, got_m = block_loss(drafter, with_stats, anchors, sup, "dspark", with_stats=True)
    assert math.isclose(float(got), float(ref), rel_tol=1e-5)
    for k in ("l1", "conf", "_pos_sum_t0", "_pos_sum_t1"):
        assert torch.allclose(got_m[k], ref_m[k], rtol=1e-5, atol=1e-6), k
    cached = (fresh.path / TARGET_STATS_FILE).stat().st_mtime_ns
    again = TrainingData(data.path, target)
    attach_target_stats(again, target.model.lm_head.weight, None, progress=False)
    assert (fresh.path / TARGET_STATS_FILE).stat().st_mtime_ns == cached
    assert torch.equal(again.sequence(3, ["target_lse"])["target_lse"], fresh.sequence(3, ["target_lse"])["target_lse"])
    attach_target_stats(again, target.model.lm_head.weight, torch.bfloat16, progress=False)
    assert (fresh.path / TARGET_STATS_FILE).stat().st_mtime_ns != cached


def test_warm_start_continues_a_trained_drafter(target, data, trained, tmp_path):
    """--init: the run starts from the given drafter's stored weights and draft vocabulary (not a
    random initialisation), records the chain of runs in its summary and card line, and refuses a
    drafter of another kind or architecture with a one-line UserError."""
    from specbench.train.common import warm_start, warm_start_line

    src, first = trained["dspark"]
    stored = {k: v for k, v in _weights(src).items()}
    for f in sorted(src.glob("*.safetensors"))[1:]:
        stored.update(load_file(f))
    args = DSparkArgs.from_dict(json.loads((src / "drafter.json").read_text())["model_args"])
    fresh = build_drafter(args, target.model, dtype=torch.float32)
    fresh.init_weights(torch.Generator().manual_seed(7))
    info = warm_start(fresh, str(src), target, "dspark", args.to_dict())
    own = fresh.state_dict()
    assert all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in stored.items())
    assert info["steps"] == first.steps and info["warm_start"] is None
    assert warm_start_line(info).startswith(f"`{src}` ({first.steps} steps on ")

    b = budget(steps=6)
    cont = train(target, data, tmp_path / "w", budget=b, seed=0, policy="dspark", progress=False, init=str(src))
    scratch = train(target, data, tmp_path / "s", budget=b, seed=0, policy="dspark", progress=False)
    assert cont.history[0]["loss"] < 0.9 * scratch.history[0]["loss"]  # it starts where the trained one ended
    assert abs(cont.history[0]["loss"] - first.history[-1]["loss"]) < 0.25 * first.history[-1]["loss"]
    summary = json.loads((tmp_path / "w" / "drafter.json").read_text())["training"]
    assert summary["warm_start"]["from"] == str(src) and "warm start" in cont.extra
    again = train(target, data, tmp_path / "w2", budget=b, seed=0, policy="dspark", progress=False,
                  init=str(tmp_path / "w"))
    assert "itself continuing" in again.extra["warm start"]

    with pytest.raises(UserError, match="not 'dspark'"):
        train(target, data, tmp_path / "x", budget=b, seed=0, policy="dspark", progress=False,
              init=str(trained["dflash"][0]))
    with pytest.raises(UserError, match="markov_rank"):
        train(target, data, tmp_path / "y", budget=budget(steps=6, markov_rank=4), seed=0, policy="dspark",
              progress=False, init=str(src))
    # q/k norms may be added (weights 1: the Qwen3 layout DeepSpec and vLLM load), not taken away
    normed = train(target, data, tmp_path / "q", budget=budget(steps=6, qk_norm=True), seed=0, policy="dspark",
                   progress=False, init=str(src))
    assert "q/k norms (weights 1) added" in normed.extra["warm start"] and "q/k norms" in normed.extra["architecture"]
    config = json.loads((tmp_path / "q" / "drafter.json").read_text())
    assert config["model_args"]["model_args"]["qk_norm"] is True
    assert abs(normed.history[0]["loss"] - first.history[-1]["loss"]) < 0.5 * first.history[-1]["loss"]
    with pytest.raises(UserError, match="qk_norm|model_args"):
        train(target, data, tmp_path / "z", budget=b, seed=0, policy="dspark", progress=False, init=str(tmp_path / "q"))


def test_warm_start_grows_the_markov_rank(target, trained):
    """--init with a larger --markov-rank: the stored head fills the leading rank directions, the
    new directions' W2 columns and confidence inputs are 0, so the grown drafter's bias-corrected
    logits and confidence equal the stored drafter's; W1's new columns keep a fresh initialisation
    (else no gradient could reach the new directions). A smaller rank is refused."""
    from specbench.train.common import warm_start

    src, _ = trained["dspark"]
    config = json.loads((src / "drafter.json").read_text())["model_args"]
    stored = DSparkArgs.from_dict(config)
    original = build_drafter(stored, target.model, dtype=torch.float32)
    warm_start(original, str(src), target, "dspark", stored.to_dict())
    grown_args = DSparkArgs.from_dict({**config, "markov_rank": 2 * stored.markov_rank})
    grown = build_drafter(grown_args, target.model, dtype=torch.float32)
    grown.init_weights(torch.Generator().manual_seed(3))
    info = warm_start(grown, str(src), target, "dspark", grown_args.to_dict())
    assert info["added"] == f"Markov rank {stored.markov_rank} → {grown_args.markov_rank} (new W2 columns 0)"
    r = stored.markov_rank
    assert grown.markov_w1.weight[:, r:].abs().sum() > 0 and grown.markov_w2.weight[:, r:].abs().sum() == 0
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, stored.model_args.dim, generator=g)
    prev = torch.randint(0, stored.model_args.vocab_size, (5,), generator=g)
    with torch.no_grad():
        assert torch.allclose(grown.block_logits(h, prev), original.block_logits(h, prev), atol=1e-6)
        assert torch.allclose(grown.confidence_logits(h, prev), original.confidence_logits(h, prev), atol=1e-6)
    smaller = DSparkArgs.from_dict({**config, "markov_rank": r // 2})
    with pytest.raises(UserError, match="markov_rank"):
        warm_start(build_drafter(smaller, target.model, dtype=torch.float32), str(src), target, "dspark",
                   smaller.to_dict())


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_warm_start_appends_draft_layers(target, trained, variant):
    """--init with more --draft-layers: the stored layers come first, each new layer's o_proj and
    down_proj are 0 (the identity on the residual stream), so the grown drafter's block hidden
    states equal the stored drafter's; the new layers' other weights keep a fresh initialisation.
    Fewer layers are refused."""
    from specbench.train.common import warm_start

    src, _ = trained[variant]
    config = json.loads((src / "drafter.json").read_text())["model_args"]
    stored = DSparkArgs.from_dict(config)
    n = stored.model_args.n_layers
    original = build_drafter(stored, target.model, dtype=torch.float32)
    warm_start(original, str(src), target, variant, stored.to_dict())
    grown_args = DSparkArgs.from_dict({**config, "model_args": {**config["model_args"], "n_layers": n + 2}})
    grown = build_drafter(grown_args, target.model, dtype=torch.float32)
    grown.init_weights(torch.Generator().manual_seed(3))
    info = warm_start(grown, str(src), target, variant, grown_args.to_dict())
    assert info["added"] == f"draft layers {n} → {n + 2} (new output projections 0)"
    assert len(grown.layers) == n + 2
    for layer in grown.layers[n:]:
        assert layer.self_attn.o_proj.weight.abs().sum() == 0 and layer.mlp.down_proj.weight.abs().sum() == 0
        assert layer.self_attn.q_proj.weight.abs().sum() > 0 and layer.mlp.up_proj.weight.abs().sum() > 0
    g = torch.Generator().manual_seed(0)
    T = 12
    features = torch.randn(2, T, len(stored.tap_layers) * stored.model_args.dim, generator=g)
    input_ids = torch.randint(0, stored.model_args.vocab_size, (2, T), generator=g)
    anchors = torch.tensor([[3, 7], [1, 5]])
    with torch.no_grad():
        assert torch.allclose(grown.forward_blocks(features, input_ids, anchors),
                              original.forward_blocks(features, input_ids, anchors), atol=1e-5)
    if n > 1:
        fewer_args = DSparkArgs.from_dict({**config, "model_args": {**config["model_args"], "n_layers": n - 1}})
        with pytest.raises(UserError, match="model_args"):
            warm_start(build_drafter(fewer_args, target.model, dtype=torch.float32), str(src), target, variant,
                       fewer_args.to_dict())


def test_build_dspark_leaves_a_whole_vocabulary_drafter_whole(target, trained):
    """build_dspark's draft_vocab = n on a drafter that drafts from the whole vocabulary: nothing ranked to
    cut, so it is used whole, and policy_params say so."""
    from specbench.policies.registry import build_dspark

    V = target.model.args.vocab_size
    for n in (0, 3):
        policy = build_dspark(target, drafter=str(trained["dspark"][0]), scheduler="fixed", draft_vocab=n)
        assert policy.params()["draft_vocab"] == V and policy.draft_model.vocab_ids is None


def test_build_dspark_cuts_the_block(target, trained):
    """build_dspark's block = n: a trained γ-slot drafter drafts n slots a round (keep_block); 0 or n ≥ γ
    leaves all γ; policy_params record the cut (0: none)."""
    from specbench.policies.registry import build_dspark

    trained_block = load_dspark_drafter(str(trained["dspark"][0]), target).block_size
    assert trained_block >= 3
    for n, gamma, recorded in ((0, trained_block, 0), (trained_block, trained_block, 0),
                               (trained_block + 2, trained_block, 0), (2, 2, 2)):
        policy = build_dspark(target, drafter=str(trained["dspark"][0]), scheduler="fixed", block=n)
        assert policy.gamma == gamma and policy.draft_model.block_size == gamma
        assert policy.params()["block"] == recorded and policy.params()["gamma"] == gamma


@pytest.mark.parametrize("bad", [-1, 2.5, "four", False])
def test_build_dspark_refuses_a_block_that_is_not_a_count(bad):
    """block from a spec or --param: a whole number >= 0, else one clear error before any loading."""
    from specbench.errors import UserError
    from specbench.policies.registry import build_dspark

    with pytest.raises(UserError, match="block must be a whole number >= 0"):
        build_dspark(None, block=bad)


@pytest.mark.parametrize("bad", [-3, 1.5, "abc", True])
def test_build_dspark_refuses_a_draft_vocab_that_is_not_a_count(bad):
    """draft_vocab from a spec or --param: a whole number >= 0, else one clear error before any loading."""
    from specbench.errors import UserError
    from specbench.policies.registry import build_dspark

    with pytest.raises(UserError, match="draft_vocab must be a whole number >= 0"):
        build_dspark(None, draft_vocab=bad)


@pytest.mark.parametrize("name,bad,least", [("lookup_ngram", -1, 0), ("lookup_ngram", 2.5, 0), ("lookup_k", 0, 1),
                                            ("lookup_k", "six", 1), ("lookup_k", True, 1)])
def test_build_dspark_refuses_lookup_settings_that_are_not_counts(name, bad, least):
    """lookup_ngram / lookup_k from a spec or --param: whole numbers (>= 0, >= 1), else one clear error."""
    from specbench.errors import UserError
    from specbench.policies.registry import build_dspark

    with pytest.raises(UserError, match=f"{name} must be a whole number >= {least}"):
        build_dspark(None, **{name: bad})


@pytest.mark.parametrize("name,bad,least", [("lookup_ngram", -1, 0), ("lookup_k", 0, 1), ("lookup_k", "six", 1),
                                            ("k", 0, 1), ("draft_vocab", 1.5, 0)])
def test_build_fixed_k_refuses_settings_that_are_not_counts(name, bad, least):
    """fixed-k's k / draft_vocab / lookup_ngram / lookup_k from a spec or --param: one clear error before any loading."""
    from specbench.errors import UserError
    from specbench.policies.registry import build_fixed_k

    with pytest.raises(UserError, match=f"{name} must be a whole number >= {least}"):
        build_fixed_k(None, **{name: bad})
