"""Build realistic synthetic results records (docs/records.md) for stats/report tests.

The records are internally consistent: each speculative request is simulated round by round
(draft length per round, a geometric run of accepted drafts, bonus token), so ``rounds``,
``drafted``, ``accepted``, the per-position lists and ``tau`` agree; tokens/s follows from a
per-round cost model with per-prompt lognormal noise; batches share ``batch_id``,
``batch_wall_s`` and ``batch_generated_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

# Per-token acceptance probability by policy and category (unknown categories use "default").
ALPHA = {
    "pld": {"default": 0.45, "code": 0.7, "summarization": 0.65, "writing": 0.3},
    "fixed-k": {"default": 0.65, "code": 0.75, "summarization": 0.6, "writing": 0.55},
    "eagle": {"default": 0.75},
}
# Draft length per round (max); pld drafts 0..K depending on whether an n-gram matched.
K = {"pld": 4, "fixed-k": 4, "eagle": 6}
# Cost of one verify round relative to one AR step, by batch size (verify gets dearer with b).
VERIFY_COST = {1: 1.25, 2: 1.4, 4: 1.7, 8: 2.3}
DRAFT_COST = {"pld": 0.02, "fixed-k": 0.25, "eagle": 0.12}

ENV = {
    "python": "3.11.9",
    "torch": "2.4.1+cpu",
    "transformers": "4.46.3",
    "device_name": "Fake CPU (2 cores)",
    "cpu_count": 2,
    "git_commit": "0000000deadbeef",
    "hostname": "testhost",
    "time": "2025-01-01T00:00:00Z",
}


def _simulate(rng, policy, alpha, k, n_tokens):
    """Round-by-round simulation; returns counters matching the records schema."""
    rounds = drafted = accepted = 0
    dpp = [0] * k
    app = [0] * k
    emitted = 1  # the prefill's first token
    while emitted < n_tokens:
        if policy == "pld":
            q = int(rng.integers(0, k + 1)) if rng.random() < 0.7 else 0
        else:
            q = k
        a = 0
        while a < q and rng.random() < alpha:
            a += 1
        a = min(a, n_tokens - emitted - 1)
        rounds += 1
        drafted += q
        accepted += a
        for j in range(q):
            dpp[j] += 1
        for j in range(a):
            app[j] += 1
        emitted += a + 1
    return dict(rounds=rounds, drafted=drafted, accepted=accepted, drafted_per_position=dpp, accepted_per_position=app)


def make_records(
    workloads: Mapping[str, Iterable[str]] | None = None,
    policies: Iterable[str] = ("ar", "pld", "fixed-k"),
    batch_sizes: Iterable[int] = (1, 4),
    n_prompts: int = 12,
    repeats: int = 1,
    turns: Mapping[str, int] | None = None,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    noise: float = 0.08,
) -> list[dict]:
    """Synthetic records for every workload × policy × batch size × repeat × prompt × turn.

    ``workloads`` maps a workload name to its categories; prompts cycle through them.
    ``turns`` maps workload → number of turns (default 1).
    """
    workloads = workloads or {"humaneval": ["code"], "specbench": ["writing", "summarization", "math"]}
    turns = turns or {}
    rng = np.random.default_rng(seed)
    out = []
    for wl, cats in workloads.items():
        cats = list(cats)
        # per-prompt base AR rate (the prompt's length etc. shift every policy alike)
        base = {i: float(rng.lognormal(np.log(9.0), 0.15)) for i in range(n_prompts)}
        for b in batch_sizes:
            for rep in range(repeats):
                for pol in policies:
                    batch_no = 0
                    for t in range(turns.get(wl, 1)):
                        ids = list(range(n_prompts))
                        for start in range(0, n_prompts, b):
                            group = ids[start : start + b]
                            # the runner's format (runner.py::iter_group): the pairing of batches relies on it
                            batch_id = f"{wl}|b{b}|t{temperature:g}|s0|r{rep}|batch{start // b}|turn{t}|{pol}"
                            batch_no += 1
                            recs = []
                            for i in group:
                                cat = cats[i % len(cats)]
                                n_tok = int(rng.integers(max_new_tokens // 2, max_new_tokens + 1))
                                finish = "length" if n_tok == max_new_tokens else "eos"
                                ar_step = 1.0 / (base[i] * (0.9 ** np.log2(b)))  # s per AR token, per user
                                if pol == "ar":
                                    sim = dict(rounds=n_tok - 1, drafted=0, accepted=0, drafted_per_position=[], accepted_per_position=[])
                                    step_cost = ar_step
                                else:
                                    alpha = ALPHA.get(pol, {}).get(cat, ALPHA.get(pol, {}).get("default", 0.5))
                                    sim = _simulate(rng, pol, alpha, K.get(pol, 4), n_tok)
                                    step_cost = ar_step * (VERIFY_COST.get(b, 1.0 + 0.15 * b) + DRAFT_COST.get(pol, 0.1))
                                decode_s = max(sim["rounds"], 1) * step_cost * float(rng.lognormal(0.0, noise))
                                tau = (n_tok - 1) / sim["rounds"] if sim["rounds"] else 1.0
                                ttft = float(0.05 * b * rng.lognormal(0, 0.05))
                                rec = {
                                    "key": f"{pol}|{wl}|p{i}|{t}|{b}|{temperature}|{seed}|{rep}",
                                    "policy": pol,
                                    "policy_params": {} if pol == "ar" else {"K": K.get(pol, 4)},
                                    "workload": wl,
                                    "prompt_id": f"p{i}",
                                    "category": cat,
                                    "turn": t,
                                    "batch_size": b,
                                    "batch_id": batch_id,
                                    "repeat": rep,
                                    "temperature": temperature,
                                    "top_p": 1.0,
                                    "seed": seed,
                                    "max_new_tokens": max_new_tokens,
                                    "target": "SmolLM2-135M-Instruct",
                                    "drafter": "fake-drafter" if pol in ("fixed-k", "eagle") else None,
                                    "device": "cpu",
                                    "prompt_tokens": int(rng.integers(20, 200)),
                                    "generated_tokens": n_tok,
                                    "output_ids": [int(x) for x in rng.integers(0, 49152, n_tok)],
                                    "finish_reason": finish,
                                    **sim,
                                    "tau": tau,
                                    "ttft_s": ttft,
                                    "decode_s": decode_s,
                                    "tokens_per_s": (n_tok - 1) / decode_s,
                                    "env": dict(ENV),
                                }
                                recs.append(rec)
                            wall = max(r["ttft_s"] + r["decode_s"] for r in recs)
                            tot = sum(r["generated_tokens"] for r in recs)
                            for r in recs:
                                r["batch_wall_s"] = wall
                                r["batch_generated_tokens"] = tot
                            out.extend(recs)
    return out


def write_records(path: str | Path, records: Iterable[Mapping]) -> Path:
    """Write records as jsonlines (one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def rec(policy, prompt_id, tps, *, workload="w", batch_size=1, temperature=0.0, turn=0, repeat=0, **kw):
    """A minimal record with the fields the analysis reads."""
    r = {
        "key": f"{policy}|{workload}|{prompt_id}|{turn}|{batch_size}|{temperature}|0|{repeat}",
        "policy": policy, "workload": workload, "prompt_id": prompt_id, "category": kw.pop("category", workload),
        "turn": turn, "batch_size": batch_size, "temperature": temperature, "repeat": repeat,
        "tokens_per_s": tps, "generated_tokens": 33, "decode_s": 32 / tps,
        "batch_id": kw.pop("batch_id", f"{policy}-{workload}-{prompt_id}-{turn}-{repeat}-{batch_size}"),
        "batch_wall_s": 32 / tps + 0.1, "batch_generated_tokens": 33,
        "rounds": 32, "drafted": 0, "accepted": 0, "tau": 1.0,
        "drafted_per_position": [], "accepted_per_position": [],
    }
    r.update(kw)
    return r
