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
// share one pass, in registers), prefetching a few KB ahead.
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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kBlock = 32;          // output features per block: two registers of 16 lanes
constexpr int kMaxRows = 8;             // rows of x per pass: 16 accumulators + 2 weight registers
constexpr int64_t kPrefetch = 4096;     // elements (8 KB) ahead; best of 0/256/1024/2048/4096 measured

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
    if (prefetch) {  // never faults, even past the end of the tensor
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + 32), _MM_HINT_T0);
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
            for (int i = 0; i < 16 * 2 * kBlock; i += 32)  // one line in 64 bytes, kPrefetch ahead
              _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + i), _MM_HINT_T0);
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

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "gemv_bf16: x [M, K], packed [blocks, K/2, 32, 2]");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) == K / 2 && packed.size(2) == kBlock && packed.size(3) == 2 &&
              blocks * kBlock >= N && (blocks - 1) * kBlock < N, "gemv_bf16: packed does not match x and N");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && x.is_cpu() && packed.is_cpu(),
              "gemv_bf16: contiguous CPU tensors");
  at::Tensor y = at::empty({M, N}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  if (amx_applies(K)) {
    gemv_amx(xp, wp, yp, M, K, N, blocks);
    return y;
  }
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)  // more than 8 rows: another pass, from cache
        any_rows(static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), xp + m0 * K, K, wp + b * kBlock * K,
                 yp + m0 * N, N, b * kBlock, m0 == 0);
  });
  return y;
}

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

void check_bf16_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_cpu(), what, ": bf16 CPU tensors only");
}

// model.py's RMSNorm for one row: weight · bf16(x · rsqrt(mean(x²) + eps)), the mean and the
// product in fp32. The sum of squares runs in index order, so its last bits may differ from torch's
// vectorised mean; the roundings are torch's.
void norm_row(const bf16* x, const bf16* w, bf16* y, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) { const float v = x[i]; ss += v * v; }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = bf16(static_cast<float>(w[i]) * round_bf16(static_cast<float>(x[i]) * r));
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16_cpu(x, "rms_norm_bf16");
  check_bf16_cpu(weight, "rms_norm_bf16");
  TORCH_CHECK(weight.numel() == x.size(-1) && weight.is_contiguous(), "rms_norm_bf16: weight [D]");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>(); const bf16* wp = weight.data_ptr<bf16>(); bf16* yp = y.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  return y;
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
  const bf16* xp = xc.data_ptr<bf16>(); const bf16* dp = dc.data_ptr<bf16>(); const bf16* wp = weight.data_ptr<bf16>();
  bf16* sp = s.data_ptr<bf16>(); bf16* yp = y.data_ptr<bf16>();
  for (int64_t i = 0; i < rows * D; ++i) sp[i] = bf16(static_cast<float>(xp[i]) + static_cast<float>(dp[i]));
  for (int64_t r = 0; r < rows; ++r) norm_row(sp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  return {s, y};
}

// model.py's apply_rope for one head (transformers' rotate_half convention) with torch's roundings,
// so the same bits: bf16(bf16(x · cos) + bf16(rotate_half(x) · sin)).
inline void rope_row(const bf16* x, const bf16* c, const bf16* s, bf16* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) {
    const float rot = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    out[i] = bf16(round_bf16(static_cast<float>(x[i]) * static_cast<float>(c[i])) + round_bf16(rot * static_cast<float>(s[i])));
  }
}

// Attention's step from the packed projection to SDPA: qkv [b, q, (nh + 2 nkv) · hd] →
// rope(q) as [b, nh, q, hd] (returned: SDPA's layout, and folded GQA's by a view), rope(k) and v
// written to k_cache / v_cache [B, nkv, S, hd] at each row's slots [b, q]. cos, sin: [b, q, (1,) hd].
at::Tensor qkv_rope_cache_bf16(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                               at::Tensor k_cache, at::Tensor v_cache, int64_t nh, int64_t nkv, int64_t hd) {
  for (const at::Tensor& t : {qkv, cos, sin, k_cache, v_cache}) check_bf16_cpu(t, "qkv_rope_cache_bf16");
  TORCH_CHECK(qkv.dim() == 3, "qkv_rope_cache_bf16: qkv [b, q, width]");
  const int64_t b = qkv.size(0), q = qkv.size(1), width = qkv.size(2);
  TORCH_CHECK(width == (nh + 2 * nkv) * hd && hd % 2 == 0, "qkv_rope_cache_bf16: width != (nh + 2 nkv) hd");
  TORCH_CHECK(cos.numel() == b * q * hd && sin.numel() == b * q * hd, "qkv_rope_cache_bf16: cos / sin [b, q, hd]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == b * q, "qkv_rope_cache_bf16: slots [b, q] int64");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
              k_cache.size(0) >= b && v_cache.size(0) >= b && k_cache.size(1) == nkv && k_cache.size(3) == hd &&
              v_cache.size(1) == nkv && v_cache.size(3) == hd, "qkv_rope_cache_bf16: caches [B >= b, nkv, S, hd]");
  at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), slc = slots.contiguous();
  at::Tensor out = at::empty({b, nh, q, hd}, qkv.options());
  const bf16* p = qc.data_ptr<bf16>(); const bf16* cp = cc.data_ptr<bf16>(); const bf16* sp = sc.data_ptr<bf16>();
  const int64_t* sl = slc.data_ptr<int64_t>();
  bf16* op = out.data_ptr<bf16>(); bf16* kp = k_cache.data_ptr<bf16>(); bf16* vp = v_cache.data_ptr<bf16>();
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
  return out;
}
}  // namespace

TORCH_LIBRARY(specbench_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("amx_available() -> bool", amx_available);  // no tensor argument: one kernel for every backend
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_rope_cache_bf16(Tensor qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int nh, int nkv, int hd) -> Tensor");
}
TORCH_LIBRARY_IMPL(specbench_cpu, CPU, m) {
  m.impl("gemv_bf16", gemv_bf16);
  m.impl("rms_norm_bf16", rms_norm_bf16);
  m.impl("add_rms_norm_bf16", add_rms_norm_bf16);
  m.impl("qkv_rope_cache_bf16", qkv_rope_cache_bf16);
}
