"""How close to the floor can a b = 1 step get at all? Reads the target's own weight packs, no arithmetic
(not a test: numbers go to docs/performance.md).

The floor `step_bench.py` quotes is the step's weight bytes over the rate of one 1 GiB `torch.sum`. A step
reads those bytes as 121 separate packs (4 a layer and the LM head), each split between the threads and
followed by a wait for the slower one. This times, cold (right after a 1 GiB read that also gives the
rate of the moment), plain reads of exactly those packs in the order a forward reads them:

  regions    one `at::parallel_for` per pack with the GEMV's split (blocks of 32 rows, grain 4): the
             GEMV's memory pattern without its arithmetic or the small ops between the matrices;
  barriers   one OpenMP region for all packs, each thread its same share of each pack, a barrier after
             each pack (what a persistent-thread forward would do);
  no-waits   the same without the barriers: each thread streams its shares back to back (the bound of
             a perfect balance between the threads);
  claimed    each pack in chunks of 4 blocks that two threads claim as they go, one from each end (a
             dynamic balance between the threads, in place of the even split; two threads only);
  stealing   `barriers` with each share's tail up for grabs: a thread takes its own share's blocks from
             the front, then the other's from the back (work stealing, one block at a time);
  mirrored   `barriers` with every other pack's split mirrored, so that at each pack boundary one thread
             carries on where it stopped (the packs lie back to back in forward order);
  thread-major  the packs copied so that each thread's shares of all of them lie back to back in a
             buffer of its own, read with a barrier after each pack: one unbroken stream per thread (a
             layout the suite does not use; the bound of the one above);
  gemvs      the suite's own GEMV (one row) over every pack in turn: the weight stream with its
             arithmetic but without the small ops between the matrices (with one small allocation
             and one read-back a pack);

and the real b = 1, q = 1 step (one-call forward, context 256) in the same pairs. Each is reported as
the median of (floor at the rate just measured) / (its time): 1.0 means as fast as the 1 GiB sum. A read's
floor is the bytes it reads; the step's is the suite's (`costs.profile.floor_ms`: its weights and its 256
cached tokens' K/V, as step_bench.py quotes it).

Usage (an otherwise idle machine; bf16 on a CPU with AVX-512 BF16):
  python benchmarks/pack_read.py --pairs 30 --out results/perf/cpu-pack-read-epyc.json
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specbench.atomic import write_json
from specbench.costs.profile import floor_ms
from specbench.engine import cpu_kernels, huge_pages
from specbench.engine.loading import load_model
from specbench.engine.timing import device_name, time_forward

CONTEXT = 256

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <atomic>
#include <tuple>

// Two independent add chains over 128-byte steps: the loads, not the adds, set the pace.
static inline __m512 read_range(const char* p, int64_t n, __m512 acc) {
  __m512 other = _mm512_setzero_ps();
  for (int64_t i = 0; i + 128 <= n; i += 128) {
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_loadu_si512(p + i)));
    other = _mm512_add_ps(other, _mm512_castsi512_ps(_mm512_loadu_si512(p + i + 64)));
  }
  return _mm512_add_ps(acc, other);
}

static inline int64_t block_bytes(const at::Tensor& t) { return t.numel() / t.size(0) * 2; }

double read_regions(std::vector<at::Tensor> packs) {
  double total = 0;
  for (const at::Tensor& t : packs) {
    const int64_t bb = block_bytes(t);
    const char* base = static_cast<const char*>(t.data_ptr());
    float out[64] = {0};
    at::parallel_for(0, t.size(0), 4, [&](int64_t b0, int64_t b1) {
      out[at::get_thread_num() % 64] += _mm512_reduce_add_ps(read_range(base + b0 * bb, (b1 - b0) * bb, _mm512_setzero_ps()));
    });
    for (float v : out) total += v;
  }
  return total;
}

template <bool WAIT, bool MIRROR = false>
double read_one_region(std::vector<at::Tensor> packs) {
  float out[64] = {0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    __m512 acc = _mm512_setzero_ps();
    for (const at::Tensor& t : packs) {
      const int64_t blocks = t.size(0), per = (blocks + nt - 1) / nt;
      int64_t b0 = std::min(blocks, tid * per), b1 = std::min(blocks, b0 + per);
      if (MIRROR && (&t - packs.data()) % 2) std::tie(b0, b1) = std::make_pair(blocks - b1, blocks - b0);
      const int64_t bb = block_bytes(t);
      acc = read_range(static_cast<const char*>(t.data_ptr()) + b0 * bb, (b1 - b0) * bb, acc);
      if (WAIT) {
#pragma omp barrier
      }
    }
    out[tid % 64] = _mm512_reduce_add_ps(acc);
  }
  double total = 0;
  for (float v : out) total += v;
  return total;
}

// Each pack cut into chunks of 4 blocks that the threads claim as they go, thread 0 from the front and
// thread 1 from the back (one shared count of chunks claimed keeps the two from meeting twice): each
// thread's stream stays contiguous within a chunk, and a thread the memory system serves faster takes
// more of the pack instead of waiting for the other.
double read_claimed(std::vector<at::Tensor> packs) {
  double total = 0;
  for (const at::Tensor& t : packs) {
    const int64_t bb = block_bytes(t), chunk = 4, chunks = (t.size(0) + chunk - 1) / chunk;
    const char* base = static_cast<const char*>(t.data_ptr());
    float out[64] = {0};
    std::atomic<int64_t> claimed{0};
    at::parallel_for(0, 2, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t mine = 0; claimed.fetch_add(1, std::memory_order_relaxed) < chunks; ++mine) {
          const int64_t c = w == 0 ? mine : chunks - 1 - mine;
          const int64_t b0 = c * chunk, b1 = std::min(t.size(0), b0 + chunk);
          acc = read_range(base + b0 * bb, (b1 - b0) * bb, acc);
        }
        out[w] += _mm512_reduce_add_ps(acc);
      }
    });
    for (float v : out) total += v;
  }
  return total;
}

// The suite's own GEMV (specbench_cpu::gemv_bf16, one row of x) over every pack in turn: the step's
// weight stream with its arithmetic, without the small ops between the matrices.
double gemvs(std::vector<at::Tensor> packs) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specbench_cpu::gemv_bf16", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  double total = 0;
  for (const at::Tensor& t : packs) {
    at::Tensor x = at::ones({1, t.size(1) * 2}, t.options());
    total += op.call(x, t, t.size(0) * 32)[0][0].item<double>();
  }
  return total;
}

// `barriers` with the tail of each share up for grabs: each thread takes its own share's blocks from the
// front, one at a time, and once it runs out takes the others' from the back, so none waits while
// another still has blocks left. One (front, back) pair a share, claimed by compare-and-swap.
double read_stealing(std::vector<at::Tensor> packs) {
  float out[64] = {0};
  const int nt = at::get_num_threads();
  std::vector<std::atomic<uint64_t>> ranges(packs.size() * nt);
  for (size_t i = 0; i < packs.size(); ++i) {
    const int64_t blocks = packs[i].size(0), per = (blocks + nt - 1) / nt;
    for (int t = 0; t < nt; ++t) {
      const uint64_t lo = std::min(blocks, t * per), hi = std::min(blocks, (t + 1) * per);
      ranges[i * nt + t].store(lo | (hi << 32));
    }
  }
  auto take = [](std::atomic<uint64_t>& r, bool front, int64_t* block) {
    uint64_t v = r.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
      if (lo >= hi) return false;
      const uint64_t next = front ? ((lo + 1) | (hi << 32)) : (lo | ((hi - 1) << 32));
      if (r.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        *block = static_cast<int64_t>(front ? lo : hi - 1);
        return true;
      }
    }
  };
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    __m512 acc = _mm512_setzero_ps();
    for (size_t i = 0; i < packs.size(); ++i) {
      const at::Tensor& t = packs[i];
      const int64_t bb = block_bytes(t);
      const char* base = static_cast<const char*>(t.data_ptr());
      int64_t block;
      while (take(ranges[i * nt + tid], true, &block)) acc = read_range(base + block * bb, bb, acc);
      for (int other = 1; other < nt; ++other)
        while (take(ranges[i * nt + (tid + other) % nt], false, &block)) acc = read_range(base + block * bb, bb, acc);
#pragma omp barrier
    }
    out[tid % 64] = _mm512_reduce_add_ps(acc);
  }
  double total = 0;
  for (float v : out) total += v;
  return total;
}

// The packs laid out thread-major: thread t's shares of every pack, in forward order, back to back in one
// buffer of its own (`thread_major` makes them), read with a barrier after each pack as in `barriers`:
// whether one long contiguous stream per thread keeps the prefetchers going across the barriers.
std::vector<at::Tensor> thread_major(std::vector<at::Tensor> packs, int64_t threads) {
  std::vector<int64_t> bytes(threads, 0);
  for (const at::Tensor& t : packs) {
    const int64_t blocks = t.size(0), per = (blocks + threads - 1) / threads;
    for (int64_t i = 0; i < threads; ++i)
      bytes[i] += (std::min(blocks, (i + 1) * per) - std::min(blocks, i * per)) * block_bytes(t);
  }
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < threads; ++i) out.push_back(at::empty({bytes[i]}, at::kByte));
  std::vector<int64_t> at_(threads, 0);
  for (const at::Tensor& t : packs) {
    const int64_t blocks = t.size(0), per = (blocks + threads - 1) / threads, bb = block_bytes(t);
    for (int64_t i = 0; i < threads; ++i) {
      const int64_t b0 = std::min(blocks, i * per), b1 = std::min(blocks, (i + 1) * per);
      std::memcpy(out[i].data_ptr<uint8_t>() + at_[i], static_cast<const char*>(t.data_ptr()) + b0 * bb, (b1 - b0) * bb);
      at_[i] += (b1 - b0) * bb;
    }
  }
  return out;
}

double read_thread_major(std::vector<at::Tensor> packs, std::vector<at::Tensor> buffers) {
  float out[64] = {0};
  const int nt = static_cast<int>(buffers.size());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const char* p = static_cast<const char*>(buffers[tid].data_ptr());
    __m512 acc = _mm512_setzero_ps();
    for (const at::Tensor& t : packs) {
      const int64_t blocks = t.size(0), per = (blocks + nt - 1) / nt;
      const int64_t n = (std::min(blocks, (tid + 1) * per) - std::min(blocks, tid * per)) * block_bytes(t);
      acc = read_range(p, n, acc);
      p += n;
#pragma omp barrier
    }
    out[tid % 64] = _mm512_reduce_add_ps(acc);
  }
  double total = 0;
  for (float v : out) total += v;
  return total;
}

TORCH_LIBRARY(specbench_pack_read, m) {
  m.def("thread_major(Tensor[] packs, int threads) -> Tensor[]", thread_major);
  m.def("thread_major_read(Tensor[] packs, Tensor[] buffers) -> float", read_thread_major);
  m.def("claimed(Tensor[] packs) -> float", read_claimed);
  m.def("gemvs(Tensor[] packs) -> float", gemvs);
  m.def("regions(Tensor[] packs) -> float", read_regions);
  m.def("barriers(Tensor[] packs) -> float", read_one_region<true>);
  m.def("mirrored(Tensor[] packs) -> float", read_one_region<true, true>);
  m.def("stealing(Tensor[] packs) -> float", read_stealing);
  m.def("no_waits(Tensor[] packs) -> float", read_one_region<false>);
}
"""


def forward_packs(model) -> list[torch.Tensor]:
    """The GEMV packs a bf16 one-call forward reads, in its order: q|k|v, o, gate|up, down a layer, the head."""
    lists, tail = model._build_kernel_stack(), model._kernel_tail()
    if lists is None or tail is None or tail[2] is None:
        raise SystemExit("pack_read: the bf16 one-call forward does not apply here (needs AVX-512 BF16)")
    packs = [p for i in range(len(lists[1])) for p in (lists[1][i], lists[2][i], lists[4][i], lists[5][i])]
    return packs + [tail[2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("pack_read: the bf16 CPU kernels are not available on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "pack_read.cpp"
        src.write_text(SOURCE)
        if not cpu_kernels.build("specbench_pack_read", src, ["-O3", "-mavx512f", "-fopenmp"], "the pack-read loops"):
            raise SystemExit("pack_read: its loops could not be built")
    ops = torch.ops.specbench_pack_read

    model = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16).model
    time_forward(model, 1, 1, CONTEXT, iters=0, warmup=3)  # packs the weights
    packs = forward_packs(model)
    n_bytes = sum(p.numel() * p.element_size() for p in packs)
    buffers = huge_pages.huge_page_copies(ops.thread_major(packs, torch.get_num_threads()))
    probe_bytes = 2**30
    probe = huge_pages.read_probe(probe_bytes // 4, torch.device("cpu")).uniform_()
    probe.sum()
    arms = {"regions": lambda: ops.regions(packs), "barriers": lambda: ops.barriers(packs),
            "no_waits": lambda: ops.no_waits(packs), "claimed": lambda: ops.claimed(packs),
            "gemvs": lambda: ops.gemvs(packs), "thread_major": lambda: ops.thread_major_read(packs, buffers),
            "mirrored": lambda: ops.mirrored(packs), "stealing": lambda: ops.stealing(packs),
            "step_q1": lambda: time_forward(model, 1, 1, CONTEXT, iters=1, warmup=0)}
    for name in ("regions", "barriers", "no_waits", "claimed", "gemvs", "thread_major", "mirrored", "stealing"):
        arms[name]()
    fractions = {name: [] for name in arms}
    ms = {name: [] for name in arms}
    rates = []
    for _ in tqdm(range(args.pairs), desc="pairs"):
        for name, run in arms.items():
            t0 = time.perf_counter()
            probe.sum()
            rate = probe_bytes / (time.perf_counter() - t0)
            rates.append(rate)
            t0 = time.perf_counter()
            out = run()
            took = time.perf_counter() - t0 if name != "step_q1" else out[0]
            ms[name].append(1e3 * took)
            floor_s = 1e-3 * floor_ms(model, 1, CONTEXT, rate) if name == "step_q1" else n_bytes / rate
            fractions[name].append(floor_s / took)
    med = statistics.median
    result = {
        "device_name": device_name(torch.device("cpu")), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "packs": len(packs), "weight_bytes": n_bytes,
        "pairs": args.pairs, "context": CONTEXT,
        "read_rate_gb_s_min_median_max": [min(rates) / 1e9, med(rates) / 1e9, max(rates) / 1e9],
        "arms": {name: {"ms_median": med(ms[name]), "floor_fraction_median": med(fractions[name]),
                        "floor_fraction_quartiles": statistics.quantiles(fractions[name], n=4)[::2]}
                 for name in arms},
    }
    write_json(args.out, result)
    for name, r in result["arms"].items():
        print(f"{name:12s} {r['ms_median']:6.2f} ms  {r['floor_fraction_median']:.3f} of the floor "
              f"(quartiles {r['floor_fraction_quartiles'][0]:.3f}-{r['floor_fraction_quartiles'][1]:.3f})")
    print("read rate min / median / max GB/s:", ", ".join(f"{v:.1f}" for v in result["read_rate_gb_s_min_median_max"]))


if __name__ == "__main__":
    main()
