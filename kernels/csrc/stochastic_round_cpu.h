// Stochastic rounding fp32 -> bf16 for the CPU (outcore::stochastic_round_'s CPU kernel), bit
// for bit the reference in kernels/stochastic_round.py: r = the high 16 bits of a 32-bit hash
// of ((offset + i) mod 2^32) ^ key_lo (two xorshift-multiply rounds), ^ key_hi; the bf16
// pattern is (bits(x) + r) >> 16, NaN truncated. All in 32-bit lanes: the products are the
// reference's mod 2^32, and bits(x) + r overflows only for negative NaNs (then truncated).
// One pass, no temporaries: the reference's ~20 tensor passes over int64 scratch cost ~100x.
// Plain loops the compiler vectorizes at the build's ISA level (vpmulld; 8 or 16 lanes).
// The values are read as fp32 and their bits taken by memcpy: the bf16-lean update rounds
// buffers it has just written as floats, and a uint32_t* read of them would break strict
// aliasing. Included by adamw8bit_cpu.cpp inside its anonymous namespace.
#pragma once

constexpr uint32_t kSrMul0 = 0x2C1B3C6Du, kSrMul1 = 0x297A2D39u;  // stochastic_round.HASH_MULS

inline void stochastic_round_range(uint16_t* __restrict out, const float* __restrict x, int64_t begin,
                                   int64_t end, uint32_t key_lo, uint32_t key_hi, uint64_t offset) {
  out += begin;
  x += begin;
  // 32-bit lanes throughout: a 64-bit index, even one only cast down, is vectorized in 64-bit
  // lanes and narrowed by shuffles (measured 0.25 against ~0.1 ns per element with AVX2)
  constexpr int64_t kSpan = int64_t{1} << 30;
  for (int64_t a = 0; a < end - begin; a += kSpan) {
    const uint32_t base = static_cast<uint32_t>(offset + static_cast<uint64_t>(begin + a));  // index mod 2^32
    const int32_t n = static_cast<int32_t>(std::min(kSpan, end - begin - a));
    uint16_t* __restrict o = out + a;
    const float* __restrict xa = x + a;
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) {
      uint32_t h = (base + static_cast<uint32_t>(i)) ^ key_lo;
      h ^= h >> 15;
      h *= kSrMul0;
      h ^= h >> 12;
      h *= kSrMul1;
      h ^= h >> 15;
      const uint32_t r = (h ^ key_hi) >> 16;
      uint32_t b;
      std::memcpy(&b, xa + i, sizeof(b));
      const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
      o[i] = static_cast<uint16_t>((nan ? b : b + r) >> 16);
    }
  }
}
