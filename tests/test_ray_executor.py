"""The Ray executor against the local one on a local Ray cluster started here (tiny random target,
fake tokenizer, as in test_runner): the same record keys, the same greedy output tokens, resume
that redoes only what is missing, and a one-line error without Ray."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from specbench.errors import UserError
from specbench.bench.engines import PolicyEngine
from specbench.bench.runner import read_records, run_sweep

ray = pytest.importorskip("ray")

from specbench.bench.ray_executor import import_ray, run_sweep_ray  # noqa: E402
from helpers import make_target, make_workload

POLICIES = [("ar", {}), ("pld", {"k": 3})]


def load_tiny():  # runs in the Ray workers (this file is importable there: PYTHONPATH below)
    return make_target()


def tiny_engine(name, target, overrides):
    from specbench.policies.pld import PromptLookup
    from specbench.engine.policy import Policy

    if name not in ("ar", "pld"):
        raise UserError(f"unknown policy {name!r}")
    return PolicyEngine(target.model, PromptLookup(**overrides) if name == "pld" else Policy(), name)


@pytest.fixture(scope="module")
def cluster():
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *([old] if old else [])])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # workers inherit PYTHONPATH
    yield
    ray.shutdown()
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


def sweep_ray(out, workload):
    return run_sweep_ray(load_tiny, "tiny", POLICIES, [workload], out, batch_sizes=[1, 3], engine_factory=tiny_engine,
                         progress=False)


def test_same_keys_and_greedy_outputs_as_local(cluster, tmp_path):
    target = load_tiny()
    workload = make_workload(5, turns=2)
    local = run_sweep(target, [tiny_engine(n, target, o) for n, o in POLICIES], [workload], tmp_path / "local.jsonl",
                      batch_sizes=[1, 3], progress=False)
    remote = sweep_ray(tmp_path / "ray.jsonl", workload)
    a = {r["key"]: r for r in read_records(tmp_path / "local.jsonl")}
    b = {r["key"]: r for r in read_records(tmp_path / "ray.jsonl")}
    assert len(a) == 2 * 2 * 5 * 2 and set(a) == set(b) == set(local.keys) == set(remote.keys)
    assert remote.written == len(b) and remote.skipped == 0
    for k in a:
        assert b[k]["output_ids"] == a[k]["output_ids"], k
        assert (b[k]["batch_id"], b[k]["batch_rows"], b[k]["batch_seed"]) == (a[k]["batch_id"], a[k]["batch_rows"], a[k]["batch_seed"])

    # Resume: drop the last records (a partly done cell among them) and rerun: only they are redone.
    out = tmp_path / "ray.jsonl"
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-7]) + lines[-7][:20])  # and a line cut by a kill
    again = sweep_ray(out, workload)
    assert again.written == 7 and again.skipped == len(a) - 7
    c = {r["key"]: r for r in read_records(out)}
    assert set(c) == set(a) and len(out.read_text().splitlines()) == len(a)
    assert all(c[k]["output_ids"] == a[k]["output_ids"] for k in a)
    assert sweep_ray(out, workload).written == 0


def test_worker_user_error_is_a_user_error(cluster, tmp_path):
    with pytest.raises(UserError, match="unknown policy 'nope'"):
        run_sweep_ray(load_tiny, "tiny", [("nope", {})], [make_workload(2)], tmp_path / "r.jsonl",
                      engine_factory=tiny_engine, progress=False)
    assert not (tmp_path / "r.jsonl").exists()


def test_one_line_error_without_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(UserError, match="pip install"):
        import_ray()


def test_cli_flags_are_checked_before_anything_runs(tmp_path, capsys):
    from specbench.cli.main import main

    base = ["sweep", "--policies", "ar", "--workloads", "code", "--limit", "1", "--out", str(tmp_path / "s")]
    for extra, needle in ((["--ray-address", "auto"], "needs --executor ray"),
                          (["--executor", "ray", "--device", "cuda:1"], "--device cpu or cuda"),
                          (["--executor", "dask"], "invalid choice")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "s").exists()
