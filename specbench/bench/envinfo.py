"""The run environment: what every results record carries (`env`, docs/records.md), and the
table the report makes of it."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
import json
from functools import lru_cache
from pathlib import Path

from specbench import resources


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else platform's best guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_isa() -> str:
    """The CPU features that decide the core's routes on a CPU: torch's vector capability (e.g.
    AVX2, AVX512) and the bf16 units present (avx512_bf16: the suite's bf16 kernels; amx_bf16:
    their tile route). Two CPUs of one model name can differ here (AMD EPYC: Zen 4 with AVX-512
    BF16, Zen 3 with AVX2 only), and their numbers with them."""
    import torch

    from specbench.engine.cpu_kernels import cpu_flags

    units = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return " ".join([torch.backends.cpu.get_cpu_capability(), *units])


def device_name(device) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    return cpu_name()


@lru_cache(maxsize=1)
def git_state(repo: str = str(resources.SOURCE_ROOT)) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout specbench runs from; (None, None) outside a git checkout."""
    if not (Path(repo) / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(status.strip())


def environment(device="cpu") -> dict:
    """python, torch, transformers versions; device name; the CPU's vector capability and bf16 units
    (`cpu_isa`); cpu count; torch threads; git commit and
    dirty flag (None outside a git checkout); hostname; UTC time (ISO 8601)."""
    import torch

    commit, dirty = git_state()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "specbench": _version("specbench"),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
        "git_dirty": dirty,
        "hostname": socket.gethostname(),
        "platform": sys.platform,
        "time": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def environment_table(df):
    """The run environment of a results DataFrame (:func:`specbench.analysis.stats.load_results`), as
    the report shows it: the distinct values of every ``env.*`` field :func:`environment` recorded
    and of the run-level fields, one row each, plus one row per policy (drafter, parameters)."""
    import pandas as pd  # here, so recording an environment stays light

    fields = [c for c in df.columns if c.startswith("env.")]
    fields += [c for c in ("target", "device", "max_new_tokens", "top_p") if c in df.columns
               and f"env.{c}" not in fields]  # one row per name ("device" is in both env and the record)
    rows = []
    for c in fields:
        vals = df[c].dropna().map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else str(v))
        uniq = list(dict.fromkeys(vals))
        rows.append({"field": c.removeprefix("env."), "value": ", ".join(uniq[:6]) + (f" (+{len(uniq) - 6} more)" if len(uniq) > 6 else "")})
    if "policy" in df.columns:
        for pol, d in df.groupby("policy", sort=True):
            desc = []
            if "drafter" in d and d["drafter"].notna().any():
                desc.append("drafter=" + ", ".join(dict.fromkeys(map(str, d["drafter"].dropna()))))
            if "policy_params" in d:
                pp = list(dict.fromkeys(json.dumps(v, sort_keys=True) for v in d["policy_params"] if isinstance(v, dict) and v))
                if pp:
                    desc.append("params=" + " | ".join(pp[:3]))
            rows.append({"field": f"policy {pol}", "value": "; ".join(desc) or "-"})
    return pd.DataFrame(rows, columns=["field", "value"])
