"""Layer 7: one self-contained HTML report and one PDF from the same figures and tables.

``write_report(results, html_path=..., pdf_path=...)`` reads results records (a ``.jsonl``
file or a directory of them), runs :mod:`specbench.analysis.stats`, and writes:

1. speedup vs AR per workload × policy with 95% CI bars (and per category when a workload
   has more than one category);
2. per-user tokens/s against throughput across batch sizes (Pareto view);
3. per-position acceptance curves (unconditional and conditional);
4. τ (tokens per verify round) distributions per policy and batch size;
5. when ``specbench simulate`` has written ``simulation.csv`` under the results directory (or in
   ``simulation/`` beside a results file): the simulated per-user tokens/s against throughput
   across concurrency (Pareto view) and the mean verify length against concurrency;

at the top one verdict line per policy and cell, the sweep's settings and decode wall time and the
caveats that limit the table (too few prompts to test, stalled timings, the draft gate:
specbench/analysis/stats.py); then the summary table (CIs, Holm-corrected significance), a "where
speculation stops paying" table and the run environment. A report covers one sweep (or one
directory of run files): results of several are refused, never pooled. Figures are drawn on bare ``matplotlib.figure.Figure``
objects (Agg canvas; pyplot's global state is never touched), embedded in the HTML as base64
PNG (no scripts, no external URLs) and written to the PDF with ``PdfPages``. Each output is
rendered fully in memory and then written atomically (temp file + rename), so a failure never
leaves a half-written report behind.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_pdf import PdfPages
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from specbench import atomic
from specbench.analysis import stats
from specbench.bench.envinfo import environment_table
from specbench.errors import UserError

_PALETTE = ["#4d4d4d", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
_LINESTYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
_DPI = 100


# --------------------------------------------------------------------------------------------
# Small helpers


def _policy_order(policies) -> list[str]:
    return sorted(set(policies), key=lambda p: (p != stats.BASELINE, p))


def _colors(policies) -> dict[str, str]:
    return {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(_policy_order(policies))}


def _fmt(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def _fmt_ci(v, lo, hi, nd=2, suffix="") -> str:
    if v is None or not np.isfinite(v):
        return "–"
    s = f"{v:.{nd}f}{suffix}"
    if np.isfinite(lo) and np.isfinite(hi):
        s += f" [{lo:.{nd}f}, {hi:.{nd}f}]"
    return s


def _fmt_p(p) -> str:
    if p is None or not np.isfinite(p):
        return "–"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _fmt_temp(t) -> str:
    return f"{t:g}"


def _grid(n: int, ncols: int = 3, w: float = 4.3, h: float = 3.3, title: str | None = None):
    ncols = max(1, min(ncols, n))
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(max(w * ncols, 7.0), h * nrows + (0.5 if title else 0)), dpi=_DPI)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12, fontweight="bold")
    return fig, axes[:n]


def _empty_figure(title: str, text: str) -> Figure:
    fig = Figure(figsize=(8, 2), dpi=_DPI)
    ax = fig.subplots()
    ax.axis("off")
    ax.set_title(title, fontsize=12, fontweight="bold")
    ax.text(0.5, 0.45, text, ha="center", va="center", fontsize=10, color="#555")
    return fig


_SPEEDUP_TICKS = [  # finest first; each a subset-ish of the one before
    [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0],
    [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 10.0],
    [0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0],
    [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0],
    [0.01, 0.1, 1.0, 10.0, 100.0],
]


def _speedup_axis(ax, values: Sequence[float]):
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0], dtype=float)
    lo, hi = (min(v.min(), 1.0), max(v.max(), 1.0)) if v.size else (0.5, 2.0)
    ax.set_yscale("log")
    ymin, ymax = lo / 1.15, hi * 1.15
    ax.set_ylim(ymin, ymax)
    # Each label once (a LogLocator with subs > 1 put 0.8 at 0.08·10 and 0.8·1: drawn twice), and
    # no more than ~7 of them: the finest ladder of "nice" ratios that is not crowded.
    for ladder in _SPEEDUP_TICKS:
        ticks = [t for t in ladder if ymin <= t <= ymax]
        if len(ticks) <= 7:
            break
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}×"))
    ax.axhline(1.0, color="#888", lw=1, ls="--", zorder=0)
    ax.grid(axis="y", color="#eee", zorder=-1)


def _panel_title(parts: dict) -> str:
    bits = []
    for k, v in parts.items():
        if k == "batch_size":
            bits.append(f"b={v}")
        elif k == "temperature":
            bits.append(f"T={_fmt_temp(v)}")
        else:
            bits.append(str(v))
    return ", ".join(bits)


# --------------------------------------------------------------------------------------------
# Figures


def _dot_panels(summary: pd.DataFrame, xcol: str, panel_cols: list[str], title: str, colors) -> Figure:
    """Speedup dots with CI bars: x = ``xcol`` values, one offset series per policy."""
    s = summary[summary["policy"] != stats.BASELINE]
    if s.empty:
        return _empty_figure(title, "no speculative policies in these results (only the AR baseline)")
    panels = list(s.groupby(panel_cols, sort=True))
    fig, axes = _grid(len(panels), ncols=2 if len(panels) > 1 else 1, w=5.6, h=3.6, title=title)
    pols = [p for p in _policy_order(s["policy"])]
    width = 0.7
    for ax, (key, d) in zip(axes, panels):
        key = key if isinstance(key, tuple) else (key,)
        xs = sorted(d[xcol].unique(), key=str)
        step = width / max(len(pols), 1)
        allv = []
        for j, pol in enumerate(pols):
            dp = d[d["policy"] == pol].set_index(xcol)
            for i, x in enumerate(xs):
                if x not in dp.index:
                    continue
                r = dp.loc[x]
                gm, lo, hi = r["speedup"], r["speedup_ci_low"], r["speedup_ci_high"]
                if not np.isfinite(gm):
                    continue
                xpos = i - width / 2 + step * (j + 0.5)
                if np.isfinite(lo) and np.isfinite(hi):
                    ax.errorbar(xpos, gm, yerr=[[max(gm - lo, 0)], [max(hi - gm, 0)]], color=colors[pol], capsize=3, lw=1.3, zorder=2)
                    allv += [lo, hi]
                sig = bool(r["significant"])
                ax.plot(xpos, gm, marker="o", ms=6, color=colors[pol], mfc=colors[pol] if sig else "white", mew=1.5, zorder=3)
                allv.append(gm)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([str(x) for x in xs], rotation=20 if len(xs) > 3 else 0, ha="right" if len(xs) > 3 else "center", fontsize=8)
        ax.set_xlim(-0.6, len(xs) - 0.4)
        _speedup_axis(ax, allv)
        ax.set_title(_panel_title(dict(zip(panel_cols, key))), fontsize=10)
        ax.set_ylabel("speedup vs AR (geo. mean)", fontsize=8)
        ax.tick_params(labelsize=8)
    handles = [
        axes[0].plot([], [], marker="o", ls="", color=colors[p], label=p)[0] for p in pols
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(pols), 6), fontsize=9, frameon=False,
               title="bars: 95% bootstrap CI; filled: Holm p<0.05; hollow: not significant", title_fontsize=8)
    fig.tight_layout(rect=(0, 0.1 if len(panels) <= 2 else 0.06, 1, 0.95))
    return fig


def fig_speedup(summary: pd.DataFrame, colors) -> Figure:
    return _dot_panels(summary, "workload", ["temperature", "batch_size"], "Speedup vs AR per workload (paired, per prompt)", colors)


def fig_speedup_by_category(summary_cat: pd.DataFrame, colors) -> Figure | None:
    multi = summary_cat.groupby("workload")["category"].nunique()
    multi = multi[multi > 1].index
    if len(multi) == 0:
        return None
    s = summary_cat[summary_cat["workload"].isin(multi)]
    return _dot_panels(s, "category", ["workload", "temperature", "batch_size"], "Speedup vs AR per category", colors)


def fig_pareto(summary: pd.DataFrame, colors) -> Figure:
    title = "Per-user tokens/s vs throughput across batch sizes"
    s = summary[np.isfinite(summary["throughput"].astype(float)) & np.isfinite(summary["tps_median"].astype(float))]
    if s.empty:
        return _empty_figure(title, "no throughput data")
    panels = list(s.groupby(["workload", "temperature"], sort=True))
    fig, axes = _grid(len(panels), ncols=2 if len(panels) > 1 else 1, w=5.6, h=3.8, title=title)
    pols = _policy_order(s["policy"])
    for ax, ((wl, t), d) in zip(axes, panels):
        for k, pol in enumerate(pols):
            dp = d[d["policy"] == pol].sort_values("batch_size")
            if dp.empty:
                continue
            x, y = dp["throughput"].to_numpy(float), dp["tps_median"].to_numpy(float)
            lo, hi = dp["tps_ci_low"].to_numpy(float), dp["tps_ci_high"].to_numpy(float)
            # A BCa interval need not contain the point estimate (skewed or tied samples, small n):
            # draw the part of the bar that lies on each side, never a negative length.
            yerr = np.vstack([np.where(np.isfinite(lo), y - lo, 0), np.where(np.isfinite(hi), hi - y, 0)]).clip(min=0)
            ax.errorbar(x, y, yerr=yerr, color=colors[pol], marker=_MARKERS[k % len(_MARKERS)], ms=5, lw=1.5, capsize=2, label=pol)
            for xi, yi, b in zip(x, y, dp["batch_size"]):
                ax.annotate(f"b={b}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=colors[pol])
        ax.set_title(_panel_title({"workload": wl, "temperature": t}), fontsize=10)
        _style_axis(ax, "throughput, tokens/s (all users)", "per-user tokens/s (median, 95% CI)")
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _style_axis(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(color="#eee")
    ax.tick_params(labelsize=8)
    ax.margins(x=0.12, y=0.12)


def fig_position(pos: pd.DataFrame, colors) -> Figure:
    title = "Per-position acceptance"
    if pos.empty:
        return _empty_figure(title, "no per-position acceptance data (no speculative policies)")
    panels = list(pos.groupby(["workload", "temperature"], sort=True))
    n = len(panels)
    fig = Figure(figsize=(max(4.6 * n, 7.0), 6.6), dpi=_DPI)
    axes = fig.subplots(2, n, squeeze=False)
    fig.suptitle(title, fontsize=12, fontweight="bold")
    bss = sorted(pos["batch_size"].unique())
    ls = {b: _LINESTYLES[i % len(_LINESTYLES)] for i, b in enumerate(bss)}
    marker = {b: _MARKERS[i % len(_MARKERS)] for i, b in enumerate(bss)}
    # Greedy decoding gives the same acceptance at every batch size for a deterministic drafter (pld):
    # a small x offset per batch size keeps coinciding curves, and their line styles, visible.
    shift = {b: 0.08 * (i - (len(bss) - 1) / 2) for i, b in enumerate(bss)}
    for j, ((wl, t), d) in enumerate(panels):
        for row, (col, ylabel) in enumerate([("acceptance", "P(accepted ≥ k | drafted ≥ k)"), ("conditional", "conditional: acc[k] / acc[k−1]")]):
            ax = axes[row, j]
            for (pol, b), dp in d.groupby(["policy", "batch_size"], sort=True):
                dp = dp.sort_values("position")
                ax.plot(dp["position"] + shift[b], dp[col], color=colors[pol], ls=ls[b], marker=marker[b], ms=4,
                        mfc="white", lw=1.6, label=f"{pol}, b={b}")
            # The conditional value is a ratio of two rates with different denominators (rounds that
            # drafted ≥ k vs ≥ k−1), so with variable draft lengths it can exceed 1: show all of it.
            top = np.nanmax(d[col].to_numpy(float)) if d[col].notna().any() else 1.0
            ax.set_ylim(0, max(1.05, top * 1.08))
            if top > 1:
                ax.axhline(1.0, color="#888", lw=0.8, ls="--", zorder=0)
            ax.grid(color="#eee")
            ax.tick_params(labelsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            if row == 0:
                ax.set_title(_panel_title({"workload": wl, "temperature": t}), fontsize=10)
            else:
                ax.set_xlabel("draft position k", fontsize=8)
            ax.xaxis.get_major_locator().set_params(integer=True)
        axes[0, j].legend(fontsize=7, frameon=False, ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def fig_tau(df: pd.DataFrame, colors) -> Figure:
    title = "τ: tokens per verify round (accepted + bonus), per request"
    d = df[(df["policy"] != stats.BASELINE)]
    if "tau" not in d or d["tau"].dropna().empty:
        return _empty_figure(title, "no speculative policies in these results")
    d = d.dropna(subset=["tau"])
    panels = list(d.groupby(["workload", "temperature"], sort=True))
    fig, axes = _grid(len(panels), ncols=2 if len(panels) > 1 else 1, w=5.6, h=3.6, title=title)
    for ax, ((wl, t), dp) in zip(axes, panels):
        groups = sorted(dp.groupby(["policy", "batch_size"]).groups.keys(), key=lambda k: (_policy_order(d["policy"]).index(k[0]), k[1]))
        data = [dp[(dp["policy"] == p) & (dp["batch_size"] == b)]["tau"].to_numpy(float) for p, b in groups]
        bp = ax.boxplot(data, patch_artist=True, widths=0.6, showfliers=True, flierprops=dict(ms=2, alpha=0.5))
        for patch, (p, b) in zip(bp["boxes"], groups):
            patch.set_facecolor(colors[p])
            patch.set_alpha(0.55)
        for med in bp["medians"]:
            med.set_color("black")
        ax.set_xticks(range(1, len(groups) + 1))
        ax.set_xticklabels([f"{p}\nb={b}" for p, b in groups], fontsize=8)
        ax.axhline(1.0, color="#888", lw=1, ls="--", zorder=0)
        ax.set_ylabel("τ (AR = 1)", fontsize=8)
        ax.set_title(_panel_title({"workload": wl, "temperature": t}), fontsize=10)
        ax.grid(axis="y", color="#eee")
        ax.tick_params(labelsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def load_simulation(results_path: Path) -> pd.DataFrame | None:
    """The `specbench simulate` outputs that belong to these results, or None."""
    from specbench.analysis.simulate import COLUMNS, OUT_FILE

    results_path = Path(results_path)
    files = (sorted(results_path.rglob(OUT_FILE)) if results_path.is_dir()
             else [p for p in [results_path.parent / "simulation" / OUT_FILE] if p.is_file()])
    frames = []
    for f in files:
        try:
            d = pd.read_csv(f)
        except (OSError, ValueError) as e:
            raise UserError(f"{f}: unreadable simulation results ({e})") from None
        missing = [c for c in ("policy", "workload", "temperature", "mode", "concurrency", "per_user_tok_s",
                               "throughput_tok_s", "mean_verify_len") if c not in d.columns]
        if missing or not set(d.columns) <= set(COLUMNS):
            raise UserError(f"{f}: not a simulation.csv from `specbench simulate` (missing {', '.join(missing) or 'nothing'})")
        frames.append(d)
    return pd.concat(frames, ignore_index=True) if frames else None


def fig_simulation(sim: pd.DataFrame, colors) -> Figure:
    """Per (workload, temperature, mode): left, per-user tokens/s vs throughput with one point per
    concurrency; right, the mean verify length vs concurrency."""
    panels = list(sim.groupby(["workload", "temperature", "mode"], sort=True))
    fig = Figure(figsize=(11.2, 3.8 * len(panels) + 0.5), dpi=_DPI)
    axes = fig.subplots(len(panels), 2, squeeze=False)
    fig.suptitle("Simulated load (replayed traces × cost profile)", fontsize=12, fontweight="bold")
    pols = _policy_order(sim["policy"])
    for (left, right), ((wl, t, mode), d) in zip(axes, panels):
        for k, pol in enumerate(pols):
            dp = d[d["policy"] == pol].sort_values("concurrency")
            if dp.empty:
                continue
            style = dict(color=colors[pol], marker=_MARKERS[k % len(_MARKERS)], ms=5, lw=1.5, label=pol)
            left.plot(dp["throughput_tok_s"], dp["per_user_tok_s"], **style)
            for x, y, c in zip(dp["throughput_tok_s"], dp["per_user_tok_s"], dp["concurrency"]):
                left.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=colors[pol])
            right.plot(dp["concurrency"], dp["mean_verify_len"], **style)
        title = _panel_title({"workload": wl, "temperature": t}) + f", {mode} batching"
        left.set_title(title, fontsize=10)
        left.set_yscale("log")
        _style_axis(left, "throughput, tokens/s (all users)", "per-user tokens/s (median)")
        left.legend(fontsize=8, frameon=False)
        right.set_title(title, fontsize=10)
        right.set_xscale("log", base=2)
        right.set_xticks(sorted(d["concurrency"].unique()))
        right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        right.xaxis.set_minor_formatter(NullFormatter())
        _style_axis(right, "concurrency (requests in flight)", "mean verify length ℓ (drafts per round)")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


# --------------------------------------------------------------------------------------------
# Tables


def summary_table(summary: pd.DataFrame, with_category: bool = False) -> pd.DataFrame:
    """Formatted (string) summary table shared by the HTML and the PDF."""
    rows = []
    for _, r in summary.iterrows():
        base = r["policy"] == stats.BASELINE
        row = {"Workload": r["workload"]}
        if with_category:
            row["Category"] = r["category"]
        row.update({
            "b": str(r["batch_size"]),
            "T": _fmt_temp(r["temperature"]),
            "Policy": r["policy"],
            "n": str(r["n"]) if pd.notna(r["n"]) else "–",
            "Speedup [95% CI]": "1 (baseline)" if base else _fmt_ci(r["speedup"], r["speedup_ci_low"], r["speedup_ci_high"], suffix="×")
            + (" *" if r["significant"] else ""),
            "Holm p": "" if base else _fmt_p(r["p_holm"]),
            "med. log s": "" if base else _fmt(r["median_log_speedup"], 3),
            "r_rb": "" if base else _fmt(r["rank_biserial"], 2),
            "Ratio of means": "" if base else _fmt(r["speedup_ratio_of_means"]) + "×",
            "τ [95% CI]": _fmt_ci(r["tau"], r["tau_ci_low"], r["tau_ci_high"]),
            "Accept rate [95% CI]": "" if base else _fmt_ci(r["acceptance_rate"], r["acceptance_ci_low"], r["acceptance_ci_high"]),
            "tok/s/user median [95% CI]": _fmt_ci(r["tps_median"], r["tps_ci_low"], r["tps_ci_high"], nd=1),
            "Throughput tok/s": _fmt(r["throughput"], 1),
            "Throughput vs baseline [95% CI] (batches)": "" if base else (
                _fmt_ci(r["throughput_ratio"], r["throughput_ratio_ci_low"], r["throughput_ratio_ci_high"], suffix="×")
                + (f" ({int(r['n_batch_pairs'])})" if pd.notna(r["n_batch_pairs"]) else "")),
            "Note": "" if r["note"] == "baseline" else (r["note"] or ""),
        })
        rows.append(row)
    return pd.DataFrame(rows)


def breakeven_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, T, policy): batch sizes with a significant gain / no evidence / a loss."""
    s = summary[summary["policy"] != stats.BASELINE]
    rows = []
    for (wl, t, pol), d in s.groupby(["workload", "temperature", "policy"], sort=True):
        d = d.sort_values("batch_size")
        paired = d["n"] > 0  # batch sizes with no AR records on the same prompts are not a "no difference"
        # too few prompts for the test to reject at all: not evidence of "no difference" either
        few = paired & (d["too_few"].fillna(False).astype(bool) if "too_few" in d else False)
        gain = d[paired & d["significant"] & (d["speedup"] > 1)]["batch_size"]
        loss = d[paired & d["significant"] & (d["speedup"] < 1)]["batch_size"]
        none = d[paired & ~d["significant"] & ~few]["batch_size"]
        j = lambda v: ", ".join(map(str, v)) or "–"  # noqa: E731
        rows.append({"Workload": wl, "T": _fmt_temp(t), "Policy": pol, "faster (Holm p<0.05)": j(gain),
                     "no significant difference": j(none), "slower (Holm p<0.05)": j(loss),
                     "too few prompts to test": j(f"{r['batch_size']}{_ci_side(r)}" for _, r in d[few].iterrows()),
                     "no AR to compare": j(d[~paired]["batch_size"])})
    out = pd.DataFrame(rows, columns=["Workload", "T", "Policy", "faster (Holm p<0.05)", "no significant difference",
                                      "slower (Holm p<0.05)", "too few prompts to test", "no AR to compare"])
    if (out["too few prompts to test"] == "–").all():  # shown only where some cell could not be tested
        out = out.drop(columns="too few prompts to test")
    return out


def _ci_side(r) -> str:
    """' (CI above 1)' / ' (CI below 1)' where the speedup's CI excludes 1, else ''."""
    lo, hi = r["speedup_ci_low"], r["speedup_ci_high"]
    if np.isfinite(lo) and lo > 1:
        return " (CI above 1)"
    if np.isfinite(hi) and hi < 1:
        return " (CI below 1)"
    return ""


def verdicts(summary: pd.DataFrame) -> list[str]:
    """One line per policy and cell, the answer first: "dspark vs ar on code, b = 1, T = 0: 0.93×
    [0.88, 0.98], slower", with what limits it (too few prompts, stalled timings, the draft gate)."""
    lines = []
    for _, r in summary[summary["policy"] != stats.BASELINE].iterrows():
        head = f"{r['policy']} vs {stats.BASELINE} on {r['workload']}, b = {r['batch_size']}, T = {_fmt_temp(r['temperature'])}"
        if not r["n"] > 0:
            lines.append(f"{head}: no {stats.BASELINE} records on the same prompts")
            continue
        est = _fmt_ci(r["speedup"], r["speedup_ci_low"], r["speedup_ci_high"], suffix="×")
        if r["significant"]:
            word = "faster" if r["speedup"] > 1 else "slower"
        elif r.get("too_few") is True:
            side = _ci_side(r).strip(" ()")
            word = f"too few prompts to test (n = {int(r['n'])}, {int(r['n_needed'])} needed)" + (f"; {side}" if side else "")
        else:
            word = "no significant difference"
        extra = []
        if r.get("timing_suspect") is True:
            extra.append("timings untrustworthy (stalled requests)")
        if r.get("gate_skipped", 0) and r["gate_skipped"] > 0:
            share = r["gate_skipped"] / r["rounds_traced"]
            extra.append("drafted nothing (draft gate)" if not np.isfinite(r["acceptance_rate"])
                         else f"draft gate skipped {100 * share:.0f}% of rounds")
        if r.get("lookup_only", 0) and r["lookup_only"] > 0:
            extra.append(f"{100 * r['lookup_only'] / r['rounds_traced']:.0f}% of rounds took lookup drafts only")
        lines.append(f"{head}: {est}, {word}" + "".join(f"; {e}" for e in extra))
    return lines


def caveats(summary: pd.DataFrame) -> list[str]:
    """What limits the whole table, said once at the top (each cell's note says it in detail)."""
    s = summary[(summary["policy"] != stats.BASELINE) & (summary["n"] > 0)]
    out = []
    few = s[s["too_few"].fillna(False).astype(bool)]
    if len(few):
        ns = ", ".join(map(str, sorted(set(few["n"].astype(int)))))
        out.append(f"{len(few)} of {len(s)} compared cells have too few prompts (n = {ns}) for Wilcoxon with Holm "
                   f"across the table ever to reach p < {stats.ALPHA:g}: {int(few['n_needed'].max())} are needed. "
                   "Read their CIs, not their p-values (\"no significant difference\" would mean nothing there).")
    stalled = summary[summary["stalled"].fillna(0) > 0]
    if len(stalled):
        cells = ", ".join(f"{r['policy']} {r['workload']} b = {r['batch_size']}" for _, r in stalled.iterrows())
        out.append(f"Stalled requests (decode time per verify round > {stats.STALL_FACTOR:g}× the cell's median) in: {cells}. "
                   "Their tokens/s, throughput and the speedups paired on them are untrustworthy; τ and acceptance are not "
                   "affected. Rerun those cells on an idle machine.")
    gate = s[s["gate_skipped"].fillna(0) > 0]
    if len(gate):
        cells = ", ".join(f"{r['policy']} {r['workload']} b = {r['batch_size']} "
                          f"({100 * r['gate_skipped'] / r['rounds_traced']:.0f}%)" for _, r in gate.iterrows())
        out.append(f"DSpark's draft gate skipped drafting in some rounds, because the device's cost profile said drafting "
                   f"would not pay there: {cells}. τ near 1 in those cells means \"did not draft\", not \"drafted badly\".")
    return out


def settings_lines(df: pd.DataFrame) -> list[str]:
    """The sweep's settings (its sweep.json when there is one, else what the records say) and its
    decode wall time."""
    import json

    src = stats.sources(df)
    settings_file = Path(src[0]) / "sweep.json" if src else None
    lines = []
    if settings_file is not None and settings_file.is_file():
        try:
            st = json.loads(settings_file.read_text())
        except (OSError, ValueError):
            st = None
        if isinstance(st, dict):
            keys = ("policies", "workloads", "batch_sizes", "temperatures", "repeats", "limit", "max_new_tokens",
                    "top_p", "seed", "target", "device")
            fmt = lambda v: ", ".join(map(str, v)) if isinstance(v, list) else ("all" if v is None else str(v))  # noqa: E731
            lines.append("Settings (" + str(settings_file) + "): " +
                         "; ".join(f"{k.replace('_', ' ')} {fmt(st[k])}" for k in keys if k in st))
    if not lines:
        vals = lambda c: ", ".join(map(str, sorted(set(df[c].dropna())))) if c in df else "?"  # noqa: E731
        lines.append(f"Settings (from the records): target {vals('target')}; device {vals('device')}; "
                     f"max new tokens {vals('max_new_tokens')}; top p {vals('top_p')}; seed {vals('seed')}")
    if {"batch_id", "batch_wall_s"} <= set(df.columns):
        b = df.dropna(subset=["batch_id"]).drop_duplicates(subset=["batch_id"])
        wall = float(b["batch_wall_s"].astype(float).sum())
        started = sorted(set(df["env.time"].dropna())) if "env.time" in df else []
        when = f", started {started[0].replace('T', ' ').rstrip('Z')} UTC" if started else ""
        lines.append(f"Wall time decoding: {_duration(wall)} over {len(b)} batches{when} (sum of batch wall times; "
                     "model load, warm-up and cost profiling not included)")
    return lines


def _duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "–"
    m, s_ = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m} min" if h else (f"{m} min {s_} s" if m else f"{seconds:.1f} s")


def calibration_tables(df: pd.DataFrame, n_resamples: int = 500) -> list[tuple[str, pd.DataFrame]]:
    """Held-out confidence calibration per (policy, workload, temperature) for runs that recorded
    confidences (DSpark): ECE of the prefix-survival prediction before / after STS (the fit for that
    temperature), the change with a request-bootstrap 95% CI, and AUC, per position."""
    from specbench.policies.calibration import calibration_from_traces, sts_for

    out = []
    if "trace" not in df.columns or "policy_params" not in df.columns:
        return out
    for (policy, workload, temperature), g in df.groupby(["policy", "workload", "temperature"], sort=True):
        traces = [t for t in g["trace"] if isinstance(t, dict) and t.get("confidence")]
        params = [p for p in g["policy_params"] if isinstance(p, dict) and p.get("sts")]
        if not traces or not params:
            continue
        rows = calibration_from_traces(traces, sts_for(params[0]["sts"], float(temperature)), n_resamples=n_resamples)
        rows = [r for r in rows if r["n"] > 0]
        if not rows:
            continue

        def change(r):
            if "ece_change" not in r:
                return "–"
            return f"{r['ece_change']:+.3f} [{r['ece_change_lo']:+.3f}, {r['ece_change_hi']:+.3f}]"

        t = pd.DataFrame([{"Position": r["position"], "n": r["n"], "Accept rate": _fmt(r["label_rate"], 3),
                           "T (STS)": _fmt(r["temperature"]), "ECE before": _fmt(r["ece_before"], 3),
                           "ECE after": _fmt(r["ece_after"], 3), "after − before [95% CI]": change(r),
                           "AUC": _fmt(r["auc"], 3)} for r in rows])
        out.append((f"{policy} on {workload}, T = {_fmt_temp(temperature)}", t))
    return out


def _html_table(t: pd.DataFrame, cls: str = "") -> str:
    if t.empty:
        return "<p class='muted'>(empty)</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in t.columns)
    body = []
    for _, r in t.iterrows():
        cells = []
        for c in t.columns:
            v = html.escape(str(r[c]))
            if c.startswith("Speedup") and v.endswith(" *"):
                v = f"<b>{v[:-2]}</b><span class='sig'> *</span>"
            cells.append(f"<td>{v}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<div class='scroll'><table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


def _footnoted(t: pd.DataFrame, col: str) -> tuple[pd.DataFrame, list[str]]:
    """Replace the long text of column `col` by footnote marks [1], [2] … (one per distinct text):
    the PDF's table keeps every column readable and the notes are printed in full below it."""
    texts = list(dict.fromkeys(v for v in t[col] if v))
    marks = {v: f"[{i}]" for i, v in enumerate(texts, 1)}
    t = t.copy()
    t[col] = [marks.get(v, "") for v in t[col]]
    return t, [f"{marks[v]} {v}" for v in texts]


def _table_pages(t: pd.DataFrame, title: str, rows_per_page: int = 24, col_widths: dict | None = None,
                 footnotes: Sequence[str] = (), then: tuple[pd.DataFrame, str] | None = None) -> list[Figure]:
    """Landscape A4 pages holding a formatted table (for the PDF), `footnotes` printed in full
    under it, and optionally a second small table (`then`: table, title) below on the last page
    when it fits, else on its own page."""
    figs = []
    if t.empty:
        return figs
    pages = max(1, math.ceil(len(t) / rows_per_page))
    for p in range(pages):
        chunk = t.iloc[p * rows_per_page : (p + 1) * rows_per_page]
        fig = Figure(figsize=(11.69, 8.27), dpi=_DPI)
        top = _draw_table(fig, chunk, title + (f" ({p + 1}/{pages})" if pages > 1 else ""), 0.94)
        if p == pages - 1:
            notes = [w for f in footnotes for w in _wrap(f, 190)]
            if notes:
                fig.text(0.05, top - 0.02, "\n".join(notes), fontsize=7.5, va="top", linespacing=1.4)
                top -= 0.02 + 0.0185 * len(notes) + 0.02
            if then is not None and not then[0].empty:
                if top - 0.06 - 0.035 * (len(then[0]) + 1) > 0.03:
                    _draw_table(fig, then[0], then[1], top - 0.02)
                else:
                    figs.append(fig)
                    fig = Figure(figsize=(11.69, 8.27), dpi=_DPI)
                    _draw_table(fig, then[0], then[1], 0.94)
        figs.append(fig)
    return figs


def _draw_table(fig: Figure, t: pd.DataFrame, title: str, top: float) -> float:
    """Draw `t` under `title` from height `top` (figure fraction) down; returns its bottom. Each
    column is as wide as its longest text (a fitted font otherwise squeezes short columns such as
    b / T / n until their text runs together) and the font is chosen so the whole row fits."""
    fig.text(0.05, top, title, fontsize=12, fontweight="bold", va="top")
    # a cell longer than a line would shrink the whole table's font: cut it (the HTML has it whole)
    cells = [[v if len(v) <= 110 else v[:109] + "…" for v in row] for row in t.astype(str).to_numpy().tolist()]
    chars = [max([len(str(c))] + [len(row[i]) for row in cells]) + 2 for i, c in enumerate(t.columns)]
    left, width = 0.05, 0.90
    size = min(9.0, width * fig.get_figwidth() * 72 / (0.62 * sum(chars)))
    row_h = size * 1.9 / 72 / fig.get_figheight()
    height = row_h * (len(cells) + 1)
    bottom = top - 0.035 - height
    ax = fig.add_axes((left, bottom, width, height))
    ax.axis("off")
    tab = ax.table(cellText=cells, colLabels=list(t.columns), cellLoc="left", loc="upper left",
                   colWidths=[c / sum(chars) for c in chars], bbox=(0, 0, 1, 1))
    tab.auto_set_font_size(False)
    tab.set_fontsize(size)
    for (i, _), cell in tab.get_celld().items():
        cell.set_edgecolor("#ccc")
        cell.PAD = 0.02
        if i == 0:
            cell.set_facecolor("#eef2f7")
            cell.set_text_props(fontweight="bold")
    return bottom


def _text_page(title: str, lines: list[str]) -> Figure:
    fig = Figure(figsize=(11.69, 8.27), dpi=_DPI)
    fig.text(0.06, 0.92, title, fontsize=16, fontweight="bold", va="top")
    fig.text(0.06, 0.85, "\n".join(lines), fontsize=9, va="top", family="DejaVu Sans", linespacing=1.6)
    return fig


# --------------------------------------------------------------------------------------------
# Assembly


_CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,'DejaVu Sans',Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#222;line-height:1.45;padding:0 16px;background:#fff}
h1{font-size:1.6em;margin-bottom:0.2em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:3px}
.muted{color:#666;font-size:0.9em}
table{border-collapse:collapse;font-size:0.8em;margin:8px 0;width:100%}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#eef2f7}td{white-space:nowrap}td:last-child{white-space:normal;min-width:12em}
.scroll{overflow-x:auto}tbody tr:nth-child(even){background:#fafafa}
.sig{color:#c00;font-weight:bold}
figure{margin:12px 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:0.85em;color:#555}
.env td:first-child{white-space:nowrap;font-weight:600}
.verdicts{font-size:0.95em;margin:4px 0 8px 0}.verdicts li{margin:1px 0}
.warn{background:#fff6e0;border-left:4px solid #e0a000;padding:6px 10px;font-size:0.9em;margin:6px 0}
"""


def _png_b64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


_METHOD = (
    "Speedup is paired per prompt: each policy's tokens/s (decode rate per user, TTFT excluded) "
    "is divided by the AR baseline's on the same prompt, turn, batch size and temperature "
    "(tokens/s averaged over repeats first; turns of one prompt averaged on the log scale). "
    "The headline is the geometric mean over prompts with a 95% BCa bootstrap CI "
    "({n_resamples} resamples, seed {seed}); p is a two-sided Wilcoxon signed-rank test of the log "
    "speedups, Holm-corrected across every cell of the table; * marks Holm p < 0.05. "
    "Effect sizes: median log speedup and matched-pairs rank-biserial r_rb. "
    "'Ratio of means' is Spec-Bench's mean(tok/s policy) / mean(tok/s AR), for comparability. "
    "τ = tokens per verify round incl. the bonus token (mean over prompts); acceptance rate = Σaccepted / Σdrafted; "
    "throughput = Σ tokens of all batches / Σ their wall time (prefill included)."
)


_CALIBRATION_NOTE = (
    "The confidence head predicts each draft's conditional acceptance; the scheduler uses the prefix "
    "survival Π c_i, so that is what is scored: equal-width-bin ECE (15 bins) of the prediction before "
    "(T = 1) and after Sequential Temperature Scaling (per-position temperatures fitted by "
    "`specbench calibrate` on the drafter's own held-out training prompts, one fit per sampling "
    "temperature; the nearest fit is used), on the rounds of these runs (evaluation prompts, never "
    "seen in fitting). The change's 95% interval resamples whole requests (500 bootstrap resamples). "
    "Under a scheduler, position k is labelled only in rounds that verified ≥ k drafts. AUC is "
    "unchanged by temperature scaling."
)


def write_report(
    results_path: str | Path,
    html_path: str | Path | None = None,
    pdf_path: str | Path | None = None,
    *,
    title: str | None = None,
    n_resamples: int = stats.DEFAULT_RESAMPLES,
    seed: int = stats.DEFAULT_SEED,
) -> None:
    """Write the HTML and/or PDF report for the results under ``results_path``.

    At least one of ``html_path`` / ``pdf_path`` must be given. Raises
    :class:`specbench.errors.UserError` for missing or malformed results.
    """
    if html_path is None and pdf_path is None:
        raise UserError("nothing to write: give an HTML path, a PDF path, or both")
    results_path = Path(results_path)
    df = stats.load_results(results_path)
    srcs = stats.sources(df)
    if len(srcs) > 1:  # pooling sweeps would pair requests measured at different times and settings
        shown = ", ".join(srcs[:4]) + (f" and {len(srcs) - 4} more" if len(srcs) > 4 else "")
        raise UserError(f"{results_path} holds records of {len(srcs)} different sweeps or run directories ({shown}); "
                        "a report covers one: give one of them (`specbench compare` keeps them apart)")
    title = title or f"specbench report: {results_path.name or results_path}"
    summary = stats.summarize(df, n_resamples=n_resamples, seed=seed)
    cats = df.groupby("workload")["category"].nunique()
    summary_cat = stats.summarize(df, by_category=True, n_resamples=n_resamples, seed=seed) if (cats > 1).any() else None
    pos = stats.position_acceptance(df)
    env = environment_table(df)
    colors = _colors(df["policy"])

    figs: list[tuple[str, str, Figure]] = [
        ("Speedup vs AR", "Geometric-mean per-prompt speedup vs AR with 95% bootstrap CI; the dashed line is 1× (no gain).",
         fig_speedup(summary, colors)),
    ]
    if summary_cat is not None:
        fc = fig_speedup_by_category(summary_cat, colors)
        if fc is not None:
            figs.append(("Speedup per category", "Same as above within each category (fewer prompts per cell: wider CIs; "
                         "Holm correction across all category cells).", fc))
    figs += [
        ("Per-user rate vs throughput", "Each point is one batch size (labelled b=…); up = faster for each user, "
         "right = more tokens/s for the machine. Error bars: 95% CI of the median per-user rate.", fig_pareto(summary, colors)),
        ("Per-position acceptance", "Top: unconditional acceptance at draft position k = rounds accepting ≥ k drafts / rounds "
         "verifying ≥ k drafts. Bottom: conditional = ratio of consecutive unconditional values (above 1 where "
         "fewer rounds drafted k than k−1 tokens, e.g. prompt lookup's variable lengths). Line style and marker = batch "
         "size (points shifted sideways per batch size so equal curves stay visible).",
         fig_position(pos, colors)),
        ("τ distributions", "Tokens emitted per verify round (accepted drafts + bonus token), one value per request.",
         fig_tau(df, colors)),
    ]
    sim = load_simulation(results_path)
    if sim is not None:
        figs.append(("Simulated load", "`specbench simulate`: the recorded per-round traces replayed against a cost "
                     "profile (specbench/analysis/simulate.py), one point per concurrency c; DSpark re-schedules on the replayed "
                     "confidences. Estimates, not measurements; see simulation.json beside the csv for the profile.",
                     fig_simulation(sim, _colors(pd.concat([df["policy"], sim["policy"]])))))
    table = summary_table(summary)
    table_cat = summary_table(summary_cat, with_category=True) if summary_cat is not None else None
    be = breakeven_table(summary)
    calibration = calibration_tables(df)
    method = _METHOD.format(n_resamples=n_resamples, seed=seed)
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    files = sorted(set(df["_file"]))
    meta = (f"{len(df)} records from {len(files)} file(s) under {results_path}; "
            f"workloads: {', '.join(sorted(df['workload'].unique()))}; policies: {', '.join(_policy_order(df['policy']))}; "
            f"batch sizes {', '.join(map(str, sorted(df['batch_size'].unique())))}; generated {generated}.")
    if df.attrs.get("duplicates_dropped"):
        meta += f" {df.attrs['duplicates_dropped']} duplicate record(s) (same key) ignored."
    verdict = verdicts(summary)
    caveat = caveats(summary)
    setting = settings_lines(df)

    try:
        if html_path is not None:
            parts = [
                "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
                "<meta name='viewport' content='width=device-width,initial-scale=1'>",
                f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
                f"<h1>{html.escape(title)}</h1><p class='muted'>{html.escape(meta)}</p>",
                "".join(f"<p class='muted'>{html.escape(x)}</p>" for x in setting),
                "<h2>Verdicts</h2><p class='muted'>Geometric-mean speedup per prompt vs AR [95% CI]; faster / slower "
                "= Holm p &lt; 0.05.</p><ul class='verdicts'>",
                "".join(f"<li>{html.escape(v)}</li>" for v in verdict) or "<li>no speculative policy to compare</li>",
                "</ul>",
                "".join(f"<p class='warn'>{html.escape(c)}</p>" for c in caveat),
                f"<h2>Summary</h2><p class='muted'>{html.escape(method)}</p>",
                _html_table(table),
                "<h2>Where speculation stops paying</h2><p class='muted'>Batch sizes at which each policy is "
                "significantly faster than AR, not distinguishable from it, or significantly slower (Holm p &lt; 0.05)"
                + ("; 'too few prompts to test': the test could not have rejected at this n, whatever the data"
                   if "too few prompts to test" in be.columns else "") + ".</p>",
                _html_table(be),
            ]
            for i, (h, cap, fig) in enumerate(figs, 1):
                parts.append(f"<h2>{i}. {html.escape(h)}</h2><figure><img alt='{html.escape(h)}' "
                             f"src='data:image/png;base64,{_png_b64(fig)}'><figcaption>{html.escape(cap)}</figcaption></figure>")
            if table_cat is not None:
                parts += ["<h2>Summary per category</h2>", _html_table(table_cat)]
            if calibration:
                parts.append(f"<h2>Confidence calibration (held-out)</h2><p class='muted'>{html.escape(_CALIBRATION_NOTE)}</p>")
                for name, t in calibration:
                    parts += [f"<h3>{html.escape(name)}</h3>", _html_table(t)]
            parts += ["<h2>Run environment</h2>", _html_table(env.rename(columns={"field": "Field", "value": "Value"}), "env"),
                      "<p class='muted'>specbench — paired per-prompt statistics; see docs for definitions.</p></body></html>"]
            atomic.write_text(Path(html_path), "".join(parts))

        if pdf_path is not None:
            buf = io.BytesIO()
            first = [*_wrap(meta, 150), *[w for x in setting for w in _wrap(x, 150)], "", "Verdicts (speedup vs AR "
                     "[95% CI]; faster / slower = Holm p < 0.05):"]
            shown = verdict[:24]
            first += [f"  • {w}" for v in shown for w in _wrap(v, 145)]
            if len(verdict) > len(shown):
                first.append(f"  (+{len(verdict) - len(shown)} more: see the summary table)")
            first += ["", *[w for c in caveat for w in _wrap("! " + c, 150)], "", *_wrap(method, 150)]
            pages = [_text_page(title, first)]
            narrow, footnotes = _footnoted(table.drop(columns=["med. log s", "r_rb"]), "Note")
            pages += _table_pages(narrow, "Summary (* = Holm p < 0.05)", footnotes=footnotes,
                                  then=(be, "Where speculation stops paying"))
            pages += [f for _, _, f in figs]
            if table_cat is not None:
                cat_narrow, cat_notes = _footnoted(table_cat.drop(columns=["med. log s", "r_rb"]), "Note")
                pages += _table_pages(cat_narrow, "Summary per category", footnotes=cat_notes)
            for name, t in calibration:
                pages += _table_pages(t, f"Confidence calibration (held-out): {name}")
            pages += _table_pages(env.rename(columns={"field": "Field", "value": "Value"}), "Run environment", rows_per_page=30)
            with PdfPages(buf, metadata={"Title": title, "Creator": "specbench"}) as pdf:
                for f in pages:
                    pdf.savefig(f, facecolor="white")
            atomic.write_bytes(Path(pdf_path), buf.getvalue())
    finally:
        for _, _, f in figs:
            f.clear()


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


__all__ = ["write_report", "summary_table", "breakeven_table", "fig_speedup", "fig_pareto", "fig_position", "fig_tau",
           "fig_simulation", "load_simulation"]
