import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests import the tiny-model helpers directly


import pytest  # noqa: E402

from specbench.engine import cpu_f32, cpu_kernels  # noqa: E402

# The bf16 CPU kernels' own tests need a CPU with AVX-512 BF16: hardware, not set-up, so on other
# CPUs they are not collected rather than skipped (a skip fails `.ci/run`, below). There torch's
# routes run, which every other test covers, and test_engine_units.py checks that they do.
collect_ignore = [] if cpu_kernels.cpu_has_avx512_bf16() else ["test_cpu_kernels.py"]
# Likewise the fp32 GEMV's (engine/cpu_f32.py), on a CPU without AVX2 + FMA.
if not cpu_f32.cpu_has_avx2_fma():
    collect_ignore.append("test_cpu_f32.py")


@pytest.fixture(scope="session")
def default_model():
    """The embedded default target (SmolLM2-135M-Instruct, fp32 CPU); the first run converts the
    GGUF into the cache (~25 s), later runs load it in about a second."""
    from specbench.engine.loading import load_model

    return load_model("smollm2-135m")


# `.ci/run` sets SPECBENCH_NO_SKIPS=1 after scripts/setup.sh: there every tool a test needs is
# installed, so a skip ("chromium not installed", "ray not installed") means the set-up is broken
# and must fail the run instead of passing quietly. Deselected tests (-m "not slow") are not skips.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("SPECBENCH_NO_SKIPS") == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under SPECBENCH_NO_SKIPS=1 (a fresh set-up must have everything): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (`pytest.importorskip("ray")`)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("SPECBENCH_NO_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under SPECBENCH_NO_SKIPS=1 (a fresh set-up must have everything): {reason}"
