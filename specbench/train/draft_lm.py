"""The fixed-K draft LM: a few-layer Transformer sharing the target's frozen embedding and lm_head,
distilled from the target (Leviathan et al. 2023 / DistillSpec-style).

Architecture: the target's own ModelArgs with fewer layers (width must match: the embedding and
output head are the target's). Layer j is initialised from target layer round(j·(L−1)/(n−1))
(evenly spaced; n = 1 takes layer 0; budget key lm_init = "first" takes layers 0..n−1
instead), the final norm from the target's. Budget keys read here: lm_layers, lm_init,
ce_weight, kl_weight, lm_positions, val_fraction, plus the loop's (steps, batch_size, lr, ...).

Loss, on every position t whose next token t+1 is a response token (loss_mask[t+1] = 1):
    ce_weight · CE(draft logits_t, x_{t+1})                  x = the target-generated token
  + kl_weight · KL(p_target,t ‖ p_draft,t)                     both at temperature 1
where the target's logits are recomputed as lm_head(last_hidden[t]) from the feature cache.
lm_positions = n > 0 keeps only n of those positions per sequence, drawn uniformly without
replacement (validation draws them from a fixed seed): the two full-vocabulary softmaxes, not the
few-layer forward, are most of a step's cost (5.5 s a step of 8 corpus sequences, ~1 900 positions,
on one CPU thread), so fewer positions per sequence buy more sequences for the same time.

Output: a `draft-lm` checkpoint (`specbench.drafters.checkpoints.load_draft_lm(path, target)` loads it).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specbench.engine.model import ModelArgs, Transformer, apply_rope, rope_cos_sin, rope_inv_freq
from specbench.train.common import (CURVE_FILE, LoopConfig, TrainResult, plot_loss_curve, run_training,
                                    save_drafter, vocab_rank, warm_start, warm_start_line)
from specbench.train.data import TrainingData

KIND = "draft-lm"
CE_WEIGHT = 0.5
KL_WEIGHT = 1.0


def draft_layer_ids(n_target: int, n_draft: int, init: str = "spaced") -> list[int]:
    """Target layers the draft's layers start from: "spaced" (evenly, first and last included) or
    "first" (the target's first n_draft layers, i.e. the `truncate:N` drafter)."""
    if not 1 <= n_draft <= n_target:
        raise ValueError(f"draft layers must be between 1 and {n_target}")
    if init == "first" or n_draft == 1:
        return list(range(n_draft))
    if init != "spaced":
        raise ValueError(f"draft init {init!r}: expected 'spaced' or 'first'")
    return [round(j * (n_target - 1) / (n_draft - 1)) for j in range(n_draft)]


def init_draft_lm(target: Transformer, n_layers: int, init: str = "spaced") -> Transformer:
    """A draft LM whose layers (fp32, trainable) copy target layers `draft_layer_ids(..., init)` and
    whose embedding and lm_head are the target's own tensors (frozen, shared, not copied)."""
    args = ModelArgs(**{**target.args.to_dict(), "n_layers": n_layers})
    src = target.state_dict()
    state = {}
    for j, i in enumerate(draft_layer_ids(target.args.n_layers, n_layers, init)):
        prefix = f"model.layers.{i}."
        for k, v in src.items():
            if k.startswith(prefix):
                state[f"model.layers.{j}.{k[len(prefix):]}"] = v.detach().float().clone()
    state["model.norm.weight"] = src["model.norm.weight"].detach().float().clone()
    state["model.embed_tokens.weight"] = target.model.embed_tokens.weight
    state["lm_head.weight"] = target.lm_head.weight
    with torch.device("meta"):
        draft = Transformer(args)
    draft.load_state_dict(state, assign=True, strict=True)
    draft.inv_freq = rope_inv_freq(args).to(target.device)
    for name, p in draft.named_parameters():
        p.requires_grad_(name not in ("model.embed_tokens.weight", "lm_head.weight"))
    return draft


def causal_forward(model: Transformer, tokens: Tensor) -> Tensor:
    """Training forward without a KV cache: [B, T] tokens (right-padded) → final normed hidden
    [B, T, d], causal attention from position 0. Same math as `Transformer.forward` over a fresh cache."""
    b, t = tokens.shape
    x = model.model.embed_tokens(tokens)
    positions = torch.arange(t, device=tokens.device)[None].expand(b, t)
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        nh, nkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
        q = attn.q_proj(h).view(b, t, nh, hd)
        k = attn.k_proj(h).view(b, t, nkv, hd)
        v = attn.v_proj(h).view(b, t, nkv, hd)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if nh != nkv:
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x)


def keep_positions(sup: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """sup [B, T] bool -> the same mask keeping at most n True entries per row, uniformly without
    replacement (n <= 0 keeps all)."""
    if n <= 0:
        return sup
    scores = torch.rand(sup.shape, generator=generator).to(sup.device)
    scores = scores.masked_fill(~sup, -1.0)
    k = min(n, sup.shape[1])
    kth = scores.topk(k, dim=1).values[:, -1:]  # each row's k-th largest score
    return sup & (scores >= kth)


def distill_loss(draft: Transformer, batch: dict[str, Tensor], ce_weight: float = CE_WEIGHT,
                 kl_weight: float = KL_WEIGHT, positions: int = 0,
                 generator: torch.Generator | None = None) -> tuple[Tensor, dict]:
    """batch: TrainingData.batch(..., ("input_ids", "loss_mask", "last_hidden")) on the draft's device.
    positions > 0: the loss over at most that many supervised positions per sequence (`keep_positions`)."""
    ids, mask, last = batch["input_ids"], batch["loss_mask"], batch["last_hidden"]
    device = ids.device
    head = draft.lm_head.weight
    sup = mask[:, 1:]
    if positions > 0:
        sup = keep_positions(sup, positions, generator if generator is not None else torch.Generator())
    # fp32 master weights; a half-precision target (bf16 on GPU) means autocast to its dtype.
    half = head.dtype in (torch.bfloat16, torch.float16)
    autocast = torch.autocast(device.type, dtype=head.dtype) if half else nullcontext()
    with autocast:
        hidden = causal_forward(draft, ids)
        logits = F.linear(hidden[:, :-1][sup], head)
    with torch.no_grad():
        t_logits = F.linear(last[:, :-1][sup].to(head.dtype), head).float()
        logq = F.log_softmax(t_logits, dim=-1)
    logp = F.log_softmax(logits.float(), dim=-1)
    labels = ids[:, 1:][sup]
    ce = F.nll_loss(logp, labels)
    kl = (logq.exp() * (logq - logp)).sum(-1).mean()
    loss = ce_weight * ce + kl_weight * kl
    with torch.no_grad():
        agree = (logp.argmax(-1) == logq.argmax(-1)).float().mean()
    return loss, {"ce": ce.detach(), "kl": kl.detach(), "top1_agree": agree, "tokens": float(labels.numel())}


def evaluate(draft: Transformer, data: TrainingData, indices, batch_size: int, device, positions: int = 0,
             seed: int = 0) -> dict:
    """Token-weighted mean loss / CE / KL / top-1 agreement over `indices` (with positions > 0, over
    positions drawn from a fixed generator, so every evaluation sees the same ones)."""
    totals = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "top1_agree": 0.0}
    n = 0.0
    gen = torch.Generator().manual_seed(seed + 1)
    for j in range(0, len(indices), batch_size):
        batch = _batch(data, indices[j:j + batch_size], device)
        loss, m = distill_loss(draft, batch, positions=positions, generator=gen)
        w = m["tokens"]
        totals["loss"] += float(loss) * w
        for k in ("ce", "kl", "top1_agree"):
            totals[k] += float(m[k]) * w
        n += w
    return {k: v / max(n, 1.0) for k, v in totals.items()}


def _batch(data: TrainingData, indices, device) -> dict[str, Tensor]:
    b = data.batch(indices, ("input_ids", "loss_mask", "last_hidden"))
    return {k: b[k].to(device) for k in ("input_ids", "loss_mask", "last_hidden")}


def train(target, data: TrainingData, out_dir, *, budget: dict, seed: int = 0, resume: bool = False,
          progress: bool = True, policy: str = "fixed-k", stop_after: int | None = None,
          init: str | None = None) -> TrainResult:
    """Distil a draft LM for `target` from `data`; writes a draft-lm checkpoint, loss history and
    loss curve into `out_dir`. stop_after: see `run_training` (the checkpoint is then not written).
    init: start from this draft LM's weights instead of the target's layers (`common.warm_start`)."""
    out_dir = Path(out_dir)
    device = target.model.device
    n_layers = int(budget.get("lm_layers", 2))
    init_layers_from = str(budget.get("lm_init", "spaced"))
    init_layers = draft_layer_ids(target.model.args.n_layers, n_layers, init_layers_from)
    ce_w, kl_w = float(budget.get("ce_weight", CE_WEIGHT)), float(budget.get("kl_weight", KL_WEIGHT))
    positions = int(budget.get("lm_positions", 0))
    torch.manual_seed(seed)
    draft = init_draft_lm(target.model, n_layers, init_layers_from)
    warm = warm_start(draft, init, target, KIND, draft.args.to_dict()) if init else None
    # A continued run keeps its init's token ranking, as the EAGLE and DSpark warm starts keep their draft
    # vocabularies: continuing on a narrower corpus (e.g. code only) must not re-rank the tokens the
    # policy drafts from by that corpus alone. The ranking is not used by the loss.
    init_rank = None
    if init:
        from specbench.drafters.checkpoints import read_checkpoint  # as common.warm_start imports it
        init_rank = read_checkpoint(init, target, kind=KIND)[1].get("vocab_rank")
    train_idx, val_idx = data.split(budget.get("val_fraction", 0.05), seed)
    cfg = LoopConfig.from_budget(budget, seed)

    def loss_fn(indices, generator):
        return distill_loss(draft, _batch(data, indices, device), ce_w, kl_w, positions, generator)

    eval_fn = ((lambda: evaluate(draft, data, val_idx, cfg.batch_size, device, positions, seed))
               if val_idx else None)
    t0 = time.perf_counter()
    history, steps = run_training(draft, loss_fn, train_idx, cfg, out_dir, resume=resume, eval_fn=eval_fn,
                                  progress=progress, desc=f"train {policy}", stop_after=stop_after)
    train_s = history[-1]["elapsed_s"] if history else time.perf_counter() - t0
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    final = {k: v for k, v in (history[-1] if history else {}).items()
             if k in ("loss", "ce", "kl", "top1_agree", "val_loss", "val_ce", "val_kl", "val_top1_agree")}
    result = TrainResult(kind=KIND, out_dir=out_dir, steps=steps, history=history, train_s=train_s,
                         n_params=n_params, final=final,
                         extra={"draft layers (init from target layers)":
                                f"{n_layers} ({init_layers})",
                                "loss": f"{ce_w}·CE + {kl_w}·KL(target‖draft)" + (
                                    f", {positions} positions / sequence" if positions > 0 else ""),
                                **({"warm start": warm_start_line(warm)} if warm else {})})
    if steps < cfg.steps:
        return result  # interrupted on purpose: the checkpoint holds the state, no drafter yet
    summary = {
        "trainer": "specbench.train.draft_lm", "policy": policy, "seed": seed, "steps": steps,
        "budget": budget, "data": data.summary(), "init_layers": init_layers,
        "loss": {"ce_weight": ce_w, "kl_weight": kl_w, "positions": positions}, "final": final, "train_s": round(train_s, 1),
        "device": str(device), "torch": torch.__version__, "warm_start": warm,
    }
    # The response tokens' frequency ranking of the training split (or the init's): the fixed-K policy's
    # reduced draft vocabulary (`draft_vocab = n`) is its first n tokens.
    rank = init_rank if init_rank is not None else vocab_rank(data, train_idx, draft.args.vocab_size)
    state = {**draft.state_dict(), "vocab_rank": rank}
    save_drafter(out_dir, KIND, draft.args.to_dict(), state, target, summary)
    plot_loss_curve(history, out_dir / CURVE_FILE, title=f"{policy} draft LM for {target.name}")
    return result
