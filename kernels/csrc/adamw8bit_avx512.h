// The AVX-512 block update of the CPU 8-bit AdamW kernel, bit-exact with the reference (see
// adamw8bit_cpu.cpp for the contract and kernels/adamw8bit_segments.py for the quantizer's
// model). Included by adamw8bit_cpu.cpp inside its anonymous namespace, after the definitions
// it uses (kBlock, Coeffs, Maps, quantize_one); one translation unit only. kernels/adamw8bit.py
// hashes every file of kernels/csrc/ into the build flags, so an edit here rebuilds the cache.
//
// Per block: dequantize both moments (Dequantizer: exact in-register lookups), update (the
// reference's operations in its order: no FMA) into two L1 buffers while taking their absmax,
// then requantize both (SegQuant, the same tables and arithmetic as the AVX2 path, 16 lanes).
// On Zen 4 the vector permutes, shifts, converts and FP multiplies share two pairs of the
// four FP pipes: the code keeps compares, clamps and maxima in integer ops and issues
// independent chains stage by stage (perf: dispatch otherwise stalls on a full FP scheduler).
#pragma once

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

// The segment quantizer for 16 values (kernels/adamw8bit_segments.py: segment_code, op for
// op). The 8-column tables are repeated in both halves of each register: vpermd reads 4 bits.
template <bool kSigned>
struct SegQuant {
  __m512i bnd, clamp;  // signed map: the boundaries' bits doubled (all ones for none)
  __m512 slope, off;
  static __m512i twice(const float* row) {
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    return _mm512_inserti64x4(_mm512_castsi256_si512(r), r, 1);
  }
  explicit SegQuant(const float* seg)
      : bnd(kSigned ? _mm512_or_si512(_mm512_slli_epi32(twice(seg), 1), _mm512_srli_epi32(twice(seg), 30))
                    : twice(seg)),
        clamp(twice(seg + 3 * kSegCols)),
        slope(_mm512_castsi512_ps(twice(seg + kSegCols))), off(_mm512_castsi512_ps(twice(seg + 2 * kSegCols))) {}
  // The bits of the biased f of y[0..n) (bits 15..22: the positive code), stage by stage over
  // the n vectors: each is a chain of ~25 cycles of latency (mulhi, three permutes, fma).
  template <int n>
  inline void f_bits(const __m512 y[n], __m512i fb[n]) const {
    // the key, doubled for the signed map: |y|'s bits rotated left by one, the sign in bit 0
    // (an ulp of the doubled key where y < 0); f reads |y|
    constexpr int kShift = kSigned ? 24 : 23;  // to the fp32 exponent
    __m512i a[n], key[n], q[n];
    for (int k = 0; k < n; ++k) {
      key[k] = kSigned ? _mm512_rol_epi32(_mm512_castps_si512(y[k]), 1) : _mm512_castps_si512(y[k]);
      a[k] = kSigned ? _mm512_srli_epi32(key[k], 1) : key[k];
    }
    for (int k = 0; k < n; ++k)  // slot: vpermd reads q & 15, the tables repeat every 8
      q[k] = _mm512_mulhi_epu16(_mm512_srli_epi32(_mm512_max_epu32(key[k], _mm512_set1_epi32(kSegELo << kShift)), kShift),
                                _mm512_set1_epi32(kSegSlotMul));
    for (int k = 0; k < n; ++k)  // column: + (key > boundary)
      q[k] = _mm512_mask_add_epi32(q[k], _mm512_cmpgt_epu32_mask(key[k], _mm512_permutexvar_epi32(q[k], bnd)),
                                   q[k], _mm512_set1_epi32(1));
    for (int k = 0; k < n; ++k) a[k] = _mm512_min_epi32(a[k], _mm512_permutexvar_epi32(q[k], clamp));
    for (int k = 0; k < n; ++k)
      fb[k] = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a[k]), _mm512_permutexvar_ps(q[k], slope),
                                                  _mm512_permutexvar_ps(q[k], off)));
  }
  // Codes of 64 values y[0..3] into out; folds f's fraction (units of 2^-15, below 2 * near
  // exactly in the guard band) into *dmin.
  inline void codes64(const __m512 y[4], uint8_t* __restrict out, __m512i* dmin) const {
    __m512i c[4];
    f_bits<4>(y, c);
    for (int k = 0; k < 4; ++k) {
      *dmin = _mm512_min_epu32(*dmin, _mm512_and_si512(c[k], _mm512_set1_epi32(0x7FFF)));
      c[k] = _mm512_srli_epi32(c[k], 15);  // 0x8700 + code: byte 0 is the code
    }
    store_codes64(c, y, out);
  }
  // Byte 0 of each dword of c[0..3] to out, mirrored to 254 - code (saturating: the mirror of
  // 255 is 0) where y < 0 for the signed map.
  static inline void store_codes64(const __m512i c[4], const __m512 y[4], uint8_t* __restrict out) {
#ifdef __AVX512VBMI__
    // byte k (and 32 + k) of a two-register byte permute = byte 4k of the 128 bytes (a, b),
    // i.e. element k of a (k < 16) or of b; the blend takes bytes 0..31 from (c0, c1)
    alignas(64) static constexpr uint8_t kPick[64] = {
        0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92,
        96, 100, 104, 108, 112, 116, 120, 124, 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
        64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124};
    const __m512i pick = _mm512_load_si512(kPick);
    __m512i b = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_permutex2var_epi8(c[0], pick, c[1]),
                                       _mm512_permutex2var_epi8(c[2], pick, c[3]));
#else
    // truncating packs (vpmovdb), 16 codes each
    __m512i b = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm512_cvtepi32_epi8(c[1]), _mm512_cvtepi32_epi8(c[0]))),
        _mm256_set_m128i(_mm512_cvtepi32_epi8(c[3]), _mm512_cvtepi32_epi8(c[2])), 1);
#endif
    if (kSigned) {
      const __mmask64 n = _mm512_kunpackd(
          _mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(y[3])), _mm512_movepi32_mask(_mm512_castps_si512(y[2]))),
          _mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(y[1])), _mm512_movepi32_mask(_mm512_castps_si512(y[0]))));
      b = _mm512_mask_subs_epu8(b, n, _mm512_set1_epi8(static_cast<char>(254)), b);
    }
    _mm512_storeu_si512(out, b);
  }
};

struct VecTables {
  const Maps* maps;
  Dequantizer deq_m, deq_v;
  SegQuant<true> quant_m;
  SegQuant<false> quant_v;
  explicit VecTables(const Maps& t)
      : maps(&t), deq_m(t.qm), deq_v(t.qv), quant_m(t.seg_m), quant_v(t.seg_v) {}
};

inline float block_inv(float absmax) { return absmax > 0.f ? 1.f / absmax : 1.f; }

// The guarded lanes of a block (rare: ~1e-4 of values), redone with the exact scalar method.
template <bool kSigned>
void fix_guarded(const float* __restrict buf, float inv, uint8_t* __restrict codes,
                 const SegQuant<kSigned>& q, const uint8_t* bucket, const float* thr) {
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < kBlock; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(buf + i), inv16);
    __m512i fb;
    q.template f_bits<1>(&y, &fb);
    __mmask16 mask = _mm512_cmplt_epu32_mask(_mm512_and_si512(fb, _mm512_set1_epi32(0x7FFF)),
                                             _mm512_set1_epi32(2 * kSegNear));
    for (; mask; mask &= mask - 1) {
      const int l = __builtin_ctz(mask);
      codes[i + l] = quantize_one(buf[i + l] * inv, bucket, thr);
    }
  }
}

// Codes of the 256 values buf[i] / absmax (one block).
template <bool kSigned>
inline void requantize_vec(const float* __restrict buf, float absmax, uint8_t* __restrict codes,
                           const SegQuant<kSigned>& q, const uint8_t* bucket, const float* thr) {
  const float inv = block_inv(absmax);
  const __m512 inv16 = _mm512_set1_ps(inv);
  __m512i dmin = _mm512_set1_epi32(0x7FFF);
  for (int64_t i = 0; i < kBlock; i += 64) {
    __m512 y[4];
    for (int k = 0; k < 4; ++k) y[k] = _mm512_mul_ps(_mm512_loadu_ps(buf + i + 16 * k), inv16);
    q.codes64(y, codes + i, &dmin);
  }
  if (_mm512_reduce_min_epu32(dmin) < static_cast<uint32_t>(2 * kSegNear)) fix_guarded(buf, inv, codes, q, bucket, thr);
}

// Both moments' codes of one block in one loop: two independent chains side by side for the
// out-of-order core (each alone leaves it waiting on its own latencies).
inline void requantize_both_vec(const float* __restrict mbuf, float am, uint8_t* __restrict mcb,
                                const float* __restrict vbuf, float av, uint8_t* __restrict vcb,
                                const VecTables& T) {
  const float inv_m = block_inv(am), inv_v = block_inv(av);
  const __m512 im = _mm512_set1_ps(inv_m), iv = _mm512_set1_ps(inv_v);
  __m512i dmin_m = _mm512_set1_epi32(0x7FFF), dmin_v = dmin_m;
  for (int64_t i = 0; i < kBlock; i += 64) {
    __m512 ym[4], yv[4];
    for (int k = 0; k < 4; ++k) ym[k] = _mm512_mul_ps(_mm512_loadu_ps(mbuf + i + 16 * k), im);
    for (int k = 0; k < 4; ++k) yv[k] = _mm512_mul_ps(_mm512_loadu_ps(vbuf + i + 16 * k), iv);
    T.quant_m.codes64(ym, mcb + i, &dmin_m);
    T.quant_v.codes64(yv, vcb + i, &dmin_v);
  }
  const Maps& t = *T.maps;
  const auto hit = [](__m512i d) { return _mm512_reduce_min_epu32(d) < static_cast<uint32_t>(2 * kSegNear); };
  if (hit(dmin_m)) fix_guarded(mbuf, inv_m, mcb, T.quant_m, t.bucket_m, t.thr_m);
  if (hit(dmin_v)) fix_guarded(vbuf, inv_v, vcb, T.quant_v, t.bucket_v, t.thr_v);
}

// The moments and the param of one full 256-element block, as the reference computes them
// (one rounding per operation, in its order); fresh moments to mbuf / vbuf, their absmax to
// *ma_b / *va_b.
inline void update_block_avx512(float* __restrict pb, const float* __restrict gb,
                                const uint8_t* __restrict mcb, float* __restrict ma_b,
                                const uint8_t* __restrict vcb, float* __restrict va_b,
                                const VecTables& T, float* __restrict mbuf,
                                float* __restrict vbuf, const Coeffs& c) {
  const __m512 am = _mm512_set1_ps(*ma_b), av = _mm512_set1_ps(*va_b);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 ibc2 = _mm512_set1_ps(c.inv_bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 ss = _mm512_set1_ps(c.step_size), decay = _mm512_set1_ps(c.decay);
  // absmax as the integer max of the |.| bit patterns: integer pipes, not the busy FP ones
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i amax_m = _mm512_setzero_si512(), amax_v = _mm512_setzero_si512();
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
      const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(pb + i), decay);
      _mm512_storeu_ps(pb + i, _mm512_sub_ps(p, _mm512_mul_ps(_mm512_div_ps(m, denom), ss)));
      _mm512_store_ps(mbuf + i, m);
      _mm512_store_ps(vbuf + i, v);
      amax_m = _mm512_max_epu32(amax_m, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      amax_v = _mm512_max_epu32(amax_v, _mm512_castps_si512(v));  // v >= 0
    }
  }
  *ma_b = _mm512_reduce_max_ps(_mm512_castsi512_ps(amax_m));
  *va_b = _mm512_reduce_max_ps(_mm512_castsi512_ps(amax_v));
}

// Full blocks [b0, b1) of one tensor (weights and gradients through io: Fp32Params or
// LeanParams): each block's update, then its requantization (the moments' absmax must be known
// first).
template <class IO>
inline void update_blocks_vec(IO& io, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                              const VecTables& T, int64_t b0, int64_t b1, const Coeffs& c) {
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * kBlock;
    const float* gb = io.grad(s, kBlock);
    update_block_avx512(io.param(s, kBlock), gb, mc + s, ma + b, vc + s, va + b, T, mbuf, vbuf, c);
    io.store(s, kBlock);
    requantize_both_vec(mbuf, ma[b], mc + s, vbuf, va[b], vc + s, T);
  }
}
