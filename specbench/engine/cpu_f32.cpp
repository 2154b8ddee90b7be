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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

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


// ---- Every decoder layer of a decode / verify forward in one call (fp32) ----------------------------
//
// Why: with the GEMV above, an fp32 step of the default target on the 2-core AVX2 EPYC was 35.6 ms, of
// which 21.9 ms the GEMV and the rest ~300 small torch calls (norms, rope, cache writes, SDPA, silu,
// adds) of tens of microseconds each (docs/performance.md "Session 19"). decoder_layers_f32 runs
// model.py's DecoderLayer.forward for every layer in one call: h = norm(x); qkv = h·Wqkvᵀ; rope + cache
// write; attention; delta = ·Woᵀ; x += delta; h = norm(x); x += down(silu(gate) · up).
//
// Every op works row by row (a row = one new token of one sequence) in a fixed order, so a row gets the
// same bits whatever the number of rows and tokens beside it: a verify forward computes each token as
// the AR step it replaces, which keeps greedy speculative decoding token-identical to AR. The bits are
// not those of torch's ops (other summation orders, our own exp), only close to them.

// model.py's RMSNorm of one row: w · (x · 1/sqrt(mean(x²) + eps)); the squares summed in 8 lanes
// (lane l: elements l, l + 8, ...), then horizontal_sum. D a multiple of 8.
inline void norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float r = 1.f / std::sqrt(horizontal_sum(acc) / static_cast<float>(D) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
}

// apply_rope for one head (rotate_half convention): x · cos + rotate_half(x) · sin. hd a multiple of 16.
inline void rope_row(const float* x, const float* c, const float* s, float* out, int64_t hd) {
  const int64_t half = hd / 2;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < hd; i += 8) {
    __m256 rot = _mm256_loadu_ps(x + (i < half ? i + half : i - half));
    if (i < half) rot = _mm256_xor_ps(rot, sign);  // -x by the sign bit
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(c + i)),
                                            _mm256_mul_ps(rot, _mm256_loadu_ps(s + i))));
  }
}

// e^x for x <= 0 (x = -inf gives 0): 2^n · e^r, n = round(x / ln 2), |r| <= ln 2 / 2, Taylor to r^7
// (relative error < 1e-8). Below -87 the result is 0 (e^-87 < 2^-125: it would add nothing a softmax
// over a visible maximum of e^0 keeps).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody-Waite)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// 8 rows of 8 floats → out[c] = element c of every row.
inline void transpose_8x8(const __m256* r, __m256* out) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20); out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20); out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31); out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31); out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// All-ones lanes where key j0 + u (u < 8, j0 + u < L) is visible in this mask row.
inline __m256 visible_8(const bool* mask_row, int64_t j0, int64_t L) {
  alignas(8) uint8_t bytes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(bytes, mask_row + j0, static_cast<size_t>(std::min<int64_t>(8, L - j0)));
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
}

// One item: R query rows q_rows[i] (HD floats) with mask rows mask_rows[i] [L] over keys / values
// K, V [L, HD] (row strides ks, vs) → out_rows[i]. scores: scratch of R · L8 floats, packed: L8 + 8.
//
// Scores: keys in blocks of 8, each block transposed once per item (dimension d of the 8 keys in one
// register), so a query's 8 scores accumulate side by side, one lane per key, over d in a fixed order
// (even and odd d in two chains, added at the end), times 1/√hd; a masked key scores -inf. Softmax:
// p = e^(s - max) (0 where masked); its sum runs over the visible keys' p packed in slot order, so
// the n-th visible key adds into lane n % 8 wherever its slot is; Σ p·v runs over the visible keys in
// slot order, one 8-float chain per 8 dimensions, then times 1/sum. A query's bits therefore depend
// only on which keys it sees and in which order: not on the number of rows or tokens, not on the cache
// length past its last visible slot, not on where its visible keys sit (a tree node seeing its
// ancestors at scattered slots attends exactly as the AR step that saw them in consecutive ones).
// A query that sees no key gives zeros.
template <int HD>
void attend_item(const float* const* q_rows, const bool* const* mask_rows, int R, const float* K, int64_t ks,
                 const float* V, int64_t vs, int64_t L, float scale, float* const* out_rows, float* scores,
                 float* packed) {
  constexpr int OV = HD / 8;
  const int64_t L8 = (L + 7) / 8 * 8;
  alignas(32) __m256 kt[HD];  // the block: dimension d of its 8 keys in kt[d]
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY), sv = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < L8; j0 += 8) {
    for (int c = 0; c < OV; ++c) {
      __m256 rows[8];
      for (int u = 0; u < 8; ++u)
        rows[u] = j0 + u < L ? _mm256_loadu_ps(K + (j0 + u) * ks + 8 * c) : _mm256_setzero_ps();
      transpose_8x8(rows, kt + 8 * c);
    }
    for (int i0 = 0; i0 < R; i0 += 4) {  // 4 queries at a time, two chains each: 8 independent FMA chains
      const int n = std::min(4, R - i0);
      __m256 even[4], odd[4];
      const float* qp[4];
      for (int i = 0; i < 4; ++i) {
        qp[i] = q_rows[i0 + std::min(i, n - 1)];
        even[i] = odd[i] = _mm256_setzero_ps();
      }
      for (int d = 0; d < HD; d += 2)
        for (int i = 0; i < 4; ++i) {
          even[i] = _mm256_fmadd_ps(_mm256_set1_ps(qp[i][d]), kt[d], even[i]);
          odd[i] = _mm256_fmadd_ps(_mm256_set1_ps(qp[i][d + 1]), kt[d + 1], odd[i]);
        }
      for (int i = 0; i < n; ++i) {
        const __m256 dot = _mm256_mul_ps(_mm256_add_ps(even[i], odd[i]), sv);
        _mm256_storeu_ps(scores + (i0 + i) * L8 + j0, _mm256_blendv_ps(minus_inf, dot, visible_8(mask_rows[i0 + i], j0, L)));
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    float* s = scores + i * L8;
    __m256 vmax = minus_inf;
    for (int64_t j0 = 0; j0 < L8; j0 += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    const float row_max = *std::max_element(lanes, lanes + 8);
    if (row_max == -INFINITY) {  // nothing visible
      for (int c = 0; c < OV; ++c) _mm256_storeu_ps(out_rows[i] + 8 * c, _mm256_setzero_ps());
      continue;
    }
    const __m256 mx = _mm256_set1_ps(row_max);
    for (int64_t j0 = 0; j0 < L8; j0 += 8)
      _mm256_storeu_ps(s + j0, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j0), mx)));
    const bool* m = mask_rows[i];
    int64_t n_visible = 0;
    for (int64_t j = 0; j < L; ++j)
      if (m[j]) packed[n_visible++] = s[j];
    for (int64_t j = n_visible; j < (n_visible + 7) / 8 * 8; ++j) packed[j] = 0.f;
    __m256 lsum = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n_visible; j0 += 8) lsum = _mm256_add_ps(lsum, _mm256_loadu_ps(packed + j0));
    const __m256 inv = _mm256_set1_ps(1.f / horizontal_sum(lsum));
    __m256 acc[OV];
    for (int c = 0; c < OV; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      if (!m[j] || s[j] == 0.f) continue;  // a masked key; a visible one whose p underflowed adds nothing
      const __m256 pj = _mm256_set1_ps(s[j]);
      const float* v = V + j * vs;
      for (int c = 0; c < OV; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < OV; ++c) _mm256_storeu_ps(out_rows[i] + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
}

void check_f32_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_cpu(), what, ": float32 CPU tensors only");
}

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_f32_cpu(x, "rms_norm_f32");
  check_f32_cpu(weight, "rms_norm_f32");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  TORCH_CHECK(D % 8 == 0 && weight.numel() == D && weight.is_contiguous(), "rms_norm_f32: x [..., D % 8 == 0], weight [D]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>(); const float* wp = weight.data_ptr<float>(); float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  return y;
}

// Attention's step from the packed projection to the attention: qkv [b, q, (nh + 2 nkv) · hd] →
// rope(q) as [b, nh, q, hd] (returned); rope(k) and v written to k_cache / v_cache [B, nkv, S, hd] at
// each row's slots [b, q]. cos, sin: [b, q, (1,) hd].
at::Tensor qkv_rope_cache_f32(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                              at::Tensor k_cache, at::Tensor v_cache, int64_t nh, int64_t nkv, int64_t hd) {
  for (const at::Tensor& t : {qkv, cos, sin, k_cache, v_cache}) check_f32_cpu(t, "qkv_rope_cache_f32");
  TORCH_CHECK(qkv.dim() == 3, "qkv_rope_cache_f32: qkv [b, q, width]");
  const int64_t b = qkv.size(0), q = qkv.size(1), width = qkv.size(2);
  TORCH_CHECK(width == (nh + 2 * nkv) * hd && hd % 16 == 0, "qkv_rope_cache_f32: width != (nh + 2 nkv) hd, hd % 16 == 0");
  TORCH_CHECK(cos.numel() == b * q * hd && sin.numel() == b * q * hd, "qkv_rope_cache_f32: cos / sin [b, q, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == b * q, "qkv_rope_cache_f32: slots [b, q] int64");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
              k_cache.size(0) >= b && v_cache.size(0) >= b && k_cache.size(1) == nkv && k_cache.size(3) == hd &&
              v_cache.size(1) == nkv && v_cache.size(3) == hd, "qkv_rope_cache_f32: caches [B >= b, nkv, S, hd]");
  const at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), slc = slots.contiguous();
  at::Tensor out = at::empty({b, nh, q, hd}, qkv.options());
  const float* p = qc.data_ptr<float>(); const float* cp = cc.data_ptr<float>(); const float* sp = sc.data_ptr<float>();
  const int64_t* sl = slc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>(); float* kp = k_cache.data_ptr<float>(); float* vp = v_cache.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t t = 0; t < q; ++t) {
      const float* row = p + (r * q + t) * width;
      const float* c = cp + (r * q + t) * hd; const float* s = sp + (r * q + t) * hd;
      const int64_t slot = sl[r * q + t];
      TORCH_CHECK(slot >= 0 && slot < k_cache.size(2) && slot < v_cache.size(2), "qkv_rope_cache_f32: slot out of range");
      for (int64_t h = 0; h < nh; ++h) rope_row(row + h * hd, c, s, op + ((r * nh + h) * q + t) * hd, hd);
      for (int64_t h = 0; h < nkv; ++h) {
        rope_row(row + (nh + h) * hd, c, s, kp + r * ks0 + h * ks1 + slot * ks2, hd);
        std::memcpy(vp + r * vs0 + h * vs1 + slot * vs2, row + (nh + nkv + h) * hd, sizeof(float) * hd);
      }
    }
  return out;
}

// q [b, nh, q, hd] (rope applied), caches [B >= b, nkv, S, hd], mask [b, q, L] bool → [b, q, nh · hd],
// o_proj's input. Query head h reads KV head h / (nh / nkv), as model.py's folded SDPA.
at::Tensor attend_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& mask) {
  for (const at::Tensor& t : {q, k_cache, v_cache}) check_f32_cpu(t, "attend_f32");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && mask.dim() == 3,
              "attend_f32: q [b, nh, q, hd], caches [B, nkv, S, hd], mask [b, q, L]");
  const int64_t b = q.size(0), nh = q.size(1), nq = q.size(2), hd = q.size(3), nkv = k_cache.size(1), L = mask.size(2);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == b && mask.size(1) == nq, "attend_f32: mask [b, q, L] bool");
  TORCH_CHECK((hd == 64 || hd == 128) && nh % nkv == 0, "attend_f32: hd 64 or 128, nh a multiple of nkv");
  TORCH_CHECK(k_cache.size(0) >= b && v_cache.size(0) >= b && v_cache.size(1) == nkv && k_cache.size(3) == hd &&
              v_cache.size(3) == hd && k_cache.size(2) >= L && v_cache.size(2) >= L && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1, "attend_f32: caches [B >= b, nkv, S >= L, hd]");
  const at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({b, nq, nh * hd}, q.options());
  const float* qp = qc.data_ptr<float>(); const bool* mp = mc.data_ptr<bool>();
  const float* kp = k_cache.data_ptr<float>(); const float* vp = v_cache.data_ptr<float>(); float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t G = nh / nkv;
  // An item is one row, one KV head and up to 8 of the row's tokens (each item transposes the keys once);
  // few enough tokens an item for two items a thread where rows and KV heads alone give fewer. A
  // query's bits do not depend on the grouping.
  const int64_t want = 2 * at::get_num_threads(), per_token_group = b * nkv;
  const int64_t groups = std::min<int64_t>(nq, std::max<int64_t>(1, (want + per_token_group - 1) / per_token_group));
  const int64_t kChunk = std::min<int64_t>(8, (nq + groups - 1) / groups);
  const int64_t chunks = (nq + kChunk - 1) / kChunk, R = std::min(nq, kChunk) * G;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int64_t L8 = (L + 7) / 8 * 8;
  at::parallel_for(0, b * nkv * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(R * L8)), packed(static_cast<size_t>(L8 + 8));
    std::vector<const float*> q_rows(R); std::vector<const bool*> mask_rows(R); std::vector<float*> out_rows(R);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t chunk = item % chunks, h = (item / chunks) % nkv, r = item / (chunks * nkv);
      const int64_t t0 = chunk * kChunk, t1 = std::min(nq, t0 + kChunk);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t head = h * G + g, i = (t - t0) * G + g;
          q_rows[i] = qp + ((r * nh + head) * nq + t) * hd;
          mask_rows[i] = mp + (r * nq + t) * L;
          out_rows[i] = op + (r * nq + t) * nh * hd + head * hd;
        }
      const float* Kh = kp + r * ks0 + h * ks1; const float* Vh = vp + r * vs0 + h * vs1;
      const int rows = static_cast<int>((t1 - t0) * G);
      if (hd == 64) attend_item<64>(q_rows.data(), mask_rows.data(), rows, Kh, ks2, Vh, vs2, L, scale, out_rows.data(),
                                    scores.data(), packed.data());
      else attend_item<128>(q_rows.data(), mask_rows.data(), rows, Kh, ks2, Vh, vs2, L, scale, out_rows.data(),
                            scores.data(), packed.data());
    }
  });
  return out;
}

// silu(gate) · up for gate_up = [..., gate | up]: silu(g) = g · sigmoid(g), sigmoid from e^-|g|.
at::Tensor silu_mul_f32(const at::Tensor& gate_up) {
  check_f32_cpu(gate_up, "silu_mul_f32");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  TORCH_CHECK(gate_up.size(-1) == 2 * I && I % 8 == 0, "silu_mul_f32: [..., 2 I], I % 8 == 0");
  const at::Tensor x = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* xp = x.data_ptr<float>(); float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = xp + r * 2 * I; const float* u = g + I; float* o = op + r * I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // e^-|g|
      const __m256 negative = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
      const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid), _mm256_loadu_ps(u + i)));
    }
  }
  return out;
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return gemv_f32(x.reshape({-1, x.size(-1)}), w).view(shape);
}

// Every layer, one call: the lists hold one tensor per layer (norm weights; the q|k|v, o, gate|up and
// down weights [n, k] contiguous; the caches). Returns the last layer's output and the outputs of the
// layers in `taps` (increasing).
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers_f32(
    at::Tensor x, at::TensorList input_norms, at::TensorList qkv, at::TensorList o, at::TensorList post_norms,
    at::TensorList gate_up, at::TensorList down, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& mask, double eps, int64_t nh, int64_t nkv, int64_t hd,
    at::IntArrayRef taps) {
  const size_t n_layers = input_norms.size();
  for (at::TensorList list : {qkv, o, post_norms, gate_up, down, k_caches, v_caches})
    TORCH_CHECK(list.size() == n_layers, "decoder_layers_f32: one tensor per layer in every list");
  check_f32_cpu(x, "decoder_layers_f32");
  x = x.contiguous();
  std::vector<at::Tensor> tapped;
  size_t next_tap = 0;
  for (size_t i = 0; i < n_layers; ++i) {
    at::Tensor xq = qkv_rope_cache_f32(linear_rows(rms_norm_f32(x, input_norms[i], eps), qkv[i]), cos, sin, slots,
                                       k_caches[i], v_caches[i], nh, nkv, hd);
    x = x + linear_rows(attend_f32(xq, k_caches[i], v_caches[i], mask), o[i]);
    x = x + linear_rows(silu_mul_f32(linear_rows(rms_norm_f32(x, post_norms[i], eps), gate_up[i])), down[i]);
    if (next_tap < taps.size() && taps[next_tap] == static_cast<int64_t>(i)) {
      tapped.push_back(x);
      ++next_tap;
    }
  }
  return {x, tapped};
}

}  // namespace

TORCH_LIBRARY(specbench_cpu_f32, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def("rms_norm_f32(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qkv_rope_cache_f32(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int nh, int nkv, int hd) -> Tensor");
  m.def("attend_f32(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask) -> Tensor");
  m.def("silu_mul_f32(Tensor gate_up) -> Tensor");
  m.def("decoder_layers_f32(Tensor x, Tensor[] input_norms, Tensor[] qkv, Tensor[] o, Tensor[] post_norms, "
        "Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor mask, float eps, int nh, int nkv, int hd, int[] taps) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(specbench_cpu_f32, CPU, m) {
  m.impl("gemv_f32", &gemv_f32);
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("qkv_rope_cache_f32", &qkv_rope_cache_f32);
  m.impl("attend_f32", &attend_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("decoder_layers_f32", &decoder_layers_f32);
}
