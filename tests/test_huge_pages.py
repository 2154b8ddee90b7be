"""The GEMV packs in 2 MB pages (engine/huge_pages.py): same values, one mapping per model, kept
alive by the copies, advised for huge pages where the kernel offers them, and no change in what a
model computes."""
import gc
from pathlib import Path

import pytest
import torch

from specbench.engine import cpu_kernels, huge_pages
from specbench.engine.core import forward_new_tokens
from specbench.engine.huge_pages import HUGE_PAGE, huge_page_copies, huge_page_zeros
from specbench.engine.model import PACK_ATTRIBUTES
from tiny import tiny_model


def thp_offered() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def laid_end_to_end(tensors) -> bool:
    """Whether `tensors` lie one after another, each on the next cache line after the one before: one mapping."""
    spans = sorted((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
    return all(nxt == -(-(ptr + size) // 64) * 64 for (ptr, size), (nxt, _) in zip(spans, spans[1:]))


def test_copies_keep_values_shapes_and_outlive_every_other_reference():
    sources = [torch.randn(100, 37).to(torch.bfloat16), torch.arange(11), torch.randn(3, 5, 7), torch.ones(())]
    copies = huge_page_copies([t.clone() for t in sources])
    gc.collect()
    [torch.randn(1000, 1000) for _ in range(20)]  # reuse freed memory, were the mapping gone
    for src, copy in zip(sources, copies):
        assert copy.dtype == src.dtype and copy.shape == src.shape and copy.is_contiguous()
        assert torch.equal(copy, src)
        assert copy.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    assert laid_end_to_end(copies)
    assert huge_page_copies([]) == []
    z = huge_page_zeros(1000, torch.float32)
    assert z.shape == (1000,) and not z.any() and z.data_ptr() % HUGE_PAGE == 0


def test_made_inside_inference_mode_they_are_normal_tensors():
    """A cache set up under inference_mode is written outside it too (training, a no_grad forward)."""
    with torch.inference_mode():
        zeros, (copy,) = huge_page_zeros(8, torch.bfloat16), huge_page_copies([torch.ones(4)])
    assert not zeros.is_inference() and not copy.is_inference()
    zeros.add_(1)
    copy.add_(1)
    assert zeros.tolist() == [1.0] * 8 and copy.tolist() == [2.0] * 4


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not thp_offered(),
                    reason="no transparent huge pages in this kernel")
def test_the_mapping_is_advised_for_huge_pages():
    (copy,) = huge_page_copies([torch.randn(HUGE_PAGE // 2)])  # 4 MB
    fields = vma_flags(copy.data_ptr())
    assert "hg" in fields["VmFlags"].split()  # MADV_HUGEPAGE took


@pytest.mark.skipif(not cpu_kernels.available(), reason="the bf16 kernels need AVX-512 BF16")
def test_a_bf16_model_keeps_its_packs_and_caches_in_huge_page_mappings_and_computes_the_same(monkeypatch):
    tokens, lengths = torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([7])

    def build():
        model = tiny_model(dtype=torch.bfloat16)
        model.setup_cache(1, 64)
        prefix = torch.tensor([[2, 7, 1, 8, 2, 8, 1]])
        with torch.inference_mode():
            forward_new_tokens(model, prefix, torch.tensor([0]))
            return model, forward_new_tokens(model, tokens, lengths)

    def gemv_packs(model):
        return [getattr(m, name).gemv for m in model.modules() for name in PACK_ATTRIBUTES
                if getattr(m, name, None) is not None and getattr(m, name).gemv is not None]

    model, logits = build()
    packs = gemv_packs(model)
    assert len(packs) == 2 * 4 + 1  # per layer q|k|v, o, gate|up, down; the LM head
    assert laid_end_to_end(packs)
    caches = [getattr(layer.self_attn, name) for layer in model.model.layers for name in ("k_cache", "v_cache")]
    assert laid_end_to_end(caches) and caches[0].data_ptr() % HUGE_PAGE == 0
    assert all(c.shape == (1, 2, 64, 8) and c.is_contiguous() for c in caches)
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    plain, plain_logits = build()
    assert not laid_end_to_end(gemv_packs(plain))
    out = logits[0] if isinstance(logits, tuple) else logits
    plain_out = plain_logits[0] if isinstance(plain_logits, tuple) else plain_logits
    assert torch.equal(out, plain_out)
    plain_caches = [getattr(layer.self_attn, name) for layer in plain.model.layers for name in ("k_cache", "v_cache")]
    assert all(torch.equal(a, b) for a, b in zip(caches, plain_caches))


def test_cache_zeros_share_one_mapping_on_a_cpu_and_are_plain_zeros_elsewhere(monkeypatch):
    layout = [((2, 3, 16, 8), torch.bfloat16)] * 4
    caches = huge_pages.cache_zeros(layout, torch.device("cpu"))
    assert laid_end_to_end(caches) and caches[0].data_ptr() % HUGE_PAGE == 0
    assert all(c.shape == (2, 3, 16, 8) and c.dtype == torch.bfloat16 and not c.any() for c in caches)
    (meta,) = huge_pages.cache_zeros(layout[:1], torch.device("meta"))  # any other device: torch.zeros there
    assert meta.device.type == "meta" and meta.shape == (2, 3, 16, 8)
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    assert not laid_end_to_end(huge_pages.cache_zeros(layout, torch.device("cpu")))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the bf16 kernels need AVX-512 BF16")
def test_drafters_keep_their_caches_and_head_packs_in_huge_page_mappings():
    """DSpark's context caches and EAGLE's caches and packed draft head are streamed every drafting
    round, as the target's packs are: in 2 MB pages too (what they compute is covered by the bf16
    greedy-identity tests of tests/test_eagle.py and tests/test_dspark_policy.py)."""
    from specbench.drafters.dspark import DSparkArgs, build_drafter
    from specbench.drafters.eagle import EagleArgs, build_head
    from specbench.engine.dtypes import cast_model

    target = cast_model(tiny_model(vocab=64, layers=3), torch.bfloat16)
    dspark = build_drafter(DSparkArgs.for_target(target.args, tap_layers=[0, 1, 2], n_layers=2, block_size=4,
                                                 markov_rank=8), target).to(torch.bfloat16).eval()
    dspark.setup_cache(2, 32)
    assert laid_end_to_end(dspark.k_cache + dspark.v_cache) and dspark.k_cache[0].data_ptr() % HUGE_PAGE == 0
    eagle = build_head(EagleArgs.for_target(target.args, [0, 1, 2]), target, dtype=torch.bfloat16).eval()
    eagle.setup_cache(2, 32)
    attn = eagle.layer.self_attn
    assert laid_end_to_end([attn.k_cache, attn.v_cache]) and attn.k_cache.data_ptr() % HUGE_PAGE == 0
    with torch.inference_mode():
        eagle.logits(torch.randn(1, target.args.dim).bfloat16())
    (packs,) = eagle._head_pack.values()
    assert packs.gemv is not None and packs.gemv.data_ptr() % HUGE_PAGE == 0
