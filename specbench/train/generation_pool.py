"""Decoding many independent batches at once: one-thread worker processes, each with its own copy
of the target.

Why: on the 2-core CPU one process decoding a batch of 96 rows produced about as many tokens per
second on two threads as on one (docs/performance.md "The self-distillation corpus"): a batched
135M step is many small operations, which two threads do not split well. Independent batches in
separate one-thread processes do add up. A batch's tokens are a pure function of the model, its
prompts and its sampling seed, so they are the same whichever process decodes it (all processes
run one thread: the kernels, hence the bits, are the ones a one-thread serial build uses), and
results come back in the order the batches were given.

    with GenerationPool(model, workers=2) as pool:
        for output in pool.generate([(prompts, config, stop_ids), ...]):  # per batch, in order
            ...  # output: [(generated ids, finish reason)] per request

workers ≤ 1 decodes in this process, with no worker started. Workers are spawned (not forked:
a forked child of a process that has run OpenMP regions can hang in its own) and receive the
model's arguments and weights once, at start-up.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Iterator, Sequence

import torch

from specbench.engine.core import SamplingConfig, generate
from specbench.engine.model import Transformer
from specbench.engine.policy import Policy

Job = tuple[list[list[int]], SamplingConfig, Sequence[int]]
Output = list[tuple[list[int], str]]  # per request: generated ids, finish reason

_worker_model: Transformer | None = None


def _decode(model: Transformer, prompts: list[list[int]], config: SamplingConfig, stop: Sequence[int]) -> Output:
    result = generate(model, Policy(), prompts, config, list(stop))
    return [(list(r.output_ids), r.finish_reason) for r in result.requests]


def _start_worker(args, state: dict, dtype: torch.dtype) -> None:
    global _worker_model
    torch.set_num_threads(1)
    model = Transformer(args)
    model.load_state_dict(state)
    _worker_model = model.to(dtype=dtype).eval()  # .to() packs the weights (model.pack_weights)


def _decode_job(job) -> Output:
    return _decode(_worker_model, *job)


class GenerationPool:
    def __init__(self, model: Transformer, workers: int = 1):
        if model.device.type != "cpu" and workers > 1:
            raise ValueError("worker processes decode on the CPU; one process drives a GPU")
        self.model = model
        self.workers = max(1, int(workers))
        self._pool = None
        if self.workers > 1:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            self._pool = mp.get_context("spawn").Pool(
                self.workers, initializer=_start_worker, initargs=(model.args, state, model.lm_head.weight.dtype))

    def generate(self, jobs: Sequence[Job]) -> Iterator[Output]:
        """Each job (prompts, sampling config, stop ids) decoded as one batch; yields the outputs
        in job order, each as soon as it and those before it are done."""
        if self._pool is None:
            for job in jobs:
                yield _decode(self.model, *job)
            return
        yield from self._pool.imap(_decode_job, [(p, c, list(s)) for p, c, s in jobs])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "GenerationPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
