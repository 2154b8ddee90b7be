"""Fixed-K draft-LM training at the tiny budget: it learns, it is reproducible, it resumes, and its
checkpoints are refused for another target or when corrupt (tiny random models, CPU)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from specbench.engine.core import SamplingConfig, generate
from specbench.drafters.checkpoints import load_draft_lm
from specbench.errors import UserError
from specbench.policies.fixed_k import FixedK
from specbench.cli import train as cli
from specbench.train import draft_lm
from specbench.train.common import BUDGETS, LoopConfig, batch_indices, get_budget, lr_at, save_drafter
from specbench.train.data import TrainingData, build_training_data
from helpers import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

TINY = get_budget("tiny")


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    path = build_training_data(target, tmp_path_factory.mktemp("data") / "d", n_prompts=TINY["n_prompts"],
                               max_new_tokens=TINY["max_new_tokens"], seed=0, batch_size=TINY["gen_batch_size"],
                               magpie_max_tokens=40, progress=False)
    return TrainingData(path, target)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "fixed-k"
    return draft_lm.train(target, data, out, budget=TINY, seed=0, progress=False)


def weights(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_and_data_order():
    cfg = LoopConfig(steps=100, batch_size=3, lr=1.0)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == 0.25 and lrs[3] == 1.0 and lrs[-1] < 1e-3  # 4 warmup steps, cosine to ~0
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    items = list(range(10, 17))
    seen = [i for s in range(7) for i in batch_indices(s, items, 3, seed=5)]  # 3 epochs of 7
    assert sorted(seen) == sorted(items * 3) and sorted(seen[:7]) == items
    assert batch_indices(4, items, 3, seed=5) == batch_indices(4, items, 3, seed=5)
    assert set(BUDGETS) == {"tiny", "quick", "small", "full"}
    with pytest.raises(UserError, match="unknown budget"):
        get_budget("huge")


def test_causal_forward_matches_cached_forward(target):
    draft = draft_lm.init_draft_lm(target.model, 2)
    assert draft_lm.draft_layer_ids(4, 2) == [0, 3] and draft_lm.draft_layer_ids(30, 3) == [0, 14, 29]
    assert draft_lm.draft_layer_ids(30, 3, "first") == [0, 1, 2]
    assert draft.model.embed_tokens.weight is target.model.model.embed_tokens.weight  # shared, not copied
    assert not draft.lm_head.weight.requires_grad and draft.model.layers[0].mlp.up_proj.weight.requires_grad
    torch.testing.assert_close(draft.model.layers[1].mlp.up_proj.weight, target.model.model.layers[3].mlp.up_proj.weight)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = draft_lm.causal_forward(draft, tokens)
        draft.setup_cache(2, 64)
        from specbench.engine.core import forward_new_tokens
        _, _, ref = forward_new_tokens(draft, tokens, torch.zeros(2, dtype=torch.long))
    torch.testing.assert_close(hidden, ref, rtol=1e-5, atol=1e-5)


def test_loss_over_a_sample_of_positions(target, data):
    sup = torch.zeros(3, 10, dtype=torch.bool)
    sup[0, 2:9] = True  # 7 supervised
    sup[1, [1, 4]] = True  # 2 supervised: all kept
    kept = draft_lm.keep_positions(sup, 3, torch.Generator().manual_seed(0))
    assert kept.sum(1).tolist() == [3, 2, 0] and not (kept & ~sup).any()
    assert torch.equal(draft_lm.keep_positions(sup, 0, torch.Generator()), sup)
    draws = {tuple(draft_lm.keep_positions(sup, 3, torch.Generator().manual_seed(s))[0].nonzero().flatten().tolist())
             for s in range(20)}
    assert len(draws) > 5  # a fresh sample per generator state, not the first n
    draft = draft_lm.init_draft_lm(target.model, 1)
    batch = data.batch([0, 1], ("input_ids", "loss_mask", "last_hidden"))
    _, every = draft_lm.distill_loss(draft, batch)
    _, some = draft_lm.distill_loss(draft, batch, positions=2, generator=torch.Generator().manual_seed(0))
    assert some["tokens"] == 4 < every["tokens"]
    # the sampled loss estimates the full one (same weights, mean over many draws)
    kls = [float(draft_lm.distill_loss(draft, batch, positions=2, generator=torch.Generator().manual_seed(s))[1]["kl"])
           for s in range(200)]
    assert abs(sum(kls) / len(kls) - float(every["kl"])) < 0.1 * float(every["kl"])


def tau(target, draft, prompts, temperature: float) -> float:
    res = generate(target.model, FixedK(draft, k=4), prompts,
                   SamplingConfig(max_new_tokens=24, temperature=temperature, seed=0), target.eos_token_ids)
    return sum(r.generated_tokens - 1 for r in res.requests) / sum(r.rounds for r in res.requests)


def test_training_lowers_loss_and_raises_tau(target, data, trained):
    h = trained.history
    assert trained.steps == TINY["steps"] == len(h)
    first, last = sum(r["loss"] for r in h[:5]) / 5, sum(r["loss"] for r in h[-5:]) / 5
    assert last < 0.8 * first
    assert h[-1]["top1_agree"] > h[0]["top1_agree"] and "val_loss" in h[-1]
    out = trained.out_dir
    config = json.loads((out / "drafter.json").read_text())
    assert config["kind"] == "draft-lm" and config["target_fingerprint"] == target.fingerprint
    assert config["model_args"]["n_layers"] == TINY["lm_layers"]
    stored = weights(out)
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" not in stored
    rank = stored.pop("vocab_rank")  # the training split's token ranking (fixed-k's draft_vocab)
    assert rank.dtype == torch.int32 and sorted(rank.tolist()) == list(range(target.model.args.vocab_size))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert (out / "loss_curve.png").stat().st_size > 1000 and (out / "loss_history.json").is_file()
    # τ on the training prompts: the trained drafter beats its untrained initialisation
    prompts = []
    for i in range(len(data)):
        s = data.sequence(i, ("input_ids", "loss_mask"))
        prompts.append(s["input_ids"][: int((~s["loss_mask"]).sum())].tolist())
    untrained = draft_lm.init_draft_lm(target.model, TINY["lm_layers"]).eval().requires_grad_(False)
    drafter = load_draft_lm(str(out), target)
    assert torch.equal(drafter.vocab_rank, rank)
    gains = []
    for temperature in (0.0, 1.0):
        before, after = tau(target, untrained, prompts, temperature), tau(target, drafter, prompts, temperature)
        assert after > before, (temperature, before, after)
        gains.append(after - before)
    assert sum(gains) / 2 > 0.3, gains  # seed 0: +0.58 (T=0), +0.71 (T=1); target seeds 1-5: +0.39 ... +1.4


def test_same_seed_same_weights(target, data, trained, tmp_path):
    again = draft_lm.train(target, data, tmp_path / "again", budget=TINY, seed=0, progress=False)
    assert same(weights(trained.out_dir), weights(again.out_dir))
    assert [r["loss"] for r in trained.history] == [r["loss"] for r in again.history]
    other = draft_lm.train(target, data, tmp_path / "other", budget=TINY, seed=1, progress=False)
    assert not same(weights(trained.out_dir), weights(other.out_dir))


def test_interrupted_then_resumed_equals_uninterrupted(target, data, trained, tmp_path):
    out = tmp_path / "resumed"
    part = draft_lm.train(target, data, out, budget=TINY, seed=0, progress=False, stop_after=13)
    assert part.steps == 13 and not (out / "drafter.json").exists() and (out / "checkpoint" / "state.pt").is_file()
    with pytest.raises(UserError, match="--resume"):
        draft_lm.train(target, data, out, budget=TINY, seed=0, progress=False)
    with pytest.raises(UserError, match="other training settings"):
        draft_lm.train(target, data, out, budget={**TINY, "lr": 1e-3}, seed=0, progress=False, resume=True)
    done = draft_lm.train(target, data, out, budget=TINY, seed=0, progress=False, resume=True)
    assert done.steps == TINY["steps"]
    assert same(weights(trained.out_dir), weights(out))
    assert [r["loss"] for r in trained.history] == [r["loss"] for r in done.history]
    # optimizer state too: the saved checkpoints are the same
    a = torch.load(trained.out_dir / "checkpoint" / "state.pt", weights_only=True)
    b = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert same(a["model"], b["model"])
    assert all(same(a["optimizer"]["state"][k], b["optimizer"]["state"][k]) for k in a["optimizer"]["state"])


def test_refuses_other_target_and_corrupt_files(target, trained, tmp_path):
    other = tiny_target(seed=0, fingerprint="someone-else")
    with pytest.raises(UserError, match="was trained for target"):
        load_draft_lm(str(trained.out_dir), other)
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(trained.out_dir, bad, ignore=shutil.ignore_patterns("checkpoint"))
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    with pytest.raises(UserError, match="corrupt weights file"):
        load_draft_lm(str(bad), target)
    shard.write_bytes(b"not a safetensors file at all")
    with pytest.raises(UserError, match="corrupt weights file"):
        load_draft_lm(str(bad), target)


def test_save_drafter_shards_and_exclusions(target, trained, tmp_path):
    draft = load_draft_lm(str(trained.out_dir), target)
    state = {**draft.state_dict(), "vocab_rank": draft.vocab_rank}  # the target's (shared) embedding and head too
    save_drafter(tmp_path / "s", "draft-lm", draft.args.to_dict(), state, target, {"note": "test"},
                 max_shard_bytes=8000)
    files = sorted((tmp_path / "s").glob("*.safetensors"))
    assert len(files) > 1 and all(f.stat().st_size <= 8000 for f in files)
    assert json.loads((tmp_path / "s" / "drafter.json").read_text())["files"] == [f.name for f in files]
    assert same(weights(tmp_path / "s"), weights(trained.out_dir))
    reloaded = load_draft_lm(str(tmp_path / "s"), target)
    assert all(torch.equal(reloaded.state_dict()[k], draft.state_dict()[k]) for k in draft.state_dict())
    # renamed copies of the head are still excluded (same storage as the target's)
    save_drafter(tmp_path / "t", "x", {}, {"head": target.model.lm_head.weight, "w": torch.ones(3)}, target, {})
    assert set(weights(tmp_path / "t")) == {"w"}


def test_half_precision_target_trains(tmp_path):
    """A bf16 target (as on a GPU) trains fp32 master weights under autocast and saves bf16."""
    target = tiny_target(seed=3)
    target.model.to(torch.bfloat16)
    path = build_training_data(target, tmp_path / "d", n_prompts=6, max_new_tokens=16, seed=0, batch_size=6,
                               magpie_max_tokens=24, progress=False)
    res = draft_lm.train(target, TrainingData(path, target), tmp_path / "o", budget={**TINY, "steps": 4},
                         seed=0, progress=False)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.history)
    drafter = load_draft_lm(str(tmp_path / "o"), target)
    assert drafter.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def _write_hf_dir(target, folder) -> None:
    """The tiny target as a local HF directory, so the CLI can load it by path."""
    a = target.model.args
    cfg = {"model_type": "llama", "vocab_size": a.vocab_size, "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
           "intermediate_size": a.intermediate_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
           "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2, "hidden_act": "silu"}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in target.model.state_dict().items()}, folder / "model.safetensors")
    target.tokenizer.save_pretrained(folder)


def test_cli_tiny_end_to_end(target, tmp_path, monkeypatch):
    model_dir = tmp_path / "tiny-target"
    _write_hf_dir(target, model_dir)
    monkeypatch.setitem(BUDGETS, "tiny", {**TINY, "steps": 6, "ckpt_every": 3, "eval_every": 3})
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    argv = ["train", "--policy", "fixed-k", "--target", str(model_dir), "--budget", "tiny", "--device", "cpu",
            "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--no-progress"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    card = (tmp_path / "out" / "TRAINING.md").read_text()
    assert "fixed-k drafter" in card and "loss_curve.png" in card and "steps: 6" in card
    data_built = (tmp_path / "data" / "manifest.json").stat().st_mtime_ns
    with pytest.raises(UserError, match="--resume"):  # an existing run is never silently overwritten
        args.func(parser.parse_args(argv))
    assert args.func(parser.parse_args(argv + ["--resume"])) == 0
    assert (tmp_path / "data" / "manifest.json").stat().st_mtime_ns == data_built  # data reused
    monkeypatch.setitem(cli.TRAINERS, "fixed-k", "specbench.train.no_such_trainer")
    with pytest.raises(UserError, match="trainer for fixed-k not available yet"):
        args.func(parser.parse_args(argv))


def test_warm_start_from_a_trained_draft_lm(target, data, trained, tmp_path):
    """init: the run's first loss is the trained draft LM's (its stored weights, not the target's
    layers), the card names the source, and a draft LM of another depth is refused."""
    cont = draft_lm.train(target, data, tmp_path / "w", budget={**TINY, "steps": 4}, seed=0, progress=False,
                          init=str(trained.out_dir))
    scratch = draft_lm.train(target, data, tmp_path / "s", budget={**TINY, "steps": 4}, seed=0, progress=False)
    assert cont.history[0]["loss"] < scratch.history[0]["loss"]
    assert str(trained.out_dir) in cont.extra["warm start"]
    with pytest.raises(UserError, match="n_layers"):
        draft_lm.train(target, data, tmp_path / "d", budget={**TINY, "steps": 4, "lm_layers": 3}, seed=0,
                       progress=False, init=str(trained.out_dir))


def test_warm_start_keeps_the_init_token_ranking(target, data, trained, tmp_path):
    """A continued run keeps its init's token ranking (the reduced draft vocabulary fixed-K drafts from),
    as the EAGLE and DSpark warm starts keep theirs, instead of re-ranking by this run's data alone; a run
    from the target's layers ranks by its own training split."""
    import shutil
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(trained.out_dir, src)
    vocab = target.model.args.vocab_size
    other = torch.randperm(vocab, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        if "vocab_rank" in tensors:
            assert not torch.equal(tensors["vocab_rank"], other)
            save_file({**tensors, "vocab_rank": other}, shard, metadata={"format": "pt"})
    cont = draft_lm.train(target, data, tmp_path / "w", budget={**TINY, "steps": 2}, seed=0, progress=False,
                          init=str(src))
    assert torch.equal(weights(cont.out_dir)["vocab_rank"], other)
    scratch = draft_lm.train(target, data, tmp_path / "s", budget={**TINY, "steps": 2}, seed=0, progress=False)
    assert torch.equal(weights(scratch.out_dir)["vocab_rank"], weights(trained.out_dir)["vocab_rank"])
