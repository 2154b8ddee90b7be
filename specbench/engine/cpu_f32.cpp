// fp32 GEMV for decode and verify forwards on a CPU with AVX2 + FMA (cpu_f32.py says when it runs).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for the few rows m of a decode step (b rows) or a verify step
// (b * q rows). Why not F.linear: on a 2-core AVX2-only AMD EPYC, torch's fp32 GEMM read the target's
// weights at 8-9 GB/s for 2 to 8 rows against 14 GB/s for one row and 25 GB/s for a plain sum
// (docs/performance.md "Session 18"), so a verify over 8 tokens cost 1.9x a decode step. Here each
// weight row is read from memory once per call, whatever the number of rows, and multiplied with
// every row of x while it sits in L1.
//
// Every output is reduced in the same fixed order (one 8-lane FMA chain over k in steps of 8, a
// fixed horizontal sum, then the scalar tail), alone or beside other rows and on any split over
// threads: a verify forward's projections give each row the bits of the AR step it replaces, and the
// same bits on every x86 CPU with AVX2 + FMA. Built with -ffp-contract=off so the tail is not fused
// differently in different instantiations.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

// A block of outputs: NW weight rows times R rows of x, one 8-lane accumulator each (3 x 4 = 12 of
// the 16 ymm registers, 3 more for the weight vectors), so every k-step loads NW + R vectors for
// NW * R FMAs, and 12 independent chains cover the FMA latency.
constexpr int kWeightRows = 3, kXRows = 4;

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r * ldy + c] = w[c] . x[r] for c < NW, r < R (w rows and x rows of length k, strides k).
// Each output is one chain of FMAs over k in steps of 8, a fixed horizontal sum, then the scalar
// tail: the same operations in the same order in every block shape.
template <int NW, int R>
inline void dot_block(const float* w, const float* x, int64_t k, float* y, int64_t ldy) {
  __m256 acc[NW][R];
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    __m256 wv[NW];
    for (int c = 0; c < NW; ++c) wv[c] = _mm256_loadu_ps(w + c * k + j);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + j);
      for (int c = 0; c < NW; ++c) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
  for (int c = 0; c < NW; ++c)
    for (int r = 0; r < R; ++r) {
      float s = horizontal_sum(acc[c][r]);
      for (int64_t t = j; t < k; ++t) s += w[c * k + t] * x[r * k + t];
      y[r * ldy + c] = s;
    }
}

// Weight rows [i, i + NW) against every row of x.
template <int NW>
inline void weight_rows(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t n) {
  int64_t r = 0;
  for (; r + kXRows <= m; r += kXRows) dot_block<NW, kXRows>(w, x + r * k, k, y + r * n, n);
  switch (m - r) {
    case 3: dot_block<NW, 3>(w, x + r * k, k, y + r * n, n); break;
    case 2: dot_block<NW, 2>(w, x + r * k, k, y + r * n, n); break;
    case 1: dot_block<NW, 1>(w, x + r * k, k, y + r * n, n); break;
    default: break;
  }
}

// Up to 8 rows of x (a decode step, or a verify over q <= 8 tokens at b = 1): one weight row against
// all of them in one pass, 8 accumulators + 1 weight + 1 x vector in registers. Each weight vector is
// loaded once and used m times while the next ones stream in; the blocked path above loads it again
// per block of 4 rows and waits on memory in the first block only. Measured over the default target's
// 538 MB of weight matrices on the 2-core AVX2 EPYC (docs/performance.md "Session 19"): 8-17% less
// time at 2-8 rows, the same at 1. The per-output arithmetic is the blocked path's, so the bits are too.
constexpr int kOnePassRows = 8;

inline void one_weight_row(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t n) {
  switch (m) {
    case 1: dot_block<1, 1>(w, x, k, y, n); break;
    case 2: dot_block<1, 2>(w, x, k, y, n); break;
    case 3: dot_block<1, 3>(w, x, k, y, n); break;
    case 4: dot_block<1, 4>(w, x, k, y, n); break;
    case 5: dot_block<1, 5>(w, x, k, y, n); break;
    case 6: dot_block<1, 6>(w, x, k, y, n); break;
    case 7: dot_block<1, 7>(w, x, k, y, n); break;
    case 8: dot_block<1, 8>(w, x, k, y, n); break;
    default: break;  // m == 0: nothing to write
  }
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_f32: x [m, k] and w [n, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv_f32: float32 only");
  TORCH_CHECK(w.is_contiguous(), "gemv_f32: w must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = w.size(0);
  at::Tensor y = at::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (m <= kOnePassRows) {
    at::parallel_for(0, n, 24, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) one_weight_row(wp + c * k, xp, m, k, yp + c, n);
    });
    return y;
  }
  const int64_t pairs = (n + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, pairs, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = p * kWeightRows;
      if (i + kWeightRows <= n)
        weight_rows<kWeightRows>(wp + i * k, xp, m, k, yp + i, n);
      else
        for (int64_t c = i; c < n; ++c) weight_rows<1>(wp + c * k, xp, m, k, yp + c, n);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specbench_cpu_f32, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbench_cpu_f32, CPU, m) {
  m.impl("gemv_f32", &gemv_f32);
}
