"""DSpark (Cheng et al., DeepSeek 2026): semi-autoregressive drafting + confidence-scheduled,
load-aware verification. Also DFlash (its parallel backbone alone) as the same policy class
without a confidence head.

Per round (docs/dspark.md §4, §5):
  propose   the drafter's parallel backbone drafts a γ-block per row from the target features of
            the committed prefix (persistent draft context cache), the Markov head samples it left
            to right from the exact bias-corrected distributions; the confidence head scores each
            position (conditional acceptance, computed from x_{<k} only), calibrated by the STS
            temperatures stored with the drafter;
  schedule  per-row verify lengths ℓ_r from a scheduler (specbench/policies/scheduler.py): fixed ℓ = γ,
            the repo's static threshold, Algorithm 1 (global greedy by prefix survival maximising
            E[tokens]·SPS(B) on this device's measured cost profile, with the early stop that keeps
            it lossless), or the production capacity variant (K from confidences two rounds old);
  observe   the target features of [anchor, accepted drafts] join the draft context.

Draft gate (specbench's addition, `draft_gate`, on by default with the cost-model schedulers):
the paper's step always runs the drafter, and Algorithm 1 can only cut the verify side. On a
device where one drafting round costs a good part of a target step (a 135M target on a CPU:
γ slots through the 49k-vocabulary head), that floor alone keeps DSpark below AR at high load.
So after every drafted round the policy asks, with that round's confidences and the same cost
profile, whether drafting paid: for the lengths ℓ the scheduler would verify (Algorithm 1 with its
early stop; the capacity variant's whole path), E[tokens] / (draft(b) + step(b, 1 + max ℓ)) against
rows / step(b, 1). If not, the next rounds
skip the drafter (plain decode steps, ℓ = 0 for every row) and probe again after 1, 2, 4 … 64
skipped rounds. A new batch probes at once, but starts from the back-off that the policy's last
batch of the same size ended with: where drafting does not pay at a load, each batch then pays for
one or two probes instead of six in 64 rounds (what kept `dspark` 5.7% below AR at b = 16 on chat,
docs/performance.md). The decision uses confidences of earlier rounds only, never the current drafts,
so it is lossless for the same reason as the production variant's stale capacity (docs/dspark.md §4.6, §4.4).
While rounds are skipped, their target features wait and join the draft context in one append
when drafting resumes (only a drafted round reads the context): a skipped round then costs what
an `ar` step costs, plus keeping the features.

Lookup drafts (specbench's addition, `lookup_ngram = n`, off by default): before drafting, look up
each active row's last n..max(n, 3) tokens earlier in its prompt + output (prompt lookup,
specbench/policies/pld.py). A row that finds a match drafts the `lookup_k` tokens that followed it
instead of its drafted block. When every active row finds one, or the draft gate skips the round, the
drafter does not run at all. With Algorithm 1 a lookup draft is scheduled with the drafted rows, its
per-position confidence the acceptance rate of lookup drafts at that position in earlier rounds (a
Beta(1, 1) prior); with the other schedulers it is verified whole. The draft gate judges the drafter
by the rows that use its drafts. On a 2-core CPU, where a drafting round is a good part of a target step
and DSpark's drafter is weak, such free drafts pay on code and chat alike (docs/performance.md
"Session 27"). Which rows take a lookup draft depends only on committed tokens, and a lookup draft is
deterministic (one-hot), so verification stays exact. The features of a round without a drafter call
wait for the next drafted round, as a skipped round's do. Where Algorithm 1 admits none of the lookup
drafts of a round without a drafter call (at b = 16 on the 2-core CPU it never does), the policy stops
looking up for 1, 2, 4 … 64 rounds, as the draft gate backs off, so a batch that cannot use lookup drafts
does not pay for finding them every round; whether a row takes one still depends only on committed tokens
and earlier rounds.
"""
from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from specbench.policies.calibration import nearest_fit
from specbench.engine.model import round_to_bucket
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.policies.pld import check_lookup_settings, find_lookups, lookup_indexes, lookup_params, with_lookup_drafts
from specbench.policies.scheduler import (algorithm1_admit, algorithm1_lengths, best_capacity, capacity_lengths,
                                          fixed_lengths, prefix_survival, threshold_lengths)

SCHEDULERS = ("fixed", "threshold", "algorithm1", "capacity")
MAX_BACKOFF = 64  # the draft gate probes at least once every this many rounds


class DSpark(Policy):
    name = "dspark"

    def __init__(self, draft_model, scheduler: str = "algorithm1", threshold: float = 0.5,
                 sts_temperatures: list[float] | dict[float, list[float]] | None = None, step_seconds=None, draft_seconds=None,
                 max_length: int | None = None,
                 drafter_name: str | None = None, group_size: int | None = None, draft_gate: bool = False,
                 lookup_ngram: int = 0, lookup_k: int = 4):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r} (valid: {', '.join(SCHEDULERS)})")
        if scheduler != "fixed" and draft_model.args.confidence_head is False:
            raise ValueError(f"scheduler {scheduler!r} needs a confidence head; this drafter ({draft_model.kind}) has none")
        if scheduler in ("algorithm1", "capacity") and step_seconds is None:
            raise ValueError(f"scheduler {scheduler!r} needs a cost profile")
        self.draft_model = draft_model
        self.drafter = drafter_name  # the checkpoint, recorded with every result
        self.scheduler = scheduler
        self.threshold = threshold
        self.gamma = draft_model.block_size if max_length is None else min(max_length, draft_model.block_size)
        check_lookup_settings(lookup_ngram, lookup_k)
        self.lookup_ngram, self.lookup_k = lookup_ngram, lookup_k  # module docstring, "Lookup drafts"
        # Per position j of a lookup draft: [rounds that verified it, rounds that accepted it] (observe),
        # over every batch this policy decoded: the confidence Algorithm 1 schedules lookup drafts by.
        self.lookup_outcomes = [[0, 0] for _ in range(lookup_k)]
        self.lookup_verified: dict[int, int] = {}  # this round's scheduled length of each lookup row
        self.max_draft = max(self.gamma, lookup_k if lookup_ngram else 0)
        self.lookups: dict[int, list[int]] = {}  # this round's lookup drafts by row (schedule keeps their lengths)
        # Lookup back-off (module docstring, "Lookup drafts"): rounds left without looking up, the wait after
        # the next round that admits none, and per batch size the wait its last batch ended with.
        self.lookup_skip, self.lookup_backoff = 0, 1
        self.lookup_backoff_by_rows: dict[int, int] = {}
        self.target_taps = tuple(draft_model.args.tap_layers)
        # STS temperatures, one set per sampling temperature they were fitted at (calibration.py::
        # load_sts); a plain list serves every temperature.
        if sts_temperatures is None:
            sts_temperatures = [1.0] * draft_model.block_size
        self.sts_single = not isinstance(sts_temperatures, dict)
        fits = {1.0: sts_temperatures} if self.sts_single else sts_temperatures
        self.sts_by_temperature = {float(t): torch.tensor(v, dtype=torch.float32)[: draft_model.block_size]
                                   for t, v in fits.items()}
        self.step_seconds = step_seconds  # (rows, q) → seconds of one verify forward on this device
        # rows → seconds of one drafting round (paid whatever ℓ is), from the same stored profile so
        # that decisions are a deterministic function of the drafts and the profile.
        self.draft_seconds = draft_seconds or (lambda rows: 0.0)
        self.stale_confidence: deque = deque(maxlen=3)  # this round's and the two before
        if group_size and scheduler == "capacity":
            raise ValueError("group_size is not supported with the capacity scheduler")
        self.group_size = group_size  # tests / simulation: independent scheduling groups within a batch
        if draft_gate and step_seconds is None:
            raise ValueError("draft_gate needs a cost profile")
        # The draft gate (module docstring): one object, driven the same way by propose() here and
        # by the concurrency simulator (specbench/analysis/simulate.py) on replayed confidences.
        self.gate = (DraftGate(self.gamma, step_seconds, self.draft_seconds, early_stop=scheduler != "capacity")
                     if draft_gate else None)

    def decoding(self):
        pinned = getattr(self.draft_model, "round_routes_pinned", None)  # test stubs have none
        return pinned() if pinned is not None else super().decoding()

    def params(self) -> dict:
        return {"scheduler": self.scheduler, "gamma": self.gamma, "threshold": self.threshold,
                "sts": self._sts_params(), "draft_gate": self.gate is not None,
                "draft_vocab": getattr(self.draft_model, "draft_vocab_size", None),
                "block": getattr(self.draft_model, "block_cut", 0),
                **lookup_params(self.lookup_ngram, self.lookup_k)}

    def _sts_params(self) -> list | dict:
        rounded = {t: [round(float(x), 3) for x in v] for t, v in self.sts_by_temperature.items()}
        return next(iter(rounded.values())) if self.sts_single else {f"{t:g}": v for t, v in sorted(rounded.items())}

    def sts_temperatures(self, temperature: float) -> Tensor:
        """The STS temperatures for requests sampled at `temperature` (the nearest fit)."""
        return self.sts_by_temperature[nearest_fit(list(self.sts_by_temperature), temperature)]

    def begin(self, state: BatchState, prompt_features: Tensor | None) -> None:
        b, cap = state.tokens.shape
        self.draft_model.setup_cache(b, round_to_bucket(cap + 1))
        # The draft context holds each row's committed prefix before its anchor: the prompt.
        self.draft_model.append_context(prompt_features.to(self.draft_model.dtype), counts=state.prompt_lengths)
        self.stale_confidence.clear()
        self.lookup_indexes = lookup_indexes(self.lookup_ngram, b)
        self.lookup_skip, self.lookup_backoff = 0, self.lookup_backoff_by_rows.get(b, 1)
        # Target features of committed tokens not yet in the draft context: only a drafted round reads
        # the context, so the next drafting round appends them (the last round's, and those of rounds
        # the draft gate skipped, in one call: _pending_features).
        self.pending_context: list[tuple[Tensor, Tensor]] = []
        self._admitted = None  # (confidence, active rows, Algorithm 1's lengths) of the last gated round
        # The batch's temperature is fixed for its life: pick its STS fit and move it once, not per round.
        self.batch_sts = self.sts_temperatures(state.temperature)[: self.gamma].to(state.tokens.device)
        if self.gate is not None:
            self.gate.reset()

    @torch.inference_mode()
    def propose(self, state: BatchState) -> Draft | None:
        active = state.active.tolist()
        self.lookups = self._lookups(state)  # row -> lookup draft (module docstring, "Lookup drafts")
        if self.lookups and len(self.lookups) == sum(active):  # every active row has one: no drafter call
            return with_lookup_drafts(None, self.lookups, state, self.lookup_k)
        if self.gate is not None and self.gate.skip():  # a plain decode step, bar the rows with a lookup draft
            return with_lookup_drafts(None, self.lookups, state, self.lookup_k) if self.lookups else None
        features, counts = self._pending_features()
        anchors = state.tokens.gather(1, (state.lengths - 1)[:, None])[:, 0]
        # The context append and the block in one call (draft_round): the committed tokens' features
        # join the context just before the drafter reads it.
        tokens, probs, conf_logits = self.draft_model.draft_round(features, counts, anchors, state.temperature,
                                                                  state.top_p, state.generator,
                                                                  with_probs=state.temperature > 0)
        tokens = tokens[:, : self.gamma]
        probs = probs[:, : self.gamma] if probs is not None else None
        confidence = raw = None
        if conf_logits is not None:
            raw = conf_logits[:, : self.gamma].float()  # the core records them for STS calibration
            confidence = torch.sigmoid(raw / self.batch_sts)
            if self.gate is not None:
                # Judged by the rows that take the drafter's block (lookup rows verify their own draft).
                judged = [on and r not in self.lookups for r, on in enumerate(active)]
                admitted = self.gate.update(confidence, judged)
                # What Algorithm 1 admits for these confidences, rows and lengths (the gate's own
                # question); _schedule takes it instead of running the same search again.
                self._admitted = (confidence, judged, admitted)
        lengths = torch.full((state.batch_size,), self.gamma, dtype=torch.long, device=tokens.device)
        # At temperature 0 both sides are one-hot: the tokens alone decide (no probs drafted).
        draft = Draft(tokens=tokens, probs=probs, lengths=lengths, confidence=confidence, confidence_logits=raw)
        return with_lookup_drafts(draft, self.lookups, state, self.lookup_k) if self.lookups else draft

    def _lookups(self, state: BatchState) -> dict[int, list[int]]:
        if not self.lookup_ngram:
            return {}
        if self.lookup_skip > 0:  # backing off: Algorithm 1 admitted no lookup draft lately at this load
            self.lookup_skip -= 1
            return {}
        return find_lookups(self.lookup_indexes, state, self.lookup_k)

    def _sps(self, b: int, n: int):
        return rounds_per_second(self.step_seconds, self.draft_seconds, b, n)

    def schedule(self, draft: Draft, state: BatchState) -> Tensor:
        if not self.lookups:
            self.lookup_verified = {}
            return self._schedule_drafted(draft, state)
        rows = sorted(self.lookups)
        if self.scheduler == "algorithm1":
            size = self.group_size or state.batch_size  # scheduling groups, as _schedule_drafted
            active, survival = state.active.tolist(), self.lookup_survival()
            parts = [self._schedule_with_lookups(draft, active, survival, range(start, min(start + size, state.batch_size)))
                     for start in range(0, state.batch_size, size)]
            lengths = torch.cat(parts)
        elif draft.confidence is None:  # no drafter call this round: the lookup rows verify their drafts whole
            lengths = draft.lengths * state.active
        else:  # the scheduler sees every row's drafted block (its confidences are the block's)
            drafted = Draft(tokens=draft.tokens[:, : self.gamma], probs=None, lengths=draft.lengths.clamp(max=self.gamma),
                            confidence=draft.confidence)
            lengths = self._schedule_drafted(drafted, state)
            lengths[rows] = draft.lengths[rows]
            lengths = lengths * state.active
        verified = lengths.tolist()
        self.lookup_verified = {r: verified[r] for r in rows}
        if self.scheduler == "algorithm1" and draft.confidence is None:
            self._lookup_back_off(admitted=any(verified[r] for r in rows), batch_size=state.batch_size)
        return lengths

    def _lookup_back_off(self, admitted: bool, batch_size: int) -> None:
        """After a round without a drafter call: where Algorithm 1 admitted none of its lookup drafts (their
        acceptance so far does not pay for a longer verify at this load), skip the lookup for the next
        1, 2, 4 … MAX_BACKOFF rounds, as the draft gate backs off; reset where it admitted one."""
        if admitted:
            self.lookup_backoff = 1
        else:
            self.lookup_skip = self.lookup_backoff
            self.lookup_backoff = min(2 * self.lookup_backoff, MAX_BACKOFF)
        self.lookup_backoff_by_rows[batch_size] = self.lookup_backoff

    def lookup_survival(self) -> list[float]:
        """Prefix survival of a lookup draft, position by position, from earlier rounds' outcomes."""
        survival, alive = [], 1.0
        for verified, accepted in self.lookup_outcomes:
            alive *= (accepted + 1) / (verified + 2)
            survival.append(alive)
        return survival

    def _schedule_with_lookups(self, draft: Draft, active: list[bool], lookup_survival: list[float],
                               group: range) -> Tensor:
        """Algorithm 1 over one scheduling group's drafted and lookup rows together (the group's lengths).
        A lookup row's confidences come from earlier rounds' outcomes (lookup_survival), never from its
        current draft, so the early stop keeps the search lossless as for drafted rows (docs/dspark.md §4.3)."""
        on = [r for r in group if active[r]]
        drafted = draft.confidence is not None
        block = prefix_survival(draft.confidence[group.start : group.stop].float()).tolist() if drafted else None
        survival, limits = [], []
        for r in on:
            if r in self.lookups:
                survival.append(lookup_survival)
                limits.append(len(self.lookups[r]))
            else:
                survival.append(block[r - group.start] if drafted else [])
                limits.append(self.gamma if drafted else 0)
        lengths = [0] * len(group)
        if on:
            draft_seconds = self.draft_seconds if drafted else (lambda rows: 0.0)
            sps = rounds_per_second(self.step_seconds, draft_seconds, len(group), len(on))
            admitted, _ = algorithm1_admit(survival, limits, sps, early_stop=True, padded=True)
            for r, length in zip(on, admitted):
                lengths[r - group.start] = length
        return torch.tensor(lengths, dtype=draft.lengths.dtype, device=draft.lengths.device)

    def _schedule_drafted(self, draft: Draft, state: BatchState) -> Tensor:
        if self.group_size:  # schedule consecutive groups of rows as if each were its own batch
            parts = []
            for start in range(0, state.batch_size, self.group_size):
                rows = slice(start, start + self.group_size)
                sub = Draft(tokens=draft.tokens[rows], probs=None, lengths=draft.lengths[rows],
                            confidence=draft.confidence[rows] if draft.confidence is not None else None)
                parts.append(self._schedule(sub, state.active[rows]))
            return torch.cat(parts)
        return self._schedule(draft, state.active)

    def _schedule(self, draft: Draft, active_mask: Tensor) -> Tensor:
        known = getattr(self, "_admitted", None) if self.scheduler == "algorithm1" else None
        if known is not None and draft.confidence is not None and known[0] is draft.confidence and known[2] is not None:
            active = active_mask.tolist()
            if known[1] == active:  # the draft gate ran this very search (same inputs) in propose()
                admitted = iter(known[2])  # its lengths, the active rows' in row order
                return torch.tensor([next(admitted) if on else 0 for on in active], dtype=draft.lengths.dtype,
                                    device=draft.lengths.device)
        lengths = draft.lengths * active_mask
        if draft.tokens.shape[1] == 0:  # a round the draft gate skipped
            return lengths
        if self.scheduler == "fixed":
            return fixed_lengths(lengths)
        conf = draft.confidence
        if self.scheduler == "threshold":
            return threshold_lengths(conf, lengths, self.threshold)
        active = active_mask.nonzero().flatten()
        rows = len(active)
        out = torch.zeros_like(lengths)
        if rows == 0:
            return out
        # The engine verifies a right-padded [b, 1 + max ℓ] batch over all b rows of the batch;
        # Algorithm 1 (padded=True) hands over B = n·(1 + max ℓ) for the n requests it schedules.
        b = len(active_mask)
        if self.scheduler == "algorithm1":
            out[active] = algorithm1_lengths(conf[active], lengths[active], self._sps(b, rows), early_stop=True, padded=True)
            return out
        # Production variant (docs/dspark.md §4.4): capacity from confidences two rounds old (a causal barrier, so
        # no early stop is needed), then a top-K over the current cumulative confidences.
        self.stale_confidence.append((conf[active].clone(), lengths[active].clone()))
        stale_conf, stale_len = self.stale_confidence[0]
        capacity = (best_capacity(stale_conf, stale_len, self._sps(b, len(stale_conf)), padded=True)
                    if len(self.stale_confidence) == 3 else 0)
        out[active] = capacity_lengths(conf[active], lengths[active], capacity)
        return out

    def observe(self, state: BatchState, accepted: Tensor, verify_features: Tensor | None) -> None:
        if self.lookup_verified:
            self._count_lookup_outcomes(state, accepted)
        # The anchor and the accepted drafts are now committed: their target features join the context.
        counts = (accepted + 1) * state.active
        width = int(counts.max()) if len(counts) else 0
        if not width:
            return
        features = verify_features[:, :width].to(self.draft_model.dtype)
        # Appended by the next drafting round (propose); a copy: a graphed forward's outputs are
        # overwritten by the next forward, and rounds the draft gate skips run forwards in between.
        self.pending_context.append((features.clone(), counts.clone()))

    def _count_lookup_outcomes(self, state: BatchState, accepted: Tensor) -> None:
        """Position j of a lookup draft was verified when the row verified ≥ j drafts and accepted the
        j − 1 before it; accepted when the row accepted ≥ j. Rows that just finished are left out: EOS or
        the token budget may have cut their round short."""
        still, taken = state.active.tolist(), accepted.tolist()
        for r, length in self.lookup_verified.items():
            if not still[r]:
                continue
            for j in range(min(length, taken[r] + 1)):
                self.lookup_outcomes[j][0] += 1
                self.lookup_outcomes[j][1] += j < taken[r]
        self.lookup_verified = {}

    def _pending_features(self) -> tuple[Tensor | None, Tensor | None]:
        """The pending rounds' features as one append (features, counts), or (None, None). Each row's
        valid entries (its first counts[r] of every round) are packed to the left in round order, so
        every entry lands in the slot, at the position, that a per-round append gives it: the context
        K/V depend only on the feature and its position, so the drafts are the same."""
        if not self.pending_context:
            return None, None
        pending, self.pending_context = self.pending_context, []
        if len(pending) == 1:
            return pending[0]
        features = torch.cat([f for f, _ in pending], dim=1)
        valid = torch.cat([torch.arange(f.shape[1], device=f.device)[None] < c[:, None] for f, c in pending], dim=1)
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid entries first, in order
        return features.gather(1, order[..., None].expand_as(features)), valid.sum(dim=1)

    def _flush_context(self) -> None:
        """Append the pending rounds' features to the draft context now (_pending_features)."""
        features, counts = self._pending_features()
        if features is not None:
            self.draft_model.append_context(features, counts=counts)


def rounds_per_second(step_seconds, draft_seconds, b: int, n: int):
    """SPS(B) for Algorithm 1 over n scheduled rows of a batch of b: one round = the drafting
    (paid whatever ℓ is) + a right-padded verify of b rows × (1 + max ℓ) = B / n tokens."""
    draft_cost = draft_seconds(b)
    return lambda total: 1.0 / (draft_cost + step_seconds(b, max(total // n, 1)))


class DraftGate:
    """Whether the next rounds run the drafter at all (module docstring, "Draft gate"). Per round
    the caller asks `skip()` first; after a drafted round it hands that round's confidences to
    `update()`, which decides from them (never from the current drafts) whether drafting paid."""

    def __init__(self, gamma: int, step_seconds, draft_seconds, early_stop: bool = True):
        self.gamma, self.step_seconds, self.draft_seconds = gamma, step_seconds, draft_seconds
        # Judge drafting by the lengths the policy's scheduler would verify: Algorithm 1 stops at its
        # first non-improvement (early_stop), the capacity variant searches the whole path.
        self.early_stop = early_stop
        self.backoff_by_rows: dict[int, int] = {}  # batch size -> the back-off its last batch ended with
        self.reset()

    def reset(self) -> None:
        """A new batch: probe at once; the back-off comes from this batch size's last batch (update)."""
        self.skip_rounds = 0  # drafter-free rounds left before the next probe
        self.backoff = None  # skipped rounds after the next probe that does not pay (doubles up to MAX_BACKOFF)

    def skip(self) -> bool:
        """True (and one skipped round fewer left) when this round is a plain decode step."""
        if self.skip_rounds > 0:
            self.skip_rounds -= 1
            return True
        return False

    def update(self, confidence: Tensor, active_mask: Tensor | list[bool]) -> list[int] | None:
        """Decide, from this round's confidences [b, γ], whether the *next* rounds draft. Returns the
        lengths the scheduler admits for the active rows, in row order (Algorithm 1 with `early_stop`,
        from the same inputs as the policy's own call), or None when no row is active."""
        active_mask = active_mask.tolist() if isinstance(active_mask, Tensor) else list(active_mask)
        rows = sum(active_mask)
        if rows == 0:
            return None
        b = len(active_mask)
        if self.backoff is None:
            self.backoff = self.backoff_by_rows.get(b, 1)
        survival = prefix_survival(confidence.float()).tolist()  # the round's one transfer
        survival = [a for a, on in zip(survival, active_mask) if on]
        sps = rounds_per_second(self.step_seconds, self.draft_seconds, b, rows)
        # What the scheduler itself would admit: with Algorithm 1, a global optimum past the first
        # non-improvement is one the lossless scheduler never reaches, so drafting for it pays nothing.
        best, expected = algorithm1_admit(survival, [self.gamma] * rows, sps, early_stop=self.early_stop, padded=True)
        with_draft = expected / (self.draft_seconds(b) + self.step_seconds(b, 1 + max(best)))
        without = rows / self.step_seconds(b, 1)
        if with_draft > without:
            self.backoff = 1
        else:
            self.skip_rounds = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        self.backoff_by_rows[b] = self.backoff
        return best
