"""Engines: what decodes a batch of token-id prompts for the runner and returns a
:class:`specbench.engine.core.BatchResult` — a policy in the shared decode core
(:class:`PolicyEngine`) or a peer baseline (:mod:`specbench.bench.baselines`, subclasses of
:class:`Engine`). The runner sees only engines, so targets and policies can be injected."""
from __future__ import annotations

from typing import Sequence

from specbench.engine.core import BatchResult, SamplingConfig, generate


class Engine:
    """Decodes batches of token-id prompts. Subclasses set ``name``, ``params``, ``drafter``."""

    name: str = "?"
    drafter: str | None = None
    max_batch_size: int | None = None  # None: any

    def params(self) -> dict:
        return {}

    def decode(self, prompts: list[list[int]], config: SamplingConfig, eos_ids: Sequence[int]) -> BatchResult:
        raise NotImplementedError


class PolicyEngine(Engine):
    """A :class:`specbench.engine.policy.Policy` running in the shared decode core on the target."""

    def __init__(self, target_model, policy, name: str | None = None):
        self.target_model, self.policy = target_model, policy
        self.name = name or policy.name
        self.drafter = getattr(policy, "drafter", None)

    def params(self) -> dict:
        return self.policy.params()

    def decode(self, prompts, config, eos_ids):
        return generate(self.target_model, self.policy, prompts, config, eos_ids)
