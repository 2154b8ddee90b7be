"""The DSpark Table 1 recipe (benchmarks/dspark-table1, docs/formats.md) end to end on a tiny
random Qwen3 target with tiny DeepSpec-layout DSpark and DFlash drafters: the recipe's own
workload specs (nine DeepSpec eval sets, turn 1, non-thinking chat template), its policy specs
with only the drafter changed to the local tiny ones, and its sweep script (T = 1, γ = 7, b = 1).
Only the weights and the data files differ from the GPU run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from published import hf_target_dir, hf_tokenizer, specforge_dspark
from specbench.bench.workloads import load_workload, render_prompt
from published import deepspec_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "benchmarks" / "dspark-table1"
TASKS = ["gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2"]
# Qwen3's template in miniature: a non-thinking generation prompt ends with an empty think block.
TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t1 "
            "{% if enable_thinking is defined and not enable_thinking %}t3 t4 {% endif %}{% endif %}")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("table1")
    tok = hf_tokenizer()
    tok.chat_template = TEMPLATE
    target = hf_target_dir(root / "tiny-qwen3", tokenizer=tok)
    drafters = {}
    for name, head in (("dspark", "vanilla"), ("dflash", None)):
        (root / name).mkdir()
        ref = specforge_dspark(markov_head_type=head or "vanilla", rank=6 if head else 0, confidence=bool(head),
                               with_markov=bool(head), block_size=7)
        drafters[name], _ = deepspec_checkpoint(root / name, ref)
    copy = root / "recipe"
    shutil.copytree(RECIPE, copy)
    for name, path in drafters.items():  # only the drafter changes: local tiny ones for the released ones
        spec = copy / "policies" / f"{name}.toml"
        lines = [f'drafter = "{path}"' if ln.startswith("drafter =") else ln for ln in spec.read_text().splitlines()]
        spec.write_text("\n".join(lines) + "\n")
    (copy / "eval_datasets").mkdir()
    for i, task in enumerate(TASKS):
        rows = [{"turns": [f"t{5 + (i + j) % 50} t{9 + j} t{20 + i}", "t7 t8"]} for j in range(3)]
        (copy / "eval_datasets" / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "target": target, "recipe": copy}


def test_workload_specs_use_deepspec_protocol(recipe):
    from specbench.engine.loading import load_model

    tok = load_model(str(recipe["target"])).tokenizer
    w = load_workload(str(recipe["recipe"] / "workloads" / "mt-bench.toml"))
    assert w.chat_template_kwargs == {"enable_thinking": False} and w.max_new_tokens == 2048
    assert all(len(r.turns) == 1 for r in w.requests)  # first turn only
    ids = render_prompt(tok, w, [("user", w.requests[0].turns[0])])
    assert ids[-3:] == [1, 3, 4]  # the non-thinking generation prompt


def test_recipe_sweep_end_to_end(recipe):
    out = recipe["root"] / "out"
    env = {**os.environ, "TARGET": str(recipe["target"]), "DEVICE": "cpu"}
    proc = subprocess.run([str(recipe["recipe"] / "sweep.sh"), str(out), "--limit", "2", "--max-new-tokens", "12",
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(ln) for ln in (out / "records.jsonl").read_text().splitlines()]
    cells = {(r["policy"], r["workload"]) for r in records}
    policies = {"ar", "dspark-qwen3-4b-block7", "dflash-qwen3-4b-block7"}
    assert cells == {(p, t) for p in policies for t in TASKS}
    assert all(r["temperature"] == 1.0 and r["batch_size"] == 1 for r in records)
    drafted = [r for r in records if r["policy"] != "ar"]
    assert all(r["drafted"] > 0 for r in drafted)
    settings = json.loads((out / "sweep.json").read_text())
    assert settings
