// The simulated accelerator "sim": PyTorch's PrivateUse1 backend (renamed by
// offload/simdevice.py), for CI machines without a GPU.
//
// Sim tensors are real TensorImpls (DispatchKey::PrivateUse1) whose memory is host memory.
// Every aten op runs the CPU kernel on CPU tensors aliasing that memory, so results are
// bit-identical to the CPU. What this file adds is what a GPU does differently, i.e. what
// code written for a GPU gets wrong without noticing on a CPU:
//   * memory is not zeroed: new and freed device memory read 0xFF (NaN in fp32/bf16/fp16);
//   * streams and events with CUDA's ordering rules; a non_blocking copy between the device
//     and pinned host memory lands late (when ordering forces it), so whoever reads its
//     destination without waiting reads poison;
//   * a race detector: a vector clock per stream and an access history per 4 KiB of device
//     memory; two streams touching the same bytes with no event ordering them raise (on a
//     GPU that is silent corruption whenever the host runs ahead, which it always does);
//   * the caching allocator's lifetime rules (record_stream), and use-after-free by a copy
//     still queued when its memory was freed;
//   * CUDA's "Expected all tensors to be on the same device" error.
// Kernels run eagerly when issued; only copies are ever queued. All state sits behind one
// mutex: autograd runs backward on its own device thread, I/O threads copy on side streams.
//
// Torch internals used, all through installed headers and exported symbols, present from
// 2.6 through 2.13 (c10::DeviceAllocator from 2.9, used where present): the boxed fallback
// and redispatchBoxed, Dispatcher::getAllOpNames, at::detail::empty_generic,
// at::native::{view, _reshape_alias, as_strided_tensorimpl, resize_, set_, set_tensor_,
// set_storage_cpu_} (backend-neutral: they reallocate through the storage's own allocator),
// StorageImpl::set_data_ptr, DeviceGuardImplInterface, PrivateUse1HooksInterface, and the
// DispatchStub behind scaled_dot_product_attention (REGISTER_PRIVATEUSE1_DISPATCH; private to
// ATen's native/ headers, the one unstable part).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#if __has_include(<c10/core/CachingDeviceAllocator.h>)
#include <c10/core/CachingDeviceAllocator.h>  // c10::DeviceAllocator (torch 2.9+)
#define SIM_DEVICE_ALLOCATOR 1
#endif
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;      // allocation granule, and the race detector's
constexpr int kStreams = 8;         // stream 0: the default; 1..7: the pool, handed out round-robin
constexpr int kNames = 1024;        // op names remembered per stream, for race messages
constexpr int kPoison = 0xFF;
constexpr size_t kCacheCap = size_t(1) << 30;  // freed pool blocks kept for reuse, at most
const c10::Device kSim(c10::DeviceType::PrivateUse1, 0);
const c10::Device kCpu(c10::DeviceType::CPU);
// Storages whose last reference a locked section drops (an executed copy's host side) go
// here and are released after the unlock: dropping one may decref its Python object, which
// takes the GIL, and a thread holding the GIL may be waiting for this mutex (an event
// recorded from Python) - the lock order is GIL, then the mutex, never the reverse.
std::vector<c10::Storage>& graveyard();
std::mutex& state_mutex();  // st().mu, the graveyard's guard

struct Lock {
  explicit Lock(std::mutex& m) : u(m) {}
  ~Lock() {
    std::vector<c10::Storage> dead;
    if (u.mutex() == &state_mutex()) dead.swap(graveyard());  // (another mutex does not guard it)
    u.unlock();
  }  // `dead` is destroyed here, unlocked
  std::unique_lock<std::mutex> u;
};
using at::Tensor;
using c10::SymIntArrayRef;
using std::optional;

c10::IntArrayRef ints(SymIntArrayRef s) { return C10_AS_INTARRAYREF_SLOW(s); }

size_t round_up(size_t n) { return (n + kPage - 1) / kPage * kPage; }

// ---- State ------------------------------------------------------------------------------
// Access history of 4 KiB of an allocation: the last write, and each stream's last read since.
struct Page {
  uint64_t w = 0;  // op number (on stream ws) of the last write; 0: none
  int8_t ws = -1;
  uint64_t r[kStreams] = {};
};

// One device allocation. Pool blocks are page-aligned host memory that goes back to the pool
// of its allocation stream at free (CUDA's caching allocator reuses a block only on that
// stream); their history survives reuse, so a stream that still had the old tensor in flight
// is caught touching the new one. Adopted blocks are CPU kernels' outputs, taken over instead
// of copied (the kernel wrote every byte); at free they go back to the CPU allocator.
struct Block {
  char* base = nullptr;
  size_t size = 0;
  int stream = 0;
  bool adopted = false;
  c10::DataPtr owner;  // adopted: the CPU allocator's pointer (cleared at release)
  uint64_t gen = 0;     // bumped at each release; a queued copy checks it
  uint8_t used_on = 0;  // streams named by record_stream()
  uint64_t keep_until[kStreams] = {};
  int refs = 0;         // queued copies pointing here
  Page fill;            // the history of pages not materialized yet
  std::vector<Page> pages;
};

// A deferred host<->device copy: non_blocking, pinned host side, a plain memcpy.
struct Copy {
  uint64_t seq;
  bool h2d;
  Block* dev;  // nullptr once detached at free (see release)
  uint64_t gen;
  size_t off, nbytes;
  char* host;
  c10::Storage host_keep;   // the host side stays valid, as CUDA's pinned allocator ensures
  std::vector<char> saved;  // device-to-host whose source was freed on the copy's own stream
  bool dropped = false;     // host-to-device into a block freed on the copy's own stream
};

struct Stream {
  uint64_t count = 0;             // ops issued so far
  uint64_t clock[kStreams] = {};  // per stream, the highest op this one has waited for
  std::deque<Copy> pending;
  const char* names[kNames] = {};
};

struct Event {
  bool recorded = false;
  int stream = 0;
  uint64_t seq = 0;
  uint64_t clock[kStreams] = {};
  std::chrono::steady_clock::time_point when;
};

struct OpInfo {
  std::string name;
  std::vector<uint8_t> write;  // per argument: mutated (Tensor(a!))
  bool view = false;           // returns aliases, writes nothing: metadata only, no access
  bool cpu_indices = false;    // CUDA accepts CPU index tensors here
};

struct State {
  std::mutex mu;
  Stream streams[kStreams];
  uint64_t host[kStreams] = {};  // per stream, the highest op the host has seen complete
  std::map<std::pair<int, size_t>, std::vector<Block*>> pool;
  size_t pooled = 0;
  std::vector<Block*> kept;  // freed, but record_stream() streams may still use them
  int64_t allocated = 0, peak = 0;
  int64_t kernels = 0, pageable_non_blocking = 0, deferred_copies = 0, bytes_h2d = 0, bytes_d2h = 0;
  std::unordered_map<const c10::FunctionSchema*, OpInfo*> ops;
};

// Leaked on purpose: tensors are still freed (through free_device) while the process exits.
State& st() {
  static State* s = new State();
  return *s;
}

std::vector<c10::Storage>& graveyard() {
  static auto* dead = new std::vector<c10::Storage>();  // guarded by st().mu
  return *dead;
}
std::mutex& state_mutex() { return st().mu; }

thread_local int tls_stream = 0;  // the current stream, per thread as in CUDA

std::string stream_name(int s) { return s ? "stream " + std::to_string(s) : "stream 0 (the default stream)"; }

// ---- Ordering and the race detector -------------------------------------------------------
// What stream t has waited for, directly (events) or through the host: a host
// synchronization orders every op issued after it.
uint64_t waited(const State& s, int t, int other) {
  return std::max(s.streams[t].clock[other], s.host[other]);
}

[[noreturn]] void race(const State& s, const char* op, int t, bool write, const Block* b, size_t lo,
                       size_t hi, size_t page, int o, uint64_t c, bool o_wrote) {
  const size_t a = std::max(lo, page * kPage), z = std::min(hi, (page + 1) * kPage);
  const char* prev = s.streams[o].count - c < kNames ? s.streams[o].names[c % kNames] : nullptr;
  std::ostringstream m;
  m << "sim: stream-order race: " << op << " on " << stream_name(t) << (write ? " writes" : " reads")
    << " bytes [" << a << ", " << z << ") of the " << b->size << "-byte device allocation at "
    << static_cast<void*>(b->base) << ", which " << stream_name(o) << (o_wrote ? " wrote" : " read")
    << " in its op #" << c;
  if (prev) m << " (" << prev << ")";
  m << ", and " << stream_name(t) << " has not waited for that op. On a GPU the two run in either "
    << "order: record an event on " << stream_name(o) << " after it and make " << stream_name(t)
    << " wait on it (wait_event), or synchronize first.";
  TORCH_CHECK(false, m.str());
}

// Checks stream t's access to bytes [lo, hi) of b as its op `seq`, then records it.
void touch(State& s, Block* b, size_t lo, size_t hi, bool write, int t, uint64_t seq, const char* op) {
  if (b->pages.empty()) b->pages.assign((b->size + kPage - 1) / kPage, b->fill);
  for (size_t p = lo / kPage; p <= (hi - 1) / kPage; ++p) {
    Page& pg = b->pages[p];
    if (pg.ws >= 0 && pg.ws != t && pg.w > waited(s, t, pg.ws))
      race(s, op, t, write, b, lo, hi, p, pg.ws, pg.w, true);
    if (!write) {
      pg.r[t] = seq;
      continue;
    }
    for (int o = 0; o < kStreams; ++o)
      if (o != t && pg.r[o] > waited(s, t, o)) race(s, op, t, write, b, lo, hi, p, o, pg.r[o], false);
    pg.w = seq;
    pg.ws = static_cast<int8_t>(t);
    std::fill(std::begin(pg.r), std::end(pg.r), 0);
  }
}

// ---- Deferred copies ------------------------------------------------------------------------
void unref(Block* b) {
  if (--b->refs == 0 && b->adopted && !b->owner) delete b;
}

void execute(Copy& c) {
  if (c.dropped) return;
  char* dev = nullptr;
  if (Block* b = c.dev) {
    const bool freed = b->gen != c.gen;
    dev = b->base + c.off;
    unref(b);
    TORCH_CHECK(!freed, "sim: use after free: a non_blocking ", c.h2d ? "host-to-device" : "device-to-host",
                " copy of ", c.nbytes, " bytes, issued as op #", c.seq, ", ran after its device memory was "
                "freed; on a GPU it would ", c.h2d ? "write into" : "read from", " memory the caching "
                "allocator may have given to another tensor. Keep the tensor alive until the copy's stream "
                "is synchronized (or an event after the copy), or call tensor.record_stream(copy_stream).");
  }
  if (c.h2d) std::memcpy(dev, c.host, c.nbytes);
  else std::memcpy(c.host, c.saved.empty() ? dev : c.saved.data(), c.nbytes);
}

// Runs the first k copies queued on stream t, in order. A failing copy (use after free) does
// not stop the others: the stream ran them all; the first error is raised.
void flush(State& s, int t, size_t k) {
  auto& q = s.streams[t].pending;
  std::exception_ptr error;
  for (; k > 0; --k) {
    Copy c = std::move(q.front());
    q.pop_front();
    try {
      execute(c);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    graveyard().push_back(std::move(c.host_keep));  // released after the unlock (see Lock)
  }
  if (error) std::rethrow_exception(error);
}

void run_until(State& s, int t, uint64_t seq) {
  const auto& q = s.streams[t].pending;
  size_t k = 0;
  while (k < q.size() && q[k].seq <= seq) ++k;
  flush(s, t, k);
}

void host_waits(State& s, int t, uint64_t seq, const uint64_t* clock) {
  for (int i = 0; i < kStreams; ++i) s.host[i] = std::max(s.host[i], clock[i]);
  s.host[t] = std::max(s.host[t], seq);
}

// ---- Device memory --------------------------------------------------------------------------
void free_device(void* ctx);

Block* block_of(const c10::DataPtr& p) {
  return p.get_deleter() == &free_device ? static_cast<Block*>(p.get_context()) : nullptr;
}

void trim(State& s) {
  for (auto& [key, blocks] : s.pool) {
    auto end = std::partition(blocks.begin(), blocks.end(), [](Block* b) { return b->refs > 0; });
    for (auto it = end; it != blocks.end(); ++it) {
      s.pooled -= (*it)->size;
      std::free((*it)->base);
      delete *it;
    }
    blocks.erase(end, blocks.end());
  }
}

// Makes b's memory reusable. `forget`: its record_stream() streams are known to be done with
// it (as CUDA's allocator learns from their events), so its history goes too.
void release(State& s, Block* b, bool forget) {
  // Copies still queued on the block's own stream come before any reuse of it on that stream:
  // they see the bytes as they are now.
  for (Copy& c : s.streams[b->stream].pending) {
    if (c.dev != b) continue;
    if (c.h2d) c.dropped = true;
    else c.saved.assign(b->base + c.off, b->base + c.off + c.nbytes);
    c.dev = nullptr;
    --b->refs;
  }
  ++b->gen;
  b->used_on = 0;
  if (forget) b->pages.clear();
  if (b->adopted) {  // leaves the device (no poison: nothing on the device can read it again)
    b->owner.clear();
    if (b->refs == 0) delete b;
    return;
  }
  std::memset(b->base, kPoison, b->size);  // what a late reader of the reused block sees
  s.pool[{b->stream, b->size}].push_back(b);
  s.pooled += b->size;
  if (s.pooled > kCacheCap) trim(s);
}

bool finished(const State& s, const Block* b) {
  for (int o = 0; o < kStreams; ++o) {
    const auto& q = s.streams[o].pending;
    if ((b->used_on >> o & 1) && o != b->stream && !q.empty() && q.front().seq <= b->keep_until[o])
      return false;
  }
  return true;
}

void release_finished(State& s) {
  auto end = std::partition(s.kept.begin(), s.kept.end(), [&](Block* b) { return !finished(s, b); });
  for (auto it = end; it != s.kept.end(); ++it) release(s, *it, true);
  s.kept.erase(end, s.kept.end());
}

void free_device(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  State& s = st();
  Lock g(s.mu);
  s.allocated -= static_cast<int64_t>(b->size);
  // record_stream(): the block waits until the work those streams had issued has run.
  for (int o = 0; o < kStreams; ++o)
    if (b->used_on >> o & 1) b->keep_until[o] = s.streams[o].count;
  const bool others = (b->used_on & ~(1u << b->stream)) != 0;
  if (others && !finished(s, b)) s.kept.push_back(b);
  else release(s, b, others);
}

void count_alloc(State& s, size_t n) {
  s.allocated += static_cast<int64_t>(n);
  s.peak = std::max(s.peak, s.allocated);
}

int stream_index(const c10::Stream& s);
void record_use(const c10::DataPtr& p, int stream);

// The pool's blocks whose streams are done go back to the OS (torch.sim.empty_cache).
void empty_cache() {
  Lock g(st().mu);
  release_finished(st());
  trim(st());
}

// A c10::DeviceAllocator where torch has one (2.9+): torch.accelerator's memory calls
// (empty_cache, memory_stats …), which accelerate and transformers make on whatever
// accelerator is current, reach it as they reach CUDA's caching allocator.
#ifdef SIM_DEVICE_ALLOCATOR
using AllocatorBase = c10::DeviceAllocator;
#else
using AllocatorBase = c10::Allocator;
#endif

struct SimAllocator final : AllocatorBase {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, kSim};
    const size_t size = round_up(nbytes);
    const int t = tls_stream;
    State& s = st();
    Block* b = nullptr;
    {
      Lock g(s.mu);
      release_finished(s);
      auto it = s.pool.find({t, size});
      if (it != s.pool.end() && !it->second.empty()) {
        b = it->second.back();  // poisoned at release
        it->second.pop_back();
        s.pooled -= size;
      }
    }
    if (!b) {
      void* p = std::aligned_alloc(kPage, size);
      TORCH_CHECK_WITH(OutOfMemoryError, p, "sim: out of memory allocating ", nbytes, " bytes");
      std::memset(p, kPoison, size);  // a GPU does not zero new memory
      b = new Block;
      b->base = static_cast<char*>(p);
      b->size = size;
      b->stream = t;
    }
    Lock g(s.mu);
    count_alloc(s, size);
    return {b->base, b, &free_device, kSim};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // contexts are Blocks
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }
#ifdef SIM_DEVICE_ALLOCATOR
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { empty_cache(); }
  void recordStream(const c10::DataPtr& p, c10::Stream s) override { record_use(p, stream_index(s)); }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override {
    State& s = st();
    Lock g(s.mu);
    c10::CachingDeviceAllocator::DeviceStats d;
    auto& a = d.allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
    a.current = s.allocated;
    a.peak = s.peak;
    auto& r = d.reserved_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
    r.current = r.peak = s.allocated + static_cast<int64_t>(s.pooled);
    return d;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {
    Lock g(st().mu);
    st().peak = st().allocated;
  }
  // pure in torch's newer DeviceAllocator (no `override`: absent from 2.9-2.13's); unused by outcore
  void* raw_alloc(size_t) { TORCH_CHECK(false, "sim: raw_alloc is not supported"); }
  void raw_delete(void*) { TORCH_CHECK(false, "sim: raw_delete is not supported"); }
#endif
};
SimAllocator g_device;

c10::DataPtr adopt(c10::DataPtr cpu, size_t n, int t, uint64_t seq) {
  if (!cpu.get() || n == 0) return {nullptr, kSim};
  auto* b = new Block;
  b->base = static_cast<char*>(cpu.get());
  b->size = n;
  b->stream = t;
  b->adopted = true;
  b->owner = std::move(cpu);
  b->fill.w = seq;  // written by the op that made it
  b->fill.ws = static_cast<int8_t>(t);
  State& s = st();
  Lock g(s.mu);
  count_alloc(s, n);
  return {b->base, b, &free_device, kSim};
}

void record_use(const c10::DataPtr& p, int stream) {
  if (Block* b = block_of(p)) {
    Lock g(st().mu);
    b->used_on |= static_cast<uint8_t>(1u << stream);
  }
}

// ---- Pinned host memory: pinned-allocator blocks and host_register()ed ranges -------------
struct Pins {
  std::mutex mu;
  std::map<uintptr_t, std::pair<uintptr_t, bool>> ranges;  // begin -> (end, registered)
};
Pins& pins() {
  static Pins* p = new Pins();
  return *p;
}

bool pinned(const void* ptr, size_t n) {
  Pins& P = pins();
  Lock g(P.mu);
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  auto it = P.ranges.upper_bound(a);
  return ptr && it != P.ranges.begin() && a + n <= std::prev(it)->second.first;
}

void add_pinned(uintptr_t a, size_t n, bool registered) {
  Pins& P = pins();
  Lock g(P.mu);
  auto it = P.ranges.upper_bound(a);
  TORCH_CHECK((it == P.ranges.end() || it->first >= a + n) &&
                  (it == P.ranges.begin() || std::prev(it)->second.first <= a),
              "sim: cannot pin [", reinterpret_cast<void*>(a), ", +", n,
              ") overlaps memory that is already pinned or registered");
  P.ranges[a] = {a + n, registered};
}

void free_pinned(void* p) {
  {
    Lock g(pins().mu);
    pins().ranges.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, kCpu};
    void* p = std::aligned_alloc(kPage, round_up(nbytes));
    TORCH_CHECK_WITH(OutOfMemoryError, p, "sim: out of pinned memory allocating ", nbytes, " bytes");
    add_pinned(reinterpret_cast<uintptr_t>(p), round_up(nbytes), false);
    return {p, p, &free_pinned, kCpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }
};
PinnedAllocator g_pinned;

void host_register(const Tensor& t) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous(), "sim: host_register needs a contiguous CPU tensor");
  const auto a = reinterpret_cast<uintptr_t>(t.data_ptr());
  TORCH_CHECK(a % kPage == 0 && t.nbytes() > 0, "sim: host_register needs a page-aligned, non-empty range "
              "(cudaHostRegister pins whole pages); got ", t.data_ptr(), " (+", t.nbytes(), ")");
  add_pinned(a, round_up(t.nbytes()), true);
}

void host_unregister(const Tensor& t) {
  Lock g(pins().mu);
  auto& ranges = pins().ranges;
  auto it = ranges.find(reinterpret_cast<uintptr_t>(t.data_ptr()));
  TORCH_CHECK(it != ranges.end() && it->second.second, "sim: host_unregister: ", t.data_ptr(),
              " is not the start of a host_register()ed range");
  ranges.erase(it);
}

// ---- Issuing work on a stream ------------------------------------------------------------
struct Access {
  Block* b = nullptr;  // nullptr: no device bytes (empty, or memory not from this allocator)
  size_t lo = 0, hi = 0;
  bool write = false;
};

Access access_of(const Tensor& t, bool write) {
  Access a;
  a.write = write;
  Block* b = t.numel() ? block_of(t.storage().data_ptr()) : nullptr;
  if (!b) return a;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto item = static_cast<int64_t>(t.dtype().itemsize());
  a.b = b;
  a.lo = static_cast<size_t>(t.storage_offset() * item);
  a.hi = std::min(b->size, static_cast<size_t>((t.storage_offset() + last + 1) * item));
  return a;
}

// Issues an op on stream t: copies queued on t that touch its bytes (device ones, or host
// [hlo, hhi)) run first, as stream order requires; then the race check. Returns its number.
uint64_t issue(State& s, int t, const char* name, const Access* acc, size_t n, uintptr_t hlo = 0,
               uintptr_t hhi = 0) {
  const auto& q = s.streams[t].pending;
  size_t k = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    const Copy& c = q[i];
    const auto h = reinterpret_cast<uintptr_t>(c.host);
    bool hit = hlo < h + c.nbytes && h < hhi;
    for (size_t j = 0; j < n && !hit; ++j)
      hit = c.dev && c.dev == acc[j].b && acc[j].lo < c.off + c.nbytes && c.off < acc[j].hi;
    if (hit) k = i + 1;
  }
  flush(s, t, k);
  Stream& str = s.streams[t];
  const uint64_t seq = ++str.count;
  str.names[seq % kNames] = name;
  for (size_t j = 0; j < n; ++j)
    if (acc[j].b) touch(s, acc[j].b, acc[j].lo, acc[j].hi, acc[j].write, t, seq, name);
  return seq;
}

// The host waits for everything issued on stream t (stream.synchronize(), a blocking copy).
void sync_stream(State& s, int t) {
  host_waits(s, t, s.streams[t].count, s.streams[t].clock);
  flush(s, t, s.streams[t].pending.size());
  release_finished(s);
}

// ---- The boxed fallback: every aten op without a native kernel below ----------------------
const OpInfo& op_info(const c10::FunctionSchema& schema) {
  thread_local std::unordered_map<const c10::FunctionSchema*, const OpInfo*> cache;
  auto hit = cache.find(&schema);
  if (hit != cache.end()) return *hit->second;
  Lock g(st().mu);
  OpInfo*& info = st().ops[&schema];
  if (!info) {
    info = new OpInfo();  // lives as long as the schema; race messages keep pointing at its name
    const auto& overload = schema.overload_name();
    info->name = overload.empty() ? schema.name() : schema.name() + "." + overload;
    bool writes = false, aliases = false;
    for (const auto& a : schema.arguments()) {
      info->write.push_back(a.alias_info() && a.alias_info()->isWrite());
      writes |= info->write.back() != 0;
    }
    for (const auto& r : schema.returns()) aliases |= r.alias_info() != nullptr;
    info->view = aliases && !writes;
    // CUDA's indexing kernels take CPU index tensors (they copy them over); no other op does.
    info->cpu_indices = schema.name() == "aten::index" || schema.name() == "aten::_index_put_impl_";
  }
  cache.emplace(&schema, info);
  return *info;
}

Tensor like(c10::Storage storage, c10::DispatchKey key, const Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

c10::Storage storage(c10::DataPtr p, size_t n, c10::Allocator* allocator) {
  using c10::StorageImpl;
  return c10::Storage(
      c10::make_intrusive<StorageImpl>(StorageImpl::use_byte_size_t(), n, std::move(p), allocator, true));
}
c10::Storage sim_storage(c10::DataPtr p, size_t n) { return storage(std::move(p), n, &g_device); }
// A CPU storage over a sim storage's memory. It does not own the memory; it is resizable so
// that an out= kernel can grow it (Call::storage_for then hands the new memory to sim).
c10::Storage cpu_view_of(const c10::Storage& s) {
  return storage(c10::DataPtr(s.data_ptr().get(), kCpu), s.nbytes(), c10::GetCPUAllocator());
}

Tensor cpu_alias(const Tensor& t) { return like(cpu_view_of(t.storage()), c10::DispatchKey::CPU, t); }
c10::DataPtr take(c10::StorageImpl* s) { return s->set_data_ptr(c10::DataPtr(nullptr, kCpu)); }

struct Call {
  struct Arg { Tensor sim, cpu; bool write; };
  struct Pair { c10::Storage sim, cpu; };
  const OpInfo& info;
  int stream = tls_stream;
  uint64_t seq = 0;
  c10::SmallVector<Arg, 6> args;
  c10::SmallVector<Pair, 6> stores;  // argument storages: sim and its CPU view
  c10::SmallVector<Pair, 2> fresh;   // storages the kernel made: CPU and its sim twin
  c10::SmallVector<Access, 6> acc;
  optional<c10::Device> first;

  explicit Call(const OpInfo& i) : info(i) {}

  void see(c10::Device d) {
    if (!first) first = d;
    TORCH_CHECK(*first == d, "Expected all tensors to be on the same device, but found at least two "
                "devices, ", *first, " and ", d, "! (when checking the arguments of ", info.name, ")");
  }

  Tensor to_cpu(const Tensor& t, bool write) {
    if (!t.defined()) return t;
    if (!t.is_privateuseone()) {
      // CUDA takes 0-dim CPU tensors as scalars anywhere, and CPU index tensors in indexing.
      if (!(t.is_cpu() && !write && (t.dim() == 0 || info.cpu_indices))) see(t.device());
      return t;
    }
    see(kSim);
    auto* impl = t.storage().unsafeGetStorageImpl();
    size_t i = 0;
    while (i < stores.size() && stores[i].sim.unsafeGetStorageImpl() != impl) ++i;
    if (i == stores.size()) stores.push_back({t.storage(), cpu_view_of(t.storage())});
    Tensor c = like(stores[i].cpu, c10::DispatchKey::CPU, t);
    args.push_back({t, c, write});
    if (!info.view) acc.push_back(access_of(t, write));
    return c;
  }

  void arg(c10::IValue& v, bool write) {
    if (v.isTensor()) {
      v = to_cpu(v.toTensor(), write);
    } else if (v.isList()) {  // Tensor[] and Tensor?[]
      const auto& items = v.toListRef();
      if (std::none_of(items.begin(), items.end(), [](const c10::IValue& e) { return e.isTensor(); })) return;
      c10::impl::GenericList out(v.toList().elementType());
      out.reserve(items.size());
      for (const auto& e : items) out.push_back(e.isTensor() ? c10::IValue(to_cpu(e.toTensor(), write)) : e);
      v = std::move(out);
    } else if (v.isDevice() && v.toDevice().is_privateuseone()) {  // factories
      v = kCpu;
    }
  }

  // The sim storage for a CPU storage the kernel returned or resized.
  c10::Storage storage_for(const c10::Storage& cpu) {
    c10::StorageImpl* key = cpu.unsafeGetStorageImpl();
    for (auto& p : stores) {
      if (p.cpu.unsafeGetStorageImpl() != key) continue;
      if (key->data_ptr().get() != p.sim.data_ptr().get()) {
        // An out= argument the kernel grew: its new memory becomes the sim storage's, as
        // resize_ on the device would have done (the swap frees the old block).
        const size_t n = key->nbytes();
        c10::DataPtr moved = adopt(take(key), n, stream, seq);
        key->set_data_ptr_noswap(c10::DataPtr(moved.get(), kCpu));
        p.sim.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(moved));
        p.sim.unsafeGetStorageImpl()->set_nbytes(n);
      }
      return p.sim;
    }
    for (auto& p : fresh)
      if (p.cpu.unsafeGetStorageImpl() == key) return p.sim;
    const size_t n = cpu.nbytes();
    c10::Storage sim;
    if (cpu.use_count() == 1) {  // the kernel's own new memory: take it over
      sim = sim_storage(adopt(take(key), n, stream, seq), n);
    } else {  // shared with something else (a CPU argument): copy
      sim = sim_storage(g_device.allocate(n), n);
      if (n) std::memcpy(sim.mutable_data(), cpu.data(), n);
      Lock g(st().mu);
      if (Block* b = block_of(sim.data_ptr())) touch(st(), b, 0, n, true, stream, seq, info.name.c_str());
    }
    fresh.push_back({sim, cpu});
    return sim;
  }

  Tensor sync(const Arg& a) {
    c10::Storage storage = storage_for(a.cpu.storage());
    c10::TensorImpl* impl = a.sim.unsafeGetTensorImpl();
    if (impl->storage().unsafeGetStorageImpl() != storage.unsafeGetStorageImpl())
      impl->set_storage_keep_dtype(storage);
    if (impl->sizes() != a.cpu.sizes() || impl->strides() != a.cpu.strides() ||
        impl->storage_offset() != a.cpu.storage_offset())
      impl->set_sizes_and_strides(a.cpu.sizes(), a.cpu.strides(), a.cpu.storage_offset());
    return a.sim;
  }

  Tensor to_sim(const Tensor& r) {
    if (!r.defined() || !r.is_cpu()) return r;
    for (const auto& a : args)  // in-place and out=: the caller's own tensor
      if (a.cpu.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return sync(a);
    return like(storage_for(r.storage()), c10::DispatchKey::PrivateUse1, r);
  }

  void ret(c10::IValue& v) {
    if (v.isTensor()) {
      v = to_sim(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<Tensor> out;
      for (const Tensor& t : v.toTensorList()) out.push_back(to_sim(t));
      v = std::move(out);
    }
  }
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // The CPU kernel runs on this thread: often the autograd engine's sim thread, whose OpenMP
  // thread count was fixed when it started. A reduction's bits depend on that count, so it
  // follows the process's current torch.set_num_threads, as the CPU's own backward does.
  at::init_num_threads();
  const auto& schema = op.schema();
  Call call(op_info(schema));
  const auto nargs = static_cast<std::ptrdiff_t>(schema.arguments().size());
  for (std::ptrdiff_t i = 0; i < nargs; ++i) call.arg(stack->end()[i - nargs], call.info.write[i] != 0);
  if (!call.info.view) {
    Lock g(st().mu);
    call.seq = issue(st(), call.stream, call.info.name.c_str(), call.acc.data(), call.acc.size());
    ++st().kernels;
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (const auto& a : call.args)
    if (a.write) call.sync(a);
  const auto nret = static_cast<std::ptrdiff_t>(schema.returns().size());
  for (auto it = stack->end() - nret; it != stack->end(); ++it) call.ret(*it);
}

// ---- Native kernels: what must keep the sim tensor itself (metadata, aliasing), copies -----
void check_device(optional<c10::Device> d) {
  TORCH_CHECK(!d || (d->is_privateuseone() && d->index() <= 0), "sim: there is one device, sim:0; got ", *d);
}

void check_empty(optional<c10::Device> device, optional<at::Layout> layout, optional<bool> pin) {
  check_device(device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::kStrided, "sim: only strided tensors");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin), "sim: only CPU memory can be pinned");
}

constexpr c10::DispatchKeySet kSimKeys(c10::DispatchKey::PrivateUse1);

Tensor empty_memory_format(SymIntArrayRef size, optional<at::ScalarType> dtype, optional<at::Layout> layout,
                           optional<c10::Device> device, optional<bool> pin,
                           optional<at::MemoryFormat> format) {
  check_empty(device, layout, pin);
  return at::detail::empty_generic(ints(size), &g_device, kSimKeys, c10::dtype_or_default(dtype), format);
}

Tensor empty_strided(SymIntArrayRef size, SymIntArrayRef stride, optional<at::ScalarType> dtype,
                     optional<at::Layout> layout, optional<c10::Device> device, optional<bool> pin) {
  check_empty(device, layout, pin);
  return at::detail::empty_strided_generic(ints(size), ints(stride), &g_device, kSimKeys,
                                           c10::dtype_or_default(dtype));
}

Tensor as_strided(const Tensor& self, SymIntArrayRef size, SymIntArrayRef stride,
                  optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(self, ints(size), ints(stride),
                                           offset ? optional<int64_t>(offset->expect_int()) : std::nullopt);
}

Tensor view(const Tensor& self, SymIntArrayRef size) { return at::native::view(self, ints(size)); }

Tensor reshape_alias(const Tensor& self, SymIntArrayRef size, SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, ints(size), ints(stride));
}

// Grows through the storage's allocator (ours): the new bytes are poison, as on a GPU.
const Tensor& resize_(const Tensor& self, SymIntArrayRef size, optional<at::MemoryFormat> format) {
  return at::native::resize_(self, ints(size), format);
}

Tensor& set_storage(Tensor& self, at::Storage source, c10::SymInt offset, SymIntArrayRef size,
                    SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset.expect_int(), ints(size), ints(stride));
}
Tensor& set_source_storage(Tensor& self, at::Storage source) { return at::native::set_(self, source); }
Tensor& set_source_tensor(Tensor& self, const Tensor& src) { return at::native::set_tensor_(self, src); }
Tensor& set_empty(Tensor& self) { return self.set_(sim_storage({nullptr, kSim}, 0), 0, {0}, {}); }

// `cpu_param.data = sim_tensor`, and back, works on CUDA: both are dense tensors.
bool has_compatible_shallow_copy_type(const Tensor& self, const Tensor& from) {
  auto dense = [](const Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() && (t.is_cpu() || t.is_privateuseone());
  };
  return (dense(self) && dense(from)) ||
         self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

int stream_index(const c10::Stream& s) {
  TORCH_CHECK(s.device_type() == c10::DeviceType::PrivateUse1 && s.id() >= 0 && s.id() < kStreams,
              "sim: not a sim stream: ", s);
  return static_cast<int>(s.id());
}

void record_stream(Tensor& self, c10::Stream s) {
  record_use(self.storage().data_ptr(), stream_index(s));
}

// .item(): a device-to-host copy the host waits for.
c10::Scalar local_scalar_dense(const Tensor& self) {
  {
    Lock g(st().mu);
    const Access a = access_of(self, false);
    issue(st(), tls_stream, "aten::_local_scalar_dense (.item())", &a, 1);
    sync_stream(st(), tls_stream);
  }
  return cpu_alias(self).item();
}

Tensor copy_from(const Tensor& src, const Tensor& dst, bool non_blocking) {
  State& s = st();
  const int t = tls_stream;
  const bool to_dev = dst.is_privateuseone();
  if (to_dev && src.is_privateuseone()) {  // device to device: a kernel on the current stream
    const Access acc[2] = {access_of(src, false), access_of(dst, true)};
    {
      Lock g(s.mu);
      issue(s, t, "aten::copy_ (device to device)", acc, 2);
      ++s.kernels;
    }
    cpu_alias(dst).copy_(cpu_alias(src));
    return dst;
  }
  const Tensor& host = to_dev ? src : dst;
  const Tensor& dev = to_dev ? dst : src;
  TORCH_CHECK(host.is_cpu(), "sim: cannot copy between ", src.device(), " and ", dst.device());
  const size_t nbytes = dev.numel() * dev.element_size();
  const bool pin = pinned(host.data_ptr(), host.nbytes());
  // CUDA moves the bytes as they are only between same-dtype contiguous tensors; otherwise it
  // converts on the host, into pageable memory, and the copy is synchronous.
  const bool host_plain = host.dtype() == dev.dtype() && host.is_contiguous() &&
                          host.is_conj() == dev.is_conj() && host.is_neg() == dev.is_neg();
  const Access a = access_of(dev, to_dev);
  c10::Storage keep = host.storage();  // taken before the lock: a refcount may take the GIL (see Lock)
  const char* op = to_dev ? (non_blocking ? "copy_ host-to-device (non_blocking)" : "copy_ host-to-device")
                          : (non_blocking ? "copy_ device-to-host (non_blocking)" : "copy_ device-to-host");
  bool deferred = false;
  {
    Lock g(s.mu);
    (to_dev ? s.bytes_h2d : s.bytes_d2h) += static_cast<int64_t>(nbytes);
    if (non_blocking && pin && host_plain && dev.is_contiguous() && host.numel() == dev.numel() && a.b) {
      // Deferred: it runs when ordering forces it (events, sync_stream, issue); until then its
      // destination holds poison.
      auto* hp = static_cast<char*>(host.data_ptr());
      const auto h = reinterpret_cast<uintptr_t>(hp);
      const uint64_t seq = issue(s, t, op, &a, 1, h, h + nbytes);
      ++a.b->refs;
      s.streams[t].pending.push_back(Copy{seq, to_dev, a.b, a.b->gen, a.lo, nbytes, hp, std::move(keep)});
      std::memset(to_dev ? a.b->base + a.lo : hp, kPoison, nbytes);
      ++s.deferred_copies;
      deferred = true;  // (returned after the unlock: copying `dst` out increfs it, see Lock)
    } else {
      const bool staged = non_blocking && !(pin && host_plain);
      s.pageable_non_blocking += staged;
      const auto h = reinterpret_cast<uintptr_t>(keep.data_ptr().get());
      issue(s, t, op, &a, 1, h, h + keep.nbytes());
      // A blocking copy waits for its stream; so does a device-to-host copy into pageable
      // memory (it returns once the bytes are there, i.e. after the stream's earlier work).
      if (!non_blocking || (staged && !to_dev)) sync_stream(s, t);
    }
  }
  if (deferred) return dst;
  if (to_dev) cpu_alias(dst).copy_(src);
  else const_cast<Tensor&>(dst).copy_(cpu_alias(src));
  return dst;
}

Tensor copy_from_and_resize(const Tensor& src, const Tensor& dst) {
  dst.resize_(src.sizes());
  return copy_from(src, dst, false);
}

// ---- Streams and events ---------------------------------------------------------------------
c10::Stream make_stream(int id) { return c10::Stream(c10::Stream::UNSAFE, kSim, id); }

int next_side_stream() {
  static std::atomic<int> rr{0};
  return 1 + rr++ % (kStreams - 1);
}

// The host waits for, or sees complete, the event.
void host_sync(void* event) {
  auto* e = static_cast<Event*>(event);
  if (!e || !e->recorded) return;
  Lock g(st().mu);
  host_waits(st(), e->stream, e->seq, e->clock);
  run_until(st(), e->stream, e->seq);
  release_finished(st());
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override { return setDevice(d), kSim; }
  c10::Device getDevice() const override { return kSim; }
  void setDevice(c10::Device d) const override { check_device(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  c10::Stream getStream(c10::Device) const override { return make_stream(tls_stream); }
  c10::Stream getDefaultStream(c10::Device) const override { return make_stream(0); }
  c10::Stream getNewStream(c10::Device, int) const override { return make_stream(next_side_stream()); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const int prev = tls_stream;
    tls_stream = stream_index(s);
    return make_stream(prev);
  }

  void record(void** event, const c10::Stream& stream, c10::DeviceIndex, c10::EventFlag) const override {
    const int t = stream_index(stream);
    if (!*event) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    Lock g(st().mu);
    e->recorded = true;
    e->stream = t;
    e->seq = st().streams[t].count;
    std::copy(std::begin(st().streams[t].clock), std::end(st().streams[t].clock), e->clock);
    e->when = std::chrono::steady_clock::now();
  }
  // The stream waits for the event: the copies it covers run now (work after the wait may
  // read their bytes), and the stream's clock learns all that the event's stream had seen.
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<Event*>(event);
    if (!e || !e->recorded) return;  // waiting on an unrecorded event is a no-op, as in CUDA
    const int t = stream_index(stream);
    Lock g(st().mu);
    uint64_t* clock = st().streams[t].clock;
    for (int i = 0; i < kStreams; ++i) clock[i] = std::max(clock[i], e->clock[i]);
    clock[e->stream] = std::max(clock[e->stream], e->seq);
    run_until(st(), e->stream, e->seq);
  }
  // A query answering "done" is a host observation too. Kernels are eager and queued copies
  // run on demand, so everything is done once asked.
  bool queryEvent(void* event) const override {
    host_sync(event);
    return true;
  }
  void synchronizeEvent(void* event) const override { host_sync(event); }
  void destroyEvent(void* e, c10::DeviceIndex) const noexcept override { delete static_cast<Event*>(e); }
  double elapsedTime(void* a, void* b, c10::DeviceIndex) const override {
    auto *ea = static_cast<Event*>(a), *eb = static_cast<Event*>(b);
    TORCH_CHECK(ea && eb && ea->recorded && eb->recorded, "sim: both events must be recorded before "
                "calculating elapsed time");  // (torch.Event itself checks enable_timing)
    host_sync(a);
    host_sync(b);
    return std::chrono::duration<double, std::milli>(eb->when - ea->when).count();
  }
  bool queryStream(const c10::Stream& stream) const override {
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    Lock g(st().mu);
    sync_stream(st(), stream_index(stream));
  }
  void synchronizeDevice(c10::DeviceIndex) const override {
    Lock g(st().mu);
    std::exception_ptr error;
    for (int t = 0; t < kStreams; ++t) {
      try {
        sync_stream(st(), t);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& stream) const override {
    record_use(p, stream_index(stream));
  }
};

// ---- Hooks -------------------------------------------------------------------------------
// torch.empty(..., pin_memory=True), Tensor.pin_memory() and Tensor.is_pinned() ask the hooks
// of the current accelerator (at::getAccelerator(): PrivateUse1 as soon as hooks are
// registered, when no CUDA is present); is_pinned() answers false until the device is
// initialized, which enable() does through init().
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  bool isPinnedPtr(const void* p) const override { return pinned(p, 1); }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }
  at::Device getDeviceFromPtr(void*) const override { return kSim; }
  // Sim kernels are CPU kernels: random ops draw from the CPU generator (torch.manual_seed
  // seeds it), so a seeded run gives the same numbers on sim as on the CPU.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::make_generator<at::CPUGeneratorImpl>();
  }
};

// scaled_dot_product_attention picks its kernel through a stub keyed by device type: without
// an entry for sim it takes the math path, whose numerics differ from the CPU's.
int64_t sdp_choice(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                   double dropout, bool causal, optional<double> scale, bool gqa) {
  return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), q, k, v, mask,
                                                 dropout, causal, scale, gqa);
}

// An op with a CPU kernel that is also composite (a generic decomposition for other backends,
// or allocate-then-out=) would run the composite on sim: other kernels, other numerics than
// on the CPU. Registering the fallback for every op with a CPU kernel gives sim the CPU's
// dispatch table.
void mirror_cpu_kernels() {
  static auto* lib =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op || name.name.rfind("aten::", 0) != 0 || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1))
      continue;
    const std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

// enable(): the hooks make sim the accelerator pinned memory belongs to. Loading the library
// alone changes nothing visible (see load() in simdevice.py).
void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    mirror_cpu_kernels();
    at::RegisterPrivateUse1HooksInterface(new Hooks());
    at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  });
}

std::vector<int64_t> report() {
  State& s = st();
  Lock g(s.mu);
  int64_t pending = 0;
  for (const auto& str : s.streams) pending += static_cast<int64_t>(str.pending.size());
  return {s.kernels,   s.pageable_non_blocking, s.deferred_copies, s.bytes_h2d,
          s.bytes_d2h, s.allocated,             s.peak,            pending};
}

void reset_report() {
  State& s = st();
  Lock g(s.mu);
  s.kernels = s.pageable_non_blocking = s.deferred_copies = s.bytes_h2d = s.bytes_d2h = 0;
  s.peak = s.allocated;
}

// Registered when the library loads: the guard must be, before the autograd engine counts devices.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_device)
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &sdp_choice)
}  // namespace at::native

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("record_stream", record_stream);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  // Composite on every backend, but they pick CPU kernels only for CPU tensors (elsewhere
  // they call convolution_overrideable): run them as the CPU does.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY(outcore_sim, m) {
  m.def("init() -> ()", &init);
  m.def("report() -> int[]", &report);
  m.def("reset_report() -> ()", &reset_report);
  m.def("empty_cache() -> ()", &empty_cache);
  m.def("host_register(Tensor t) -> ()", &host_register);
  m.def("host_unregister(Tensor t) -> ()", &host_unregister);
}
