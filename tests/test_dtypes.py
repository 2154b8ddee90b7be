"""`--dtype`: parsing and refusals, the cast (rope stays fp32, cache follows), `auto`'s measured
and cached CPU decision, and the dtype carried by records and checked on resume."""
from __future__ import annotations

import json

import pytest
import torch

from specbench.engine import dtypes
from specbench.cli.main import main
from specbench.errors import UserError
from specbench.bench.runner import PolicyEngine, read_records, run_sweep
from specbench.engine.policy import Policy
from helpers import make_target, make_workload
from tiny import tiny_model


def test_parse_and_refuse():
    assert dtypes.parse_dtype("bfloat16") is torch.bfloat16
    assert dtypes.parse_dtype("auto") == "auto"
    with pytest.raises(UserError, match="unknown dtype"):
        dtypes.parse_dtype("int8")
    with pytest.raises(UserError, match="float16 is not supported on CPU"):
        dtypes.check_device_dtype(torch.float16, "cpu")
    assert dtypes.dtype_name(torch.bfloat16) == dtypes.dtype_name("torch.bfloat16") == "bfloat16"
    assert dtypes.auto_without_measuring(torch.float32, "cpu") is torch.float32
    assert dtypes.auto_without_measuring("auto", "cpu") == "auto"  # a CPU measures


def test_cli_rejects_bad_dtype_in_one_line(capsys, tmp_path):
    rc = main(["run", "--policy", "ar", "--workload", "code", "--dtype", "int8", "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--dtype" in err[0]
    assert not (tmp_path / "r.jsonl").exists()


def test_cast_keeps_rope_fp32_and_reallocates_cache():
    model = tiny_model()
    model.setup_cache(2, 64)
    dtypes.cast_model(model, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    assert model.model.layers[0].self_attn.k_cache.dtype == torch.bfloat16  # KV cache in the model dtype
    assert (model.max_batch, model.max_seq) == (2, 64)


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    loaded = make_target()
    loaded.fingerprint = "tiny-fp"
    calls = []
    real = dtypes.measure_cpu_dtypes

    def counting(model, iters=2):
        calls.append(model.lm_head.weight.dtype)
        return real(model, iters=iters)

    monkeypatch.setattr(dtypes, "measure_cpu_dtypes", counting)
    chosen, decision = dtypes.auto_dtype(loaded, tmp_path)
    assert chosen in dtypes.AUTO_CPU_CANDIDATES and decision["chosen"] == dtypes.dtype_name(chosen)
    assert set(decision["step_ms"]) == {"float32", "bfloat16"} and all(
        set(v) == {"q1", "q8"} and all(t > 0 for t in v.values()) for v in decision["step_ms"].values())
    assert loaded.model.lm_head.weight.dtype == torch.float32  # measuring leaves the model as it was
    again, _ = dtypes.auto_dtype(loaded, tmp_path)
    assert again == chosen and len(calls) == 1  # the second decision came from the cache
    stored = json.loads((tmp_path / "profiles" / "cpu-dtype.json").read_text())
    assert len(stored) == 1 and next(iter(stored)).startswith("tiny-fp|")


def test_records_carry_dtype_and_resume_refuses_another(tmp_path):
    workload = make_workload(2)
    out = tmp_path / "r.jsonl"
    fp32 = make_target()
    run_sweep(fp32, [PolicyEngine(fp32.model, Policy(), "ar")], [workload], out, progress=False, max_new_tokens=6)
    assert {r["dtype"] for r in read_records(out)} == {"float32"}
    bf16 = make_target()
    dtypes.cast_model(bf16.model, torch.bfloat16)
    with pytest.raises(UserError, match="dtype"):
        run_sweep(bf16, [PolicyEngine(bf16.model, Policy(), "ar")], [workload], out, progress=False, max_new_tokens=6)
    other = tmp_path / "bf16.jsonl"
    run_sweep(bf16, [PolicyEngine(bf16.model, Policy(), "ar")], [workload], other, progress=False, max_new_tokens=6)
    assert {r["dtype"] for r in read_records(other)} == {"bfloat16"}
