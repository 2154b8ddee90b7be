"""Before / after timing of two checkouts of this repository on one machine (not a test: numbers go to
docs/performance.md). Each run imports specbench from the checkout given and prints, for the real
target in bf16 at b = 1, context 256: the medians of 30 decode steps (`forward_new_tokens` +
`greedy_ids`) at q = 1, 4 and 8 (4: about what DSpark verifies at b = 1 on a CPU), and of 30 DSpark drafting rounds (a 2-token context append +
`draft_block`), each run right after a target step as in decoding, so the drafter's weights are as
cold as they are there.

Run the two sides alternately, in separate processes, on an idle machine (the machine's read rate
drifts within minutes, so one run of each says little):

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do
        TORCH_EXTENSIONS_DIR=/tmp/before/build python benchmarks/commit_ab.py /tmp/before before
        python benchmarks/commit_ab.py . after
    done
"""
import statistics
import sys
import time
from pathlib import Path

checkout, label = str(Path(sys.argv[1]).resolve()), sys.argv[2]
sys.path.insert(0, checkout)
import torch  # noqa: E402

import specbench  # noqa: E402

assert specbench.__file__.startswith(checkout), f"specbench came from {specbench.__file__}, not {checkout}"
from specbench.drafters.dspark import load_dspark_drafter  # noqa: E402
from specbench.engine.core import forward_new_tokens  # noqa: E402
from specbench.engine.loading import load_model  # noqa: E402
from specbench.engine.sampling import greedy_ids  # noqa: E402

target = load_model("smollm2-135m", dtype=torch.bfloat16)
drafter = load_dspark_drafter(checkout + "/drafters/smollm2-135m/dspark", target)


def median_ms(f, n: int = 30) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def step(q: int):
    tokens, lengths = torch.randint(0, target.model.args.vocab_size, (1, q)), torch.full((1,), 256)
    return lambda: greedy_ids(forward_new_tokens(target.model, tokens, lengths)[0])


with torch.inference_mode():
    target.model.setup_cache(1, 512)
    drafter.setup_cache(1, 4096)
    features = torch.randn(1, 2, len(drafter.args.tap_layers) * target.model.args.dim).bfloat16()
    ar_step = step(1)

    def drafting_round() -> float:
        ar_step()  # evicts the drafter's weights, as the verify forward does in decoding
        t = time.perf_counter()
        drafter.ctx_len.fill_(256)
        drafter.append_context(features, torch.tensor([2]))
        drafter.draft_block(torch.tensor([1234]), None, temperature=0.0, with_probs=False)
        return time.perf_counter() - t

    rounds = [drafting_round() for _ in range(30)]
    print(f"{label}: T(1) {median_ms(step(1)):.2f} ms  T(4) {median_ms(step(4)):.2f} ms  T(8) {median_ms(step(8)):.2f} ms  "
          f"drafting round after a step {statistics.median(rounds) * 1e3:.2f} ms", flush=True)
