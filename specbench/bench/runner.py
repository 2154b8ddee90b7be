"""Layer 5: the runner. Sweeps policy × workload × batch size × temperature × repeat and appends one
results record per request (docs/records.md) to a jsonlines file.

Terms
-----
* **Engine**: something that decodes a batch of token-id prompts and returns a
  :class:`specbench.engine.core.BatchResult`: a core policy (:class:`PolicyEngine`) or a peer baseline
  (:mod:`specbench.bench.baselines`). The runner only sees engines, so targets, tokenizers and policies
  can be injected (tests use tiny random models and a fake tokenizer).
* **Target**: any object with ``model`` (our Transformer), ``tokenizer`` (``apply_chat_template``,
  ``encode``, ``decode``), ``name`` and ``eos_token_ids``: a :class:`specbench.engine.loading.LoadedModel`
  or a stub.
* **Cell** = (policy, workload, batch_size, temperature, repeat).
* **Group** = (workload, batch_size, temperature, repeat): the cells of all policies that share
  it are run together, interleaved.

Order (drift hits all policies alike)
-------------------------------------
For each workload, batch size, temperature and repeat, the requests are cut into batches of
``batch_size`` in workload order (the last batch may be smaller). For each batch, for each turn,
every policy decodes the same rows before the runner moves on (ABAB...), and the policy order
rotates by one per batch (batch 0: A B C, batch 1: B C A, ...). Turn t+1's prompt holds the
model's own answer to turn t (that policy's answer: at temperature > 0 policies may differ).

Seeds
-----
Every decode call gets ``batch_seed = derive_seed(seed, repeat, batch_index, turn)``, the same for
every policy, so a prompt gets the same seed under every policy. Records carry the user's
``seed`` (in the key) and the derived ``batch_seed``.

Warm-up
-------
Before the first timed decode of each (policy, batch size) in a process, the runner decodes that
batch once with at most ``WARMUP_TOKENS`` new tokens and discards the result.

Records, resume
---------------
Each record is written with ``f.write(json.dumps(rec) + "\\n"); f.flush(); os.fsync(...)`` as its
batch completes. On start the runner reads the existing file: a truncated last line (a kill
mid-write) is dropped and the file rewritten without it atomically (temp file + rename); any
other malformed line is an error. Records whose ``key`` is present are not redone:

* a (batch, turn) whose keys are all present is skipped (its stored ``output_ids`` feed the next
  turn's history);
* a (batch, turn) with some keys present and some missing is decoded again as a whole (the batch
  composition is part of the measurement), but only the missing keys are written; the rerun's
  records share ``batch_id`` with the first run's, so throughput (which takes one record per
  ``batch_id``) counts the batch once.

Existing records of the same policy and workload must have been made with the same target,
max_new_tokens, top_p, policy parameters and device; otherwise the runner refuses (UserError).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from specbench import atomic
from specbench.bench import baselines
from specbench.bench.engines import Engine, PolicyEngine
from specbench.engine.core import BatchResult, SamplingConfig
from specbench.engine.cuda_graphs import uses_cuda_graphs
from specbench.errors import UserError
from specbench.bench.workloads import Workload, render_prompt

WARMUP_TOKENS = 4

# Fields that must agree between existing records and a new run of the same (policy, workload).
_CONSISTENT = ("target", "max_new_tokens", "top_p", "policy_params", "drafter", "device", "dtype")


# ---------------------------------------------------------------------------------------------
# Engines


def make_engine(name: str, target, overrides: dict | None = None) -> Engine:
    """The engine for a policy name / spec path, or a peer baseline (``hf``, ``hf-assisted``, ``hf-pld``)."""
    if name in baselines.BASELINES:
        return baselines.make_baseline(name, target, overrides or {})
    from specbench.policies.registry import build_policy

    policy = build_policy(name, target, overrides)
    return PolicyEngine(target.model, policy)


# ---------------------------------------------------------------------------------------------
# Keys, seeds, records


def format_temperature(t: float) -> str:
    return f"{float(t):g}"


def record_key(policy: str, workload: str, prompt_id: str, turn: int, batch_size: int,
               temperature: float, seed: int, repeat: int) -> str:
    """`policy|workload|prompt_id|turn|batch_size|temperature|seed|repeat` (temperature as %g)."""
    return "|".join(map(str, (policy, workload, prompt_id, turn, batch_size, format_temperature(temperature), seed, repeat)))


def derive_seed(seed: int, repeat: int, batch_index: int, turn: int = 0) -> int:
    """Deterministic 63-bit seed of one decode call; the same for every policy."""
    h = hashlib.sha256(f"specbench:{seed}:{repeat}:{batch_index}:{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _finite(x):
    """NaN/inf → None (strict JSON), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _trace(res) -> dict:
    trace = {"verify_len": list(res.trace_verify_len), "accepted": list(res.trace_accepted)}
    confidence = getattr(res, "trace_confidence", None)  # policies with a confidence head (DSpark)
    if confidence and any(confidence):
        trace["confidence"] = list(confidence)
    lookup = getattr(res, "trace_lookup", None)  # policies with prompt-lookup drafts (policies/pld.py)
    if lookup and any(lookup):
        trace["lookup"] = list(lookup)
    return trace


def make_record(res, *, key: str, engine: Engine, workload: Workload, request, turn: int, batch_size: int,
                batch_rows: int, batch_id: str, batch: BatchResult, temperature: float, top_p: float, seed: int,
                batch_seed: int, repeat: int, max_new_tokens: int, target_name: str, device: str,
                env: dict | None, dtype: str | None = None, cuda_graphs: bool = False) -> dict:
    """One results record (docs/records.md) from a core or baseline RequestResult."""
    rec = {
        "key": key,
        "policy": engine.name,
        "policy_params": engine.params(),
        "workload": workload.name,
        "prompt_id": request.prompt_id,
        "category": request.category,
        "turn": turn,
        "batch_size": batch_size,
        "batch_rows": batch_rows,
        "batch_id": batch_id,
        "repeat": repeat,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "seed": seed,
        "batch_seed": batch_seed,
        "max_new_tokens": max_new_tokens,
        "target": target_name,
        "drafter": engine.drafter,
        "device": device,
        "dtype": dtype,
        "cuda_graphs": cuda_graphs,
        "prompt_tokens": res.prompt_tokens,
        "generated_tokens": res.generated_tokens,
        "output_ids": list(res.output_ids),
        "finish_reason": res.finish_reason,
        "rounds": res.rounds,
        "drafted": res.drafted,
        "accepted": res.accepted,
        "drafted_per_position": res.drafted_per_position,
        "accepted_per_position": res.accepted_per_position,
        "tau": res.tau,
        "ttft_s": res.ttft_s,
        "decode_s": res.decode_s,
        "tokens_per_s": res.tokens_per_s,
        "batch_wall_s": batch.wall_s,
        "batch_generated_tokens": batch.generated_tokens,
        "trace": _trace(res),
        "env": env or {},
    }
    return _finite(rec)


# ---------------------------------------------------------------------------------------------
# Results file: read (with repair), append


def read_records(path: str | Path, repair: bool = True) -> list[dict]:
    """Records of an existing results file ([] if it does not exist).

    A last line without its newline that is not valid JSON is what a kill mid-write leaves: it is
    dropped and (``repair=True``) the file is rewritten without it, atomically. A complete last
    line that only lacks its newline gets one. Any other bad line raises UserError with its number.
    """
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise UserError(f"results path {path} is not a file")
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records, dirty = [], False
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        records.append(_parse_record(line, path, i))
    if tail.strip():
        try:
            records.append(_parse_record(tail, path, len(lines) + 1))
        except UserError:
            pass  # truncated by a kill: drop it
        dirty = True
    if dirty and repair:
        atomic.write_text(path, "".join(json.dumps(rec) + "\n" for rec in records))
    return records


def _parse_record(line: bytes, path: Path, lineno: int) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {lineno}: malformed results record (column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: line {lineno}: malformed results record ({e})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
        raise UserError(f"{path}: line {lineno}: not a results record (a JSON object with a 'key')")
    return rec


class RecordWriter:
    """Append-only jsonlines writer: one line per record, flushed and fsynced; opened lazily so a
    run that fails before its first record leaves no file behind."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = None
        self.written = 0

    def write(self, rec: dict) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.written += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# The sweep


@dataclass
class SweepResult:
    path: Path
    written: int = 0
    skipped: int = 0
    keys: list[str] = field(default_factory=list)  # every key this sweep covers, in order


@dataclass
class _Ctx:
    target: object
    seed: int
    top_p: float
    max_new_tokens: int | None  # None: each workload's own
    device: str
    env: dict | None
    done: dict  # key -> output_ids of records already present
    warmup: bool
    warmed: set = field(default_factory=set)
    on_decode: Callable | None = None  # test hook: called (engine name, batch_index, turn, warmup)

    @property
    def dtype(self) -> str | None:
        return target_dtype(self.target)


def _batches(workload: Workload, batch_size: int) -> list[list]:
    reqs = workload.requests
    return [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]


def _n_turns(workload: Workload) -> int:
    return max((len(r.turns) for r in workload.requests), default=0)


def _rotate(engines: list[Engine], i: int) -> list[Engine]:
    if not engines:
        return []
    i %= len(engines)
    return engines[i:] + engines[:i]


def _decode_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _group_keys(engines, workload, batch_size, temperature, repeat, seed) -> list[str]:
    return [record_key(e.name, workload.name, r.prompt_id, t, batch_size, temperature, seed, repeat)
            for e in engines for r in workload.requests for t in range(len(r.turns))]


def iter_group(ctx: _Ctx, engines: list[Engine], workload: Workload, batch_size: int, temperature: float,
               repeat: int) -> Iterator[tuple[str, dict | None]]:
    """Run every engine over one group, interleaved; yields (key, record) per request as each batch
    completes, and (key, None) for requests skipped because already done."""
    if batch_size < 1:
        raise UserError(f"batch size must be positive, got {batch_size}")
    for e in engines:
        if e.max_batch_size is not None and batch_size > e.max_batch_size:
            raise UserError(f"{e.name} runs at batch size ≤ {e.max_batch_size} only, got {batch_size}")
    tok = ctx.target.tokenizer
    eos = list(ctx.target.eos_token_ids)
    max_new = ctx.max_new_tokens or workload.max_new_tokens
    for bi, batch in enumerate(_batches(workload, batch_size)):
        history = {e.name: {r.prompt_id: [] for r in batch} for e in engines}
        for turn in range(max(len(r.turns) for r in batch)):
            rows = [r for r in batch if len(r.turns) > turn]
            batch_seed = derive_seed(ctx.seed, repeat, bi, turn)
            for eng in _rotate(engines, bi):
                hist = history[eng.name]
                for r in rows:
                    hist[r.prompt_id].append(("user", r.turns[turn]))
                keys = [record_key(eng.name, workload.name, r.prompt_id, turn, batch_size, temperature, ctx.seed, repeat)
                        for r in rows]
                if all(k in ctx.done for k in keys):
                    outputs = [ctx.done[k] for k in keys]
                    for k in keys:
                        yield k, None
                else:
                    prompts = [render_prompt(tok, workload, hist[r.prompt_id]) for r in rows]
                    if ctx.warmup and (eng.name, batch_size) not in ctx.warmed:
                        if ctx.on_decode:
                            ctx.on_decode(eng.name, bi, turn, True)
                        eng.decode(prompts, SamplingConfig(min(WARMUP_TOKENS, max_new), temperature, ctx.top_p, batch_seed), eos)
                        ctx.warmed.add((eng.name, batch_size))
                    if ctx.on_decode:
                        ctx.on_decode(eng.name, bi, turn, False)
                    config = SamplingConfig(max_new, temperature, ctx.top_p, batch_seed)
                    result = eng.decode(prompts, config, eos)
                    batch_id = (f"{workload.name}|b{batch_size}|t{format_temperature(temperature)}|s{ctx.seed}"
                                f"|r{repeat}|batch{bi}|turn{turn}|{eng.name}")
                    outputs = []
                    for r, k, res in zip(rows, keys, result.requests):
                        if k in ctx.done:
                            outputs.append(ctx.done[k])
                            yield k, None
                            continue
                        outputs.append(list(res.output_ids))
                        yield k, make_record(
                            res, key=k, engine=eng, workload=workload, request=r, turn=turn, batch_size=batch_size,
                            batch_rows=len(rows), batch_id=batch_id, batch=result, temperature=temperature,
                            top_p=ctx.top_p, seed=ctx.seed, batch_seed=batch_seed, repeat=repeat,
                            max_new_tokens=max_new, target_name=ctx.target.name, device=ctx.device, env=ctx.env,
                            dtype=ctx.dtype, cuda_graphs=uses_cuda_graphs(getattr(ctx.target, "model", None)),
                        )
                for r, out in zip(rows, outputs):
                    if turn + 1 < len(r.turns):
                        hist[r.prompt_id].append(("assistant", _decode_text(tok, out)))


def run_cell(target, engine: Engine, workload: Workload, batch_size: int, temperature: float = 0.0,
             repeat: int = 0, *, top_p: float = 1.0, seed: int = 0, max_new_tokens: int | None = None,
             device: str = "cpu", env: dict | None = None, done: dict | None = None,
             warmup: bool = True) -> Iterator[dict]:
    """Decode all requests of `workload` with one engine in batches of `batch_size`, turn by turn;
    yield one record per request as each batch completes (requests whose key is in `done` are
    skipped). `run_sweep` interleaves several engines and writes the records."""
    ctx = _Ctx(target=target, seed=seed, top_p=top_p, max_new_tokens=max_new_tokens, device=device, env=env,
               done=done or {}, warmup=warmup)
    for _, rec in iter_group(ctx, [engine], workload, batch_size, temperature, repeat):
        if rec is not None:
            yield rec


def target_dtype(target) -> str | None:
    """The dtype a target's model runs in ("bfloat16", ...), None for a stub without weights."""
    from specbench.engine.dtypes import dtype_name

    weight = getattr(getattr(getattr(target, "model", None), "lm_head", None), "weight", None)
    return dtype_name(weight.dtype) if weight is not None else None


def check_compatible(existing: Iterable[dict], engines: list[Engine], workloads: list[Workload], *, target: str,
                     max_new_tokens: int | None, top_p: float, device: str, path, dtype: str | None = None) -> None:
    """Refuse to mix records of different settings under the same keys (records written before
    `dtype` was recorded were fp32, the only dtype then)."""
    want = {}
    for e in engines:
        for w in workloads:
            want[(e.name, w.name)] = {
                "target": target, "max_new_tokens": max_new_tokens or w.max_new_tokens, "top_p": float(top_p),
                "policy_params": _finite(e.params()), "drafter": e.drafter, "device": device, "dtype": dtype,
            }
    for rec in existing:
        exp = want.get((rec.get("policy"), rec.get("workload")))
        if exp is None:
            continue
        for f in _CONSISTENT:
            if f == "dtype":  # not compared against a stub target (None)
                have, compared = rec.get("dtype") or "float32", exp[f] is not None
            else:
                have, compared = rec.get(f), f in rec
            if compared and have != exp[f]:
                raise UserError(
                    f"{path} already holds {rec['policy']}/{rec['workload']} records with {f}={json.dumps(have)}, "
                    f"not {json.dumps(exp[f])}; use another --out"
                )


def plan_size(engines, workloads, batch_sizes, temperatures, repeats) -> tuple[int, int]:
    """(cells, requests incl. turns) of a sweep."""
    n = len(engines) * len(batch_sizes) * len(temperatures) * repeats
    return n * len(workloads), n * sum(sum(len(r.turns) for r in w.requests) for w in workloads)


def run_sweep(target, engines: list[Engine], workloads: list[Workload], out_path: str | Path, *,
              batch_sizes: Sequence[int] = (1,), temperatures: Sequence[float] = (0.0,), repeats: int = 1,
              top_p: float = 1.0, seed: int = 0, max_new_tokens: int | None = None, device: str = "cpu",
              env: dict | None = None, warmup: bool = True, progress: bool = True,
              on_decode: Callable | None = None, on_record: Callable | None = None) -> SweepResult:
    """Run the sweep, appending records to `out_path` (resuming from the records already there)."""
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise UserError(f"policy names must be distinct, got {', '.join(names)}")
    for e in engines:
        big = [b for b in batch_sizes if e.max_batch_size is not None and b > e.max_batch_size]
        if big:
            raise UserError(f"{e.name} runs at batch size ≤ {e.max_batch_size} only, got {big[0]}")
    out_path = Path(out_path)
    existing = read_records(out_path)
    check_compatible(existing, engines, workloads, target=target.name, max_new_tokens=max_new_tokens, top_p=top_p,
                     device=device, path=out_path, dtype=target_dtype(target))
    done = {r["key"]: r.get("output_ids") or [] for r in existing}
    ctx = _Ctx(target=target, seed=seed, top_p=top_p, max_new_tokens=max_new_tokens, device=device, env=env,
               done=done, warmup=warmup, on_decode=on_decode)
    result = SweepResult(path=out_path)
    n_cells, n_requests = plan_size(engines, workloads, batch_sizes, temperatures, repeats)
    bars = ProgressBars(n_cells, n_requests, enabled=progress)
    try:
        with RecordWriter(out_path) as writer:
            for w in workloads:
                for bs in batch_sizes:
                    for temp in temperatures:
                        for rep in range(repeats):
                            # per-cell countdown of requests, to tick the cell bar when a cell completes
                            left = {e.name: sum(len(r.turns) for r in w.requests) for e in engines}
                            for key, rec in iter_group(ctx, engines, w, bs, temp, rep):
                                result.keys.append(key)
                                pol = key.split("|", 1)[0]
                                if rec is None:
                                    result.skipped += 1
                                else:
                                    writer.write(rec)
                                    result.written += 1
                                    ctx.done[key] = rec["output_ids"]
                                    if on_record:
                                        on_record(rec)
                                bars.request(rec is None)
                                left[pol] -= 1
                                if left[pol] == 0:
                                    bars.cell()
    finally:
        bars.close()
    return result


class ProgressBars:
    """tqdm progress (stderr) over cells and requests."""

    def __init__(self, n_cells: int, n_requests: int, enabled: bool):
        self.cells = self.requests = None
        if enabled and n_requests:
            from tqdm import tqdm

            self.cells = tqdm(total=n_cells, desc="cells", unit="cell", position=0, file=sys.stderr,
                              dynamic_ncols=True, mininterval=0.5)
            self.requests = tqdm(total=n_requests, desc="requests", unit="req", position=1, file=sys.stderr,
                                 dynamic_ncols=True, mininterval=0.5)
        self.skipped = 0

    def request(self, skipped: bool) -> None:
        if self.requests is not None:
            if skipped:
                self.skipped += 1
                self.requests.set_postfix(resumed=self.skipped, refresh=False)
            self.requests.update(1)

    def cell(self) -> None:
        if self.cells is not None:
            self.cells.update(1)

    def close(self) -> None:
        for b in (self.requests, self.cells):
            if b is not None:
                b.close()
