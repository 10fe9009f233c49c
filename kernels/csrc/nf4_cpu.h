// NF4 (QLoRA's 4-bit NormalFloat) block-wise quantization for the CPU, bit for bit the
// reference in kernels/nf4.py (bitsandbytes' own CPU quantizer): per block of 64 weights,
// absmax = max |x|; y = clamp(x * (1 / max(absmax, 1e-38)), -1, 1) in fp32; the code is the
// number of the 15 midpoints between NF4 levels strictly below y; two codes a byte, the first
// in the high nibble. One pass, no temporaries: the reference's bucketize over fp32 copies
// quantizes 6-14 M weights/s on two cores, 1.4 to 3.5 hours for a 70B base.
// Included by adamw8bit_cpu.cpp inside its anonymous namespace.
#pragma once

constexpr int64_t kNf4Block = 64;  // kernels/nf4.py NF4_BLOCK

template <typename T>
inline void nf4_quantize_blocks(const T* __restrict x, const float* __restrict bounds, uint8_t* __restrict packed,
                                float* __restrict absmax, int64_t begin, int64_t end) {
  float y[kNf4Block];
  for (int64_t b = begin; b < end; ++b) {
    const T* xb = x + b * kNf4Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kNf4Block; ++i) {
      y[i] = static_cast<float>(xb[i]);
      amax = std::max(amax, std::fabs(y[i]));
    }
    absmax[b] = amax;
    const float inv = 1.f / std::max(amax, 1e-38f);  // torch: 1.0 / absmax.clamp(min=1e-38), in fp32
    uint8_t q[kNf4Block];
#pragma omp simd
    for (int64_t i = 0; i < kNf4Block; ++i) {
      const float v = std::min(std::max(y[i] * inv, -1.f), 1.f);
      int c = 0;
      for (int j = 0; j < 15; ++j) c += bounds[j] < v ? 1 : 0;  // torch.bucketize(v, bounds)
      q[i] = static_cast<uint8_t>(c);
    }
    uint8_t* pb = packed + b * (kNf4Block / 2);
    for (int64_t i = 0; i < kNf4Block / 2; ++i) pb[i] = static_cast<uint8_t>((q[2 * i] << 4) | q[2 * i + 1]);
  }
}
