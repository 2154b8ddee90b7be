"""Peer baselines: transformers' own generation, run as pseudo-policies so they land in the same
records and the same statistics as specbench's policies.

* ``hf`` — ``model.generate`` on the transformers reference model with the target's weights
  (:func:`specbench.engine.loading.load_hf_reference`), greedy or sampled with the same temperature /
  top-p (top-k off); any batch size, prompts left-padded.
* ``hf-assisted`` — transformers assisted generation, ``assistant_model=`` a draft LM in
  transformers form: by default the same draft the ``fixed-k`` policy uses (its spec's
  ``drafter``: ``truncate:N`` = the target's first N layers, ``self``, or a trained draft-LM
  checkpoint), drafting a constant ``k`` tokens per round (``num_assistant_tokens_schedule =
  "constant"``, confidence-based early stop off), as fixed-k does. Batch size 1 only.
* ``hf-pld`` — transformers prompt-lookup decoding (``prompt_lookup_num_tokens=k``,
  ``max_matching_ngram_size=max_ngram``). Batch size 1 only. (transformers takes the first
  n-gram match left to right; specbench's ``pld`` the most recent one, so their drafts differ.)

Records have the same fields as the core's, with these differences (docs/records.md):

* timing: ``time.perf_counter`` around ``generate`` only. ``ttft_s`` is null (a separate 1-token
  generate to measure it is not done); ``decode_s`` is the whole generate call, prefill included,
  and ``tokens_per_s = generated_tokens / decode_s`` (the first token counts, since its prefill
  is in the time). At batch size > 1 every row gets the batch's time (transformers returns all
  rows together).
* tokens are counted from the returned ids: the prompt and padding are excluded, and a row is
  cut after its first EOS id (the same EOS ids the core stops at).
* ``hf``: ``rounds = generated_tokens − 1`` (one target forward per token after prefill),
  ``drafted = accepted = 0``.
* ``hf-assisted`` / ``hf-pld``: transformers verifies the first drafts in the prefill forward, so
  ``rounds`` counts every target forward and ``tau = generated_tokens / rounds``. Per round,
  drafted = tokens the target verified beyond the anchor (read with a forward pre-hook) and
  accepted = tokens emitted − 1 (read with a streamer); a last round cut by EOS or the token
  budget may count one accepted draft fewer than the core would.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from specbench.engine.core import BatchResult, RequestResult, SamplingConfig
from specbench.errors import UserError
from specbench.bench.engines import Engine
from specbench.bench.peers import PeerRequestResult, add_round, fixed_k_defaults, hf_draft_model, merge_params  # noqa: F401 (re-exported)

BASELINES = {
    "hf": "transformers generate() on the same weights (any batch size, left padding)",
    "hf-assisted": "transformers assisted generation with the fixed-k draft LM as assistant_model (batch size 1)",
    "hf-pld": "transformers prompt-lookup decoding, prompt_lookup_num_tokens (batch size 1)",
}
BATCH1_ONLY = ("hf-assisted", "hf-pld", "llama-cpp", "llama-cpp-pld")


def _vllm_baselines() -> dict:
    from specbench.bench.vllm_engine import VLLM_BASELINES

    return VLLM_BASELINES


def _llamacpp_baselines() -> dict:
    from specbench.bench.llamacpp_engine import LLAMACPP_BASELINES

    return LLAMACPP_BASELINES


# vLLM's engines (specbench/bench/vllm_engine.py) and llama.cpp's (specbench/bench/llamacpp_engine.py) plug in
# at the same seam; vLLM runs in its own Python and llama_cpp is imported only when one is made.
BASELINES.update(_vllm_baselines())
BASELINES.update(_llamacpp_baselines())



def default_params(name: str) -> dict:
    if name in _vllm_baselines():
        from specbench.bench import vllm_engine

        return vllm_engine.default_params(name)
    if name in _llamacpp_baselines():
        from specbench.bench import llamacpp_engine

        return llamacpp_engine.default_params(name)
    if name == "hf":
        return {}
    if name == "hf-assisted":
        d = fixed_k_defaults()
        return {"k": int(d.get("k", 4)), "drafter": str(d.get("drafter", "truncate:8"))}
    if name == "hf-pld":
        return {"k": 4, "max_ngram": 3}
    raise UserError(f"unknown baseline {name!r} (valid: {', '.join(BASELINES)})")



def check_params(name: str, overrides: dict) -> dict:
    """Defaults merged with `overrides`; UserError for unknown names or bad values."""
    if name in _vllm_baselines():
        from specbench.bench import vllm_engine

        return vllm_engine.check_params(name, overrides)
    if name in _llamacpp_baselines():
        from specbench.bench import llamacpp_engine

        return llamacpp_engine.check_params(name, overrides)
    params = merge_params(name, default_params(name), overrides)
    for key in ("k", "max_ngram"):
        if key in params and (isinstance(params[key], bool) or not isinstance(params[key], int) or params[key] < 1):
            raise UserError(f"baseline {name!r}: {key} must be a positive integer, got {params[key]!r}")
    if "drafter" in params and not isinstance(params["drafter"], str):
        raise UserError(f"baseline {name!r}: drafter must be a string, got {params['drafter']!r}")
    return params


def check_ready(name: str) -> None:
    """UserError (one line) when the baseline's engine is not installed, before any model loads."""
    if name in _vllm_baselines():
        from specbench.bench.vllm_engine import find_vllm_python

        find_vllm_python()
    if name in _llamacpp_baselines():
        from specbench.bench.llamacpp_engine import check_installed

        check_installed()


def check_batch_size(name: str, batch_size: int) -> None:
    if name in BATCH1_ONLY and batch_size != 1:
        why = "one llama.cpp context decodes one sequence" if name.startswith("llama-cpp") else \
            "transformers' assisted generation does not batch"
        raise UserError(f"{name} runs at batch size 1 only ({why}), got batch size {batch_size}")



@dataclass
class HFRequestResult(PeerRequestResult):
    """transformers' generate: no TTFT, and decode_s includes the prefill (so the first token counts)."""

    @property
    def tokens_per_s(self):
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else None


class _Recorder:
    """Streamer (tokens emitted per round) + forward pre-hook (tokens per target forward)."""

    def __init__(self):
        self.puts: list[int] = []
        self.forward_lengths: list[int] = []

    # streamer protocol
    def put(self, value):
        self.puts.append(int(value.shape[-1]) if value.dim() else 1)

    def end(self):
        pass

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is not None:
            self.forward_lengths.append(int(ids.shape[-1]))


def _cut(ids: list[int], eos: set[int], max_new: int) -> tuple[list[int], str]:
    ids = ids[:max_new]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1], "eos"
    return ids, "length"


class HFEngine(Engine):
    def __init__(self, name: str, hf_model, params: dict, pad_id: int, assistant=None, drafter: str | None = None):
        self.name, self._params = name, params
        self.hf_model, self.assistant, self.pad_id = hf_model, assistant, pad_id
        self.drafter = drafter
        self.max_batch_size = 1 if name in BATCH1_ONLY else None

    def params(self) -> dict:
        return {k: v for k, v in self._params.items() if k != "drafter"}

    def _generation_config(self, config: SamplingConfig, eos_ids):
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=config.max_new_tokens, min_new_tokens=0, num_beams=1,
                  eos_token_id=list(eos_ids) or None, pad_token_id=self.pad_id,
                  repetition_penalty=1.0, no_repeat_ngram_size=0)
        if config.temperature > 0:
            kw.update(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=0)
        else:
            kw.update(do_sample=False)
        if self.name == "hf-pld":
            kw.update(prompt_lookup_num_tokens=self._params["k"], max_matching_ngram_size=self._params["max_ngram"])
        return GenerationConfig(**kw)

    @torch.inference_mode()
    def decode(self, prompts, config, eos_ids):
        b = len(prompts)
        if self.max_batch_size is not None and b > self.max_batch_size:
            check_batch_size(self.name, b)
        device = self.hf_model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        gen_config = self._generation_config(config, eos_ids)
        kwargs = {}
        rec = _Recorder() if self.name in BATCH1_ONLY else None
        handle = None
        if rec is not None:
            kwargs["streamer"] = rec
            handle = self.hf_model.register_forward_pre_hook(rec.hook, with_kwargs=True)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        torch.manual_seed(config.seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            out = self.hf_model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen_config, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        eos = set(int(e) for e in eos_ids)
        results = []
        for r, p in enumerate(prompts):
            ids, reason = _cut(out[r, width:].tolist(), eos, config.max_new_tokens)
            res = HFRequestResult(output_ids=ids, prompt_tokens=len(p), finish_reason=reason, decode_s=wall)
            if rec is None:
                res.rounds = max(len(ids) - 1, 0)
                res.drafted = res.accepted = 0
                res.tau_value = 1.0 if res.rounds else None
            else:
                _assisted_counters(res, rec, len(p))
            results.append(res)
        return BatchResult(requests=results, wall_s=wall)


def _assisted_counters(res: HFRequestResult, rec: _Recorder, prompt_len: int) -> None:
    emitted = rec.puts[1:]  # the first put is the prompt
    lengths = rec.forward_lengths
    n = min(len(emitted), len(lengths))
    if n == 0:
        return
    res.rounds, res.drafted, res.accepted = n, 0, 0
    remaining = res.generated_tokens  # rounds past our EOS cut (should not happen) count nothing
    for i in range(n):
        drafted = max(lengths[i] - (prompt_len if i == 0 else 1), 0)
        e = min(emitted[i], remaining)
        remaining -= e
        add_round(res, drafted, max(min(e - 1, drafted), 0))
    res.tau_value = res.generated_tokens / n



# ---------------------------------------------------------------------------------------------
# Building



def make_baseline(name: str, target, overrides: dict) -> HFEngine:
    """An engine for baseline `name` on `target` (a LoadedModel: its `path` holds the HF weights)."""
    if name in _vllm_baselines():
        from specbench.bench.vllm_engine import make_vllm_baseline

        return make_vllm_baseline(name, target, overrides, device=str(target.model.device))
    if name in _llamacpp_baselines():
        from specbench.bench.llamacpp_engine import make_llamacpp_baseline

        return make_llamacpp_baseline(name, target, overrides, device=str(target.model.device))
    from transformers.utils import logging as hf_logging

    from specbench.engine.loading import load_hf_reference

    params = check_params(name, overrides)
    # transformers' per-call notices (e.g. assisted generation's own generate() deprecation note) and
    # weight-loading bars would drown the run's progress; errors still show.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = target.model.device
    dtype = target.model.lm_head.weight.dtype
    hf = load_hf_reference(str(target.path), device=device, dtype=dtype)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = hf.generation_config.pad_token_id
    if pad is None:
        pad = list(target.eos_token_ids)[0] if target.eos_token_ids else 0
    assistant, drafter = None, None
    if name == "hf-assisted":
        drafter = params["drafter"]
        assistant = hf_draft_model(drafter, target, hf)
        g = assistant.generation_config
        g.num_assistant_tokens = params["k"]
        g.num_assistant_tokens_schedule = "constant"
        g.assistant_confidence_threshold = 0.0
    return HFEngine(name, hf, params, int(pad), assistant=assistant, drafter=drafter)
