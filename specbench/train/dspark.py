"""Training DSpark and DFlash drafters (docs/dspark.md §6) on a target's cached features.

Per optimiser step: `batch_size` sequences (shared deterministic order, `common.batch_indices`);
per sequence up to `anchors` training blocks (docs/dspark.md §6.1):
  * valid anchors p: loss_mask[p] = loss_mask[p+1] = 1 (the anchor and its next token are both
    response tokens), sampled uniformly without replacement, sorted; shortfalls are padding
    blocks (anchor 0, never supervised);
  * block p: inputs [x_p, MASK×(γ−1)] at positions p..p+γ−1, labels x_{p+1..p+γ}, the target's
    distribution for slot k = softmax(lm_head(last_hidden[p+k])) (recomputed from the cache,
    only at supervised slots);
  * slot k is supervised iff its label exists and is a response token, cut to a contiguous prefix
    (cumulative product), as DeepSpec's `eval_mask`.
All blocks of a batch go through one `DSparkDrafter.forward_blocks` pass.

Losses (docs/dspark.md §6.2, as DeepSpec's `loss.py`), each a weighted mean Σ w·ℓ / Σ w with w_k = exp(−k/4) on
supervised slots (k = 0..γ−1; the code's decay constant 4, not the paper's γ):
  dspark  0.1·CE(x*) + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(σ(z_k), clamp(1 − ½‖p_d − p_t‖₁, 0, 1).detach())
          with p_d the bias-corrected (Markov) draft distribution, teacher-forced prefixes, T = 1
  dflash  CE only (markov_rank 0, no confidence head)

Optimisation: `common.run_training` — AdamW (wd 0), 4 % warmup + cosine, clip 1.0, fp32 master
weights, bf16 autocast where it is faster (`common.training_autocast`: CUDA, and CPUs with bf16
matrix units, measured), checkpoints and resume. The target's embedding and lm_head are
used frozen and never saved. Output: a "dspark" / "dflash" checkpoint (`save_drafter`), read by
`load_dspark_drafter(path, target)`.

Budget keys read here (defaults in brackets): draft_layers [2], block_size [7], markov_rank [64],
anchors per sequence [32], val_fraction [0.05], draft_vocab [0 = all; V_d > 0 = the V_d most
frequent response tokens of the training split, see DSparkArgs], plus the loop's steps /
batch_size / lr / ... .
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specbench.drafters.dspark import KINDS, DSparkArgs, DSparkDrafter, build_drafter, load_dspark_drafter
from specbench.train.common import (CURVE_FILE, LoopConfig, TrainResult, attach_target_stats, plot_loss_curve,
                                    run_training, save_drafter, training_autocast, vocab_rank, warm_start,
                                    warm_start_line)

__all__ = ["train", "load_dspark_drafter", "sample_anchors", "make_blocks", "block_loss"]

LOSS_WEIGHTS = {"dspark": {"ce": 0.1, "l1": 0.9, "conf": 1.0}, "dflash": {"ce": 1.0, "l1": 0.0, "conf": 0.0}}
DECAY = 4.0  # w_k = exp(−k / DECAY), DeepSpec's loss_decay_gamma (docs/dspark.md §6.2)
DEFAULTS = {"draft_layers": 2, "block_size": 7, "markov_rank": 64, "anchors": 32, "val_fraction": 0.05, "draft_vocab": 0,
            "qk_norm": None}  # qk_norm None: the target's layers; True: q/k norms (Qwen3 layout: DeepSpec, vLLM)
FIELDS = ("input_ids", "loss_mask", "taps", "last_hidden")
TARGET_STATS = ("target_lse", "target_argmax")  # per-token, from common.attach_target_stats


# ---------------------------------------------------------------------------------------------
# Training blocks (docs/dspark.md §6.1)


def sample_anchors(loss_mask: Tensor, length: int, n: int, generator: torch.Generator) -> Tensor:
    """Up to n anchor positions of one sequence (sorted): p < length−1 with loss_mask[p] and
    loss_mask[p+1], uniform without replacement (DeepSpec `sample_anchor_positions`)."""
    m = loss_mask[:length].bool().cpu()
    valid = (m[:-1] & m[1:]).nonzero().flatten()
    if len(valid) > n:
        valid = valid[torch.randperm(len(valid), generator=generator)[:n]]
    return valid.sort().values


def make_blocks(batch: dict[str, Tensor], n_anchors: int, block_size: int, generator: torch.Generator):
    """anchors [B, N] (padding 0), supervision mask [B, N, γ] (contiguous prefixes, False on
    padding blocks), N = the most anchors any sequence of the batch got (≤ n_anchors)."""
    lengths, loss_mask = batch["lengths"].cpu(), batch["loss_mask"].cpu().bool()
    B = len(lengths)
    per_seq = [sample_anchors(loss_mask[b], int(lengths[b]), n_anchors, generator) for b in range(B)]
    N = max(1, max(len(a) for a in per_seq))
    anchors = torch.zeros(B, N, dtype=torch.long)
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b, a in enumerate(per_seq):
        anchors[b, : len(a)] = a
        keep[b, : len(a)] = True
    T = loss_mask.shape[1]
    label_pos = anchors[:, :, None] + 1 + torch.arange(block_size)  # [B, N, γ]
    in_seq = label_pos < lengths[:, None, None]
    label_ok = loss_mask.gather(1, label_pos.clamp(max=T - 1).view(B, -1)).view(B, N, block_size)
    sup = (in_seq & label_ok & keep[:, :, None]).long().cumprod(-1).bool()
    return anchors, sup


def position_weights(block_size: int, device=None) -> Tensor:
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / DECAY)


def block_loss(drafter: DSparkDrafter, batch: dict[str, Tensor], anchors: Tensor, sup: Tensor,
               variant: str, with_stats: bool = False, autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, dict]:
    """The loss of docs/dspark.md §6.2 for one batch of blocks. batch tensors on the drafter's device.
    with_stats: also per-position acceptance estimates (teacher-forced, T = 1 and greedy).
    autocast_dtype: run the drafter's matrix products in it (`common.training_autocast`).
    With a reduced draft vocabulary and the batch's `target_lse` / `target_argmax`
    (`common.attach_target_stats`) the target's distribution is computed on the draft vocabulary
    only; without them, from its whole-vocabulary logits (the same values up to rounding)."""
    weights = LOSS_WEIGHTS[variant]
    device = drafter.device
    g = drafter.block_size
    ids, taps, last = batch["input_ids"], batch["taps"], batch["last_hidden"]
    anchors, sup = anchors.to(device), sup.to(device)
    B, N = anchors.shape
    T = ids.shape[1]
    slot = torch.arange(g, device=device)
    pos = (anchors[:, :, None] + slot).clamp(max=T - 1)  # [B, N, γ]: slot k's position p+k
    label_pos = (anchors[:, :, None] + slot + 1).clamp(max=T - 1)
    prev = ids.gather(1, pos.view(B, -1)).view(B, N, g)  # teacher-forced x_{k−1}: [x_p, x*_{p+1}, ...]
    labels = ids.gather(1, label_pos.view(B, -1)).view(B, N, g)
    w_all = position_weights(g, device).expand(B, N, g)

    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    with autocast:
        h = drafter.forward_blocks(taps, ids, anchors)  # [B, N, γ, d]
        hs, prevs = h[sup], prev[sup]  # only supervised slots reach the vocabulary projections
        logits = drafter.block_logits(hs, prevs)
        z = drafter.confidence_logits(hs, prevs) if weights["conf"] > 0 else None
    lab, w, k_idx = labels[sup], w_all[sup], slot.expand(B, N, g)[sup]
    wsum = w.sum().clamp_min(1e-8)
    logp = F.log_softmax(logits.float(), dim=-1)
    # CE on the label's draft-vocabulary index; a label outside a reduced draft vocabulary cannot
    # be drafted and carries no CE (its mass still counts in the L1 term below).
    lab_idx = drafter.token_to_draft_index(lab)
    in_vocab = (lab_idx >= 0).float()
    ce = -logp.gather(1, lab_idx.clamp_min(0)[:, None]).squeeze(1) * in_vocab
    w_ce = w * in_vocab
    wce_sum = w_ce.sum().clamp_min(1e-8)
    loss = weights["ce"] * ce.mul(w).sum() / wce_sum
    metrics = {"ce": ce.mul(w).sum() / wce_sum}
    need_target = weights["l1"] > 0 or weights["conf"] > 0 or with_stats
    if need_target:
        d = last.shape[-1]
        th = last.gather(1, pos.view(B, N * g)[:, :, None].expand(B, N * g, d)).view(B, N, g, d)[sup]
        stats = drafter.vocab_ids is not None and "target_lse" in batch
        with torch.no_grad(), autocast:
            if stats:  # p_t on the draft vocabulary: its rows of the head, the whole vocabulary's normaliser
                lse = batch["target_lse"].gather(1, pos.view(B, N * g)).view(B, N, g)[sup]
                p_t_in = (drafter.base_logits(th.to(drafter.dtype)).float() - lse[:, None]).exp()
                t_argmax = batch["target_argmax"].gather(1, pos.view(B, N * g)).view(B, N, g)[sup]
            else:
                t_logits = drafter.target_logits(th.to(drafter.dtype)).float()
                t_argmax = t_logits.argmax(-1)
                p_t_in = torch.softmax(t_logits, dim=-1)
                if drafter.vocab_ids is not None:
                    p_t_in = p_t_in[:, drafter.vocab_ids]
        # ‖p_d − p_t‖₁ = 2·TV; gradients reach the draft only. p_d is 0 outside a reduced draft
        # vocabulary: that part of the norm is p_t's mass there.
        l1 = (logp.exp() - p_t_in).abs().sum(-1)
        if drafter.vocab_ids is not None:
            l1 = l1 + (1 - p_t_in.sum(-1)).clamp_min(0)
        accept = (1 - 0.5 * l1).clamp(0, 1).detach()  # c*_k: analytic acceptance probability at T = 1
        if weights["l1"] > 0:
            l1_loss = (w * l1).sum() / wsum
            loss = loss + weights["l1"] * l1_loss
            metrics["l1"] = l1_loss
        if z is not None:
            bce = F.binary_cross_entropy_with_logits(z.float(), accept, reduction="none")
            conf_loss = (w * bce).sum() / wsum
            loss = loss + weights["conf"] * conf_loss
            metrics["conf"] = conf_loss
        metrics["accept_t1"] = (w * accept).sum() / wsum
        if with_stats:
            agree = (drafter.to_token_ids(logp.argmax(-1)) == t_argmax).float()
            for name, val in (("t1", accept), ("t0", agree)):
                sums = torch.zeros(g, device=device).index_add_(0, k_idx, val.float())
                counts = torch.zeros(g, device=device).index_add_(0, k_idx, torch.ones_like(val, dtype=torch.float32))
                metrics[f"_pos_sum_{name}"] = sums
                metrics[f"_pos_count_{name}"] = counts
    metrics["top1_label"] = (w * (drafter.to_token_ids(logp.argmax(-1)) == lab).float()).sum() / wsum
    metrics = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in metrics.items()}
    metrics["slots"] = float(sup.sum())
    return loss, metrics


def _batch(data, indices, device) -> dict[str, Tensor]:
    b = data.batch(indices, FIELDS + tuple(f for f in TARGET_STATS if f in data.attached))
    return {k: v.to(device) for k, v in b.items()}


def evaluate(drafter: DSparkDrafter, data, indices, batch_size: int, n_anchors: int, variant: str, seed: int,
             autocast_dtype: torch.dtype | None = None) -> dict:
    """Validation: slot-weighted mean losses, plus per-position acceptance estimates under teacher
    forcing (α_k at T = 1: mean of 1 − ½‖p_d − p_t‖₁; at T = 0: argmax agreement) and the τ they
    imply for a full block, τ̂ = 1 + Σ_k Π_{i≤k} α_i (an offline proxy; the suite measures real τ).
    Anchors come from a fixed generator, so every evaluation sees the same blocks."""
    gen = torch.Generator().manual_seed(seed + 7919)
    totals: dict[str, float] = {}
    pos_sum = {"t1": 0.0, "t0": 0.0}
    pos_cnt = {"t1": 0.0, "t0": 0.0}
    n = 0.0
    for j in range(0, len(indices), batch_size):
        batch = _batch(data, indices[j:j + batch_size], drafter.device)
        anchors, sup = make_blocks(batch, n_anchors, drafter.block_size, gen)
        loss, m = block_loss(drafter, batch, anchors, sup, variant, with_stats=True, autocast_dtype=autocast_dtype)
        wt = m.pop("slots")
        for name in ("t1", "t0"):
            pos_sum[name] = pos_sum[name] + m.pop(f"_pos_sum_{name}").cpu()
            pos_cnt[name] = pos_cnt[name] + m.pop(f"_pos_count_{name}").cpu()
        totals["loss"] = totals.get("loss", 0.0) + float(loss) * wt
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + float(v) * wt
        n += wt
    out = {k: v / max(n, 1.0) for k, v in totals.items()}
    for name in ("t1", "t0"):
        alpha = (pos_sum[name] / pos_cnt[name].clamp_min(1)).tolist()
        tau, survive = 1.0, 1.0
        for k, a in enumerate(alpha):
            survive *= a
            tau += survive
            out[f"alpha{k + 1}_{name}"] = a
        out[f"tau_est_{name}"] = tau
    return out


# ---------------------------------------------------------------------------------------------
# The trainer (specbench.cli.train contract)


def train(target, data, out_dir, *, budget: dict, seed: int = 0, resume: bool = False, progress: bool = True,
          policy: str = "dspark", variant: str | None = None, stop_after: int | None = None,
          init: str | None = None) -> TrainResult:
    """Train a DSpark (policy "dspark") or DFlash ("dflash") drafter for `target` (a LoadedModel)
    on `data` (a TrainingData of that target); writes the checkpoint, loss history and loss curve
    into `out_dir` and returns the TrainResult. stop_after: end early with only the resumable
    checkpoint written (see `common.run_training`). init: start from this drafter's weights
    (`common.warm_start`) instead of a random initialisation."""
    variant = variant or policy
    if variant not in KINDS:
        raise ValueError(f"variant must be one of {KINDS}, not {variant!r}")
    out_dir = Path(out_dir)
    opts = {k: budget.get(k, v) for k, v in DEFAULTS.items()}
    device = target.model.device
    args = DSparkArgs.for_target(target.model.args, tap_layers=data.tap_layers, variant=variant,
                                 n_layers=int(opts["draft_layers"]), block_size=int(opts["block_size"]),
                                 markov_rank=int(opts["markov_rank"]), draft_vocab=int(opts["draft_vocab"]),
                                 qk_norm=opts["qk_norm"])
    torch.manual_seed(seed)
    drafter = build_drafter(args, target.model, dtype=torch.float32)  # fp32 master weights
    drafter.init_weights(torch.Generator().manual_seed(seed))
    n_anchors = int(opts["anchors"])
    train_idx, val_idx = data.split(float(opts["val_fraction"]), seed)
    warm = warm_start(drafter, init, target, variant, args.to_dict()) if init else None  # its vocabulary too
    if args.draft_vocab and not warm:  # the most frequent response tokens of the training split (EAGLE-3's choice)
        drafter.set_draft_vocab(vocab_rank(data, train_idx, args.model_args.vocab_size)[: args.draft_vocab])
    amp = training_autocast(device)
    if args.draft_vocab:
        attach_target_stats(data, target.model.lm_head.weight, amp, progress=progress)
    cfg = LoopConfig.from_budget(budget, seed)

    def loss_fn(indices, generator):
        batch = _batch(data, indices, device)
        anchors, sup = make_blocks(batch, n_anchors, args.block_size, generator)
        loss, metrics = block_loss(drafter, batch, anchors, sup, variant, autocast_dtype=amp)
        metrics.pop("slots")
        return loss, metrics

    def eval_fn():
        return evaluate(drafter, data, val_idx, cfg.batch_size, n_anchors, variant, seed, autocast_dtype=amp)

    t0 = time.perf_counter()
    history, steps = run_training(drafter, loss_fn, train_idx, cfg, out_dir, resume=resume,
                                  eval_fn=eval_fn if val_idx else None, progress=progress,
                                  desc=f"train {variant}", stop_after=stop_after)
    train_s = history[-1]["elapsed_s"] if history else time.perf_counter() - t0
    last = history[-1] if history else {}
    final = {k: v for k, v in last.items() if k in ("loss", "ce", "l1", "conf", "accept_t1", "top1_label")
             or (k.startswith("val_") and ("alpha" not in k))}
    weights = LOSS_WEIGHTS[variant]
    loss_text = " + ".join(f"{weights[k]}·{name}" for k, name in (("ce", "CE"), ("l1", "L1"), ("conf", "BCE(conf)"))
                           if weights[k] > 0)
    extra = {
        "architecture": (f"{args.model_args.n_layers} draft layers (target width"
                         f"{', q/k norms' if args.model_args.qk_norm else ''}), block γ = {args.block_size}, "
                         f"taps {args.tap_layers}, Markov rank {args.markov_rank}, "
                         f"confidence head {'on' if args.confidence_head else 'off'}, learned mask embedding, "
                         f"draft vocabulary {args.draft_vocab or 'all'} tokens"),
        "loss": f"{loss_text}, position weights exp(−k/{DECAY:g}), {n_anchors} anchors / sequence",
    }
    if warm:
        extra["warm start"] = warm_start_line(warm)
    if val_idx and last:
        for name in ("t1", "t0"):
            alphas = [last.get(f"val_alpha{k + 1}_{name}") for k in range(args.block_size)]
            if None not in alphas:
                extra[f"held-out per-position acceptance estimate ({'T = 1' if name == 't1' else 'greedy'}, "
                      "teacher-forced)"] = ", ".join(f"{a:.3f}" for a in alphas)
    result = TrainResult(kind=variant, out_dir=out_dir, steps=steps, history=history, train_s=train_s,
                         n_params=drafter.num_parameters(), final=final, extra=extra)
    if steps < cfg.steps:
        return result  # interrupted on purpose: the checkpoint holds the state, no drafter yet
    summary = {
        "trainer": "specbench.train.dspark", "policy": policy, "variant": variant, "seed": seed, "steps": steps,
        "budget": budget, "options": opts, "data": data.summary(), "loss_weights": weights, "decay": DECAY,
        "final": final, "train_s": round(train_s, 1), "device": str(device), "torch": torch.__version__,
        "warm_start": warm,
    }
    save_drafter(out_dir, variant, args.to_dict(), drafter.state_dict(), target, summary)
    plot_loss_curve(history, out_dir / CURVE_FILE, title=f"{variant} drafter for {target.name}")
    return result
