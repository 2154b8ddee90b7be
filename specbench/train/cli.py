"""`python -m specbench train`: build (or reuse) a target's training data, train one drafter.

    python -m specbench train --policy {fixed-k,eagle,dspark,dflash} --target M
        --budget {tiny,small,full} [--out DIR] [--data DIR] [--seed S] [--device D] [--resume]

Data goes to `--data` (default `<cache>/traindata/<target>/<budget>-s<seed>/`; a directory that
already holds finished data is reused as it is), the drafter, its loss history / curve, its
checkpoint and a training card (TRAINING.md) to `--out` (default
`<cache>/drafters/<target>/<policy>-<budget>-s<seed>/`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

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
                   help="tiny: seconds (tests); small: the 2-core CPU, under an hour; full: one H200, minutes")
    p.add_argument("--out", help="output directory for the drafter (default: in the cache)")
    p.add_argument("--data", help="training-data directory (built there if it holds none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    from specbench.cli import add_dtype_argument

    add_dtype_argument(p)  # the target's dtype (data generation, features); drafters train with fp32 master weights
    p.add_argument("--tap-layers", help="comma-separated target layers to cache (default: 3 evenly spaced)")
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
    from specbench.loading import default_cache_dir, load_model
    from specbench.train.common import get_budget, write_training_card
    from specbench.train.data import TrainingData, build_training_data, default_data_dir

    trainer = trainer_for(args.policy)
    budget = get_budget(args.budget)
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
    if not (data_dir / "manifest.json").is_file():
        t0 = time.perf_counter()
        build_training_data(target, data_dir, n_prompts=budget["n_prompts"], max_new_tokens=budget["max_new_tokens"],
                            seed=args.seed, tap_layers=tap_layers, batch_size=budget["gen_batch_size"],
                            magpie_fraction=budget["magpie_fraction"], progress=progress)
        data_s = time.perf_counter() - t0
    data = TrainingData(data_dir, target)

    safe_target = "".join(c if c.isalnum() or c in "._-" else "_" for c in target.name)
    out = Path(args.out) if args.out else (default_cache_dir() / "drafters" / safe_target
                                           / f"{args.policy}-{args.budget}-s{args.seed}")
    result = trainer.train(target, data, out, budget=budget, seed=args.seed, resume=args.resume,
                           progress=progress, policy=args.policy)
    card = write_training_card(out, policy=args.policy, result=result, target=target,
                               data_summary=data.summary(), budget_name=args.budget, budget=budget,
                               seed=args.seed, data_s=data_s, device=str(device))
    final = ", ".join(f"{k} {v:.4g}" for k, v in result.final.items())
    print(f"specbench: trained {args.policy} drafter for {target.name}: {out} ({result.steps} steps; {final}); "
          f"card {card.name}", file=sys.stderr)
    return 0
