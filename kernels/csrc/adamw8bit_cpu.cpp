// Fused block-wise 8-bit AdamW update for the CPU (outcore::adamw8bit_update).
//
// Bit-exact with the pure-PyTorch reference in kernels/adamw8bit.py: every float op of the
// update is one IEEE-rounded fp32 operation in the same order as the reference, and the
// build passes -ffp-contract=off (no FMA contraction) and no -ffast-math.
//
// One pass per 256-element block: read codes -> fp32 moments -> update param -> new absmax,
// the block's fresh moments kept in two stack buffers (2 KiB, in L1); then requantize.
// Work is handed out to the threads in chunks of blocks from an atomic counter (dynamic
// scheduling: on a shared machine a descheduled thread does not hold the others up).
//
// Paths (chosen at build time by the ISA flags kernels/adamw8bit.py passes):
// * AVX-512 (F/BW/VL/DQ): 16 lanes per instruction, no gathers (they run at ~3 ns per 16
//   lanes on the CPUs measured, slower than the rest of the update together).
//   - dequantization (Dequantizer): with AVX512-VBMI the 256-entry map is 4 byte planes and
//     64 codes are looked up at once with byte permutes; without VBMI, fp32 permutes over
//     the map held in 16 registers.
//   - quantization (SegmentQuantizer): code = floor(f) of a piecewise-linear f(|y|) whose
//     pieces are the map's decades (the dynamic map is linear within a decade). The piece is
//     found with one exact comparison against the decade boundary inside |y|'s binade. The
//     tables are built and *verified exhaustively* in Python (kernels/adamw8bit.py:
//     segment_tables): wherever f is not within `near` units of 2^-12 of an integer,
//     floor(f) is the reference's searchsorted code. Lanes that close to a code boundary
//     (about 5 in 10^4) are redone with the exact scalar bucket method below.
// * scalar (any CPU, and partial blocks): dequantize through the map, quantize with the
//   16-bit bucket table + one threshold comparison of kernels/quantize.py (equal to the
//   reference's searchsorted by construction).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define OUTCORE_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 256;
constexpr int64_t kChunkBlocks = 64;  // 16K elements (~10 us) per work item handed to a thread
// Bucket index of a normalized value (kernels/quantize.py: bucket_index): sign and the top
// 16 bits of |y| clamped to [kBucketMin, kBucketMax]. The tables hold one uint8 per bucket
// (+4 bytes of padding).
constexpr int32_t kBucketMin = 100 << 7;
constexpr int32_t kBucketMax = (128 << 7) - 1;
constexpr int32_t kBucketsPerSign = kBucketMax - kBucketMin + 1;
constexpr int64_t kTableBytes = 2 * kBucketsPerSign + 4;
// Segment tables (kernels/adamw8bit.py: segment_tables): rows seglo, boundary, slope,
// offset, clamp; 32 columns. Binade slots are exponents kSegExpLo..kSegExpLo+31.
constexpr int64_t kSegRows = 5;
constexpr int64_t kSegCols = 32;
constexpr int32_t kSegExpLo = 96;

struct Coeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay;
};

struct Maps {  // everything a block update reads besides its own data
  const float* qm;  // (256,) signed map
  const float* qv;  // (256,) unsigned map
  const uint8_t* bucket_m;
  const float* thr_m;
  const uint8_t* bucket_v;
  const float* thr_v;
  const float* seg_m;  // (kSegRows, kSegCols)
  const float* seg_v;
  int32_t near_units;
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
#ifdef __AVX512VBMI__
// 256-entry fp32 table lookup of 64 byte codes at once. The table is stored as 4 byte planes
// (bits 0-7, 8-15, ... of every entry), 4 registers each; a plane lookup is two 128-entry
// byte permutes and a blend on bit 7 of the code. 8 unpacks interleave the planes back into
// 4 x 16 floats; the codes are pre-permuted so that those come out in natural order.
struct Dequantizer {
  __m512i plane[4][4];
  __m512i order;
  explicit Dequantizer(const float* map) {
    alignas(64) uint8_t buf[4][256];
    for (int j = 0; j < 256; ++j) {
      uint32_t b;
      std::memcpy(&b, map + j, sizeof(b));
      for (int k = 0; k < 4; ++k) buf[k][j] = static_cast<uint8_t>(b >> (8 * k));
    }
    for (int k = 0; k < 4; ++k)
      for (int r = 0; r < 4; ++r) plane[k][r] = _mm512_load_si512(buf[k] + 64 * r);
    // unpack{lo,hi}_epi8 then _epi16 put byte 16l + 4q + j of each 128-bit lane l into
    // output vector q, lane position 4l + j: so that position must hold code 16q + 4l + j.
    alignas(64) uint8_t o[64];
    for (int l = 0; l < 4; ++l)
      for (int q = 0; q < 4; ++q)
        for (int j = 0; j < 4; ++j) o[16 * l + 4 * q + j] = static_cast<uint8_t>(16 * q + 4 * l + j);
    order = _mm512_load_si512(o);
  }
  // codes: 64 bytes; out: 4 x 16 floats, map[codes[16q + i]] in out[q] lane i.
  inline void lookup64(const uint8_t* codes, __m512 out[4]) const {
    const __m512i p = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
    const __mmask64 upper = _mm512_movepi8_mask(p);  // code >= 128
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
      b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(plane[k][0], p, plane[k][1]),
                                    _mm512_permutex2var_epi8(plane[k][2], p, plane[k][3]));
    const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
  }
};
#else
// Without VBMI: the map in 16 registers, 8 two-register fp32 permutes over 32-entry slices,
// then a 3-level blend on code bits 5..7.
struct Dequantizer {
  __m512 r[16];
  explicit Dequantizer(const float* map) {
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(map + 16 * k);
  }
  inline __m512 lookup16(__m512i idx) const {
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
  inline void lookup64(const uint8_t* codes, __m512 out[4]) const {
    for (int q = 0; q < 4; ++q)
      out[q] = lookup16(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * q))));
  }
};
#endif

// code(y) for 16 normalized values, see the file comment and segment_tables() in Python:
//   a = |y|; k = a (y >= 0) or the next float above a (y < 0: boundaries count as "below"
//   for negative values, the reference's ties go to the lower code);
//   piece = seglo[binade(k)] + (k > boundary[binade(k)]) (+16 for y < 0);
//   f = min(a, clamp[piece]) * slope[piece] + offset[piece] = 2048 + code + fraction.
// In [2048, 4096) the low 12 mantissa bits of f are the fraction (units of 2^-12) and the
// next 8 the code: both are integer ops on f's bits. f within `near` units of an integer
// means the code is not certain (the exact fallback decides).
template <bool kSigned>
struct SegmentQuantizer {
  __m512i seglo0, seglo1, bnd0, bnd1, near;
  __m512 slope0, slope1, off0, off1, clamp0, clamp1;
  SegmentQuantizer(const float* seg, int32_t near_units) {
    seglo0 = _mm512_cvtps_epi32(_mm512_loadu_ps(seg));
    seglo1 = _mm512_cvtps_epi32(_mm512_loadu_ps(seg + 16));
    bnd0 = _mm512_loadu_si512(seg + kSegCols), bnd1 = _mm512_loadu_si512(seg + kSegCols + 16);
    slope0 = _mm512_loadu_ps(seg + 2 * kSegCols), slope1 = _mm512_loadu_ps(seg + 2 * kSegCols + 16);
    off0 = _mm512_loadu_ps(seg + 3 * kSegCols), off1 = _mm512_loadu_ps(seg + 3 * kSegCols + 16);
    clamp0 = _mm512_loadu_ps(seg + 4 * kSegCols), clamp1 = _mm512_loadu_ps(seg + 4 * kSegCols + 16);
    near = _mm512_set1_epi32(near_units);
  }
  // The biased f of 16 values, as its bit pattern.
  inline __m512i biased(__m512 y) const {
    const __m512i yb = _mm512_castps_si512(y);
    __m512i ab = yb, key = yb;
    __mmask16 neg = 0;
    if (kSigned) {
      ab = _mm512_and_si512(yb, _mm512_set1_epi32(0x7FFFFFFF));
      neg = _mm512_movepi32_mask(yb);
      key = _mm512_mask_add_epi32(ab, neg, ab, _mm512_set1_epi32(1));
    }
    // permutex2var reads the low 5 bits: slots 0..31 = exponents 96..127 (|y| < 2).
    const __m512i e = _mm512_max_epu32(_mm512_srli_epi32(key, 23), _mm512_set1_epi32(kSegExpLo));
    // key > boundary as integers (both non-negative floats): the sign of boundary - key.
    __m512i seg = _mm512_sub_epi32(_mm512_permutex2var_epi32(seglo0, e, seglo1),
                                   _mm512_srai_epi32(_mm512_sub_epi32(
                                       _mm512_permutex2var_epi32(bnd0, e, bnd1), key), 31));
    __m512 clamp, slope, off;
    if (kSigned) {  // pieces of y < 0 are columns 16..31
      seg = _mm512_mask_add_epi32(seg, neg, seg, _mm512_set1_epi32(16));
      clamp = _mm512_permutex2var_ps(clamp0, seg, clamp1);
      slope = _mm512_permutex2var_ps(slope0, seg, slope1);
      off = _mm512_permutex2var_ps(off0, seg, off1);
    } else {  // y >= 0 only: 16 columns, one-register permutes
      clamp = _mm512_permutexvar_ps(seg, clamp0);
      slope = _mm512_permutexvar_ps(seg, slope0);
      off = _mm512_permutexvar_ps(seg, off0);
    }
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(ab), clamp);
    return _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(a, slope), off));
  }
  // (fraction + near) mod 4096: below 2 * near exactly for the uncertain lanes.
  inline __m512i distance(__m512i f) const {
    return _mm512_and_si512(_mm512_add_epi32(f, near), _mm512_set1_epi32(0xFFF));
  }
  inline __mmask16 uncertain(__m512 y) const {
    return _mm512_cmplt_epu32_mask(distance(biased(y)), _mm512_add_epi32(near, near));
  }
};

// Codes of one full block of fresh moments `buf` whose absmax is `absmax`.
template <bool kSigned>
inline void requantize_avx512(const float* __restrict buf, float absmax, uint8_t* __restrict codes,
                              const SegmentQuantizer<kSigned>& q, const uint8_t* bucket,
                              const float* thr) {
  const float inv = absmax > 0.f ? 1.f / absmax : 1.f;
  const __m512 inv16 = _mm512_set1_ps(inv);
  __m512i closest = _mm512_set1_epi32(0xFFF);
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512i f = q.biased(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv16));
    closest = _mm512_min_epu32(closest, q.distance(f));
    // the code is bits 12..19 of f; the byte truncation drops the exponent above them
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(_mm512_srli_epi32(f, 12)));
  }
  if (_mm512_reduce_min_epu32(closest) < static_cast<uint32_t>(2 * _mm512_cvtsi512_si32(q.near))) {
    // rare: a value next to a code boundary; the exact scalar method decides those lanes
    for (int64_t i = 0; i < kBlock; i += 16) {
      const __mmask16 nr = q.uncertain(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv16));
      for (int l = 0; nr >> l; ++l)
        if ((nr >> l) & 1) codes[i + l] = quantize_one(buf[i + l] * inv, bucket, thr);
    }
  }
}

struct Avx512Tables {
  Dequantizer deq_m, deq_v;
  SegmentQuantizer<true> quant_m;
  SegmentQuantizer<false> quant_v;
  explicit Avx512Tables(const Maps& t)
      : deq_m(t.qm), deq_v(t.qv), quant_m(t.seg_m, t.near_units), quant_v(t.seg_v, t.near_units) {}
};

// One full 256-element block. Same float operations, same order as the scalar loop below
// (and as the PyTorch reference).
inline void update_block_avx512(float* __restrict pb, const float* __restrict gb,
                                uint8_t* __restrict mcb, float* __restrict ma_b,
                                uint8_t* __restrict vcb, float* __restrict va_b,
                                const Avx512Tables& T, const Maps& maps, float* __restrict mbuf,
                                float* __restrict vbuf, const Coeffs& c) {
  const __m512 am = _mm512_set1_ps(*ma_b), av = _mm512_set1_ps(*va_b);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 ss = _mm512_set1_ps(c.step_size), decay = _mm512_set1_ps(c.decay);
  __m512 amax_m = _mm512_setzero_ps(), amax_v = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < kBlock; i0 += 64) {
    __m512 mq[4], vq[4];
    T.deq_m.lookup64(mcb + i0, mq);
    T.deq_v.lookup64(vcb + i0, vq);
    for (int q = 0; q < 4; ++q) {
      const int64_t i = i0 + 16 * q;
      const __m512 g = _mm512_loadu_ps(gb + i);
      __m512 m = _mm512_mul_ps(mq[q], am);
      __m512 v = _mm512_mul_ps(vq[q], av);
      m = _mm512_add_ps(_mm512_mul_ps(m, b1), _mm512_mul_ps(g, omb1));
      v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), ibc2), eps);
      const __m512 p = _mm512_loadu_ps(pb + i);
      _mm512_storeu_ps(pb + i, _mm512_sub_ps(_mm512_mul_ps(p, decay),
                                             _mm512_mul_ps(_mm512_div_ps(m, denom), ss)));
      _mm512_store_ps(mbuf + i, m);
      _mm512_store_ps(vbuf + i, v);
      amax_m = _mm512_range_ps(amax_m, m, 0x0B);  // max(|amax|, |m|), sign cleared: one op
      amax_v = _mm512_range_ps(amax_v, v, 0x0B);
    }
  }
  const float am_new = _mm512_reduce_max_ps(amax_m), av_new = _mm512_reduce_max_ps(amax_v);
  *ma_b = am_new;
  *va_b = av_new;
  requantize_avx512(mbuf, am_new, mcb, T.quant_m, maps.bucket_m, maps.thr_m);
  requantize_avx512(vbuf, av_new, vcb, T.quant_v, maps.bucket_v, maps.thr_v);
}
#endif

void update_block_scalar(float* __restrict pb, const float* __restrict gb, uint8_t* __restrict mcb,
                         float* __restrict ma_b, uint8_t* __restrict vcb, float* __restrict va_b,
                         int64_t len, const Maps& t, float* __restrict mbuf,
                         float* __restrict vbuf, const Coeffs& c) {
  const float am = *ma_b;
  const float av = *va_b;
  float amax_m = 0.f;
  float amax_v = 0.f;
#pragma omp simd reduction(max : amax_m, amax_v)
  for (int64_t i = 0; i < len; ++i) {
    const float gi = gb[i];
    float mi = t.qm[mcb[i]] * am;
    float vi = t.qv[vcb[i]] * av;
    mi = mi * c.beta1 + gi * c.one_minus_beta1;
    vi = vi * c.beta2 + (gi * gi) * c.one_minus_beta2;
    const float denom = std::sqrt(vi) * c.inv_bc2_sqrt + c.eps;
    pb[i] = pb[i] * c.decay - (mi / denom) * c.step_size;
    mbuf[i] = mi;
    vbuf[i] = vi;
    amax_m = std::max(amax_m, std::fabs(mi));
    amax_v = std::max(amax_v, std::fabs(vi));
  }
  *ma_b = amax_m;
  *va_b = amax_v;
  const float inv_m = amax_m > 0.f ? 1.f / amax_m : 1.f;
  const float inv_v = amax_v > 0.f ? 1.f / amax_v : 1.f;
  for (int64_t i = 0; i < len; ++i) {
    mcb[i] = quantize_one(mbuf[i] * inv_m, t.bucket_m, t.thr_m);
    vcb[i] = quantize_one(vbuf[i] * inv_v, t.bucket_v, t.thr_v);
  }
}

#ifdef OUTCORE_AVX512
using Tables = Avx512Tables;
#else
struct Tables {
  explicit Tables(const Maps&) {}
};
#endif

void update_range(float* p, const float* g, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                  const Maps& maps, const Tables& tables, int64_t n, int64_t block_begin,
                  int64_t block_end, const Coeffs& c) {
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
#ifdef OUTCORE_AVX512
    if (len == kBlock) {
      update_block_avx512(p + start, g + start, mc + start, ma + b, vc + start, va + b, tables,
                          maps, mbuf, vbuf, c);
      continue;
    }
#endif
    update_block_scalar(p + start, g + start, mc + start, ma + b, vc + start, va + b, len, maps,
                        mbuf, vbuf, c);
  }
}

void check(const torch::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

}  // namespace

namespace {

struct Job {  // one tensor's update
  float* p;
  const float* g;
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
  int64_t n, nblocks;
  Coeffs c;
};

Maps make_maps(const std::vector<torch::Tensor>& t, int64_t seg_near) {
  // t: qmap_m, qmap_v, bucket_m, thr_m, bucket_v, thr_v, seg_m, seg_v
  TORCH_CHECK(t.size() == 8, "expected 8 table tensors, got ", t.size());
  check(t[0], at::kFloat, 256, "qmap_m");
  check(t[1], at::kFloat, 256, "qmap_v");
  check(t[2], at::kByte, kTableBytes, "bucket_m");
  check(t[3], at::kFloat, 256, "thr_m");
  check(t[4], at::kByte, kTableBytes, "bucket_v");
  check(t[5], at::kFloat, 256, "thr_v");
  check(t[6], at::kFloat, kSegRows * kSegCols, "seg_m");
  check(t[7], at::kFloat, kSegRows * kSegCols, "seg_v");
  TORCH_CHECK(seg_near >= 1 && seg_near < 1024, "seg_near=", seg_near, " must be in [1, 1024)");
  return Maps{t[0].data_ptr<float>(), t[1].data_ptr<float>(), t[2].data_ptr<uint8_t>(),
              t[3].data_ptr<float>(), t[4].data_ptr<uint8_t>(), t[5].data_ptr<float>(),
              t[6].data_ptr<float>(), t[7].data_ptr<float>(), static_cast<int32_t>(seg_near)};
}

// All jobs' blocks, in chunks of kChunkBlocks, handed out dynamically: each worker pulls the
// next chunk (of any tensor) until none is left, so a thread the OS parks on a shared machine
// delays only the chunk it holds, and a whole optimizer step is one parallel region (one
// fork/join, not one per tensor). The counter is all the workers share; chunks are disjoint.
void run_jobs(const std::vector<Job>& jobs, const Maps& maps) {
  std::vector<int64_t> first_chunk(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j)
    first_chunk[j + 1] = first_chunk[j] + (jobs[j].nblocks + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t nchunks = first_chunk.back();
  auto run_chunk = [&](int64_t k, const Tables& tables) {
    const size_t j = std::upper_bound(first_chunk.begin(), first_chunk.end(), k) - first_chunk.begin() - 1;
    const Job& t = jobs[j];
    const int64_t b0 = (k - first_chunk[j]) * kChunkBlocks;
    update_range(t.p, t.g, t.mc, t.ma, t.vc, t.va, maps, tables, t.n, b0,
                 std::min(t.nblocks, b0 + kChunkBlocks), t.c);
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), nchunks);
  if (workers <= 1) {
    const Tables tables(maps);
    for (int64_t k = 0; k < nchunks; ++k) run_chunk(k, tables);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const Tables tables(maps);  // per worker: the maps' registers / L1 copies, built once
    for (int64_t k = next.fetch_add(1); k < nchunks; k = next.fetch_add(1)) run_chunk(k, tables);
  });
}

Job make_job(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& m_codes,
             const torch::Tensor& m_absmax, const torch::Tensor& v_codes,
             const torch::Tensor& v_absmax, const double* k) {
  const int64_t n = param.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check(param, at::kFloat, n, "param");
  check(grad, at::kFloat, n, "grad");
  check(m_codes, at::kByte, n, "m_codes");
  check(v_codes, at::kByte, n, "v_codes");
  check(m_absmax, at::kFloat, nblocks, "m_absmax");
  check(v_absmax, at::kFloat, nblocks, "v_absmax");
  // Scalars are rounded to fp32 exactly as PyTorch rounds Python scalars for fp32 tensors.
  const Coeffs c{static_cast<float>(k[0]), static_cast<float>(k[1]), static_cast<float>(k[2]),
                 static_cast<float>(k[3]), static_cast<float>(k[4]), static_cast<float>(k[5]),
                 static_cast<float>(k[6]), static_cast<float>(k[7])};
  return Job{param.data_ptr<float>(), grad.data_ptr<float>(), m_codes.data_ptr<uint8_t>(),
             m_absmax.data_ptr<float>(), v_codes.data_ptr<uint8_t>(), v_absmax.data_ptr<float>(),
             n, nblocks, c};
}

}  // namespace

// One tensor. coeffs: beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps,
// lr / (1 - beta1^t), 1 - lr * wd (kernels/adamw8bit.py: Coefficients).
void adamw8bit_update(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes,
                      torch::Tensor m_absmax, torch::Tensor v_codes, torch::Tensor v_absmax,
                      std::vector<torch::Tensor> tables, int64_t seg_near,
                      std::vector<double> coeffs) {
  TORCH_CHECK(coeffs.size() == 8, "expected 8 coefficients, got ", coeffs.size());
  const Maps maps = make_maps(tables, seg_near);
  run_jobs({make_job(param, grad, m_codes, m_absmax, v_codes, v_absmax, coeffs.data())}, maps);
}

// Many tensors in one parallel region; coeffs holds 8 per tensor, in order.
void adamw8bit_update_many(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                           std::vector<torch::Tensor> m_codes, std::vector<torch::Tensor> m_absmax,
                           std::vector<torch::Tensor> v_codes, std::vector<torch::Tensor> v_absmax,
                           std::vector<torch::Tensor> tables, int64_t seg_near,
                           std::vector<double> coeffs) {
  const size_t k = params.size();
  TORCH_CHECK(grads.size() == k && m_codes.size() == k && m_absmax.size() == k &&
                  v_codes.size() == k && v_absmax.size() == k && coeffs.size() == 8 * k,
              "adamw8bit_update_many: lists of different lengths");
  const Maps maps = make_maps(tables, seg_near);
  std::vector<Job> jobs;
  jobs.reserve(k);
  for (size_t i = 0; i < k; ++i)
    jobs.push_back(make_job(params[i], grads[i], m_codes[i], m_absmax[i], v_codes[i], v_absmax[i],
                            coeffs.data() + 8 * i));
  run_jobs(jobs, maps);
}

// Block-wise quantization of `x` with the update's requantization code (tests compare it
// with the reference on adversarial values: thresholds, their neighbours, tiny and huge).
std::tuple<torch::Tensor, torch::Tensor> quantize_blockwise(torch::Tensor x, bool is_signed,
                                                            torch::Tensor bucket, torch::Tensor thr,
                                                            torch::Tensor seg, int64_t seg_near) {
  const int64_t n = x.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check(x, at::kFloat, n, "x");
  check(bucket, at::kByte, kTableBytes, "bucket");
  check(thr, at::kFloat, 256, "thr");
  check(seg, at::kFloat, kSegRows * kSegCols, "seg");
  auto codes = torch::empty({n}, x.options().dtype(at::kByte));
  auto absmax = torch::empty({nblocks}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
  const uint8_t* bp = bucket.data_ptr<uint8_t>();
  const float* tp = thr.data_ptr<float>();
#ifdef OUTCORE_AVX512
  TORCH_CHECK(seg_near >= 1 && seg_near < 1024, "seg_near=", seg_near, " must be in [1, 1024)");
  const SegmentQuantizer<true> qs(seg.data_ptr<float>(), static_cast<int32_t>(seg_near));
  const SegmentQuantizer<false> qu(seg.data_ptr<float>(), static_cast<int32_t>(seg_near));
#endif
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
    float amax = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      // the unsigned path serves the second moment, which is never negative
      TORCH_CHECK(is_signed || !(xp[start + i] < 0.f), "x[", start + i, "]=", xp[start + i],
                  " is negative; the unsigned map quantizes values >= 0 only");
      amax = std::max(amax, std::fabs(xp[start + i]));
    }
    ap[b] = amax;
#ifdef OUTCORE_AVX512
    if (len == kBlock) {
      if (is_signed) requantize_avx512(xp + start, amax, cp + start, qs, bp, tp);
      else requantize_avx512(xp + start, amax, cp + start, qu, bp, tp);
      continue;
    }
#endif
    const float inv = amax > 0.f ? 1.f / amax : 1.f;
    for (int64_t i = 0; i < len; ++i) cp[start + i] = quantize_one(xp[start + i] * inv, bp, tp);
  }
  return {codes, absmax};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw8bit_update", &adamw8bit_update, "fused block-wise 8-bit AdamW update (in place)");
  m.def("adamw8bit_update_many", &adamw8bit_update_many,
        "fused block-wise 8-bit AdamW update of many tensors (in place, one parallel region)");
  m.def("quantize_blockwise", &quantize_blockwise, "block-wise 8-bit quantization (the update's path)");
}
