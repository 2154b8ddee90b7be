"""CUDA-graph capture of a model's forward, one graph per (batch, q, taps) bucket.

A decode step of a small target is a few hundred kernel launches; at batch 1 their launch cost
rivals the work (docs/hardware.md §1: a 1.2 ms graphed step vs ~50 ms through transformers.generate).
Capturing the whole forward once per shape and replaying it removes that overhead. Graphs need
static shapes and addresses, so graphed forwards always attend over the whole cache
(kv_len = max_seq: the mask hides unused slots) and copy their inputs into static buffers.

Outputs are the graph's static tensors: they are overwritten by the next replay of the same
bucket, so callers consume (or clone) them before the next forward.

`run` and `sweep` enable it for the target on CUDA (`--no-cuda-graphs` turns it off). Buckets are
the (batch, q) shapes the core meets: q = 1 decode and each verify width up to `max_q`; longer
forwards (prefill) run eagerly (specbench/engine/core.py graphed_for), so prompts of every length do not
each capture a graph. The drafters' own steps are not graphed (yet).
"""
from __future__ import annotations

import torch
from torch import Tensor


MAX_GRAPHED_Q = 64  # the widest verify forward captured: drafts + anchor of any shipped policy fit


class GraphedForward:
    def __init__(self, model, warmup: int = 2, max_q: int = MAX_GRAPHED_Q):
        self.model = model
        self.warmup = warmup
        self.max_q = max_q
        self.graphs: dict[tuple, tuple] = {}
        self.cache_id = None

    def __call__(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, taps=(), logits=True):
        # setup_cache may have reallocated the KV cache: graphs captured on the old one are stale.
        cache_id = id(self.model.model.layers[0].self_attn.k_cache)
        if cache_id != self.cache_id:
            self.graphs.clear()
            self.cache_id = cache_id
        key = (tuple(tokens.shape), tuple(mask.shape), tuple(taps), logits)
        if key not in self.graphs:
            self.graphs[key] = self._capture(tokens, positions, slots, mask, taps, logits)
        graph, inputs, outputs = self.graphs[key]
        for static, new in zip(inputs, (tokens, positions, slots, mask)):
            static.copy_(new)
        graph.replay()
        return outputs

    def _capture(self, tokens, positions, slots, mask, taps, logits):
        inputs = tuple(t.clone() for t in (tokens, positions, slots, mask))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Warm-up runs write the same K/V to the same slots the replay will write: harmless.
            for _ in range(self.warmup):
                self.model(*inputs, taps=taps, logits=logits)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.model(*inputs, taps=taps, logits=logits)
        return graph, inputs, outputs


def enable_cuda_graphs(model, max_q: int = MAX_GRAPHED_Q) -> None:
    """Route the core's forwards of `model` of up to `max_q` tokens per row through captured graphs
    (CUDA only)."""
    if model.device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    model.graphed = GraphedForward(model, max_q=max_q)


def uses_cuda_graphs(model) -> bool:
    return getattr(model, "graphed", None) is not None
