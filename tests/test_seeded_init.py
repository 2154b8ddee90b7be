"""Seeded drafter initialisation draws on the CPU: a seed gives the same weights whatever the module's
device and dtype (the CUDA case itself runs in benchmarks/gpu_check.py on a lent GPU: the suite
has no skips). (On a lent H200 the trainers and benchmarks/gpu_check.py failed with "Expected a
'cuda' device type for generator but found 'cpu'" before `seeded_normal`.)"""
from __future__ import annotations

import pytest
import torch

from specbench.drafters.dspark import DSparkArgs, build_drafter
from specbench.drafters.eagle import EagleArgs, build_head
from specbench.engine.model import seeded_normal
from tiny import tiny_model


def _drafter(target, dtype, device="cpu"):
    args = DSparkArgs.for_target(target.args, tap_layers=[0, 1], variant="dspark", n_layers=1, block_size=4,
                                 markov_rank=8)
    return build_drafter(args, target, dtype=dtype).to(device)


def _head(target, dtype, device="cpu"):
    return build_head(EagleArgs.for_target(target.args, [0, 1]), target, dtype=dtype).to(device)


def test_seeded_normal_is_the_cpu_generators_draw():
    like = torch.empty(5, 7, dtype=torch.bfloat16)
    got = seeded_normal(like, 0.02, torch.Generator().manual_seed(3))
    want = torch.empty(5, 7).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("build", [_drafter, _head], ids=["dspark", "eagle"])
def test_init_in_bf16_is_the_fp32_init_cast(build):
    target = tiny_model()
    fp32, bf16 = build(target, torch.float32), build(target, torch.bfloat16)
    fp32.init_weights(torch.Generator().manual_seed(0))
    bf16.init_weights(torch.Generator().manual_seed(0))
    compared = 0
    for (name, a), (_, b) in zip(fp32.state_dict().items(), bf16.state_dict().items()):
        if a.is_floating_point() and b.dtype == torch.bfloat16:
            assert torch.equal(a.to(torch.bfloat16), b), name
            compared += 1
    assert compared >= 4
