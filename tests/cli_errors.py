"""Run the CLI in a subprocess and check a bad-input exit: code 2, one `specbench: error:` line
containing `needle`, no traceback, no output file."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def assert_one_line_error(args: list[str], tmp_path: Path, needle: str, out: Path, env_extra: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    p = subprocess.run([sys.executable, "-m", "specbench", *args], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and not out.exists(), p.stderr[-2000:]
    assert lines[-1].startswith("specbench: error: ") and needle in lines[-1], lines[-1]
    assert not any("Traceback" in line for line in lines)
