// FRUGAL's step of one (rows, n) fp32 matrix for the CPU, bit for bit the reference in
// kernels/frugal.py: the weights decayed, AdamW on the k state-full columns (their moments
// (rows, k)), signSGD on every other column. One pass over the weights and gradient, a row
// at a time, instead of the reference's passes: gathers of the subspace's columns, a sign
// temporary, an add, ~7 tensor passes of Adam and a scatter, ~3x the bytes.
// Per row, the subspace's new weights are computed first (from the decayed weights, before
// the sign step overwrites them) in a buffer of k floats, the sign step runs over the
// row, then the buffer is written back: the row (<= 64 KiB for n <= 16K) stays in L1/L2.
// Included by adamw8bit_cpu.cpp inside its anonymous namespace (adamw_step: the AdamW step
// of one element; the build has no FMA contraction, so one rounding per operation).
#pragma once

// torch.sign's value: +-1, or +0 for zeros and NaN.
inline float sign_of(float x) { return static_cast<float>((x > 0.f) - (x < 0.f)); }

// Rows [r0, r1). cols: the k sorted state-full columns; buf: 2k floats of scratch;
// free_alpha: the signSGD step, -(lr * free_lr_scale), fp32.
inline void frugal_rows(float* __restrict p, const float* __restrict g, const int64_t* __restrict cols,
                        float* __restrict m, float* __restrict v, int64_t n, int64_t k, int64_t r0, int64_t r1,
                        const Coeffs& c, float free_alpha, float* __restrict buf) {
  float* __restrict xs = buf;  // the subspace's weights, then their new values
  float* __restrict gs = buf + k;
  for (int64_t r = r0; r < r1; ++r) {
    float* pr = p + r * n;
    const float* gr = g + r * n;
    float* mr = m + r * k;
    float* vr = v + r * k;
    for (int64_t j = 0; j < k; ++j) {  // gathered first: the Adam loop is then a vector loop
      xs[j] = pr[cols[j]];
      gs[j] = gr[cols[j]];
    }
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) xs[j] = adamw_step(xs[j], gs[j], mr[j], vr[j], c);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) pr[j] = pr[j] * c.decay + free_alpha * sign_of(gr[j]);
    for (int64_t j = 0; j < k; ++j) pr[cols[j]] = xs[j];
  }
}
