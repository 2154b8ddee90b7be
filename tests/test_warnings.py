"""What a reader must be told beside the numbers, in the sweep summary and in the report, on
fabricated records that have it and not on records that don't: too few prompts for the test to
ever reject (small n), stalled requests (timings not to be trusted), rounds DSpark's draft gate
skipped; plus the report's one-line verdicts, settings and axes."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

from specbench.analysis import report, stats
from specbench.bench.envinfo import environment_table
from specbench.cli import main as cli

from fakerecords import make_records, write_records

PDFTOTEXT = shutil.which("pdftotext")


def _write_sweep(d, recs, settings=None):
    d.mkdir(parents=True, exist_ok=True)
    write_records(d / "records.jsonl", recs)
    (d / "sweep.json").write_text(json.dumps(settings or {"policies": ["ar", "pld"], "limit": None}))
    return d / "records.jsonl"


def _records(n_prompts, seed=3, policies=("ar", "pld"), batch_sizes=(1,)):
    return make_records(workloads={"code": ["code"]}, policies=policies, batch_sizes=batch_sizes,
                        n_prompts=n_prompts, seed=seed)


def _stall(recs, policy, prompt, factor=20.0):
    """One request decoded `factor` times slower, as on a machine that stalled mid-request."""
    for r in recs:
        if r["policy"] == policy and r["prompt_id"] == prompt:
            r["decode_s"] *= factor
            r["tokens_per_s"] /= factor
            r["batch_wall_s"] += r["decode_s"] * (1 - 1 / factor)
    return recs


def _gate(recs, policy="pld", skipped_every=2):
    """Give `policy` DSpark-style traces whose every `skipped_every`-th round the draft gate skipped."""
    for r in recs:
        if r["policy"] == policy:
            conf = [[] if i % skipped_every == 0 else [0.5] * 4 for i in range(r["rounds"])]
            r["trace"] = {"verify_len": [0 if not c else 4 for c in conf], "accepted": [0] * r["rounds"],
                          "confidence": conf}
            r["policy_params"] = {"draft_gate": True}
    return recs


def _report_text(tmp_path, records_file):
    html_path, pdf_path = tmp_path / "r.html", tmp_path / "r.pdf"
    report.write_report(records_file.parent, html_path, pdf_path, n_resamples=200)
    return html_path.read_text(), pdf_path


# ---------------------------------------------------------------------------------------------
# Small n


def test_too_few_prompts_is_said_not_no_difference(tmp_path):
    """n = 4 with 2 tested cells: the smallest possible Holm p is 2 · 2/2^4 = 0.25, so the test can
    never reject; the summary and the report say so and which n is needed (7), even where the CI
    excludes 1."""
    assert stats.wilcoxon_min_p(4) == pytest.approx(0.125) and stats.min_n_to_reject(1) == 6
    assert stats.min_n_to_reject(2) == 7 and stats.min_n_to_reject(10) == 9
    f = _write_sweep(tmp_path / "s", _records(4, batch_sizes=(1, 4)))
    s = stats.summarize(stats.load_results(f), n_resamples=200)
    pld = s[s["policy"] == "pld"]
    assert pld["too_few"].all() and (pld["n_needed"] == 7).all() and not pld["significant"].any()
    assert all("n = 4 too few to test" in n and "needs n ≥ 7" in n for n in pld["note"])
    assert not s[s["policy"] == "ar"]["too_few"].any()
    summary = cli.sweep_summary(f)
    assert summary.count("too few to test") == 2 and "needs n ≥ 7" in summary
    html, _ = _report_text(tmp_path, f)
    assert "pld vs ar on code, b = 1, T = 0:" in html and "too few prompts to test (n = 4, 7 needed)" in html
    assert "2 of 2 compared cells have too few prompts" in html
    be = report.breakeven_table(s).iloc[0]
    assert be["no significant difference"] == "–" and be["too few prompts to test"].startswith("1")


def test_enough_prompts_no_small_n_warning(tmp_path):
    f = _write_sweep(tmp_path / "s", _records(12))
    s = stats.summarize(stats.load_results(f), n_resamples=200)
    assert not s["too_few"].any() and not s["note"].str.contains("too few").any()
    assert "too few" not in cli.sweep_summary(f)
    html, _ = _report_text(tmp_path, f)
    assert "too few" not in html and "pld vs ar on code, b = 1, T = 0:" in html


# ---------------------------------------------------------------------------------------------
# Stalls


def test_stalled_request_flagged_in_summary_and_report(tmp_path):
    f = _write_sweep(tmp_path / "s", _stall(_records(12), "ar", "p3"))
    s = stats.summarize(stats.load_results(f), n_resamples=200)
    ar, pld = s[s["policy"] == "ar"].iloc[0], s[s["policy"] == "pld"].iloc[0]
    assert ar["stalled"] == 1 and ar["timing_suspect"] and "1 of 12 requests stalled" in ar["note"]
    assert re.search(r"vs the cell's median: p3 \d+×\)", ar["note"]), ar["note"]
    assert pld["stalled"] == 0 and pld["timing_suspect"]  # its speedup divides by ar's stalled timing
    assert "ar: 1 of 12 requests stalled" in pld["note"]
    assert "stalled" in cli.sweep_summary(f) and "untrustworthy" in cli.sweep_summary(f)
    html, _ = _report_text(tmp_path, f)
    assert "Stalled requests" in html and "timings untrustworthy (stalled requests)" in html


def test_no_stall_no_flag(tmp_path):
    f = _write_sweep(tmp_path / "s", _records(12))
    s = stats.summarize(stats.load_results(f), n_resamples=200)
    assert (s["stalled"] == 0).all() and not s["timing_suspect"].any()
    assert "stalled" not in cli.sweep_summary(f)
    html, _ = _report_text(tmp_path, f)
    assert "stalled" not in html.lower()


def test_low_acceptance_is_not_a_stall():
    """A request whose drafts were rarely accepted takes more rounds, not longer ones: timing is
    judged per round."""
    recs = _records(12)
    for r in recs:
        if r["policy"] == "pld" and r["prompt_id"] == "p0":
            r["rounds"], r["decode_s"] = r["generated_tokens"] - 1, r["decode_s"] * 4  # τ = 1, 4× the time
    ratio = stats.stalled_requests(pd.DataFrame(recs))
    assert ratio.notna().all() and not (ratio > stats.STALL_FACTOR).any()


def test_run_summary_notes(tmp_path):
    recs = _stall(_gate(_records(12, policies=("pld",))), "pld", "p1")
    notes = cli.run_notes(recs, 1)
    assert any("1 of 12 requests stalled" in n for n in notes)
    assert any("draft gate skipped" in n for n in notes)
    assert cli.run_notes(_records(12, policies=("pld",)), 1) == []


# ---------------------------------------------------------------------------------------------
# The draft gate


def test_draft_gate_said_where_it_skipped(tmp_path):
    f = _write_sweep(tmp_path / "s", _gate(_records(12)))
    s = stats.summarize(stats.load_results(f), n_resamples=200)
    pld = s[s["policy"] == "pld"].iloc[0]
    assert pld["gate_skipped"] > 0 and "draft gate skipped" in pld["note"] and "would not pay at b = 1" in pld["note"]
    html, _ = _report_text(tmp_path, f)
    assert "draft gate skipped drafting in some rounds" in html


def test_draft_gate_drafted_nothing(tmp_path):
    recs = _gate(_records(12), skipped_every=1)
    for r in recs:
        if r["policy"] == "pld":
            r.update(drafted=0, accepted=0, drafted_per_position=[], accepted_per_position=[])
    s = stats.summarize(stats.load_results(_write_sweep(tmp_path / "s", recs)), n_resamples=200)
    note = s[s["policy"] == "pld"].iloc[0]["note"]
    assert note.startswith("drafted nothing: the draft gate skipped") or "drafted nothing" in note
    assert any("drafted nothing (draft gate)" in v for v in report.verdicts(s))


def test_lookup_only_rounds_are_not_called_gated(tmp_path):
    """DSpark with lookup drafts (docs/dspark.md §4.7): a round without confidences that verified drafts
    took lookup drafts only; it is counted apart, and only rounds that verified nothing count as gated."""
    recs = _gate(_records(12))
    for r in recs:
        if r["policy"] == "pld":  # every 4th skipped round verified a lookup draft instead
            r["trace"]["verify_len"] = [3 if not c and i % 4 == 0 else v
                                        for i, (c, v) in enumerate(zip(r["trace"]["confidence"], r["trace"]["verify_len"]))]
    s = stats.summarize(stats.load_results(_write_sweep(tmp_path / "s", recs)), n_resamples=200)
    pld = s[s["policy"] == "pld"].iloc[0]
    rounds = sum(r["rounds"] for r in recs if r["policy"] == "pld")
    lookup_only = sum(1 for r in recs if r["policy"] == "pld" for i, c in enumerate(r["trace"]["confidence"])
                      if not c and i % 4 == 0)
    assert pld["rounds_traced"] == rounds and pld["lookup_only"] == lookup_only > 0
    assert pld["gate_skipped"] == sum(1 for r in recs if r["policy"] == "pld" for c in r["trace"]["confidence"] if not c) - lookup_only
    assert "verified prompt-lookup drafts without a drafter call" in pld["note"]
    assert any("of rounds took lookup drafts only" in v for v in report.verdicts(s))
    assert any("verified prompt-lookup drafts" in n for n in cli.run_notes(recs, 1))


def test_lookup_rounds_of_policies_without_confidences(tmp_path):
    """fixed-k / EAGLE chains with lookup drafts record per round which rows took one (trace `lookup`); a
    round ran no drafter when every row of the batch still decoding took one, and only such rounds that
    verified drafts count as lookup-only."""
    recs = _records(12)
    mine = [r for r in recs if r["policy"] == "pld"]
    for j, r in enumerate(mine):
        n = r["rounds"]
        r["batch_id"] = f"pair{j // 2}"  # two rows a batch
        r["trace"] = {"verify_len": [3] * n, "accepted": [1] * n,
                      "lookup": [int(i % 3 == 0 or (j % 2 == 0 and i % 3 == 1)) for i in range(n)]}
    s = stats.summarize(stats.load_results(_write_sweep(tmp_path / "s", recs)), n_resamples=200)
    pld = s[s["policy"] == "pld"].iloc[0]
    expected = 0
    for a, b in zip(mine[::2], mine[1::2]):
        for i in range(max(len(a["trace"]["verify_len"]), len(b["trace"]["verify_len"]))):
            rows = [t for t in (a["trace"], b["trace"]) if i < len(t["verify_len"])]
            if all(t["lookup"][i] for t in rows):
                expected += sum(1 for t in rows if t["verify_len"][i])
    assert pld["rounds_traced"] == sum(len(r["trace"]["verify_len"]) for r in mine)
    assert pld["lookup_only"] == expected > 0 and pld["gate_skipped"] == 0
    assert "verified prompt-lookup drafts without a drafter call" in pld["note"]


def test_no_gate_no_note(tmp_path):
    s = stats.summarize(stats.load_results(_write_sweep(tmp_path / "s", _records(12))), n_resamples=200)
    assert (s["gate_skipped"] == 0).all() and not s["note"].str.contains("gate").any()


# ---------------------------------------------------------------------------------------------
# The report's top, axes and PDF


def test_verdicts_settings_and_wall_time(tmp_path):
    recs = make_records(workloads={"code": ["code"]}, policies=("ar", "pld", "fixed-k"), batch_sizes=(1, 4),
                        n_prompts=12, seed=5)
    f = _write_sweep(tmp_path / "s", recs, {"policies": ["ar", "pld", "fixed-k"], "batch_sizes": [1, 4], "limit": 12})
    df = stats.load_results(f)
    s = stats.summarize(df, n_resamples=200)
    lines = report.verdicts(s)
    assert len(lines) == 4
    for line in lines:
        assert re.fullmatch(r"(pld|fixed-k) vs ar on code, b = [14], T = 0: \d\.\d\d× \[\d\.\d\d, \d\.\d\d\], "
                            r"(faster|slower|no significant difference)", line), line
    settings = report.settings_lines(df)
    assert "policies ar, pld, fixed-k" in settings[0] and "batch sizes 1, 4" in settings[0] and "limit 12" in settings[0]
    wall = sum({r["batch_id"]: r["batch_wall_s"] for r in recs}.values())
    assert settings[1].startswith(f"Wall time decoding: {report._duration(wall)} over ")


def test_speedup_axis_labels_once_and_not_crowded():
    from matplotlib.figure import Figure

    for values in ([0.1, 1.0], [0.5, 1.6], [0.9, 1.1], [0.05, 12.0]):
        ax = Figure().subplots()
        report._speedup_axis(ax, values)
        ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        labels = [ax.yaxis.get_major_formatter()(t, 0) for t in ticks]
        assert len(labels) == len(set(labels)) and 2 <= len(labels) <= 7, (values, labels)
        assert not ax.get_yticks(minor=True).size


def test_conditional_acceptance_above_one_is_not_clipped():
    """conditional = acc[k] / acc[k−1] (docs: ratio of consecutive unconditional values) exceeds 1
    when fewer rounds drafted k tokens than k−1; the axis shows it whole."""
    pos = pd.DataFrame([{"workload": "w", "temperature": 0.0, "policy": "pld", "batch_size": b, "position": k,
                         "acceptance": a, "conditional": c, "drafted": 10, "accepted": 5, "acceptance_vllm": a}
                        for b in (1, 4) for k, a, c in ((1, 0.3, 0.3), (2, 0.24, 0.8), (3, 0.3, 1.25))])
    fig = report.fig_position(pos, report._colors(["ar", "pld"]))
    cond_ax = fig.axes[1]
    assert cond_ax.get_ylim()[1] >= 1.25
    lines = [ln for ln in cond_ax.get_lines() if len(ln.get_xdata()) == 3]
    assert len({ln.get_linestyle() for ln in lines}) == 2 and len({ln.get_marker() for ln in lines}) == 2
    assert not np.allclose(lines[0].get_xdata(), lines[1].get_xdata())  # equal curves drawn side by side


def test_environment_fields_once():
    """'device' is both an env field and a record field: the environment table lists it once."""
    recs = _records(4)
    for r in recs:
        r["env"]["device"] = "cpu"
    frame = pd.DataFrame([{**{k: v for k, v in r.items() if k != "env"}, **{f"env.{k}": v for k, v in r["env"].items()}}
                          for r in recs])
    env = environment_table(frame)
    assert env["field"].is_unique and "device" in set(env["field"])


@pytest.mark.skipif(PDFTOTEXT is None, reason="pdftotext not installed (apt-get install -y poppler-utils)")
def test_pdf_first_pages_hold_the_answers(tmp_path):
    """Page 1: title, settings, verdicts; page 2: the summary with b, T, n in their own columns,
    its Note column (footnotes) and the 'Where speculation stops paying' table."""
    f = _write_sweep(tmp_path / "s", _stall(_records(4, batch_sizes=(1, 4)), "ar", "p1"))
    _, pdf = _report_text(tmp_path, f)

    def page(i):
        return subprocess.run([PDFTOTEXT, "-layout", "-f", str(i), "-l", str(i), str(pdf), "-"], capture_output=True,
                              text=True, timeout=60, check=True).stdout

    one, two = page(1), page(2)
    assert "Verdicts" in one and "pld vs ar on code, b = 1, T = 0" in one and "Settings" in one and "Wall time" in one
    assert re.search(r"Workload\s+b\s+T\s+Policy\s+n\s", two), two[:400]
    assert "Note" in two and "[1] " in two and "too few to test" in two and "stalled" in two
    assert "Where speculation stops paying" in two and "too few prompts to test" in two
