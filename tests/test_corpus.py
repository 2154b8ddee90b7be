"""specbench.train.corpus: the committed token-id corpus — format, resume after SIGKILL (no shard
duplicated or lost), and a tiny end-to-end run corpus → features → train → load → decode."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specbench.engine.core import SamplingConfig, generate
from specbench.drafters.dspark import load_dspark_drafter
from specbench.errors import UserError
from specbench.policies.dspark import DSpark
from specbench.engine.policy import Policy
from specbench.train.common import get_budget
from specbench.train.corpus import build_corpus, features_from_corpus, parse_corpus_part, read_corpus, shard_name
from specbench.train.data import TrainingData
from specbench.train.dspark import train
from helpers import IM_END, tiny_target

TESTS = Path(__file__).resolve().parent
BUILD = dict(shard_prompts=6, max_new_tokens=16, batch_size=4, magpie_fraction=0.5, magpie_max_tokens=24,
             min_response_tokens=2, eval_texts=[], progress=False)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the subprocess uses one thread too: bit-identical shards
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def corpus(target, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("corpus") / "c"
    build_corpus(target, out, 10**9, max_shards=3, **BUILD)
    return out


def test_shards_hold_uint16_ids_masks_and_a_manifest(target, corpus):
    manifest, shards = read_corpus(corpus)
    assert [s["file"] for s in manifest["shards"]] == [shard_name(k) for k in range(3)]
    assert manifest["target"]["fingerprint"] == target.fingerprint
    totals = manifest["totals"]
    assert totals["n_shards"] == 3 and totals["n_response_tokens"] == sum(
        s["n_response_tokens"] for s in manifest["shards"]) > 0
    texts = []
    for shard, info in zip(shards, manifest["shards"]):
        assert shard["token_ids"].dtype == np.uint16
        offs, plen = shard["seq_offsets"], shard["prompt_lengths"]
        assert offs[0] == 0 and offs[-1] == len(shard["token_ids"]) and np.all(np.diff(offs) > plen)
        assert info["n_response_tokens"] == int(offs[-1] - plen.sum()) and info["dtype"] == "float32"
        texts += [t for _, t in shard["prompts"]]
        # each sequence starts with its prompt as the chat template renders it
        ids = shard["token_ids"][offs[0]:offs[1]].tolist()
        text = shard["prompts"][int(shard["prompt_index"][0])][1]
        prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        assert ids[: plen[0]] == list(prompt)
    assert len(texts) == len(set(texts)), "a prompt appears in two shards"
    assert {"magpie", "seed:code"} & set(totals["prompt_sources"])
    assert "mix" not in manifest["settings"]  # the general mix keeps the key corpora had before mixes


@pytest.fixture(scope="module")
def code_corpus(target, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("code") / "c"
    build_corpus(target, out, 10**9, max_shards=2, mix="code", **BUILD)
    return out


def test_the_code_mix_asks_the_programmer_and_the_standard_library(target, corpus, code_corpus):
    manifest, shards = read_corpus(code_corpus)
    assert manifest["settings"]["mix"] == "code" and manifest["settings"]["python"] == "%d.%d" % sys.version_info[:2]
    assert manifest["build_key"] != read_corpus(corpus)[0]["build_key"]
    sources = [source for shard in shards for source, _ in shard["prompts"]]
    assert set(sources) <= {"magpie:1", "stdlib:code", "seed:code"} and "stdlib:code" in sources
    texts = [text for shard in shards for _, text in shard["prompts"]]
    assert len(texts) == len(set(texts)) == BUILD["shard_prompts"] * 2
    stdlib = [t for s, t in zip(sources, texts) if s == "stdlib:code"]
    assert all("def " in t or "Write a Python function" in t for t in stdlib)
    with pytest.raises(UserError, match="unknown corpus mix"):
        build_corpus(target, code_corpus, 10**9, max_shards=1, **{**BUILD, "mix": "poetry"})


def test_third_party_requests_follow_the_standard_library(target, tmp_path, monkeypatch):
    """Once the standard library's requests are used up, the code mix asks for functions of the
    installed packages, records their versions with each shard, and continues as before."""
    from specbench.train import corpus as corpus_module
    from specbench.train.data import package_code_prompts

    few_stdlib = corpus_module.stdlib_code_prompts(0)[:2]
    monkeypatch.setattr(corpus_module, "stdlib_code_prompts", lambda seed: few_stdlib)
    monkeypatch.setattr(corpus_module, "package_code_prompts",
                        lambda seed: package_code_prompts(seed, packages=("mpmath",)))
    out = tmp_path / "c"
    build_corpus(target, out, 10**9, max_shards=2, mix="code", **BUILD)
    manifest, shards = read_corpus(out)
    prompts = [p for shard in shards for p in shard["prompts"]]
    assert [t for s, t in prompts if s == "stdlib:code"] == [t for _, t in few_stdlib]
    from_packages = [t for s, t in prompts if s == "package:code"]
    assert from_packages and all("def " in t or "Write a Python function" in t for t in from_packages)
    assert all(s["packages"]["mpmath"] for s in manifest["shards"])
    assert manifest["totals"]["prompt_sources"]["package:code"] == len(from_packages)


def test_package_requests_are_reproducible_capped_and_interleaved(monkeypatch):
    from specbench.train.data import package_code_prompts, package_versions

    one = package_code_prompts(0, packages=("mpmath", "no_such_package_here"), cap=50)
    assert one == package_code_prompts(0, packages=("mpmath",), cap=50) and len(one) == 50
    assert one != package_code_prompts(1, packages=("mpmath",), cap=50)
    assert all(source == "package:code" and '"""' not in text.split("```python")[0] for source, text in one)
    everything = package_code_prompts(0, packages=("mpmath",), cap=10**6)  # ifac's memo table is left out
    assert everything and max(len(text) for _, text in everything) < 1200
    # a function more or less (another version of the package) moves no other request
    from specbench.train import data as data_module
    monkeypatch.setattr(data_module, "MAX_PACKAGE_SIGNATURE", 60)
    fewer = package_code_prompts(0, packages=("mpmath",), cap=10**6)
    assert 0 < len(fewer) < len(everything) and [p for p in everything if p in fewer] == fewer
    assert package_versions(("mpmath", "no_such_package_here"))["no_such_package_here"] is None
    # in turn from each package: no run of one package's requests while the other has some left
    both = package_code_prompts(0, packages=("mpmath", "networkx"), cap=20)
    assert len(both) == 40 and both[:20:2] == package_code_prompts(0, packages=("mpmath",), cap=20)[:10]


def test_features_from_several_corpus_parts(target, corpus, code_corpus, tmp_path):
    """A range of one corpus' shards and a whole second corpus, in that order, as one training set."""
    data = TrainingData(features_from_corpus(target, [f"{corpus}[1:3]", str(code_corpus)], tmp_path / "f", [0, 1],
                                             progress=False), target)
    general, general_shards = read_corpus(corpus)
    code, code_shards = read_corpus(code_corpus)
    assert len(data) == sum(s["n_sequences"] for s in general["shards"][1:3]) + code["totals"]["n_sequences"]
    first, last = data.sequence(0)["input_ids"], data.sequence(len(data) - 1)["input_ids"]
    offs = general_shards[1]["seq_offsets"]
    assert first.tolist() == general_shards[1]["token_ids"][offs[0]:offs[1]].astype(int).tolist()
    offs = code_shards[-1]["seq_offsets"]
    assert last.tolist() == code_shards[-1]["token_ids"][offs[-2]:offs[-1]].astype(int).tolist()
    used = data.manifest["generation"]["corpora"]
    assert [(u["build_key"], u["shards"]) for u in used] == [(general["build_key"], [1, 3]), (code["build_key"], [0, 2])]
    assert parse_corpus_part("a/b[66:]") == (Path("a/b"), 66, None) and parse_corpus_part("a/b") == (Path("a/b"), 0, None)
    with pytest.raises(UserError, match="empty shard range"):
        parse_corpus_part("a[3:3]")
    with pytest.raises(UserError, match="only 3 shards"):
        features_from_corpus(target, [f"{corpus}[5:]"], tmp_path / "g", [0, 1], progress=False)


def test_grows_resumes_and_refuses_other_settings(target, corpus, tmp_path):
    copy = tmp_path / "c"
    copy.mkdir()
    for p in corpus.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    kept = (copy / shard_name(0)).stat().st_mtime_ns
    # killed after the rename, before the manifest listed the shard: adopted, not redone
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:2]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / ".shard-00003.safetensors.k1ll3d.tmp").write_bytes(b"half")  # a shard killed mid-write
    build_corpus(target, copy, 10**9, max_shards=1, **BUILD)
    assert (copy / shard_name(0)).stat().st_mtime_ns == kept
    assert not list(copy.glob(".*.tmp"))
    grown, shards = read_corpus(copy)
    assert grown["totals"]["n_shards"] == 4
    assert [s["sha256"] for s in grown["shards"][:3]] == [s["sha256"] for s in read_corpus(corpus)[0]["shards"]]
    with pytest.raises(UserError, match="other settings"):
        build_corpus(target, copy, 10**9, max_shards=1, **{**BUILD, "max_new_tokens": 12})
    (copy / shard_name(1)).write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt"):
        read_corpus(copy)


KILLED_RUN = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    import specbench.train.corpus as corpus
    import specbench.train.generation_pool as pool
    from helpers import tiny_target
    real_generate, calls = pool.generate, [0]
    def announcing_generate(*a, **kw):
        calls[0] += 1
        print("generate", calls[0], flush=True)
        if calls[0] == {hang_at}:
            time.sleep(600)  # the parent SIGKILLs us here, in the middle of a shard
        return real_generate(*a, **kw)
    pool.generate = announcing_generate
    corpus.build_corpus(tiny_target(), {out!r}, 10**9, max_shards=3, **{build!r})
""")


def test_sigkill_mid_shard_then_rerun_loses_and_duplicates_nothing(target, corpus, tmp_path):
    out = tmp_path / "killed"
    build = {k: v for k, v in BUILD.items()}
    # generate() calls per shard: magpie batches, then response batches; hang in shard 2's.
    per_shard = _generate_calls_per_shard(target, tmp_path / "count")
    hang_at = per_shard[0] + per_shard[1] + 1
    script = KILLED_RUN.format(tests=str(TESTS), out=str(out), build=build, hang_at=hang_at)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.strip() == f"generate {hang_at}":
                break
        time.sleep(0.5)
        assert proc.poll() is None, "the build finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    partial = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in partial["shards"]] == [shard_name(0), shard_name(1)]
    build_corpus(target, out, 10**9, max_shards=1, **BUILD)  # the rerun
    resumed, got = read_corpus(out)
    _, reference = read_corpus(corpus)
    assert [s["file"] for s in resumed["shards"]] == [shard_name(k) for k in range(3)]
    # the same shards as an uninterrupted build, in content (the safetensors header orders its
    # metadata differently from one process to the next, so file hashes differ)
    for a, b in zip(got, reference):
        assert a["prompts"] == b["prompts"]
        assert all(np.array_equal(a[name], b[name]) for name in a if name != "prompts")


def _generate_calls_per_shard(target, out) -> list[int]:
    import specbench.train.generation_pool as pool_module

    counts, real = [], pool_module.generate

    def counting(*a, **kw):
        counts[-1] += 1
        return real(*a, **kw)

    pool_module.generate = counting
    try:
        for k in range(2):
            counts.append(0)
            build_corpus(target, out, 10**9, max_shards=1, **BUILD)
    finally:
        pool_module.generate = real
    return counts


def test_corpus_to_drafter_end_to_end(target, corpus, tmp_path):
    """corpus → recomputed features → a tiny-budget DSpark drafter → loaded → lossless decode."""
    data_dir = features_from_corpus(target, corpus, tmp_path / "features", [0, 1, 2], progress=False)
    data = TrainingData(data_dir, target)
    manifest, shards = read_corpus(corpus)
    assert len(data) == manifest["totals"]["n_sequences"]
    first = data.sequence(0)
    assert first["input_ids"].tolist() == shards[0]["token_ids"][: len(first["input_ids"])].astype(int).tolist()
    assert int(first["loss_mask"].sum()) == len(first["input_ids"]) - int(shards[0]["prompt_lengths"][0])
    mtime = (data_dir / "features-00000.safetensors").stat().st_mtime_ns
    features_from_corpus(target, corpus, data_dir, [0, 1, 2], progress=False)  # kept, not recomputed
    assert (data_dir / "features-00000.safetensors").stat().st_mtime_ns == mtime

    budget = get_budget("tiny", anchors=8, block_size=4, markov_rank=8, steps=20)
    train(target, data, tmp_path / "dspark", budget=budget, seed=0, policy="dspark", progress=False)
    drafter = load_dspark_drafter(str(tmp_path / "dspark"), target)
    prompts = [shards[0]["token_ids"][: int(shards[0]["prompt_lengths"][0])].astype(int).tolist()] * 2
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.0)
    ar = generate(target.model, Policy(), prompts, cfg, [IM_END])
    spec = generate(target.model, DSpark(drafter, scheduler="fixed"), prompts, cfg, [IM_END])
    assert [r.output_ids for r in spec.requests] == [r.output_ids for r in ar.requests]
    assert sum(r.drafted for r in spec.requests) > 0


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-code"])
def test_committed_corpus_overlaps_no_evaluation_workload(name):
    """Every prompt of a shipped corpus against every turn of the evaluation workloads
    (code, chat, math and the held-out set): no shared word 8-gram, no identical text."""
    from specbench.train.data import EvalOverlap, eval_prompt_texts

    manifest, shards = read_corpus(TESTS.parent / "corpus" / name)
    overlap = EvalOverlap(eval_prompt_texts())
    prompts = [text for shard in shards for _, text in shard["prompts"]]
    assert len(prompts) == manifest["totals"]["n_prompts"] > 0
    assert [p for p in prompts if overlap.overlaps(p)] == []
    assert len(set(prompts)) == len(prompts)


def test_worker_processes_write_the_same_shards(target, corpus, tmp_path):
    """--workers 2: the Magpie rounds and response groups decoded by two one-thread processes give
    the same shards as the one-process build (the `corpus` fixture): the same prompts, token ids,
    offsets and masks. (Not the same file hash: safetensors writes its metadata keys in an order
    that changes from process to process.)"""
    out = tmp_path / "c"
    build_corpus(target, out, 10**9, max_shards=2, workers=2, **BUILD)
    manifest, shards = read_corpus(out)
    reference, reference_shards = read_corpus(corpus)
    assert len(shards) == 2
    for got, want in zip(shards, reference_shards):
        assert set(got) == set(want)
        for key in want:
            assert (got[key] == want[key]) if isinstance(want[key], list) else np.array_equal(got[key], want[key]), key
    assert [s["prompt_sources"] for s in manifest["shards"]] == [s["prompt_sources"] for s in reference["shards"][:2]]
    assert all(s["workers"] == 2 and s["threads"] == 1 for s in manifest["shards"])
