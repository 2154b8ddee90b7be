"""Time of one DSpark block pass + greedy draft (`draft_block`) at b = 1 on the shipped drafter and the
real target, bf16, context 256: the draft layers in one kernel call (dspark.FUSED_BLOCK) against the
SDPA path, 30 interleaved pairs. Run on an idle machine: `python benchmarks/draft_round.py`."""
import statistics as st
import time

import torch

from specbench.drafters import dspark
from specbench.drafters.dspark import load_dspark_drafter
from specbench.engine.loading import load_model

target = load_model("smollm2-135m", dtype=torch.bfloat16)
drafter = load_dspark_drafter("drafters/smollm2-135m/dspark", target)
anchor = torch.tensor([1234])


def one(fused: bool) -> float:
    dspark.FUSED_BLOCK = fused
    t = time.perf_counter()
    drafter.draft_block(anchor, None, temperature=0.0, with_probs=False)
    return time.perf_counter() - t


with torch.inference_mode():
    drafter.setup_cache(1, 512)
    feats = torch.randn(1, 256, len(drafter.args.tap_layers) * drafter.args.model_args.dim).bfloat16()
    drafter.append_context(feats)
    for _ in range(5):
        one(True), one(False)
    fused, sdpa = zip(*[(one(True), one(False)) for _ in range(30)])
print(f"draft_block b = 1, context 256, gamma {drafter.block_size}: one kernel call {st.median(fused) * 1e3:.2f} ms, "
      f"per-module + SDPA {st.median(sdpa) * 1e3:.2f} ms (medians of 30 interleaved pairs)")
