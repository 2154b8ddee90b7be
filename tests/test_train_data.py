"""specbench.train.data: prompts, responses, loss masks, feature shards, resume, reader (tiny models)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specbench.engine.core import forward_new_tokens
from specbench.errors import UserError
from specbench.train.data import (ChatFormat, EvalOverlap, PromptFilter, TrainingData, build_training_data,
                                  default_tap_layers, eval_prompt_texts, seed_prompts)
from helpers import IM_END, IM_START, one_thread, tiny_target, tiny_tokenizer  # noqa: F401 (one_thread: autouse fixture)


BUILD = dict(n_prompts=12, max_new_tokens=20, seed=0, batch_size=4, shard_size=5, magpie_max_tokens=40,
             progress=False)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def built(target, tmp_path_factory):
    return build_training_data(target, tmp_path_factory.mktemp("data") / "d", **BUILD)


def test_default_tap_layers():
    assert default_tap_layers(30) == [1, 14, 27]
    assert default_tap_layers(32) == [1, 15, 29]
    for n in (1, 2, 3, 4, 6):
        taps = default_tap_layers(n)
        assert taps and all(0 <= i < n for i in taps)


def test_chat_format_pieces():
    fmt = ChatFormat(tiny_tokenizer())
    assert fmt.user_header_ids() == [IM_START, 4, 8, 9, IM_END, IM_START, 5]  # default system, then "user"
    assert fmt.user_header_ids("w20")[:3] == [IM_START, 4, 27]
    assert fmt.user_stop_ids == [IM_END]
    assert fmt.prompt_ids("w3") == fmt.user_header_ids() + [10, IM_END, IM_START, 6]
    assert fmt.decode([10, 11, IM_END]) == "w3 w4"


def test_build_shapes_masks_offsets(target, built):
    manifest = json.loads((built / "manifest.json").read_text())
    data = TrainingData(built, target)
    records = [json.loads(line) for line in (built / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == BUILD["n_prompts"]
    assert manifest["target"]["fingerprint"] == target.fingerprint
    assert manifest["tap_layers"] == default_tap_layers(4) == data.tap_layers
    assert len(manifest["shards"]) == 3  # 12 prompts, 5 per shard
    assert manifest["n_sequences"] == len(data) > 0
    assert manifest["n_tokens"] == data.n_tokens
    assert set(manifest["prompt_sources"]) <= {"magpie", "seed:code", "seed:chat", "seed:math"}
    fmt = ChatFormat(target.tokenizer)
    model = target.model
    taps = tuple(data.tap_layers)
    n_loss = 0
    seen_prompts = set()
    for shard in manifest["shards"]:
        from safetensors.torch import load_file
        t = load_file(built / shard["file"])
        assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
        assert t["taps"].dtype == t["last_hidden"].dtype == torch.bfloat16
        assert t["taps"].shape == (len(t["input_ids"]), len(taps) * 32)
        assert t["last_hidden"].shape == (len(t["input_ids"]), 32)
        assert t["seq_offsets"][0] == 0 and t["seq_offsets"][-1] == len(t["input_ids"])
        assert len(t["prompt_index"]) == len(t["seq_offsets"]) - 1
        seen_prompts |= set(t["prompt_index"].tolist())
    for i in range(len(data)):
        s = data[i]
        mask = s["loss_mask"].long()
        n_prompt = int((mask == 0).sum())
        assert mask[:n_prompt].sum() == 0 and mask[n_prompt:].all()  # prompt then response
        n_resp = len(mask) - n_prompt
        assert 10 <= n_resp <= BUILD["max_new_tokens"]  # min_loss_tokens = min(14, 20 // 2)
        ids = s["input_ids"].tolist()
        assert ids[n_prompt - 2:n_prompt] == [IM_START, 6]  # generation prompt "<|im_start|>assistant"
        if n_resp < BUILD["max_new_tokens"]:
            assert ids[-1] == IM_END  # stopped at EOS, which is supervised
        assert IM_END not in ids[n_prompt:-1]
        n_loss += n_resp
        # the features are the target's own, at every position
        model.setup_cache(1, 128)
        _, tapped, hidden = forward_new_tokens(model, s["input_ids"][None], torch.zeros(1, dtype=torch.long), taps)
        torch.testing.assert_close(s["taps"].float(), tapped[0].to(torch.bfloat16).float())
        torch.testing.assert_close(s["last_hidden"].float(), hidden[0].to(torch.bfloat16).float())
    assert manifest["n_loss_tokens"] == n_loss
    # the prompt of every kept sequence renders through the chat template to its prompt ids
    by_index = {r["index"]: r["text"] for r in records}
    shard0 = TrainingData(built)
    from safetensors.torch import load_file
    t0 = load_file(built / manifest["shards"][0]["file"])
    first = int(t0["prompt_index"][0])
    n_prompt0 = int((shard0[0]["loss_mask"] == 0).sum())
    assert shard0[0]["input_ids"][:n_prompt0].tolist() == fmt.prompt_ids(by_index[first])
    assert seen_prompts <= set(by_index)


def test_build_is_resumable_and_deterministic(target, built, tmp_path):
    copy = tmp_path / "d"
    shutil.copytree(built, copy)
    (copy / "manifest.json").unlink()
    (copy / "features-00001.safetensors").unlink()
    kept = copy / "features-00000.safetensors"
    mtime = kept.stat().st_mtime_ns
    build_training_data(target, copy, **BUILD)
    assert kept.stat().st_mtime_ns == mtime  # finished shards are not redone
    assert json.loads((copy / "manifest.json").read_text())["n_sequences"] == len(TrainingData(built))
    from safetensors.torch import load_file
    a, b = load_file(built / "features-00001.safetensors"), load_file(copy / "features-00001.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # redone bit-identically
    # a finished directory is reused as is; other settings in it are refused
    assert build_training_data(target, copy, **BUILD) == copy
    with pytest.raises(UserError, match="other settings"):
        build_training_data(target, copy, **{**BUILD, "max_new_tokens": 30})
    # a half-written shard (killed mid-write elsewhere) is redone, not trusted
    (copy / "manifest.json").unlink()
    (copy / "features-00002.safetensors").write_bytes(b"garbage")
    build_training_data(target, copy, **BUILD)
    a, b = load_file(built / "features-00002.safetensors"), load_file(copy / "features-00002.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_reader_split_batch_and_refusals(target, built, tmp_path):
    data = TrainingData(built, target)
    train, val = data.split(0.2, seed=0)
    assert sorted(train + val) == list(range(len(data))) and not set(train) & set(val) and val
    assert (train, val) == data.split(0.2, seed=0)
    assert data.split(0.0) == (list(range(len(data))), [])
    batch = data.batch([0, 1], ("input_ids", "loss_mask", "taps"))
    t = int(batch["lengths"].max())
    assert batch["input_ids"].shape == (2, t) and batch["taps"].shape == (2, t, 32)
    short = int(batch["lengths"].argmin())
    assert not batch["loss_mask"][short, batch["lengths"][short]:].any()
    with pytest.raises(UserError, match="built for target"):
        TrainingData(built, tiny_target(seed=1))
    with pytest.raises(UserError, match="no manifest"):
        TrainingData(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(built, broken)
    (broken / "features-00001.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(UserError, match="corrupt"):
        TrainingData(broken)


def test_prompts_do_not_overlap_eval_workloads(built):
    overlap = EvalOverlap(eval_prompt_texts())
    assert overlap.count >= 164 + 80
    records = [json.loads(line) for line in (built / "prompts.jsonl").read_text().splitlines()]
    assert not any(overlap.overlaps(r["text"]) for r in records)
    seeds = seed_prompts(1500, seed=0)
    assert seeds == seed_prompts(1500, seed=0) and len({t for _, t in seeds}) == 1500
    assert {s for s, _ in seeds} == {"seed:code", "seed:chat", "seed:math"}
    assert not any(overlap.overlaps(t) for _, t in seeds)
    # the check catches eval prompts, lightly edited ones included
    from specbench.bench.workloads import load_workload
    mt = load_workload("chat").requests[0].turns[0]
    he = load_workload("code").requests[5].turns[0]
    assert overlap.overlaps(mt) and overlap.overlaps("Please help: " + mt.upper())
    assert overlap.overlaps(he.replace("Write a solution", "Write code"))


def test_prompt_filter_rejections():
    f = PromptFilter(EvalOverlap(["Compose an engaging travel blog post about a recent trip to Hawaii today"]))
    assert f.accept("Write a Python function that merges two sorted lists into one sorted list.")
    assert not f.accept("write a python function that merges two sorted lists into one sorted list")  # duplicate
    assert not f.accept("Write a Python function that merges two sorted lists into one sorted list, please.")
    assert f.accept("Explain photosynthesis to a ten-year-old.")
    assert not f.accept("hi")  # too short
    assert not f.accept("the cat the cat the cat the cat the cat the cat")  # degenerate
    assert not f.accept("Could you compose an engaging travel blog post about a recent trip to Hawaii?")
    assert f.rejected == {"duplicate": 1, "near_duplicate": 1, "degenerate": 2, "eval_overlap": 1}


@pytest.mark.model
def test_chat_format_smollm2(default_model):
    fmt = ChatFormat(default_model.tokenizer)
    tok = default_model.tokenizer
    assert tok.decode(fmt.user_header_ids()).endswith("<|im_end|>\n<|im_start|>user\n")
    assert fmt.user_stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(fmt.prompt_ids("Hello")).endswith("user\nHello<|im_end|>\n<|im_start|>assistant\n")
