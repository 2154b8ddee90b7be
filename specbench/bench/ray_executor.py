"""Sweeps on a Ray cluster: `python -m specbench sweep ... --executor ray [--ray-address ADDR]`.

Why: a sweep's cells are independent measurements, and a cluster of GPUs runs them side by side.
Each cell (policy, workload, batch size, temperature, repeat) becomes one Ray task holding the
resources one measurement needs — a whole GPU when the sweep runs on CUDA (a shared GPU would
time two cells against each other), else one CPU — which loads the target and the policy in its
worker (cached there for the next cell) and returns the cell's records. The driver writes them
through the same append-only, fsynced writer as the local executor (runner.RecordWriter) as each
cell completes, and resumes the same way: the existing file is read first, cells whose keys are
all present are not submitted, and a partly done cell gets the keys it already has (its batches
with every key present are skipped, as runner.run_cell does locally).

What differs from the local executor: records arrive cell by cell in completion order (the key
set and, under greedy decoding, the output tokens are the same; tests/test_ray_executor.py), a
cell's policies are not interleaved with each other within one process (each cell is its own
measurement on its own device), and each cell warms up its own engine. Workers need specbench
(and the checkpoints a policy names) importable at the same version as the driver.

Ray is an optional extra (`pip install -e ".[ray]"`), imported only here and only when used.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

from specbench.errors import UserError
from specbench.bench.runner import (ProgressBars, SweepResult, check_compatible, make_engine, plan_size, read_records, record_key,
                              run_cell, target_dtype, RecordWriter)


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install -e \".[ray]\" (or pip install ray==2.60.0)") from None
    return ray


def ray_device(device: str) -> str:
    """Cells run on the CPU or on the one GPU Ray gives each task (which it shows as cuda:0)."""
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "cuda:0"):
        return "cuda:0"
    raise UserError(f"with --executor ray use --device cpu or cuda (each cell gets its own GPU), got {device!r}")


# ---------------------------------------------------------------------------------------------
# Worker side


_WORKER_CACHE: dict = {}  # per worker process: target_key → target, (target_key, policy) → engine


def _worker_engine(target_key: str, load_target: Callable, engine_factory: Callable, policy: str, overrides: dict):
    if target_key not in _WORKER_CACHE:
        _WORKER_CACHE[target_key] = load_target()
    target = _WORKER_CACHE[target_key]
    key = (target_key, policy, tuple(sorted(overrides.items())))
    if key not in _WORKER_CACHE:
        _WORKER_CACHE[key] = engine_factory(policy, target, overrides)
    return target, _WORKER_CACHE[key]


def _describe(target_key, load_target, engine_factory, policies) -> dict:
    """What the driver needs before writing: the target's name and each engine's settings."""
    out = {}
    for policy, overrides in policies:
        target, engine = _worker_engine(target_key, load_target, engine_factory, policy, overrides)
        out[policy] = {"target": target.name, "name": engine.name, "params": engine.params(), "drafter": engine.drafter,
                       "dtype": target_dtype(target)}
    return out


def _run_cell(target_key, load_target, engine_factory, policy, overrides, workload, batch_size, temperature, repeat,
              *, top_p, seed, max_new_tokens, device, env_fn, done) -> list[dict]:
    target, engine = _worker_engine(target_key, load_target, engine_factory, policy, overrides)
    env = env_fn(device) if env_fn is not None else None
    return list(run_cell(target, engine, workload, batch_size, temperature, repeat, top_p=top_p, seed=seed,
                         max_new_tokens=max_new_tokens, device=device, env=env, done=done))


# ---------------------------------------------------------------------------------------------
# Driver side


def _get(ray, ref):
    """ray.get, with a worker's UserError (a bad policy parameter, a missing checkpoint) re-raised
    here as the one-line error it is, not as a remote traceback."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserError):
            raise UserError(str(e.cause)) from None
        raise


def run_sweep_ray(load_target: Callable, target_key: str, policies: Sequence[tuple[str, dict]], workloads,
                  out_path: str | Path, *, batch_sizes: Sequence[int] = (1,), temperatures: Sequence[float] = (0.0,),
                  repeats: int = 1, top_p: float = 1.0, seed: int = 0, max_new_tokens: int | None = None,
                  device: str = "cpu", env_fn: Callable | None = None, address: str | None = None,
                  engine_factory: Callable = make_engine, progress: bool = True) -> SweepResult:
    """runner.run_sweep with every cell a Ray task. `load_target` (picklable, no arguments) loads the
    target in a worker, `target_key` names it for the worker's cache, `policies` are (name, overrides)
    given to `engine_factory(name, target, overrides)` (runner.make_engine). Attaches to the cluster
    at `address` (default: RAY_ADDRESS, else a new local one) unless Ray is already initialised."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"cannot reach the Ray cluster at {address}: {e}") from None
    on_gpu = device.startswith("cuda")
    if on_gpu and ray.cluster_resources().get("GPU", 0) < 1:
        raise UserError("--device cuda with --executor ray, but the Ray cluster has no GPU")
    resources = {"num_gpus": 1} if on_gpu else {"num_cpus": 1}
    describe = ray.remote(**resources)(_describe)
    run_cell_task = ray.remote(**resources)(_run_cell)

    out_path = Path(out_path)
    existing = read_records(out_path)
    info = _get(ray, describe.remote(target_key, load_target, engine_factory, list(policies)))
    names = [info[p]["name"] for p, _ in policies]
    if len(set(names)) != len(names):
        raise UserError(f"policy names must be distinct, got {', '.join(names)}")
    target_name = next(iter(info.values()))["target"]
    stand_ins = [SimpleNamespace(name=i["name"], params=lambda i=i: i["params"], drafter=i["drafter"]) for i in info.values()]
    check_compatible(existing, stand_ins, workloads, target=target_name, max_new_tokens=max_new_tokens, top_p=top_p,
                     device=device, path=out_path, dtype=next(iter(info.values()))["dtype"])
    done = {r["key"]: r.get("output_ids") or [] for r in existing}

    result = SweepResult(path=out_path)
    n_cells, n_requests = plan_size(list(policies), workloads, batch_sizes, temperatures, repeats)
    bars = ProgressBars(n_cells, n_requests, enabled=progress)
    pending = {}
    try:
        for w in workloads:
            for bs in batch_sizes:
                for temp in temperatures:
                    for rep in range(repeats):
                        for policy, overrides in policies:
                            keys = [record_key(info[policy]["name"], w.name, r.prompt_id, t, bs, temp, seed, rep)
                                    for r in w.requests for t in range(len(r.turns))]
                            result.keys += keys
                            have = {k: done[k] for k in keys if k in done}
                            if len(have) == len(keys):
                                result.skipped += len(keys)
                                for _ in keys:
                                    bars.request(True)
                                bars.cell()
                                continue
                            ref = run_cell_task.remote(target_key, load_target, engine_factory, policy, overrides, w, bs,
                                                       temp, rep, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
                                                       device=device, env_fn=env_fn, done=have)
                            pending[ref] = len(have)
        with RecordWriter(out_path) as writer:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    skipped = pending.pop(ref)
                    for rec in _get(ray, ref):
                        writer.write(rec)
                        result.written += 1
                        bars.request(False)
                    result.skipped += skipped
                    for _ in range(skipped):
                        bars.request(True)
                    bars.cell()
    finally:
        bars.close()
        for ref in pending:  # an error or Ctrl-C: what is written stays; the rest is rerun on resume
            ray.cancel(ref, force=True)
    return result
