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
// 8 or 16 of them is 4 vector instructions (F16C), encoding 8 or 16 about 10, with no table and
// no memory operation (~62 instructions per 8 elements for the whole update with AVX2,
// callgrind; ~29 with AVX-512's 16 lanes, read from the compiler's assembly).
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
// E4M3's codes decode as fp16 values 2^8 times too small (Fp8Lanes8::decode); the block's scale
// absorbs the factor.
constexpr float kE4M3DecodedScale = 0x1p-8f;

using I32x8 = int32_t __attribute__((vector_size(32)));
inline I32x8 lane_max_i32(I32x8 a, I32x8 b) {
  return reinterpret_cast<I32x8>(_mm256_max_epi32(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
}
#ifdef OUTCORE_AVX512
using I32x16 = int32_t __attribute__((vector_size(64)));
inline I32x16 lane_max_i32(I32x16 a, I32x16 b) {
  return reinterpret_cast<I32x16>(_mm512_max_epi32(reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b)));
}
#endif

// The code of |y| for lanes of any width (I: GCC/Clang int32 vector, VF: float vector of the
// same size, a: |y|'s bits). Adding 2^(e + 23 - kMant), e the exponent of |y| (of the smallest
// normal below it), rounds |y| to the FP8 grid (to nearest even: the FPU's rounding); the sum's
// bits minus the power's count grid steps from 2^e, and the code is that count plus the
// exponent's offset. 8 operations, one of them a float add.
template <class F, class VF, class I>
inline I fp8_magnitude_code(I a) {
  const I e = lane_max_i32(a & static_cast<int32_t>(0x7F800000), I{} + static_cast<int32_t>(F::kMinNormalBits));
  const I power = e + (F::kShift << 23);
  const I sum = reinterpret_cast<I>(reinterpret_cast<VF>(a) + reinterpret_cast<VF>(power));
  return sum - power + ((e - static_cast<int32_t>(F::kMinNormalBits)) >> F::kShift);
}

// One vector width's part of the FP8 block update (update_blocks_fp8_vec): decoding 8 or 16
// codes, encoding kEncodeLanes. Same results as fp8_decode / fp8_encode, lane by lane.
// 8 lanes: AVX2 + FMA + F16C.
struct Fp8Lanes8 {
  using V = __m256;
  using I = I32x8;
  static constexpr int kLanes = 8;
  static constexpr int kEncodeLanes = 32;  // four vectors make one 32-byte store
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hmax(V x) { return hmax8(x); }
  // An FP8 code is a truncated fp16: E5M2 is the top byte of the fp16 of the same value, E4M3
  // (sign aside) bits 7..13 of the fp16 of value * 2^-8. So vcvtph2ps decodes 8 codes,
  // subnormals included.
  template <bool kSigned>
  static V decode(const uint8_t* codes) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
    __m128i h;
    if (kSigned)  // sign-extended: bits 15 and 14 hold the sign after the shift; drop 14
      h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(c), 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    else
      h = _mm_slli_epi16(_mm_cvtepu8_epi16(c), 8);
    return _mm256_cvtph_ps(h);
  }
  template <class F, bool kSigned>
  static __m256i code8(V y) {  // int32 lanes: the codes of |y|
    const __m256i bits = _mm256_castps_si256(y);
    const I a = reinterpret_cast<I>(kSigned ? _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)) : bits);
    return reinterpret_cast<__m256i>(fp8_magnitude_code<F, V>(a));
  }
  // 16 codes (int16 lanes, per 128-bit lane 4 of y0's then 4 of y1's) with their signs as bit 7
  template <class F, bool kSigned>
  static __m256i code16(V y0, V y1) {
    const __m256i c = _mm256_packus_epi32(code8<F, kSigned>(y0), code8<F, kSigned>(y1));
    if (!kSigned) return c;
    // the sign bits, packed alike (saturation keeps them), as bit 7 (-0.0 too)
    const __m256i s = _mm256_packs_epi32(_mm256_castps_si256(y0), _mm256_castps_si256(y1));
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_srai_epi16(s, 15), _mm256_set1_epi16(0x80)));
  }
  // Codes of the 32 values y[0..32) * inv into out: two saturating packs and one dword permute
  // (the packs work per 128-bit lane: dword l of lane h holds vector l's elements 4h..4h+3).
  template <class F, bool kSigned>
  static void encode(const float* __restrict y, V inv, uint8_t* __restrict out) {
    const __m256i a = code16<F, kSigned>(_mm256_mul_ps(_mm256_loadu_ps(y), inv),
                                         _mm256_mul_ps(_mm256_loadu_ps(y + 8), inv));
    const __m256i b = code16<F, kSigned>(_mm256_mul_ps(_mm256_loadu_ps(y + 16), inv),
                                         _mm256_mul_ps(_mm256_loadu_ps(y + 24), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};

#ifdef OUTCORE_AVX512
// 16 lanes: AVX-512 F/BW/VL/DQ (+ F16C). Half the instructions per element of Fp8Lanes8: on
// cores that split 512-bit operations in two (AMD Zen 4) the vector work is the same, but the
// front end issues half as many instructions; and vpmovdb packs 16 codes in one.
struct Fp8Lanes16 {
  using V = __m512;
  using I = I32x16;
  static constexpr int kLanes = 16;
  static constexpr int kEncodeLanes = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hmax(V x) { return _mm512_reduce_max_ps(x); }
  template <bool kSigned>
  static V decode(const uint8_t* codes) {  // as Fp8Lanes8::decode
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    __m256i h;
    if (kSigned)
      h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                           _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    else
      h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8);
    return _mm512_cvtph_ps(h);
  }
  template <class F, bool kSigned>
  static void encode(const float* __restrict y, V inv, uint8_t* __restrict out) {
    const V v = _mm512_mul_ps(_mm512_loadu_ps(y), inv);
    const __m512i bits = _mm512_castps_si512(v);
    const I a = reinterpret_cast<I>(kSigned ? _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)) : bits);
    __m512i code = reinterpret_cast<__m512i>(fp8_magnitude_code<F, V>(a));
    if (kSigned)  // | (bits >> 24) & 0x80: bit 7 where the sign is set (-0.0 too), one ternary-logic op
      code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(code));
  }
};
using Fp8Lanes = Fp8Lanes16;
#else
using Fp8Lanes = Fp8Lanes8;
#endif

// Codes of one block's values y[0..kBlock) * inv (fp8_quantize_blockwise's full blocks).
template <class F, bool kSigned>
inline void fp8_encode_block(const float* __restrict y, float inv, uint8_t* __restrict out) {
  for (int64_t i = 0; i < kBlock; i += Fp8Lanes::kEncodeLanes)
    Fp8Lanes::encode<F, kSigned>(y + i, Fp8Lanes::set1(inv), out + i);
}

// Full blocks [b0, b1) of one tensor, two passes per block (the codes need the block's new
// absmax): the codes decoded, the moments updated into two L1 buffers with their absmax and
// the weights stepped; then both moments encoded. The divider's work (sqrt and divide) sits
// with the decoding in the first pass: measured ~4% faster than with the encoding in the
// second (AMD Zen 4, AVX2), and than interleaving block b + 1's first pass with block b's
// second (which was slower still).
template <class IO>
inline void update_blocks_fp8_vec(IO& io, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                                  int64_t b0, int64_t b1, const Coeffs& c) {
  using L = Fp8Lanes;
  using V = L::V;
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * kBlock;
    const V sm = L::set1(fp8_scale<E4M3>(ma[b]) * (1.f / kE4M3DecodedScale));
    const V sv = L::set1(fp8_scale<E5M2>(va[b]));
    const float* gb = io.grad(s, kBlock);
    float* pb = io.param(s, kBlock);
    V amax_m = L::set1(0.f), amax_v = L::set1(0.f);
    for (int64_t k = 0; k < kBlock; k += L::kLanes) {
      V m = L::template decode<true>(mc + s + k) * sm;
      V v = L::template decode<false>(vc + s + k) * sv;
      L::store(pb + k, adamw_step(L::load(pb + k), L::load(gb + k), m, v, c));
      L::store(mbuf + k, m);
      L::store(vbuf + k, v);
      amax_m = L::max(amax_m, reinterpret_cast<V>(reinterpret_cast<L::I>(m) & 0x7FFFFFFF));  // |m|
      amax_v = L::max(amax_v, v);  // v >= 0
    }
    io.store(s, kBlock);
    ma[b] = L::hmax(amax_m);
    va[b] = L::hmax(amax_v);
    const V inv_m = L::set1(fp8_inv<E4M3>(ma[b])), inv_v = L::set1(fp8_inv<E5M2>(va[b]));
    for (int64_t i = 0; i < kBlock; i += L::kEncodeLanes) {  // both moments, interleaved
      L::encode<E4M3, true>(mbuf + i, inv_m, mc + s + i);
      L::encode<E5M2, false>(vbuf + i, inv_v, vc + s + i);
    }
  }
}
#endif  // OUTCORE_VEC
