"""Training-loop pieces every drafter trainer shares.

* `BUDGETS` / `get_budget`: tiny (seconds, tests), small (the 2-core CPU, under an hour),
  full (an H200, a few minutes): data size, generation length, steps, batch, lr.
* `run_training`: AdamW (β = 0.9 / 0.999, ε = 1e-8, weight decay 0), lr linear warmup over 4 %
  of the steps then cosine to 0, grad-norm clip 1.0, deterministic data order (batch of step s
  is a pure function of (seed, s): per-epoch permutations from seeded `torch.Generator`s),
  periodic checkpoints to `<out>/checkpoint/state.pt` (trainable weights, optimizer, step, RNG
  states, loss history; atomic), and resume from them: on CPU an interrupted-then-resumed run
  ends bit-identical to an uninterrupted one. Writes `<out>/loss_history.json`; tqdm bar.
* `save_drafter`: bf16 safetensors shards ≤ 16 MB + `drafter.json` (what
  `specbench.drafters.checkpoints.read_checkpoint` reads), never the target's embedding / lm_head.
* `plot_loss_curve`, `write_training_card`.

Trainer contract (what `specbench.cli.train` calls, for every policy):

    train(target: LoadedModel, data: TrainingData, out_dir: Path, *, budget: dict, seed: int,
          resume: bool = False, progress: bool = True, policy: str) -> TrainResult

`budget` is `get_budget(name)` (keys below; a trainer may read extra keys of its own with
defaults). The trainer writes the drafter checkpoint into `out_dir` with `save_drafter`, its
`loss_curve.png` with `plot_loss_curve`, and returns a `TrainResult`; the CLI writes the card.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from specbench import atomic
from specbench.errors import UserError

MAX_SHARD_BYTES = 16 * 2**20
CHECKPOINT_DIR = "checkpoint"
HISTORY_FILE = "loss_history.json"
CURVE_FILE = "loss_curve.png"
CARD_FILE = "TRAINING.md"

# n_prompts / max_new_tokens / gen_batch_size / magpie_fraction: training data (shared by all
# trainers of a target); steps / batch_size / lr / ckpt_every / eval_every: the optimisation;
# val_fraction: held-out sequences for the validation loss; lm_layers: fixed-K draft LM depth;
# lm_positions: supervised positions per sequence in its loss (0: all; see train/draft_lm.py)
# (each trainer reads its own architecture keys, with defaults).
# "small" is sized for the 2-core CPU: extrapolated from single-threaded timings on smollm2-135m,
# ~18 min of data generation and ~7 s per fixed-K step of 8 sequences (~30 min for 240 steps);
# 2 threads should be faster but that was not measured. "full" is for one H200 (not measured).
BUDGETS: dict[str, dict] = {
    "tiny": dict(n_prompts=16, max_new_tokens=24, gen_batch_size=8, magpie_fraction=0.5, steps=40,
                 batch_size=4, lr=3e-3, ckpt_every=20, eval_every=20, val_fraction=0.125, lm_layers=1),
    "small": dict(n_prompts=512, max_new_tokens=160, gen_batch_size=32, magpie_fraction=0.4, steps=240,
                  batch_size=8, lr=6e-4, ckpt_every=40, eval_every=40, val_fraction=0.05, lm_layers=2,
                  anchors=24, markov_rank=32, positions=32, draft_vocab=8192, lm_positions=64),
    # "quick": a functioning drafter in ~20 min of a shared 2-core CPU (far from converged).
    "quick": dict(n_prompts=512, max_new_tokens=160, gen_batch_size=32, magpie_fraction=0.4, steps=80,
                  batch_size=8, lr=1e-3, ckpt_every=20, eval_every=40, val_fraction=0.05, lm_layers=2,
                  anchors=16, markov_rank=32, positions=24, draft_vocab=8192),
    "full": dict(n_prompts=4096, max_new_tokens=256, gen_batch_size=128, magpie_fraction=0.4, steps=3000,
                 batch_size=32, lr=6e-4, ckpt_every=500, eval_every=250, val_fraction=0.03, lm_layers=2),
}


def get_budget(name: str, **overrides) -> dict:
    if name not in BUDGETS:
        raise UserError(f"unknown budget {name!r}; choose one of {', '.join(BUDGETS)}")
    return {**BUDGETS[name], **{k: v for k, v in overrides.items() if v is not None}}


# ---------------------------------------------------------------------------------------------
# Schedule and data order


@dataclass
class LoopConfig:
    steps: int
    batch_size: int
    lr: float
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 100
    eval_every: int = 0  # 0: only at the end
    log_every: int = 1

    @classmethod
    def from_budget(cls, budget: dict, seed: int) -> "LoopConfig":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in budget.items() if k in keys}, seed=seed)

    def key(self) -> dict:
        """What must match for a checkpoint to be resumed (everything but logging)."""
        d = asdict(self)
        d.pop("log_every")
        d["betas"] = list(d["betas"])
        return d


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warmup over ⌈warmup_frac·steps⌉ steps, then cosine from lr to 0 (step is 0-based)."""
    warm = max(1, math.ceil(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def batch_indices(step: int, items: Sequence[int], batch_size: int, seed: int) -> list[int]:
    """The items of step `step`: consecutive slices of an endless stream of per-epoch permutations
    (epoch e shuffled by a torch.Generator seeded with (seed, e)); a pure function of its args."""
    n = len(items)
    if n == 0:
        raise UserError("no training sequences")
    out = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        perm = _epoch_perm(n, seed, epoch)
        take = min(batch_size - len(out), n - offset)
        out += [items[i] for i in perm[offset:offset + take]]
        pos += take
    return out


_PERM_CACHE: dict[tuple[int, int, int], list[int]] = {}


def _epoch_perm(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _PERM_CACHE:
        if len(_PERM_CACHE) > 8:
            _PERM_CACHE.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERM_CACHE[key] = torch.randperm(n, generator=g).tolist()
    return _PERM_CACHE[key]


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    kind: str  # drafter kind written to drafter.json ("draft-lm", "dspark", ...)
    out_dir: Path
    steps: int
    history: list[dict]
    train_s: float
    n_params: int
    final: dict = field(default_factory=dict)  # last train metrics and val metrics
    extra: dict = field(default_factory=dict)  # anything a trainer wants in the card


@functools.lru_cache(maxsize=None)
def measured_cpu_dtype() -> tuple[torch.dtype, dict]:
    """The faster of fp32 and bf16 for a decode-sized GEMM on this CPU (bf16 matrix units exist
    on some CPUs and not on others): best of 6 timings of [2048, 576] @ [576, 1536] each."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, w = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        best = float("inf")
        for _ in range(6):
            t0 = time.perf_counter()
            a @ w
            best = min(best, time.perf_counter() - t0)
        timings[str(dtype).replace("torch.", "")] = round(best * 1e3, 3)
    faster = torch.bfloat16 if timings["bfloat16"] < timings["float32"] else torch.float32
    return faster, {"gemm_ms": timings}


def training_autocast(device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a training step over fp32 master weights: bf16 on CUDA; on a CPU, bf16
    where this CPU multiplies bf16 faster than fp32 (measured), else None (plain fp32)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if measured_cpu_dtype()[0] == torch.bfloat16 else None


def vocab_rank(data, indices, vocab_size: int) -> torch.Tensor:
    """Token ids by frequency among the response tokens of `indices` (most frequent first, ties by
    id). A reduced draft vocabulary is a prefix of it: the EAGLE head's (`EagleHead.set_draft_vocab`),
    DSpark's / DFlash's, and the one fixed-K drafts from (stored with the draft LM)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in indices:
        s = data.sequence(i, ("input_ids", "loss_mask"))
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices
    return order.to(torch.int32)


TARGET_STATS_FILE = "target_stats.safetensors"


def attach_target_stats(data, lm_head_weight: torch.Tensor, dtype: torch.dtype | None,
                        progress: bool = True, chunk: int = 2048) -> None:
    """Attach per-token `target_lse` (fp32 log-normaliser of the target's logits) and
    `target_argmax` (its greedy token) to `data` (a TrainingData), from each position's final
    hidden state and the target's lm_head, multiplied in `dtype` (None: the head's own).

    Why: a trainer that drafts from a reduced vocabulary then needs the target's distribution
    only on those tokens, p_t = exp(lm_head[vocab] · h − lse): a V_d-row projection per step
    instead of the whole 49k-row one, which dominated a CPU training step. Computed once and
    cached in the data directory (`target_stats.safetensors`, keyed by the data's shards, the
    target and the dtype); an unwritable directory only loses the cache."""
    dt = dtype or lm_head_weight.dtype
    key = hashlib.sha256(json.dumps([data.manifest["shards"], data.manifest["target"]["fingerprint"],
                                     str(dt)]).encode()).hexdigest()[:16]
    path = Path(data.path) / TARGET_STATS_FILE
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") == key:
                    data.attach("target_lse", f.get_tensor("lse"))
                    data.attach("target_argmax", f.get_tensor("argmax"))
                    return
        except (SafetensorError, OSError):
            pass  # unreadable: recompute and overwrite
    head = lm_head_weight.detach().to(dt)
    lse = torch.empty(data.n_tokens, dtype=torch.float32)
    argmax = torch.empty(data.n_tokens, dtype=torch.int64)
    bar = tqdm(total=data.n_tokens, desc="target log-normalisers", unit="tok", disable=not progress)
    pos, pending = 0, []
    with torch.no_grad():
        for i in range(len(data)):
            pending.append(data.sequence(i, ["last_hidden"])["last_hidden"])
            if sum(len(h) for h in pending) < chunk and i + 1 < len(data):
                continue
            h = torch.cat(pending).to(head.device, dt)
            logits = torch.nn.functional.linear(h, head).float()
            lse[pos:pos + len(h)] = torch.logsumexp(logits, -1).cpu()
            argmax[pos:pos + len(h)] = logits.argmax(-1).cpu()
            pos += len(h)
            bar.update(len(h))
            pending = []
    bar.close()
    try:
        with atomic.replacing(path) as tmp:
            save_file({"lse": lse, "argmax": argmax}, str(tmp), metadata={"key": key})
    except OSError:
        pass
    data.attach("target_lse", lse)
    data.attach("target_argmax", argmax)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def warm_start(model: nn.Module, spec: str, target, kind: str, model_args: dict) -> dict:
    """Load a trained drafter's weights and buffers (its draft vocabulary among them) into `model`
    before training: the run then continues that drafter's optimisation on this run's data, with a
    fresh optimizer and lr schedule. The architecture must match exactly; tensors the drafter shares
    with the target (embedding, lm_head) stay the target's. Returns what the card says about it."""
    from specbench.drafters.checkpoints import read_checkpoint, resolve_checkpoint

    config, state = read_checkpoint(spec, target, kind=kind)
    theirs, ours = config.get("model_args") or {}, json.loads(json.dumps(model_args))
    # Two changes are allowed, each leaving the drafter's outputs as they were:
    # - q/k norms added to layers that had none (their weights start at 1), e.g. to carry a
    #   Llama-layered drafter over to the Qwen3 layout that DeepSpec and vLLM load;
    # - a larger Markov rank (DSpark): the new rank dimensions' W2 columns and confidence-head
    #   inputs start at 0, so the bias W1[x]·W2 and the confidence are unchanged (`_grow_markov_rank`);
    # - more draft layers (DSpark, DFlash), appended after the trained ones with their attention
    #   output and MLP down projections at 0: each new layer starts as the identity on the residual
    #   stream, so the block's hidden states are unchanged (`_new_layer_tensors`).
    adds_qk_norm = _layer_args(ours).get("qk_norm") is True and not _layer_args(theirs).get("qk_norm")
    if adds_qk_norm:
        theirs = json.loads(json.dumps(theirs))
        _layer_args(theirs)["qk_norm"] = True
    old_rank, new_rank = int(theirs.get("markov_rank") or 0), int(ours.get("markov_rank") or 0)
    grows_rank = 0 < old_rank < new_rank
    if grows_rank:
        theirs = {**theirs, "markov_rank": new_rank}
    old_layers, new_layers = int(_layer_args(theirs).get("n_layers") or 0), int(_layer_args(ours).get("n_layers") or 0)
    grows_layers = kind in ("dspark", "dflash") and 0 < old_layers < new_layers
    if grows_layers:
        theirs = json.loads(json.dumps(theirs))
        _layer_args(theirs)["n_layers"] = new_layers
    if theirs != ours:
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise UserError(f"--init {spec}: its architecture differs from this run's in {', '.join(differ)}")
    shared = {t.data_ptr() for t in (target.model.model.embed_tokens.weight, target.model.lm_head.weight)}
    own = model.state_dict()
    if "vocab_rank" in state and "vocab_rank" not in own:
        state.pop("vocab_rank")  # a draft LM's token ranking: data the run recomputes, not a weight
    unknown = sorted(set(state) - set(own))
    added_layers = _new_layer_tensors(own, old_layers) if grows_layers else {}
    absent = sorted(n for n, t in own.items() if n not in state and not (t.numel() and t.data_ptr() in shared)
                    and not (adds_qk_norm and n.endswith(("q_norm.weight", "k_norm.weight")))
                    and n not in added_layers)
    if unknown or absent:
        raise UserError(f"--init {spec}: its weights do not match this model ({(unknown + absent)[:3]})")
    with torch.no_grad():
        for name, t in state.items():
            if grows_rank and own[name].shape != t.shape:
                _grow_markov_rank(name, own[name], t)
            else:
                own[name].copy_(t.to(own[name].dtype))
        for name, zero in added_layers.items():
            if zero:
                own[name].zero_()
    training = config.get("training") or {}
    info = {"from": str(resolve_checkpoint(spec)), "steps": training.get("steps"),
            "n_loss_tokens": (training.get("data") or {}).get("n_loss_tokens"),
            "warm_start": training.get("warm_start")}
    added = (["q/k norms (weights 1)"] if adds_qk_norm else []) + (
        [f"Markov rank {old_rank} → {new_rank} (new W2 columns 0)"] if grows_rank else []) + (
        [f"draft layers {old_layers} → {new_layers} (new output projections 0)"] if grows_layers else [])
    if added:
        info["added"] = ", ".join(added)
    return info


def _grow_markov_rank(name: str, own: torch.Tensor, old: torch.Tensor) -> None:
    """Copy a smaller Markov rank's tensor into the leading slice of its last dimension: W1 (V × r)
    keeps its fresh initialisation in the new columns, W2 (V_d × r) and the confidence head's
    weight (1 × (d + r): the backbone state, then W1[x]) get zeros there, so nothing the drafter
    computes changes until training moves them (W2's new columns get gradient from W1's at once)."""
    if own.dim() != old.dim() or own.shape[:-1] != old.shape[:-1] or own.shape[-1] < old.shape[-1]:
        raise UserError(f"--init: {name} has shape {tuple(old.shape)}, this model's {tuple(own.shape)}")
    if not name.startswith("markov_w1."):
        own.zero_()
    own[..., : old.shape[-1]] = old.to(own.dtype)


def _new_layer_tensors(own: dict, old_layers: int) -> dict[str, bool]:
    """The state names of draft layers `old_layers` and up (`layers.<i>.…`), each mapped to whether
    it starts at 0: the attention's o_proj and the MLP's down_proj, the two projections that write
    into the residual stream. Their other weights keep the fresh initialisation, so gradient reaches
    them as soon as the zeroed projections move."""
    new = {}
    for name in own:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= old_layers:
            new[name] = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
    return new


def _layer_args(model_args: dict) -> dict:
    """The layers' ModelArgs dict inside a drafter's model_args (DSpark nests it; EAGLE and the
    draft LM keep theirs flat or nested likewise)."""
    inner = model_args.get("model_args")
    return inner if isinstance(inner, dict) else model_args


def warm_start_line(info: dict) -> str:
    """The card's line for a warm-started run, with the chain of earlier runs it continues."""
    line = f"`{info['from']}` ({info['steps']} steps on {info['n_loss_tokens']} supervised tokens"
    if info.get("added"):
        line += f"; {info['added']} added"
    if info.get("warm_start"):
        line += ", itself continuing " + warm_start_line(info["warm_start"])
    return line + ")"


def run_training(
    model: nn.Module,
    loss_fn: Callable[[list[int], torch.Generator], tuple[torch.Tensor, dict]],
    train_items: Sequence[int],
    cfg: LoopConfig,
    out_dir,
    *,
    resume: bool = False,
    eval_fn: Callable[[], dict] | None = None,
    progress: bool = True,
    desc: str = "train",
    stop_after: int | None = None,
) -> tuple[list[dict], int]:
    """Optimise `model`'s trainable parameters for cfg.steps steps of `loss_fn(batch, generator)`
    (batch = sequence indices of this step; generator = the loop's seeded torch.Generator for any
    sampling the loss needs, checkpointed with the rest). Returns (history, steps done).

    resume: continue from `<out_dir>/checkpoint/state.pt` when it exists (a checkpoint from other
    settings is refused); without it an existing checkpoint is an error, so nothing is silently
    overwritten. stop_after: end this invocation after that many steps in total (a checkpoint is
    written there), as if interrupted; a later resume finishes the run."""
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / CHECKPOINT_DIR
    ckpt_file = ckpt_dir / "state.pt"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    step, history = 0, []
    if ckpt_file.is_file():
        if not resume:
            raise UserError(f"{out_dir} already holds a training checkpoint; pass --resume to continue it "
                            "or choose another output directory")
        try:
            state = torch.load(ckpt_file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise UserError(f"{ckpt_file}: corrupt checkpoint: {e}") from None
        if state.get("config") != cfg.key():
            raise UserError(f"{ckpt_file} was written with other training settings; "
                            "resume with the same budget and seed, or choose another output directory")
        missing = set(trainable_state(model)) ^ set(state["model"])
        if missing:
            raise UserError(f"{ckpt_file} does not match this model ({sorted(missing)[:3]})")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(state["model"][n])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["rng"]["torch"])
        gen.set_state(state["rng"]["loop"])
        if torch.cuda.is_available() and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    def save_checkpoint():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        rng = {"torch": torch.get_rng_state(), "loop": gen.get_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        with atomic.replacing(ckpt_file) as tmp:
            torch.save({"model": {k: v.clone() for k, v in trainable_state(model).items()},
                        "optimizer": opt.state_dict(), "step": step, "history": history, "rng": rng,
                        "config": cfg.key()}, tmp)
        atomic.write_json(out_dir / HISTORY_FILE, history)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.train()
    elapsed0 = history[-1].get("elapsed_s", 0.0) if history else 0.0
    t_start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", disable=not progress)
    while step < cfg.steps:
        if stop_after is not None and step >= stop_after:
            break
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss, metrics = loss_fn(batch_indices(step, train_items, cfg.batch_size, cfg.seed), gen)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        rec = {"step": step, "lr": lr, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
               **{k: float(v) for k, v in metrics.items()}}
        rec["elapsed_s"] = round(elapsed0 + time.perf_counter() - t_start, 3)
        last = step == cfg.steps
        if eval_fn is not None and (last or (cfg.eval_every and step % cfg.eval_every == 0)):
            model.eval()
            with torch.no_grad():
                rec.update({f"val_{k}": float(v) for k, v in eval_fn().items()})
            model.train()
        history.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        bar.update(1)
        if last or step % cfg.ckpt_every == 0 or (stop_after is not None and step >= stop_after):
            save_checkpoint()
    bar.close()
    model.eval()
    return history, step


# ---------------------------------------------------------------------------------------------
# Output: drafter checkpoint, loss curve, card


def save_drafter(out_dir, kind: str, model_args: dict, state_dict: dict[str, torch.Tensor], target,
                 training_summary: dict, *, exclude: Sequence[str] = ("model.embed_tokens.weight", "lm_head.weight"),
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a drafter checkpoint into `out_dir`: bf16 safetensors shards (each ≤ max_shard_bytes)
    + drafter.json {kind, model_args, target_fingerprint, target_name, training, files, format}.

    Tensors named in `exclude`, or sharing storage with the target's embedding / lm_head, are left
    out (loaders take them from the target). Shards are written under temporary names and renamed;
    drafter.json is written last, so a half-written save never loads; stale shards are removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shared = set()
    tm = target.model
    for t in (tm.model.embed_tokens.weight, tm.lm_head.weight):
        shared.add(t.data_ptr())
    tensors = {}
    for name, t in state_dict.items():
        if name in exclude or (t.numel() and t.data_ptr() in shared):
            continue
        t = t.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.bfloat16)
        n = t.numel() * t.element_size()
        if n > max_shard_bytes - min(64 * 1024, max_shard_bytes // 8):
            raise ValueError(f"tensor {name} is {n / 2**20:.1f} MB, over the {max_shard_bytes / 2**20:.0f} MB file limit")
        tensors[name] = t.contiguous().clone()
    room = max_shard_bytes - min(64 * 1024, max_shard_bytes // 8)  # the rest is for each file's header
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > room:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    files = []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with atomic.replacing(out / fname) as tmp:
            save_file(shard, str(tmp), metadata={"format": "pt", "kind": kind})
        files.append(fname)
    for stale in out.glob("*.safetensors"):
        if stale.name not in files:
            stale.unlink()
    config = {
        "format": 1,
        "kind": kind,
        "model_args": model_args,
        "target_name": target.name,
        "target_fingerprint": target.fingerprint,
        "training": training_summary,
        "files": files,
        "n_params": int(sum(t.numel() for t in tensors.values())),
        "dtype": "bfloat16",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic.write_json(out / "drafter.json", config)
    return out


def plot_loss_curve(history: list[dict], path, title: str = "training loss") -> Path:
    """Train loss per step (light) and its moving average, validation loss as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    steps = [h["step"] for h in history]
    loss = [h["loss"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if steps:
        ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train (per step)")
        w = max(1, len(loss) // 50)
        smooth = [sum(loss[max(0, i - w + 1):i + 1]) / len(loss[max(0, i - w + 1):i + 1]) for i in range(len(loss))]
        ax.plot(steps, smooth, color="tab:blue", lw=1.6, label=f"train (mean of {w})")
        val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
        if val:
            ax.plot(*zip(*val), "o-", color="tab:orange", ms=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic.replacing(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def write_training_card(out_dir, *, policy: str, result: TrainResult, target, data_summary: dict,
                        budget_name: str, budget: dict, seed: int, data_s: float | None, device: str,
                        evaluation: str | None = None) -> Path:
    """A markdown card: what was trained, on what, how long, the loss curve; `evaluation` is a
    markdown section (held-out τ etc.) when the caller has one."""
    out = Path(out_dir)
    final = result.final
    lines = [
        f"# {policy} drafter for {target.name}",
        "",
        f"- kind: `{result.kind}`, {result.n_params / 1e6:.2f} M trainable parameters (stored bf16)",
        f"- target: `{target.name}` (fingerprint `{target.fingerprint}`)",
        f"- budget: `{budget_name}` — {json.dumps(budget)}",
        f"- seed: {seed}; device: {device}; torch {torch.__version__}",
        f"- training data: {data_summary.get('n_sequences')} sequences, {data_summary.get('n_tokens')} tokens "
        f"({data_summary.get('n_loss_tokens')} supervised), prompts {data_summary.get('prompt_sources')}, "
        f"responses by the target (max {data_summary.get('max_new_tokens')} new tokens), "
        f"tap layers {data_summary.get('tap_layers')}; `{data_summary.get('path')}`",
        f"- steps: {result.steps} (batch {budget.get('batch_size')} sequences, lr {budget.get('lr')}, "
        "AdamW, 4 % warmup + cosine, clip 1.0)",
        f"- time: data {_fmt_s(data_s)}, training {_fmt_s(result.train_s)}",
    ]
    if final:
        lines.append("- final: " + ", ".join(f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, (int, float))))
    for k, v in result.extra.items():
        lines.append(f"- {k}: {v}")
    lines += ["", f"![loss curve]({CURVE_FILE})", ""]
    if evaluation:
        lines += [evaluation, ""]
    else:
        lines += ["Held-out acceptance (τ) is not measured by training; run the suite on the `code` / `chat`",
                  "workloads with this drafter and add it here.", ""]
    path = out / CARD_FILE
    atomic.write_text(path, "\n".join(lines))
    return path


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "reused (built earlier)"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"
