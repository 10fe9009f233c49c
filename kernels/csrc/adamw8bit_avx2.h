// The AVX2 block update of the CPU 8-bit AdamW kernel, bit-exact with the reference (see
// adamw8bit_cpu.cpp for the contract and adamw8bit_segments.py for the quantizer's model).
// Included by adamw8bit_cpu.cpp inside its anonymous namespace, after the definitions it uses
// (kBlock, Coeffs, Maps, quantize_one, hmax8); one translation unit only.
//
// Per block: the moments from their map values, updated (the reference's operations in its
// order: no FMA), into two L1 buffers with their absmax; then the param and both
// requantizations. Costs, measured on the dev box (AMD EPYC Zen 4 with the AVX-512 units
// unused, one thread, 64K elements in cache), where the update is bound by its vector ops:
// * dequantization has no cheap AVX2 form: a 256-entry fp32 table is 32 registers of 8 for
//   vpermps, 16-entry vpshufb lookups need 64 shuffles per 32 codes for 4 byte planes, and
//   vpgatherdd is slower than scalar loads (1.37 against 1.11 ns per element). Eight scalar
//   loads assembled into a register cost 14 shuffles per 8 elements of both moments, on the
//   two pipes the quantizer's permutes need. So the map values are looked up one block ahead
//   by scalar loads and stores (MapLookahead): load/store and integer units only, issued
//   inside the requantization loops of the block before (1.02 against 1.11 ns per element;
//   all lookups in one of the two loops, or in the moment loop: 1.07-1.20).
// * quantization: three binades per slot, 8 pieces, so each of the four table lookups is one
//   vpermps/vpermd over a register (SegQuant); the code is read from the bits of f, biased
//   into [256, 512); values in the guard band are rare (~1e-4) and redone exactly.
#pragma once

// out[k] = map[codes[k]] for 16 codes, by scalar loads and stores. The empty asm keeps the
// compiler from vectorizing the loop into vpgatherdd (slower here, see above). Each code is
// its own byte load (movzbl): 3 instructions a lookup, where extracting the bytes of one
// 8-byte load took 5 (shift, copy, zero-extend); 124 instead of 146 per 8 elements of the
// whole update (callgrind), 0.76-0.77 instead of 0.79-0.82 ns per element in cache and
// 0.81 instead of 0.83 from DRAM (Zen 5, AVX2 forced, one thread). What bounds the update:
// docs/benchmarks.md.
inline void lookup16(const uint32_t* __restrict map, const uint8_t* __restrict codes, uint32_t* __restrict out) {
  for (int k = 0; k < 16; ++k) {
    uint32_t x = map[codes[k]];
    __asm__("" : "+r"(x));
    out[k] = x;
  }
}

// The map values of one block's codes (both moments), as fp32 bits, filled 32 at a time.
struct MapLookahead {
  alignas(64) uint32_t m[kBlock];
  alignas(64) uint32_t v[kBlock];
  static const uint32_t* bits(const float* map) { return reinterpret_cast<const uint32_t*>(map); }
  const float* mval(int64_t k) const { return reinterpret_cast<const float*>(m + k); }
  const float* vval(int64_t k) const { return reinterpret_cast<const float*>(v + k); }
};

// The segment quantizer for 8 values (kernels/adamw8bit_segments.py: segment_code, op for op).
template <bool kSigned>
struct SegQuant {
  __m256i bnd, clamp;
  __m256 slope, off;
  explicit SegQuant(const float* seg)
      : bnd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seg))),
        clamp(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(seg + 3 * kSegCols))),
        slope(_mm256_loadu_ps(seg + kSegCols)), off(_mm256_loadu_ps(seg + 2 * kSegCols)) {}
  // The bits of the biased f of y[0..n) (bits 15..22: the positive code). Stage by stage over
  // the n vectors: each is a chain of ~25 cycles of latency (mulhi, three permutes, fma), and
  // written vector after vector the chains fill the scheduler before they can overlap.
  template <int n>
  inline void f_bits(const __m256 y[n], __m256i fb[n]) const {
    __m256i key[n], q[n];
    for (int k = 0; k < n; ++k) {
      key[k] = _mm256_castps_si256(y[k]);
      if (kSigned)  // |y|, plus one ulp where y < 0
        key[k] = _mm256_add_epi32(_mm256_and_si256(key[k], _mm256_set1_epi32(0x7FFFFFFF)), _mm256_srli_epi32(key[k], 31));
    }
    for (int k = 0; k < n; ++k)  // slot: vpermd reads q & 7
      q[k] = _mm256_mulhi_epu16(_mm256_srli_epi32(_mm256_max_epi32(key[k], _mm256_set1_epi32(kSegELo << 23)), 23),
                                _mm256_set1_epi32(kSegSlotMul));
    for (int k = 0; k < n; ++k)  // column: + (key > boundary)
      q[k] = _mm256_sub_epi32(q[k], _mm256_cmpgt_epi32(key[k], _mm256_permutevar8x32_epi32(bnd, q[k])));
    for (int k = 0; k < n; ++k)  // f reads the key (|y| measured 5% slower: a register more)
      key[k] = _mm256_min_epi32(key[k], _mm256_permutevar8x32_epi32(clamp, q[k]));
    for (int k = 0; k < n; ++k)
      fb[k] = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(key[k]), _mm256_permutevar8x32_ps(slope, q[k]),
                                                  _mm256_permutevar8x32_ps(off, q[k])));
  }
  // f's fraction, in units of 2^-15: below 2 * near exactly in the guard band (the offsets
  // carry near units of bias).
  static inline __m256i guard_dist(__m256i fb) { return _mm256_and_si256(fb, _mm256_set1_epi32(0x7FFF)); }
  // Codes of 32 values y[0..3] into out; folds their guard distances into *dmin.
  inline void codes32(const __m256 y[4], uint8_t* __restrict out, __m256i* dmin) const {
    __m256i c[4];
    f_bits<4>(y, c);
    for (int k = 0; k < 4; ++k) {
      *dmin = _mm256_min_epu32(*dmin, guard_dist(c[k]));
      c[k] = _mm256_srli_epi32(c[k], 15);  // 0x8700 + code: fits uint16
    }
    // per 128-bit lane: 4 codes of each vector as int16, then bytes; dword l of lane h holds
    // codes of vector l, elements 4h..4h+3: the final vpermd puts them in element order
    __m256i w01 = _mm256_packus_epi32(c[0], c[1]), w23 = _mm256_packus_epi32(c[2], c[3]);
    if (kSigned) {  // code - 127, negated where y < 0 (vpsignw), + 127: the mirror 254 - code
      const __m256i k = _mm256_set1_epi16(static_cast<int16_t>((kBiasBits >> 15) + 127));
      w01 = _mm256_sign_epi16(_mm256_sub_epi16(w01, k),
                              _mm256_packs_epi32(_mm256_castps_si256(y[0]), _mm256_castps_si256(y[1])));
      w23 = _mm256_sign_epi16(_mm256_sub_epi16(w23, k),
                              _mm256_packs_epi32(_mm256_castps_si256(y[2]), _mm256_castps_si256(y[3])));
      w01 = _mm256_add_epi16(w01, _mm256_set1_epi16(127));
      w23 = _mm256_add_epi16(w23, _mm256_set1_epi16(127));
    } else {
      const __m256i k = _mm256_set1_epi16(static_cast<int16_t>(kBiasBits >> 15));
      w01 = _mm256_sub_epi16(w01, k);
      w23 = _mm256_sub_epi16(w23, k);
    }
    const __m256i b = _mm256_packus_epi16(w01, w23);  // saturates the mirror of 255 to 0
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};

struct VecTables {
  const Maps* maps;
  SegQuant<true> quant_m;
  SegQuant<false> quant_v;
  explicit VecTables(const Maps& t) : maps(&t), quant_m(t.seg_m), quant_v(t.seg_v) {}
};

inline float block_inv(float absmax) { return absmax > 0.f ? 1.f / absmax : 1.f; }

inline bool guard_hit(__m256i dmin) {
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(2 * kSegNear), dmin))) != 0;
}

// The guarded lanes of a block (rare: ~1e-4 of values), redone with the exact scalar method.
template <bool kSigned>
void fix_guarded(const float* __restrict buf, float inv, uint8_t* __restrict codes,
                 const SegQuant<kSigned>& q, const uint8_t* bucket, const float* thr) {
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < kBlock; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(buf + i), inv8);
    __m256i fb;
    q.template f_bits<1>(&y, &fb);
    const __m256i d = SegQuant<kSigned>::guard_dist(fb);
    int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(2 * kSegNear), d)));
    for (; mask; mask &= mask - 1) {
      const int l = __builtin_ctz(mask);
      codes[i + l] = quantize_one(buf[i + l] * inv, bucket, thr);
    }
  }
}

// Requantization of one block's moments, 32 values at a time (the block's absmax known).
template <bool kSigned>
struct BlockQuant {
  const SegQuant<kSigned>& q;
  float inv;
  __m256 inv8;
  __m256i dmin = _mm256_set1_epi32(0x7FFF);
  BlockQuant(const SegQuant<kSigned>& quant, float absmax)
      : q(quant), inv(block_inv(absmax)), inv8(_mm256_set1_ps(inv)) {}
  inline void step32(const float* __restrict buf, uint8_t* __restrict codes) {
    __m256 y[4];
    for (int k = 0; k < 4; ++k) y[k] = _mm256_mul_ps(_mm256_loadu_ps(buf + 8 * k), inv8);
    q.codes32(y, codes, &dmin);
  }
  void finish(const float* buf, uint8_t* codes, const uint8_t* bucket, const float* thr) const {
    if (guard_hit(dmin)) fix_guarded(buf, inv, codes, q, bucket, thr);
  }
};

// Codes of the 256 values buf[i] / absmax (one block).
template <bool kSigned>
inline void requantize_vec(const float* __restrict buf, float absmax, uint8_t* __restrict codes,
                           const SegQuant<kSigned>& q, const uint8_t* bucket, const float* thr) {
  BlockQuant<kSigned> bq(q, absmax);
  for (int64_t i = 0; i < kBlock; i += 32) bq.step32(buf + i, codes + i);
  bq.finish(buf, codes, bucket, thr);
}

// The update of one block, as the reference computes it (one rounding per operation, in its
// order), in two passes: the moments (from their map values, updated, to the buffers, their
// absmax), then the param from the buffered moments. The second pass waits on the divider
// (sqrt and divide: ~0.28 ns of its ~0.35 per element here); it runs in the loop that
// requantizes the first moment, whose work goes to the other pipes (measured 1.10 vs 1.18 ns
// per element for one pass and separate requantization). Fusing loops further needs more
// registers than AVX2 has: the next block's moments in the loops of this block's
// requantizations took 1.20-1.26 ns against 1.02.
struct MomentUpdate {
  __m256 am, av, b1, omb1, b2, omb2;
  __m256 amax_m = _mm256_setzero_ps(), amax_v = _mm256_setzero_ps();
  MomentUpdate(const Coeffs& c, float absmax_m, float absmax_v)
      : am(_mm256_set1_ps(absmax_m)), av(_mm256_set1_ps(absmax_v)), b1(_mm256_set1_ps(c.beta1)),
        omb1(_mm256_set1_ps(c.one_minus_beta1)), b2(_mm256_set1_ps(c.beta2)),
        omb2(_mm256_set1_ps(c.one_minus_beta2)) {}
  // mq, vq: the map values of the codes
  inline void step8(const float* __restrict gb, const float* mq, const float* vq, float* __restrict mbuf,
                    float* __restrict vbuf) {
    const __m256 g = _mm256_loadu_ps(gb);
    __m256 m = _mm256_mul_ps(_mm256_load_ps(mq), am);
    __m256 v = _mm256_mul_ps(_mm256_load_ps(vq), av);
    m = _mm256_add_ps(_mm256_mul_ps(m, b1), _mm256_mul_ps(g, omb1));
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
    _mm256_store_ps(mbuf, m);
    _mm256_store_ps(vbuf, v);
    amax_m = _mm256_max_ps(amax_m, _mm256_and_ps(m, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))));
    amax_v = _mm256_max_ps(amax_v, v);  // v >= 0
  }
};

struct ParamUpdate {
  __m256 ibc2, eps, ss, decay;
  explicit ParamUpdate(const Coeffs& c)
      : ibc2(_mm256_set1_ps(c.inv_bc2_sqrt)), eps(_mm256_set1_ps(c.eps)), ss(_mm256_set1_ps(c.step_size)),
        decay(_mm256_set1_ps(c.decay)) {}
  inline void step8(float* __restrict pb, const float* mbuf, const float* vbuf) const {
    const __m256 m = _mm256_load_ps(mbuf), v = _mm256_load_ps(vbuf);
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), ibc2), eps);
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(pb), decay);
    _mm256_storeu_ps(pb, _mm256_sub_ps(p, _mm256_mul_ps(_mm256_div_ps(m, denom), ss)));
  }
};

// Full blocks [b0, b1) of one tensor (weights and gradients through io: Fp32Params or
// LeanParams; the moments' absmax must be known before requantizing). The map values of
// block b + 1 are looked up while block b is requantized (MapLookahead).
template <class IO>
inline void update_blocks_vec(IO& io, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                              const VecTables& T, int64_t b0, int64_t b1, const Coeffs& c) {
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  MapLookahead q;
  const Maps& t = *T.maps;
  const uint32_t* qmap_m = MapLookahead::bits(t.qm);  // locals: the loops reload no pointer
  const uint32_t* qmap_v = MapLookahead::bits(t.qv);
  const ParamUpdate pu(c);
  for (int64_t k = 0; k < kBlock; k += 16) {
    lookup16(qmap_m, mc + b0 * kBlock + k, q.m + k);
    lookup16(qmap_v, vc + b0 * kBlock + k, q.v + k);
  }
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * kBlock;
    MomentUpdate u(c, ma[b], va[b]);
    const float* gb = io.grad(s, kBlock);
    for (int64_t k = 0; k < kBlock; k += 8)
      u.step8(gb + k, q.mval(k), q.vval(k), mbuf + k, vbuf + k);
    ma[b] = hmax8(u.amax_m);
    va[b] = hmax8(u.amax_v);
    // the next block's codes; after the last block, this block's again (unused: a branch-free loop)
    const int64_t next = b + 1 < b1 ? s + kBlock : s;
    BlockQuant<true> qm(T.quant_m, ma[b]);
    float* pb = io.param(s, kBlock);
    for (int64_t i = 0; i < kBlock; i += 32) {
      for (int64_t k = i; k < i + 32; k += 8) pu.step8(pb + k, mbuf + k, vbuf + k);
      qm.step32(mbuf + i, mc + s + i);
      lookup16(qmap_m, mc + next + i, q.m + i);
      lookup16(qmap_m, mc + next + i + 16, q.m + i + 16);
    }
    qm.finish(mbuf, mc + s, t.bucket_m, t.thr_m);
    BlockQuant<false> qv(T.quant_v, va[b]);
    for (int64_t i = 0; i < kBlock; i += 32) {
      io.store_part(s, i, 32);  // bf16-lean's rounding here, the lightest loop: 3-4% (AVX2)
      qv.step32(vbuf + i, vc + s + i);
      lookup16(qmap_v, vc + next + i, q.v + i);
      lookup16(qmap_v, vc + next + i + 16, q.v + i + 16);
    }
    qv.finish(vbuf, vc + s, t.bucket_v, t.thr_v);
  }
}
