"""The weight packs and KV caches in 2 MB pages (specbench/engine/huge_pages.py) against 4 KB pages, on
the real target in bf16 and the shipped DSpark and EAGLE drafters (a DSpark drafting round, and an EAGLE
chain round as policies/eagle-chain.toml drafts it) (not a test: numbers go to docs/performance.md).

Two copies of each are built in one process, one with huge pages off (as before session 29) and one
with them on, and timed interleaved in random order, each step right after a 256 MB read so that
both arms start cold and see the same memory phase (the 2-core EPYC's read rate switches between
~30 and ~60 GB/s). A 1 GiB read before each pass records the phase. Reports the median time of
each arm and the median of the paired ratios (2 MB / 4 KB) with its 95% bootstrap CI.

Usage (an otherwise idle machine):
  python benchmarks/huge_pages_ab.py --pairs 40 --out results/perf/cpu-huge-pages-ab-epyc.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from scipy.stats import bootstrap
from tqdm import tqdm

from specbench.atomic import write_json
from specbench.drafters.dspark import load_dspark_drafter
from specbench.drafters.eagle import load_eagle_head
from specbench.engine import huge_pages
from specbench.engine.loading import load_model
from specbench.engine.model import round_to_bucket
from specbench.engine.timing import device_name, time_forward

CONTEXT = 256
STEPS = [(1, 1), (1, 4), (1, 8), (8, 1), (16, 1), (16, 4)]  # (batch, q)


def eagle_chain_round(head, vocab, depth: int) -> None:
    """One greedy EAGLE chain drafting round at b = 1, as policies/eagle.py's `_chain` runs it: the
    draft head's logits, then `depth - 1` steps of the head layer, each followed by the logits."""
    ctx = head.ctx_len[:1]
    hidden = head.h_last[:1]
    keys = torch.arange(head.kv_len(int(ctx.max()) + depth))[None, None]
    for step in range(depth):
        logits, ids = head.draft_logits(hidden, vocab)
        x = ids[logits.argmax(-1)]
        if step + 1 < depth:
            pos = (ctx + step)[:, None]
            hidden = head.step(hidden[:, None], x[:, None], pos, pos, keys <= pos[..., None])[:, 0]


def build(on: bool, drafter_dir: str, draft_vocab: int, block: int, eagle_dir: str, eagle_vocab: int):
    huge_pages.ENABLED = on  # read when packs and caches are made
    loaded = load_model("smollm2-135m", dtype=torch.bfloat16)
    target = getattr(loaded, "model", loaded)
    target.setup_cache(max(b for b, _ in STEPS), round_to_bucket(CONTEXT + max(q for _, q in STEPS) + 1))
    drafter = load_dspark_drafter(drafter_dir, loaded)
    drafter.keep_draft_vocab(draft_vocab)
    drafter.keep_block(block)
    with torch.inference_mode():
        drafter.setup_cache(1, 512)
        dim = len(drafter.args.tap_layers) * drafter.args.model_args.dim
        drafter.append_context(torch.randn(1, CONTEXT, dim, generator=torch.Generator().manual_seed(0)).bfloat16())
        for _ in range(3):  # the layer packs are made on first use, while ENABLED is this arm's
            drafter.draft_block(torch.tensor([1234]), None, temperature=0.0, with_probs=False)
    eagle = load_eagle_head(eagle_dir, loaded)
    eagle_vocab_rows = eagle.draft_vocab(eagle_vocab)
    with torch.inference_mode():
        eagle.setup_cache(1, 512)
        features = torch.randn(1, CONTEXT, dim, generator=torch.Generator().manual_seed(1)).bfloat16()
        eagle.append_context(features, torch.randint(0, 49152, (1, CONTEXT)), torch.tensor([CONTEXT]))
        for _ in range(3):  # the head pack is made on first use, too
            eagle_chain_round(eagle, eagle_vocab_rows, 3)
    return target, drafter, (eagle, eagle_vocab_rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--drafter", default="drafters/smollm2-135m/dspark")
    ap.add_argument("--draft-vocab", type=int, default=2048, help="as policies/dspark.toml")
    ap.add_argument("--block", type=int, default=4, help="as policies/dspark.toml")
    ap.add_argument("--eagle", default="drafters/smollm2-135m/eagle")
    ap.add_argument("--eagle-vocab", type=int, default=2048, help="as policies/eagle-chain.toml")
    ap.add_argument("--eagle-depth", type=int, default=3, help="as policies/eagle-chain.toml")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    was = huge_pages.ENABLED
    arms = {on: build(on, args.drafter, args.draft_vocab, args.block, args.eagle, args.eagle_vocab)
            for on in (False, True)}
    huge_pages.ENABLED = was
    read = torch.rand(2 ** 28)  # 1 GiB: the phase
    evict = read[: 2 ** 26]  # 256 MB: larger than the L3, so every arm starts cold
    times: dict[str, dict[bool, list[float]]] = {}
    rates = []
    with torch.inference_mode():
        for _ in tqdm(range(args.pairs), desc="pairs"):
            start = time.perf_counter()
            read.sum()
            rates.append(read.numel() * 4 / (time.perf_counter() - start))
            for b, q in STEPS:
                for on in random.sample([False, True], 2):
                    evict.sum()
                    (t,) = time_forward(arms[on][0], b, q, CONTEXT, iters=1, warmup=0)
                    times.setdefault(f"target b={b} q={q}", {False: [], True: []})[on].append(t)
            for on in random.sample([False, True], 2):  # a drafting round right after a target step, as in decoding
                target, drafter, _ = arms[on]
                time_forward(target, 1, 1, CONTEXT, iters=1, warmup=0)
                start = time.perf_counter()
                drafter.draft_block(torch.tensor([1234]), None, temperature=0.0, with_probs=False)
                times.setdefault("dspark draft_block b=1", {False: [], True: []})[on].append(time.perf_counter() - start)
            for on in random.sample([False, True], 2):
                target, _, (eagle, eagle_vocab_rows) = arms[on]
                time_forward(target, 1, 1, CONTEXT, iters=1, warmup=0)
                start = time.perf_counter()
                eagle_chain_round(eagle, eagle_vocab_rows, args.eagle_depth)
                times.setdefault("eagle chain round b=1", {False: [], True: []})[on].append(time.perf_counter() - start)
    med = statistics.median
    rows = []
    for name, arm in times.items():
        ratios = [h / p for p, h in zip(arm[False], arm[True])]
        ci = bootstrap((ratios,), np.median, confidence_level=0.95, n_resamples=5000,
                       random_state=np.random.default_rng(0)).confidence_interval
        rows.append({"what": name, "ms_4k": 1e3 * med(arm[False]), "ms_2m": 1e3 * med(arm[True]),
                     "ratio_2m_over_4k": med(ratios), "ratio_ci95": [ci.low, ci.high], "pairs": len(ratios),
                     "seconds_4k": arm[False], "seconds_2m": arm[True]})
        print(f"{name:24s} 4 KB {rows[-1]['ms_4k']:7.2f} ms  2 MB {rows[-1]['ms_2m']:7.2f} ms  "
              f"2 MB / 4 KB {med(ratios):.3f} [{ci.low:.3f}, {ci.high:.3f}]")
    rate = [r / 1e9 for r in (min(rates), med(rates), max(rates))]
    print(f"read rate min / median / max {rate[0]:.1f} / {rate[1]:.1f} / {rate[2]:.1f} GB/s; {args.pairs} pairs")
    if args.out:
        write_json(args.out, {"device": device_name(torch.device("cpu")), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "context": CONTEXT,
                              "read_rate_gb_s_min_median_max": rate, "rows": rows,
                              "thp_mode": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()})


if __name__ == "__main__":
    main()
