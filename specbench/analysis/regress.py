"""Noise-aware CI regression gate: compare a run's results records against a baseline's.

``python -m specbench regress --baseline results/baseline/NAME/ --current results/NAME/``
exits 1 (and prints what regressed, by how much, with CIs) only when the evidence says so,
0 otherwise; bad input (missing paths, no common cells, malformed records) is a
:class:`specbench.errors.UserError`, which the CLI turns into exit 2. docs/regress.md has the
rules and the measured A/A and injected-slowdown numbers.

Cells are (workload, batch_size, temperature, policy ≠ ar) present in both runs. The paired unit
is the prompt: per (prompt_id, turn) values are averaged over repeats (and seeds), then over a
prompt's turns, as in :mod:`specbench.analysis.stats`. Per cell, four metrics:

* ``tau`` (mean tokens per round) and ``acceptance`` (Σaccepted / Σdrafted over the paired
  prompts). Greedy (temperature 0) decoding is deterministic, so any drop beyond float noise
  (relative 1e-9) is a regression. Under sampling: a paired bootstrap CI of the difference
  new − old; regression when its upper bound < −max_slowdown · old.
* ``speedup_wall``: the wall-clock speedup vs ``ar`` measured *within* each run (per-prompt
  tokens/s ratio to the ar record of the same prompt, turn, batch size and temperature), then the
  per-prompt ratio current / baseline; geometric mean over prompts with a 95% BCa bootstrap CI.
  Regression only when the CI's upper bound < 1 − max(max_slowdown, tolerance), where the
  tolerance is calibrated from A/A runs (``aa.json`` beside the baseline, see
  :func:`calibrate_tolerance`; 0 without one).
* ``speedup_cost``: a cost-model speedup from the records and a measured cost profile
  (:func:`specbench.costs.profile.step_time_model`): per request, AR time = (generated_tokens − 1) ·
  T(b, 1) and policy time = Σ_rounds [T(b, 1 + verify_len) + D(b)] (D: the profile's drafting
  cost, for policies with a drafter, when the profile has a ``draft`` table); b = the batch's
  rows. Per prompt: ratio of the summed times; per cell: geometric mean. Both runs use the same
  profile, so this metric is stable across machines. Greedy: deterministic, regression when the
  ratio < 1 − max_slowdown; sampling: bootstrap CI of the geometric-mean ratio, regression when
  its upper bound < 1 − max_slowdown.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from specbench import atomic
from specbench.costs.schema import check_profile, read_profile
from specbench.errors import UserError
from specbench.analysis.stats import BASELINE, CELL, DEFAULT_RESAMPLES, DEFAULT_SEED, bootstrap_ci, gmean_ci, load_results, \
    paired_log_ratios

GREEDY_RTOL = 1e-9  # relative float noise allowed on deterministic (greedy) metrics
AA_FILE = "aa.json"  # A/A calibration, beside the baseline records
PROFILE_FILE = "profile.json"  # optional cost profile stored with the baseline
AA_QUANTILE = 0.95
METRICS = ("tau", "acceptance", "speedup_wall", "speedup_cost")
REGRESSED, OK, IMPROVED, NA = "REGRESSED", "ok", "improved", "n/a"

_PROMPT = ["prompt_id", "turn"]


# ---------------------------------------------------------------------------------------------
# Loading


def _load(path, what: str) -> pd.DataFrame:
    if isinstance(path, pd.DataFrame):
        return path
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} results path not found: {p}")
    df = load_results(p)
    if "tau" not in df and not {"generated_tokens", "rounds"} <= set(df.columns):
        raise UserError(f"{what} records ({p}) lack tau (or generated_tokens and rounds)")
    df = df.copy()
    df["temperature"] = df["temperature"].astype(float).round(6)
    return df


def _aa_path(baseline) -> Path | None:
    if isinstance(baseline, pd.DataFrame):
        return None
    p = Path(baseline)
    return (p if p.is_dir() else p.parent) / AA_FILE


def read_tolerance(baseline) -> tuple[float, str]:
    """(tolerance, source) from ``aa.json`` beside the baseline records, else (0, reason)."""
    path = _aa_path(baseline)
    if path is None or not path.is_file():
        return 0.0, "no aa.json: tolerance 0"
    try:
        tol = float(json.loads(path.read_text())["tolerance"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not an A/A calibration file ({e})") from None
    if not (math.isfinite(tol) and tol >= 0):
        raise UserError(f"{path}: tolerance must be a finite number ≥ 0, got {tol}")
    return tol, f"tolerance {tol:.4f} from {path}"


# ---------------------------------------------------------------------------------------------
# Cost profile


def resolve_profile(profile, baseline, base_df: pd.DataFrame) -> tuple[dict | None, str]:
    """The cost profile both runs are priced with, and where it came from.

    Order: ``profile`` (a path or a dict); ``profile.json`` beside the baseline records; a
    committed (results/profiles/) or cached (``$SPECBENCH_CACHE/profiles``) profile measured for
    the baseline's target (one for the baseline's device preferred). None: the metric is skipped.
    """
    if isinstance(profile, dict):
        return check_profile(profile, "profile"), "given profile"
    if profile is not None:
        p = Path(profile)
        if not p.is_file():
            raise UserError(f"cost profile not found: {p}")
        return read_profile(p), str(p)
    aa = _aa_path(baseline)
    if aa is not None and (aa.parent / PROFILE_FILE).is_file():
        return read_profile(aa.parent / PROFILE_FILE), str(aa.parent / PROFILE_FILE)
    targets = set(base_df["target"].dropna().astype(str)) if "target" in base_df else set()
    if not targets:
        return None, "no cost profile (records name no target): speedup_cost skipped"
    devices = set(base_df["env.device_name"].dropna().astype(str)) if "env.device_name" in base_df else set()
    from specbench.costs import profile as profiles
    folders = profiles.committed_profiles()
    try:
        from specbench.engine.loading import default_cache_dir

        folders.append(default_cache_dir() / "profiles")
    except Exception:  # pragma: no cover - cache location unavailable
        pass
    found = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = read_profile(path)
            except UserError:
                continue
            if str(data.get("target")) in targets:
                name = str(data.get("device_name", ""))
                same_device = any(name.startswith(d) or d.startswith(name) for d in devices if d and name)
                found.append((not same_device, len(found), path, data))
    if not found:
        return None, f"no cost profile for {', '.join(sorted(targets))} (give --profile): speedup_cost skipped"
    _, _, path, data = min(found, key=lambda x: x[:2])
    return data, str(path)


def _cost_fn(profile: dict):
    """record → (AR seconds, policy seconds), from the profile's step (and draft) time models."""
    from specbench.costs.profile import draft_time_model, step_time_model

    step = lru_cache(maxsize=None)(step_time_model(profile))
    draft = lru_cache(maxsize=None)(draft_time_model(profile["draft"])) if profile.get("draft") else None

    def cost(rec) -> tuple[float, float]:
        gen, rounds = rec.get("generated_tokens"), rec.get("rounds")
        if not _num(gen) or not _num(rounds) or rounds <= 0 or gen <= 1:
            return float("nan"), float("nan")
        rows = rec.get("batch_rows")
        rows = int(rows) if _num(rows) and rows > 0 else int(rec["batch_size"])
        trace = rec.get("trace")
        lengths = trace.get("verify_len") if isinstance(trace, dict) else None
        if isinstance(lengths, list) and len(lengths) == int(rounds):
            pol = sum(step(rows, 1 + int(v)) for v in lengths)
        else:  # no trace: the mean verify length of its rounds
            drafted = rec.get("drafted")
            mean_len = float(drafted) / rounds if _num(drafted) else 0.0
            lo = int(math.floor(mean_len))
            frac = mean_len - lo
            pol = rounds * ((1 - frac) * step(rows, 1 + lo) + frac * step(rows, 2 + lo))
        if draft is not None and rec.get("drafter") not in (None, ""):
            pol += rounds * draft(rows)
        return (gen - 1) * step(rows, 1), pol

    return cost


def _num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(float(x))


# ---------------------------------------------------------------------------------------------
# Per-prompt tables


def _cell_key(row) -> tuple:
    return tuple(row[c] for c in CELL) + (row["policy"],)


def _cells(df: pd.DataFrame) -> set[tuple]:
    d = df[df["policy"] != BASELINE]
    return set(map(tuple, d[list(CELL) + ["policy"]].drop_duplicates().itertuples(index=False, name=None)))


def _settings(df: pd.DataFrame) -> dict[tuple, str]:
    """cell → its policy_params and drafter, as one string (to note a change between runs)."""
    out: dict[tuple, set] = {}
    cols = [c for c in ("policy_params", "drafter") if c in df]
    if not cols:
        return {}
    for rec in df[df["policy"] != BASELINE][list(CELL) + ["policy"] + cols].to_dict("records"):
        key = tuple(rec[c] for c in CELL) + (rec["policy"],)
        desc = json.dumps({c: rec[c] for c in cols}, sort_keys=True, default=str)
        out.setdefault(key, set()).add(desc)
    return {k: " | ".join(sorted(v)) for k, v in out.items()}


def _prompt_table(df: pd.DataFrame, cost) -> pd.DataFrame:
    """One row per (cell, policy ≠ ar, prompt_id): tau (mean over repeats, then turns), sums of
    accepted / drafted / cost-model times, and the first repeat's outputs per turn."""
    d = df[df["policy"] != BASELINE].copy()
    if "tau" not in d:
        d["tau"] = np.nan
    if {"generated_tokens", "rounds"} <= set(d.columns):  # fill tau where missing (n/a: one token)
        rounds = pd.to_numeric(d["rounds"], errors="coerce")
        calc = (pd.to_numeric(d["generated_tokens"], errors="coerce") - 1) / rounds.where(rounds > 0)
        d["tau"] = pd.to_numeric(d["tau"], errors="coerce").fillna(calc)
    d["tau"] = pd.to_numeric(d["tau"], errors="coerce")
    for c in ("accepted", "drafted"):
        d[c] = pd.to_numeric(d[c], errors="coerce") if c in d else np.nan
    if cost is not None:
        times = [cost(r) for r in d.to_dict("records")]
        d["cost_ar"] = [t[0] for t in times]
        d["cost_pol"] = [t[1] for t in times]
    else:
        d["cost_ar"] = d["cost_pol"] = np.nan
    d["outputs"] = d["output_ids"].map(lambda v: tuple(v) if isinstance(v, list) else None) if "output_ids" in d else None
    keys = list(CELL) + ["policy"] + _PROMPT
    pt = d.sort_values("repeat", kind="stable").groupby(keys, dropna=False, sort=True).agg(
        tau=("tau", "mean"), accepted=("accepted", lambda s: s.sum(min_count=1)),
        drafted=("drafted", lambda s: s.sum(min_count=1)), cost_ar=("cost_ar", lambda s: s.sum(min_count=1)),
        cost_pol=("cost_pol", lambda s: s.sum(min_count=1)), outputs=("outputs", "first")).reset_index()
    keys = list(CELL) + ["policy", "prompt_id"]
    return pt.groupby(keys, dropna=False, sort=True).agg(
        tau=("tau", "mean"), accepted=("accepted", lambda s: s.sum(min_count=1)),
        drafted=("drafted", lambda s: s.sum(min_count=1)), cost_ar=("cost_ar", lambda s: s.sum(min_count=1)),
        cost_pol=("cost_pol", lambda s: s.sum(min_count=1)), outputs=("outputs", tuple)).reset_index()


def wall_log_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per (cell, policy ≠ ar, prompt_id): ``log_ratio`` = log(tokens/s of the policy / tokens/s
    of ar), paired within the run (:func:`specbench.analysis.stats.paired_log_ratios`)."""
    out = []
    if BASELINE in set(df["policy"]):
        for pol in sorted(set(df["policy"]) - {BASELINE}):
            p = paired_log_ratios(df, pol, BASELINE, by=CELL)
            if len(p):
                out.append(p.assign(policy=pol)[list(CELL) + ["policy", "prompt_id", "log_ratio"]])
    if not out:
        return pd.DataFrame(columns=list(CELL) + ["policy", "prompt_id", "log_ratio"])
    w = pd.concat(out, ignore_index=True)
    return w[np.isfinite(w["log_ratio"].astype(float))]


def _select(table: pd.DataFrame, cell: tuple) -> pd.DataFrame:
    if table.empty:
        return table
    mask = np.ones(len(table), dtype=bool)
    for c, v in zip(list(CELL) + ["policy"], cell):
        mask &= (table[c] == v).to_numpy()
    return table[mask]


# ---------------------------------------------------------------------------------------------
# Metrics of one cell


def _row(cell, metric, **kw) -> dict:
    wl, b, t, pol = cell
    row = {"cell": f"{wl} b={b} T={t:g} {pol}", "workload": wl, "batch_size": b, "temperature": t, "policy": pol,
           "metric": metric, "old": float("nan"), "new": float("nan"), "ratio": float("nan"),
           "ci_low": float("nan"), "ci_high": float("nan"), "n": 0, "verdict": NA, "rule": "", "note": ""}
    row.update(kw)
    return row


def _constant(*arrays: np.ndarray) -> bool:
    """All values equal (to float noise) in each array: no bootstrap needed, the CI is a point."""
    return arrays[0].size >= 2 and all(np.ptp(a) <= 1e-12 * max(1.0, float(np.max(np.abs(a)))) for a in arrays)


def _ci(data, statistic, kw, **extra) -> tuple[float, float, str]:
    """:func:`specbench.analysis.stats.bootstrap_ci`; when BCa is degenerate, the percentile interval."""
    lo, hi, note = bootstrap_ci(data, statistic, **{**kw, **extra})
    if not (np.isfinite(lo) and np.isfinite(hi)) and extra.get("method", "BCa") == "BCa" and "n<2" not in note:
        lo, hi, note2 = bootstrap_ci(data, statistic, **{**kw, **extra, "method": "percentile"})
        note = "percentile CI (BCa degenerate)" if np.isfinite(hi) else note2
    return lo, hi, note


def _diff_ci(d: np.ndarray, kw) -> tuple[float, float, str]:
    """CI of mean(d); all-equal differences give the degenerate interval [d, d]."""
    if _constant(d):
        return float(d.mean()), float(d.mean()), ""
    return _ci(d, np.mean, kw)


def _mean_metric(cell, metric, old: np.ndarray, new: np.ndarray, greedy: bool, max_slowdown: float, kw, note="") -> dict:
    """τ-like metric: paired per prompt; greedy → any drop; sampling → CI of the mean difference."""
    n = old.size
    if n == 0:
        return _row(cell, metric, note="no paired prompts with values")
    o, w = float(old.mean()), float(new.mean())
    lo, hi, ci_note = _diff_ci(new - old, kw)
    ratio = w / o if o else float("nan")
    ci = ((o + lo) / o, (o + hi) / o) if o else (float("nan"), float("nan"))
    notes = [x for x in (note, ci_note) if x]
    if greedy:
        rule = "greedy: any drop"
        verdict = REGRESSED if w < o * (1 - GREEDY_RTOL) - 1e-12 else IMPROVED if w > o * (1 + GREEDY_RTOL) + 1e-12 else OK
    else:
        rule = f"CI high < -{max_slowdown:g}·old"
        if not np.isfinite(hi):
            verdict = NA
        else:
            verdict = REGRESSED if hi < -max_slowdown * o else IMPROVED if lo > max_slowdown * o else OK
    return _row(cell, metric, old=o, new=w, ratio=ratio, ci_low=ci[0], ci_high=ci[1], n=n, verdict=verdict, rule=rule,
                note="; ".join(notes))


def _ratio_of_sums_diff(a_new, d_new, a_old, d_old, axis=-1):
    return np.sum(a_new, axis=axis) / np.sum(d_new, axis=axis) - np.sum(a_old, axis=axis) / np.sum(d_old, axis=axis)


def _acceptance(cell, m: pd.DataFrame, greedy: bool, max_slowdown: float, kw) -> dict:
    m = m.dropna(subset=["accepted_b", "drafted_b", "accepted_c", "drafted_c"])
    if m.empty or m["drafted_b"].sum() <= 0 or m["drafted_c"].sum() <= 0:
        return _row(cell, "acceptance", n=len(m), note="nothing drafted: no acceptance rate")
    ab, db, ac, dc = (m[c].to_numpy(dtype=float) for c in ("accepted_b", "drafted_b", "accepted_c", "drafted_c"))
    o, w = ab.sum() / db.sum(), ac.sum() / dc.sum()
    arrays = (ac, dc, ab, db)
    if _constant(*arrays):
        lo = hi = w - o
        note = ""
    else:
        lo, hi, note = _ci(arrays, _ratio_of_sums_diff, kw, paired=True, method="percentile")
    ratio = w / o if o else float("nan")
    ci = ((o + lo) / o, (o + hi) / o) if o else (float("nan"), float("nan"))
    if greedy:
        rule = "greedy: any drop"
        verdict = REGRESSED if w < o * (1 - GREEDY_RTOL) - 1e-12 else IMPROVED if w > o * (1 + GREEDY_RTOL) + 1e-12 else OK
    else:
        rule = f"CI high < -{max_slowdown:g}·old"
        verdict = NA if not np.isfinite(hi) else REGRESSED if hi < -max_slowdown * o else \
            IMPROVED if lo > max_slowdown * o else OK
    return _row(cell, "acceptance", old=o, new=w, ratio=ratio, ci_low=ci[0], ci_high=ci[1], n=len(m), verdict=verdict,
                rule=rule, note=note)


def _gm_metric(cell, metric, log_old: np.ndarray, log_new: np.ndarray, threshold: float, kw, *,
               deterministic: bool = False, note: str = "", rule: str = "") -> dict:
    """Geometric-mean ratio metric (speedups): per-prompt log ratios new − old, with a bootstrap CI."""
    n = log_old.size
    if n == 0:
        return _row(cell, metric, note="; ".join(x for x in (note, "no paired prompts") if x))
    d = log_new - log_old
    if _constant(d):
        ratio = lo = hi = float(np.exp(d.mean()))
        ci_note = ""
    else:
        ratio, lo, hi, ci_note = gmean_ci(np.exp(d), **kw)
        if n >= 2 and not np.isfinite(hi):
            lo, hi, ci_note = _ci(d, np.mean, kw)
            lo, hi = float(np.exp(lo)), float(np.exp(hi))
    notes = [x for x in (note, ci_note) if x]
    if deterministic:
        verdict = REGRESSED if ratio < threshold else IMPROVED if ratio > 1 + GREEDY_RTOL else OK
    elif not np.isfinite(hi):
        verdict = NA
        notes.append("no CI: no verdict")
    else:
        verdict = REGRESSED if hi < threshold else IMPROVED if lo > 2 - threshold else OK
    return _row(cell, metric, old=float(np.exp(log_old.mean())), new=float(np.exp(log_new.mean())), ratio=ratio,
                ci_low=lo, ci_high=hi, n=n, verdict=verdict, rule=rule, note="; ".join(notes))


# ---------------------------------------------------------------------------------------------
# The gate


def compare(baseline_path, current_path, max_slowdown: float = 0.05, tolerance: float | None = None, profile=None,
            n_resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> tuple[list[dict], bool]:
    """Compare the current run's records against the baseline's; returns (rows, regressed).

    ``baseline_path``, ``current_path``: a results ``.jsonl`` file or a directory of them (or a
    DataFrame from :func:`specbench.analysis.stats.load_results`). ``tolerance``: the wall-clock A/A
    tolerance (None: ``aa.json`` beside the baseline, else 0). ``profile``: cost profile path or
    dict (None: see :func:`resolve_profile`). One row per (cell, metric) with cell, metric, old,
    new, ratio (new / old), ci_low / ci_high (CI of the ratio), n (paired prompts), verdict
    (REGRESSED / ok / improved / n/a), rule and note.
    """
    if not (isinstance(max_slowdown, (int, float)) and 0 <= max_slowdown < 1):
        raise UserError(f"max slowdown must be in [0, 1), got {max_slowdown!r}")
    base = _load(baseline_path, "baseline")
    cur = _load(current_path, "current")
    common = sorted(_cells(base) & _cells(cur), key=lambda c: (str(c[0]), c[1], c[2], str(c[3])))
    if not common:
        def show(df):
            cells = sorted(_cells(df), key=str)
            return ", ".join(f"{w}/b{b}/T{t:g}/{p}" for w, b, t, p in cells[:6]) or "none"
        raise UserError(f"no common cells (workload, batch size, temperature, policy ≠ ar): "
                        f"baseline has {show(base)}; current has {show(cur)}")
    if tolerance is None:
        tol, tol_note = read_tolerance(baseline_path)
    else:
        if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
            raise UserError(f"tolerance must be a finite number ≥ 0, got {tolerance!r}")
        tol, tol_note = float(tolerance), f"tolerance {float(tolerance):.4f} given"
    prof, prof_note = resolve_profile(profile, baseline_path, base)
    cost = _cost_fn(prof) if prof is not None else None
    kw = dict(n_resamples=n_resamples, seed=seed)

    pb, pc = _prompt_table(base, cost), _prompt_table(cur, cost)
    sb, sc = _settings(base), _settings(cur)
    wb, wc = wall_log_speedups(base), wall_log_speedups(cur)
    wall_threshold = 1 - max(max_slowdown, tol)
    rows = []
    for cell in common:
        greedy = cell[2] == 0
        m = _select(pb, cell).merge(_select(pc, cell), on=list(CELL) + ["policy", "prompt_id"], suffixes=("_b", "_c"))
        # tau
        t = m.dropna(subset=["tau_b", "tau_c"])
        notes = []
        if sb.get(cell) != sc.get(cell):
            notes.append(f"settings changed: {sb.get(cell)} -> {sc.get(cell)}")
        if greedy and "outputs_b" in t:
            differ = int(sum(1 for x, y in zip(t["outputs_b"], t["outputs_c"]) if None not in x + y and x != y))
            if differ:
                notes.append(f"outputs differ on {differ}/{len(t)} prompts")
        note = "; ".join(notes)
        rows.append(_mean_metric(cell, "tau", t["tau_b"].to_numpy(float), t["tau_c"].to_numpy(float), greedy,
                                 max_slowdown, kw, note=note))
        rows.append(_acceptance(cell, m, greedy, max_slowdown, kw))
        # wall-clock speedup vs ar within each run
        w = _select(wb, cell).merge(_select(wc, cell), on=list(CELL) + ["policy", "prompt_id"], suffixes=("_b", "_c"))
        missing = [name for name, df in (("baseline", base), ("current", cur)) if BASELINE not in set(df["policy"])]
        rows.append(_gm_metric(
            cell, "speedup_wall", w["log_ratio_b"].to_numpy(float), w["log_ratio_c"].to_numpy(float), wall_threshold, kw,
            note=f"no {BASELINE} records in {' and '.join(missing)}" if missing else tol_note,
            rule=f"CI high < {wall_threshold:.4g}"))
        # cost-model speedup
        if cost is None:
            rows.append(_row(cell, "speedup_cost", note=prof_note))
        else:
            c = m.dropna(subset=["cost_ar_b", "cost_pol_b", "cost_ar_c", "cost_pol_c"])
            c = c[(c["cost_pol_b"] > 0) & (c["cost_pol_c"] > 0) & (c["cost_ar_b"] > 0) & (c["cost_ar_c"] > 0)]
            lb = np.log(c["cost_ar_b"].to_numpy(float) / c["cost_pol_b"].to_numpy(float))
            lc = np.log(c["cost_ar_c"].to_numpy(float) / c["cost_pol_c"].to_numpy(float))
            rows.append(_gm_metric(cell, "speedup_cost", lb, lc, 1 - max_slowdown, kw, deterministic=greedy,
                                   note=f"profile {prof_note}",
                                   rule=(f"ratio < {1 - max_slowdown:.4g}" if greedy else f"CI high < {1 - max_slowdown:.4g}")))
    return rows, any(r["verdict"] == REGRESSED for r in rows)


# ---------------------------------------------------------------------------------------------
# A/A calibration


def aa_log_ratios(pairs_of_runs: Iterable[Sequence], n_resamples: int = 0) -> list[float]:
    """log of the geometric-mean wall-clock speedup ratio (B vs A) of every cell of every A/A pair."""
    out = []
    for pair in pairs_of_runs:
        if len(pair) != 2:
            raise UserError("A/A calibration takes pairs of runs (A, B)")
        a, b = _load(pair[0], "A/A run"), _load(pair[1], "A/A run")
        wa, wb = wall_log_speedups(a), wall_log_speedups(b)
        m = wa.merge(wb, on=list(CELL) + ["policy", "prompt_id"], suffixes=("_a", "_b"))
        for _, g in m.groupby(list(CELL) + ["policy"], sort=True):
            out.append(float((g["log_ratio_b"] - g["log_ratio_a"]).mean()))
    return out


def calibrate_tolerance(pairs_of_runs: Iterable[Sequence], quantile: float = AA_QUANTILE) -> float:
    """Wall-clock tolerance from A/A runs (pairs of runs of the same code on the same machine):
    the ``quantile`` (95th percentile) of |log r| over every pair and common cell, where r is the
    geometric-mean ratio of the per-prompt wall-clock speedups vs ar (B / A). For small values
    |log r| ≈ the relative change, the unit of ``max_slowdown``."""
    logs = aa_log_ratios(pairs_of_runs)
    if not logs:
        raise UserError("A/A calibration: no common cells with ar records in the given pairs")
    return float(np.quantile(np.abs(logs), quantile))


def write_aa(path, pairs_of_runs: Sequence[Sequence], quantile: float = AA_QUANTILE) -> dict:
    """Calibrate from ``pairs_of_runs`` and write ``aa.json`` (``path``: the file, or the baseline
    directory to write it into). Returns what was written."""
    pairs = [tuple(p) for p in pairs_of_runs]
    logs = aa_log_ratios(pairs)
    if not logs:
        raise UserError("A/A calibration: no common cells with ar records in the given pairs")
    data = {
        "tolerance": float(np.quantile(np.abs(logs), quantile)),
        "quantile": quantile,
        "statistic": "quantile of |log(geometric-mean wall-clock speedup ratio B/A)| over A/A pairs and cells",
        "n_pairs": len(pairs),
        "n_values": len(logs),
        "log_ratios": logs,
        "runs": [[str(x) if not isinstance(x, pd.DataFrame) else "<DataFrame>" for x in p] for p in pairs],
    }
    path = Path(path)
    if path.is_dir():
        path = path / AA_FILE
    atomic.write_json(path, data)
    return data


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(v, digits=4) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, (int, np.integer)):
        return str(v)
    return f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def format_table(rows: Sequence[dict], only_regressed: bool = False) -> str:
    """Plain-text table: cell, metric, old, new, ratio (new/old), 95% CI of the ratio, n, verdict, rule, note."""
    rows = [r for r in rows if r["verdict"] == REGRESSED] if only_regressed else list(rows)
    head = ["cell", "metric", "old", "new", "ratio", "95% CI", "n", "verdict", "rule", "note"]
    body = []
    for r in rows:
        ci = "-" if not (np.isfinite(r["ci_low"]) and np.isfinite(r["ci_high"])) else \
            f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        ratio = "-" if not np.isfinite(r["ratio"]) else f"{r['ratio']:.4f}"
        body.append([r["cell"], r["metric"], _fmt(r["old"]), _fmt(r["new"]), ratio, ci, str(r["n"]), r["verdict"],
                     r["rule"], r["note"]])
    widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in body]
    return "\n".join(lines)
