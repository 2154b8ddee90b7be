"""Helpers the test modules share (test modules never import one another).

* χ² against the exact distribution: `exact_joint` enumerates a tiny-vocabulary target's joint
  distribution of the first N_TOKENS tokens, `sampled_counts` draws N_SAMPLES of them through a
  policy, `chi_square` compares (the lossless tests under sampling; their power is shown by
  negative controls such as `broken_verify_tree`).
* A tiny chat target: a real transformers tokenizer over VOCAB word ids with a ChatML-like
  template, around a tiny random Transformer (`tiny_target`: training data, drafter training).
* A DSpark drafter for a tiny target with lively random weights (`make_drafter`).
* Runner fakes: a character tokenizer and a SimpleNamespace target (`make_target`) and a small
  workload (`make_workload`).
"""
from __future__ import annotations

import itertools
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from scipy import stats
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from specbench.bench.workloads import Request, Workload
from specbench.drafters.dspark import DSparkArgs, build_drafter
from specbench.engine.core import SamplingConfig, generate
from specbench.engine.loading import LoadedModel
from specbench.engine.sampling import probs_from_logits, sample
from specbench.train.data import TrainingData, build_training_data
from tiny import tiny_model

# ---------------------------------------------------------------------------------------------
# χ² against the exact distribution

SMALL_VOCAB, N_TOKENS, N_SAMPLES = 5, 4, 30000


def exact_joint(model, prompt, n_tokens, temperature, top_p):
    """P(x_1..x_n | prompt) for every sequence, by enumeration with the model's own forward."""
    probs = {}
    for seq in itertools.product(range(SMALL_VOCAB), repeat=n_tokens - 1):
        ids = torch.tensor([prompt + list(seq)])
        q = ids.shape[1]
        model.setup_cache(1, 64)
        mask = torch.tril(torch.ones(q, q, dtype=torch.bool))[None]
        pos = torch.arange(q)[None]
        logits, _, _ = model(ids, pos, pos, mask)
        step = probs_from_logits(logits[0, len(prompt) - 1 :], temperature, top_p).double()
        p_prefix = 1.0
        for i in range(n_tokens - 1):
            p_prefix *= float(step[i, seq[i]])
        for last in range(SMALL_VOCAB):
            probs[seq + (last,)] = p_prefix * float(step[n_tokens - 1, last])
    return probs


def sampled_counts(target, policy, prompt, temperature, top_p, seed=1234):
    config = SamplingConfig(max_new_tokens=N_TOKENS, temperature=temperature, top_p=top_p, seed=seed)
    result = generate(target, policy, [prompt] * N_SAMPLES, config)
    counts = {}
    for r in result.requests:
        key = tuple(r.output_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, result


def lookup_merge_spy(module, monkeypatch, broken: bool, vocab: int) -> dict:
    """Wraps `module.with_lookup_drafts` (policies/pld.py) as a policy module imported it: counts the rounds
    it merged without a drafter call ("free") and with one ("mixed"); with `broken`, the negative control,
    the looked-up rows claim a uniform draft distribution over `vocab` instead of their one-hot one."""
    honest, calls = module.with_lookup_drafts, {"free": 0, "mixed": 0}

    def spy(drafted, lookups, state, k):
        calls["free" if drafted is None else "mixed"] += 1
        out = honest(drafted, lookups, state, k)
        if broken:
            b, width = out.tokens.shape
            probs = out.probs if out.probs is not None else torch.zeros(b, width, vocab)
            probs[sorted(lookups)] = 1.0 / vocab
            out.probs = probs
        return out

    monkeypatch.setattr(module, "with_lookup_drafts", spy)
    return calls


def assert_lossless_or_caught(exact, counts, broken: bool, what: str) -> None:
    """The χ² verdict of a sampled-losslessness test with a negative control: the honest policy's counts
    fit the exact distribution (p > 1e-3); the broken one's are rejected (p < 1e-6, TV > 0.05)."""
    pvalue, tv = chi_square(exact, counts)
    if broken:
        assert pvalue < 1e-6 and tv > 0.05, f"broken {what} was not caught (p={pvalue:.2e}, TV={tv:.4f})"
    else:
        assert pvalue > 1e-3, f"{what} differs from the target's (p={pvalue:.2e}, TV={tv:.4f})"


def chi_square(exact, counts):
    keys = sorted(exact, key=exact.get, reverse=True)
    expected = np.array([exact[k] for k in keys])
    expected = expected / expected.sum() * N_SAMPLES  # float rounding in the enumeration
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    assert observed.sum() == N_SAMPLES  # nothing outside the support
    big = expected >= 5  # pool sparse cells so the χ² approximation holds
    expected = np.append(expected[big], expected[~big].sum())
    observed = np.append(observed[big], observed[~big].sum())
    tv = 0.5 * np.abs(observed / N_SAMPLES - expected / N_SAMPLES).sum()
    return stats.chisquare(observed, expected).pvalue, tv


def broken_verify_tree(target_probs, node_tokens, parents, node_probs, n_nodes, generator):
    """Tries top-k children with probability p(x) each but never removes a rejected child from p."""
    b = target_probs.shape[0]
    paths, dists = [], []
    for r in range(b):
        node, path, p = -1, [], target_probs[r, 0]
        while True:
            kids = [i for i in range(int(n_nodes[r])) if int(parents[r, i]) == node]
            chosen = next((c for c in kids if float(torch.rand((), generator=generator)) < float(p[node_tokens[r, c]])), None)
            if chosen is None:
                break
            path.append(chosen)
            node, p = chosen, target_probs[r, chosen + 1]
        paths.append(path)
        dists.append(p)
    return paths, sample(torch.stack(dists), generator)


def decode_in_batches(target_model, policy, prompts, batch_size, config):
    """Every prompt decoded through `policy`, `batch_size` rows per generate() call."""
    out = []
    for i in range(0, len(prompts), batch_size):
        out += generate(target_model, policy, prompts[i : i + batch_size], config).requests
    return out


# ---------------------------------------------------------------------------------------------
# A tiny chat target

VOCAB = 64


IM_START, IM_END = 1, 2


CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "<|im_start|>system w1 w2<|im_end|>{% endif %}"
          "<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB ids with a ChatML-like template (no download)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = specials + ["system", "user", "assistant"] + [f"w{i}" for i in range(VOCAB - 7)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                                additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = CHATML
    return fast


def tiny_target(seed: int = 0, layers: int = 4, scale: float = 6.0, fingerprint: str | None = None) -> LoadedModel:
    """A LoadedModel around a tiny random Transformer (sharp output layer: a learnable target)."""
    model = tiny_model(vocab=VOCAB, dim=32, layers=layers, seed=seed, scale=scale)
    return LoadedModel(model, tiny_tokenizer(), f"tiny-{seed}", "test", "", fingerprint or f"tiny-fp-{seed}", [IM_END])


def tiny_training_data(target, folder, tap_layers) -> TrainingData:
    """The drafter trainers' shared data set: 24 prompts, 32-token responses, features at `tap_layers`."""
    torch.set_num_threads(1)
    path = build_training_data(target, folder, n_prompts=24, max_new_tokens=32, seed=0, tap_layers=tap_layers,
                               batch_size=8, shard_size=12, eval_texts=[], progress=False)
    return TrainingData(path, target)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops on a busy 2-core machine run ~10x faster single-threaded (import it into a test
    module to use it there)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Runner fakes

EOS = 2


class FakeTokenizer:
    """Character-level tokenizer over a 64-id vocabulary: 0 pad, 1 <|im_start|>, 2 <|im_end|> (EOS),
    3 unused, 4.. printable characters (code points 32..91; others wrap around)."""

    pad_token_id = 0
    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False):
        return [4 + (ord(c) - 32) % (VOCAB - 4) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + i - 4) if i >= 4 else ("" if skip_special_tokens else f"<{i}>") for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [1] + self.encode(m["role"] + " " + m["content"]) + [EOS]
        if add_generation_prompt:
            ids += [1] + self.encode("assistant ")
        return ids


def make_target(seed: int = 0, dim: int = 32, layers: int = 2):
    return SimpleNamespace(model=tiny_model(vocab=VOCAB, dim=dim, layers=layers, seed=seed, scale=4.0),
                           tokenizer=FakeTokenizer(), name="tiny", eos_token_ids=[EOS], fingerprint="tiny")


def make_workload(n: int = 7, turns: int = 1, name: str = "toy") -> Workload:
    reqs = []
    for i in range(n):
        t = [f"QUESTION {i}: REPEAT ABC ABC ABC {i * 7}"] + [f"AND THEN {i}?"] * (turns - 1)
        reqs.append(Request(prompt_id=f"q{i}", category="cat" if i % 2 else "dog", turns=t))
    return Workload(name=name, requests=reqs, max_new_tokens=24, use_chat_template=True, system_prompt=None,
                    synthetic=True, spec_path=None)


# ---------------------------------------------------------------------------------------------
# A DSpark drafter for a tiny target

TAPS = [0, 1]


def make_drafter(target, seed=0, block_size=4, variant="dspark", std=0.2, draft_vocab=0):
    args = DSparkArgs.for_target(target.args, tap_layers=TAPS, variant=variant, n_layers=1,
                                 block_size=block_size, markov_rank=8, draft_vocab=draft_vocab)
    drafter = build_drafter(args, target)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # livelier than the default 0.02 init: confidences spread over (0, 1)
        for name, p in drafter.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=torch.Generator().manual_seed(seed + zlib.crc32(name.encode()) % 1000))
    return drafter.eval().requires_grad_(False)


def attention_reference(xq, k_cache, v_cache, mask, dtype):
    """The CPU kernels' attention in `dtype` through torch: xq [b, nh, q, hd], caches [B >= b, nkv, S, hd],
    mask [b, q, kv_len] bool → [b, q, nh·hd] (a query with no visible key: NaN)."""
    b, nh, q, hd = xq.shape
    group, kv_len = nh // k_cache.shape[1], mask.shape[-1]
    keys = k_cache[:b, :, :kv_len].repeat_interleave(group, 1).to(dtype)
    values = v_cache[:b, :, :kv_len].repeat_interleave(group, 1).to(dtype)
    scores = (xq.to(dtype) @ keys.transpose(-1, -2) / hd ** 0.5).masked_fill(~mask[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2).reshape(b, q, nh * hd)


def scattered_slot_cases(dtype, trials=20):
    """(xq, keys, values, scattered mask, the same keys and values packed consecutively, their mask):
    a tree node's view of the cache (the prefix and ancestors at scattered slots) and the AR step's view
    of the same keys in consecutive slots, for the attention kernels' slot-independence tests."""
    generator = torch.Generator().manual_seed(5)
    nh, nkv, hd, prefix, spread = 9, 3, 64, 37, 50
    xq = torch.randn(1, nh, 1, hd, generator=generator).to(dtype)
    keys, values = (torch.randn(1, nkv, prefix + spread, hd, generator=generator).to(dtype) for _ in range(2))
    for trial in range(trials):
        chosen = prefix + torch.randperm(spread, generator=generator)[:1 + trial % 9].sort().values
        scattered = torch.zeros(1, 1, prefix + spread, dtype=torch.bool)
        scattered[..., :prefix] = True
        scattered[..., chosen] = True
        seen = torch.cat([torch.arange(prefix), chosen])
        consecutive = torch.ones(1, 1, len(seen), dtype=torch.bool)
        yield xq, keys, values, scattered, keys[:, :, seen].contiguous(), values[:, :, seen].contiguous(), consecutive
