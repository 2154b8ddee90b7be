"""Layer 6: paired statistics over results records (docs/records.md).

Everything here reads a DataFrame of records (one row per completed request, as returned by
:func:`load_results`) and returns DataFrames; nothing here runs a model.

Conventions (the report and the README quote these):

* **Cell** = (workload, batch_size, temperature, policy); with ``by_category=True`` the
  category is part of the cell too.
* **Paired unit = prompt.** Within a cell, a policy's request is paired with the ``ar``
  request on the same (prompt_id, turn) at the same batch size and temperature.
  *Repeats:* tokens/s is first averaged (arithmetic mean) over repeats (and seeds) of the same
  (prompt_id, turn), separately for each policy, and the ratio is taken of those means. This
  works the same whether or not both policies ran the same repeat indices, and makes the
  prompt, not the repeat, the independent unit (repeats of one prompt are not independent
  samples, so treating them as such would make the CIs too narrow).
  *Turns:* a multi-turn prompt's log speedups are averaged over its turns (geometric mean),
  so a prompt counts once. ``n`` is the number of paired prompts.
* **Headline speedup** = geometric mean over prompts of s = tps_policy / tps_ar, with a
  bootstrap CI on mean(log s) (BCa, 2000 resamples, fixed seed), exponentiated.
  Also reported: Spec-Bench's ratio of means, mean_q(tps_policy) / mean_q(tps_ar), over the
  same paired prompts, and the time-weighted ratio Σtokens/Σdecode time of each side.
* **Test** = two-sided Wilcoxon signed-rank test of log s against 0 (``scipy.stats.wilcoxon``
  defaults), Holm-corrected across every cell in the returned table (the "family" is the
  table: all workloads × batch sizes × temperatures × policies [× categories]).
* **Effect sizes** = median log speedup and the matched-pairs rank-biserial correlation
  r = (T+ − T−) / (T+ + T−) (zero differences dropped, as in Wilcoxon's ``zero_method='wilcox'``).
* τ = mean of the per-request ``tau`` field (per prompt first, then over prompts, with a
  bootstrap CI); ``tau_pooled`` = Σ(generated_tokens − 1) / Σ rounds.
  acceptance rate = Σaccepted / Σdrafted (CI: bootstrap over prompts of the ratio of sums).
  per-user tokens/s = median over prompts (percentile-bootstrap CI).
  throughput = Σ batch_generated_tokens / Σ batch_wall_s over the cell's unique batch_id.
  **Throughput ratio** against the baseline = geometric mean over paired batches (the same
  workload, batch size, temperature, seed, repeat, batch index and turn: the batch_id up to its
  policy) of (tokens / wall)_policy / (tokens / wall)_baseline, with a bootstrap CI on the mean
  log ratio (percentile); n_batch_pairs is its n. The rows of a batch share one wall time, so at
  b > 1 this, not the per-request speedup, is the load test, and its n is batches, not prompts.
* Cells with n < 2, or whose values are all identical, get NaN CIs and a ``note``.
* **Too few prompts to test**: the exact two-sided Wilcoxon p of n pairs is at least 2 / 2^n (all
  differences of one sign), and Holm multiplies the smallest p of the family by the number m of
  tested cells. A cell with m · p_min(n) ≥ 0.05 can never be significant, whatever its data:
  ``too_few`` is set and the note says so and which n the family would need (n = 4: p ≥ 0.125
  even alone; 6 prompts suffice for one cell, 9 for ten). Such a cell is not "no difference".
* **Stalled requests**: a request whose decode time per verify round exceeds
  ``STALL_FACTOR`` (3) × the median of its cell (same workload, batch size, temperature and
  policy) was stalled by something outside the decode (a loaded machine, swapping): ``stalled``
  counts them, and the cell's timings (tokens/s, throughput, the speedups paired on them, the
  baseline's included) are flagged in the note as untrustworthy (``timing_suspect``). τ and
  acceptance do not depend on timing and stay valid.
* **Draft gate** (DSpark, ``policy_params.draft_gate``): rounds whose trace ``confidence`` is
  ``[]`` were decoded without drafting because the gate judged drafting would not pay on the
  device's cost profile; ``gate_skipped`` / ``rounds_traced`` count them and the note says so (a
  τ of 1 then means "did not draft", not "drafted badly"). A round with ``[]`` that verified drafts
  all the same took prompt-lookup drafts only (``policy_params.lookup_ngram``): ``lookup_only``
  counts those, and they are not gated. Policies without confidences that take lookup drafts
  (fixed-k, EAGLE chains) record per round which rows did (trace ``lookup``); a round in which every
  row of the batch did ran no drafter, and counts in ``lookup_only`` too.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as _st

from specbench.errors import UserError

BASELINE = "ar"
CELL = ("workload", "batch_size", "temperature")
DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
CONFIDENCE = 0.95
ALPHA = 0.05
STALL_FACTOR = 3.0  # decode time per round above this × the cell's median: a stalled request

# Fields a record must have for the analysis to pair it (docs/records.md).
_REQUIRED = ("policy", "workload", "prompt_id", "batch_size", "temperature", "tokens_per_s")
_DEFAULTS = {"turn": 0, "repeat": 0}


# --------------------------------------------------------------------------------------------
# Loading


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if not files:
            raise UserError(f"no *.jsonl results files under {path}")
        return files
    if path.is_file():
        return [path]
    raise UserError(f"results path not found: {path}")


def _source(f: Path, root: Path) -> str:
    """Which sweep or set of runs a records file belongs to: the nearest directory (from the file
    up to ``root``) holding a ``sweep.json``, else the file's own directory (a `run` writes one
    file per policy beside the others, and those pair with each other)."""
    for d in f.parents:
        if (d / "sweep.json").is_file():
            return str(d)
        if d == root:
            break
    return str(f.parent)


def sources(df: pd.DataFrame) -> list[str]:
    """The distinct ``source`` values of loaded records (see :func:`load_results`), in order."""
    return sorted(df["source"].unique()) if "source" in df.columns else []


def load_results(path: str | Path) -> pd.DataFrame:
    """Read results records from a ``.jsonl`` file or every ``*.jsonl`` under a directory.

    One row per record. List fields (``output_ids``, ``*_per_position``) stay Python lists;
    dict fields (``policy_params``, ``trace``) stay dicts, except ``env`` which is flattened
    to ``env.<name>`` columns. Two bookkeeping columns are added: ``_file`` and ``_line``.
    Records repeated with the same ``key`` (e.g. a file copied twice) are kept once (first
    seen); the number dropped is in ``df.attrs["duplicates_dropped"]``. ``source`` names the
    sweep directory (the nearest one with a ``sweep.json``) or, for loose run files, the directory
    a file lies in: records of different sources were measured at different times under different
    settings and must not be paired or pooled (``compare`` keeps them apart, ``report`` refuses).

    A line that is not a JSON object, or lacks a field the analysis needs, raises
    :class:`specbench.errors.UserError` naming the file and line number.
    """
    path = Path(path)
    rows: list[dict] = []
    for f in _jsonl_files(path):
        source = _source(f, path) if path.is_dir() else str(f.parent)
        with open(f, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{f}:{lineno}: malformed results record (column {e.colno}: {e.msg})") from None
                if not isinstance(rec, dict):
                    raise UserError(f"{f}:{lineno}: results record is not a JSON object")
                missing = [k for k in _REQUIRED if k not in rec]
                if missing:
                    raise UserError(f"{f}:{lineno}: results record lacks field(s) {', '.join(missing)}")
                for k, v in _DEFAULTS.items():
                    rec.setdefault(k, v)
                if rec.get("category") in (None, ""):
                    rec["category"] = rec["workload"]
                env = rec.pop("env", None)
                if isinstance(env, dict):
                    for k, v in env.items():
                        rec[f"env.{k}"] = v
                rec["_file"] = str(f)
                rec["_line"] = lineno
                rec["source"] = source
                rows.append(rec)
    if not rows:
        raise UserError(f"no results records in {path}")
    df = pd.DataFrame(rows)
    dropped = 0
    if "key" in df.columns:
        keyed = df["key"].notna()
        dup = keyed & df["key"].duplicated(keep="first")
        dropped = int(dup.sum())
        if dropped:
            df = df[~dup].reset_index(drop=True)
    df["prompt_id"] = df["prompt_id"].astype(str)
    for c in ("batch_size", "turn", "repeat", "temperature", "tokens_per_s"):
        v = pd.to_numeric(df[c], errors="coerce")
        bad = v.isna() & (c != "tokens_per_s" or df[c].notna())
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise UserError(f"{df['_file'].iat[i]}:{df['_line'].iat[i]}: field {c} is not a number: {df[c].iat[i]!r}")
        df[c] = v.astype(int) if c in ("batch_size", "turn", "repeat") else v.astype(float)
    df.attrs["duplicates_dropped"] = dropped
    return df


# --------------------------------------------------------------------------------------------
# Primitives (each one is scipy called on the given array, so tests can compare directly)


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm–Bonferroni step-down adjusted p-values, in the input order.

    NaN p-values are ignored (they stay NaN and do not count toward the family size m).
    adj_(i) = max_{j ≤ i} min(1, (m − j + 1) · p_(j)) for the ascending order p_(1) ≤ … ≤ p_(m).
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    running = 0.0
    for j, idx in enumerate(order):
        running = max(running, min(1.0, (m - j) * p[idx]))
        out[idx] = running
    return out


def rank_biserial(d: Sequence[float]) -> float:
    """Matched-pairs rank-biserial correlation of differences ``d`` (zeros dropped)."""
    d = np.asarray(d, dtype=float)
    d = d[d != 0]
    if d.size == 0:
        return float("nan")
    r = _st.rankdata(np.abs(d))
    tp, tm = r[d > 0].sum(), r[d < 0].sum()
    return float((tp - tm) / (tp + tm))


def wilcoxon_p(d: Sequence[float]) -> tuple[float, str]:
    """Two-sided Wilcoxon signed-rank p-value of ``d`` vs 0 (scipy defaults) and a note."""
    d = np.asarray(d, dtype=float)
    if d.size < 2:
        return float("nan"), "n<2: no test"
    if np.all(d == 0):
        return float("nan"), "all differences zero: no test"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return float(_st.wilcoxon(d).pvalue), ""
        except ValueError as e:  # pragma: no cover - scipy edge cases
            return float("nan"), f"wilcoxon failed: {e}"


def wilcoxon_min_p(n: int) -> float:
    """The smallest two-sided p ``wilcoxon_p`` can return for n pairs: all differences of one sign
    and distinct (2 / 2^n where scipy uses the exact distribution, n ≤ 50)."""
    if n < 2:
        return float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(_st.wilcoxon(np.arange(1.0, n + 1)).pvalue)


def min_n_to_reject(m: int, alpha: float = ALPHA) -> int:
    """The fewest pairs with which a cell in a Holm family of m tests can reach p_holm < alpha."""
    n = 2
    while max(m, 1) * wilcoxon_min_p(n) >= alpha:
        n += 1
    return n


def bootstrap_ci(
    data: Sequence[float] | tuple[Sequence[float], ...],
    statistic=np.mean,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    method: str = "BCa",
    seed: int = DEFAULT_SEED,
    paired: bool = False,
    confidence_level: float = CONFIDENCE,
) -> tuple[float, float, str]:
    """``scipy.stats.bootstrap`` CI of ``statistic``; returns (low, high, note).

    ``data`` is one array or a tuple of equal-length arrays (then ``paired=True`` resamples
    them together). n < 2 or all-identical data give (nan, nan, note) without calling scipy.
    """
    arrays = data if isinstance(data, tuple) else (data,)
    arrays = tuple(np.asarray(a, dtype=float) for a in arrays)
    n = arrays[0].size
    if n < 2:
        return float("nan"), float("nan"), "n<2: no CI"
    if all(np.ptp(a) == 0 for a in arrays):
        return float("nan"), float("nan"), "all values identical: no CI"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = _st.bootstrap(
                arrays,
                statistic,
                n_resamples=n_resamples,
                method=method,
                confidence_level=confidence_level,
                paired=paired,
                vectorized=None,
                rng=np.random.default_rng(seed),
            )
        except (ValueError, FloatingPointError) as e:
            return float("nan"), float("nan"), f"bootstrap failed: {e}"
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return float("nan"), float("nan"), "degenerate bootstrap distribution: no CI"
    return lo, hi, ""


def gmean_ci(s: Sequence[float], **kw) -> tuple[float, float, float, str]:
    """Geometric mean of ratios ``s`` with a bootstrap CI on mean(log s): (gm, low, high, note)."""
    logs = np.log(np.asarray(s, dtype=float))
    if logs.size == 0:
        return float("nan"), float("nan"), float("nan"), "no paired prompts"
    lo, hi, note = bootstrap_ci(logs, np.mean, **kw)
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi)), note


# --------------------------------------------------------------------------------------------
# Pairing


def _cell_cols(by_category: bool, by: Iterable[str] | None = None) -> list[str]:
    if by is not None:
        cols = [c for c in by if c != "policy"]
    else:
        cols = list(CELL)
        if by_category:
            cols.insert(1, "category")
    return cols


def _valid_tps(df: pd.DataFrame) -> pd.DataFrame:
    tps = df["tokens_per_s"]
    return df[np.isfinite(tps) & (tps > 0)]


PAIRED_METRICS = ("tokens_per_s", "tau")  # what compare_policies can pair on


def _per_prompt_turn(df: pd.DataFrame, cols: list[str], metric: str = "tokens_per_s") -> pd.DataFrame:
    """Mean of `metric` (column ``tps``) over repeats per (cell, policy, prompt_id, turn), plus
    token/time sums."""
    d = _valid_tps(df).copy()
    d = d[np.isfinite(d[metric].astype(float)) & (d[metric].astype(float) > 0)]
    d["_tok"] = d["generated_tokens"].astype(float) - 1 if "generated_tokens" in d else np.nan
    d["_dec"] = d["decode_s"].astype(float) if "decode_s" in d else np.nan
    keys = cols + ["policy", "prompt_id", "turn"]
    g = d.groupby(keys, dropna=False, sort=True)
    return g.agg(tps=(metric, "mean"), tok=("_tok", "sum"), dec=("_dec", "sum")).reset_index()


def paired_log_ratios(
    df: pd.DataFrame, a: str, b: str = BASELINE, *, by_category: bool = False, by: Iterable[str] | None = None,
    metric: str = "tokens_per_s",
) -> pd.DataFrame:
    """Per-prompt paired log ratio log(tps_a / tps_b) within each cell.

    Returns one row per (cell…, prompt_id) with columns ``log_ratio`` (mean over turns),
    ``tps_a``, ``tps_b`` (mean over turns of the repeat-averaged tokens/s), ``tok_a``,
    ``dec_a``, ``tok_b``, ``dec_b`` (sums over turns and repeats) and ``turns``.
    Prompts (or turns) missing on either side are dropped. ``metric="tau"`` pairs the
    per-request τ instead of tokens/s (``tps_*`` then hold τ).
    """
    cols = _cell_cols(by_category, by)
    pt = _per_prompt_turn(df[df["policy"].isin([a, b])], cols, metric)
    key = cols + ["prompt_id", "turn"]
    A = pt[pt["policy"] == a].drop(columns="policy")
    B = pt[pt["policy"] == b].drop(columns="policy")
    m = A.merge(B, on=key, suffixes=("_a", "_b"), how="inner")
    if m.empty:
        return pd.DataFrame(columns=cols + ["prompt_id", "log_ratio", "tps_a", "tps_b", "tok_a", "dec_a", "tok_b", "dec_b", "turns"])
    m["log_ratio"] = np.log(m["tps_a"] / m["tps_b"])
    out = (
        m.groupby(cols + ["prompt_id"], dropna=False, sort=True)
        .agg(
            log_ratio=("log_ratio", "mean"),
            tps_a=("tps_a", "mean"),
            tps_b=("tps_b", "mean"),
            tok_a=("tok_a", "sum"),
            dec_a=("dec_a", "sum"),
            tok_b=("tok_b", "sum"),
            dec_b=("dec_b", "sum"),
            turns=("turn", "size"),
        )
        .reset_index()
    )
    return out


def _paired_stats(p: pd.DataFrame, n_resamples: int, seed: int, method: str) -> dict:
    logs = p["log_ratio"].to_numpy(dtype=float)
    n = logs.size
    notes = []
    gm, lo, hi, note = gmean_ci(np.exp(logs), n_resamples=n_resamples, seed=seed, method=method)
    if note:
        notes.append(note)
    pval, note = wilcoxon_p(logs)
    if note and note not in notes:
        notes.append(note)
    tok_a, dec_a, tok_b, dec_b = (p[c].sum() for c in ("tok_a", "dec_a", "tok_b", "dec_b"))
    tw = (tok_a / dec_a) / (tok_b / dec_b) if n and dec_a > 0 and dec_b > 0 and tok_b > 0 else float("nan")
    return {
        "n": n,
        "speedup": gm,
        "speedup_ci_low": lo,
        "speedup_ci_high": hi,
        "p": pval,
        "median_log_speedup": float(np.median(logs)) if n else float("nan"),
        "rank_biserial": rank_biserial(logs),
        "speedup_ratio_of_means": float(p["tps_a"].mean() / p["tps_b"].mean()) if n else float("nan"),
        "speedup_time_weighted": float(tw),
        "_notes": notes,
    }


# --------------------------------------------------------------------------------------------
# Summaries


def _per_prompt_policy(d: pd.DataFrame) -> pd.DataFrame:
    """One row per prompt for one cell's policy: mean tau, tokens/s; sums of accepted/drafted."""
    d = d.copy()
    for c in ("tau", "accepted", "drafted"):
        if c not in d:
            d[c] = np.nan
    v = d["tokens_per_s"].where(np.isfinite(d["tokens_per_s"]) & (d["tokens_per_s"] > 0))
    d["_tps"] = v
    return (
        d.groupby("prompt_id", sort=True)
        .agg(tau=("tau", "mean"), tps=("_tps", "mean"), accepted=("accepted", "sum"), drafted=("drafted", "sum"))
        .reset_index()
    )


def _ratio_of_sums(a, d, axis=-1):
    return np.sum(a, axis=axis) / np.sum(d, axis=axis)


def _throughput(d: pd.DataFrame) -> tuple[float, int]:
    if not {"batch_id", "batch_wall_s", "batch_generated_tokens"} <= set(d.columns):
        return float("nan"), 0
    b = d.dropna(subset=["batch_id"]).drop_duplicates(subset=["batch_id"])
    wall = b["batch_wall_s"].astype(float).sum()
    if len(b) == 0 or not wall > 0:
        return float("nan"), len(b)
    return float(b["batch_generated_tokens"].astype(float).sum() / wall), len(b)


def _batch_rates(d: pd.DataFrame) -> pd.Series:
    """tokens / wall of each batch, indexed by its batch_id without the trailing policy name."""
    if not {"batch_id", "batch_wall_s", "batch_generated_tokens"} <= set(d.columns):
        return pd.Series(dtype=float)
    b = d.dropna(subset=["batch_id"]).drop_duplicates(subset=["batch_id"])
    keys, rates = [], []
    for batch_id, policy, tokens, wall in zip(b["batch_id"].astype(str), b["policy"].astype(str),
                                              b["batch_generated_tokens"].astype(float), b["batch_wall_s"].astype(float)):
        if batch_id.endswith("|" + policy) and wall > 0:
            keys.append(batch_id[: -len(policy) - 1])
            rates.append(tokens / wall)
    return pd.Series(rates, index=keys, dtype=float)


def paired_throughput(d: pd.DataFrame, base: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES,
                      seed: int = DEFAULT_SEED) -> tuple[float, float, float, int]:
    """(ratio, ci_low, ci_high, n_batch_pairs) of one policy's cell against the baseline's (module docstring)."""
    a, b = _batch_rates(d), _batch_rates(base)
    common = a.index.intersection(b.index)
    if len(common) == 0:
        return float("nan"), float("nan"), float("nan"), 0
    ratios = (a[common] / b[common]).to_numpy(dtype=float)
    gm, lo, hi, _ = gmean_ci(ratios, n_resamples=n_resamples, seed=seed, method="percentile")
    return gm, lo, hi, len(common)


def stalled_requests(df: pd.DataFrame, cols: Sequence[str] = CELL) -> pd.Series:
    """Per record: decode time per verify round (per generated token where rounds are not
    recorded) divided by its cell's median (cell = ``cols`` + policy); a ratio above
    ``STALL_FACTOR`` marks a stalled request (module docstring). Per round, not per token: a
    request whose drafts were rarely accepted takes more rounds for its tokens, not longer ones.
    NaN where the record has no usable timing."""
    if "decode_s" not in df or "generated_tokens" not in df:
        return pd.Series(np.nan, index=df.index)
    steps = (df["generated_tokens"].astype(float) - 1).clip(lower=1)
    if "rounds" in df:
        rounds = pd.to_numeric(df["rounds"], errors="coerce")
        steps = rounds.where(rounds > 0, steps)
    per_step = df["decode_s"].astype(float) / steps
    per_step = per_step.where(np.isfinite(per_step) & (per_step > 0))
    median = per_step.groupby([df[c] for c in [*cols, "policy"]], dropna=False).transform("median")
    return per_step / median


def stall_note(ratio: pd.Series, who: str = "", prompts: pd.Series | None = None) -> str:
    bad = ratio[ratio > STALL_FACTOR].sort_values(ascending=False)
    if bad.empty:
        return ""
    which = ""
    if prompts is not None:  # name the worst few, so they can be found in the records
        shown = [f"{prompts[i]} {bad[i]:.0f}×" for i in bad.index[:3]]
        which = ": " + ", ".join(shown) + (", …" if len(bad) > 3 else "")
    return (f"{who}{len(bad)} of {int(ratio.notna().sum())} requests stalled (time per round vs the cell's median"
            f"{which}): timings untrustworthy, rerun on an idle machine")


def round_kinds(d: pd.DataFrame) -> tuple[int, int, int]:
    """(rounds traced, rounds the draft gate skipped, rounds that verified lookup drafts without a drafter
    call) of one cell's records, counted per request and round.

    With confidences in the trace (DSpark) a round without them skipped the drafter: it was gated when
    it verified nothing, lookup-only when it verified something. Without confidences, a policy that
    records which rows took a lookup draft (trace ``lookup``: fixed-k and EAGLE chains with lookup
    drafts) ran its drafter in a round unless every request of the batch still decoding took a lookup
    draft in it; the rows of a batch share its rounds in order, so round i of each record is one round."""
    if "trace" not in d:
        return 0, 0, 0
    rounds = skipped = lookup_only = 0
    batches: dict[object, list[dict]] = {}  # records without confidences, by batch
    batch_ids = d["batch_id"] if "batch_id" in d else pd.Series(range(len(d)), index=d.index)
    for t, batch in zip(d["trace"], batch_ids):
        conf = t.get("confidence") if isinstance(t, dict) else None
        if isinstance(conf, list):
            verify = t.get("verify_len") or [0] * len(conf)
            rounds += len(conf)
            skipped += sum(1 for c, v in zip(conf, verify) if not c and not v)
            lookup_only += sum(1 for c, v in zip(conf, verify) if not c and v)
        elif isinstance(t, dict) and isinstance(t.get("verify_len"), list):
            batches.setdefault(batch, []).append(t)
    if not any(t.get("lookup") for traces in batches.values() for t in traces):
        return rounds, skipped, lookup_only
    for traces in batches.values():
        for i in range(max(len(t["verify_len"]) for t in traces)):
            active = [t for t in traces if i < len(t["verify_len"])]
            rounds += len(active)
            if all(i < len(t.get("lookup") or []) and t["lookup"][i] for t in active):
                lookup_only += sum(1 for t in active if t["verify_len"][i])
    return rounds, skipped, lookup_only


def lookup_note(rounds: int, lookup_only: int) -> str:
    if not lookup_only:
        return ""
    return (f"{lookup_only} of {rounds} rounds ({100 * lookup_only / rounds:.0f}%) verified prompt-lookup drafts "
            "without a drafter call")


def gate_note(d: pd.DataFrame, rounds: int, skipped: int, batch_size) -> str:
    if not skipped:
        return ""
    drafted = pd.to_numeric(d.get("drafted", pd.Series(dtype=float)), errors="coerce").sum()
    why = f"the cost profile says drafting does not pay at b = {batch_size}"
    if drafted == 0:
        return (f"drafted nothing: the draft gate skipped {skipped} of {rounds} rounds and the scheduler verified "
                f"no draft in the {rounds - skipped} it probed ({why})")
    return (f"draft gate skipped {skipped} of {rounds} rounds ({100 * skipped / rounds:.0f}%: in those rounds "
            f"the cost profile said drafting would not pay at b = {batch_size} at the acceptance seen so far)")


def summarize(
    df: pd.DataFrame,
    *,
    by_category: bool = False,
    by: Sequence[str] | None = None,
    baseline: str = BASELINE,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    method: str = "BCa",
) -> pd.DataFrame:
    """One row per cell (workload, [category,] batch_size, temperature, policy).

    ``by`` overrides the cell columns (e.g. ``("workload", "category", "batch_size",
    "temperature")``); ``by_category=True`` is the shorthand for that. The baseline's own rows
    are included (speedup 1 by definition, no test) so its tokens/s and throughput appear.

    Columns: n, n_requests, speedup (geometric mean) with speedup_ci_low/high, p (Wilcoxon),
    p_holm, significant (p_holm < 0.05), median_log_speedup, rank_biserial,
    speedup_ratio_of_means (Spec-Bench), speedup_time_weighted, tau (mean) with
    tau_ci_low/high, tau_pooled, acceptance_rate with acceptance_ci_low/high,
    tps_median with tps_ci_low/high, ttft_median_s, throughput, n_batches, throughput_ratio with
    throughput_ratio_ci_low/high and n_batch_pairs (paired batches against the baseline), note.
    """
    cols = _cell_cols(by_category, by)
    missing = [c for c in cols + ["policy"] if c not in df.columns]
    if missing:
        raise UserError(f"results lack column(s) {', '.join(missing)}")
    rows = []
    policies = sorted(df["policy"].unique(), key=lambda p: (p != baseline, p))
    paired = {p: paired_log_ratios(df, p, baseline, by=cols) for p in policies if p != baseline}
    stall = stalled_requests(df, cols)
    for cell, d in df.groupby(cols + ["policy"], dropna=False, sort=True):
        cell = dict(zip(cols + ["policy"], cell))
        pol = cell["policy"]
        row = dict(cell)
        notes: list[str] = []
        if pol == baseline:
            row.update(n=d["prompt_id"].nunique(), speedup=1.0, speedup_ratio_of_means=1.0, speedup_time_weighted=1.0)
            notes.append("baseline")
        else:
            pp = paired[pol]
            if len(pp):
                mask = np.ones(len(pp), dtype=bool)
                for c in cols:
                    mask &= (pp[c] == cell[c]).to_numpy()
                pp = pp[mask]
            st = _paired_stats(pp, n_resamples, seed, method)
            notes += st.pop("_notes")
            if st["n"] == 0:
                notes = [f"no {baseline} records on the same prompts"]
            row.update(st)
        row["n_requests"] = len(d)
        pr = _per_prompt_policy(d)
        # tau
        tau = pr["tau"].dropna().to_numpy(dtype=float)
        row["tau"] = float(tau.mean()) if tau.size else float("nan")
        if pol != baseline and tau.size:
            row["tau_ci_low"], row["tau_ci_high"], _ = bootstrap_ci(tau, np.mean, n_resamples=n_resamples, seed=seed, method=method)
        if "rounds" in d and "generated_tokens" in d and d["rounds"].sum() > 0:
            row["tau_pooled"] = float((d["generated_tokens"] - 1).sum() / d["rounds"].sum())
        # acceptance rate
        acc, dr = pr["accepted"].to_numpy(dtype=float), pr["drafted"].to_numpy(dtype=float)
        if np.nansum(dr) > 0:
            row["acceptance_rate"] = float(np.nansum(acc) / np.nansum(dr))
            keep = ~(np.isnan(acc) | np.isnan(dr))
            row["acceptance_ci_low"], row["acceptance_ci_high"], _ = bootstrap_ci(
                (acc[keep], dr[keep]), _ratio_of_sums, paired=True, n_resamples=n_resamples, seed=seed, method="percentile"
            )
        # per-user tokens/s
        tps = pr["tps"].dropna().to_numpy(dtype=float)
        row["tps_median"] = float(np.median(tps)) if tps.size else float("nan")
        if tps.size:
            row["tps_ci_low"], row["tps_ci_high"], _ = bootstrap_ci(
                tps, np.median, n_resamples=n_resamples, seed=seed, method="percentile"
            )
        if "ttft_s" in d:
            row["ttft_median_s"] = float(d["ttft_s"].astype(float).median())
        row["throughput"], row["n_batches"] = _throughput(d)
        base = None if pol == baseline else df[
            (df["policy"] == baseline) & np.logical_and.reduce([(df[c] == cell[c]).to_numpy() for c in cols])]
        if base is None:
            row["throughput_ratio"] = 1.0
        else:
            (row["throughput_ratio"], row["throughput_ratio_ci_low"], row["throughput_ratio_ci_high"],
             row["n_batch_pairs"]) = paired_throughput(d, base, n_resamples, seed)
        row["stalled"] = int((stall[d.index] > STALL_FACTOR).sum())
        notes.append(stall_note(stall[d.index], prompts=d["prompt_id"]))
        if base is not None:  # the paired speedup divides by the baseline's timings too
            notes.append(stall_note(stall[base.index], f"{baseline}: ", base["prompt_id"]))
        row["timing_suspect"] = any(n and "stalled" in n for n in notes)
        row["rounds_traced"], row["gate_skipped"], row["lookup_only"] = round_kinds(d)
        notes.append(gate_note(d, row["rounds_traced"], row["gate_skipped"], cell["batch_size"]))
        notes.append(lookup_note(row["rounds_traced"], row["lookup_only"]))
        row["note"] = "; ".join(dict.fromkeys(n for n in notes if n))
        rows.append(row)
    order = cols + [
        "policy", "n", "n_requests", "speedup", "speedup_ci_low", "speedup_ci_high", "p", "p_holm", "significant",
        "median_log_speedup", "rank_biserial", "speedup_ratio_of_means", "speedup_time_weighted",
        "tau", "tau_ci_low", "tau_ci_high", "tau_pooled", "acceptance_rate", "acceptance_ci_low",
        "acceptance_ci_high", "tps_median", "tps_ci_low", "tps_ci_high", "ttft_median_s", "throughput",
        "n_batches", "throughput_ratio", "throughput_ratio_ci_low", "throughput_ratio_ci_high", "n_batch_pairs", "too_few", "n_needed", "stalled", "timing_suspect", "rounds_traced", "gate_skipped", "lookup_only", "note",
    ]
    out = pd.DataFrame(rows)
    for c in order:
        if c not in out:
            out[c] = np.nan
    out["p_holm"] = holm(out["p"].to_numpy(dtype=float))
    out["significant"] = out["p_holm"] < ALPHA
    _flag_too_few(out, out["policy"] != baseline)
    out["_base"] = out["policy"] != baseline  # baseline first within each cell
    out = out.sort_values(cols + ["_base", "policy"], kind="stable")[order]
    return out.reset_index(drop=True)


def compare_policies(
    df: pd.DataFrame,
    a: str,
    b: str,
    *,
    by_category: bool = False,
    by: Sequence[str] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    method: str = "BCa",
    metric: str = "tokens_per_s",
) -> pd.DataFrame:
    """Paired comparison of policy ``a`` against ``b`` on the same prompts, per cell.

    Columns: cell columns, a, b, metric, n, ratio, ratio_ci_low, ratio_ci_high, p, p_holm,
    significant, median_log_ratio, rank_biserial, ratio_of_means, ratio_time_weighted, note.

    ``ratio`` = geometric mean over prompts of metric_a / metric_b (tokens/s: > 1 = a is faster;
    ``metric="tau"``: > 1 = a's drafts yield more tokens per verify round, the drafter-quality
    comparison, free of timing noise) with a bootstrap CI; ``p`` = Wilcoxon signed-rank on the
    per-prompt log ratios, ``p_holm`` Holm across the returned cells; effect sizes as in
    :func:`summarize`. ``ratio_time_weighted`` is a tokens/s quantity whatever the metric.
    """
    if metric not in PAIRED_METRICS:
        raise UserError(f"unknown metric {metric!r} (valid: {', '.join(PAIRED_METRICS)})")
    for name in (a, b):
        if name not in set(df["policy"]):
            raise UserError(f"no records for policy {name!r} (have: {', '.join(sorted(df['policy'].unique()))})")
    cols = _cell_cols(by_category, by)
    pp = paired_log_ratios(df, a, b, by=cols, metric=metric)
    rows = []
    for cell, p in pp.groupby(cols, dropna=False, sort=True):
        st = _paired_stats(p, n_resamples, seed, method)
        notes = st.pop("_notes")
        row = dict(zip(cols, cell if isinstance(cell, tuple) else (cell,)))
        row.update(a=a, b=b, metric=metric)
        names = {"speedup": "ratio", "speedup_ci_low": "ratio_ci_low", "speedup_ci_high": "ratio_ci_high",
                 "median_log_speedup": "median_log_ratio", "speedup_ratio_of_means": "ratio_of_means",
                 "speedup_time_weighted": "ratio_time_weighted"}
        row.update({names.get(k, k): v for k, v in st.items()})
        row["note"] = "; ".join(notes)
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return pd.DataFrame(columns=cols + ["a", "b", "metric", "n", "ratio", "ratio_ci_low", "ratio_ci_high", "p", "p_holm", "significant"])
    out["p_holm"] = holm(out["p"].to_numpy(dtype=float))
    out["significant"] = out["p_holm"] < ALPHA
    _flag_too_few(out, pd.Series(True, index=out.index))
    return out


def _flag_too_few(out: pd.DataFrame, tested: pd.Series) -> None:
    """Set ``too_few`` and prepend its note where a cell's n can never reach Holm p < ALPHA in this
    family (module docstring), so a reader sees "too few prompts", not "no significant difference"."""
    m = int(np.isfinite(out["p"].to_numpy(dtype=float)).sum())
    need = min_n_to_reject(m)
    out["too_few"] = False
    out["n_needed"] = np.where(tested.to_numpy(), need, np.nan)
    for i in out.index[tested.to_numpy()]:
        n = int(out.at[i, "n"]) if pd.notna(out.at[i, "n"]) else 0
        if n == 0 or n >= need:
            continue
        out.at[i, "too_few"] = True
        family = f"Holm over {m} cells" if m > 1 else "one cell"
        note = f"n = {n} too few to test: Wilcoxon, {family}, needs n ≥ {need} to reach p < {ALPHA:g}"
        old = out.at[i, "note"] if isinstance(out.at[i, "note"], str) else ""
        out.at[i, "note"] = "; ".join(x for x in (note, old) if x)


def _sum_lists(lists: Iterable) -> np.ndarray:
    total = np.zeros(0)
    for v in lists:
        if not isinstance(v, (list, tuple, np.ndarray)) or len(v) == 0:
            continue
        v = np.asarray(v, dtype=float)
        if v.size > total.size:
            total = np.pad(total, (0, v.size - total.size))
        total[: v.size] += v
    return total


def position_acceptance(
    df: pd.DataFrame, *, by_category: bool = False, by: Sequence[str] | None = None
) -> pd.DataFrame:
    """Per-position acceptance per cell, long format.

    For draft position k (``position`` = k + 1, 1-based: position 1 is the first draft token):
    ``drafted`` = Σ drafted_per_position[k] (rounds that verified ≥ k+1 drafts),
    ``accepted`` = Σ accepted_per_position[k] (rounds that accepted ≥ k+1),
    ``acceptance`` = accepted / drafted (unconditional),
    ``conditional`` = acceptance[k] / acceptance[k−1] (= acceptance at position 1),
    ``acceptance_vllm`` = accepted / drafted at position 1 (vLLM's denominator: all rounds
    that drafted anything). Policies without per-position data (``ar``) give no rows.
    """
    cols = _cell_cols(by_category, by)
    rows = []
    if "drafted_per_position" not in df or "accepted_per_position" not in df:
        return pd.DataFrame(columns=cols + ["policy", "position", "drafted", "accepted", "acceptance", "conditional", "acceptance_vllm"])
    for cell, d in df.groupby(cols + ["policy"], dropna=False, sort=True):
        D = _sum_lists(d["drafted_per_position"])
        A = _sum_lists(d["accepted_per_position"])
        if D.size == 0:
            continue
        A = np.pad(A, (0, max(0, D.size - A.size)))[: D.size]
        with np.errstate(divide="ignore", invalid="ignore"):
            unc = np.where(D > 0, A / D, np.nan)
            prev = np.concatenate([[1.0], unc[:-1]])
            cond = np.where(prev > 0, unc / prev, np.nan)
            vllm = A / D[0] if D[0] > 0 else np.full(D.size, np.nan)
        for k in range(D.size):
            row = dict(zip(cols + ["policy"], cell))
            row.update(
                position=k + 1,
                drafted=int(D[k]),
                accepted=int(A[k]),
                acceptance=float(unc[k]),
                conditional=float(cond[k]),
                acceptance_vllm=float(vllm[k]),
            )
            rows.append(row)
    if not rows:
        return pd.DataFrame(columns=cols + ["policy", "position", "drafted", "accepted", "acceptance", "conditional", "acceptance_vllm"])
    return pd.DataFrame(rows)


__all__ = [
    "load_results", "summarize", "compare_policies", "position_acceptance", "paired_log_ratios",
    "holm", "rank_biserial", "wilcoxon_p", "bootstrap_ci", "gmean_ci", "sources",
]
