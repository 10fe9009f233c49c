// The FP8 state format of the CPU 8-bit AdamW kernel (kernels/adamw8bit.py: STATE_FORMATS,
// "fp8"; kernels/quantize_fp8.py): the first moment as float8_e4m3fn, the second as
// float8_e5m2, one fp32 absmax per 256-element block, a value being code * (absmax / FP8_MAX).
// Bit-exact with the reference (adamw8bit_update_ref with state_format="fp8": torch's casts).
// Included by adamw8bit_cpu.cpp inside its anonymous namespace, after the definitions it uses
// (kBlock, Coeffs, adamw_step, hmax8); one translation unit only.
//
// Why a second format: the dynamic map's dequantization is a 256-entry table lookup and its
// quantization a search, which AVX2 can only do with scalar loads or many permutes (~124
// instructions per 8 elements, adamw8bit_avx2.h). FP8 codes are a float's top bits: decoding
// 8 of them is 4 vector instructions (F16C), encoding 8 or 11, with no table and no memory
// operation (~61 instructions per 8 elements for the whole update, callgrind).
#pragma once

// One FP8 format: kMant mantissa bits, exponent bias kBias, the fp32 bits of its largest value.
template <int kMant, int kBias, int kMaxBits>
struct Fp8Format {
  static constexpr int kShift = 23 - kMant;  // code bit kMant -> fp32 exponent bit 23
  // Below the smallest normal (2^(1 - bias)) a code is subnormal.
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(128 - kBias) << 23;
  // Adding 2^(24 - kBias - kMant) (whose ulp is the FP8 subnormal step, 2^(1 - kBias - kMant))
  // to a subnormal's magnitude rounds it to nearest even; the code is the sum's low bits.
  static constexpr uint32_t kDenormBits = static_cast<uint32_t>(127 + 24 - kBias - kMant) << 23;
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << 23;
  static float max() {
    const uint32_t b = static_cast<uint32_t>(kMaxBits);
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  }
};
using E4M3 = Fp8Format<3, 7, 0x43E00000>;   // 448
using E5M2 = Fp8Format<2, 15, 0x47600000>;  // 57344

// The per-block factors: absmax -> (dequantization scale, quantization multiplier). The floor
// keeps the multiplier finite (a block of zeros quantizes to zeros either way).
constexpr float kFp8AbsmaxFloor = 0x1p-100f;
template <class F>
inline float fp8_scale(float absmax) { return absmax / F::max(); }
template <class F>
inline float fp8_inv(float absmax) { return F::max() / std::max(absmax, kFp8AbsmaxFloor); }

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A code's value (exact): normal codes by moving the bits into place and re-biasing the
// exponent; subnormal ones (exponent 0) as a normal with exponent 1 minus the implicit one.
template <class F>
inline float fp8_decode(uint8_t code) {
  const uint32_t mag = static_cast<uint32_t>(code & 0x7F) << F::kShift;
  const bool sub = mag < (1u << 23);
  const float f = u2f(mag + F::kRebias + (sub ? 1u << 23 : 0u)) - (sub ? u2f(F::kMinNormalBits) : 0.f);
  return u2f(f2u(f) | (static_cast<uint32_t>(code & 0x80) << 24));
}

// The code of y, rounded to nearest even, for finite |y| <= F::max() * (1 + 2^-21) (c10's
// fp8 casts, which the reference calls, compute the same there).
template <class F>
inline uint8_t fp8_encode(float y) {
  const uint32_t bits = f2u(y);
  const uint32_t a = bits & 0x7FFFFFFFu;
  uint32_t r;
  if (a < F::kMinNormalBits) {
    r = f2u(u2f(a) + u2f(F::kDenormBits)) - F::kDenormBits;
  } else {
    r = (a - F::kRebias + ((1u << (F::kShift - 1)) - 1) + ((a >> F::kShift) & 1)) >> F::kShift;
  }
  return static_cast<uint8_t>(r | ((bits >> 24) & 0x80));
}

// A partial block (and every block below AVX2): the reference's operations element by element.
inline void update_block_fp8_scalar(float* __restrict pb, const float* __restrict gb, uint8_t* __restrict mcb,
                                    float* __restrict ma_b, uint8_t* __restrict vcb, float* __restrict va_b,
                                    int64_t len, float* __restrict mbuf, float* __restrict vbuf, const Coeffs& c) {
  const float sm = fp8_scale<E4M3>(*ma_b);
  const float sv = fp8_scale<E5M2>(*va_b);
  float amax_m = 0.f;
  float amax_v = 0.f;
  for (int64_t i = 0; i < len; ++i) {
    float mi = fp8_decode<E4M3>(mcb[i]) * sm;
    float vi = fp8_decode<E5M2>(vcb[i]) * sv;
    pb[i] = adamw_step(pb[i], gb[i], mi, vi, c);
    mbuf[i] = mi;
    vbuf[i] = vi;
    amax_m = std::max(amax_m, std::fabs(mi));
    amax_v = std::max(amax_v, std::fabs(vi));
  }
  *ma_b = amax_m;
  *va_b = amax_v;
  const float inv_m = fp8_inv<E4M3>(amax_m);
  const float inv_v = fp8_inv<E5M2>(amax_v);
  for (int64_t i = 0; i < len; ++i) {
    mcb[i] = fp8_encode<E4M3>(mbuf[i] * inv_m);
    vcb[i] = fp8_encode<E5M2>(vbuf[i] * inv_v);
  }
}

#ifdef OUTCORE_VEC
// 8 lanes (AVX2 + FMA + F16C; the AVX-512 builds run these too). The same results as the
// scalar functions above, lane by lane.
template <class F, bool kSigned>
struct Fp8Vec {
  // An FP8 code is a truncated fp16: E5M2 is the top byte of the fp16 of the same value, E4M3
  // (sign aside) bits 7..13 of the fp16 of value * 2^-8. So vcvtph2ps decodes 8 codes,
  // subnormals included, and the block's scale absorbs the 2^8.
  static constexpr float kHalfScale = kSigned ? 0x1p-8f : 1.f;
  // Values * kHalfScale of 8 codes.
  static inline __m256 decode(const uint8_t* codes) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
    __m128i h;
    if (kSigned)  // sign-extended: bits 15 and 14 hold the sign after the shift; drop 14
      h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(c), 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    else
      h = _mm_slli_epi16(_mm_cvtepu8_epi16(c), 8);
    return _mm256_cvtph_ps(h);
  }
  // Codes of |y| (int32 lanes). Adding 2^(e + 23 - kMant), e the exponent of |y| (of the
  // smallest normal below it), rounds |y| to the FP8 grid (to nearest even: the FPU's
  // rounding); the sum's bits minus the power's count grid steps from 2^e, and the code is that
  // count plus the exponent's offset. 8 operations, one of them a float add.
  static inline __m256i magnitude_code(__m256 y) {
    const __m256i a = kSigned ? _mm256_and_si256(_mm256_castps_si256(y), _mm256_set1_epi32(0x7FFFFFFF))
                              : _mm256_castps_si256(y);
    const __m256i e = _mm256_max_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)),
                                       _mm256_set1_epi32(static_cast<int32_t>(F::kMinNormalBits)));
    const __m256i power = _mm256_add_epi32(e, _mm256_set1_epi32(F::kShift << 23));
    const __m256i sum = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(power)));
    const __m256i offset = _mm256_srli_epi32(
        _mm256_sub_epi32(e, _mm256_set1_epi32(static_cast<int32_t>(F::kMinNormalBits))), F::kShift);
    return _mm256_add_epi32(_mm256_sub_epi32(sum, power), offset);
  }
  // Codes of the 32 values y[0..32) * inv into out (bytes, in order).
  static inline void encode32(const float* __restrict y, __m256 inv, uint8_t* __restrict out) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_mul_ps(_mm256_loadu_ps(y + 8 * k), inv);
    __m256i a = _mm256_packus_epi32(magnitude_code(v[0]), magnitude_code(v[1]));
    __m256i b = _mm256_packus_epi32(magnitude_code(v[2]), magnitude_code(v[3]));
    if (kSigned) {  // the sign bits, packed alike (saturation keeps them), as bit 7 (-0.0 too)
      const __m256i sa = _mm256_packs_epi32(_mm256_castps_si256(v[0]), _mm256_castps_si256(v[1]));
      const __m256i sb = _mm256_packs_epi32(_mm256_castps_si256(v[2]), _mm256_castps_si256(v[3]));
      a = _mm256_or_si256(a, _mm256_and_si256(_mm256_srai_epi16(sa, 15), _mm256_set1_epi16(0x80)));
      b = _mm256_or_si256(b, _mm256_and_si256(_mm256_srai_epi16(sb, 15), _mm256_set1_epi16(0x80)));
    }
    // the packs work per 128-bit lane: dword l of lane h holds vector l's elements 4h..4h+3
    const __m256i r = _mm256_packus_epi16(a, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};

// Full blocks [b0, b1) of one tensor, two passes per block (the codes need the block's new
// absmax): the codes decoded, the moments updated into two L1 buffers with their absmax and
// the weights stepped; then both moments encoded. The divider's work (sqrt and divide) sits
// with the decoding in the first pass: measured ~4% faster than with the encoding in the
// second (AMD Zen 4, AVX2), and than interleaving block b + 1's first pass with block b's
// second (which was slower still).
template <class IO>
inline void update_blocks_fp8_vec(IO& io, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                                  int64_t b0, int64_t b1, const Coeffs& c) {
  using QM = Fp8Vec<E4M3, true>;
  using QV = Fp8Vec<E5M2, false>;
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  const __m256 b1v = _mm256_set1_ps(c.beta1), omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 b2v = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 ibc2 = _mm256_set1_ps(c.inv_bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 ss = _mm256_set1_ps(c.step_size), decay = _mm256_set1_ps(c.decay);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * kBlock;
    // the decoded E4M3 values are 2^-8 of the codes' (exact): the scale is 2^8 times larger
    const __m256 sm = _mm256_set1_ps(fp8_scale<E4M3>(ma[b]) * (1.f / QM::kHalfScale));
    const __m256 sv = _mm256_set1_ps(fp8_scale<E5M2>(va[b]));
    const float* gb = io.grad(s, kBlock);
    float* pb = io.param(s, kBlock);
    __m256 amax_m = _mm256_setzero_ps(), amax_v = _mm256_setzero_ps();
    for (int64_t k = 0; k < kBlock; k += 8) {
      const __m256 g = _mm256_loadu_ps(gb + k);
      __m256 m = _mm256_mul_ps(QM::decode(mc + s + k), sm);
      __m256 v = _mm256_mul_ps(QV::decode(vc + s + k), sv);
      m = _mm256_add_ps(_mm256_mul_ps(m, b1v), _mm256_mul_ps(g, omb1));
      v = _mm256_add_ps(_mm256_mul_ps(v, b2v), _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
      _mm256_store_ps(mbuf + k, m);
      _mm256_store_ps(vbuf + k, v);
      amax_m = _mm256_max_ps(amax_m, _mm256_and_ps(m, abs_mask));
      amax_v = _mm256_max_ps(amax_v, v);  // v >= 0
      const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
      const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(pb + k), decay);
      _mm256_storeu_ps(pb + k, _mm256_sub_ps(p, _mm256_mul_ps(_mm256_div_ps(m, denom), ss)));
    }
    io.store(s, kBlock);
    ma[b] = hmax8(amax_m);
    va[b] = hmax8(amax_v);
    const __m256 inv_m = _mm256_set1_ps(fp8_inv<E4M3>(ma[b])), inv_v = _mm256_set1_ps(fp8_inv<E5M2>(va[b]));
    for (int64_t i = 0; i < kBlock; i += 32) {
      QM::encode32(mbuf + i, inv_m, mc + s + i);
      QV::encode32(vbuf + i, inv_v, vc + s + i);
    }
  }
}
#endif  // OUTCORE_VEC
