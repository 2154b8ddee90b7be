"""The fp32 GEMV (specbench/engine/cpu_f32.py): F.linear's products to fp32 rounding, the same bits
for a row alone or among others (so a verify forward computes each row as the AR step it
replaces), and taken only where it applies. Collected only on a CPU with AVX2 + FMA (conftest.py)."""
import torch

from specbench.engine import cpu_f32, cpu_kernels
from specbench.engine.model import linear


def test_builds_here():
    assert cpu_f32.available()


def test_products_match_float64_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    # the default target's projection shapes, odd sizes (k not a multiple of 8, n not of 3)
    for n, k in [(960, 576), (1536, 576), (576, 1536), (49152, 576), (37, 13), (5, 8), (1, 17)]:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(11, k, generator=g)
        y = cpu_f32.gemv(x, w)
        exact = (x.double() @ w.double().T)
        assert (y.double() - exact).abs().max() <= 1e-5 * k ** 0.5 * (1 + exact.abs().max())
        alone = torch.cat([cpu_f32.gemv(x[i:i + 1], w) for i in range(len(x))])
        assert torch.equal(alone, y)  # bits: a row's result does not depend on the rows beside it
        for m in range(9):  # the one-pass path (<= 8 rows) against the blocked one (11 rows); 0 rows too
            assert torch.equal(cpu_f32.gemv(x[:m], w), y[:m])
        threads = torch.get_num_threads()
        try:
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                assert torch.equal(cpu_f32.gemv(x[3:7], w), y[3:7])  # nor on the split over threads
        finally:
            torch.set_num_threads(threads)


def test_applies_to_decode_and_verify_forwards_only():
    w = torch.randn(16, 64)
    assert cpu_f32.applies(torch.randn(1, 1, 64), w)  # AR step
    assert cpu_f32.applies(torch.randn(4, 8, 64), w)  # verify at b = 4
    assert cpu_f32.applies(torch.randn(1, cpu_kernels.MAX_ATTEND_TOKENS, 64), w)  # a tree
    assert not cpu_f32.applies(torch.randn(1, cpu_kernels.MAX_ATTEND_TOKENS + 1, 64), w)  # prefill: F.linear
    assert cpu_f32.applies(torch.randn(cpu_f32.MAX_FLAT_ROWS, 64), w)
    assert not cpu_f32.applies(torch.randn(cpu_f32.MAX_FLAT_ROWS + 1, 64), w)
    assert not cpu_f32.applies(torch.randn(1, 1, 64).bfloat16(), w.bfloat16())  # bf16: cpu_kernels' business
    assert not cpu_f32.applies(torch.randn(1, 1, 64), w.T)  # a non-contiguous weight
    x = torch.randn(1, 1, 64, requires_grad=True)
    assert not cpu_f32.applies(x, w)  # training: F.linear, which has a backward
    with torch.no_grad():
        assert cpu_f32.applies(x, w)
    cpu_kernels.ENABLED = False
    try:
        assert not cpu_f32.applies(torch.randn(1, 1, 64), w)  # SPECBENCH_CPU_KERNELS=0
        assert torch.equal(linear(torch.ones(1, 1, 64), w), torch.nn.functional.linear(torch.ones(1, 1, 64), w))
    finally:
        cpu_kernels.ENABLED = True
