"""Training the EAGLE-3-style head (docs/eagle.md §3, also the DSpark paper's Eagle3 baseline) on a
target's cached features (specbench.train.data).

Per optimiser step: `batch_size` sequences (shared deterministic order, `common.batch_indices`).
Training-time test: the head is unrolled `ttt_steps` steps on its own outputs
(`EagleHead.forward_ttt`): step i at index t sees the target's taps up to t and its own i earlier
outputs at t, and predicts x_{t+2+i}. Loss (EAGLE-3 `traineagle3`, DeepSpec's Eagle3 config):

    L = Σ_i 0.8^i · mean_{t supervised at step i} CE(p_target(· | x_{≤t+1+i}), p_head)

soft-label cross-entropy against the target's distribution p_target = softmax(lm_head(
last_hidden[t+1+i])) (recomputed from the cached final hidden state, only at supervised slots).
Slot (i, t) is supervised iff its label position t+2+i lies inside the sequence and is a response
token (loss mask). Optionally only `positions` query indices per sequence are unrolled (sampled
uniformly without replacement among supervised step-0 slots, sorted); step 0 always runs over the
whole sequence, since its keys are every later query's context. 0 = every index (EAGLE-3).

Optimisation: `common.run_training` — AdamW (wd 0), 4 % warmup + cosine, clip 1.0, fp32 master
weights, bf16 autocast where it is faster (`common.training_autocast`), checkpoints and resume. The target's embedding and lm_head are
used frozen and never saved. Output: an "eagle" checkpoint (`save_drafter`), read by
`load_eagle_head(path, target)`.

The checkpoint also records the response tokens' frequency ranking (`vocab_rank`), from which
the policy's optional reduced draft vocabulary (`draft_vocab`) is taken.

draft_vocab = V_d > 0 trains on that reduced vocabulary too (EAGLE-3 trains its head on its draft
vocabulary): the head's logits and the target's distribution are taken on the V_d most frequent
training tokens only, the CE against the target's probabilities there (so the head learns the
target's distribution conditioned on the draft vocabulary, which is what it drafts from), and the
target's probabilities come from its cached log-normaliser, p_t = exp(lm_head[vocab] · h − lse)
(`common.attach_target_stats`): a V_d-row projection per supervised slot and step instead of two
49 152-row ones. A head trained so is meant for the policy's `draft_vocab = V_d`.

Budget keys read here (defaults per budget in EAGLE_DEFAULTS, looked up by the budget's
`n_prompts`; fall back to "small"): ttt_steps, positions, val_fraction, draft_vocab, plus the
loop's keys.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specbench.drafters.eagle import KIND, EagleArgs, EagleHead, build_head, load_eagle_head
from specbench.train.common import (BUDGETS, CURVE_FILE, LoopConfig, TrainResult, attach_target_stats,
                                    plot_loss_curve, run_training, save_drafter, training_autocast, vocab_rank,
                                    warm_start, warm_start_line)

__all__ = ["train", "load_eagle_head", "ttt_loss", "evaluate", "options"]

STEP_DECAY = 0.8  # weight of TTT step i: 0.8^i
EAGLE_DEFAULTS = {
    "tiny": {"ttt_steps": 3, "positions": 0, "val_fraction": 0.125, "draft_vocab": 0},
    "small": {"ttt_steps": 5, "positions": 48, "val_fraction": 0.05, "draft_vocab": 0},
    "full": {"ttt_steps": 7, "positions": 0, "val_fraction": 0.03, "draft_vocab": 0},
}
FIELDS = ("input_ids", "loss_mask", "taps", "last_hidden")
TARGET_STATS = ("target_lse", "target_argmax")  # per-token, from common.attach_target_stats


def options(budget: dict) -> dict:
    """This trainer's options: the budget's own keys win, else the defaults of the named budget
    whose n_prompts the budget has (the CLI passes `get_budget(name)`), else "small"'s."""
    name = next((n for n, b in BUDGETS.items() if b["n_prompts"] == budget.get("n_prompts")), "small")
    return {k: budget.get(k, v) for k, v in EAGLE_DEFAULTS[name].items()}


def step_weights(steps: int) -> list[float]:
    return [STEP_DECAY ** i for i in range(steps)]


def supervision(batch: dict[str, Tensor], steps: int) -> Tensor:
    """[B, T, steps] bool: slot (t, i) is supervised iff label position t+2+i < length and is a
    response token."""
    lengths, loss_mask = batch["lengths"], batch["loss_mask"].bool()
    B, T = loss_mask.shape
    device = loss_mask.device
    label = torch.arange(T, device=device)[:, None] + 2 + torch.arange(steps, device=device)[None]  # [T, S]
    inside = label[None] < lengths.to(device)[:, None, None]
    ok = loss_mask.gather(1, label.clamp(max=T - 1).reshape(1, -1).expand(B, -1)).view(B, T, steps)
    return inside & ok


def sample_positions(sup0: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(query indices [B, N], keep [B, N]): up to n supervised step-0 indices per sequence
    (uniform without replacement, sorted); shortfalls are index 0 with keep False."""
    B = sup0.shape[0]
    picks = []
    for b in range(B):
        valid = sup0[b].nonzero().flatten().cpu()
        if len(valid) > n:
            valid = valid[torch.randperm(len(valid), generator=generator)[:n]].sort().values
        picks.append(valid)
    N = max(1, max(len(p) for p in picks))
    index = torch.zeros(B, N, dtype=torch.long)
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b, p in enumerate(picks):
        index[b, : len(p)] = p
        keep[b, : len(p)] = True
    return index.to(sup0.device), keep.to(sup0.device)


def ttt_loss(head: EagleHead, batch: dict[str, Tensor], steps: int, positions: int = 0,
             generator: torch.Generator | None = None, with_stats: bool = False,
             autocast_dtype: torch.dtype | None = None, vocab: Tensor | None = None) -> tuple[Tensor, dict]:
    """The weighted TTT loss of one batch (tensors on the head's device). Metrics: per-step CE,
    and the teacher-free acceptance estimates per step (α_i at T = 1: 1 − TV(p_head, p_target);
    greedy: argmax agreement) — step i's are conditional on the head's own earlier steps, as at
    inference along a chain. autocast_dtype: the matrix products' dtype (`common.training_autocast`).
    vocab: ascending token ids of a reduced draft vocabulary (module docstring), or None for all;
    with it, the batch's `target_lse` / `target_argmax` (when attached) spare the whole-vocabulary
    target projection."""
    device = head.device
    ids, taps, last = batch["input_ids"], batch["taps"], batch["last_hidden"]
    B, T = ids.shape
    sup = supervision(batch, steps)  # [B, T, S]
    if positions and positions > 0:
        q_index, keep = sample_positions(sup[..., 0], positions, generator or torch.Generator())
        sup = sup.gather(1, q_index[..., None].expand(-1, -1, steps)) & keep[..., None]
    else:
        q_index = None
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    with autocast:
        outs = head.forward_ttt(taps, ids, steps, q_index)
    index = torch.arange(T, device=device).expand(B, T) if q_index is None else q_index
    d = last.shape[-1]
    loss = torch.zeros((), device=device)
    metrics: dict = {}
    weights = step_weights(steps)
    w = head.lm_head_weight
    rows_w = None if vocab is None else w.index_select(0, vocab)  # the draft vocabulary's head rows
    stats = vocab is not None and "target_lse" in batch
    for i, h in enumerate(outs):
        s = sup[..., i]
        if not bool(s.any()):
            continue
        target_pos = (index + 1 + i).clamp(max=T - 1)[s]  # the target's hidden predicting x_{t+2+i}
        rows = torch.arange(B, device=device)[:, None].expand_as(index)[s]
        th = last[rows, target_pos]
        with autocast:
            logits = head.logits(h[s]) if vocab is None else F.linear(head.norm(h[s]), rows_w)
            with torch.no_grad():
                if stats:  # p_t on the draft vocabulary from its rows and the cached normaliser
                    t_in = F.linear(th.to(w.dtype), rows_w)
                else:
                    t_logits = F.linear(th.to(w.dtype), w)
        logq = F.log_softmax(logits.float(), dim=-1)
        if stats:
            p_t = (t_in.float() - batch["target_lse"][rows, target_pos][:, None]).exp()
            t_argmax = batch["target_argmax"][rows, target_pos]
        else:
            p_t = torch.softmax(t_logits.float(), dim=-1)
            t_argmax = p_t.argmax(-1)
            if vocab is not None:
                p_t = p_t[:, vocab]
        ce = -(p_t * logq).sum(-1).mean()
        loss = loss + weights[i] * ce
        metrics[f"ce{i}"] = ce.detach()
        if with_stats or i == 0:
            with torch.no_grad():
                # outside a reduced vocabulary the head's probability is 0: TV counts p_t's mass there
                tv = 0.5 * ((logq.exp() - p_t).abs().sum(-1) + (1 - p_t.sum(-1)).clamp_min(0))
                drafted = logq.argmax(-1) if vocab is None else vocab[logq.argmax(-1)]
                metrics[f"acc{i}_t1"] = (1 - tv).clamp(0, 1).mean()
                metrics[f"acc{i}_t0"] = (drafted == t_argmax).float().mean()
                metrics[f"_n{i}"] = float(s.sum())
    return loss, metrics


def _batch(data, indices, device) -> dict[str, Tensor]:
    b = data.batch(indices, FIELDS + tuple(f for f in TARGET_STATS if f in data.attached))
    return {k: v.to(device) for k, v in b.items()}


@torch.no_grad()
def evaluate(head: EagleHead, data, indices, batch_size: int, steps: int, positions: int = 0, seed: int = 0,
             autocast_dtype: torch.dtype | None = None, vocab: Tensor | None = None) -> dict:
    """Validation on held-out sequences (every index, or `positions` per sequence drawn from a
    fixed generator, so every evaluation sees the same slots): mean batch loss, slot-weighted
    per-step CE / acceptance estimates, and τ̂ = 1 + Σ_k Π_{i≤k} α_i for a chain of `steps` drafts
    (an offline proxy; the suite measures real τ)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    loss_sum, loss_n = 0.0, 0
    for j in range(0, len(indices), batch_size):
        batch = _batch(data, indices[j:j + batch_size], head.device)
        loss, m = ttt_loss(head, batch, steps, positions, gen, with_stats=True, autocast_dtype=autocast_dtype,
                           vocab=vocab)
        loss_sum += float(loss)
        loss_n += 1
        for i in range(steps):
            n = m.pop(f"_n{i}", 0.0)
            for key in (f"ce{i}", f"acc{i}_t1", f"acc{i}_t0"):
                if key in m:
                    sums[key] = sums.get(key, 0.0) + float(m[key]) * n
                    counts[key] = counts.get(key, 0.0) + n
    out = {"loss": loss_sum / max(loss_n, 1)}
    out.update({k: sums[k] / max(counts[k], 1.0) for k in sums})
    for name in ("t1", "t0"):
        tau, survive = 1.0, 1.0
        for i in range(steps):
            survive *= out.get(f"acc{i}_{name}", 0.0)
            tau += survive
        out[f"tau_est_{name}"] = tau
    return out


def train(target, data, out_dir, *, budget: dict, seed: int = 0, resume: bool = False, progress: bool = True,
          policy: str = "eagle", stop_after: int | None = None, init: str | None = None) -> TrainResult:
    """Train an EAGLE head for `target` (a LoadedModel) on `data` (a TrainingData of that target);
    writes the checkpoint, loss history and loss curve into `out_dir` and returns the TrainResult.
    stop_after: end early with only the resumable checkpoint written (`common.run_training`).
    init: start from this head's weights and vocabulary ranking (`common.warm_start`)."""
    out_dir = Path(out_dir)
    opts = options(budget)
    steps, positions = int(opts["ttt_steps"]), int(opts["positions"])
    device = target.model.device
    args = EagleArgs.for_target(target.model.args, data.tap_layers)
    n_vocab = int(opts["draft_vocab"])
    args.trained_vocab = n_vocab if 0 < n_vocab < args.model_args.vocab_size else 0
    torch.manual_seed(seed)
    head = build_head(args, target.model, dtype=torch.float32)  # fp32 master weights
    head.init_weights(torch.Generator().manual_seed(seed))
    train_idx, val_idx = data.split(float(opts["val_fraction"]), seed)
    warm = warm_start(head, init, target, KIND, args.to_dict()) if init else None  # its vocab_rank too
    if not warm:
        head.vocab_rank.copy_(vocab_rank(data, train_idx, args.model_args.vocab_size))
    cfg = LoopConfig.from_budget(budget, seed)
    amp = training_autocast(device)
    vocab = None
    if args.trained_vocab:  # the ids the policy will draft from
        vocab = head.draft_vocab(args.trained_vocab)[0]
        attach_target_stats(data, target.model.lm_head.weight, amp, progress=progress)

    def loss_fn(indices, generator):
        loss, metrics = ttt_loss(head, _batch(data, indices, device), steps, positions, generator, autocast_dtype=amp,
                                 vocab=vocab)
        return loss, {k: v for k, v in metrics.items() if not k.startswith("_")}

    def eval_fn():
        return evaluate(head, data, val_idx, cfg.batch_size, steps, positions, seed, autocast_dtype=amp, vocab=vocab)

    t0 = time.perf_counter()
    history, done = run_training(head, loss_fn, train_idx, cfg, out_dir, resume=resume,
                                 eval_fn=eval_fn if val_idx else None, progress=progress,
                                 desc="train eagle", stop_after=stop_after)
    train_s = history[-1]["elapsed_s"] if history else time.perf_counter() - t0
    last = history[-1] if history else {}
    final = {k: v for k, v in last.items() if k in ("loss", "ce0", "acc0_t1", "acc0_t0")
             or k in ("val_loss", "val_tau_est_t1", "val_tau_est_t0")}
    extra = {
        "architecture": (f"EAGLE-3-style head: fc ({len(args.tap_layers)}·d → d) over taps {args.tap_layers}, "
                         "1 decoder layer (target-shaped, q/k/v over [norm(emb); norm(hidden)]), "
                         "target's frozen embedding and lm_head"),
        "loss": (f"training-time test, {steps} steps, soft-label CE to the target distribution, step weights "
                 f"{STEP_DECAY}^i; {'all' if not positions else positions} query positions / sequence; "
                 + (f"on the {n_vocab}-token draft vocabulary (the policy's default draft_vocab = -1 drafts "
                    f"from it; draft_vocab = {n_vocab} names it)" if vocab is not None else "whole vocabulary")),
    }
    if warm:
        extra["warm start"] = warm_start_line(warm)
    if val_idx and last:
        for name in ("t1", "t0"):
            acc = [last.get(f"val_acc{i}_{name}") for i in range(steps)]
            if None not in acc:
                extra[f"held-out per-step acceptance estimate ({'T = 1' if name == 't1' else 'greedy'}, "
                      "own features)"] = ", ".join(f"{a:.3f}" for a in acc)
    result = TrainResult(kind=KIND, out_dir=out_dir, steps=done, history=history, train_s=train_s,
                         n_params=head.num_parameters(), final=final, extra=extra)
    if done < cfg.steps:
        return result  # interrupted on purpose: the checkpoint holds the state, no drafter yet
    summary = {
        "trainer": "specbench.train.eagle", "policy": policy, "seed": seed, "steps": done, "budget": budget,
        "options": opts, "data": data.summary(), "step_decay": STEP_DECAY, "final": final,
        "train_s": round(train_s, 1), "device": str(device), "torch": torch.__version__, "warm_start": warm,
    }
    save_drafter(out_dir, KIND, args.to_dict(), head.state_dict(), target, summary)
    plot_loss_curve(history, out_dir / CURVE_FILE, title=f"EAGLE head for {target.name}")
    return result
