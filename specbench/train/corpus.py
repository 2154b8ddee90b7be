"""The self-distillation corpus: the target's own answers to prompts that overlap no evaluation
workload, stored as token ids in small committed shards.

Why token ids only: the target's features (taps, last hidden state) for a sequence are a pure
function of its ids, so training recomputes them (`features_from_corpus`, one prefill per
sequence, cached outside the repository) instead of committing gigabytes. Ids are uint16 (the
default target's vocabulary has 49 152 entries; a larger vocabulary is refused).

Prompts, per shard (never overlapping an evaluation workload; see specbench/train/data.py)
    * Magpie-style user turns the target writes itself: its chat template's user-turn header
      after a system turn, sampled at T = 1, top-p 0.95 (`magpie_prompts`);
    * the seed topics of `seed_prompts` (code / chat / math requests from templates);
    * every prompt passes `PromptFilter`: degenerate, duplicate, near-duplicate (against every
      earlier prompt of the corpus, earlier shards included) and evaluation-overlap checks.

Responses: the target through `specbench.engine.core.generate` and the AR policy, DeepSpec's
non-thinking recipe (temperature 0.7, top-p 0.8; the suite's sampler has no top-k 20, so that
one cut is not applied), up to `max_new_tokens`, stopping at EOS. The loss mask is the response
part of each sequence (assistant tokens incl. the generated end-of-turn), derivable from
`prompt_lengths`.

Layout of a corpus directory
    manifest.json           settings, per-shard counts / sha256 / dtype / device / seconds, totals
    shard-00000.safetensors token_ids uint16 [T]    prompt ids then response ids, per sequence
                            seq_offsets int64 [S+1] sequence s is token_ids[offsets[s]:offsets[s+1]]
                            prompt_lengths int32 [S]
                            finished_eos uint8 [S]  1 when the response ended on an EOS id
                            metadata: format, build_key, shard, prompts (JSON [[source, text]],
                            every prompt the filter accepted for this shard, kept or not)

Shard k's content depends only on the settings, k and the prompts accepted in shards < k, so
a killed build resumes exactly where it stopped: a shard is written to a temp file and renamed,
then the manifest is rewritten; a shard file the manifest does not list yet (killed between the
two) is adopted if its build key and index match. A rerun never duplicates or loses a shard.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from specbench.engine.core import SamplingConfig
from specbench import atomic
from specbench.bench.envinfo import device_name
from specbench.errors import UserError
from specbench.train.generation_pool import GenerationPool
from specbench.train.data import (
    MAGPIE_SAMPLING,
    MAGPIE_SYSTEMS,
    RESPONSE_SAMPLING,
    EVAL_WORKLOADS,
    SEED_WEIGHTS,
    ChatFormat,
    EvalOverlap,
    PromptFilter,
    derive_seed,
    magpie_prompts,
    eval_prompt_texts,
    seed_prompts,
    package_code_prompts,
    package_versions,
    stdlib_code_prompts,
)

FORMAT = 1
CORPUS_MIXES = ("general", "code")
UINT16_VOCAB = 1 << 16


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_shard(path: Path, build_key: str, k: int) -> dict | None:
    """The shard's arrays and prompts, or None when it is missing, corrupt or from another build."""
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            if meta.get("build_key") != build_key or meta.get("shard") != str(k):
                return None
            arrays = {name: f.get_tensor(name) for name in
                      ("token_ids", "seq_offsets", "prompt_lengths", "finished_eos", "prompt_index")}
            prompts = [tuple(p) for p in json.loads(meta["prompts"])]
    except (SafetensorError, OSError, KeyError, ValueError):
        return None
    if len(arrays["seq_offsets"]) != len(arrays["prompt_lengths"]) + 1:
        return None
    return {**arrays, "prompts": prompts}


def _shard_summary(path: Path, shard: dict, seconds: float, dtype: str, device: str) -> dict:
    offs, plen = shard["seq_offsets"], shard["prompt_lengths"]
    n_tok = int(offs[-1])
    return {
        "file": path.name, "sha256": _sha256(path),
        "n_prompts": len(shard["prompts"]), "n_sequences": len(plen),
        "n_tokens": n_tok, "n_response_tokens": n_tok - int(plen.sum()),
        "n_finished_eos": int(shard["finished_eos"].sum()),
        "prompt_sources": dict(Counter("magpie" if s.startswith("magpie") else s for s, _ in shard["prompts"])),
        "seconds": round(seconds, 1), "dtype": dtype, "device": device,
    }


def build_corpus(
    target,
    out_dir,
    target_response_tokens: int,
    *,
    shard_prompts: int = 256,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    seed: int = 0,
    magpie_fraction: float = 0.6,
    magpie_max_tokens: int = 96,
    min_response_tokens: int = 8,
    temperature: float = RESPONSE_SAMPLING["temperature"],
    top_p: float = RESPONSE_SAMPLING["top_p"],
    eval_texts: Sequence[str] | None = None,
    on_shard: Callable[[Path, dict], None] | None = None,
    max_shards: int | None = None,
    progress: bool = True,
    workers: int = 1,
    mix: str = "general",
) -> dict:
    """Add shards to the corpus in `out_dir` until it holds `target_response_tokens` response
    tokens (or `max_shards` new shards were written); returns the manifest. `on_shard(path,
    manifest)` runs after each shard is in place and listed (e.g. to commit it). workers > 1:
    the shard's independently seeded batches (Magpie rounds, response groups) are decoded by that
    many one-thread processes at once (train/generation_pool.py); the shards do not change.

    mix "general": Magpie turns under all of `MAGPIE_SYSTEMS`, then the seed topics (code, chat,
    math). mix "code": Magpie turns under the programmer system prompt only, then
    function-writing requests from the standard library's signatures and docstrings
    (`stdlib_code_prompts`), then the same kind of requests from installed third-party packages
    (`package_code_prompts`; their versions are recorded with each shard), then the seed topics'
    code requests."""
    model = target.model
    if mix not in CORPUS_MIXES:
        raise UserError(f"unknown corpus mix {mix!r} (choose from {', '.join(CORPUS_MIXES)})")
    if model.args.vocab_size > UINT16_VOCAB:
        raise UserError(f"the corpus stores uint16 token ids; {target.name} has {model.args.vocab_size} tokens")
    if min(target_response_tokens, shard_prompts, max_new_tokens, batch_size) < 1:
        raise UserError("target tokens, shard size, max new tokens and batch size must be positive")
    if not 0.0 <= magpie_fraction <= 1.0:
        raise UserError(f"the Magpie fraction must be between 0 and 1, not {magpie_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # What determines the content. Device, dtype, batch size and threads are recorded per shard,
    # not keyed: a corpus may be continued on another machine.
    settings = {
        "format": FORMAT, "target_name": target.name, "target_fingerprint": target.fingerprint,
        "seed": seed, "shard_prompts": shard_prompts, "max_new_tokens": max_new_tokens,
        "magpie_fraction": magpie_fraction, "magpie_max_tokens": magpie_max_tokens,
        "min_response_tokens": min_response_tokens, "temperature": temperature, "top_p": top_p,
    }
    if mix != "general":  # keyed only when set, so corpora built before mixes existed keep their key
        # the standard library's functions, hence the prompts, differ between Python versions
        settings.update({"mix": mix, "python": "%d.%d" % sys.version_info[:2]})
    build_key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    manifest_file = out / "manifest.json"
    manifest = None
    if manifest_file.is_file():
        try:
            manifest = json.loads(manifest_file.read_text())
        except ValueError as e:
            raise UserError(f"{manifest_file}: corrupt manifest: {e}") from None
        if manifest.get("build_key") != build_key:
            diff = sorted(k for k in settings if manifest.get("settings", {}).get(k) != settings[k])
            raise UserError(f"{out} holds a corpus built with other settings ({', '.join(diff)}); "
                            "pass another directory")
    if manifest is None:
        manifest = {"format": FORMAT, "build_key": build_key, "settings": settings,
                    "target": {"name": target.name, "fingerprint": target.fingerprint,
                               "vocab_size": model.args.vocab_size},
                    "generation": {"engine": "specbench.engine.core.generate, AR policy",
                                   "response_sampling": {"temperature": temperature, "top_p": top_p,
                                                         "top_k": None},
                                   "magpie_sampling": MAGPIE_SAMPLING, "magpie_system_prompts": MAGPIE_SYSTEMS},
                    "overlap_check": {"workloads": ", ".join(EVAL_WORKLOADS) if eval_texts is None else "caller-supplied"},
                    "shards": []}

    fmt = ChatFormat(target.tokenizer)
    overlap = EvalOverlap(list(eval_texts) if eval_texts is not None else eval_prompt_texts())
    manifest["overlap_check"]["eval_texts"] = overlap.count
    pfilter = PromptFilter(overlap)
    # Replay the prompts of the shards already built, so the filter's state (near duplicates
    # across the corpus) is what an uninterrupted build would have; adopt an unlisted shard.
    listed = {s["file"] for s in manifest["shards"]}
    k = 0
    while True:
        path = out / shard_name(k)
        shard = _read_shard(path, build_key, k) if path.is_file() else None
        if shard is None:
            break
        for _, text in shard["prompts"]:
            pfilter.remember(text)
        if path.name not in listed:
            manifest["shards"].append(_shard_summary(path, shard, float("nan"), "unknown", "unknown"))
        k += 1
    manifest["shards"] = manifest["shards"][:k]
    for stale in out.glob(".*.tmp"):  # temp files of a build killed mid-write (atomic.replacing)
        stale.unlink()

    dtype = str(model.lm_head.weight.dtype).replace("torch.", "")
    device = str(model.device)
    eos = list(target.eos_token_ids)
    done_tokens = sum(s["n_response_tokens"] for s in manifest["shards"])
    bar = tqdm(total=target_response_tokens, initial=min(done_tokens, target_response_tokens),
               desc="corpus response tokens", unit="tok", disable=not progress)
    written = 0
    pool = GenerationPool(model, workers)
    systems = [1] if mix == "code" else None  # MAGPIE_SYSTEMS[1]: the programmer
    packages = package_versions() if mix == "code" else None
    stdlib = stdlib_code_prompts(seed) if mix == "code" else []
    third_party: list[tuple[str, str]] = []

    def fillers():
        yield from stdlib
        if mix == "code":
            if not third_party:  # built on first need: importing the packages' modules takes ~15 s
                third_party.extend(package_code_prompts(seed))
            yield from third_party
    try:
        while done_tokens < target_response_tokens and (max_shards is None or written < max_shards):
            t0 = time.time()
            n_magpie = round(shard_prompts * magpie_fraction)
            prompts, _ = magpie_prompts(target, fmt, n_magpie, derive_seed(seed, "corpus", k), batch_size,
                                         magpie_max_tokens, pfilter, progress, pool=pool, systems=systems)
            seeds = seed_prompts(8 * (shard_prompts - len(prompts)) + 64, derive_seed(seed, "seeds", k),
                                 weights=(1.0, 0.0, 0.0) if mix == "code" else SEED_WEIGHTS)
            # fillers already taken by earlier shards are rejected as duplicates by the filter
            for source, text in itertools.chain(fillers(), seeds):
                if len(prompts) >= shard_prompts:
                    break
                if pfilter.accept(text):
                    prompts.append((source, text))
            if not prompts:
                raise UserError(f"no new prompt passed the filters for shard {k}; the prompt sources are exhausted")
            prompt_ids = [fmt.prompt_ids(text) for _, text in prompts]
            order = sorted(range(len(prompts)), key=lambda i: (len(prompt_ids[i]), i))
            seqs: dict[int, tuple[list[int], bool]] = {}
            groups = [order[j:j + batch_size] for j in range(0, len(order), batch_size)]
            jobs = [([prompt_ids[i] for i in group],
                     SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    seed=derive_seed(seed, "responses", k, j * batch_size)), eos)
                    for j, group in enumerate(groups)]
            for group, outputs in zip(groups, pool.generate(jobs)):
                for i, (ids, finish) in zip(group, outputs):
                    if len(ids) >= min_response_tokens:
                        seqs[i] = (ids, finish == "eos")
                bar.update(sum(len(ids) for ids, _ in outputs if len(ids) >= min_response_tokens))
            kept = sorted(seqs)
            token_ids = [t for i in kept for t in prompt_ids[i] + seqs[i][0]]
            offsets = np.cumsum([0] + [len(prompt_ids[i]) + len(seqs[i][0]) for i in kept]).astype(np.int64)
            arrays = {
                "token_ids": np.asarray(token_ids, dtype=np.uint16),
                "seq_offsets": offsets,
                "prompt_lengths": np.asarray([len(prompt_ids[i]) for i in kept], dtype=np.int32),
                "finished_eos": np.asarray([seqs[i][1] for i in kept], dtype=np.uint8),
                "prompt_index": np.asarray(kept, dtype=np.int32),
            }
            path = out / shard_name(k)
            with atomic.replacing(path) as tmp:
                save_file(arrays, str(tmp), metadata={"format": f"specbench-corpus-{FORMAT}", "build_key": build_key,
                                                      "shard": str(k), "prompts": json.dumps(prompts)})
            shard = _read_shard(path, build_key, k)
            summary = _shard_summary(path, shard, time.time() - t0, dtype, device)
            summary.update({"batch_size": batch_size, "threads": 1 if pool.workers > 1 else torch.get_num_threads(),
                            "workers": pool.workers, "cpu": device_name(model.device)})
            if packages is not None:
                summary["packages"] = packages  # the package requests depend on their versions
            manifest["shards"].append(summary)
            _write_manifest(manifest_file, manifest)
            done_tokens += summary["n_response_tokens"]
            written += 1
            k += 1
            if on_shard is not None:
                on_shard(path, manifest)
    finally:
        pool.close()
    bar.close()
    _write_manifest(manifest_file, manifest)
    return manifest


def _write_manifest(path: Path, manifest: dict) -> None:
    shards = manifest["shards"]
    manifest["totals"] = {key: sum(s[key] for s in shards) for key in
                          ("n_prompts", "n_sequences", "n_tokens", "n_response_tokens", "n_finished_eos")}
    manifest["totals"]["n_shards"] = len(shards)
    manifest["totals"]["generation_s"] = round(sum(s["seconds"] for s in shards if s["seconds"] == s["seconds"]), 1)
    sources: Counter = Counter()
    for s in shards:
        sources.update(s["prompt_sources"])
    manifest["totals"]["prompt_sources"] = dict(sorted(sources.items()))
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic.write_text(path, json.dumps(manifest, indent=1) + "\n")


def read_corpus(path) -> tuple[dict, list[dict]]:
    """(manifest, shards) of a corpus directory; each shard's arrays as numpy (checked against
    the manifest's sha256)."""
    path = Path(path)
    mf = path / "manifest.json"
    if not mf.is_file():
        raise UserError(f"{path}: no manifest.json (not a corpus directory)")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError as e:
        raise UserError(f"{mf}: corrupt manifest: {e}") from None
    shards = []
    for k, s in enumerate(manifest["shards"]):
        p = path / s["file"]
        shard = _read_shard(p, manifest["build_key"], k) if p.is_file() else None
        if shard is None or _sha256(p) != s["sha256"]:
            raise UserError(f"{p}: missing, corrupt or not the shard the manifest lists")
        shards.append(shard)
    return manifest, shards


def parse_corpus_part(spec: str) -> tuple[Path, int, int | None]:
    """"DIR" or "DIR[START:END]" (a Python slice of the corpus' shards, either end optional)
    -> (DIR, START, END or None)."""
    m = re.fullmatch(r"(.+?)\[(\d*):(\d*)\]", spec.strip())
    if not m:
        return Path(spec), 0, None
    start, end = int(m.group(2) or 0), (int(m.group(3)) if m.group(3) else None)
    if end is not None and end <= start:
        raise UserError(f"corpus {spec!r}: empty shard range")
    return Path(m.group(1)), start, end


def features_from_corpus(target, corpus_dir, out_dir, tap_layers: Sequence[int], *, batch_size: int = 8,
                         max_shards: int | None = None, progress: bool = True) -> Path:
    """The training-data directory (`TrainingData` format, specbench/train/data.py) of the target's
    features over the corpus' sequences: one prefill per sequence, one features shard per corpus
    shard (kept when its key — the corpus shard's sha256, taps, target, dtype — still matches, so a
    grown corpus only adds shards). `max_shards` uses the first shards only.

    `corpus_dir` may also be a list of parts, each a directory or "DIR[START:END]"
    (`parse_corpus_part`): their shards in that order, e.g. a general corpus' newest shards and
    a code corpus, to continue a drafter on data it has not seen."""
    from specbench.train.data import FORMAT as DATA_FORMAT, feature_pass, feature_shard_name, feature_shard_ok, write_feature_shard

    model = target.model
    parts = [corpus_dir] if isinstance(corpus_dir, (str, Path)) else list(corpus_dir)
    if not parts:
        raise UserError("no corpus given")
    taps = tuple(int(i) for i in tap_layers)
    if not taps or any(not 0 <= i < model.args.n_layers for i in taps):
        raise UserError(f"tap layers {list(taps)} must be between 0 and {model.args.n_layers - 1}")
    shards, listed, used, origin, first = [], [], [], [], None
    for part in parts:
        path, start, end = parse_corpus_part(str(part))
        if max_shards is not None:
            end = max_shards if end is None else min(end, max_shards)
        manifest, part_shards = read_corpus(path)
        if manifest["target"]["fingerprint"] != target.fingerprint:
            raise UserError(f"corpus {path} was generated by {manifest['target']['name']!r}, not {target.name!r}")
        if start >= len(part_shards):
            raise UserError(f"corpus {part}: it has only {len(part_shards)} shards")
        shards += part_shards[start:end]
        listed += manifest["shards"][start:end]
        origin += [str(path)] * len(part_shards[start:end])
        first = first or manifest
        used.append({"corpus": str(path), "build_key": manifest["build_key"], "shards": [start, start + len(part_shards[start:end])],
                     "settings": manifest["settings"]})
    manifest = first
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dim, dtype = model.args.dim, str(model.lm_head.weight.dtype).replace("torch.", "")
    t0 = time.time()
    total = sum(int(s["seq_offsets"][-1]) for s in shards)
    bar = tqdm(total=total, desc="target features", unit="tok", disable=not progress)
    summaries, n_loss = [], 0
    for k, (shard, info, source_dir) in enumerate(zip(shards, listed, origin)):
        key = hashlib.sha256(json.dumps([info["sha256"], taps, target.fingerprint, dtype]).encode()).hexdigest()[:16]
        offs, plen = shard["seq_offsets"].tolist(), shard["prompt_lengths"].tolist()
        seqs = [shard["token_ids"][offs[s]:offs[s + 1]].astype(np.int64).tolist() for s in range(len(plen))]
        n_loss += sum(len(q) - p for q, p in zip(seqs, plen))
        path = out / feature_shard_name(k)
        if not feature_shard_ok(path, key):
            order = sorted(range(len(seqs)), key=lambda s: (len(seqs[s]), s))
            feats: dict[int, tuple] = {}
            for j in range(0, len(order), batch_size):
                group = order[j:j + batch_size]
                for s, f in zip(group, feature_pass(model, [seqs[s] for s in group], taps)):
                    feats[s] = f
                bar.update(sum(len(seqs[s]) for s in group))
            write_feature_shard(
                path,
                [torch.tensor(q, dtype=torch.int32) for q in seqs],
                [torch.tensor([0] * p + [1] * (len(q) - p), dtype=torch.uint8) for q, p in zip(seqs, plen)],
                [feats[s][0] for s in range(len(seqs))], [feats[s][1] for s in range(len(seqs))],
                shard["prompt_index"].tolist(), len(taps) * dim, dim, key, target.fingerprint)
        else:
            bar.update(offs[-1])
        summaries.append({"file": path.name, "n_sequences": len(seqs), "n_tokens": offs[-1], "corpus_shard": info["file"],
                          "corpus": source_dir})
    bar.close()
    sources: Counter = Counter()
    for info in listed:
        sources.update(info["prompt_sources"])
    data_manifest = {
        "format": DATA_FORMAT,
        "target": {"name": target.name, "fingerprint": target.fingerprint, "n_layers": model.args.n_layers,
                   "dim": dim, "vocab_size": model.args.vocab_size},
        "tap_layers": list(taps),
        "n_sequences": sum(s["n_sequences"] for s in summaries), "n_tokens": sum(s["n_tokens"] for s in summaries),
        "n_loss_tokens": n_loss,
        "generation": {**manifest["generation"], "max_new_tokens": manifest["settings"]["max_new_tokens"],
                       "corpus": used[0]["corpus"], "corpus_build_key": manifest["build_key"],
                       "corpora": used, "feature_dtype": dtype},
        "seed": manifest["settings"]["seed"],
        "prompt_sources": dict(sorted(sources.items())),
        "shards": summaries,
        "build_s": round(time.time() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic.write_json(out / "manifest.json", data_manifest)
    return out
