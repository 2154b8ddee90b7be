"""Concurrency simulation from measured traces: per-user tokens/s and throughput of each policy at
1, 4, … 256 concurrent requests, on this device or on any device with a cost profile.

Why: speculative decoding pays at batch 1, where verifying ℓ extra tokens is almost free, and can
stop paying under load, where it is not; DSpark's scheduler exists to react to that. A sweep can
only measure the batch sizes the machine at hand runs. But every results record carries what the
policy verified and what the target accepted in each round (and DSpark's calibrated confidences),
and `specbench profile` says what a round costs on a device (a GPU's profile serves as well as
this CPU's). Replaying the traces against a profile estimates the load curve anywhere.

What is replayed
----------------
A request is its recorded output length G, prompt length and rounds. Greedy outputs do not depend
on the schedule (every policy is lossless), so only how fast the row walks through its G tokens
changes: a round emits accepted + 1 tokens, cut at G. (Sampled records keep their recorded G.)

* Policies that do not react to load (ar, pld, fixed-k, eagle, dflash, records without
  confidences): each round verifies and accepts what it did in the record.
* DSpark (records with ``trace.confidence``): the policy's own code decides. A DSpark policy object
  (specbench/policies/dspark.py, built from the record's ``policy_params`` and *this* profile; the
  drafter is never called) runs its scheduler (Algorithm 1, capacity, threshold or fixed, from
  specbench/policies/scheduler.py) and its draft gate, if the recorded policy had one, on the replayed
  confidences of all rows sharing the round. A row replays its *drafted* rounds in order (cycling
  if it needs more of them than it recorded). For a replayed round with recorded (ℓ_rec, a_rec):
    - a rejection was observed (a_rec < ℓ_rec): accepted = min(a_rec, ℓ);
    - everything verified was accepted and ℓ ≤ ℓ_rec: accepted = ℓ;
    - ℓ > ℓ_rec: positions ℓ_rec+1..ℓ were never verified, so their outcome is NOT in the record:
      it is DRAWN, position by position, from the calibrated confidences with a seeded RNG
      (stopping at the first failure). `drawn_frac` in the output is the share of verified
      positions decided this way; everything else is measured.
  Round-indexed replay ignores that a row which advances faster meets different text; the
  confidences and outcomes are those of the recorded rounds, in order.
  DSpark with lookup drafts (``policy_params.lookup_ngram``) replays its recorded rounds like the
  policies above: which rows find a lookup depends on the text, which the records do not replay. A
  replayed round in which every row replays a prompt-lookup draft (trace ``lookup``, or for DSpark a
  round without confidences) costs no drafter call, as in the core.

What a round costs (b = rows in the forward, q = 1 + the longest ℓ among them: the core verifies a
right-padded [b, q] batch):
  the profile's ``round`` grid (a whole core round: forward + sampling + acceptance + commit), or,
  in profiles without it, the bare forward grid ``entries`` (then per-round overheads are missing
  and ``overheads_modeled`` is false);
  + the drafter's cost draft(b) in rounds where a drafter ran (the profile's ``draft`` table, or
  ``drafters.json`` beside it, keyed by drafter and device; ``draft_cost_modeled`` says if found).
  Prefill: prefill(rows, longest prompt) from the profile's ``prefill`` points, else left out
  (``prefill_modeled`` false). Not modelled: policy-side Python (pld's n-gram search, DSpark's
  scheduler and context update) and DSpark's per-batch drafter set-up.

Modes
-----
continuous (default)  c slots, refilled as requests finish: newcomers are prefilled together
                      before the next round (the prefill stalls the decoding rows, as in an engine
                      without chunked prefill) and the forward carries only occupied slots. Closed
                      loop: the source requests are cycled until ``requests`` (default
                      max(8·c, available)) have run; turns of a multi-turn prompt count as
                      independent requests. One policy instance serves the whole run (DSpark's
                      gate back-off and stale capacity carry over, as in a long-running engine).
static                mirrors specbench.engine.core.generate: c requests start together (one right-padded
                      prefill), finished rows stay in the forward until the whole batch is done,
                      then the next batch starts, the policy's per-batch state reset (as each
                      generate() call begins one; DSpark's gate keeps its back-off per batch
                      size). Batches are formed as the runner forms them
                      (prompts in workload order, c per batch, turn by turn), so simulating the
                      recorded batch size replays the recorded batches: this is the check against
                      measurement (docs/performance.md, "Simulation vs measurement").

Metrics, as specbench.analysis.stats defines them: per-user tokens/s = (G − 1) / decode time (first token
to last, prefill excluded), median over requests; throughput = Σ G / total time (prefill
included); mean verify length = mean ℓ over every (request, round). Records repeated under the
same key (a file copied twice) count once, as in specbench.analysis.stats.
"""
from __future__ import annotations

import csv
import json
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from specbench import atomic
from specbench.costs.schema import cut_variant
from specbench.errors import UserError

# torch and the policy code are imported where used: the CLI builds this parser for every command.

MODES = ("continuous", "static")
OUT_FILE = "simulation.csv"
SETTINGS_FILE = "simulation.json"
REQUESTS_PER_SLOT = 8  # continuous mode's default closed-loop length: this many requests per slot
COLUMNS = ("policy", "workload", "temperature", "mode", "concurrency", "source_batch_size", "requests",
           "per_user_tok_s", "throughput_tok_s", "mean_verify_len", "tau", "drafted_round_frac", "drawn_frac",
           "rescheduled", "overheads_modeled", "prefill_modeled", "draft_cost_modeled",
           "measured_per_user_tok_s", "measured_throughput_tok_s", "measured_mean_verify_len", "measured_requests")


# ---------------------------------------------------------------------------------------------
# Inputs: traces and the cost profile


def load_traces(path: str | Path) -> tuple[list[dict], list[str]]:
    """Records with a usable per-round trace from a results .jsonl or every *.jsonl under a directory,
    and the policies left out for having none (the transformers baselines record no rounds)."""
    from specbench.bench.runner import read_records

    path = Path(path)
    if not path.exists():
        raise UserError(f"trace path not found: {path}")
    files = sorted(p for p in path.rglob("*.jsonl") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise UserError(f"no *.jsonl results files under {path}")
    records = [r for f in files for r in read_records(f, repair=False)]
    if not records:
        raise UserError(f"no results records in {path}")
    records = list({r["key"]: r for r in reversed(records)}.values())[::-1]  # first seen per key
    usable = [r for r in records if _has_trace(r)]
    if not usable:
        raise UserError(f"no records with per-round traces (trace.verify_len / trace.accepted) in {path}")
    kept = {r["policy"] for r in usable}
    return usable, sorted({str(r.get("policy")) for r in records} - kept)


def _has_trace(rec: dict) -> bool:
    trace = rec.get("trace")
    if not isinstance(trace, dict):
        return False
    v, a = trace.get("verify_len"), trace.get("accepted")
    gen = rec.get("generated_tokens")
    return (isinstance(v, list) and isinstance(a, list) and len(v) == len(a) and isinstance(gen, int)
            and (len(v) > 0 or gen <= 1) and all(k in rec for k in ("policy", "workload", "batch_size")))


@dataclass
class Costs:
    """Seconds of the pieces of a round on the profiled device (module docstring)."""

    round: Callable[[int, int], float]  # (rows, q) → one core round
    step: Callable[[int, int], float]  # (rows, q) → one bare verify forward (what DSpark's scheduler reads)
    prefill: Callable[[int, int], float] | None  # (rows, prompt tokens per row) → seconds
    drafters: dict  # drafter name, or name#variant (a cut draft vocabulary) → (rows → seconds of one drafting round)
    device_name: str
    overheads_modeled: bool


def load_costs(profile_path: str | Path) -> Costs:
    from specbench.costs import profile as profiles
    from specbench.engine.loading import default_cache_dir
    from specbench.costs.schema import DRAFTER_COSTS_FILE, parse_drafter_cost_key, read_profile, split_cost_digest

    path = Path(profile_path)
    if not path.is_file():
        raise UserError(f"cost profile not found: {path}")
    data = read_profile(path)
    step = profiles.step_time_model(data)
    device = str(data.get("device_name", ""))
    drafters = {}
    # drafter costs measured on this profile's device: committed, beside the profile, this machine's cache
    for table in [*(folder / DRAFTER_COSTS_FILE for folder in profiles.committed_profiles()),
                  path.parent / DRAFTER_COSTS_FILE, default_cache_dir() / "profiles" / DRAFTER_COSTS_FILE]:
        try:
            known = json.loads(table.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for key, entries in known.items() if isinstance(known, dict) else ():
            # skip costs of an older checkpoint at the same path when the current one is here to compare with
            name, digest, dev = parse_drafter_cost_key(key)
            current = profiles.drafter_digest(name) if digest else "-"
            checkpoint, variant = split_cost_digest(digest)
            if digest and current != "-" and checkpoint != current:
                continue
            if dev == device and isinstance(entries, list) and entries:
                # a drafter loaded otherwise than saved (a cut draft vocabulary) costs otherwise: its own entry
                drafters[f"{name}#{variant}" if variant else name] = profiles.draft_time_model(entries)
    if data.get("draft"):  # a profile from load_or_measure carries its drafter's cost
        drafters.setdefault(data.get("drafter") or "*", profiles.draft_time_model(data["draft"]))
    return Costs(
        round=profiles.step_time_model({"entries": data["round"]}) if data.get("round") else step,
        step=step,
        prefill=profiles.prefill_time_model(data["prefill"]) if data.get("prefill") else None,
        drafters=drafters, device_name=device, overheads_modeled=bool(data.get("round")),
    )


# ---------------------------------------------------------------------------------------------
# One request being replayed


@dataclass
class _Row:
    rec: dict
    rounds: list  # recorded rounds: (confidences, ℓ_rec, a_rec)
    drafted: list  # the rounds among them in which the drafter ran (have confidences)
    rng: random.Random
    emitted: int = 1  # the first token comes from the prefill
    cursor: int = 0  # next recorded round (replay) or next drafted round (DSpark)
    t_first: float = 0.0
    t_done: float | None = None

    @property
    def generated(self) -> int:
        return int(self.rec["generated_tokens"])

    @property
    def active(self) -> bool:
        return self.emitted < self.generated

    def budget(self) -> int:
        """Drafts the core would still verify for this row (the bonus token takes one)."""
        return max(int(self.rec.get("max_new_tokens") or self.generated) - self.emitted - 1, 0)


def _rounds(rec: dict) -> list[tuple[list[float], int, int, int]]:
    """The recorded rounds: (confidences, ℓ_rec, a_rec, 1 if the row verified a prompt-lookup draft)."""
    trace = rec["trace"]
    conf = trace.get("confidence") or [[] for _ in trace["verify_len"]]
    lookup = trace.get("lookup") or [0] * len(trace["verify_len"])
    return list(zip(conf, trace["verify_len"], trace["accepted"], lookup))


def accepted_at(entry: tuple, length: int, rng: random.Random) -> tuple[int, int]:
    """(accepted, drawn positions) when a recorded round (confidences, ℓ_rec, a_rec, …) verifies `length`."""
    conf, l_rec, a_rec = entry[:3]
    if length <= l_rec or a_rec < l_rec:
        return min(a_rec, length), 0
    a = l_rec
    while a < length and a < len(conf) and rng.random() < conf[a]:
        a += 1
    drawn = min(a + 1, length) - l_rec  # positions decided by a draw (the failing one included)
    return a, drawn


# ---------------------------------------------------------------------------------------------
# Per-round decisions: recorded, or DSpark's on replayed confidences. A decider maps (rows, active)
# to (verify length per row, the recorded round each row replays or None, whether a drafter ran).


def _replay_decider(has_drafter: bool, has_conf: bool):
    def decide(rows: list[_Row], active: list[bool]):
        entries = [r.rounds[r.cursor % len(r.rounds)] if a and r.rounds else None for r, a in zip(rows, active)]
        lengths = [e[1] if e else 0 for e in entries]
        # The drafter ran iff some row took its draft: not a prompt-lookup draft (e[3]), and, with
        # confidences in the trace, one the drafter made (DSpark's gate can skip the drafter).
        drafted = has_drafter and any(e is not None and not e[3] and (not has_conf or e[0]) for e in entries)
        return lengths, entries, drafted

    return decide


def _dspark_policy(params: dict, gamma: int, costs: Costs, drafter_seconds):
    """The DSpark policy object the record was made with, priced by this profile. Its drafter is a
    stub: the simulator calls only the scheduling side (schedule, and the draft gate's update)."""
    from specbench.policies.dspark import DSpark

    stub = SimpleNamespace(args=SimpleNamespace(confidence_head=True, tap_layers=()), block_size=gamma, kind="dspark")
    try:
        return DSpark(stub, scheduler=params.get("scheduler", "algorithm1"), threshold=params.get("threshold", 0.5),
                      step_seconds=costs.step, draft_seconds=drafter_seconds, max_length=gamma,
                      draft_gate=bool(params.get("draft_gate", False)))
    except ValueError as e:
        raise UserError(f"cannot rebuild the DSpark scheduler from the records' policy_params {params}: {e}") from None


def _dspark_decider(policy, gamma: int):
    """DSpark.propose without the drafter (the gate's skip, then the gate's update on this round's
    confidences), then DSpark.schedule, exactly as the core calls them."""
    import torch

    from specbench.engine.policy import Draft

    def decide(rows: list[_Row], active: list[bool]):
        b = len(rows)
        if policy.gate is not None and policy.gate.skip():  # the draft gate: a plain decode step
            return [0] * b, [None] * b, False
        entries = [r.drafted[r.cursor % len(r.drafted)] if a and r.drafted else None for r, a in zip(rows, active)]
        conf = torch.zeros(b, gamma)
        for i, e in enumerate(entries):
            if e is not None:
                conf[i, : min(len(e[0]), gamma)] = torch.tensor(e[0][:gamma], dtype=torch.float32)
        active_t = torch.tensor(active, dtype=torch.bool)
        if policy.gate is not None:
            policy.gate.update(conf, active_t)
        draft = Draft(tokens=torch.zeros(b, gamma, dtype=torch.long), probs=None,
                      lengths=torch.full((b,), gamma, dtype=torch.long), confidence=conf)
        lengths = policy.schedule(draft, SimpleNamespace(active=active_t, batch_size=b)).clamp(max=gamma) * active_t
        return [int(v) for v in lengths.tolist()], entries, True

    return decide


@dataclass
class _Stats:
    rounds: int = 0
    drafted_rounds: int = 0
    row_rounds: int = 0
    verified: int = 0
    drawn: int = 0


def _round(rows: list[_Row], decide, costs: Costs, draft_seconds, clock: float, stats: _Stats) -> float:
    """One round over `rows` (all in the forward); advances the active ones; returns its seconds."""
    active = [r.active for r in rows]
    lengths, entries, drafted = decide(rows, active)
    lengths = [min(v, r.budget()) if a else 0 for v, r, a in zip(lengths, rows, active)]
    seconds = costs.round(len(rows), 1 + max(lengths, default=0))
    if drafted and draft_seconds is not None:
        seconds += draft_seconds(len(rows))
    stats.rounds += 1
    stats.drafted_rounds += int(drafted)
    for r, a, v, e in zip(rows, active, lengths, entries):
        if not a:
            continue
        acc, drawn = accepted_at(e, v, r.rng) if e is not None else (0, 0)
        r.emitted = min(r.emitted + acc + 1, r.generated)
        r.cursor += 1 if e is not None else 0
        stats.row_rounds += 1
        stats.verified += v
        stats.drawn += drawn
        if not r.active:
            r.t_done = clock + seconds
    return seconds


# ---------------------------------------------------------------------------------------------
# The two engines


def _prefill(costs: Costs, rows: list[_Row]) -> float:
    if costs.prefill is None or not rows:
        return 0.0
    return costs.prefill(len(rows), max(int(r.rec.get("prompt_tokens") or 1) for r in rows))


def _finish_at_prefill(rows: list[_Row], clock: float) -> None:
    for r in rows:
        r.t_first = clock
        if not r.active:
            r.t_done = clock


def run_static(batches: list[list[_Row]], make_decider, costs: Costs, draft_seconds, stats: _Stats) -> float:
    """specbench.engine.core.generate, batch after batch; returns the total time."""
    clock = 0.0
    for rows in batches:
        decide = make_decider()  # a batch begins, as each of the runner's generate() calls begins one
        clock += _prefill(costs, rows)
        _finish_at_prefill(rows, clock)
        while any(r.active for r in rows):
            clock += _round(rows, decide, costs, draft_seconds, clock, stats)
    return clock


def run_continuous(stream: list[_Row], slots: int, make_decider, costs: Costs, draft_seconds, stats: _Stats) -> float:
    """`slots` requests in flight, refilled as they finish; returns the total time."""
    clock, waiting, running = 0.0, deque(stream), []
    decide = make_decider()  # one long-running engine
    while waiting or running:
        newcomers = [waiting.popleft() for _ in range(min(slots - len(running), len(waiting)))]
        if newcomers:
            clock += _prefill(costs, newcomers)
            _finish_at_prefill(newcomers, clock)
            running += [r for r in newcomers if r.active]
        if running:
            clock += _round(running, decide, costs, draft_seconds, clock, stats)
            running = [r for r in running if r.active]
    return clock


# ---------------------------------------------------------------------------------------------
# Cells


def runner_order(recs: list[dict], batch_size: int) -> list[list[dict]]:
    """Records grouped into the batches the runner decodes at `batch_size`: prompts in workload
    order (first appearance), `batch_size` prompts per batch, turn by turn; per repeat."""
    out = []
    for rep in sorted({int(r.get("repeat", 0)) for r in recs}):
        mine = [r for r in recs if int(r.get("repeat", 0)) == rep]
        prompts = list(dict.fromkeys(str(r.get("prompt_id")) for r in mine))
        by_turn: dict[tuple[str, int], dict] = {(str(r.get("prompt_id")), int(r.get("turn", 0))): r for r in mine}
        turns = sorted({int(r.get("turn", 0)) for r in mine})
        for i in range(0, len(prompts), batch_size):
            group = prompts[i : i + batch_size]
            for t in turns:
                batch = [by_turn[(p, t)] for p in group if (p, t) in by_turn]
                if batch:
                    out.append(batch)
    return out


def measured(recs: list[dict]) -> dict:
    """Median per-user tokens/s, throughput and mean verify length of real records, defined as the
    simulator defines them (and specbench.analysis.stats, for single-turn workloads)."""
    tps = [r["tokens_per_s"] for r in recs if isinstance(r.get("tokens_per_s"), (int, float)) and r["tokens_per_s"] > 0]
    batches = {r.get("batch_id"): (r.get("batch_generated_tokens") or 0, r.get("batch_wall_s") or 0.0) for r in recs}
    wall = sum(w for _, w in batches.values())
    rounds = sum(len(r["trace"]["verify_len"]) for r in recs)
    return {"measured_per_user_tok_s": statistics.median(tps) if tps else math.nan,
            "measured_throughput_tok_s": sum(t for t, _ in batches.values()) / wall if wall > 0 else math.nan,
            "measured_mean_verify_len": sum(sum(r["trace"]["verify_len"]) for r in recs) / rounds if rounds else math.nan,
            "measured_requests": len(recs)}


def draft_cost(costs: Costs, drafter: str | None, params: dict):
    """rows → seconds of one drafting round for records of `drafter` run with `params` (policy_params), or
    None: the cost measured with the records' cut draft vocabulary and block where there is one, else the
    drafter's."""
    vocab, block = params.get("draft_vocab") or 0, params.get("block") or 0
    # Records give the size drafted from, cut or not; a drafter whose vocabulary was not cut has its cost
    # under the block's variant alone.
    variants = [cut_variant(vocab, block)] + ([cut_variant(0, block)] if block else [])
    cut = next((costs.drafters[k] for v in variants if v and (k := f"{drafter}#{v}") in costs.drafters), None)
    return cut or costs.drafters.get(drafter) or (costs.drafters.get("*") if drafter else None)


def simulate_cell(recs: list[dict], concurrency: int, mode: str, costs: Costs, *, requests: int | None = None,
                  seed: int = 0) -> dict:
    """Simulate one (policy, workload, temperature) group of source records at one concurrency."""
    first = recs[0]
    params = first.get("policy_params") or {}
    drafter = first.get("drafter")
    draft_seconds = draft_cost(costs, drafter, params)
    has_conf = any(r["trace"].get("confidence") for r in recs)
    rescheduled = has_conf and "scheduler" in params and not params.get("lookup_ngram")
    if rescheduled:
        gamma = int(params.get("gamma") or max(len(c) for r in recs for c in r["trace"]["confidence"]))

        policy = _dspark_policy(params, gamma, costs, draft_seconds)

        def make_decider():  # one policy object for every batch, as the runner's engine keeps one
            policy.stale_confidence.clear()  # what DSpark.begin does at each batch
            if policy.gate is not None:
                policy.gate.reset()  # (the gate's back-off memory per batch size stays)
            return _dspark_decider(policy, gamma)
    else:
        def make_decider():
            return _replay_decider(bool(drafter), has_conf)

    order = [r for batch in runner_order(recs, concurrency if mode == "static" else len(recs)) for r in batch]
    n = requests or (max(len(order), concurrency) if mode == "static" else max(len(order), REQUESTS_PER_SLOT * concurrency))
    prepared = {id(r): _rounds(r) for r in order}
    stream = []
    for i in range(n):
        rec = order[i % len(order)]
        rounds = prepared[id(rec)]
        stream.append(_Row(rec=rec, rounds=rounds, drafted=[e for e in rounds if e[0]], rng=random.Random(f"{seed}:{i}")))
    stats = _Stats()
    if mode == "static":
        if n == len(order):  # exactly the source requests: the runner's batches
            groups, k = [], 0
            for batch in runner_order(recs, concurrency):
                groups.append(stream[k : k + len(batch)])
                k += len(batch)
        else:
            groups = [stream[i : i + concurrency] for i in range(0, n, concurrency)]
        total = run_static(groups, make_decider, costs, draft_seconds, stats)
    else:
        total = run_continuous(stream, concurrency, make_decider, costs, draft_seconds, stats)

    tps = [(r.generated - 1) / (r.t_done - r.t_first) for r in stream
           if r.generated > 1 and r.t_done is not None and r.t_done > r.t_first]
    row = {
        "policy": first["policy"], "workload": first["workload"], "temperature": float(first.get("temperature", 0.0)),
        "mode": mode, "concurrency": concurrency, "source_batch_size": int(first["batch_size"]), "requests": n,
        "per_user_tok_s": statistics.median(tps) if tps else math.nan,
        "throughput_tok_s": sum(r.generated for r in stream) / total if total > 0 else math.nan,
        "mean_verify_len": stats.verified / stats.row_rounds if stats.row_rounds else 0.0,
        "tau": sum(r.generated - 1 for r in stream) / stats.row_rounds if stats.row_rounds else math.nan,
        "drafted_round_frac": stats.drafted_rounds / stats.rounds if stats.rounds else 0.0,
        "drawn_frac": stats.drawn / stats.verified if stats.verified else 0.0,
        "rescheduled": rescheduled, "overheads_modeled": costs.overheads_modeled,
        "prefill_modeled": costs.prefill is not None, "draft_cost_modeled": not drafter or draft_seconds is not None,
    }
    return row


def simulate(trace_path, profile_path, concurrencies, modes=("continuous",), **kw) -> list[dict]:
    """`simulate_records` on the records under `trace_path` priced by the profile at `profile_path`."""
    return simulate_records(load_traces(trace_path)[0], load_costs(profile_path), concurrencies, modes, **kw)


def simulate_records(recs: list[dict], costs: Costs, concurrencies, modes=("continuous",), *,
                     requests: int | None = None, source_batch_size: int | None = None, seed: int = 0) -> list[dict]:
    """One output row per (policy, workload, temperature, mode, concurrency). Source traces: the
    records at `source_batch_size` (default: the smallest recorded). Where records at batch size c
    exist, static rows carry their measured per-user tokens/s, throughput and verify length (measured_*)."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r["policy"], r["workload"], float(r.get("temperature", 0.0))), []).append(r)
    rows = []
    for (policy, workload, temp), group in sorted(groups.items()):
        sizes = sorted({int(r["batch_size"]) for r in group})
        src = source_batch_size or sizes[0]
        if src not in sizes:
            raise UserError(f"{policy}/{workload}: no records at batch size {src} (recorded: {', '.join(map(str, sizes))})")
        source = [r for r in group if int(r["batch_size"]) == src]
        for mode in modes:
            for c in concurrencies:
                row = simulate_cell(source, c, mode, costs, requests=requests, seed=seed)
                real = [r for r in group if int(r["batch_size"]) == c]
                if mode == "static" and real:  # what a static engine measured at this batch size
                    row.update(measured(real))
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Output, CLI


def write_outputs(rows: list[dict], out_dir: Path, settings: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / OUT_FILE
    with atomic.replacing(csv_path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items() if k in COLUMNS})
    atomic.write_json(out_dir / SETTINGS_FILE, settings, indent=2)
    return csv_path


def format_table(rows: list[dict]) -> str:
    head = f"{'policy':<12} {'workload':<10} {'mode':<10} {'c':>4} {'tok/s/user':>10} {'throughput':>10} {'ℓ':>5} {'τ':>5}"
    lines = [head]
    for r in rows:
        meas = ""
        if r.get("measured_requests"):
            meas = f"   measured {r['measured_per_user_tok_s']:.1f} / {r['measured_throughput_tok_s']:.1f}"
        lines.append(f"{r['policy']:<12} {r['workload']:<10} {r['mode']:<10} {r['concurrency']:>4} "
                     f"{r['per_user_tok_s']:>10.1f} {r['throughput_tok_s']:>10.1f} {r['mean_verify_len']:>5.2f} "
                     f"{r['tau']:>5.2f}{meas}")
    return "\n".join(lines)
