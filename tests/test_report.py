"""Tests for specbench.analysis.report: self-contained HTML that renders in headless Chromium, a PDF
that renders with pdftoppm, atomic writes.

Binaries (Debian): apt-get install -y chromium poppler-utils. The rendering tests skip, with
that reason, only when the binary is missing.
"""

from __future__ import annotations

import base64
import html.parser
import io
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from specbench.analysis import report
from specbench.errors import UserError

from fakerecords import make_records, write_records

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PDFTOPPM = shutil.which("pdftoppm")
APT = "apt-get install -y chromium poppler-utils"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    recs = make_records(
        workloads={"humaneval": ["code"], "specbench": ["writing", "summarization", "math"]},
        policies=("ar", "pld", "fixed-k"),
        batch_sizes=(1, 4),
        n_prompts=12,
        turns={"specbench": 2},
        seed=11,
    )
    write_records(d / "results" / "sweep.jsonl", recs)
    html_path, pdf_path = d / "out" / "r.html", d / "out" / "r.pdf"
    report.write_report(d / "results", html_path, pdf_path)
    return d, html_path, pdf_path


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("src", "href", "srcset", "data", "poster", "action") and v is not None:
                self.refs.append((tag, k, v))


def _not_blank(img: Image.Image, min_std=10.0, min_ink=0.01):
    a = np.asarray(img.convert("L"), dtype=float)
    ink = (a < 200).mean()  # fraction of clearly non-white pixels
    return a.std() > min_std and ink > min_ink, (a.std(), ink)


def test_html_is_self_contained(built):
    _, html_path, _ = built
    text = html_path.read_text(encoding="utf-8")
    p = _Refs()
    p.feed(text)
    assert "script" not in p.tags and "link" not in p.tags and "iframe" not in p.tags
    external = [r for r in p.refs if not r[2].startswith("data:")]
    assert external == [], external
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(?:https?:)?//", text, re.I)
    imgs = [v for t, k, v in p.refs if t == "img"]
    assert len(imgs) == 5  # speedup, per category, Pareto, per position, tau
    for v in imgs:
        assert v.startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(v.split(",", 1)[1]))).verify()
    # the summary table carries CIs and the significance legend
    assert "Holm" in text and "95% CI" in text and "Run environment" in text and "SmolLM2-135M-Instruct" in text


def _chromium_render(page, png, tmp_path, size="1280,2000"):
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
        f"--screenshot={png}", f"--window-size={size}", page.resolve().as_uri(),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    # console messages (console.*, uncaught exceptions) are logged as "...:CONSOLE(...)] ..." or
    # "INFO:CONSOLE:..." lines; the page has no scripts, so any such line is a failure.
    console = [l for l in p.stderr.splitlines() if re.search(r":CONSOLE\b|Uncaught", l)]
    return p, console


@pytest.mark.skipif(CHROMIUM is None, reason=f"chromium not installed ({APT})")
def test_console_error_detection_works(tmp_path):
    """Negative control: the same invocation does catch a page's console error."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><p>x</p><script>throw new Error('boom')</script></body></html>")
    p, console = _chromium_render(page, tmp_path / "bad.png", tmp_path, size="400,300")
    assert p.returncode == 0, p.stderr[-2000:]
    assert any("boom" in l for l in console), p.stderr[-2000:]


@pytest.mark.skipif(CHROMIUM is None, reason=f"chromium not installed ({APT})")
def test_html_renders_in_headless_chromium(built, tmp_path):
    _, html_path, _ = built
    png = tmp_path / "shot.png"
    p, console = _chromium_render(html_path, png, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert console == [], console
    img = Image.open(png)
    assert img.size == (1280, 2000)
    ok, why = _not_blank(img)
    assert ok, f"screenshot looks blank (std, ink) = {why}"


@pytest.mark.skipif(PDFTOPPM is None, reason=f"pdftoppm not installed ({APT})")
def test_pdf_renders_with_pdftoppm(built, tmp_path):
    _, _, pdf_path = built
    assert pdf_path.read_bytes()[:5] == b"%PDF-"
    p = subprocess.run([PDFTOPPM, "-png", "-r", "50", str(pdf_path), str(tmp_path / "page")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pages = sorted(tmp_path.glob("page-*.png"))
    # title, summary, break-even, 5 figures, per-category table, environment
    assert len(pages) >= 9, pages
    for pg in pages:
        ok, why = _not_blank(Image.open(pg), min_std=3.0, min_ink=0.002)
        assert ok, f"{pg.name} looks blank (std, ink) = {why}"


def test_failed_report_leaves_no_partial_file(built, tmp_path, monkeypatch):
    d, _, _ = built
    html_path, pdf_path = tmp_path / "r.html", tmp_path / "r.pdf"
    html_path.write_text("previous report")

    def boom(*a, **k):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(report, "fig_tau", boom)
    with pytest.raises(RuntimeError):
        report.write_report(d / "results", html_path, pdf_path)
    assert html_path.read_text() == "previous report" and not pdf_path.exists()
    monkeypatch.undo()

    # a failure while writing the PDF leaves the HTML complete and no PDF / temp files
    monkeypatch.setattr(report, "_table_pages", boom)
    with pytest.raises(RuntimeError):
        report.write_report(d / "results", html_path, pdf_path)
    assert html_path.read_text().rstrip().endswith("</html>") and not pdf_path.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.html"]


def test_bad_input_is_a_user_error(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("{not json\n")
    with pytest.raises(UserError, match=r"r\.jsonl:1:"):
        report.write_report(f, tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(UserError, match="nothing to write"):
        report.write_report(f)


def test_ar_only_and_single_prompt_results_still_render(tmp_path):
    recs = make_records(workloads={"w": ["w"]}, policies=("ar",), batch_sizes=(1,), n_prompts=3)
    write_records(tmp_path / "ar.jsonl", recs)
    report.write_report(tmp_path / "ar.jsonl", tmp_path / "ar.html", tmp_path / "ar.pdf", n_resamples=200)
    assert "1 (baseline)" in (tmp_path / "ar.html").read_text()
    assert (tmp_path / "ar.pdf").read_bytes()[:5] == b"%PDF-"
    recs = make_records(workloads={"w": ["w"]}, policies=("ar", "pld"), batch_sizes=(1,), n_prompts=1)
    write_records(tmp_path / "one.jsonl", recs)
    report.write_report(tmp_path / "one.jsonl", tmp_path / "one.html", tmp_path / "one.pdf", n_resamples=200)
    assert "n&lt;2: no CI" in (tmp_path / "one.html").read_text()


def test_pareto_survives_an_interval_that_excludes_its_point():
    """BCa intervals can exclude the point estimate (the load-cpu sweep's b = 16 median did): the
    figure draws, it does not raise on a negative error-bar length."""
    import pandas as pd

    from specbench.analysis.report import _colors, fig_pareto

    summary = pd.DataFrame([
        {"workload": "code", "temperature": 0.0, "policy": "ar", "batch_size": 16, "throughput": 78.1,
         "tps_median": 11.1, "tps_ci_low": 11.2, "tps_ci_high": 11.5},
        {"workload": "code", "temperature": 0.0, "policy": "dspark", "batch_size": 16, "throughput": 77.2,
         "tps_median": 10.3, "tps_ci_low": 9.0, "tps_ci_high": 10.1},
    ])
    fig = fig_pareto(summary, _colors(summary["policy"]))
    (ax,) = fig.axes
    bars = {c.get_label(): c for c in ax.containers}  # one errorbar per policy: (line, caps, bar segments)
    assert set(bars) == {"ar", "dspark"}
    expected = {  # (x, y) at (throughput, median); the bar keeps only the interval's side of the point
        "ar": ((78.1, 11.1), [(78.1, 11.1), (78.1, 11.5)]),
        "dspark": ((77.2, 10.3), [(77.2, 9.0), (77.2, 10.3)]),
    }
    for pol, (point, segment) in expected.items():
        line, _, (segments,) = bars[pol].lines
        np.testing.assert_allclose(np.column_stack(line.get_data()), [point])
        np.testing.assert_allclose(segments.get_segments()[0], segment)
    assert sorted(t.get_text() for t in ax.texts) == ["b=16", "b=16"]


def test_calibration_tables_one_per_temperature_with_its_fit():
    """DSpark records at T = 0 and T = 1: one held-out table each, scored with the STS fit for that
    temperature (from policy_params.sts), with the request-bootstrap interval of the ECE change."""
    import numpy as np
    import pandas as pd

    from specbench.analysis.report import calibration_tables

    rng = np.random.default_rng(0)
    fits = {"0": [0.5, 2.0], "1": [1.5, 1.0]}
    rows = []
    for temperature, fit in ((0.0, fits["0"]), (1.0, fits["1"])):
        for request in range(12):
            z = rng.normal(0.0, 1.5, size=(30, 2))
            accepted = (rng.random((30, 2)) < 1 / (1 + np.exp(-z))).cumprod(axis=1).sum(axis=1)
            conf = 1 / (1 + np.exp(-z / np.array(fit)))
            rows.append({"policy": "dspark-fixed", "workload": "code", "temperature": temperature,
                         "policy_params": {"scheduler": "fixed", "sts": fits},
                         "trace": {"confidence": conf.tolist(), "verify_len": [2] * 30, "accepted": accepted.tolist()}})
    rows.append({"policy": "ar", "workload": "code", "temperature": 0.0, "policy_params": {}, "trace": {"verify_len": [0]}})
    tables = calibration_tables(pd.DataFrame(rows), n_resamples=50)
    assert [name for name, _ in tables] == ["dspark-fixed on code, T = 0", "dspark-fixed on code, T = 1"]
    for (_, t), fit in zip(tables, (fits["0"], fits["1"])):
        assert list(t["n"]) == [360, 360]
        assert [float(x) for x in t["T (STS)"]] == fit
        assert all(c.count("[") == 1 for c in t["after − before [95% CI]"])


def test_breakeven_table_does_not_call_unpaired_cells_no_difference():
    """A cell without AR records on the same prompts (n = 0) is 'no AR to compare', not 'no
    significant difference'."""
    import pandas as pd

    from specbench.analysis.report import breakeven_table

    summary = pd.DataFrame([
        {"workload": "code", "temperature": 0.0, "policy": "ar", "batch_size": 1, "n": 0, "speedup": float("nan"), "significant": False},
        {"workload": "code", "temperature": 0.0, "policy": "pld", "batch_size": 1, "n": 8, "speedup": 1.4, "significant": True},
        {"workload": "code", "temperature": 0.0, "policy": "pld", "batch_size": 4, "n": 8, "speedup": 1.02, "significant": False},
        {"workload": "code", "temperature": 0.0, "policy": "pld", "batch_size": 16, "n": 0, "speedup": float("nan"), "significant": False},
    ])
    row = breakeven_table(summary).iloc[0]
    assert (row["faster (Holm p<0.05)"], row["no significant difference"], row["slower (Holm p<0.05)"],
            row["no AR to compare"]) == ("1", "4", "–", "16")
