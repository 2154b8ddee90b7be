"""Our forward against transformers' forward on the real default weights (SmolLM2-135M-Instruct)."""
from __future__ import annotations

import time

import pytest
import torch

from specbench.engine.loading import load_hf_reference, load_model

pytestmark = pytest.mark.model

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
NEW_TOKENS = 24


def chat_ids(tokenizer) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template unless return_dict=False.
    return tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_dict=False)


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """Prefill, then one token per step through the static KV cache (slot = position)."""
    p = len(ids)
    model.setup_cache(1, p + n)
    pos = torch.arange(p)[None]
    logits, _, _ = model(torch.tensor([ids]), pos, pos, torch.ones(p, p, dtype=torch.bool).tril()[None])
    out = [int(logits[0, -1].argmax())]
    for i in range(p, p + n - 1):
        pos = torch.tensor([[i]])
        logits, _, _ = model(torch.tensor([[out[-1]]]), pos, pos, torch.ones(1, 1, i + 1, dtype=torch.bool))
        out.append(int(logits[0, -1].argmax()))
    return out


@torch.no_grad()
def hf_argmax_along(hf, ids: list[int], continuation: list[int]) -> list[int]:
    """transformers' argmax after each prefix of ids + continuation, in one uncached forward. It equals
    `continuation` exactly when transformers' own greedy decode would produce the same tokens."""
    logits = hf(torch.tensor([ids + continuation[:-1]])).logits[0, len(ids) - 1:]
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def hf_default():
    return load_hf_reference("smollm2-135m")


def test_default_metadata(default_model):
    lm = default_model
    assert lm.name == "smollm2-135m" and lm.source.startswith("gguf:")
    assert lm.model.args.n_layers == 30 and lm.model.args.dim == 576 and lm.model.args.vocab_size == 49152
    assert lm.eos_token_ids == [2, 0]  # <|im_end|> ends a chat turn; <|endoftext|> ends a document
    assert lm.tokenizer.convert_ids_to_tokens(lm.eos_token_ids) == ["<|im_end|>", "<|endoftext|>"]
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                            tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert len(lm.fingerprint) == 16


def test_logits_match_transformers(default_model, hf_default):
    ids = torch.tensor([chat_ids(default_model.tokenizer)])
    n = ids.shape[1]
    model = default_model.model
    model.setup_cache(1, n)
    pos = torch.arange(n)[None]
    with torch.no_grad():
        ours, _, _ = model(ids, pos, pos, torch.ones(n, n, dtype=torch.bool).tril()[None])
        ref = hf_default(ids).logits
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"relative logit error over {n} prompt tokens: {rel:.2e}")
    assert rel < 1e-4


def test_greedy_continuation_matches_transformers(default_model, hf_default):
    ids = chat_ids(default_model.tokenizer)
    ours = greedy(default_model.model, ids, NEW_TOKENS)
    print(repr(default_model.tokenizer.decode(ours)))
    assert hf_argmax_along(hf_default, ids, ours) == ours
    # transformers' generate (the `hf` baseline) agrees up to its EOS stop.
    gen = hf_default.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert gen == ours[:len(gen)]


def test_cached_load_is_fast(default_model):
    t0 = time.perf_counter()
    again = load_model("smollm2-135m")
    seconds = time.perf_counter() - t0
    print(f"cached load of smollm2-135m: {seconds:.2f} s")
    assert again.fingerprint == default_model.fingerprint
    assert seconds <= 3.0
