"""CLI: every bad input is one line `specbench: error: ...` on stderr, exit 2, no traceback, no output
file, and nothing loaded; plus wiring of run / sweep / list / report, and (model mark) end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from specbench.cli import main as cli
from specbench.cli import args as cli_args
from specbench.cli.args import parse_scalar
from specbench.cli.main import main

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
RECORD_FIELDS = [
    "key", "policy", "policy_params", "workload", "prompt_id", "category", "turn", "batch_size", "batch_id", "repeat",
    "temperature", "top_p", "seed", "max_new_tokens", "target", "drafter", "device", "prompt_tokens",
    "generated_tokens", "output_ids", "finish_reason", "rounds", "drafted", "accepted", "drafted_per_position",
    "accepted_per_position", "tau", "ttft_s", "decode_s", "tokens_per_s", "batch_wall_s", "batch_generated_tokens",
    "trace", "env",
]


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Bad input must fail before any model loads: loading one in these tests is a failure."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("specbench.engine.loading.load_model", boom)


def _one_error_line(capsys, rc, *needles):
    out, err = capsys.readouterr()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specbench: error: ")
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "wl.jsonl"
    p.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n')
    return p


def run_args(tmp_path, *extra, workload="code", policy="pld"):
    return ["run", "--policy", policy, "--workload", str(workload), "--out", str(tmp_path / "out" / "r.jsonl"), *extra]


@pytest.mark.parametrize("extra, needles", [
    (["--batch-size", "0"], ["--batch-size", "positive"]),
    (["--batch-size", "-3"], ["--batch-size"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--temperature", "-0.5"], ["temperature"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--top-p", "0"], ["top-p", "(0, 1]"]),
    (["--top-p", "1.5"], ["top-p"]),
    (["--limit", "0"], ["--limit"]),
    (["--all", "--limit", "3"], ["--all", "--limit"]),
    (["--param", "novalue"], ["NAME=VALUE"]),
    (["--param", "nosuch=3"], ["no parameter 'nosuch'", "min_ngram"]),
    (["--device", "cuda:7"], ["cuda"]),
    (["--device", "toaster"], ["device"]),
    (["--bogus"], ["unrecognized"]),
])
def test_run_bad_numbers_and_flags(tmp_path, capsys, extra, needles):
    rc = main(run_args(tmp_path, *extra))
    _one_error_line(capsys, rc, *needles)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("extra, needles", [
    (["--policy", "eagle", "--qk-norm"], ["--qk-norm", "dspark and dflash", "eagle"]),
    (["--policy", "dflash", "--markov-rank", "64"], ["--markov-rank", "dspark", "dflash"]),
    (["--policy", "dspark", "--markov-rank", "0"], ["--markov-rank", "at least 1"]),
    (["--policy", "fixed-k", "--draft-layers", "4"], ["--draft-layers", "dspark and dflash", "fixed-k"]),
    (["--policy", "dflash", "--draft-layers", "0"], ["--draft-layers", "at least 1"]),
])
def test_train_flags_for_other_drafters(tmp_path, capsys, extra, needles):
    """Architecture flags a drafter kind has no use for: one line, exit 2, nothing written."""
    rc = main(["train", *extra, "--out", str(tmp_path / "d"), "--data", str(tmp_path / "data")])
    _one_error_line(capsys, rc, *needles)
    assert _files(tmp_path) == []


def test_unknown_policy_lists_valid(tmp_path, capsys):
    line = _one_error_line(capsys, main(run_args(tmp_path, policy="nope")), "unknown policy 'nope'")
    for name in ("ar", "pld", "fixed-k", "hf", "hf-pld"):
        assert name in line
    assert _files(tmp_path) == []


def test_unknown_workload_lists_valid(tmp_path, capsys):
    line = _one_error_line(capsys, main(run_args(tmp_path, workload="nope")), "unknown workload 'nope'")
    for name in ("code", "chat", "math"):
        assert name in line
    assert not (tmp_path / "out").exists()


def test_malformed_workload_jsonl_names_line(tmp_path, capsys):
    wl = tmp_path / "bad.jsonl"
    wl.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": [\n')
    _one_error_line(capsys, main(run_args(tmp_path, workload=wl)), "line 2")
    assert _files(tmp_path) == [wl]


def test_empty_workload_file(tmp_path, capsys):
    wl = tmp_path / "empty.jsonl"
    wl.write_text("\n")
    _one_error_line(capsys, main(run_args(tmp_path, workload=wl)), "empty")
    assert _files(tmp_path) == [wl]


def test_output_under_a_regular_file(tmp_path, capsys, jsonl):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    rc = main(["run", "--policy", "ar", "--workload", str(jsonl), "--out", str(blocker / "sub" / "r.jsonl")])
    _one_error_line(capsys, rc, "not a directory")
    rc = main(["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--out", str(blocker / "sweep")])
    _one_error_line(capsys, rc, "not a directory")
    assert _files(tmp_path) == sorted([blocker, jsonl])


def test_output_where_the_kernel_refuses(tmp_path, capsys, jsonl):
    """/proc refuses new files even to root, for whom os.access says yes: the write check tries it."""
    for argv in (["run", "--policy", "ar", "--workload", str(jsonl), "--out", "/proc/specbench-out/x.jsonl"],
                 ["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--out", "/proc/specbench-out/s"],
                 ["report", str(jsonl), "--html", "/proc/specbench-out/r.html"],
                 ["profile", "--out", "/proc/specbench-out/p.json"]):
        _one_error_line(capsys, main(argv), "/proc/specbench-out", "not writable")
    assert not Path("/proc/specbench-out").exists() and _files(tmp_path) == [jsonl]


@pytest.mark.parametrize("policy", ["pld", "dspark-fixed", "ar"])
def test_profile_policy_must_schedule_from_drafter_costs(tmp_path, capsys, policy):
    """`profile --policy` stores the drafting cost a DSpark spec schedules from; a policy that schedules from
    none is refused before any model loads, with no file written."""
    rc = main(["profile", "--policy", policy, "--out", str(tmp_path / "p.json")])
    _one_error_line(capsys, rc, repr(policy), "schedules from no drafter cost")
    assert _files(tmp_path) == []


def test_write_check_leaves_nothing_behind(tmp_path):
    """The probe creates the missing directories and a file, then removes exactly those."""
    (tmp_path / "keep.jsonl").write_text("x\n")
    cli_args.check_writable(tmp_path / "a" / "b" / "r.jsonl", "file")
    cli_args.check_writable(tmp_path / "sweep" / "new", "directory")
    cli_args.check_writable(tmp_path / "keep.jsonl", "file")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["keep.jsonl"]
    assert (tmp_path / "keep.jsonl").read_text() == "x\n"


def test_output_dir_not_writable(tmp_path, capsys, jsonl):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "inner").mkdir()
    ro.chmod(0o500)
    try:
        # root may write here; then the same refusal must come from the probe, not os.access
        with mock.patch.object(cli_args.os, "access", return_value=True), \
                mock.patch.object(cli_args.tempfile, "mkstemp", side_effect=PermissionError(13, "Permission denied")):
            _one_error_line(capsys, main(["run", "--policy", "ar", "--workload", str(jsonl), "--out",
                                          str(ro / "inner" / "r.jsonl")]), "not writable", "Permission denied")
    finally:
        ro.chmod(0o700)
    assert _files(tmp_path) == [jsonl]


def test_max_new_tokens_beyond_the_context(tmp_path, capsys, jsonl):
    """A generation limit the target's context cannot hold is refused before its weights load."""
    target = tmp_path / "tiny-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    rc = main(["run", "--policy", "ar", "--workload", str(jsonl), "--target", str(target), "--max-new-tokens", "100",
               "--out", str(tmp_path / "out" / "r.jsonl")])
    _one_error_line(capsys, rc, "--max-new-tokens 100", "context of 64 tokens", "at most 63")
    rc = main(["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--target", str(target),
               "--max-new-tokens", "64", "--out", str(tmp_path / "s")])
    _one_error_line(capsys, rc, "--max-new-tokens 64", "context of 64")
    assert _files(tmp_path) == sorted([jsonl, target / "config.json"])
    # within the context the checks pass and the model would load (stubbed out here)
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["run", "--policy", "ar", "--workload", str(jsonl), "--target", str(target), "--max-new-tokens", "63",
              "--out", str(tmp_path / "out" / "r.jsonl")])


def test_malformed_json_messages_read_once(tmp_path, capsys, jsonl):
    """json's own message may end in 'at' ('Unterminated string starting at'): no 'at at column'."""
    wl = tmp_path / "bad.jsonl"
    wl.write_text('{"question_id": 1, "turns": ["unterminated}\n')
    line = _one_error_line(capsys, main(run_args(tmp_path, workload=wl)), "line 1", "column")
    assert "at at" not in line
    res = tmp_path / "r.jsonl"
    res.write_text('{"key": "a", "x": "unterminated}\n{"key": "b"}\n')
    line = _one_error_line(capsys, main(["run", "--policy", "ar", "--workload", str(jsonl), "--out", str(res)]),
                           "line 1", "column")
    assert "at at" not in line
    line = _one_error_line(capsys, main(["report", str(res), "--html", str(tmp_path / "r.html")]), "column")
    assert "at at" not in line and not (tmp_path / "r.html").exists()


def test_output_dir_not_writable_simulated(tmp_path, capsys, jsonl, monkeypatch):
    monkeypatch.setattr(cli_args.os, "access", lambda *a, **k: False)
    rc = main(["run", "--policy", "ar", "--workload", str(jsonl), "--out", str(tmp_path / "new" / "r.jsonl")])
    _one_error_line(capsys, rc, "not writable")
    assert _files(tmp_path) == [jsonl]


def test_baseline_batch1_only_and_bad_param(tmp_path, capsys, jsonl):
    _one_error_line(capsys, main(run_args(tmp_path, "--batch-size", "4", policy="hf-pld", workload=jsonl)),
                    "hf-pld", "batch size 1")
    _one_error_line(capsys, main(run_args(tmp_path, "--param", "zz=1", policy="hf-pld", workload=jsonl)),
                    "no parameter 'zz'")
    _one_error_line(capsys, main(["sweep", "--policies", "ar,hf-assisted", "--workloads", str(jsonl),
                                  "--batch-sizes", "1,4", "--out", str(tmp_path / "s")]), "hf-assisted")
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()


def test_existing_malformed_results_refused(tmp_path, capsys, jsonl):
    out = tmp_path / "r.jsonl"
    out.write_text('{"key": "a"}\ngarbage\n{"key": "b"}\n')
    rc = main(["run", "--policy", "ar", "--workload", str(jsonl), "--out", str(out)])
    _one_error_line(capsys, rc, "line 2")
    assert out.read_text() == '{"key": "a"}\ngarbage\n{"key": "b"}\n'


def test_sweep_bad_lists(tmp_path, capsys, jsonl):
    base = ["sweep", "--workloads", str(jsonl), "--out", str(tmp_path / "s")]
    _one_error_line(capsys, main(base + ["--policies", "ar,,pld"]), "--policies")
    _one_error_line(capsys, main(base + ["--policies", "ar,ar"]), "duplicate")
    _one_error_line(capsys, main(base + ["--policies", "ar", "--batch-sizes", "1,0"]), "--batch-sizes")
    _one_error_line(capsys, main(base + ["--policies", "ar", "--repeats", "0"]), "--repeats")
    _one_error_line(capsys, main(base + ["--policies", "ar", "--temperatures", "0,-1"]), "temperature")
    _one_error_line(capsys, main(base + ["--policies", "ar,nope"]), "unknown policy")
    _one_error_line(capsys, main(["sweep", "--policies", "ar", "--out", str(tmp_path / "s")]), "--workloads")
    assert not (tmp_path / "s").exists()


def test_sweep_refuses_other_settings(tmp_path, capsys, jsonl):
    d = tmp_path / "s"
    d.mkdir()
    args = cli.build_parser().parse_args(["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--out", str(d)])
    settings = cli.sweep_settings(args, ["ar", "pld"], None, "cpu")
    (d / "sweep.json").write_text(json.dumps(settings))
    rc = main(["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--out", str(d), "--batch-sizes", "1,4"])
    _one_error_line(capsys, rc, "different settings", "batch_sizes")
    assert _files(d) == [d / "sweep.json"]
    # the same settings pass validation and go on to load the model (stubbed out here)
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["sweep", "--policies", "ar,pld", "--workloads", str(jsonl), "--out", str(d)])


def test_no_command_and_help(capsys):
    line = _one_error_line(capsys, main([]), "choose a command")
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name in cli.COMMAND_NAMES:
        assert name in line and name in usage.splitlines()[1] + usage.splitlines()[2], name
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("specbench ")


def _subparsers():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction)]
    return sub.choices


def test_every_option_is_described():
    """Every option of every command has a help text; options that take a list say how it is
    separated, and the numeric ones people change say their default."""
    commands = _subparsers()
    assert set(commands) == set(cli.COMMAND_NAMES)
    for name, sp in commands.items():
        for action in sp._actions:
            if not action.option_strings or action.help == cli.argparse.SUPPRESS or "-h" in action.option_strings:
                continue
            flag = action.option_strings[-1]
            assert action.help, f"{name} {flag} has no help"
            if isinstance(action.default, list) and not isinstance(action, cli.argparse._AppendAction):
                assert "comma-separated" in action.help, f"{name} {flag}: say the list is comma-separated"
            if action.default not in (None, False) and not isinstance(action.default, list):
                assert "default" in action.help, f"{name} {flag}: show the default {action.default!r}"


def test_param_values_are_toml_scalars():
    assert parse_scalar("4") == 4 and parse_scalar("0.5") == 0.5 and parse_scalar("true") is True
    assert parse_scalar('"x y"') == "x y" and parse_scalar("truncate:8") == "truncate:8"
    assert parse_scalar("drafters/a") == "drafters/a"


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("ar", "pld", "fixed-k", "hf", "hf-assisted", "hf-pld", "code", "chat", "math", "smollm2-135m"):
        assert name in out


def test_report_wiring(tmp_path, capsys):
    res = tmp_path / "records.jsonl"
    res.write_text("{}\n")
    with mock.patch("specbench.analysis.report.write_report") as wr:
        assert main(["report", str(res), "--html", str(tmp_path / "a.html"), "--pdf", str(tmp_path / "a.pdf")]) == 0
        wr.assert_called_once_with(res, html_path=str(tmp_path / "a.html"), pdf_path=str(tmp_path / "a.pdf"))
        assert main(["report", str(tmp_path)]) == 0
        assert wr.call_args.kwargs == {"html_path": str(tmp_path / "report.html"), "pdf_path": str(tmp_path / "report.pdf")}
    _one_error_line(capsys, main(["report", str(tmp_path / "missing")]), "not found")


def test_compare_command(tmp_path, capsys):
    """`compare RESULTS A B --metric tau`: one line per cell with the ratio, CI and verdict; the csv
    is written whole; unknown policies or paths are one-line errors."""
    from fakerecords import rec

    res = tmp_path / "records.jsonl"
    rows = []
    for i in range(12):
        rows += [rec("dspark", f"q{i}", 10.0, tau=1.5 + 0.01 * i), rec("dflash", f"q{i}", 10.0, tau=1.2 + 0.005 * i)]
    res.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(res), "dspark", "dflash", "--metric", "tau", "--csv", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    assert "n=12" in out and "higher" in out and "τ" in out
    assert (tmp_path / "c.csv").read_text().startswith("workload,")
    _one_error_line(capsys, main(["compare", str(res), "dspark", "eagle"]), "no records for policy 'eagle'")
    _one_error_line(capsys, main(["compare", str(tmp_path / "missing"), "dspark", "dflash"]), "not found")


def test_keyboard_interrupt_exit_130(tmp_path, capsys, jsonl, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_run", interrupted)  # the parser names it when main() builds it
    rc = main(["run", "--policy", "ar", "--workload", str(jsonl)])
    assert rc == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0]


@pytest.mark.parametrize("argv, needle", [
    (["run", "--policy", "pld", "--workload", "code", "--batch-size", "0"], "--batch-size"),
    (["run", "--policy", "zzz", "--workload", "code"], "unknown policy"),
    (["sweep", "--policies", "ar", "--workloads", "nope", "--out", "x"], "unknown workload"),
    (["run", "--policy", "ar", "--workload", "code", "--out", "/proc/specbench-out/x.jsonl"], "not writable"),
])
def test_subprocess_one_line(tmp_path, argv, needle):
    p = subprocess.run([sys.executable, "-m", "specbench", *argv], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specbench: error: ") and needle in lines[0], p.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# End to end on the real default model


def _cli(tmp_path, *argv, timeout=3600):
    p = subprocess.run([sys.executable, "-m", "specbench", *argv, "--no-progress"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.model
@pytest.mark.slow
def test_e2e_pld_run_and_equals_ar(tmp_path):
    out = tmp_path / "pld.jsonl"
    p = _cli(tmp_path, "run", "--policy", "pld", "--workload", "code", "--limit", "8", "--max-new-tokens", "64",
             "--out", str(out))
    assert "tau" in p.stdout and str(out) in p.stdout
    recs = _records(out)
    assert len(recs) == 8 and len({r["key"] for r in recs}) == 8
    for r in recs:
        missing = [f for f in RECORD_FIELDS if f not in r]
        assert not missing, missing
        assert r["target"] == "smollm2-135m" and r["policy"] == "pld" and r["generated_tokens"] == len(r["output_ids"])
    assert sum(r["accepted"] for r in recs) > 0
    _cli(tmp_path, "run", "--policy", "ar", "--workload", "code", "--limit", "8", "--max-new-tokens", "64",
         "--out", str(tmp_path / "ar.jsonl"))
    ar = {r["prompt_id"]: r["output_ids"] for r in _records(tmp_path / "ar.jsonl")}
    assert {r["prompt_id"]: r["output_ids"] for r in recs} == ar


@pytest.mark.model
@pytest.mark.slow
def test_e2e_fixed_k_batched_equals_ar(tmp_path):
    d = tmp_path / "sweep"
    _cli(tmp_path, "run", "--policy", "ar", "--workload", "code", "--limit", "16", "--max-new-tokens", "48",
         "--out", str(tmp_path / "ar.jsonl"))
    ar = {r["prompt_id"]: r["output_ids"] for r in _records(tmp_path / "ar.jsonl")}
    p = _cli(tmp_path, "sweep", "--policies", "fixed-k", "--workloads", "code", "--batch-sizes", "1,4,16",
             "--limit", "16", "--max-new-tokens", "48", "--out", str(d))
    assert "fixed-k" in p.stdout
    recs = _records(d / "records.jsonl")
    assert len(recs) == 48 and json.loads((d / "sweep.json").read_text())["batch_sizes"] == [1, 4, 16]
    for r in recs:
        assert r["output_ids"] == ar[r["prompt_id"]], (r["batch_size"], r["prompt_id"])
        assert r["drafted"] > 0 and r["drafter"] == "truncate:8"


def test_compare_and_report_keep_sweeps_apart(tmp_path, capsys):
    """`compare results/ dspark ar` over committed sweeps and the user's own runs: each sweep (and
    the directory of loose run files) is compared on its own, never pooled; `report` refuses
    more than one."""
    from fakerecords import make_records, write_records

    root = tmp_path / "results"
    for name, seed, slow in (("sweeps/old", 1, 0.5), ("sweeps/other", 2, 2.0)):
        recs = make_records(workloads={"code": ["code"]}, policies=("ar", "pld"), batch_sizes=(1,), n_prompts=8, seed=seed)
        for r in recs:
            if r["policy"] == "pld":  # a different machine state: pld's rate scaled by `slow`
                r["tokens_per_s"] *= slow
        write_records(root / name / "records.jsonl", recs)
        (root / name / "sweep.json").write_text("{}")
    mine = make_records(workloads={"code": ["code"]}, policies=("ar", "pld"), batch_sizes=(1,), n_prompts=8, seed=3)
    write_records(root / "run-ar-code.jsonl", [r for r in mine if r["policy"] == "ar"])
    write_records(root / "run-pld-code.jsonl", [r for r in mine if r["policy"] == "pld"])

    assert main(["compare", str(root), "pld", "ar", "--csv", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    assert "3 sweeps or run directories; each is compared on its own, never pooled" in out
    blocks = {line.rstrip(":") for line in out.splitlines() if line.endswith(":") and "never pooled" not in line}
    assert set(blocks) == {str(root), str(root / "sweeps/old"), str(root / "sweeps/other")}
    assert out.count("n=8") == 3  # one cell per source, 8 prompts each: nothing paired across sources
    assert "too few" not in out  # 8 prompts in a family of 3 cells can reach Holm p < 0.05 (7 suffice)
    import pandas as pd

    table = pd.read_csv(tmp_path / "c.csv")
    ratio = dict(zip(table["source"], table["ratio"]))
    assert ratio[str(root / "sweeps/other")] > 3 * ratio[str(root / "sweeps/old")]
    # one source alone: no grouping
    assert main(["compare", str(root / "sweeps/old"), "pld", "ar"]) == 0
    assert "never pooled" not in capsys.readouterr().out

    line = _one_error_line(capsys, main(["report", str(root), "--html", str(tmp_path / "r.html")]),
                           "3 different sweeps or run directories", "give one of them")
    assert str(root / "sweeps/old") in line and not (tmp_path / "r.html").exists()


def test_settings_refusal_names_the_flag_not_a_file():
    """The refusal for records of other settings says 'use another --out' (a sweep's --out is a
    directory, a run's a file), not 'write to another file'."""
    from types import SimpleNamespace

    from specbench.errors import UserError
    from specbench.bench.runner import check_compatible

    engine = SimpleNamespace(name="dspark", params=lambda: {"gamma": 7, "draft_gate": True}, drafter="d")
    workload = SimpleNamespace(name="code", max_new_tokens=48)
    old = {"policy": "dspark", "workload": "code", "policy_params": {"gamma": 7}}
    with pytest.raises(UserError, match="use another --out") as e:
        check_compatible([old], [engine], [workload], target="t", max_new_tokens=48, top_p=1.0, device="cpu",
                         path=Path("results/sweeps/demo/records.jsonl"))
    assert "another file" not in str(e.value)
