// bf16 kernels for the decode step on a CPU with AVX-512 BF16 (loaded by engine/cpu_kernels.py):
// the few-row GEMV that streams the weights, and the small per-row ops around it fused, so that a
// decode step is not ~1 500 separate torch calls of a few microseconds each.
//
// 1. gemv_bf16: y = x · Wᵀ for a few rows of x: up to 64 (AMX tiles) or 8 (AVX-512 BF16) in use.
//
// Why a GEMV of our own: at b = 1 a decode step of the default target is ~150 matrix-vector
// products over 269 MB of bf16 weights that no cache holds, so the step is as fast as those weights
// stream from memory. torch's routes (torch.mv, oneDNN's GEMM) streamed them at 7-14 GB/s on the
// 2-core Xeon, against ~20 GB/s for a plain 1 GiB sum (docs/performance.md "A bf16 GEMV of our
// own"); and a verify forward of 8 rows cost oneDNN about as much again as one row.
//
// The weight is packed once (cpu_kernels.py: pack) into blocks of 32 output features:
//   packed[block][k / 2][feature in block][k % 2]
// so one 64-byte load holds a pair of k for 16 features, and VDPBF16PS multiplies it by the same
// pair of x broadcast to every lane: 16 outputs accumulate side by side in one register, with no
// horizontal sum. Each thread streams a contiguous run of blocks once for all rows of x (≤ 8 rows
// share one pass, in registers), prefetching 32 KB ahead into L2 at 1-2 and 5-8 rows (below).
//
// Every output y[m, n] is one fp32 lane summing the pairs of k in increasing order, then rounded
// to bf16 (round to nearest even). Neither the number of rows of x nor the split over threads
// changes that sequence, so a row gets the same bits alone or among up to 8 (tests/test_cpu_kernels.py).
//
// Where the CPU has AMX and Linux grants it (arch_prctl), and K is a multiple of 32, the same packed
// blocks feed TDPBF16PS instead: [16 rows × 32] tiles of x times two [16 pairs × 16 features]
// tiles of the block, accumulated in two fp32 tiles, each block read from memory once for all rows.
// The layout is AMX's own B-tile layout, so no second copy. VDPBF16PS is compute-bound at 8 rows
// (~0.5 per cycle here: 8 rows cost 1.3× one row); AMX kept 16 rows at ~1.1× and 64 rows below
// oneDNN's GEMM (docs/performance.md "A bf16 GEMV of our own"). Each row is again computed alone in
// fixed k order; on the Xeon measured, AMX and AVX-512 gave the same bits.
//
// 2. rms_norm_bf16, add_rms_norm_bf16, qkv_rope_cache_bf16: one call each for what model.py's
// RMSNorm, a residual add followed by RMSNorm, and Attention's split / rope / cache write do in
// 8-25 torch calls. Each works row by row, so it too gives a row the same bits in any batch.
//
// 3. attend_bf16: attention of a few new queries per row over the cache, in place of SDPA for
// decode and verify forwards; 4. silu_mul_bf16: the MLP's silu(gate) · up; 5. decoder_layers_bf16:
// every layer in one call, and decoder_forward_bf16 a whole decode or verify forward; 6. argmax_bf16:
// greedy ids; 7. markov_draft_bf16: DSpark's greedy Markov head; 8. dspark_round_bf16: a whole greedy
// DSpark drafting round (all below, before the operator registrations).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kBlock = 32;          // output features per block: two registers of 16 lanes
constexpr int kMaxRows = 8;             // rows of x per pass: 16 accumulators + 2 weight registers
// Software prefetch of the weight stream (the route of CPUs without AMX, and beside AMX of K not a multiple of 32).
// Up to 4 rows the hardware prefetchers alone stream fastest; from 5 rows, where a byte of weight costs
// the most VDPBF16PS work, prefetching into L2 32 KB ahead lets the stream overlap that work. Measured on
// the 2-core AMD EPYC (Zen 4), the real target's GEMV sequence, 120-200 interleaved repeats against the
// earlier 8 KB-ahead T0 prefetch at every row count: 1-4 rows 6-7% faster, 8 rows 16% faster
// (docs/performance.md "Session 13"). At 1-2 rows one prefetch per 128-byte step (the even line; the
// L2's adjacent-line prefetch brings its pair) 32 KB ahead into L2 beat the hardware alone by 2-3% of a
// whole b = 1 step, on a cold cache in both of the machine's memory phases; at 4 rows it cost 15%
// (docs/performance.md "Session 23"), so 3-4 rows keep the hardware's stream alone.
constexpr int kFarPrefetchRows = 5;
constexpr int kNearPrefetchRows = 2;
constexpr int64_t kPrefetch = 16384;    // elements (32 KB) ahead, into L2

template <int MT>
void rows_by_block(const bf16* x, int64_t K, const bf16* block, bf16* y, int64_t N, int64_t n0, bool prefetch) {
  // All loops over i are unrolled so the accumulators stay in registers.
  __m512 acc[MT][2];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const bf16* w = block + kp * 2 * kBlock;
    if (MT >= kFarPrefetchRows && prefetch) {  // never faults, even past the end of the tensor
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + 32), _MM_HINT_T1);
    } else if (MT <= kNearPrefetchRows && prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + i * K + 2 * kp));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xk);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xk);
    }
  }
  const int64_t valid = std::min<int64_t>(kBlock, N - n0);  // the last block is zero-padded
  const __mmask16 low = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 high = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    _mm256_mask_storeu_epi16(y + i * N + n0, low, (__m256i)_mm512_cvtneps_pbh(acc[i][0]));
    _mm256_mask_storeu_epi16(y + i * N + n0 + 16, high, (__m256i)_mm512_cvtneps_pbh(acc[i][1]));
  }
}

void any_rows(int rows, const bf16* x, int64_t K, const bf16* block, bf16* y, int64_t N, int64_t n0, bool prefetch) {
  switch (rows) {
    case 8: rows_by_block<8>(x, K, block, y, N, n0, prefetch); break;
    case 7: rows_by_block<7>(x, K, block, y, N, n0, prefetch); break;
    case 6: rows_by_block<6>(x, K, block, y, N, n0, prefetch); break;
    case 5: rows_by_block<5>(x, K, block, y, N, n0, prefetch); break;
    case 4: rows_by_block<4>(x, K, block, y, N, n0, prefetch); break;
    case 3: rows_by_block<3>(x, K, block, y, N, n0, prefetch); break;
    case 2: rows_by_block<2>(x, K, block, y, N, n0, prefetch); break;
    default: rows_by_block<1>(x, K, block, y, N, n0, prefetch); break;
  }
}

// ---- AMX ----------------------------------------------------------------------------------------

constexpr int kAmxRows = 16;
constexpr int64_t kAmxPrefetch = 4096;  // elements (8 KB) ahead, into L1: the best of 4-64 KB and T0/T1/T2 on the AMX Xeon

struct alignas(64) TileConfig {  // the LDTILECFG memory layout (palette 1)
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX tile state only on request (once per process).
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Tiles: 0 = x rows [M × 32 bf16], 1 and 2 = the block's features 0-15 and 16-31 over 16 pairs of
// k [16 × 16 × 2 bf16], 3 and 4 = their fp32 sums [M × 16].
void configure_tiles(int rows) {
  TileConfig cfg;
  cfg.rows[0] = rows;
  cfg.colsb[0] = 64;
  for (int t : {1, 2}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t : {3, 4}) {
    cfg.rows[t] = rows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

void gemv_amx(const bf16* xp, const bf16* wp, bf16* yp, int64_t M, int64_t K, int64_t N, int64_t blocks) {
  // Rows go through the tiles 16 at a time; x is zero-padded to a multiple of 16 so that every tile
  // is full (a padding row is computed and dropped: rows never mix).
  const int64_t chunks = (M + kAmxRows - 1) / kAmxRows;
  std::vector<bf16> padded;
  const bf16* xs = xp;
  if (M % kAmxRows) {
    padded.assign(chunks * kAmxRows * K, bf16(0.f));
    std::memcpy(padded.data(), xp, M * K * sizeof(bf16));
    xs = padded.data();
  }
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    configure_tiles(kAmxRows);  // tile state is per thread
    alignas(64) float sums[kAmxRows][kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* block = wp + b * kBlock * K;
      const int64_t n0 = b * kBlock, valid = std::min<int64_t>(kBlock, N - n0);  // the last block is zero-padded
      const __mmask16 low = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
      const __mmask16 high = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
      for (int64_t c = 0; c < chunks; ++c) {  // the block is read from memory once, then from cache
        _tile_zero(3);
        _tile_zero(4);
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
          const bf16* w = block + k0 * kBlock;  // 16 pairs of k × 32 features × 2: 2 KB
          if (c == 0)
            for (int i = 0; i < 16 * 2 * kBlock; i += 32)  // one line in 64 bytes, kAmxPrefetch ahead
              _mm_prefetch(reinterpret_cast<const char*>(w + kAmxPrefetch + i), _MM_HINT_T0);
          _tile_loadd(0, xs + c * kAmxRows * K + k0, K * 2);
          _tile_loadd(1, w, 4 * kBlock);  // a row of k pairs is 32 features × 2 bf16 = 128 bytes
          _tile_loadd(2, w + kBlock, 4 * kBlock);
          _tile_dpbf16ps(3, 0, 1);
          _tile_dpbf16ps(4, 0, 2);
        }
        _tile_stored(3, &sums[0][0], kBlock * 4);
        _tile_stored(4, &sums[0][16], kBlock * 4);
        const int64_t rows = std::min<int64_t>(kAmxRows, M - c * kAmxRows);
        for (int64_t m = 0; m < rows; ++m) {  // round to bf16 (nearest even), 16 at a time
          bf16* out = yp + (c * kAmxRows + m) * N + n0;
          _mm256_mask_storeu_epi16(out, low, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&sums[m][0])));
          _mm256_mask_storeu_epi16(out + 16, high, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&sums[m][16])));
        }
      }
    }
    _tile_release();
  });
}

// Chosen by K and the machine alone, never by the row count: a row's bits may not depend on it.
bool amx_applies(int64_t K) { return K % 32 == 0 && amx_ready(); }

bool amx_available() { return amx_ready(); }

// Checks that `packed` is gemv_bf16's pack for inputs of width K and N outputs.
void check_pack(const at::Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 4, "gemv_bf16: packed [blocks, K/2, 32, 2]");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) == K / 2 && packed.size(2) == kBlock && packed.size(3) == 2 &&
              blocks * kBlock >= N && (blocks - 1) * kBlock < N, "gemv_bf16: packed does not match x and N");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.is_cpu(),
              "gemv_bf16: a contiguous bf16 CPU pack");
}

// y [M, N] = x [M, K] · Wᵀ from W's pack (check_pack'ed), into y.
void gemv_into(const bf16* xp, int64_t M, int64_t K, const at::Tensor& packed, int64_t N, bf16* yp) {
  const int64_t blocks = packed.size(0);
  const bf16* wp = packed.data_ptr<bf16>();
  if (amx_applies(K)) {
    gemv_amx(xp, wp, yp, M, K, N, blocks);
    return;
  }
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)  // more than 8 rows: another pass, from cache
        any_rows(static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), xp + m0 * K, K, wp + b * kBlock * K,
                 yp + m0 * N, N, b * kBlock, m0 == 0);
  });
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "gemv_bf16: x [M, K], packed [blocks, K/2, 32, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.is_cpu(), "gemv_bf16: x contiguous bf16 on a CPU");
  check_pack(packed, x.size(1), N);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  gemv_into(x.data_ptr<bf16>(), x.size(0), x.size(1), packed, N, y.data_ptr<bf16>());
  return y;
}

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

void check_bf16_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_cpu(), what, ": bf16 CPU tensors only");
}

// An RMSNorm weight for rows of D: bf16 [D], contiguous.
void check_norm_weight(const at::Tensor& w, int64_t D) {
  check_bf16_cpu(w, "rms_norm_bf16");
  TORCH_CHECK(w.numel() == D && w.is_contiguous(), "rms_norm_bf16: weight [D]");
}

// A layer's K and V caches for b rows: bf16 [B >= b, nkv, S >= min_slots, hd], each row of hd contiguous.
void check_caches(const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t nkv, int64_t hd, int64_t min_slots,
                  const char* what) {
  for (const at::Tensor& t : {k, v}) check_bf16_cpu(t, what);
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.stride(3) == 1 && v.stride(3) == 1 && k.size(0) >= b &&
              v.size(0) >= b && k.size(1) == nkv && v.size(1) == nkv && k.size(3) == hd && v.size(3) == hd &&
              k.size(2) >= min_slots && v.size(2) >= min_slots,
              what, ": caches [B >= b, nkv, S", min_slots ? " >= L" : "", ", hd]");
}

// model.py's RMSNorm for one row: weight · bf16(x · rsqrt(mean(x²) + eps)), the mean and the
// product in fp32. The sum of squares runs in its own fixed order (below), so its last bits may
// differ from torch's vectorised mean; the roundings are torch's.
void norm_row(const bf16* x, const bf16* w, bf16* y, int64_t D, float eps) {
  // Squares summed in 16 fp32 lanes (lane l takes elements l, l + 16, ...), the lanes then added by
  // _mm512_reduce_add_ps: a fixed order for a given D, whatever the row's neighbours.
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __mmask16 m = D - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (D - i)) - 1u);
    const __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, x + i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < D; i += 16) {
    const __mmask16 m = D - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (D - i)) - 1u);
    const __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, x + i));
    const __m512 normed = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(v, rv)));  // bf16(x · r)
    const __m512 wv = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, w + i));
    _mm256_mask_storeu_epi16(y + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(wv, normed)));
  }
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16_cpu(x, "rms_norm_bf16");
  check_norm_weight(weight, x.size(-1));
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>(); const bf16* wp = weight.data_ptr<bf16>(); bf16* yp = y.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  return y;
}

// s = bf16(x + delta) over n elements, as torch's bf16 add rounds (s may be x).
void add_into(const bf16* xp, const bf16* dp, bf16* sp, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, xp + i));
    const __m512 d = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, dp + i));
    _mm256_mask_storeu_epi16(sp + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, d)));
  }
}

// s = x + delta (add_into) and y = RMSNorm(s) for `rows` rows of D (s may be x).
void add_norm_into(const bf16* xp, const bf16* dp, const bf16* wp, bf16* sp, bf16* yp, int64_t rows, int64_t D, double eps) {
  add_into(xp, dp, sp, rows * D);
  for (int64_t r = 0; r < rows; ++r) norm_row(sp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
}

// (x + delta, RMSNorm of it): a residual add (rounded to bf16 as torch's add rounds) and the norm
// that follows it in a decoder layer.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                     double eps) {
  check_bf16_cpu(x, "add_rms_norm_bf16");
  check_bf16_cpu(delta, "add_rms_norm_bf16");
  check_bf16_cpu(weight, "add_rms_norm_bf16");
  TORCH_CHECK(x.sizes() == delta.sizes() && weight.numel() == x.size(-1) && weight.is_contiguous(),
              "add_rms_norm_bf16: x and delta [..., D], weight [D]");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor xc = x.contiguous(), dc = delta.contiguous();
  at::Tensor s = at::empty_like(xc), y = at::empty_like(xc);
  add_norm_into(xc.data_ptr<bf16>(), dc.data_ptr<bf16>(), weight.data_ptr<bf16>(), s.data_ptr<bf16>(), y.data_ptr<bf16>(),
                rows, D, eps);
  return {s, y};
}

// model.py's apply_rope for one head (transformers' rotate_half convention) with torch's roundings,
// so the same bits: bf16(bf16(x · cos) + bf16(rotate_half(x) · sin)).
inline void rope_row(const bf16* x, const bf16* c, const bf16* s, bf16* out, int64_t hd) {
  const int64_t half = hd / 2;
  if (half % 16 == 0) {  // 16 elements at a time, the same operations per element as the loop below
    for (int64_t i = 0; i < hd; i += 16) {
      const __m512 xv = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(x + i)));
      __m512 rot = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(x + (i < half ? i + half : i - half))));
      if (i < half)  // -x by its sign bit, as the scalar negation (0 - x would turn -0 into +0)
        rot = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(rot), _mm512_set1_epi32(INT32_MIN)));
      const __m512 cv = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(c + i)));
      const __m512 sv = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(s + i)));
      const __m512 a = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(xv, cv)));
      const __m512 b = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(rot, sv)));
      _mm256_storeu_si256((__m256i*)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    }
    return;
  }
  for (int64_t i = 0; i < hd; ++i) {
    const float rot = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    out[i] = bf16(round_bf16(static_cast<float>(x[i]) * static_cast<float>(c[i])) + round_bf16(rot * static_cast<float>(s[i])));
  }
}

void qkv_rope_cache_into(const bf16* p, int64_t b, int64_t q, const bf16* cp, const bf16* sp, const int64_t* sl,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t nh, int64_t nkv, int64_t hd,
                         bf16* op);

// Attention's step from the packed projection to SDPA: qkv [b, q, (nh + 2 nkv) · hd] →
// rope(q) as [b, nh, q, hd] (returned: SDPA's layout, and folded GQA's by a view), rope(k) and v
// written to k_cache / v_cache [B, nkv, S, hd] at each row's slots [b, q]. cos, sin: [b, q, (1,) hd].
at::Tensor qkv_rope_cache_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                               at::Tensor k_cache, at::Tensor v_cache, int64_t nh, int64_t nkv, int64_t hd) {
  for (const at::Tensor& t : {qkv, cos, sin}) check_bf16_cpu(t, "qkv_rope_cache_bf16");
  TORCH_CHECK(qkv.dim() == 3, "qkv_rope_cache_bf16: qkv [b, q, width]");
  const int64_t b = qkv.size(0), q = qkv.size(1), width = qkv.size(2);
  TORCH_CHECK(width == (nh + 2 * nkv) * hd && hd % 2 == 0, "qkv_rope_cache_bf16: width != (nh + 2 nkv) hd");
  TORCH_CHECK(cos.numel() == b * q * hd && sin.numel() == b * q * hd, "qkv_rope_cache_bf16: cos / sin [b, q, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == b * q, "qkv_rope_cache_bf16: slots [b, q] int64");
  check_caches(k_cache, v_cache, b, nkv, hd, 0, "qkv_rope_cache_bf16");
  at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), slc = slots.contiguous();
  at::Tensor out = at::empty({b, nh, q, hd}, qkv.options());
  qkv_rope_cache_into(qc.data_ptr<bf16>(), b, q, cc.data_ptr<bf16>(), sc.data_ptr<bf16>(), slc.data_ptr<int64_t>(),
                      k_cache, v_cache, nh, nkv, hd, out.data_ptr<bf16>());
  return out;
}

// qkv_rope_cache_bf16's work on raw rows (qkv [b, q, (nh + 2 nkv) hd], cos / sin [b, q, hd], slots
// [b, q], all contiguous), the rope'd queries into out [b, nh, q, hd]; the caches as checked there.
void qkv_rope_cache_into(const bf16* p, int64_t b, int64_t q, const bf16* cp, const bf16* sp, const int64_t* sl,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t nh, int64_t nkv, int64_t hd,
                         bf16* op) {
  const int64_t width = (nh + 2 * nkv) * hd;
  bf16* kp = k_cache.data_ptr<bf16>(); bf16* vp = v_cache.data_ptr<bf16>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t t = 0; t < q; ++t) {
      const bf16* row = p + (r * q + t) * width;
      const bf16* c = cp + (r * q + t) * hd; const bf16* s = sp + (r * q + t) * hd;
      const int64_t slot = sl[r * q + t];
      TORCH_CHECK(slot >= 0 && slot < k_cache.size(2) && slot < v_cache.size(2), "qkv_rope_cache_bf16: slot out of range");
      for (int64_t h = 0; h < nh; ++h) rope_row(row + h * hd, c, s, op + ((r * nh + h) * q + t) * hd, hd);
      for (int64_t h = 0; h < nkv; ++h) {
        rope_row(row + (nh + h) * hd, c, s, kp + r * ks0 + h * ks1 + slot * ks2, hd);
        const bf16* v = row + (nh + nkv + h) * hd; bf16* vd = vp + r * vs0 + h * vs1 + slot * vs2;
        for (int64_t i = 0; i < hd; ++i) vd[i] = v[i];
      }
    }
}
// 3. attend_bf16: softmax(q·kᵀ / √hd + mask) · v for each query row over the cache, the new
// queries' keys and values already written (qkv_rope_cache_bf16). SDPA took ~40 µs a layer for one
// decode query at 320 cached slots on the 2-core Xeon, most of it set-up; the work is ~10 µs.
//
// One item is one row, one KV head and up to 8 of the row's tokens: the tokens × `group` query heads
// that read that KV head.
// Keys go in blocks of 16, each block transposed once per item into pairs of dimensions × 16 keys
// (the layout VDPBF16PS wants), so one query's 16 scores accumulate side by side, pair by pair in
// increasing order, in fp32. Then a vector exp, the softmax sum per lane, and Σ p·v over the keys in
// increasing order, in fp32, skipping terms whose p is 0; the output is rounded to bf16 once. A
// masked key scores -inf, i.e. p = 0, and the softmax's sum runs over the visible keys packed in
// slot order, so a query's bits depend on neither the number of rows, nor of tokens per row, nor
// the cache length past its last visible slot, nor the slots its visible keys sit in: a chain or
// tree verify forward attends exactly as the AR steps it replaces. A query that sees no slot gives
// zeros (SDPA: NaN).

// e^x for x <= 0 (x = -inf gives 0): 2^n · e^r, n = round(x / ln 2), |r| <= ln 2 / 2, Taylor to r^7.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 dead = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody-Waite)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~dead), _mm512_scalef_ps(p, n));
}

// 16 rows of 16 dwords → out[p] = dword p of every row (a 16 × 16 transpose of 32-bit elements).
inline void transpose_16x16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + c], 128-bit lane L: dword 4L + c of rows 4a .. 4a + 3
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Bit u set where key j0 + u < L is visible in this mask row.
inline __mmask16 visible_16(const bool* mask_row, int64_t j0, int64_t L) {
  const __mmask16 in_range = L - j0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j0)) - 1u);
  const __m128i bytes = _mm_maskz_loadu_epi8(in_range, mask_row + j0);
  return _mm_mask_cmpneq_epi8_mask(in_range, bytes, _mm_setzero_si128());
}

// Scores of N ≤ 4 query rows against one block of 16 keys (kt: pair p of the 16 keys in kt[p]), scaled,
// -inf where the mask hides a key, into scores + i · L16 + j0. N is a template argument so that the
// accumulators stay in registers (a runtime count spilled them); each row is summed alone, so its bits
// do not depend on N.
template <int N, int PAIRS>
inline void scores_group(const bf16* const* q_rows, const bool* const* mask_rows, const __m512i* kt, int64_t j0,
                         int64_t L, int64_t L16, float scale, float* scores) {
  __m512 even[N], odd[N];
  const int32_t* qp[N];
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) {
    qp[i] = reinterpret_cast<const int32_t*>(q_rows[i]);
    even[i] = odd[i] = _mm512_setzero_ps();
  }
  for (int p = 0; p < PAIRS; p += 2) {
    const __m512bh k0 = (__m512bh)kt[p], k1 = (__m512bh)kt[p + 1];
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {
      even[i] = _mm512_dpbf16_ps(even[i], k0, (__m512bh)_mm512_set1_epi32(qp[i][p]));
      odd[i] = _mm512_dpbf16_ps(odd[i], k1, (__m512bh)_mm512_set1_epi32(qp[i][p + 1]));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) {
    const __m512 dot = _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(scale));
    _mm512_storeu_ps(scores + i * L16 + j0,
                     _mm512_mask_blend_ps(visible_16(mask_rows[i], j0, L), _mm512_set1_ps(-INFINITY), dot));
  }
}

// out_rows[i] = bf16(Σ_j p_i[j] · V[j] · inv_sum[i]) for N ≤ 4 rows of probabilities p_i = probs + i · L16,
// the keys in slot order, fp32; keys no row sees are skipped (adding a p of 0 changes no bit). N is a
// template argument for the same reason as in scores_group.
template <int N, int OV>
inline void values_group(const float* probs, int64_t L16, const float* inv_sum, const bf16* V, int64_t vs, int64_t L,
                         bf16* const* out_rows) {
  __m512 acc[N][OV];
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < OV; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    bool any = false;
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) any |= probs[i * L16 + j] != 0.f;
    if (!any) continue;
    const bf16* v = V + j * vs;
    __m512 vf[OV];
#pragma GCC unroll 8
    for (int c = 0; c < OV; ++c) vf[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(v + 16 * c)));
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {  // a p of 0 adds exact zeros (finite cache values)
      const __m512 pj = _mm512_set1_ps(probs[i * L16 + j]);
#pragma GCC unroll 8
      for (int c = 0; c < OV; ++c) acc[i][c] = _mm512_fmadd_ps(pj, vf[c], acc[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < N; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
#pragma GCC unroll 8
    for (int c = 0; c < OV; ++c)
      _mm256_storeu_si256((__m256i*)(out_rows[i] + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], inv)));
  }
}

// f(std::integral_constant<int, n>) for a group of n = 1..4 query rows: the size as a template argument.
template <typename F>
inline void with_group_size(int n, F&& f) {
  switch (n) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

// One item: R query rows q_rows[i] (hd bf16 each) with mask rows mask_rows[i] [L]; keys / values
// K, V [L, hd] with row strides ks, vs; out_rows[i] = attention output (hd bf16).
// scores: scratch of R · L16 floats.
template <int HD>
void attend_item(const bf16* const* q_rows, const bool* const* mask_rows, int R, const bf16* K, int64_t ks,
                 const bf16* V, int64_t vs, int64_t L, float scale, bf16* const* out_rows, float* scores) {
  constexpr int PAIRS = HD / 2;  // dword pairs of dimensions per key
  constexpr int OV = HD / 16;    // fp32 vectors per output row
  const int64_t L16 = (L + 15) / 16 * 16;
  alignas(64) __m512i kt[PAIRS];  // the block, pair p of the 16 keys in kt[p]
  for (int64_t j0 = 0; j0 < L16; j0 += 16) {
    // A cache follows a step's ~270 MB of weights, so its rows come from memory, and one head's
    // keys (32 KB at 256 tokens) are too short a stream for the hardware prefetchers to reach
    // speed: the next block's keys are fetched into L1 while this one is scored, and this block's
    // values into L2 for the Σ p·v pass below. Cut attention's time in a cold b = 1 step by 14%
    // on the 2-core EPYC (0.440 -> 0.377 ms over 30 layers; docs/performance.md "Session 33").
    // Prefetches change no value.
    for (int64_t j = j0 + 16; j < std::min(L, j0 + 32); ++j)
      for (int c = 0; c < HD * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(K + j * ks) + c, _MM_HINT_T0);
    for (int64_t j = j0; j < std::min(L, j0 + 16); ++j)
      for (int c = 0; c < HD * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(V + j * vs) + c, _MM_HINT_T1);
    for (int c = 0; c < PAIRS / 16; ++c) {
      __m512i rows[16];
      for (int u = 0; u < 16; ++u)
        rows[u] = j0 + u < L ? _mm512_loadu_si512(K + (j0 + u) * ks + 32 * c) : _mm512_setzero_si512();
      transpose_16x16(rows, kt + 16 * c);
    }
    // 4 queries at a time, two chains each: 8 independent VDPBF16PS sums hide its latency.
    for (int i0 = 0; i0 < R; i0 += 4) {
      with_group_size(std::min(4, R - i0), [&](auto n) {
        scores_group<decltype(n)::value, PAIRS>(q_rows + i0, mask_rows + i0, kt, j0, L, L16, scale, scores + i0 * L16);
      });
    }
  }
  std::vector<float> inv_sum(R);
  std::vector<float> visible_p(static_cast<size_t>(L16 + 16));
  for (int i = 0; i < R; ++i) {
    float* s = scores + i * L16;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < L16; j0 += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j0));
    const float row_max = _mm512_reduce_max_ps(vmax);
    if (row_max == -INFINITY) {  // nothing visible: all p = 0
      for (int64_t j0 = 0; j0 < L16; j0 += 16) _mm512_storeu_ps(s + j0, _mm512_setzero_ps());
      inv_sum[i] = 0.f;
      continue;
    }
    // The sum of p runs over the visible keys packed in slot order: the n-th visible key adds into
    // lane n % 16, wherever its slot is. So a query's bits depend on which keys it sees, not on
    // where they sit: a tree node seeing the prefix and its ancestors at scattered slots sums as
    // the AR step that sees the same keys in consecutive slots. (Where the visible keys are a
    // prefix of the slots, the lanes are the slots' own, as before.)
    const __m512 mx = _mm512_set1_ps(row_max);
    int64_t n_visible = 0;
    for (int64_t j0 = 0; j0 < L16; j0 += 16) {
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j0), mx));
      _mm512_storeu_ps(s + j0, p);
      const __mmask16 live = visible_16(mask_rows[i], j0, L);
      // Compress in a register, then a masked store: the compressing store to memory is microcoded
      // on Zen 4 and took 15% of attention's time (perf, docs/performance.md "Session 28").
      const int count = __builtin_popcount(static_cast<unsigned>(live));
      _mm512_mask_storeu_ps(visible_p.data() + n_visible, static_cast<__mmask16>((1u << count) - 1u),
                            _mm512_maskz_compress_ps(live, p));
      n_visible += count;
    }
    _mm512_storeu_ps(visible_p.data() + n_visible, _mm512_setzero_ps());
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n_visible; j0 += 16) lsum = _mm512_add_ps(lsum, _mm512_loadu_ps(visible_p.data() + j0));
    inv_sum[i] = 1.f / _mm512_reduce_add_ps(lsum);
  }
  // Σ p·v, 4 queries at a time sharing each value row's conversion to fp32.
  for (int i0 = 0; i0 < R; i0 += 4) {
    with_group_size(std::min(4, R - i0), [&](auto n) {
      values_group<decltype(n)::value, OV>(scores + i0 * L16, L16, inv_sum.data() + i0, V, vs, L, out_rows + i0);
    });
  }
}

// q [b, nh, q, hd] (rope applied), caches [B >= b, nkv, S, hd], mask [b, q, kv_len] bool →
// [b, q, nh · hd], o_proj's input. Query head h reads KV head h / (nh / nkv), as model.py's folded SDPA.
void attend_into(const bf16* qp, int64_t b, int64_t nh, int64_t nq, int64_t hd, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const bool* mp, int64_t L, bf16* op);

at::Tensor attend_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& mask) {
  check_bf16_cpu(q, "attend_bf16");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && mask.dim() == 3,
              "attend_bf16: q [b, nh, q, hd], caches [B, nkv, S, hd], mask [b, q, L]");
  const int64_t b = q.size(0), nh = q.size(1), nq = q.size(2), hd = q.size(3), nkv = k_cache.size(1), L = mask.size(2);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == b && mask.size(1) == nq, "attend_bf16: mask [b, q, L] bool");
  TORCH_CHECK((hd == 64 || hd == 128) && nh % nkv == 0, "attend_bf16: hd 64 or 128, nh a multiple of nkv");
  check_caches(k_cache, v_cache, b, nkv, hd, L, "attend_bf16");
  at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty({b, nq, nh * hd}, q.options());
  attend_into(qc.data_ptr<bf16>(), b, nh, nq, hd, k_cache, v_cache, mc.data_ptr<bool>(), L, out.data_ptr<bf16>());
  return out;
}

// attend_bf16's work on raw rows: q [b, nh, nq, hd] and mask [b, nq, L] contiguous, the caches as
// checked there; out [b, nq, nh · hd].
void attend_into(const bf16* qp, int64_t b, int64_t nh, int64_t nq, int64_t hd, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const bool* mp, int64_t L, bf16* op) {
  const int64_t nkv = k_cache.size(1);
  const bf16* kp = k_cache.data_ptr<bf16>(); const bf16* vp = v_cache.data_ptr<bf16>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t G = nh / nkv;
  // Tokens per item: at most 8, and few enough for two items per thread where the rows and KV heads
  // alone give fewer (b = 1, 3 KV heads, 8 tokens, 2 threads: 6 items of 4 tokens, not 3 of 8, which
  // left one thread a third of the work idle); each item transposes the keys once. A query's bits
  // do not depend on the grouping.
  const int64_t want = 2 * at::get_num_threads(), per_token_group = b * nkv;
  const int64_t groups = std::min<int64_t>(nq, std::max<int64_t>(1, (want + per_token_group - 1) / per_token_group));
  const int64_t kChunk = std::min<int64_t>(8, (nq + groups - 1) / groups);
  const int64_t chunks = (nq + kChunk - 1) / kChunk, R = std::min(nq, kChunk) * G;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int64_t L16 = (L + 15) / 16 * 16;
  at::parallel_for(0, b * nkv * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(R * L16));
    std::vector<const bf16*> q_rows(R); std::vector<const bool*> mask_rows(R); std::vector<bf16*> out_rows(R);
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
      const bf16* K = kp + r * ks0 + h * ks1; const bf16* V = vp + r * vs0 + h * vs1;
      const int rows = static_cast<int>((t1 - t0) * G);
      if (hd == 64) attend_item<64>(q_rows.data(), mask_rows.data(), rows, K, ks2, V, vs2, L, scale, out_rows.data(),
                                    scores.data());
      else attend_item<128>(q_rows.data(), mask_rows.data(), rows, K, ks2, V, vs2, L, scale, out_rows.data(),
                            scores.data());
    }
  });
}
// 4. silu_mul_bf16: model.py's MLP between its packed gate|up product and down_proj,
// bf16(bf16(silu(g)) · u) with silu(g) = g · sigmoid(g) in fp32, as torch rounds F.silu(g) * u.
// The sigmoid uses e^-|g| (exp_nonpositive), so the last fp32 bits of silu may differ from torch's;
// each element stands alone, so a row's bits do not depend on the rows beside it.
inline __m512 silu_fp32(__m512 g) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // e^-|g|
  const __m512 one = _mm512_set1_ps(1.f);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
  return _mm512_mul_ps(g, sigmoid);
}

inline __m512 load_bf16(const bf16* p, __mmask16 m) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}

void silu_mul_into(const bf16* xp, int64_t rows, int64_t I, bf16* op);

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  check_bf16_cpu(gate_up, "silu_mul_bf16");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul_bf16: [..., 2 I]");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  at::Tensor x = gate_up.contiguous();
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, gate_up.options());
  silu_mul_into(x.data_ptr<bf16>(), rows, I, out.data_ptr<bf16>());
  return out;
}

// silu_mul_bf16's work on raw rows: gate_up [rows, 2 I] contiguous → out [rows, I]. In pieces of up to
// 512 columns of a row, over the threads once there are 4 096 elements or more (a verify forward's 8
// rows took 0.17 ms a step on one thread on the 2-core EPYC; over two, the q = 8 step ran ~1% faster,
// docs/performance.md "Session 33"); one decode row stays on one thread, where a fork would cost more
// than the work. Each element stands alone: the same bits either way.
void silu_mul_into(const bf16* xp, int64_t rows, int64_t I, bf16* op) {
  constexpr int64_t kPiece = 512, kParallel = 4096;
  const int64_t pieces = (I + kPiece - 1) / kPiece, items = rows * pieces;
  at::parallel_for(0, items, rows * I >= kParallel ? 1 : std::max<int64_t>(items, 1), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = j / pieces, i0 = (j % pieces) * kPiece, i1 = std::min(I, i0 + kPiece);
      const bf16* g = xp + r * 2 * I; const bf16* u = g + I; bf16* o = op + r * I;
      for (int64_t i = i0; i < i1; i += 16) {
        const __mmask16 m = i1 - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (i1 - i)) - 1u);
        const __m512 s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu_fp32(load_bf16(g + i, m))));  // rounded as F.silu's output
        _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, load_bf16(u + i, m))));
      }
    }
  });
}

// 5. decoder_layers_bf16: model.py's DecoderLayer.forward for every layer in one call, on the packed
// routes above, in the same order with the same kernels, so its bits are those of the per-module path
// (tests/test_cpu_kernels.py). Why: a b = 1 step is ~270 of these calls, and the Python between them
// (module calls, route checks, views) cost ~4.5 ms a step against ~11 ms of kernel time on a 2-core
// EPYC (docs/performance.md "Session 11"). Per layer: h = norm(x); qkv = h·Wqkvᵀ; rope + cache write;
// attend; delta = ·Woᵀ; (x, h) = (x + delta, norm(x + delta)); x = x + down(silu(gate) · up), with the
// next layer's h = norm(x) made in the same call.
// Returns the last layer's output and the outputs of the layers in `taps` (in increasing order).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return gemv_bf16(x.reshape({-1, x.size(-1)}).contiguous(), packed, n).view(shape);
}

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers_bf16(
    at::Tensor x, at::TensorList input_norms, at::TensorList qkv, at::TensorList o, at::TensorList post_norms,
    at::TensorList gate_up, at::TensorList down, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& mask, double eps, int64_t nh, int64_t nkv, int64_t hd,
    int64_t intermediate, at::IntArrayRef taps) {
  const size_t n_layers = input_norms.size();
  for (at::TensorList list : {qkv, o, post_norms, gate_up, down, k_caches, v_caches})
    TORCH_CHECK(list.size() == n_layers, "decoder_layers_bf16: one tensor per layer in every list");
  // Everything the per-op wrappers (gemv_bf16, rms_norm_bf16, qkv_rope_cache_bf16, attend_bf16, ...)
  // check, checked here once; the layers then run on their raw cores, every activation in one scratch
  // buffer. Why: the wrappers' allocations, views and checks cost ~2 us a GEMV (0.24 ms a step) and
  // more around the small ops, on caches the weight stream has just flushed; without them a b = 1
  // step ran 2-7% faster on the 2-core EPYC, the more the faster its memory (docs/performance.md
  // "Session 33"). The same kernels in the same order: the same bits.
  for (const at::Tensor& t : {x, cos, sin}) check_bf16_cpu(t, "decoder_layers_bf16");
  TORCH_CHECK(x.dim() == 3, "decoder_layers_bf16: x [b, q, dim]");
  const int64_t b = x.size(0), q = x.size(1), dim = x.size(2), rows = b * q, heads_width = nh * hd;
  const int64_t qkv_width = (nh + 2 * nkv) * hd, I = intermediate;
  TORCH_CHECK(hd % 2 == 0 && cos.numel() == rows * hd && sin.numel() == rows * hd,
              "qkv_rope_cache_bf16: cos / sin [b, q, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "qkv_rope_cache_bf16: slots [b, q] int64");
  TORCH_CHECK(mask.dim() == 3 && mask.scalar_type() == at::kBool && mask.size(0) == b && mask.size(1) == q,
              "attend_bf16: mask [b, q, L] bool");
  TORCH_CHECK((hd == 64 || hd == 128) && nh % nkv == 0, "attend_bf16: hd 64 or 128, nh a multiple of nkv");
  const int64_t L = mask.size(2);
  for (size_t i = 0; i < n_layers; ++i) {
    check_norm_weight(input_norms[i], dim);
    check_norm_weight(post_norms[i], dim);
    check_pack(qkv[i], dim, qkv_width);
    check_pack(o[i], heads_width, dim);
    check_pack(gate_up[i], dim, 2 * I);
    check_pack(down[i], I, dim);
    check_caches(k_caches[i], v_caches[i], b, nkv, hd, L, "attend_bf16");
  }
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous(), slc = slots.contiguous(), mc = mask.contiguous();
  const bf16* cp = cc.data_ptr<bf16>(); const bf16* sp = sc.data_ptr<bf16>();
  const int64_t* sl = slc.data_ptr<int64_t>(); const bool* mp = mc.data_ptr<bool>();

  at::Tensor out = x.contiguous().clone();  // the residual stream, updated in place (x stays the caller's)
  bf16* xp = out.data_ptr<bf16>();
  // Scratch: h [rows, dim], q|k|v [rows, width], rope'd q [b, nh, q, hd], attention [rows, nh hd],
  // delta [rows, dim], gate|up [rows, 2 I], silu · up [rows, I]; each on a cache line.
  auto line = [](int64_t n) { return (n + 31) / 32 * 32; };
  const int64_t sizes[] = {rows * dim, rows * qkv_width, rows * heads_width, rows * heads_width, rows * dim,
                           rows * 2 * I, rows * I};
  int64_t total = 0;
  for (int64_t n : sizes) total += line(n);
  at::Tensor scratch = at::empty({total}, x.options());
  bf16* buffers[7];
  bf16* next = scratch.data_ptr<bf16>();
  for (int k = 0; k < 7; ++k) buffers[k] = next, next += line(sizes[k]);
  bf16 *h = buffers[0], *qkv_out = buffers[1], *xq = buffers[2], *att = buffers[3], *delta = buffers[4],
       *gu = buffers[5], *sm = buffers[6];

  std::vector<at::Tensor> tapped;
  size_t next_tap = 0;
  if (n_layers)
    for (int64_t r = 0; r < rows; ++r)
      norm_row(xp + r * dim, input_norms[0].data_ptr<bf16>(), h + r * dim, dim, static_cast<float>(eps));
  for (size_t i = 0; i < n_layers; ++i) {
    gemv_into(h, rows, dim, qkv[i], qkv_width, qkv_out);
    qkv_rope_cache_into(qkv_out, b, q, cp, sp, sl, k_caches[i], v_caches[i], nh, nkv, hd, xq);
    attend_into(xq, b, nh, q, hd, k_caches[i], v_caches[i], mp, L, att);
    gemv_into(att, rows, heads_width, o[i], dim, delta);
    add_norm_into(xp, delta, post_norms[i].data_ptr<bf16>(), xp, h, rows, dim, eps);
    gemv_into(h, rows, dim, gate_up[i], 2 * I, gu);
    silu_mul_into(gu, rows, I, sm);
    gemv_into(sm, rows, I, down[i], dim, delta);
    // The residual add and the next layer's input norm in one pass (the same roundings as torch's
    // bf16 add followed by rms_norm_bf16).
    if (i + 1 < n_layers) add_norm_into(xp, delta, input_norms[i + 1].data_ptr<bf16>(), xp, h, rows, dim, eps);
    else add_into(xp, delta, xp, rows * dim);
    if (next_tap < taps.size() && taps[next_tap] == static_cast<int64_t>(i)) {
      tapped.push_back(out.clone());
      ++next_tap;
    }
  }
  return {out, tapped};
}

// Rows of `table` [n, width] (bf16) gathered at `index` (int64, checked against n) into a new [index.numel(), width].
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index, const char* what) {
  const int64_t n = table.size(0), width = table.size(1), count = index.numel();
  const at::Tensor idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, width}, table.options());
  const bf16* tp = table.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "decoder_forward_bf16: ", what, " ", ip[i], " is outside [0, ", n, ")");
    std::memcpy(op + i * width, tp + ip[i] * width, width * sizeof(bf16));
  }
  return out;
}

// 5b. decoder_forward_bf16: a whole decode or verify forward in one call: the token embeddings, rope's
// cos / sin looked up in tables of every position (model.py: Transformer.rope_tables, the values
// rope_cos_sin gives position by position), every layer (decoder_layers_bf16), the final norm and, where
// `head` is given, the LM head; for a chain (no mask given) also the positions, slots and mask that
// core.forward_new_tokens would make. Each step is the op model.py's modules call for it, in the same
// order, so the bits are theirs. What goes is the Python and the dozen small torch calls around the
// layers: on a cold cache (a step follows 270 MB of weight reads) they cost ~0.8 ms of a ~10 ms b = 1
// step on the 2-core EPYC (docs/performance.md "Session 23").
std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor> decoder_forward_bf16(
    const at::Tensor& tokens, const at::Tensor& embed, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& positions, at::TensorList input_norms, at::TensorList qkv, at::TensorList o,
    at::TensorList post_norms, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& mask, const at::Tensor& norm,
    const at::Tensor& head, int64_t head_rows, double eps, int64_t nh, int64_t nkv, int64_t hd, int64_t intermediate,
    at::IntArrayRef taps) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "decoder_forward_bf16: int64 tokens [b, q] and positions");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && cos_table.dim() == 2 && cos_table.size(1) == hd &&
              sin_table.sizes() == cos_table.sizes() && cos_table.is_contiguous() && sin_table.is_contiguous(),
              "decoder_forward_bf16: contiguous embedding table [V, D] and rope tables [positions, hd]");
  for (const at::Tensor& t : {embed, cos_table, sin_table}) check_bf16_cpu(t, "decoder_forward_bf16");
  const int64_t b = tokens.size(0), q = tokens.size(1);
  at::Tensor pos = positions, slot = slots, visible = mask;
  if (!mask.defined() || mask.numel() == 0) {
    // A chain (core.forward_new_tokens): `positions` holds each row's cache length c_r; token i of row r
    // sits at position and slot c_r + i and sees slots 0 .. c_r + i (core.chain_mask, over the slots up to
    // the last one any row sees: a row's bits do not depend on slots past its own last visible one).
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == b, "decoder_forward_bf16: a chain takes cache lengths [b]");
    const at::Tensor lengths = positions.contiguous();
    const int64_t* lp = lengths.data_ptr<int64_t>();
    pos = at::empty({b, q}, positions.options());
    int64_t* pp = pos.data_ptr<int64_t>();
    int64_t kv_len = 0;
    for (int64_t r = 0; r < b; ++r)
      for (int64_t i = 0; i < q; ++i) {
        pp[r * q + i] = lp[r] + i;
        kv_len = std::max(kv_len, lp[r] + i + 1);
      }
    visible = at::empty({b, q, kv_len}, positions.options().dtype(at::kBool));
    bool* vp = visible.data_ptr<bool>();
    for (int64_t r = 0; r < b; ++r)
      for (int64_t i = 0; i < q; ++i)
        for (int64_t j = 0; j < kv_len; ++j) vp[(r * q + i) * kv_len + j] = j <= pp[r * q + i];
    slot = pos;
  }
  TORCH_CHECK(pos.sizes() == tokens.sizes(), "decoder_forward_bf16: positions [b, q] like tokens");
  at::Tensor x = gather_rows(embed, tokens, "token").view({b, q, embed.size(1)});
  const at::Tensor cos = gather_rows(cos_table, pos, "position").view({b, q, 1, hd});
  const at::Tensor sin = gather_rows(sin_table, pos, "position").view({b, q, 1, hd});
  auto [last, tapped] = decoder_layers_bf16(x, input_norms, qkv, o, post_norms, gate_up, down, k_caches, v_caches, cos,
                                            sin, slot, visible, eps, nh, nkv, hd, intermediate, taps);
  at::Tensor hidden = rms_norm_bf16(last, norm, eps);
  at::Tensor logits = head.numel() ? linear_rows(hidden, head, head_rows) : at::empty({0}, hidden.options());
  return {logits, tapped, hidden};
}

// 6. argmax_bf16: the index of each row's largest value, the first one on ties, NaN counting as the
// largest (the first NaN): what torch's max(dim=-1).indices gives (sampling.py: greedy_ids), without
// its ~0.3 ms per 49 152-entry bf16 row on the 2-core Xeon (AMX; docs/performance.md "Session 12").
// 16 lanes each keep their own first maximum; the lanes' maxima then go to the smallest index among
// the lanes that hold the largest value. A row with a NaN takes the scalar loop.
int64_t argmax_row(const bf16* x, int64_t V) {
  int64_t i = 0;
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_index = _mm512_set1_epi32(0);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 unordered = 0;
  bool any = false;
  if (V < (int64_t(1) << 31)) {
    for (; i + 16 <= V; i += 16) {
      const __m512 v = load_bf16(x + i, 0xFFFF);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, greater, v);
      best_index = _mm512_mask_mov_epi32(best_index, greater, index);
      index = _mm512_add_epi32(index, step);
      any = true;
    }
  }
  if (unordered) {  // a NaN: the first NaN wins
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(static_cast<float>(x[j]))) return j;
  }
  float top = -INFINITY;
  int64_t top_index = 0;
  bool found = false;
  if (any) {
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, best);
    _mm512_store_si512(reinterpret_cast<__m512i*>(indices), best_index);
    for (int l = 0; l < 16; ++l) {
      // A lane still at -inf with nothing greater seen holds index 0 only if its first value was
      // -inf too; treating it as index l (its first element) keeps "first maximum" exact.
      const int64_t at = values[l] == -INFINITY ? l : indices[l];
      if (!found || values[l] > top || (values[l] == top && at < top_index)) {
        top = values[l], top_index = at, found = true;
      }
    }
  }
  for (; i < V; ++i) {  // the tail
    const float v = x[i];
    if (std::isnan(v)) return i;
    if (!found || v > top) top = v, top_index = i, found = true;
  }
  return top_index;
}

at::Tensor argmax_bf16(const at::Tensor& x) {
  check_bf16_cpu(x, "argmax_bf16");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax_bf16: [..., V] with V > 0");
  const at::Tensor c = x.contiguous();
  const int64_t V = c.size(-1), rows = c.numel() / V;
  std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end() - 1);
  at::Tensor out = at::empty(shape, c.options().dtype(at::kLong));
  const bf16* xp = c.data_ptr<bf16>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// 7. markov_draft_bf16: DSpark's sequential Markov head at temperature 0 (drafters/dspark.py:
// draft_block's greedy loop) in one call. For k = 0 .. γ−1: bias = W1[x_{k−1}] · W2ᵀ (the GEMV
// above on W2's pack, as markov_w2's Linear computes it), logits = bf16(U_k + bias) (torch's bf16
// add), x_k = vocab_ids[argmax] (argmax_row: the first maximum). Same tokens as the Python loop,
// whose ~7 × 6 torch calls cost ~0.7 ms a round on the 2-core Xeon; then, given its weights, the
// confidence head's logits z_k (from h_k and x_{k−1}). Returns (tokens [b, γ], the previous tokens
// [b, γ] = [anchor, x_1 .. x_{γ−1}], z [b, γ] bf16 or uninitialised without a confidence head).
//
// Sampled (uniforms given, temperature > 0; what draft_block's loop does at top_p = 1): x_k is drawn from
// p = softmax(float(logits) / T), computed here in fp32 (exp_nonpositive, so its last bits are not
// torch.softmax's), by inverting its CDF summed in float64 at u_k · Σp, as sampling.py's `sample`
// does: the first index whose cumulative mass exceeds it (a p of 0 is never drawn). p itself is
// returned [b, γ, Vd] fp32: the verifier's rejection test needs exactly the distribution each draft
// came from, and this is it, whatever its rounding — so drafts stay lossless.
void sample_position(const bf16* logits, int64_t Vd, float temperature, double u, float* p, int64_t* index) {
  const int64_t full = Vd / 16 * 16;
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  const __m512 vt = _mm512_set1_ps(temperature);  // logits / T, as probs_from_logits divides
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 z = _mm512_div_ps(_mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(logits + j))), vt);
    _mm512_storeu_ps(p + j, z);
    vmax = _mm512_max_ps(vmax, z);
  }
  float top = _mm512_reduce_max_ps(vmax);
  for (int64_t j = full; j < Vd; ++j) {
    p[j] = static_cast<float>(logits[j]) / temperature;
    top = std::max(top, p[j]);
  }
  const __m512 vtop = _mm512_set1_ps(top);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), vtop));
    _mm512_storeu_ps(p + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (int64_t j = full; j < Vd; ++j) {
    alignas(64) float tail[16];
    _mm512_store_ps(tail, exp_nonpositive(_mm512_set1_ps(p[j] - top)));
    p[j] = tail[0];
    sum += p[j];
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t j = 0; j < full; j += 16) _mm512_storeu_ps(p + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), inv));
  for (int64_t j = full; j < Vd; ++j) p[j] *= 1.f / sum;
  double total = 0.0;
  for (int64_t j = 0; j < Vd; ++j) total += static_cast<double>(p[j]);
  const double target = u * total;
  double cdf = 0.0;
  int64_t chosen = Vd - 1;  // u < 1, so some index qualifies; the last one only guards a rounding tie
  for (int64_t j = 0; j < Vd; ++j) {
    cdf += static_cast<double>(p[j]);
    if (cdf > target) {
      chosen = j;
      break;
    }
  }
  *index = chosen;
}

// The Markov head as described above; uniforms [b, γ] float64 (empty: greedy). Returns (tokens, previous
// tokens, confidence logits, p [b, γ, Vd] fp32 or empty when greedy).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> markov_head(
    const at::Tensor& base, const at::Tensor& anchors, const at::Tensor& w1, const at::Tensor& w2_packed,
    const at::Tensor& vocab_ids, const at::Tensor& h, const at::Tensor& conf_weight, const at::Tensor& conf_bias,
    const at::Tensor& uniforms, double temperature) {
  check_bf16_cpu(base, "markov_draft_bf16");
  check_bf16_cpu(w1, "markov_draft_bf16");
  TORCH_CHECK(base.dim() == 3 && anchors.dim() == 1 && anchors.size(0) == base.size(0) &&
              anchors.scalar_type() == at::kLong && w1.dim() == 2, "markov_draft_bf16: base [b, γ, Vd], anchors [b]");
  const int64_t b = base.size(0), g = base.size(1), Vd = base.size(2), r = w1.size(1), V = w1.size(0);
  const bool subset = vocab_ids.numel() > 0;
  TORCH_CHECK(!subset || (vocab_ids.numel() == Vd && vocab_ids.scalar_type() == at::kLong),
              "markov_draft_bf16: vocab_ids [Vd] int64 or empty");
  const at::Tensor u = base.contiguous(), table = w1.contiguous(), anchor = anchors.contiguous();
  const at::Tensor ids = subset ? vocab_ids.contiguous() : vocab_ids;
  at::Tensor tokens = at::empty({b, g}, anchors.options());
  at::Tensor prevs = at::empty({b, g}, anchors.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* pp = prevs.data_ptr<int64_t>();
  const bf16* up = u.data_ptr<bf16>();
  const bool sampled = uniforms.numel() > 0;
  TORCH_CHECK(!sampled || (uniforms.scalar_type() == at::kDouble && uniforms.dim() == 2 && uniforms.size(0) == b &&
                           uniforms.size(1) == g && temperature > 0),
              "markov_draft_bf16: uniforms [b, γ] float64 and a temperature > 0, or no uniforms (greedy)");
  const at::Tensor uc = sampled ? uniforms.contiguous() : uniforms;
  at::Tensor probs = sampled ? at::empty({b, g, Vd}, base.options().dtype(at::kFloat)) : at::empty({0}, base.options().dtype(at::kFloat));
  at::Tensor x = at::empty({b, r}, base.options());
  std::vector<bf16> logits(Vd);
  for (int64_t rr = 0; rr < b; ++rr) pp[rr * g] = anchor.data_ptr<int64_t>()[rr];
  for (int64_t k = 0; k < g; ++k) {
    for (int64_t rr = 0; rr < b; ++rr) {
      const int64_t prev = pp[rr * g + k];
      TORCH_CHECK(prev >= 0 && prev < V, "markov_draft_bf16: token id out of range");
      std::memcpy(x.data_ptr<bf16>() + rr * r, table.data_ptr<bf16>() + prev * r, r * sizeof(bf16));
    }
    const at::Tensor bias = gemv_bf16(x, w2_packed, Vd);
    const bf16* bp = bias.data_ptr<bf16>();
    for (int64_t rr = 0; rr < b; ++rr) {
      const bf16* row = up + (rr * g + k) * Vd;
      for (int64_t j = 0; j < Vd; ++j)
        logits[j] = bf16(static_cast<float>(row[j]) + static_cast<float>(bp[rr * Vd + j]));
      int64_t index;
      if (sampled)
        sample_position(logits.data(), Vd, static_cast<float>(temperature), uc.data_ptr<double>()[rr * g + k],
                        probs.data_ptr<float>() + (rr * g + k) * Vd, &index);
      else
        index = argmax_row(logits.data(), Vd);
      const int64_t token = subset ? ids.data_ptr<int64_t>()[index] : index;
      tp[rr * g + k] = token;
      if (k + 1 < g) pp[rr * g + k + 1] = token;
    }
  }
  // The confidence head: z = w · [h_k ; W1[x_{k−1}]] + b (or w · h_k + b), summed in fp32 in index order
  // and rounded to bf16 once, as nn.Linear's bf16 output (its GEMM may sum in another order).
  at::Tensor z = at::empty({b, g}, base.options());
  if (conf_weight.numel() > 0) {
    check_bf16_cpu(h, "markov_draft_bf16");
    check_bf16_cpu(conf_weight, "markov_draft_bf16");
    check_bf16_cpu(conf_bias, "markov_draft_bf16");
    const int64_t d = h.size(-1), width = conf_weight.numel();
    TORCH_CHECK(h.dim() == 3 && h.size(0) == b && h.size(1) == g && (width == d || width == d + r) &&
                conf_bias.numel() == 1, "markov_draft_bf16: h [b, γ, d], conf_weight [d (+ r)], conf_bias [1]");
    const at::Tensor hc = h.contiguous(), wc = conf_weight.contiguous();
    const bf16* hp = hc.data_ptr<bf16>(); const bf16* wp = wc.data_ptr<bf16>();
    const float bias = static_cast<float>(conf_bias.contiguous().data_ptr<bf16>()[0]);
    bf16* zp = z.data_ptr<bf16>();
    for (int64_t i = 0; i < b * g; ++i) {
      float sum = 0.f;
      const bf16* row = hp + i * d;
      for (int64_t j = 0; j < d; ++j) sum += static_cast<float>(wp[j]) * static_cast<float>(row[j]);
      if (width > d) {
        const bf16* m = table.data_ptr<bf16>() + pp[i] * r;
        for (int64_t j = 0; j < r; ++j) sum += static_cast<float>(wp[d + j]) * static_cast<float>(m[j]);
      }
      zp[i] = bf16(sum + bias);
    }
  }
  return {tokens, prevs, z, probs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> markov_draft_bf16(
    const at::Tensor& base, const at::Tensor& anchors, const at::Tensor& w1, const at::Tensor& w2_packed,
    const at::Tensor& vocab_ids, const at::Tensor& h, const at::Tensor& conf_weight, const at::Tensor& conf_bias) {
  const auto out = markov_head(base, anchors, w1, w2_packed, vocab_ids, h, conf_weight, conf_bias,
                               at::empty({0}, base.options().dtype(at::kDouble)), 0.0);
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

// 8. dspark_round_bf16: a DSpark drafting round (greedy, or sampled at top_p = 1) in one call (drafters/dspark.py:
// draft_round = append_context, then draft_block, on their kernel routes), without the Python between
// those kernels (route checks, rope, masks, views: ~40 torch calls): 3.17 -> 2.32 ms a round after a
// target step on the 2-core EPYC, 0.1-0.3 ms a round in decoding (docs/performance.md "Session 14").
// Same kernels, same order, and the few torch ops (rope's cos / sin, the slots and the mask) as ATen calls with
// model.py's arguments, so the same bits as the Python path (tests/test_cpu_kernels.py).

// model.py's rope_cos_sin: cos / sin [b, q, 1, hd] of positions [b, q].
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, const at::Tensor& positions) {
  at::Tensor angles = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;
  angles = at::cat({angles, angles}, -1);
  return {angles.cos().to(at::kBFloat16).unsqueeze(2), angles.sin().to(at::kBFloat16).unsqueeze(2)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dspark_round_bf16(
    const at::Tensor& features, const at::Tensor& counts, at::Tensor ctx_len, const at::Tensor& fc,
    const at::Tensor& hidden_norm, at::TensorList kv, const at::Tensor& anchors, const at::Tensor& embed,
    const at::Tensor& mask_embedding, at::TensorList input_norms, at::TensorList qkv, at::TensorList o,
    at::TensorList post_norms, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& inv_freq, const at::Tensor& norm, const at::Tensor& head,
    int64_t head_rows, const at::Tensor& markov_w1, const at::Tensor& markov_w2, const at::Tensor& vocab_ids,
    const at::Tensor& conf_weight, const at::Tensor& conf_bias, double eps, int64_t nh, int64_t nkv, int64_t hd,
    int64_t intermediate, int64_t block, int64_t max_ctx, const at::Tensor& uniforms, double temperature) {
  TORCH_CHECK(anchors.dim() == 1 && ctx_len.scalar_type() == at::kLong && ctx_len.size(0) >= anchors.size(0) && block >= 1,
              "dspark_round_bf16: anchors [b], ctx_len [>= b] int64");
  const int64_t b = anchors.size(0), d = embed.size(1);
  at::Tensor lens = ctx_len.narrow(0, 0, b);  // a view: the appends below advance the drafter's ctx_len
  // append_context(features, counts): context entries at slots ctx_len + i (padding → the sink slot max_ctx).
  if (features.numel() > 0) {
    TORCH_CHECK(features.dim() == 3 && features.size(0) == b && counts.numel() == b && counts.scalar_type() == at::kLong &&
                kv.size() == k_caches.size() && kv.size() == v_caches.size(),
                "dspark_round_bf16: features [b, n, m·d], counts [b] int64, one k|v pack per cache pair");
    const int64_t n = features.size(1);
    const at::Tensor offsets = at::arange(n, lens.options()).unsqueeze(0);
    const at::Tensor positions = lens.unsqueeze(1) + offsets;
    const at::Tensor slots = at::where(offsets < counts.unsqueeze(1), positions, at::Scalar(max_ctx));
    const at::Tensor ctx = rms_norm_bf16(linear_rows(features, fc, d), hidden_norm, eps);
    const auto cs = rope_cos_sin(inv_freq, positions);
    for (size_t i = 0; i < kv.size(); ++i)
      qkv_rope_cache_bf16(linear_rows(ctx, kv[i], 2 * nkv * hd), cs.first, cs.second, slots, k_caches[i], v_caches[i],
                          0, nkv, hd);
    lens.add_(counts);
  }
  // draft_block(anchors): block_hidden (the anchor's embedding, then block − 1 mask vectors, attending to
  // the context and the whole block), the draft head's logits, the Markov head and the confidence head.
  const at::Tensor x = at::cat({at::embedding(embed, anchors).unsqueeze(1), mask_embedding.expand({b, block - 1, d})}, 1);
  const at::Tensor slots = lens.unsqueeze(1) + at::arange(block, lens.options()).unsqueeze(0);
  const int64_t kv_len = lens.max().item<int64_t>() + block;
  const at::Tensor visible =
      (at::arange(kv_len, lens.options()).unsqueeze(0) < (lens + block).unsqueeze(1)).unsqueeze(1).expand({b, block, kv_len});
  const auto cs = rope_cos_sin(inv_freq, slots);
  const at::Tensor out = std::get<0>(decoder_layers_bf16(x, input_norms, qkv, o, post_norms, gate_up, down, k_caches,
                                                         v_caches, cs.first, cs.second, slots, visible, eps, nh, nkv,
                                                         hd, intermediate, {}));
  const at::Tensor h = rms_norm_bf16(out, norm, eps);
  return markov_head(linear_rows(h, head, head_rows), anchors, markov_w1, markov_w2, vocab_ids, h, conf_weight,
                     conf_bias, uniforms, temperature);
}
}  // namespace

TORCH_LIBRARY(specbench_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("amx_available() -> bool", amx_available);  // no tensor argument: one kernel for every backend
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_rope_cache_bf16(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int nh, int nkv, int hd) -> Tensor");
  m.def("attend_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor mask) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def("argmax_bf16(Tensor x) -> Tensor");
  m.def("markov_draft_bf16(Tensor base, Tensor anchors, Tensor w1, Tensor w2_packed, Tensor vocab_ids, Tensor h, "
        "Tensor conf_weight, Tensor conf_bias) -> (Tensor, Tensor, Tensor)");
  m.def("decoder_layers_bf16(Tensor x, Tensor[] input_norms, Tensor[] qkv, Tensor[] o, Tensor[] post_norms, "
        "Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor mask, float eps, int nh, int nkv, int hd, int intermediate, int[] taps) -> (Tensor, Tensor[])");
  m.def("decoder_forward_bf16(Tensor tokens, Tensor embed, Tensor cos_table, Tensor sin_table, Tensor positions, "
        "Tensor[] input_norms, Tensor[] qkv, Tensor[] o, Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor mask, Tensor norm, Tensor head, "
        "int head_rows, float eps, int nh, int nkv, int hd, int intermediate, int[] taps) -> (Tensor, Tensor[], Tensor)");
  m.def("dspark_round_bf16(Tensor features, Tensor counts, Tensor(a!) ctx_len, Tensor fc, Tensor hidden_norm, "
        "Tensor[] kv, Tensor anchors, Tensor embed, Tensor mask_embedding, Tensor[] input_norms, Tensor[] qkv, "
        "Tensor[] o, Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor inv_freq, Tensor norm, Tensor head, int head_rows, Tensor markov_w1, "
        "Tensor markov_w2, Tensor vocab_ids, Tensor conf_weight, Tensor conf_bias, float eps, int nh, int nkv, "
        "int hd, int intermediate, int block, int max_ctx, Tensor uniforms, float temperature) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(specbench_cpu, CPU, m) {
  m.impl("gemv_bf16", gemv_bf16);
  m.impl("rms_norm_bf16", rms_norm_bf16);
  m.impl("add_rms_norm_bf16", add_rms_norm_bf16);
  m.impl("qkv_rope_cache_bf16", qkv_rope_cache_bf16);
  m.impl("attend_bf16", attend_bf16);
  m.impl("silu_mul_bf16", silu_mul_bf16);
  m.impl("argmax_bf16", argmax_bf16);
  m.impl("markov_draft_bf16", markov_draft_bf16);
  m.impl("decoder_layers_bf16", decoder_layers_bf16);
  m.impl("decoder_forward_bf16", decoder_forward_bf16);
  m.impl("dspark_round_bf16", dspark_round_bf16);
}
