// Fused block-wise 8-bit AdamW update for the CPU (outcore::adamw8bit_update).
//
// Bit-exact with the pure-PyTorch reference in kernels/adamw8bit.py: every float op
// below is one IEEE-rounded fp32 operation in the same order as the reference, and the
// build passes -ffp-contract=off (no FMA contraction) and no -ffast-math. Quantization
// uses the 16-bit bucket table + one threshold comparison described in
// kernels/quantize.py, which equals the reference's searchsorted by construction.
//
// One pass per 256-element block, the block's dequantized moments kept in two stack
// buffers (2 KiB, stays in L1): read codes -> fp32 moments -> update param -> new absmax
// -> requantize. Blocks are split between threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define OUTCORE_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 256;
// Bucket index of a normalized value (kernels/quantize.py: bucket_index): sign and the top
// 16 bits of |y| clamped to [kBucketMin, kBucketMax]. The tables hold one uint8 per bucket
// (+4 bytes of padding, room for a 4-byte gather). Used by the scalar path; the AVX-512
// path searches the thresholds in registers instead.
constexpr int32_t kBucketMin = 100 << 7;
constexpr int32_t kBucketMax = (128 << 7) - 1;
constexpr int32_t kBucketsPerSign = kBucketMax - kBucketMin + 1;
constexpr int64_t kTableBytes = 2 * kBucketsPerSign + 4;

struct Coeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay;
};

inline uint8_t quantize_one(float y, const uint8_t* bucket, const float* thr) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const int32_t mag = std::min(std::max(static_cast<int32_t>((bits & 0x7FFFFFFFu) >> 16), kBucketMin),
                               kBucketMax) - kBucketMin;
  const int32_t c = bucket[mag + static_cast<int32_t>(bits >> 31) * kBucketsPerSign];
  return static_cast<uint8_t>(c + (y > thr[c] ? 1 : 0));
}

#ifdef OUTCORE_AVX512
// AVX-512 path without gathers (gathers run at ~1 element/cycle on the CPUs measured,
// which made them the bottleneck): every table lookup is done in registers with permutes.
//
// Lookup of a 256-entry float table (dequantization): 8 two-register permutes over
// 32-entry slices, then a 3-level blend on index bits 5..7.
struct Table256 {
  __m512 r[16];
  explicit Table256(const float* t) {
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(t + 16 * k);
  }
  inline __m512 lookup(__m512i idx) const {
    __m512 s[8];
    for (int k = 0; k < 8; ++k) s[k] = _mm512_permutex2var_ps(r[2 * k], idx, r[2 * k + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    for (int k = 0; k < 4; ++k) s[k] = _mm512_mask_blend_ps(b5, s[2 * k], s[2 * k + 1]);
    s[0] = _mm512_mask_blend_ps(b6, s[0], s[1]);
    s[1] = _mm512_mask_blend_ps(b6, s[2], s[3]);
    return _mm512_mask_blend_ps(b7, s[0], s[1]);
  }
};

// Quantization = #{k : t[k] < y} by a branch-free binary search over the 255 sorted
// thresholds: level L (step 128 >> L) compares y with t[pos + step - 1]; the candidates
// of level L are the 2^L values t[j * (256 >> L) + (128 >> L) - 1], j = pos >> (8 - L),
// held in registers (levels 0-4: one permute, 5: two-register permute, 6: two, 7: four).
struct Thresholds {
  __m512 l04[5];  // levels 0..4, up to 16 entries each
  __m512 l5[2], l6[4], l7[8];
  explicit Thresholds(const float* t) {
    alignas(64) float buf[128];
    for (int L = 0; L <= 4; ++L) {
      const int n = 1 << L, stride = 256 >> L, off = (128 >> L) - 1;
      for (int j = 0; j < 16; ++j) buf[j] = t[(j % n) * stride + off];
      l04[L] = _mm512_load_ps(buf);
    }
    for (int j = 0; j < 32; ++j) buf[j] = t[j * 8 + 3];
    for (int k = 0; k < 2; ++k) l5[k] = _mm512_load_ps(buf + 16 * k);
    for (int j = 0; j < 64; ++j) buf[j] = t[j * 4 + 1];
    for (int k = 0; k < 4; ++k) l6[k] = _mm512_load_ps(buf + 16 * k);
    for (int j = 0; j < 128; ++j) buf[j] = t[j * 2];
    for (int k = 0; k < 8; ++k) l7[k] = _mm512_load_ps(buf + 16 * k);
  }
  static inline __m512i step(__m512i pos, __m512 t, __m512 y, int s) {
    const __mmask16 lt = _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ);
    return _mm512_mask_add_epi32(pos, lt, pos, _mm512_set1_epi32(s));
  }
  inline __m512i codes(__m512 y) const {
    __m512i pos = _mm512_setzero_si512();
    for (int L = 0; L <= 4; ++L) {
      const __m512i j = _mm512_srli_epi32(pos, 8 - L);
      pos = step(pos, _mm512_permutexvar_ps(j, l04[L]), y, 128 >> L);
    }
    __m512i j = _mm512_srli_epi32(pos, 3);
    pos = step(pos, _mm512_permutex2var_ps(l5[0], j, l5[1]), y, 4);
    j = _mm512_srli_epi32(pos, 2);
    {
      const __mmask16 b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
      const __m512 t = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(l6[0], j, l6[1]),
                                            _mm512_permutex2var_ps(l6[2], j, l6[3]));
      pos = step(pos, t, y, 2);
    }
    j = _mm512_srli_epi32(pos, 1);
    {
      const __mmask16 b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
      const __mmask16 b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
      const __m512 a = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(l7[0], j, l7[1]),
                                            _mm512_permutex2var_ps(l7[2], j, l7[3]));
      const __m512 b = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(l7[4], j, l7[5]),
                                            _mm512_permutex2var_ps(l7[6], j, l7[7]));
      pos = step(pos, _mm512_mask_blend_ps(b6, a, b), y, 1);
    }
    return pos;
  }
};

// One full 256-element block, 16 lanes at a time. Same operations, same order as the
// scalar loop below (and as the PyTorch reference).
inline void update_block_avx512(float* __restrict pb, const float* __restrict gb,
                                uint8_t* __restrict mcb, float* __restrict ma_b,
                                uint8_t* __restrict vcb, float* __restrict va_b,
                                const Table256& qm, const Table256& qv, const Thresholds& tm,
                                const Thresholds& tv, float* __restrict mbuf,
                                float* __restrict vbuf, const Coeffs& c) {
  const __m512 am = _mm512_set1_ps(*ma_b), av = _mm512_set1_ps(*va_b);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 ss = _mm512_set1_ps(c.step_size), decay = _mm512_set1_ps(c.decay);
  __m512 amax_m = _mm512_setzero_ps(), amax_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512 g = _mm512_loadu_ps(gb + i);
    const __m512i mi_idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mcb + i)));
    const __m512i vi_idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vcb + i)));
    __m512 m = _mm512_mul_ps(qm.lookup(mi_idx), am);
    __m512 v = _mm512_mul_ps(qv.lookup(vi_idx), av);
    m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
    v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
    const __m512 p = _mm512_loadu_ps(pb + i);
    _mm512_storeu_ps(pb + i, _mm512_sub_ps(_mm512_mul_ps(p, decay),
                                           _mm512_mul_ps(_mm512_div_ps(m, denom), ss)));
    _mm512_store_ps(mbuf + i, m);
    _mm512_store_ps(vbuf + i, v);
    amax_m = _mm512_max_ps(amax_m, _mm512_abs_ps(m));
    amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(v));
  }
  const float am_new = _mm512_reduce_max_ps(amax_m), av_new = _mm512_reduce_max_ps(amax_v);
  *ma_b = am_new;
  *va_b = av_new;
  const __m512 inv_m = _mm512_set1_ps(am_new > 0.f ? 1.f / am_new : 1.f);
  const __m512 inv_v = _mm512_set1_ps(av_new > 0.f ? 1.f / av_new : 1.f);
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512i cm = tm.codes(_mm512_mul_ps(_mm512_load_ps(mbuf + i), inv_m));
    const __m512i cv = tv.codes(_mm512_mul_ps(_mm512_load_ps(vbuf + i), inv_v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mcb + i), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vcb + i), _mm512_cvtepi32_epi8(cv));
  }
}
#endif

void update_range(float* __restrict p, const float* __restrict g, uint8_t* __restrict mc,
                  float* __restrict ma, uint8_t* __restrict vc, float* __restrict va,
                  const float* __restrict qm, const float* __restrict qv,
                  const uint8_t* __restrict bm, const float* __restrict tm,
                  const uint8_t* __restrict bv, const float* __restrict tv,
                  int64_t n, int64_t block_begin, int64_t block_end, const Coeffs c) {
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
#ifdef OUTCORE_AVX512
  const Table256 qm_r(qm), qv_r(qv);  // per thread, once per range: tables into registers
  const Thresholds tm_r(tm), tv_r(tv);
#endif
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
#ifdef OUTCORE_AVX512
    if (len == kBlock) {
      update_block_avx512(p + start, g + start, mc + start, ma + b, vc + start, va + b, qm_r,
                          qv_r, tm_r, tv_r, mbuf, vbuf, c);
      continue;
    }
#endif
    float* __restrict pb = p + start;
    const float* __restrict gb = g + start;
    uint8_t* __restrict mcb = mc + start;
    uint8_t* __restrict vcb = vc + start;
    const float am = ma[b];
    const float av = va[b];
    float amax_m = 0.f;
    float amax_v = 0.f;
#pragma omp simd reduction(max : amax_m, amax_v)
    for (int64_t i = 0; i < len; ++i) {
      const float gi = gb[i];
      float mi = qm[mcb[i]] * am;
      float vi = qv[vcb[i]] * av;
      mi = mi * c.beta1 + gi * c.one_minus_beta1;
      vi = vi * c.beta2 + (gi * gi) * c.one_minus_beta2;
      const float denom = std::sqrt(vi) * c.inv_bc2_sqrt + c.eps;
      pb[i] = pb[i] * c.decay - (mi / denom) * c.step_size;
      mbuf[i] = mi;
      vbuf[i] = vi;
      amax_m = std::max(amax_m, std::fabs(mi));
      amax_v = std::max(amax_v, std::fabs(vi));
    }
    ma[b] = amax_m;
    va[b] = amax_v;
    const float inv_m = amax_m > 0.f ? 1.f / amax_m : 1.f;
    const float inv_v = amax_v > 0.f ? 1.f / amax_v : 1.f;
    for (int64_t i = 0; i < len; ++i) {
      mcb[i] = quantize_one(mbuf[i] * inv_m, bm, tm);
      vcb[i] = quantize_one(vbuf[i] * inv_v, bv, tv);
    }
  }
}

void check(const torch::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

}  // namespace

void adamw8bit_update(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes,
                      torch::Tensor m_absmax, torch::Tensor v_codes, torch::Tensor v_absmax,
                      torch::Tensor qmap_m, torch::Tensor qmap_v, torch::Tensor bucket_m,
                      torch::Tensor thr_m, torch::Tensor bucket_v, torch::Tensor thr_v,
                      double beta1, double one_minus_beta1, double beta2, double one_minus_beta2,
                      double inv_bc2_sqrt, double eps, double step_size, double decay) {
  const int64_t n = param.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check(param, at::kFloat, n, "param");
  check(grad, at::kFloat, n, "grad");
  check(m_codes, at::kByte, n, "m_codes");
  check(v_codes, at::kByte, n, "v_codes");
  check(m_absmax, at::kFloat, nblocks, "m_absmax");
  check(v_absmax, at::kFloat, nblocks, "v_absmax");
  check(qmap_m, at::kFloat, 256, "qmap_m");
  check(qmap_v, at::kFloat, 256, "qmap_v");
  check(bucket_m, at::kByte, kTableBytes, "bucket_m");
  check(bucket_v, at::kByte, kTableBytes, "bucket_v");
  check(thr_m, at::kFloat, 256, "thr_m");
  check(thr_v, at::kFloat, 256, "thr_v");
  // Scalars are rounded to fp32 exactly as PyTorch rounds Python scalars for fp32 tensors.
  const Coeffs c{static_cast<float>(beta1),        static_cast<float>(one_minus_beta1),
                 static_cast<float>(beta2),        static_cast<float>(one_minus_beta2),
                 static_cast<float>(inv_bc2_sqrt), static_cast<float>(eps),
                 static_cast<float>(step_size),    static_cast<float>(decay)};
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  uint8_t* mc = m_codes.data_ptr<uint8_t>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>();
  float* ma = m_absmax.data_ptr<float>();
  float* va = v_absmax.data_ptr<float>();
  const float* qm = qmap_m.data_ptr<float>();
  const float* qv = qmap_v.data_ptr<float>();
  const uint8_t* bm = bucket_m.data_ptr<uint8_t>();
  const uint8_t* bv = bucket_v.data_ptr<uint8_t>();
  const float* tm = thr_m.data_ptr<float>();
  const float* tv = thr_v.data_ptr<float>();
  // 64 blocks (16K elements) per task: enough work to amortize a thread hand-off.
  at::parallel_for(0, nblocks, 64, [&](int64_t b0, int64_t b1) {
    update_range(p, g, mc, ma, vc, va, qm, qv, bm, tm, bv, tv, n, b0, b1, c);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw8bit_update", &adamw8bit_update, "fused block-wise 8-bit AdamW update (in place)");
}
