// Fused block-wise 8-bit AdamW update for the CPU (outcore::adamw8bit_update).
//
// One pass per 256-element block: read codes -> fp32 moments -> update param -> new absmax,
// the block's fresh moments kept in two stack buffers (2 KiB, in L1); then requantize both.
// Work is handed out to the threads in chunks of blocks from an atomic counter (dynamic
// scheduling: on a shared machine a descheduled thread does not hold the others up).
// Every block's result depends on that block's inputs only, so the output is the same bit
// for bit whatever the thread count, the chunking, or whether tensors come one per call or
// batched, or a tensor in 4096-aligned pieces (the out-of-core engine relies on it).
//
// Numerical contract: every path, at every ISA level, is bit-identical to the pure-PyTorch
// reference in kernels/adamw8bit.py for finite inputs (tests/kernels/test_adamw8bit_kernel.py
// runs each level the CPU supports): one IEEE-rounded fp32 operation per reference operation,
// in its order (no FMA in the update; the build passes -ffp-contract=off, no -ffast-math),
// and the reference's codes.
//
// Paths (chosen at build time by the ISA flags kernels/adamw8bit.py passes), full blocks:
// * AVX-512 (F/BW/VL/DQ, adamw8bit_avx512.h): 16 lanes; dequantization by in-register byte
//   permutes (VBMI) or fp32 permutes, no gathers (they run at ~3 ns per 16 lanes here).
// * AVX2 + FMA (adamw8bit_avx2.h): 8 lanes; dequantization by scalar loads.
// Both quantize with the segment quantizer (kernels/adamw8bit_segments.py): the code is the
// integer part of a piecewise-linear f(|y|) whose pieces are the map's decades (the dynamic
// map is linear within a decade), four one-register table lookups; tables built and
// *verified exhaustively* in Python. Values within a guard band of a code boundary (~1e-4 of
// them) are redone with the exact scalar method, so the codes are the reference's.
// * scalar (any CPU, and partial blocks everywhere): dequantize through the map, quantize with
//   the 16-bit bucket table + one threshold comparison of kernels/quantize.py (equal to the
//   reference's searchsorted by construction).
// The FP8 state format (adamw8bit_fp8.h; kernels/quantize_fp8.py) has its own block update: F16C
// conversions and integer rounding on the FP8 grid, 8 lanes with AVX2, 16 with AVX-512; bit
// manipulation in the scalar path.
#ifndef OUTCORE_KERNEL_ONLY  // defined by stand-alone micro-benchmarks of the kernel (no torch)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define OUTCORE_AVX512 1
#define OUTCORE_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OUTCORE_AVX2 1
#define OUTCORE_VEC 1
#endif

namespace {

constexpr int64_t kBlock = 256;
// Blocks per work item handed to a thread (see run_jobs): 16K to 256K elements.
constexpr int64_t kMinChunkBlocks = 64;
constexpr int64_t kMaxChunkBlocks = 1024;
// Bucket index of a normalized value (kernels/quantize.py: bucket_index): sign and the top
// 16 bits of |y| clamped to [kBucketMin, kBucketMax]. The tables hold one uint8 per bucket
// (+4 bytes of padding).
constexpr int32_t kBucketMin = 100 << 7;
constexpr int32_t kBucketMax = (128 << 7) - 1;
constexpr int32_t kBucketsPerSign = kBucketMax - kBucketMin + 1;
constexpr int64_t kTableBytes = 2 * kBucketsPerSign + 4;
// Segment tables (kernels/adamw8bit_segments.py, whose constants these are): rows boundary
// (per slot), slope, biased offset, clamp (per piece); 8 columns.
constexpr int64_t kSegRows = 4;
constexpr int64_t kSegCols = 8;
constexpr int32_t kSegELo = 107;         // SEG_E_LO
constexpr int32_t kSegSlotMul = 22100;   // SEG_SLOT_MUL
constexpr int32_t kSegNear = 2;          // SEG_NEAR
constexpr int32_t kBiasBits = 0x43800000;  // 256.0f: f's bits are this + code * 2^15 + fraction

// The step's scalars, rounded to fp32 as PyTorch rounds Python scalars for fp32 tensors (the
// reference's, kernels/adamw8bit.py: Coefficients).
struct Coeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay;
};

inline Coeffs make_coeffs(const double* k) {
  return Coeffs{static_cast<float>(k[0]), static_cast<float>(k[1]), static_cast<float>(k[2]),
                static_cast<float>(k[3]), static_cast<float>(k[4]), static_cast<float>(k[5]),
                static_cast<float>(k[6]), static_cast<float>(k[7])};
}

inline float lane_sqrt(float x) { return std::sqrt(x); }
#ifdef OUTCORE_VEC
inline __m256 lane_sqrt(__m256 x) { return _mm256_sqrt_ps(x); }
#endif
#ifdef OUTCORE_AVX512
inline __m512 lane_sqrt(__m512 x) { return _mm512_sqrt_ps(x); }
#endif

// AdamW's step, the reference's operations in its order (kernels/adamw8bit.py:
// adamw_step_ref): m and v updated, the new weight returned. T is float or a vector of floats
// (GCC/Clang vector types: +, -, *, / lane by lane, a scalar operand broadcast; each operation
// rounds once, -ffp-contract=off keeps it from fusing). The scalar paths (a partial block, the
// DEFAULT level, FRUGAL's state-full columns) call it in loops the compiler vectorizes.
template <class T>
inline T adamw_step(T p, T g, T& m, T& v, const Coeffs& c) {
  m = m * c.beta1 + g * c.one_minus_beta1;
  v = v * c.beta2 + (g * g) * c.one_minus_beta2;
  const T denom = lane_sqrt(v) * c.inv_bc2_sqrt + c.eps;
  return p * c.decay - (m / denom) * c.step_size;
}

struct Maps {  // everything a block update reads besides its own data
  const float* qm;  // (256,) signed map
  const float* qv;  // (256,) unsigned map
  const uint8_t* bucket_m;
  const float* thr_m;
  const uint8_t* bucket_v;
  const float* thr_v;
  const float* seg_m;  // (kSegRows, kSegCols)
  const float* seg_v;
};

inline uint8_t quantize_one(float y, const uint8_t* bucket, const float* thr) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const int32_t mag = std::min(std::max(static_cast<int32_t>((bits & 0x7FFFFFFFu) >> 16), kBucketMin),
                               kBucketMax) - kBucketMin;
  const int32_t c = bucket[mag + static_cast<int32_t>(bits >> 31) * kBucketsPerSign];
  return static_cast<uint8_t>(c + (y > thr[c] ? 1 : 0));
}

#include "stochastic_round_cpu.h"  // bf16-lean's rounding, in the same extension
#include "nf4_cpu.h"  // QLoRA's NF4 quantizer, in the same extension
#include "frugal_cpu.h"  // FRUGAL's step, in the same extension

// Where a block's fp32 weights and gradient come from and its new weights go (the update
// paths take one of these as `io`, per block: param(s, len) and grad(s, len) before the block's
// update, store(s, len) after its weights are written, or store_part(s, i, len) for each part
// [i, i + len) of the block once that part is written).
// * Fp32Params: the tensors themselves.
// * LeanParams, bf16-lean (optim/lean.py): bf16 weights and gradients, widened (exactly) into
//   two 1 KiB buffers, the weights rounded back stochastically with the whole tensor's element
//   indices (stochastic_round_cpu.h): the fp32 values the reference's chunked path updates, so
//   its bits. Per block, so the bf16 streams advance with the codes' (measured from DRAM, one
//   thread, Zen 5: AVX-512 0.54 ns per element, AVX2 0.96, against 0.78 and 1.29 with the
//   widening and the rounding 8K elements apart from the update).
struct Fp32Params {
  float* p;
  const float* g;
  float* param(int64_t s, int64_t) { return p + s; }
  const float* grad(int64_t s, int64_t) { return g + s; }
  void store(int64_t, int64_t) {}
  void store_part(int64_t, int64_t, int64_t) {}
};

struct LeanTensor {  // p, g: bf16 bit patterns; key and offset: stochastic_round_'s
  uint16_t* p = nullptr;
  const uint16_t* g = nullptr;
  uint32_t key_lo = 0, key_hi = 0;
  uint64_t offset = 0;
};

inline void widen_bf16(const uint16_t* __restrict in, float* __restrict out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    out[i] = f;
  }
}

struct LeanParams {
  LeanTensor t;
  alignas(64) float pbuf[kBlock];
  alignas(64) float gbuf[kBlock];
  explicit LeanParams(const LeanTensor& lt) : t(lt) {}
  float* param(int64_t s, int64_t len) {
    widen_bf16(t.p + s, pbuf, len);
    return pbuf;
  }
  const float* grad(int64_t s, int64_t len) {
    widen_bf16(t.g + s, gbuf, len);
    return gbuf;
  }
  void store(int64_t s, int64_t len) { store_part(s, 0, len); }
  void store_part(int64_t s, int64_t i, int64_t len) {
    stochastic_round_range(t.p + s, pbuf, i, i + len, t.key_lo, t.key_hi, t.offset + static_cast<uint64_t>(s));
  }
};

#ifdef OUTCORE_VEC
// The largest of 8 lanes (a block's absmax from its running maximum; AVX2 and FP8 updates).
inline float hmax8(__m256 x) {
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
}
#endif
#if defined(OUTCORE_AVX512)
#include "adamw8bit_avx512.h"  // the vector block update (uses the definitions above)
#elif defined(OUTCORE_AVX2)
#include "adamw8bit_avx2.h"
#endif
#include "adamw8bit_fp8.h"  // the FP8 state format (uses the definitions above)

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
    float mi = t.qm[mcb[i]] * am;
    float vi = t.qv[vcb[i]] * av;
    pb[i] = adamw_step(pb[i], gb[i], mi, vi, c);
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

#ifdef OUTCORE_VEC
using Tables = VecTables;
#else
struct Tables {
  explicit Tables(const Maps&) {}
};
#endif

// The state formats (kernels/adamw8bit.py: STATE_FORMATS): the dynamic maps, or FP8 codes.
enum class Format : int64_t { kDynamic = 0, kFp8 = 1 };

template <class IO>
void update_range(IO& io, uint8_t* mc, float* ma, uint8_t* vc, float* va, const Maps& maps,
                  const Tables& tables, int64_t n, int64_t block_begin, int64_t block_end, const Coeffs& c,
                  Format fmt = Format::kDynamic) {
  int64_t b = block_begin;
#ifdef OUTCORE_VEC
  const int64_t full_end = std::min(block_end, n / kBlock);  // the last block may be partial
  if (b < full_end) {
    if (fmt == Format::kFp8) update_blocks_fp8_vec(io, mc, ma, vc, va, b, full_end, c);
    else update_blocks_vec(io, mc, ma, vc, va, tables, b, full_end, c);
  }
  b = std::max(b, full_end);
#endif
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  for (; b < block_end; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
    float* pb = io.param(start, len);
    const float* gb = io.grad(start, len);
    if (fmt == Format::kFp8)
      update_block_fp8_scalar(pb, gb, mc + start, ma + b, vc + start, va + b, len, mbuf, vbuf, c);
    else
      update_block_scalar(pb, gb, mc + start, ma + b, vc + start, va + b, len, maps, mbuf, vbuf, c);
    io.store(start, len);
  }
}

}  // namespace

#ifndef OUTCORE_KERNEL_ONLY
namespace {

void check(const torch::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

// A stochastic rounding's key and the index of its first element (stochastic_round_'s).
void check_rounding(int64_t key, int64_t offset) {
  TORCH_CHECK(key >= 0 && offset >= 0, "key=", key, " and offset=", offset, " must be >= 0");
}

}  // namespace

namespace {

struct Job {  // one tensor's update
  float* p;  // fp32 weights and gradients, or (p null) bf16 ones in lean
  const float* g;
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
  int64_t n, nblocks;
  Coeffs c;
  LeanTensor lean;
  Format fmt;
};

Maps make_maps(const std::vector<torch::Tensor>& t) {
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
  return Maps{t[0].data_ptr<float>(), t[1].data_ptr<float>(), t[2].data_ptr<uint8_t>(),
              t[3].data_ptr<float>(), t[4].data_ptr<uint8_t>(), t[5].data_ptr<float>(),
              t[6].data_ptr<float>(), t[7].data_ptr<float>()};
}

// All jobs' blocks, in chunks, handed out dynamically: each worker pulls the next chunk (of
// any tensor) until none is left, so a thread the OS parks on a shared machine delays only
// the chunk it holds, and a whole optimizer step is one parallel region (one fork/join, not
// one per tensor). The counter is all the workers share; chunks are disjoint.
// Chunk size: each worker should get >= 8 chunks (balance), but chunks as large as that
// allows, up to 256K elements: a worker's consecutive chunks are not adjacent in memory, and
// every jump restarts the hardware prefetcher's streams (measured, one thread taking every
// other 16K-element chunk of a 50M tensor: 0.50 ns per element instead of 0.40; with 256K
// chunks 0.41).
void run_jobs(const std::vector<Job>& jobs, const Maps& maps) {
  int64_t total_blocks = 0;
  for (const Job& t : jobs) total_blocks += t.nblocks;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::clamp<int64_t>(total_blocks / (8 * threads), kMinChunkBlocks, kMaxChunkBlocks);
  std::vector<int64_t> first_chunk(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j)
    first_chunk[j + 1] = first_chunk[j] + (jobs[j].nblocks + chunk - 1) / chunk;
  const int64_t nchunks = first_chunk.back();
  auto run_chunk = [&](int64_t k, const Tables& tables) {
    const size_t j = std::upper_bound(first_chunk.begin(), first_chunk.end(), k) - first_chunk.begin() - 1;
    const Job& t = jobs[j];
    const int64_t b0 = (k - first_chunk[j]) * chunk;
    const int64_t b1 = std::min(t.nblocks, b0 + chunk);
    if (t.p) {
      Fp32Params io{t.p, t.g};
      update_range(io, t.mc, t.ma, t.vc, t.va, maps, tables, t.n, b0, b1, t.c, t.fmt);
    } else {
      LeanParams io(t.lean);
      update_range(io, t.mc, t.ma, t.vc, t.va, maps, tables, t.n, b0, b1, t.c, t.fmt);
    }
  };
  const int64_t workers = std::min<int64_t>(threads, nchunks);
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

// lean: null for fp32 weights and gradients, else the key and offset of bf16 ones' rounding.
Job make_job(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& m_codes,
             const torch::Tensor& m_absmax, const torch::Tensor& v_codes,
             const torch::Tensor& v_absmax, const double* k, Format fmt, const int64_t* lean = nullptr) {
  const int64_t n = param.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  const at::ScalarType dtype = lean ? at::kBFloat16 : at::kFloat;
  check(param, dtype, n, "param");
  check(grad, dtype, n, "grad");
  check(m_codes, at::kByte, n, "m_codes");
  check(v_codes, at::kByte, n, "v_codes");
  check(m_absmax, at::kFloat, nblocks, "m_absmax");
  check(v_absmax, at::kFloat, nblocks, "v_absmax");
  Job job{nullptr, nullptr, m_codes.data_ptr<uint8_t>(), m_absmax.data_ptr<float>(),
          v_codes.data_ptr<uint8_t>(), v_absmax.data_ptr<float>(), n, nblocks, make_coeffs(k), {}, fmt};
  if (!lean) {
    job.p = param.data_ptr<float>();
    job.g = grad.data_ptr<float>();
    return job;
  }
  check_rounding(lean[0], lean[1]);
  const auto key = static_cast<uint64_t>(lean[0]);
  job.lean = LeanTensor{reinterpret_cast<uint16_t*>(param.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()),
                        static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32),
                        static_cast<uint64_t>(lean[1])};
  return job;
}

Format to_format(int64_t fmt) {
  TORCH_CHECK(fmt == 0 || fmt == 1, "fmt=", fmt, " is not a state format (0: dynamic, 1: fp8)");
  return static_cast<Format>(fmt);
}

}  // namespace

// One tensor. coeffs: beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2^t), eps,
// lr / (1 - beta1^t), 1 - lr * wd (kernels/adamw8bit.py: Coefficients); fmt: the state format
// (kernels/adamw8bit.py: STATE_FORMATS' index).
void adamw8bit_update(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes,
                      torch::Tensor m_absmax, torch::Tensor v_codes, torch::Tensor v_absmax,
                      std::vector<torch::Tensor> tables,
                      std::vector<double> coeffs, int64_t fmt) {
  TORCH_CHECK(coeffs.size() == 8, "expected 8 coefficients, got ", coeffs.size());
  const Maps maps = make_maps(tables);
  run_jobs({make_job(param, grad, m_codes, m_absmax, v_codes, v_absmax, coeffs.data(), to_format(fmt))}, maps);
}

// Many tensors in one parallel region; coeffs holds 8 per tensor, in order. lean: empty for
// fp32 weights and gradients; for bf16-lean ones, (key, offset) per tensor, in order
// (stochastic_round_'s: the rounding key and the index of the tensor's first element).
void adamw8bit_update_many(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                           std::vector<torch::Tensor> m_codes, std::vector<torch::Tensor> m_absmax,
                           std::vector<torch::Tensor> v_codes, std::vector<torch::Tensor> v_absmax,
                           std::vector<torch::Tensor> tables, std::vector<double> coeffs,
                           std::vector<int64_t> lean, int64_t fmt) {
  const size_t k = params.size();
  TORCH_CHECK(grads.size() == k && m_codes.size() == k && m_absmax.size() == k &&
                  v_codes.size() == k && v_absmax.size() == k && coeffs.size() == 8 * k &&
                  (lean.empty() || lean.size() == 2 * k),
              "adamw8bit_update_many: lists of different lengths");
  const Maps maps = make_maps(tables);
  std::vector<Job> jobs;
  jobs.reserve(k);
  for (size_t i = 0; i < k; ++i)
    jobs.push_back(make_job(params[i], grads[i], m_codes[i], m_absmax[i], v_codes[i], v_absmax[i],
                            coeffs.data() + 8 * i, to_format(fmt), lean.empty() ? nullptr : lean.data() + 2 * i));
  run_jobs(jobs, maps);
}

// The absmax of x[start, start + len); unsigned codes (the second moment's, never negative)
// refuse negative values.
float checked_absmax(const float* xp, int64_t start, int64_t len, bool is_signed) {
  float amax = 0.f;
  for (int64_t i = start; i < start + len; ++i) {
    TORCH_CHECK(is_signed || !(xp[i] < 0.f), "x[", i, "]=", xp[i],
                " is negative; the unsigned codes quantize values >= 0 only");
    amax = std::max(amax, std::fabs(xp[i]));
  }
  return amax;
}

// Block-wise quantization of `x` with the update's requantization code (tests compare it
// with the reference on adversarial values: thresholds, their neighbours, tiny and huge).
std::tuple<torch::Tensor, torch::Tensor> quantize_blockwise(torch::Tensor x, bool is_signed,
                                                            torch::Tensor bucket, torch::Tensor thr,
                                                            torch::Tensor seg) {
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
#ifdef OUTCORE_VEC
  const SegQuant<true> qs(seg.data_ptr<float>());
  const SegQuant<false> qu(seg.data_ptr<float>());
#endif
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
    const float amax = checked_absmax(xp, start, len, is_signed);
    ap[b] = amax;
#ifdef OUTCORE_VEC
    if (len == kBlock) {
      if (is_signed) requantize_vec(xp + start, amax, cp + start, qs, bp, tp);
      else requantize_vec(xp + start, amax, cp + start, qu, bp, tp);
      continue;
    }
#endif
    const float inv = amax > 0.f ? 1.f / amax : 1.f;
    for (int64_t i = 0; i < len; ++i) cp[start + i] = quantize_one(xp[start + i] * inv, bp, tp);
  }
  return {codes, absmax};
}

// Block-wise FP8 quantization of x (E4M3 if is_signed, else E5M2) with the update's encoding
// (tests compare it with the reference on the grid, its midpoints and their neighbours).
std::tuple<torch::Tensor, torch::Tensor> fp8_quantize_blockwise(torch::Tensor x, bool is_signed) {
  const int64_t n = x.numel();
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  check(x, at::kFloat, n, "x");
  auto codes = torch::empty({n}, x.options().dtype(at::kByte));
  auto absmax = torch::empty({nblocks}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t start = b * kBlock;
    const int64_t len = std::min(kBlock, n - start);
    const float amax = checked_absmax(xp, start, len, is_signed);
    absmax.data_ptr<float>()[b] = amax;
    const float inv = is_signed ? fp8_inv<E4M3>(amax) : fp8_inv<E5M2>(amax);
#ifdef OUTCORE_VEC
    if (len == kBlock) {
      if (is_signed) fp8_encode_block<E4M3, true>(xp + start, inv, cp + start);
      else fp8_encode_block<E5M2, false>(xp + start, inv, cp + start);
      continue;
    }
#endif
    for (int64_t i = start; i < start + len; ++i)
      cp[i] = is_signed ? fp8_encode<E4M3>(xp[i] * inv) : fp8_encode<E5M2>(xp[i] * inv);
  }
  return {codes, absmax};
}

// Stochastic rounding of x (fp32) into out (bf16), in place (see stochastic_round_cpu.h).
void stochastic_round(torch::Tensor out, torch::Tensor x, int64_t key, int64_t offset) {
  const int64_t n = x.numel();
  check(x, at::kFloat, n, "x");
  check(out, at::kBFloat16, n, "out");
  check_rounding(key, offset);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* xb = x.data_ptr<float>();
  const uint64_t k = static_cast<uint64_t>(key);
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
    stochastic_round_range(o, xb, a, b, static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32),
                           static_cast<uint64_t>(offset));
  });
}

// NF4 quantization of x (fp32 or bf16, a multiple of 64 elements) into packed codes [n / 2]
// and absmax [n / 64] (see nf4_cpu.h); bounds: the 15 fp32 midpoints between NF4 levels.
void nf4_quantize(torch::Tensor x, torch::Tensor bounds, torch::Tensor packed, torch::Tensor absmax) {
  const int64_t n = x.numel();
  TORCH_CHECK(n % kNf4Block == 0, "nf4_quantize: ", n, " elements is not a multiple of ", kNf4Block);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  check(bounds, at::kFloat, 15, "bounds");
  check(packed, at::kByte, n / 2, "packed");
  check(absmax, at::kFloat, n / kNf4Block, "absmax");
  const float* bp = bounds.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* ap = absmax.data_ptr<float>();
  at::parallel_for(0, n / kNf4Block, 1 << 10, [&](int64_t a, int64_t b) {
    if (x.scalar_type() == at::kBFloat16) {
      nf4_quantize_blocks(x.data_ptr<at::BFloat16>(), bp, pp, ap, a, b);
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 or bfloat16, not ", x.scalar_type());
      nf4_quantize_blocks(x.data_ptr<float>(), bp, pp, ap, a, b);
    }
  });
}

// FRUGAL's step of one (rows, n) fp32 matrix, in place (see frugal_cpu.h): cols, the sorted
// state-full columns (int64, k); exp_avg, exp_avg_sq (rows, k); coeffs: the 8 of
// adamw8bit_update; free_alpha: the signSGD step, -(lr * free_lr_scale).
void frugal_update(torch::Tensor param, torch::Tensor grad, torch::Tensor cols, torch::Tensor exp_avg,
                   torch::Tensor exp_avg_sq, std::vector<double> coeffs, double free_alpha) {
  TORCH_CHECK(coeffs.size() == 8, "expected 8 coefficients, got ", coeffs.size());
  TORCH_CHECK(param.dim() == 2, "param must be a matrix, got ", param.dim(), " dimensions");
  const int64_t rows = param.size(0), n = param.size(1), k = cols.numel();
  check(param, at::kFloat, rows * n, "param");
  check(grad, at::kFloat, rows * n, "grad");
  check(cols, at::kLong, k, "cols");
  check(exp_avg, at::kFloat, rows * k, "exp_avg");
  check(exp_avg_sq, at::kFloat, rows * k, "exp_avg_sq");
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j)  // sorted and in range: every column is written once
    TORCH_CHECK(cp[j] >= 0 && cp[j] < n && (j == 0 || cp[j] > cp[j - 1]),
                "cols must be sorted distinct columns in [0, ", n, "); cols[", j, "]=", cp[j]);
  const Coeffs c = make_coeffs(coeffs.data());
  const float alpha = static_cast<float>(free_alpha);
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  // grain: ~64K weights a task, so small matrices run on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
                     std::vector<float> buf(static_cast<size_t>(2 * k));
                     frugal_rows(p, g, cp, m, v, n, k, r0, r1, c, alpha, buf.data());
                   });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is let go while a kernel runs: an update on a worker thread (the host update beside
  // an accelerator's backward) must not stall the Python hooks of the thread computing.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("adamw8bit_update", &adamw8bit_update, "fused block-wise 8-bit AdamW update (in place)", nogil());
  m.def("adamw8bit_update_many", &adamw8bit_update_many,
        "fused block-wise 8-bit AdamW update of many tensors (in place, one parallel region; "
        "bf16-lean weights too)", nogil());
  m.def("quantize_blockwise", &quantize_blockwise, "block-wise 8-bit quantization (the update's path)", nogil());
  m.def("fp8_quantize_blockwise", &fp8_quantize_blockwise, "block-wise FP8 quantization (the update's path)",
        nogil());
  m.def("stochastic_round", &stochastic_round, "fp32 -> bf16 stochastic rounding (in place)", nogil());
  m.def("frugal_update", &frugal_update, "FRUGAL's step of one fp32 matrix (in place, one pass)", nogil());
  m.def("nf4_quantize", &nf4_quantize, "block-wise NF4 quantization (QLoRA's, bitsandbytes' bits)", nogil());
}
#endif  // OUTCORE_KERNEL_ONLY
