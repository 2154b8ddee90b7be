"""pytest-benchmark microbenchmarks of the decode core's hot paths (not tests: kept out of the
default `python -m pytest`, whose testpaths is tests/ and whose addopts has --benchmark-skip).

  chain verify   specbench.engine.verify.verify_chain, b=16, K=8, V=49152: greedy (one-hot drafts) and
                 sampled drafts (the rejection sampler: accept min(1, p/q), residual, bonus)
  tree verify    specbench.engine.verify.verify_tree, b=4, 24-node trees, V=49152 (chosen siblings)
  scheduler      specbench.policies.scheduler.algorithm1_lengths, R=64 requests, γ=7 (packed and padded)
  forward        the default target's verify forward (q = 1 + 8 at 256 cached tokens, b = 1, 4),
                 only when the converted model is already in the cache (skipped otherwise)

Run and save (docs/regress.md):

  python -m pytest benchmarks/bench_hotpaths.py --benchmark-only --benchmark-autosave
  pytest-benchmark compare 0001 0002 --group-by=name --columns=min,median,mean,stddev

(--benchmark-only overrides the configured --benchmark-skip; --benchmark-enable does not.)
"""
from __future__ import annotations

import pytest
import torch

from specbench.policies.scheduler import algorithm1_lengths
from specbench.engine.verify import verify_chain, verify_tree

V = 49152


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # comparable across machines and runs; the suite's CPU runs use few threads
    yield
    torch.set_num_threads(before)


def _probs(*shape, seed: int, sharp: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(*shape, generator=g), dim=-1)


@pytest.mark.parametrize("drafts", ["greedy", "sampled"])
def test_verify_chain(benchmark, drafts):
    b, k = 16, 8
    target = _probs(b, k + 1, V, seed=0)
    draft_probs = _probs(b, k, V, seed=1) if drafts == "sampled" else None
    g = torch.Generator().manual_seed(2)
    if draft_probs is None:  # drafts that agree with the target's argmax for a random prefix
        tokens = target[:, :k].argmax(-1)
        cut = torch.randint(0, k + 1, (b,), generator=g)
        tokens = torch.where(torch.arange(k)[None] < cut[:, None], tokens, (tokens + 1) % V)
    else:
        tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(b, k)
    lengths = torch.full((b,), k, dtype=torch.long)
    gen = torch.Generator().manual_seed(3)
    accepted, nxt = benchmark(verify_chain, target, tokens, draft_probs, lengths, gen)
    assert accepted.shape == nxt.shape == (b,)


def test_verify_tree(benchmark):
    b, n = 4, 24
    # 3 children of the root, 3 of each of those, then one chain child each: 3 + 9 + 9 + 3 = 24 nodes
    parents = [-1, -1, -1] + [i // 3 for i in range(9)] + [3 + i for i in range(9)] + [12, 13, 14]
    parents = torch.tensor([parents] * b)
    target = _probs(b, n + 1, V, seed=4)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (b, n), generator=g)
    # make some nodes the target's argmax so paths get accepted
    for r in range(b):
        for i in range(n):
            if (r + i) % 2 == 0:
                tokens[r, i] = target[r, parents[r, i] + 1].argmax()
    n_nodes = torch.full((b,), n, dtype=torch.long)
    gen = torch.Generator().manual_seed(6)
    paths, nxt = benchmark(verify_tree, target, tokens, parents, None, n_nodes, gen)
    assert len(paths) == b and nxt.shape == (b,)


@pytest.mark.parametrize("padded", [False, True])
def test_algorithm1_lengths(benchmark, padded):
    rows, gamma = 64, 7
    g = torch.Generator().manual_seed(7)
    confidence = torch.rand(rows, gamma, generator=g) * 0.5 + 0.45
    max_lengths = torch.full((rows,), gamma, dtype=torch.long)

    def sps(verify_tokens: int) -> float:  # a verify step that gets dearer with the tokens it carries
        return 1.0 / (0.02 + 0.00005 * verify_tokens)

    lengths = benchmark(algorithm1_lengths, confidence, max_lengths, sps, True, padded)
    assert lengths.shape == (rows,) and int(lengths.max()) <= gamma


def _cached_default_model():
    from specbench.cli.main import DEFAULT_TARGET
    from specbench.engine.loading import default_cache_dir

    manifest = default_cache_dir() / "models" / DEFAULT_TARGET / "manifest.json"
    if not manifest.is_file():
        pytest.skip(f"default model {DEFAULT_TARGET} not converted yet (run any specbench command once)")
    from specbench.engine.loading import load_model

    return load_model(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def default_model():
    return _cached_default_model()


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 4])
def test_default_model_verify_forward(benchmark, default_model, batch):
    from specbench.engine.core import forward_new_tokens
    from specbench.engine.model import round_to_bucket

    model = default_model.model
    context, q = 256, 9  # anchor + 8 drafts
    model.setup_cache(batch, round_to_bucket(context + q + 1))
    tokens = torch.randint(0, model.args.vocab_size, (batch, q), generator=torch.Generator().manual_seed(8))
    cache_lengths = torch.full((batch,), context, dtype=torch.long)

    @torch.inference_mode()
    def forward():
        return forward_new_tokens(model, tokens, cache_lengths)[0]

    logits = benchmark.pedantic(forward, rounds=8, warmup_rounds=2, iterations=1)
    assert logits.shape[:2] == (batch, q)
