// The AVX-512 block update of the CPU 8-bit AdamW kernel (see adamw8bit_cpu.cpp, whose
// file comment states the numerical contract). Included by adamw8bit_cpu.cpp inside its
// anonymous namespace, after the constants, Coeffs and Maps it uses; one translation unit
// only. kernels/adamw8bit.py hashes every file of kernels/csrc/ into the build flags, so an
// edit here rebuilds the cached extension.
//
// Per block: dequantize both moments (Dequantizer), update (update_block_avx512: FMAs, IEEE
// sqrt and divide) into two L1 buffers while taking their absmax, then requantize both
// (SegmentQuantizer / codes64). On Zen 4/5 the vector permutes, shifts, converts and FP
// multiplies share two pairs of the four FP pipes: the code keeps compares, clamps and maxima
// in integer ops and issues independent chains stage by stage (perf: dispatch otherwise
// stalls on a full FP scheduler).
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

// The code of 16 normalized values (see the file comment and kernels/adamw8bit_segments.py,
// whose numpy model is this code op for op). With a = |y| and k = a for y >= 0, the next
// float above a for y < 0 (boundaries count as "below" for negative values: the reference's
// ties go to the lower code):
//   s = max(k >> 24, 48) & 15      (a slot of two binades; at most one piece boundary in it)
//   j = s + (k > boundary[s])      (mod 16: column j holds the piece at the top of slot j - 1)
//   f = fma(min(k, clamp[j]), slope[j], offset[j])
// and the code is c = trunc(f) saturated to [0, 255] for y >= 0, and 254 - c saturated at 0
// for y < 0: the signed map is symmetric about its code 127 (0.0) except for 1.0 (code
// 255), so a negative value's code mirrors the positive code of its magnitude, and the
// tables hold only positive pieces. Four one-register permutes; the compare and the clamp
// are integer ops on the bit patterns (non-negative floats order like their bits), which
// leaves the FP pipes (shared with the permutes on Zen) to the permutes, the fma and trunc.
template <bool kSigned>
struct SegmentQuantizer {
  __m512i bnd, clamp, pick;
  __m512 slope, off;
  explicit SegmentQuantizer(const float* seg) {
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 64; ++i) idx[i] = static_cast<uint8_t>(4 * (i & 31));
    pick = _mm512_load_si512(idx);
    bnd = _mm512_loadu_si512(seg);
    slope = _mm512_loadu_ps(seg + kSegCols);
    off = _mm512_loadu_ps(seg + 2 * kSegCols);
    clamp = _mm512_loadu_si512(seg + 3 * kSegCols);
  }
  // trunc(f) of 4 x 16 values as int32 (the sign is applied by the caller, on bytes).
  // Stage by stage over the 4 vectors, not vector by vector: the chains are ~15 dependent
  // ops long, and in program order one after another they fill Zen's FP scheduler with ops
  // that wait on their predecessor (measured: dispatch stalled on it most cycles).
  inline void code32x4(const __m512 y[4], __m512i c[4]) const {
    __m512i key[4], e[4], j[4];
    __m512 a[4];
    for (int q = 0; q < 4; ++q) {
      key[q] = _mm512_castps_si512(y[q]);
      if (kSigned)  // |y|, plus one ulp where y < 0
        key[q] = _mm512_add_epi32(_mm512_and_si512(key[q], _mm512_set1_epi32(0x7FFFFFFF)),
                                  _mm512_srli_epi32(key[q], 31));
    }
    // permutexvar reads the low 4 bits: (k >> 24) 48..63 are slots 0..15, i.e. |y| < 2
    for (int q = 0; q < 4; ++q)
      e[q] = _mm512_max_epu32(_mm512_srli_epi32(key[q], 24), _mm512_set1_epi32(kSegSlotLo));
    // + (k > boundary): the sign of boundary - k as 0 / -1, subtracted (boundary -1 where none)
    for (int q = 0; q < 4; ++q) j[q] = _mm512_sub_epi32(_mm512_permutexvar_epi32(e[q], bnd), key[q]);
    for (int q = 0; q < 4; ++q) j[q] = _mm512_sub_epi32(e[q], _mm512_srai_epi32(j[q], 31));
    for (int q = 0; q < 4; ++q)
      a[q] = _mm512_castsi512_ps(_mm512_min_epu32(key[q], _mm512_permutexvar_epi32(j[q], clamp)));
    for (int q = 0; q < 4; ++q)
      a[q] = _mm512_fmadd_ps(a[q], _mm512_permutexvar_ps(j[q], slope), _mm512_permutexvar_ps(j[q], off));
    for (int q = 0; q < 4; ++q) c[q] = _mm512_cvttps_epi32(a[q]);
  }
};

// Codes of 64 normalized values y into out: trunc(f) as int32 (in [0, 255] already: f lies
// in (-1, 256) by construction of the tables, NaN gives code 0), byte 0 of every dword
// gathered by two byte permutes and a blend (VBMI) or two packs and a permute; for the
// signed map, 254 - code (saturating) where y < 0.
template <bool kSigned>
inline void codes64(const SegmentQuantizer<kSigned>& q, const __m512 y[4], uint8_t* __restrict out) {
  __m512i c[4];
  q.code32x4(y, c);
#ifdef __AVX512VBMI__
  // pick: byte k (and 32 + k) of the result = byte 4k of the 128 bytes (a, b), i.e. element
  // k of a (k < 16) or of b; the blend takes bytes 0..31 from (c0, c1), 32..63 from (c2, c3)
  const __m512i lo = _mm512_permutex2var_epi8(c[0], q.pick, c[1]);
  const __m512i hi = _mm512_permutex2var_epi8(c[2], q.pick, c[3]);
  __m512i b = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, lo, hi);
#else
  // two saturating packs (per 128-bit lane), then dword 4l + j (elements 4l..4l+3 of vector
  // j) to position 4j + l
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i b = _mm512_permutexvar_epi32(order, _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]),
                                                                   _mm512_packus_epi32(c[2], c[3])));
#endif
  if (kSigned) {
    const __mmask64 n = _mm512_kunpackd(
        _mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(y[3])), _mm512_movepi32_mask(_mm512_castps_si512(y[2]))),
        _mm512_kunpackw(_mm512_movepi32_mask(_mm512_castps_si512(y[1])), _mm512_movepi32_mask(_mm512_castps_si512(y[0]))));
    b = _mm512_mask_subs_epu8(b, n, _mm512_set1_epi8(static_cast<char>(254)), b);
  }
  _mm512_storeu_si512(out, b);
}

inline __m512 block_inv(float absmax) { return _mm512_set1_ps(absmax > 0.f ? 1.f / absmax : 1.f); }

// Codes of the 256 values buf[i] / absmax (one block).
template <bool kSigned>
inline void requantize_avx512(const float* __restrict buf, float absmax, uint8_t* __restrict codes,
                              const SegmentQuantizer<kSigned>& q) {
  const __m512 inv = block_inv(absmax);
  for (int64_t i = 0; i < kBlock; i += 64) {
    __m512 y[4];
    for (int j = 0; j < 4; ++j) y[j] = _mm512_mul_ps(_mm512_loadu_ps(buf + i + 16 * j), inv);
    codes64(q, y, codes + i);
  }
}

// Both moments of one block in one loop: two independent chains side by side for the
// out-of-order core (each alone leaves it waiting on its own latencies).
inline void requantize_both_avx512(const float* __restrict mbuf, float am, uint8_t* __restrict mcb,
                                   const SegmentQuantizer<true>& qm, const float* __restrict vbuf,
                                   float av, uint8_t* __restrict vcb, const SegmentQuantizer<false>& qv) {
  const __m512 inv_m = block_inv(am), inv_v = block_inv(av);
  for (int64_t i = 0; i < kBlock; i += 64) {
    __m512 ym[4], yv[4];
    for (int j = 0; j < 4; ++j) ym[j] = _mm512_mul_ps(_mm512_loadu_ps(mbuf + i + 16 * j), inv_m);
    for (int j = 0; j < 4; ++j) yv[j] = _mm512_mul_ps(_mm512_loadu_ps(vbuf + i + 16 * j), inv_v);
    codes64(qm, ym, mcb + i);
    codes64(qv, yv, vcb + i);
  }
}

struct Avx512Tables {
  Dequantizer deq_m, deq_v;
  SegmentQuantizer<true> quant_m;
  SegmentQuantizer<false> quant_v;
  explicit Avx512Tables(const Maps& t) : deq_m(t.qm), deq_v(t.qv), quant_m(t.seg_m), quant_v(t.seg_v) {}
};

// The moments and the param of one full 256-element block, with FMAs (see the file comment
// for the tolerance); the fresh moments go to mbuf / vbuf, their absmax to *ma_b / *va_b:
//   m = fma(deq_m, absmax_m * b1, g * (1 - b1))
//   v = fma(deq_v, absmax_v * b2, g * (g * (1 - b2)))
//   p = p * decay - m / fma(sqrt(v), inv_bc2_sqrt / step_size, eps / step_size)
inline void update_block_avx512(float* __restrict pb, const float* __restrict gb,
                                uint8_t* __restrict mcb, float* __restrict ma_b,
                                uint8_t* __restrict vcb, float* __restrict va_b,
                                const Avx512Tables& T, float* __restrict mbuf,
                                float* __restrict vbuf, const Coeffs& c) {
  const __m512 amb1 = _mm512_set1_ps(*ma_b * c.beta1), avb2 = _mm512_set1_ps(*va_b * c.beta2);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 dscale = _mm512_set1_ps(c.denom_scale), deps = _mm512_set1_ps(c.denom_eps);
  const __m512 decay = _mm512_set1_ps(c.decay);
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
      const __m512 m = _mm512_fmadd_ps(mq[q], amb1, _mm512_mul_ps(g, omb1));
      const __m512 v = _mm512_fmadd_ps(vq[q], avb2, _mm512_mul_ps(g, _mm512_mul_ps(g, omb2)));
      const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), dscale, deps);
      _mm512_storeu_ps(pb + i, _mm512_fmsub_ps(_mm512_loadu_ps(pb + i), decay, _mm512_div_ps(m, denom)));
      _mm512_store_ps(mbuf + i, m);
      _mm512_store_ps(vbuf + i, v);
      amax_m = _mm512_max_epu32(amax_m, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      amax_v = _mm512_max_epu32(amax_v, _mm512_castps_si512(v));  // v >= 0
    }
  }
  *ma_b = _mm512_reduce_max_ps(_mm512_castsi512_ps(amax_m));
  *va_b = _mm512_reduce_max_ps(_mm512_castsi512_ps(amax_v));
}
