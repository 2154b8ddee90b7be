"""Bad published drafters on the command line: a drafter for another target (hidden size,
vocabulary, tapped layers), an unknown architecture, a missing or truncated weights file, a hub id
while offline — each a one-line error and exit status 2, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from published import hf_target_dir, save, specforge_dspark
from specbench.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "target": hf_target_dir(root / "target"),
        "wide": hf_target_dir(root / "wide", hidden=48),
        "big-vocab": hf_target_dir(root / "big-vocab", vocab=80),
        "shallow": hf_target_dir(root / "shallow", layers=2),
        "drafter": save(specforge_dspark(), root / "drafter"),
    }


def run_dspark(target, drafter, capsys, out):
    code = main(["run", "--policy", "dspark", "--workload", "code", "--limit", "1", "--max-new-tokens", "4",
                 "--target", str(target), "--param", f"drafter={drafter}", "--param", "scheduler=fixed",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert not out.exists()  # refused before anything is written
    return code, err


@pytest.mark.parametrize("target,message", [
    ("wide", "is for a target of hidden size 32"),
    ("big-vocab", "has a vocabulary of 64"),
    ("shallow", "taps target layers [0, 2]"),
])
def test_drafter_for_another_target(dirs, capsys, tmp_path, target, message):
    code, err = run_dspark(dirs[target], dirs["drafter"], capsys, tmp_path / "out.jsonl")
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def copy_drafter(dirs, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for f in dirs["drafter"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def test_unknown_architecture(dirs, tmp_path, capsys):
    d = copy_drafter(dirs, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["MedusaModel"]
    (d / "config.json").write_text(json.dumps(config))
    code, err = run_dspark(dirs["target"], d, capsys, tmp_path / "out.jsonl")
    assert code == 2 and "unknown architecture 'MedusaModel'" in err and err.count("\n") == 1


def test_missing_and_truncated_weights(dirs, tmp_path, capsys):
    d = copy_drafter(dirs, tmp_path)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    code, err = run_dspark(dirs["target"], d, capsys, tmp_path / "out.jsonl")
    assert code == 2 and "corrupt or truncated weights file model.safetensors" in err and err.count("\n") == 1
    weights.unlink()
    code, err = run_dspark(dirs["target"], d, capsys, tmp_path / "out.jsonl")
    assert code == 2 and "no weights" in err and err.count("\n") == 1


def test_hub_id_offline(dirs):
    """A hub id goes through huggingface_hub's snapshot_download, which fails offline: one line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(dirs["target"].parent / "hf-home")}
    proc = subprocess.run([sys.executable, "-m", "specbench", "run", "--policy", "dspark", "--workload", "code",
                           "--limit", "1", "--target", str(dirs["target"]),
                           "--param", "drafter=deepseek-ai/dspark_qwen3_4b_block7", "--param", "scheduler=fixed",
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "cannot download drafter 'deepseek-ai/dspark_qwen3_4b_block7' (offline?)" in proc.stderr
    assert proc.stderr.count("\n") == 1
