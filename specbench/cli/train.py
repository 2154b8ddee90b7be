"""`python -m specbench train`: build (or reuse) a target's training data, train one drafter.

    python -m specbench train --policy {fixed-k,eagle,dspark,dflash} --target M
        --budget {tiny,small,full} [--out DIR] [--data DIR] [--seed S] [--device D] [--resume] [--init DRAFTER]

Data goes to `--data` (default `<cache>/traindata/<target>/<budget>-s<seed>/`; a directory that
already holds finished data is reused as it is), the drafter, its loss history / curve, its
checkpoint and a training card (TRAINING.md) to `--out` (default
`<cache>/drafters/<target>/<policy>-<budget>-s<seed>/`).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import sys
import time
from pathlib import Path

import torch

from specbench.cli.args import positive_float, positive_int
from specbench.errors import UserError

# policy -> module with `train(target, data, out_dir, *, budget, seed, resume, progress, policy)`
TRAINERS = {
    "fixed-k": "specbench.train.draft_lm",
    "eagle": "specbench.train.eagle",
    "dspark": "specbench.train.dspark",
    "dflash": "specbench.train.dspark",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    from specbench.train.common import BUDGETS

    p = subparsers.add_parser(
        "train", help="train a drafter (fixed-K draft LM, EAGLE head, DSpark / DFlash) for a target",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, choices=list(TRAINERS), help="which drafter to train")
    p.add_argument("--target", default="smollm2-135m", help="target model spec (default: %(default)s)")
    p.add_argument("--budget", default="small", choices=list(BUDGETS),
                   help="tiny: seconds (tests); small (the default): the 2-core CPU, under an hour; full: one H200, minutes")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="optimizer steps (default: the budget's); e.g. to scale a run to a corpus' size")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (default: the budget's)")
    p.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default: the budget's)")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="steps between validation passes (default: the budget's); a large corpus' validation "
                        "split makes each pass longer")
    p.add_argument("--out", help="output directory for the drafter (default: in the cache)")
    p.add_argument("--data", help="training-data directory (built there if it holds none)")
    p.add_argument("--corpus", action="append",
                   help="train on this corpus (python -m specbench corpus): the target's features are computed "
                        "from its token ids into --data (default: in the cache). DIR[START:END] takes a range of "
                        "its shards; repeat to train on several, e.g. --corpus 'corpus/a[66:]' --corpus corpus/b")
    p.add_argument("--corpus-shards", type=int, default=None, help="use only the corpus' first N shards")
    p.add_argument("--seed", type=int, default=0, help="seed of data order and initialisation (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--init", help="start from this trained drafter's weights (same policy and architecture) "
                                  "instead of a random initialisation, e.g. to continue it on a larger corpus")
    from specbench.cli.args import add_dtype_argument

    add_dtype_argument(p)  # the target's dtype (data generation, features); drafters train with fp32 master weights
    p.add_argument("--tap-layers", help="comma-separated target layers to cache (default: 3 evenly spaced)")
    p.add_argument("--qk-norm", action="store_true",
                   help="dspark / dflash: q/k norms in the draft layers whatever the target's, i.e. Qwen3 layers, "
                        "the layout DeepSpec and vLLM load (specbench export --format deepspec); with --init a "
                        "drafter without them, they are added with weights 1")
    p.add_argument("--markov-rank", type=int,
                   help="dspark: rank r of the Markov head (W1: V × r, W2: r × V_d; default: the budget's); "
                        "with --init a drafter of smaller rank, its head grows with the new directions' "
                        "W2 columns at 0 (the drafter's outputs unchanged at the start)")
    p.add_argument("--draft-layers", type=int,
                   help="dspark / dflash: number of draft layers (default: the budget's); with --init a drafter "
                        "of fewer layers, the new ones are appended with their output projections at 0 (the "
                        "drafter's outputs unchanged at the start)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main)
    return p


def trainer_for(policy: str):
    name = TRAINERS.get(policy)
    if name is None:
        raise UserError(f"unknown policy {policy!r}; trainable: {', '.join(TRAINERS)}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise UserError(f"trainer for {policy} not available yet") from None
        raise


def main(args: argparse.Namespace) -> int:
    from specbench.engine.loading import default_cache_dir, load_model
    from specbench.train.common import get_budget, write_training_card
    from specbench.train.data import TrainingData, build_training_data, default_data_dir

    trainer = trainer_for(args.policy)
    budget = get_budget(args.budget, steps=getattr(args, "steps", None), batch_size=getattr(args, "batch_size", None),
                        lr=getattr(args, "lr", None), eval_every=getattr(args, "eval_every", None))
    if getattr(args, "qk_norm", False):
        if args.policy not in ("dspark", "dflash"):
            raise UserError(f"--qk-norm applies to dspark and dflash drafters, not {args.policy}")
        budget["qk_norm"] = True
    if getattr(args, "markov_rank", None) is not None:
        if args.policy != "dspark":
            raise UserError(f"--markov-rank applies to dspark drafters, not {args.policy}")
        if args.markov_rank < 1:
            raise UserError(f"--markov-rank must be at least 1, not {args.markov_rank}")
        budget["markov_rank"] = args.markov_rank
    if getattr(args, "draft_layers", None) is not None:
        if args.policy not in ("dspark", "dflash"):
            raise UserError(f"--draft-layers applies to dspark and dflash drafters, not {args.policy}")
        if args.draft_layers < 1:
            raise UserError(f"--draft-layers must be at least 1, not {args.draft_layers}")
        budget["draft_layers"] = args.draft_layers
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} requested but CUDA is not available")
    dtype = getattr(args, "dtype", "auto")
    progress = not getattr(args, "no_progress", False)
    tap_layers = None
    if getattr(args, "tap_layers", None):
        try:
            tap_layers = [int(x) for x in args.tap_layers.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--tap-layers {args.tap_layers!r}: expected comma-separated integers") from None

    target = load_model(args.target, device=device, dtype=dtype)
    data_dir = Path(args.data) if args.data else default_data_dir(target.name, f"{args.budget}-s{args.seed}")
    data_s = None
    if getattr(args, "corpus", None):
        from specbench.train.corpus import features_from_corpus, parse_corpus_part, read_corpus
        from specbench.train.data import default_tap_layers

        parts = [parse_corpus_part(spec) for spec in args.corpus]
        taps = tap_layers or default_tap_layers(target.model.args.n_layers)
        if not args.data:
            keys = [read_corpus(path)[0]["build_key"] + (f"[{start}:{end or ''}]" if (start, end) != (0, None) else "")
                    for path, start, end in parts]
            name = keys[0] if len(keys) == 1 and "[" not in keys[0] else hashlib.sha256("+".join(keys).encode()).hexdigest()[:16]
            shards = f"-first{args.corpus_shards}" if args.corpus_shards else ""
            data_dir = default_data_dir(target.name, f"corpus-{name}{shards}-taps{'_'.join(map(str, taps))}")
        t0 = time.perf_counter()
        features_from_corpus(target, args.corpus, data_dir, taps, max_shards=args.corpus_shards, progress=progress)
        data_s = time.perf_counter() - t0
    elif not (data_dir / "manifest.json").is_file():
        t0 = time.perf_counter()
        build_training_data(target, data_dir, n_prompts=budget["n_prompts"], max_new_tokens=budget["max_new_tokens"],
                            seed=args.seed, tap_layers=tap_layers, batch_size=budget["gen_batch_size"],
                            magpie_fraction=budget["magpie_fraction"], progress=progress)
        data_s = time.perf_counter() - t0
    data = TrainingData(data_dir, target)

    safe_target = "".join(c if c.isalnum() or c in "._-" else "_" for c in target.name)
    out = Path(args.out) if args.out else (default_cache_dir() / "drafters" / safe_target
                                           / f"{args.policy}-{args.budget}-s{args.seed}")
    init = {"init": args.init} if getattr(args, "init", None) else {}
    result = trainer.train(target, data, out, budget=budget, seed=args.seed, resume=args.resume,
                           progress=progress, policy=args.policy, **init)
    card = write_training_card(out, policy=args.policy, result=result, target=target,
                               data_summary=data.summary(), budget_name=args.budget, budget=budget,
                               seed=args.seed, data_s=data_s, device=str(device))
    final = ", ".join(f"{k} {v:.4g}" for k, v in result.final.items())
    print(f"specbench: trained {args.policy} drafter for {target.name}: {out} ({result.steps} steps; {final}); "
          f"card {card.name}", file=sys.stderr)
    return 0


def add_corpus_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "corpus", help="build (or continue) the self-distillation corpus: the target's own answers, as token ids",
        description="Build or continue a target-generated training corpus in committed uint16 shards "
                    "(specbench/train/corpus.py). A rerun continues after the last complete shard.")
    p.add_argument("--target", default="smollm2-135m", help="target model spec (default: %(default)s)")
    p.add_argument("--out", required=True, help="corpus directory (e.g. corpus/smollm2-135m)")
    p.add_argument("--tokens", type=int, default=2_000_000,
                   help="stop once the corpus holds this many response tokens (default: %(default)s)")
    p.add_argument("--shard-prompts", type=int, default=256, help="prompts per shard (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response budget (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="rows generated together (default: %(default)s)")
    p.add_argument("--max-shards", type=int, default=None, help="write at most this many new shards")
    p.add_argument("--workers", type=positive_int, default=1,
                   help="one-thread processes decoding a shard's independent batches at once, on a CPU "
                        "(default: %(default)s: this process); the shards are the same")
    p.add_argument("--seed", type=int, default=0, help="corpus seed (default: %(default)s)")
    p.add_argument("--mix", default="general", choices=["general", "code"],
                   help="prompt sources: general (Magpie under four system prompts, then seed code / chat / math "
                        "requests) or code (Magpie under the programmer system prompt, then function-writing "
                        "requests from the docstrings of the Python standard library, then of numpy, scipy, pandas, networkx, "
                        "sympy and mpmath) (default: %(default)s)")
    p.add_argument("--magpie-fraction", type=float, default=0.6,
                   help="share of each shard's prompts the target writes itself (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="target dtype; auto: bfloat16 on CUDA, on CPU the faster of the two by a GEMM "
                        "measured now (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--commit", action="store_true",
                   help="git-commit each shard and the manifest as soon as it is complete")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=corpus_main)
    return p


def _git_commit(paths: list[Path], message: str) -> None:
    import subprocess

    for attempt in range(10):  # another git process may hold the index lock for a moment
        add = subprocess.run(["git", "add", "--", *map(str, paths)], capture_output=True, text=True)
        if add.returncode == 0:
            done = subprocess.run(["git", "commit", "-q", "-m", message, "--", *map(str, paths)],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                return
        time.sleep(2 + attempt)
    print(f"specbench: could not commit {', '.join(map(str, paths))}; they stay on disk", file=sys.stderr)


def corpus_main(args: argparse.Namespace) -> int:
    from specbench.engine.loading import load_model
    from specbench.train.common import measured_cpu_dtype
    from specbench.train.corpus import build_corpus

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} requested but CUDA is not available")
    dtype_note = {}
    if args.dtype != "auto":
        dtype = getattr(torch, args.dtype)
    elif device.type == "cuda":
        dtype = torch.bfloat16
    else:
        dtype, dtype_note = measured_cpu_dtype()
    print(f"specbench: corpus generation in {str(dtype).replace('torch.', '')} on {device} "
          f"{dtype_note or ''}".rstrip(), file=sys.stderr)
    target = load_model(args.target, device=device, dtype=dtype)
    if getattr(args, "workers", 1) > 1 and device.type != "cpu":
        raise UserError("--workers is for CPU decoding; on a GPU one process drives the device")

    def commit(path: Path, manifest: dict) -> None:
        totals = manifest["totals"]
        _git_commit([path, path.parent / "manifest.json"],
                    f"corpus {path.parent.name}: {path.name} ({manifest['shards'][-1]['n_response_tokens']} response "
                    f"tokens; {totals['n_response_tokens']} in {totals['n_shards']} shards)")

    manifest = build_corpus(target, args.out, args.tokens, shard_prompts=args.shard_prompts,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                            max_shards=args.max_shards, on_shard=commit if args.commit else None,
                            progress=not args.no_progress, workers=getattr(args, "workers", 1),
                            mix=args.mix, magpie_fraction=args.magpie_fraction)
    t = manifest["totals"]
    print(f"specbench: corpus {args.out}: {t['n_response_tokens']} response tokens, {t['n_sequences']} sequences "
          f"in {t['n_shards']} shards ({t['generation_s']:.0f} s of generation)", file=sys.stderr)
    return 0
