"""The one decode loop every policy shares.

prefill → per round: propose → schedule → verify → accept → commit → observe.

Rows of a batch advance by different amounts each round: each row has its own committed length,
its own KV-cache slots and its own verify length; the target runs once per round over
[anchor, drafts...] for every row, right-padded to the longest verify length. Rolling back a
rejected suffix costs nothing: the row's committed length simply does not move past it, and the
next round overwrites those cache slots.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specbench.engine.model import Transformer, round_to_bucket
from specbench.engine.policy import BatchState, Draft, Policy
from specbench.engine.sampling import greedy_ids, make_generator, probs_from_logits, sample
from specbench.engine.verify import RoundOutcome, verify_chain, verify_chain_greedy, verify_tree, verify_tree_greedy


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class RequestResult:
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: str = "length"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    trace_verify_len: list[int] = field(default_factory=list)
    trace_accepted: list[int] = field(default_factory=list)
    # Per round: the calibrated confidences of the drafts proposed ([] when the policy gives none or
    # did not draft that round); what `specbench simulate` replays through the DSpark schedulers.
    trace_confidence: list[list[float]] = field(default_factory=list)
    # Per round: the raw confidence logits z before calibration (Draft.confidence_logits), at full
    # precision ([] as above); what `specbench calibrate` fits STS on. Not written to the records.
    trace_confidence_logits: list[list[float]] = field(default_factory=list)
    # Per round: 1 where the row verified a prompt-lookup draft instead of the drafter's (Draft.lookup_rows).
    trace_lookup: list[int] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        return (self.generated_tokens - 1) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        # Per-user decode rate: tokens after the first over the time it took to produce them.
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class BatchResult:
    requests: list[RequestResult]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.requests)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chain_mask(cache_lengths: Tensor, q: int, kv_len: int, positions: Tensor | None = None) -> Tensor:
    """[b, q, kv_len] bool: query i of row r sees every committed slot and the new slots up to its
    own (slot cache_lengths[r] + i; `positions` where the caller has them already). Padding queries
    past a row's verify length see only real tokens and themselves, so they produce finite garbage
    that nothing reads."""
    device = cache_lengths.device
    last_visible = cache_lengths[:, None] + torch.arange(q, device=device)[None] if positions is None else positions
    return _slot_indices(kv_len, device)[None, None] <= last_visible[..., None]


@functools.lru_cache(maxsize=64)
def _slot_indices(kv_len: int, device: torch.device) -> Tensor:
    """arange(kv_len), kept: a decode step is a few such small torch calls, and on a cold cache (after a
    step's weight reads) each costs tens of microseconds (docs/performance.md "Session 23")."""
    with torch.inference_mode(False):
        return torch.arange(kv_len, device=device)


def graphed_for(model: Transformer, q: int):
    """The model's CUDA-graph forward (specbench/engine/cuda_graphs.py) for a forward of q tokens per row,
    or None: no graphs, or q beyond the decode/verify buckets (a prefill runs eagerly rather than
    capturing a graph per prompt length)."""
    graphed = getattr(model, "graphed", None)
    return graphed if graphed is not None and q <= graphed.max_q else None


def forward_new_tokens(model: Transformer, tokens: Tensor, cache_lengths: Tensor, taps=(), logits: bool = True):
    """Run `tokens` [b, q] as the continuation of each row's cache (row r starts at slot
    cache_lengths[r]); returns the model's (logits, taps, hidden). logits=False may skip the head
    (logits None; a CUDA-graphed forward computes them anyway)."""
    b, q = tokens.shape
    graphed = graphed_for(model, q)
    if graphed is None and cache_lengths.dtype == torch.long:  # bf16 on a CPU: positions and mask made in the kernel
        one_call = model.chain_in_one_call(tokens, cache_lengths, taps, logits)
        if one_call is not None:
            return one_call
    positions = cache_lengths[:, None] + torch.arange(q, device=tokens.device)[None]
    if graphed is not None:  # static shapes: attend over the whole cache, the mask hides the rest
        return graphed(tokens, positions, positions, chain_mask(cache_lengths, q, model.max_seq), taps=taps)
    kv_len = round_to_bucket(int(cache_lengths.max()) + q, model.max_seq)
    return model(tokens, positions, positions, chain_mask(cache_lengths, q, kv_len, positions), taps=taps, logits=logits)


@torch.inference_mode()
def generate(
    target: Transformer,
    policy: Policy,
    prompts: list[list[int]],
    config: SamplingConfig,
    eos_ids: tuple[int, ...] | list[int] = (),
) -> BatchResult:
    """Decode a batch of prompts with `policy` until each row hits EOS or max_new_tokens."""
    pinned = getattr(target, "kernel_stack_pinned", None)  # nothing changes the target's weights while decoding
    decoding = getattr(policy, "decoding", None)  # Policy.decoding; a duck-typed policy may lack it
    with (pinned() if pinned is not None else contextlib.nullcontext(),
          decoding() if decoding is not None else contextlib.nullcontext()):
        return _generate(target, policy, prompts, config, eos_ids)


def _generate(target: Transformer, policy: Policy, prompts: list[list[int]], config: SamplingConfig,
              eos_ids: tuple[int, ...] | list[int]) -> BatchResult:
    device = target.device
    b = len(prompts)
    max_new = config.max_new_tokens
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    p_max = int(prompt_lengths.max())
    seq_cap = round_to_bucket(p_max + max_new + policy.max_draft + 2)
    target.setup_cache(b, seq_cap)
    eos = set(int(e) for e in eos_ids)

    tokens = torch.zeros(b, seq_cap, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = torch.tensor(p, device=device)
    state = BatchState(
        tokens=tokens,
        lengths=prompt_lengths.clone(),
        prompt_lengths=prompt_lengths,
        active=torch.ones(b, dtype=torch.bool, device=device),
        temperature=config.temperature,
        top_p=config.top_p,
        generator=make_generator(config.seed, device),
        max_new_tokens=max_new,
    )
    results = [RequestResult(output_ids=[], prompt_tokens=len(p)) for p in prompts]

    # Prefill: right-padded prompts from slot 0; the first token is sampled at each row's last prompt position.
    synchronize(device)
    t_start = time.perf_counter()
    zeros = torch.zeros(b, dtype=torch.long, device=device)
    logits, prompt_features, _ = forward_new_tokens(target, tokens[:, :p_max], zeros, policy.target_taps)
    last = logits[torch.arange(b, device=device), prompt_lengths - 1]
    if config.temperature <= 0:  # greedy: the argmax (what sampling a one-hot gives), no [b, V] one-hot
        first = greedy_ids(last)
    else:
        first = sample(probs_from_logits(last, config.temperature, config.top_p), state.generator)
    commit_tokens(state, results, [[int(t)] for t in first.tolist()], eos, max_new)
    synchronize(device)
    t_first = time.perf_counter()
    for res in results:
        res.ttft_s = t_first - t_start
    finished_at = [t_first if not state.active[r] else None for r in range(b)]
    policy.begin(state, prompt_features)

    while bool(state.active.any()):
        draft = policy.propose(state)
        if getattr(policy, "debug_round_delay_s", 0.0) > 0:  # debug knob (registry: debug_round_delay_ms)
            _spin(policy.debug_round_delay_s)
        if draft is None:
            draft = Draft(tokens=torch.zeros(b, 0, dtype=torch.long, device=device), probs=None, lengths=zeros)
        verify_lengths = policy.schedule(draft, state).clamp(max=draft.tokens.shape[1]) * state.active
        active_list = state.active.tolist()
        verify_round = _verify_chain_round if draft.parents is None else _verify_tree_round
        outcome = verify_round(target, policy, state, draft, verify_lengths, config)
        paths = outcome.accepted_paths
        conf_list, logit_list = _confidences_to_host(draft)
        lookup_list = draft.lookup_rows.tolist() if draft.lookup_rows is not None else [False] * b
        new_tokens = []
        for r in range(b):
            if not active_list[r]:
                new_tokens.append([])
                continue
            res = results[r]
            new_tokens.append(outcome.emitted(r))
            res.rounds += 1
            res.drafted += outcome.verified[r]
            _count_positions(res.drafted_per_position, outcome.depths[r])
            _count_positions(res.accepted_per_position, len(paths[r]))
            res.trace_verify_len.append(outcome.verified[r])
            res.trace_confidence.append([round(c, 4) for c in conf_list[r]] if conf_list else [])
            res.trace_confidence_logits.append(logit_list[r] if logit_list else [])
            res.trace_lookup.append(int(lookup_list[r]))
        emitted = commit_tokens(state, results, new_tokens, eos, max_new)
        # Rows that just finished observe nothing: their drafter state no longer matters.
        accepted = torch.tensor([len(p) for p in paths], device=device) * state.active
        for r in range(b):
            if active_list[r]:
                # Accepted drafts that were actually emitted (EOS or the budget can cut a round short).
                kept = min(len(paths[r]), emitted[r])
                results[r].accepted += kept
                results[r].trace_accepted.append(kept)
        policy.observe(state, accepted, outcome.features)
        synchronize(device)
        now = time.perf_counter()
        for r in range(b):
            if active_list[r] and not state.active[r]:
                finished_at[r] = now

    t_end = time.perf_counter()
    for r, res in enumerate(results):
        res.decode_s = (finished_at[r] or t_end) - t_first
    return BatchResult(requests=results, wall_s=t_end - t_start)


def _verify_chain_round(target, policy, state: BatchState, draft: Draft, verify_lengths: Tensor,
                        config: SamplingConfig) -> RoundOutcome:
    """One forward over [anchor, x_1..x_ℓ] per row, then chain rejection sampling; the outcome is
    brought to the host in one transfer. The accepted drafts are already in place in the cache
    (consecutive slots), so committing them is just advancing the row's length."""
    cache_lengths = state.lengths - 1  # the anchor's KV is computed in this round's forward
    # Never verify past the token budget (the bonus token takes one).
    budget = (state.max_new_tokens - (state.lengths - state.prompt_lengths) - 1).clamp_min(0)
    verify_lengths = torch.minimum(verify_lengths, budget)
    q = int(verify_lengths.max()) + 1
    anchors = state.tokens.gather(1, (state.lengths - 1)[:, None])
    inputs = torch.cat([anchors, draft.tokens[:, : q - 1]], dim=1)
    logits, verify_features, _ = forward_new_tokens(target, inputs, cache_lengths, policy.target_taps)
    if config.temperature <= 0:  # greedy fast path: argmax ids, the same outcome as one-hot verification
        ids = greedy_ids(logits)
        width = ids.shape[1]
        # One device-to-host transfer: per row [argmax ids, ℓ, drafts...].
        rows = torch.cat([ids, verify_lengths[:, None], draft.tokens], dim=1).tolist()
        lengths, drafts = [row[width] for row in rows], [row[width + 1:] for row in rows]
        accepted, next_tokens = verify_chain_greedy([row[:width] for row in rows], drafts, lengths)
    else:
        target_probs = probs_from_logits(logits, config.temperature, config.top_p)
        accepted_t, next_t = verify_chain(target_probs, draft.tokens, draft.probs, verify_lengths, state.generator)
        # One device-to-host transfer of the round's outcome: per row [accepted, next, ℓ, drafts...].
        rows = torch.cat([accepted_t[:, None], next_t[:, None], verify_lengths[:, None], draft.tokens], dim=1).tolist()
        accepted, next_tokens = [row[0] for row in rows], [row[1] for row in rows]
        lengths, drafts = [row[2] for row in rows], [row[3:] for row in rows]
    return RoundOutcome(accepted_paths=[list(range(a)) for a in accepted], next_tokens=next_tokens,
                        draft_tokens=drafts, verified=lengths, depths=lengths, features=verify_features)


def tree_layout(parents: Tensor, n_nodes: Tensor) -> tuple[Tensor, Tensor]:
    """For the verify inputs [root (anchor), node_0, ..., node_{N-1}]: depth [b, 1+N] (root 0) and
    ancestor-or-self [b, 1+N, 1+N]. Nodes past a row's n_nodes hang off the root (ignored)."""
    b, n = parents.shape
    device = parents.device
    valid = torch.arange(n, device=device)[None] < n_nodes[:, None]
    parent_index = torch.where(valid, parents, -1) + 1  # index into [root, nodes...]
    depth = torch.zeros(b, n + 1, dtype=torch.long, device=device)
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=device).repeat(b, 1, 1)
    rows = torch.arange(b, device=device)
    for i in range(n):
        depth[:, i + 1] = depth[rows, parent_index[:, i]] + 1
        ancestors[:, i + 1] |= ancestors[rows, parent_index[:, i]]
    return depth, ancestors


def _verify_tree_round(target, policy, state: BatchState, draft: Draft, n_nodes: Tensor,
                       config: SamplingConfig) -> RoundOutcome:
    """One forward over [anchor, tree nodes...] per row with a tree mask and depth positions, then
    recursive rejection sampling down the tree; the accepted path's KV is moved to consecutive slots."""
    b, device = state.batch_size, state.tokens.device
    cache_lengths = state.lengths - 1
    q = int(n_nodes.max()) + 1
    parents = draft.parents[:, : q - 1]
    depth, ancestors = tree_layout(parents, n_nodes)
    anchors = state.tokens.gather(1, cache_lengths[:, None])
    inputs = torch.cat([anchors, draft.tokens[:, : q - 1]], dim=1)
    positions = cache_lengths[:, None] + depth
    slots = cache_lengths[:, None] + torch.arange(q, device=device)[None]
    graphed = graphed_for(target, q)
    kv_len = target.max_seq if graphed is not None else round_to_bucket(int(cache_lengths.max()) + q, target.max_seq)
    key = torch.arange(kv_len, device=device)[None, None]
    offset = key - cache_lengths[:, None, None]  # key slot relative to the anchor's slot
    in_tree = ancestors.gather(2, offset.clamp(0, q - 1).expand(b, q, kv_len))
    mask = (offset < 0) | ((offset < q) & in_tree)
    forward = graphed or target
    logits, verify_features, _ = forward(inputs, positions, slots, mask, taps=policy.target_taps)
    if config.temperature <= 0:  # greedy fast path (verify_tree_greedy)
        paths, next_token = verify_tree_greedy(greedy_ids(logits), draft.tokens, parents, n_nodes)
    else:
        target_probs = probs_from_logits(logits, config.temperature, config.top_p)
        paths, next_token = verify_tree(target_probs, draft.tokens, parents, draft.probs, n_nodes, state.generator)

    # Commit: accepted node i sits at slot anchor+1+i; move it to anchor+1+j (j = its depth − 1).
    longest = max((len(p) for p in paths), default=0)
    if longest:
        src = torch.zeros(b, longest, dtype=torch.long)
        dst = torch.zeros(b, longest, dtype=torch.long)
        for r, path in enumerate(paths):
            base = int(cache_lengths[r]) + 1
            for j in range(longest):  # padding pairs copy a slot onto itself
                node = path[j] if j < len(path) else j
                src[r, j], dst[r, j] = base + node, base + j
                if j >= len(path):
                    src[r, j] = dst[r, j]
        target.move_cache(torch.arange(b, device=device)[:, None], src.to(device), dst.to(device))
    if verify_features is not None:
        index = torch.zeros(b, 1 + longest, dtype=torch.long)
        for r, path in enumerate(paths):
            index[r, 1 : 1 + len(path)] = torch.tensor([i + 1 for i in path], dtype=torch.long)
        verify_features = verify_features.gather(1, index.to(device)[..., None].expand(-1, -1, verify_features.shape[-1]))
    # The rest of the outcome in one transfer: per row [next, nodes, depth, node tokens...].
    rows = torch.cat([next_token[:, None], n_nodes[:, None], depth.max(dim=1).values[:, None], draft.tokens], dim=1).tolist()
    return RoundOutcome(accepted_paths=paths, next_tokens=[row[0] for row in rows], draft_tokens=[row[3:] for row in rows],
                        verified=[row[1] for row in rows], depths=[row[2] for row in rows], features=verify_features)


def _confidences_to_host(draft: Draft) -> tuple[list | None, list | None]:
    """The draft's calibrated confidences and raw confidence logits per row (None where absent),
    in one device-to-host transfer."""
    if draft.confidence is None:
        return None, None
    if draft.confidence_logits is None:
        return draft.confidence.float().tolist(), None
    both = torch.stack([draft.confidence.float(), draft.confidence_logits.float()]).tolist()
    return both[0], both[1]


def _spin(seconds: float) -> None:
    """Busy-wait for `seconds` of this thread's CPU time: the debug delay is extra work in the round,
    which a loaded machine stretches like the rest of the round (a time.sleep hands the CPU away,
    and there each wake-up costs far more than the sleep)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        for _ in range(100):  # a few µs of pure work between clock reads (each read is a syscall)
            pass


def _count_positions(per_position: list[int], n: int) -> None:
    if len(per_position) < n:
        per_position.extend([0] * (n - len(per_position)))
    for k in range(n):
        per_position[k] += 1


def commit_tokens(state: BatchState, results, new_tokens: list[list[int]], eos: set[int], max_new: int) -> list[int]:
    """Append each row's new tokens, cut at EOS (kept) and at the token budget; returns how many
    tokens each row emitted. A row that hits either stops (becomes inactive)."""
    emitted = []
    for r, toks in enumerate(new_tokens):
        res = results[r]
        room = max_new - len(res.output_ids)
        toks = toks[:room]
        for i, t in enumerate(toks):
            if t in eos:
                toks = toks[: i + 1]
                res.finish_reason = "eos"
                break
        if toks:
            start = int(state.lengths[r])
            state.tokens[r, start : start + len(toks)] = torch.tensor(toks, device=state.tokens.device)
            state.lengths[r] += len(toks)
            res.output_ids.extend(toks)
        if res.finish_reason == "eos" or len(res.output_ids) >= max_new:
            state.active[r] = False
        emitted.append(len(toks))
    return emitted
