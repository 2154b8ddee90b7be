"""The policy interface: how a speculative-decoding method plugs into the shared decode core.

Per round the core calls `propose` (draft tokens and the exact distributions they came from),
`schedule` (how many of them each row verifies), verifies them against the target, commits the
accepted prefix, and calls `observe` (what was accepted, plus the target's tapped features).
A policy never touches the target's KV cache; it only reads the batch state.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Draft:
    tokens: Tensor  # [b, K] draft tokens x_1..x_K per row (padding beyond `lengths` is ignored)
    probs: Tensor | None  # [b, K, V] distributions the tokens were drawn from; None = deterministic
    lengths: Tensor  # [b] valid drafts per row
    confidence: Tensor | None = None  # [b, K] optional conditional-acceptance scores (DSpark), calibrated
    # [b, K] optional raw scores before calibration (DSpark: confidence = σ(z / T_k)); the core hands
    # them back in RequestResult.trace_confidence_logits, which is what STS calibration fits on.
    confidence_logits: Tensor | None = None
    # Trees: parents[r, i] is node i's parent node (−1: the anchor), parents listed before children;
    # `tokens` are then the nodes, `lengths` the nodes per row, and `probs` (if given) the
    # distribution each node was drawn from i.i.d. among its siblings (None: siblings chosen, e.g. top-k).
    parents: Tensor | None = None
    # [b] bool: rows whose draft this round is a prompt-lookup draft in place of the drafter's
    # (policies/pld.py with_lookup_drafts); the core records it per round (RequestResult.trace_lookup).
    lookup_rows: Tensor | None = None


@dataclass
class BatchState:
    """What the core shows policies. Row r's committed sequence is tokens[r, :lengths[r]]: prompt,
    then every emitted token; its last token is the anchor, whose KV is not yet in the target cache."""

    tokens: Tensor  # [b, S] long
    lengths: Tensor  # [b] long
    prompt_lengths: Tensor  # [b] long
    active: Tensor  # [b] bool: still generating
    temperature: float
    top_p: float
    generator: torch.Generator
    max_new_tokens: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def row(self, r: int) -> list[int]:
        return self.tokens[r, : int(self.lengths[r])].tolist()


class Policy:
    """Base class: plain autoregressive decoding (proposes nothing)."""

    name = "ar"
    max_draft = 0  # the most draft tokens one row may verify in a round (sizes the KV cache)
    target_taps: tuple[int, ...] = ()  # target layers whose features `begin`/`observe` receive
    drafter: str | None = None
    debug_round_delay_s = 0.0  # test knob (registry's `debug_round_delay_ms`): the core busy-waits this much CPU time per round

    def params(self) -> dict:
        return {}

    def decoding(self):
        """A context the decode loop (core.generate) holds around a batch: a policy pins what does not
        change between its rounds there (DSpark: the drafter's kernel route)."""
        return contextlib.nullcontext()

    def begin(self, state: BatchState, prompt_features: Tensor | None) -> None:
        """After prefill. prompt_features: [b, P, F] target taps over the (right-padded) prompts."""

    def propose(self, state: BatchState) -> Draft | None:
        return None

    def schedule(self, draft: Draft, state: BatchState) -> Tensor:
        """Per-row verify lengths ℓ_r ≤ draft.lengths (for trees: nodes, a prefix of the node list). Must not depend on a draft token's own value
        when deciding whether to verify it (lossless scheduling, DSpark App. A)."""
        return draft.lengths

    def observe(self, state: BatchState, accepted: Tensor, verify_features: Tensor | None) -> None:
        """After commit. accepted: [b] drafts accepted per row; verify_features: [b, Q, F] target taps
        at [anchor, accepted drafts..., (more)]: the first accepted+1 are now committed. Outputs of
        the forward may be reused by the next one (CUDA graphs): clone what you keep."""
