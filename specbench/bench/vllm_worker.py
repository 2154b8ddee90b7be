"""The vLLM side of the ``vllm*`` peer baselines: one vLLM engine, driven over JSON lines.

Run as a script by :mod:`specbench.bench.vllm_engine` under the Python that has vLLM installed
(``SPECBENCH_VLLM_PYTHON``, see ``scripts/setup_vllm.sh``). It imports nothing from specbench
(that Python need not have the suite's dependencies), and the suite's Python need not have vLLM.

Protocol: one JSON object per line on stdin, one reply per line on stdout (vLLM's own logs go
to stderr, which the suite passes through to a log file). Every reply has ``ok``; a failed
request gets ``{"ok": false, "error": "<one line>"}`` and the worker keeps serving.

* ``{"op": "init", "engine_args": {...}}`` → builds ``vllm.LLM(**engine_args)`` once and replies
  ``{"ok": true, "vllm_version", "dtype", "device", "max_num_seqs", "num_speculative_tokens"}``.
* ``{"op": "generate", "prompts": [[ids]...], "max_tokens", "temperature", "top_p", "seed",
  "stop_token_ids"}`` → submits every prompt together (the batch is the concurrency), and
  replies ``{"ok": true, "wall_s", "outputs": [{"ids", "finish_reason", "ttft_s",
  "decode_s"}...], "counters_before", "counters_after"}``; counters are vLLM's spec-decode
  Prometheus counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
  ``accepted_per_pos``), read with ``LLM.get_metrics()`` just before and just after the call.
* ``{"op": "shutdown"}`` → replies and exits.

vLLM starts worker processes itself, so everything runs under ``if __name__ == "__main__"``.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

COUNTER_NAMES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (zeros / [] when the engine does not speculate)."""
    counters = {short: 0 for short in COUNTER_NAMES.values()}
    counters["accepted_per_pos"] = []
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in COUNTER_NAMES:
            counters[COUNTER_NAMES[name]] += int(metric.value)
        elif name == PER_POSITION_NAME:
            values = [int(v) for v in metric.values]
            acc = counters["accepted_per_pos"]
            acc.extend([0] * (len(values) - len(acc)))
            for k, v in enumerate(values):
                acc[k] += v
    return counters


def request_timing(output) -> tuple[float | None, float | None]:
    """(ttft_s, decode_s: first token → last token) from vLLM's per-request stats, when given."""
    m = getattr(output, "metrics", None)
    if m is None:
        return None, None
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    latency = getattr(m, "first_token_latency", None)
    decode = last - first if first and last and last >= first else None
    return (float(latency) if latency else None), decode


class Worker:
    def __init__(self):
        self.llm = None
        self.engine_args = None

    def init(self, msg: dict) -> dict:
        import vllm
        from vllm import LLM

        args = dict(msg["engine_args"])
        args.setdefault("disable_log_stats", False)  # the spec-decode counters need stats on
        self.llm = LLM(**args)
        self.engine_args = args
        config = self.llm.llm_engine.vllm_config
        spec = config.speculative_config
        return {
            "ok": True,
            "vllm_version": vllm.__version__,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "device": str(config.device_config.device),
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "num_speculative_tokens": spec.num_speculative_tokens if spec is not None else 0,
        }

    def generate(self, msg: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        temperature = float(msg["temperature"])
        params = SamplingParams(
            max_tokens=int(msg["max_tokens"]),
            temperature=temperature,
            top_p=float(msg["top_p"]) if temperature > 0 else 1.0,
            top_k=0 if temperature > 0 else -1,
            seed=int(msg["seed"]) if temperature > 0 else None,
            stop_token_ids=[int(t) for t in msg.get("stop_token_ids", [])],
            ignore_eos=False,
            skip_special_tokens=False,
            detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in msg["prompts"]]
        before = read_counters(self.llm)
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = read_counters(self.llm)
        rows = []
        for out in outputs:
            completion = out.outputs[0]
            ttft, decode = request_timing(out)
            rows.append({"ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
                         "ttft_s": ttft, "decode_s": decode})
        return {"ok": True, "wall_s": wall, "outputs": rows, "counters_before": before, "counters_after": after}


def serve(stdin, stdout) -> None:
    worker = Worker()
    for line in stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "init":
                reply = worker.init(msg)
            elif op == "generate":
                if worker.llm is None:
                    raise RuntimeError("generate before init")
                reply = worker.generate(msg)
            elif op == "shutdown":
                stdout.write(json.dumps({"ok": True}) + "\n")
                stdout.flush()
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # any failure is one line for the suite; the trace goes to the log
            traceback.print_exc(file=sys.stderr)
            first = (str(e).strip().splitlines() or [""])[0]
            reply = {"ok": False, "error": f"{type(e).__name__}: {first}"[:500]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


if __name__ == "__main__":
    # vLLM prints to stdout in places; keep the protocol on a private copy of the real stdout.
    import os

    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, protocol)
