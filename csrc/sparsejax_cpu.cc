// sparsejax CPU kernels as XLA FFI handlers.
//
// Built as the CPython extension module `sparsejax._cpu_ext` (plain C API, no
// pybind). `registrations()` returns {target_name: PyCapsule(handler)}; the Python
// side (sparsejax/ops/_cpu_ffi.py) registers each one with
// `jax.ffi.register_ffi_target(name, capsule, platform="cpu")`.
//
// Targets
//   sparsejax_spmm          out[s,:]  = sum_{valid k, seg[k]==s} v[k] * dense[col[k],:]
//                           (values f32[0]: v[k] = 1, no coefficient array needed)
//   sparsejax_segment_max   out[s,d]  = max_{valid k, seg[k]==s} v[k] * dense[col[k],d],
//                           argk[s,d] = smallest k attaining it (-1, out 0 if empty)
//   sparsejax_sparse_apply  lazy row-sparse optimizer update, outputs aliased to
//                           (table, slots...); mirrors `update_rows` in
//                           sparsejax/ops/optimizers.py line by line.
//   sparsejax_pairwise_dots[_bwd]  DLRM dot interaction, in sparsejax_interaction.cc.
//
// Entry k is valid iff 0 <= col[k] < K (ids in [0, V) for sparse_apply) and
// 0 <= seg[k] < S. Invalid entries contribute nothing and are never dereferenced.
// Dense/table dtype: f32 or bf16 (accumulation in f32; bf16 results rounded to
// nearest even). Summation order is always ascending k within an output row, so
// results do not depend on the thread count or on whether the fast path ran.
//
// Threads: a persistent worker pool, count = $SPARSEJAX_CPU_THREADS or hardware_concurrency();
// work below $SPARSEJAX_CPU_MIN_PARALLEL entries per thread (default 4096) runs on
// fewer threads (one for tiny inputs).
// Buffers of 64 MiB or more are advised onto 2 MiB pages (AdviseHugePages).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sparsejax_cpu_internal.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

#define SJ_RESTRICT __restrict__
#define SJ_INLINE inline __attribute__((always_inline))

using sparsejax::Bf16ToF32;
using sparsejax::bf16_t;
using sparsejax::F32ToBf16;
using sparsejax::Load;
using sparsejax::Store;

// Prefetch every cache line of [p, p + bytes).
template <int RW>
SJ_INLINE void PrefetchBytes(const void* p, int64_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a), RW, 3);
}

int64_t EnvInt(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return dflt;
  char* end = nullptr;
  long long v = std::strtoll(e, &end, 10);
  if (end == e) return dflt;
  return static_cast<int64_t>(v);
}

int MaxThreads() {
  int64_t n = EnvInt("SPARSEJAX_CPU_THREADS", 0);
  if (n <= 0) n = static_cast<int64_t>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  return static_cast<int>(std::min<int64_t>(n, 256));
}

// Number of threads for `work` items: one per SPARSEJAX_CPU_MIN_PARALLEL items.
int ThreadsFor(int64_t work) {
  int64_t min_work = EnvInt("SPARSEJAX_CPU_MIN_PARALLEL", 4096);
  if (min_work < 1) min_work = 1;
  int64_t t = work / min_work;
  t = std::max<int64_t>(1, std::min<int64_t>(t, MaxThreads()));
  return static_cast<int>(t);
}

// Runs fn(t) for t in [0, n): fn(0) on the calling thread, the rest on a persistent
// pool of workers (thread start-up costs ~40 us, as much as a small lookup). Workers
// claim shares [1, n) one by one; once fn(0) returns, the caller runs every share no
// worker has claimed yet and waits only for the claimed ones. So a worker that is slow
// to wake (its core busy with other work) delays nothing: the caller does its share
// instead of waiting for it (with dynamic chunks, the caller then takes all chunks).
// If the pool is busy (XLA may run two custom calls at once) or a worker cannot be
// started, the shares also run on the calling thread: results never depend on the split.
class WorkerPool {
 public:
  static WorkerPool& Get() {
    static WorkerPool* pool = new WorkerPool();  // leaked: workers outlive static dtors
    return *pool;
  }

  // Returns false (nothing ran) if the pool is busy with another caller.
  bool TryRun(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    EnsureWorkers(n - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      next_ = 1;
      end_ = n;
      done_.store(0, std::memory_order_relaxed);
      failed_.store(false, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    bool failed = false;
    try {
      fn(0);
    } catch (...) {
      failed = true;
    }
    int first_unclaimed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      first_unclaimed = next_;
      next_ = end_;  // close the job: late workers skip it
    }
    for (int t = first_unclaimed; t < n && !failed; ++t) {
      try {
        fn(t);
      } catch (...) {
        failed = true;
      }
    }
    const int claimed = first_unclaimed - 1;
    auto all_done = [&] { return done_.load(std::memory_order_acquire) == claimed; };
    if (!SpinUntil(all_done)) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, all_done);
    }
    if (failed || failed_.load()) throw std::runtime_error("worker thread failed");
    return true;
  }

 private:
  // Spins up to ~kSpinMicros for `done`. A kernel call is often ~1 ms, and waking a
  // thread blocked on a futex costs tens of microseconds, so workers (and the caller
  // waiting for them) spin briefly before they sleep, as OpenMP runtimes do.
  template <typename Pred>
  static bool SpinUntil(Pred done) {
    constexpr int64_t kSpinMicros = 300;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 0;; ++i) {
      if (done()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      if ((i & 255) == 0 && std::chrono::steady_clock::now() > until) return done();
    }
  }

  void EnsureWorkers(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      try {
        workers_.emplace_back([this] { Loop(); });
        workers_.back().detach();
      } catch (...) {
        return;  // the caller runs that share
      }
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!SpinUntil(fresh)) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, fresh);
      }
      const std::function<void(int)>* job = nullptr;
      int t = 0;
      {
        std::lock_guard<std::mutex> lk(mu_);
        seen = generation_.load(std::memory_order_relaxed);
        if (next_ < end_) {
          t = next_++;
          job = job_;
        }
      }
      if (job == nullptr) continue;  // the caller has run (or is running) every share
      bool failed = false;
      try {
        (*job)(t);
      } catch (...) {
        failed = true;
      }
      if (failed) failed_.store(true);
      std::lock_guard<std::mutex> lk(mu_);  // pairs with the caller's wait
      done_.fetch_add(1, std::memory_order_acq_rel);
      done_cv_.notify_one();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;  // guarded by mu_, as next_ and end_
  int next_ = 0, end_ = 0;                         // shares [next_, end_) are unclaimed
  std::atomic<int> done_{0};                       // claimed shares finished
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> generation_{0};
};

template <typename Fn>
void ParallelFor(int n, Fn&& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  const std::function<void(int)> job = [&fn](int t) { fn(t); };
  if (WorkerPool::Get().TryRun(n, job)) return;
  for (int t = 0; t < n; ++t) fn(t);  // pool busy: this call runs alone
}

// Asks the kernel to back a large buffer (an embedding table, its optimizer slots)
// with 2 MiB pages: random row access over a GiB table otherwise misses the TLB on
// nearly every row. MADV_HUGEPAGE covers future faults; MADV_COLLAPSE (Linux >= 6.1)
// converts the pages already there, in a background thread so no step stalls. Both
// leave the contents unchanged, so advising memory XLA later frees is harmless.
// Once per (address, size); off with SPARSEJAX_HUGE_PAGES=0.
void AdviseHugePages(const void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr int64_t kMinBytes = int64_t{64} << 20;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < kMinBytes || EnvInt("SPARSEJAX_HUGE_PAGES", 1) == 0) return;
  static std::mutex mu;
  static std::vector<std::pair<uintptr_t, int64_t>>* seen =
      new std::vector<std::pair<uintptr_t, int64_t>>();
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  {
    std::lock_guard<std::mutex> lk(mu);
    for (const auto& e : *seen) {
      if (e.first == p && e.second == bytes) return;
    }
    if (seen->size() > 4096) seen->clear();
    seen->emplace_back(p, bytes);
  }
  const uintptr_t begin = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (p + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end <= begin) return;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  try {
    std::thread([begin, end] {
      constexpr uintptr_t kStep = uintptr_t{64} << 20;
      for (uintptr_t a = begin; a < end; a += kStep) {
        madvise(reinterpret_cast<void*>(a), std::min(kStep, end - a), 25 /* MADV_COLLAPSE */);
      }
    }).detach();
  } catch (...) {
  }
#else
  (void)data;
  (void)bytes;
#endif
}

// Runs fn(c) for every chunk c in [0, nchunks) on `nthreads` threads that grab
// chunks dynamically, so a descheduled thread (shared/noisy machine) only delays
// the chunk it holds.
template <typename Fn>
void ParallelChunks(int nthreads, int64_t nchunks, Fn&& fn) {
  if (nthreads <= 1 || nchunks <= 1) {
    for (int64_t c = 0; c < nchunks; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  ParallelFor(nthreads, [&](int) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < nchunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c);
    }
  });
}

// Chunks per thread for dynamic scheduling.
constexpr int kChunksPerThread = 8;

std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

// ---------------------------------------------------------------------------
// Segment partitioning shared by spmm and segment_max
// ---------------------------------------------------------------------------

struct Entries {
  const float* values;  // nullptr: every value is 1
  const int32_t* col;
  const int32_t* seg;
  int64_t n;  // number of entries
  int64_t k;  // rows of dense (valid col in [0, k))
  int64_t s;  // number of segments (valid seg in [0, s))

  SJ_INLINE bool Valid(int64_t i) const {
    const int64_t c = col[i], g = seg[i];
    return c >= 0 && c < k && g >= 0 && g < s;
  }
  SJ_INLINE float Value(int64_t i) const { return values != nullptr ? values[i] : 1.0f; }
};

// True iff seg is non-decreasing over valid entries.
bool SortedBySegment(const Entries& e) {
  int64_t last = -1;
  for (int64_t i = 0; i < e.n; ++i) {
    if (!e.Valid(i)) continue;
    const int64_t g = e.seg[i];
    if (g < last) return false;
    last = g;
  }
  return true;
}

// Partition sorted entries into `parts` chunks: chunk t owns segments
// [seg_lo[t], seg_lo[t+1]) and entries [ent_lo[t], ent_lo[t+1]); every valid entry
// of those segments lies in that entry range (chunks may be empty). O(N) total.
void SplitSorted(const Entries& e, int parts, std::vector<int64_t>* seg_lo,
                 std::vector<int64_t>* ent_lo) {
  std::vector<int64_t>& sl = *seg_lo;
  std::vector<int64_t>& el = *ent_lo;
  sl.assign(parts + 1, e.s);
  el.assign(parts + 1, e.n);
  sl[0] = 0;
  el[0] = 0;
  int64_t last_found = -1;  // first valid entry >= the previous cut's start
  for (int t = 1; t < parts; ++t) {
    int64_t b = std::max(e.n * t / parts, el[t - 1]);
    if (b <= last_found) {
      b = last_found;  // nothing valid in [previous b, last_found): don't rescan
    } else {
      while (b < e.n && !e.Valid(b)) ++b;
    }
    last_found = b;
    if (b >= e.n) break;  // remaining chunks: no entries, segments up to S
    const int64_t sg = e.seg[b];
    // Walk back to the first entry of segment sg, never past the previous cut.
    int64_t first = b;
    for (int64_t j = b - 1; j >= el[t - 1]; --j) {
      if (!e.Valid(j)) continue;
      if (e.seg[j] != sg) break;
      first = j;
    }
    sl[t] = std::max(sg, sl[t - 1]);
    el[t] = first;
  }
  // Chunks after a `break` keep (S, N): empty, and the last real chunk zeroes
  // segments up to S.
}

// Runs fn(entry_begin, entry_end, segment_begin, segment_end) over the chunks of
// SplitSorted, in parallel; for sorted entries each chunk owns whole output rows.
template <typename Fn>
void ForEachSortedChunk(const Entries& e, Fn&& fn) {
  const int nt = ThreadsFor(e.n);
  const int nc = nt > 1 ? nt * kChunksPerThread : 1;
  std::vector<int64_t> seg_lo, ent_lo;
  SplitSorted(e, nc, &seg_lo, &ent_lo);
  ParallelChunks(nt, nc, [&](int64_t t) {
    fn(ent_lo[t], ent_lo[t + 1], seg_lo[t], seg_lo[t + 1]);
  });
}

// Rows prefetched ahead (~16 x 4 cache lines in flight per thread for D=64 f32).
constexpr int kPrefetchDist = 16;

// ---------------------------------------------------------------------------
// spmm
// ---------------------------------------------------------------------------

template <typename T>
SJ_INLINE void Axpy(float* SJ_RESTRICT acc, const T* SJ_RESTRICT row, float v, int64_t d) {
  for (int64_t j = 0; j < d; ++j) acc[j] += v * Load(row, j);
}

template <typename T>
SJ_INLINE void StoreRow(T* SJ_RESTRICT out, const float* SJ_RESTRICT acc, int64_t d) {
  for (int64_t j = 0; j < d; ++j) Store(out, j, acc[j]);
}

template <typename T>
void ZeroRows(T* out, int64_t s_begin, int64_t s_end, int64_t d) {
  if (s_end > s_begin) std::memset(out + s_begin * d, 0, sizeof(T) * (s_end - s_begin) * d);
}

// Prefetches row c of dense [K, d] if 0 <= c < K (negative ids wrap: invalid): one
// prefetch per 64 bytes from the row start, plus the row's last byte when rows are
// not 64-byte aligned. Unlike PrefetchBytes, no per-row alignment arithmetic or
// variable trip count: with a compile-time d this is a few straight-line prefetches.
// (A function, not a lambda: with a lambda here GCC 12 emitted no prefetches at all.)
template <typename T>
SJ_INLINE void PrefetchRow(const T* dense, int64_t d, int32_t c, uint32_t k_rows,
                           bool aligned) {
  if (static_cast<uint32_t>(c) >= k_rows) return;
  const char* row = reinterpret_cast<const char*>(dense + static_cast<int64_t>(c) * d);
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
  if (!aligned) __builtin_prefetch(row + row_bytes - 1, 0, 3);
}

// Rows the spmm gather prefetches ahead: ~12 KiB of rows, 16 to 64 rows. For D=64
// f32, 48 rows measured best on AMD EPYC (16 rows reached ~2/3 of the bandwidth).
template <typename T>
constexpr int64_t SpmmPrefetchRows(int64_t d) {
  const int64_t rows = (int64_t{12} << 10) / std::max<int64_t>(d * sizeof(T), 1);
  return std::min<int64_t>(64, std::max<int64_t>(16, rows));
}

// Sorted fast path over one chunk: entries [k_begin, k_end) own output rows
// [s_begin, s_end); every row of the range is written (empty ones zeroed), each
// exactly once. Returns false, leaving rows half written, if a valid entry is out of
// order or outside [s_begin, s_end): the caller then takes the unsorted path. So no
// separate sortedness pass is needed: chunks with disjoint ascending row ranges that
// all pass are sorted as a whole.
// kD > 0: the row width is a compile-time constant, so the accumulator lives in
// registers and the row loop is fully unrolled. kUnit: all values are 1 (no values
// buffer; adding the row is bit-identical to an FMA with 1).
template <typename T, int kD, bool kUnit>
SJ_INLINE bool SpmmSortedRangeBody(const Entries& e, const T* SJ_RESTRICT dense,
                                   T* SJ_RESTRICT out, int64_t d_runtime, int64_t k_begin,
                                   int64_t k_end, int64_t s_begin, int64_t s_end) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  float fixed_acc[kD > 0 ? kD : 1];
  std::vector<float> acc_buf(kD > 0 ? 0 : std::max<int64_t>(d, 1));
  float* SJ_RESTRICT acc = kD > 0 ? fixed_acc : acc_buf.data();
  const int32_t* SJ_RESTRICT col = e.col;
  const int32_t* SJ_RESTRICT seg = e.seg;
  const float* SJ_RESTRICT val = e.values;
  // Negative ids wrap to large unsigned values: one compare each checks validity.
  const uint32_t k_rows = static_cast<uint32_t>(e.k), n_seg = static_cast<uint32_t>(e.s);
  const int64_t dist = SpmmPrefetchRows<T>(d);
  const bool aligned = (reinterpret_cast<uintptr_t>(dense) | (d * sizeof(T))) % 64 == 0;
  for (int64_t p = k_begin; p < std::min<int64_t>(k_end, k_begin + dist); ++p) {
    PrefetchRow(dense, d, col[p], k_rows, aligned);
  }
  int64_t next_zero = s_begin;  // rows [s_begin, next_zero) are written
  int64_t i = k_begin;
  for (;;) {
    uint32_t g = 0;  // the segment of the next valid entry
    for (; i < k_end; ++i) {
      if (i + dist < k_end) PrefetchRow(dense, d, col[i + dist], k_rows, aligned);
      g = static_cast<uint32_t>(seg[i]);
      if (static_cast<uint32_t>(col[i]) < k_rows && g < n_seg) break;
    }
    if (i == k_end) break;
    if (g < next_zero || g >= s_end) return false;
    ZeroRows(out, next_zero, g, d);
    for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
    for (; i < k_end; ++i) {
      if (i + dist < k_end) PrefetchRow(dense, d, col[i + dist], k_rows, aligned);
      const uint32_t c = static_cast<uint32_t>(col[i]), s = static_cast<uint32_t>(seg[i]);
      if (c >= k_rows || s >= n_seg) continue;
      if (s != g) break;
      Axpy(acc, dense + static_cast<int64_t>(c) * d, kUnit ? 1.0f : val[i], d);
    }
    StoreRow(out + static_cast<int64_t>(g) * d, acc, d);
    next_zero = g + 1;
  }
  ZeroRows(out, next_zero, s_end, d);
  return true;
}

template <typename T, bool kUnit>
SJ_INLINE bool SpmmSortedRangeAnyD(const Entries& e, const T* dense, T* out, int64_t d,
                                   int64_t k_begin, int64_t k_end, int64_t s_begin,
                                   int64_t s_end) {
#define SJ_SPMM_BODY(KD) \
  SpmmSortedRangeBody<T, KD, kUnit>(e, dense, out, d, k_begin, k_end, s_begin, s_end)
  switch (d) {
    case 16: return SJ_SPMM_BODY(16);
    case 32: return SJ_SPMM_BODY(32);
    case 64: return SJ_SPMM_BODY(64);
    case 128: return SJ_SPMM_BODY(128);
    default: return SJ_SPMM_BODY(0);
  }
#undef SJ_SPMM_BODY
}

// The gather loop is compiled twice: a copy for AVX2+FMA machines, picked at run
// time, and the portable (SSE2) baseline. Each copy is deterministic on its own;
// they may differ by an ulp (FMA).
#if defined(__x86_64__) && defined(__GNUC__)
template <typename T, bool kUnit>
__attribute__((target("avx2,fma"))) bool SpmmSortedRangeAvx2(
    const Entries& e, const T* dense, T* out, int64_t d, int64_t k_begin, int64_t k_end,
    int64_t s_begin, int64_t s_end) {
  return SpmmSortedRangeAnyD<T, kUnit>(e, dense, out, d, k_begin, k_end, s_begin, s_end);
}

bool HasAvx2Fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         EnvInt("SPARSEJAX_CPU_BASELINE_ISA", 0) == 0;
  return ok;
}
#endif

template <typename T, bool kUnit>
bool SpmmSortedRange(const Entries& e, const T* dense, T* out, int64_t d, int64_t k_begin,
                     int64_t k_end, int64_t s_begin, int64_t s_end) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (HasAvx2Fma()) {
    return SpmmSortedRangeAvx2<T, kUnit>(e, dense, out, d, k_begin, k_end, s_begin, s_end);
  }
#endif
  return SpmmSortedRangeAnyD<T, kUnit>(e, dense, out, d, k_begin, k_end, s_begin, s_end);
}

template <typename T>
void SpmmImpl(const Entries& e, const T* dense, T* out, int64_t d) {
  if (e.s == 0 || d == 0) return;
  std::atomic<bool> sorted{true};
  ForEachSortedChunk(e, [&](int64_t k0, int64_t k1, int64_t s0, int64_t s1) {
    const bool ok = e.values == nullptr
                        ? SpmmSortedRange<T, true>(e, dense, out, d, k0, k1, s0, s1)
                        : SpmmSortedRange<T, false>(e, dense, out, d, k0, k1, s0, s1);
    if (!ok) sorted.store(false, std::memory_order_relaxed);
  });
  if (sorted.load(std::memory_order_relaxed)) return;
  // Unsorted: single-threaded scatter-accumulate in f32, from scratch.
  std::vector<float> tmp;
  float* acc;
  if constexpr (std::is_same_v<T, float>) {
    acc = out;
  } else {
    tmp.resize(e.s * d);
    acc = tmp.data();
  }
  std::memset(acc, 0, sizeof(float) * e.s * d);
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < e.n; ++i) {
    const int64_t p = i + kPrefetchDist;
    if (p < e.n) {
      const int64_t c = e.col[p];
      if (c >= 0 && c < e.k) PrefetchBytes<0>(dense + c * d, row_bytes);
    }
    if (!e.Valid(i)) continue;
    Axpy(acc + e.seg[i] * d, dense + e.col[i] * d, e.Value(i), d);
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t j = 0; j < e.s * d; ++j) Store(out, j, acc[j]);
  }
}

// Validates the (values, col_ids, segment_ids, dense) inputs and an output. With
// unit_values_ok, values may also be f32[0]: every value is 1.
ffi::Error CheckSpmmArgs(const char* name, ffi::AnyBuffer values, ffi::AnyBuffer col,
                         ffi::AnyBuffer seg, ffi::AnyBuffer dense, ffi::AnyBuffer out,
                         bool unit_values_ok = false) {
  auto vd = values.dimensions(), cd = col.dimensions(), sd = seg.dimensions();
  auto dd = dense.dimensions(), od = out.dimensions();
  if (values.element_type() != ffi::DataType::F32 || col.element_type() != ffi::DataType::S32 ||
      seg.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": values must be f32, col_ids/segment_ids int32");
  }
  if (vd.size() != 1 || cd.size() != 1 || sd.size() != 1 || sd[0] != cd[0] ||
      (vd[0] != cd[0] && !(unit_values_ok && vd[0] == 0))) {
    return ffi::Error::InvalidArgument(std::string(name) + ": values/col_ids/segment_ids must be "
                                       "rank-1 of equal length, got " + ShapeStr(vd) + " " +
                                       ShapeStr(cd) + " " + ShapeStr(sd));
  }
  if (!IsFloat(dense.element_type()) || out.element_type() != dense.element_type()) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": dense must be f32 or bf16 and match the output dtype");
  }
  if (dd.size() != 2 || od.size() != 2 || od[1] != dd[1]) {
    return ffi::Error::InvalidArgument(std::string(name) + ": dense must be [K,D] and out [S,D], "
                                       "got " + ShapeStr(dd) + " " + ShapeStr(od));
  }
  return ffi::Error::Success();
}

ffi::Error SpmmImplHandler(ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                           ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out) {
  ffi::Error err = CheckSpmmArgs("sparsejax_spmm", values, col, seg, dense, *out,
                                 /*unit_values_ok=*/true);
  if (err.failure()) return err;
  const int64_t n = col.dimensions()[0];
  Entries e{values.dimensions()[0] == n ? reinterpret_cast<const float*>(values.untyped_data())
                                        : nullptr,
            reinterpret_cast<const int32_t*>(col.untyped_data()),
            reinterpret_cast<const int32_t*>(seg.untyped_data()), n, dense.dimensions()[0],
            out->dimensions()[0]};
  const int64_t d = dense.dimensions()[1];
  AdviseHugePages(dense.untyped_data(), static_cast<int64_t>(dense.size_bytes()));
  if (dense.element_type() == ffi::DataType::F32) {
    SpmmImpl<float>(e, reinterpret_cast<const float*>(dense.untyped_data()),
                    reinterpret_cast<float*>(out->untyped_data()), d);
  } else {
    SpmmImpl<bf16_t>(e, reinterpret_cast<const bf16_t*>(dense.untyped_data()),
                     reinterpret_cast<bf16_t*>(out->untyped_data()), d);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// segment_max
// ---------------------------------------------------------------------------

// Update (acc, arg) with products v*row; NaN wins over non-NaN, ties keep the
// earlier (smaller) k because entries arrive in ascending k.
template <typename T>
SJ_INLINE void MaxUpdate(float* SJ_RESTRICT acc, int32_t* SJ_RESTRICT arg,
                         const T* SJ_RESTRICT row, float v, int32_t k, int64_t d) {
  for (int64_t j = 0; j < d; ++j) {
    const float p = v * Load(row, j);
    const float a = acc[j];
    const bool take = (p > a) | ((p != p) & (a == a));  // branch-free: vectorizes
    acc[j] = take ? p : a;
    arg[j] = take ? k : arg[j];
  }
}

template <typename T>
SJ_INLINE void MaxInit(float* SJ_RESTRICT acc, int32_t* SJ_RESTRICT arg,
                       const T* SJ_RESTRICT row, float v, int32_t k, int64_t d) {
  for (int64_t j = 0; j < d; ++j) {
    acc[j] = v * Load(row, j);
    arg[j] = k;
  }
}

template <typename T>
void EmptyMaxRows(T* out, int32_t* arg, int64_t s_begin, int64_t s_end, int64_t d) {
  if (s_end <= s_begin) return;
  ZeroRows(out, s_begin, s_end, d);
  std::fill(arg + s_begin * d, arg + s_end * d, int32_t{-1});
}

template <typename T>
void SegMaxSortedRange(const Entries& e, const T* SJ_RESTRICT dense, T* SJ_RESTRICT out,
                       int32_t* SJ_RESTRICT arg, int64_t d, int64_t k_begin, int64_t k_end,
                       int64_t s_begin, int64_t s_end) {
  std::vector<float> acc_buf(std::max<int64_t>(d, 1));
  float* SJ_RESTRICT acc = acc_buf.data();
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  int64_t cur = -1, next_empty = s_begin;
  for (int64_t p = k_begin; p < std::min<int64_t>(k_end, k_begin + kPrefetchDist); ++p) {
    const int64_t c = e.col[p];
    if (c >= 0 && c < e.k) PrefetchBytes<0>(dense + c * d, row_bytes);
  }
  for (int64_t i = k_begin; i < k_end; ++i) {
    const int64_t p = i + kPrefetchDist;
    if (p < k_end) {
      const int64_t c = e.col[p];
      if (c >= 0 && c < e.k) PrefetchBytes<0>(dense + c * d, row_bytes);
    }
    if (!e.Valid(i)) continue;
    const int64_t s = e.seg[i];
    if (s < s_begin || s >= s_end) continue;  // cannot happen for sorted input
    const T* row = dense + e.col[i] * d;
    if (s != cur) {
      if (cur >= 0) StoreRow(out + cur * d, acc, d);
      EmptyMaxRows(out, arg, next_empty, s, d);
      next_empty = s + 1;
      cur = s;
      MaxInit(acc, arg + s * d, row, e.values[i], static_cast<int32_t>(i), d);
    } else {
      MaxUpdate(acc, arg + s * d, row, e.values[i], static_cast<int32_t>(i), d);
    }
  }
  if (cur >= 0) StoreRow(out + cur * d, acc, d);
  EmptyMaxRows(out, arg, next_empty, s_end, d);
}

template <typename T>
void SegMaxImpl(const Entries& e, const T* dense, T* out, int32_t* arg, int64_t d) {
  if (e.s == 0 || d == 0) return;
  if (SortedBySegment(e)) {
    ForEachSortedChunk(e, [&](int64_t k0, int64_t k1, int64_t s0, int64_t s1) {
      SegMaxSortedRange<T>(e, dense, out, arg, d, k0, k1, s0, s1);
    });
    return;
  }
  std::vector<float> acc(e.s * d, 0.0f);
  std::fill(arg, arg + e.s * d, int32_t{-1});
  for (int64_t i = 0; i < e.n; ++i) {
    if (!e.Valid(i)) continue;
    const int64_t s = e.seg[i];
    const T* row = dense + e.col[i] * d;
    if (arg[s * d] < 0) {
      MaxInit(acc.data() + s * d, arg + s * d, row, e.values[i], static_cast<int32_t>(i), d);
    } else {
      MaxUpdate(acc.data() + s * d, arg + s * d, row, e.values[i], static_cast<int32_t>(i), d);
    }
  }
  for (int64_t j = 0; j < e.s * d; ++j) Store(out, j, acc[j]);
}

ffi::Error SegMaxImplHandler(ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                             ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> argk) {
  ffi::Error err = CheckSpmmArgs("sparsejax_segment_max", values, col, seg, dense, *out);
  if (err.failure()) return err;
  if (argk->element_type() != ffi::DataType::S32 || argk->dimensions().size() != 2 ||
      argk->dimensions()[0] != out->dimensions()[0] ||
      argk->dimensions()[1] != out->dimensions()[1]) {
    return ffi::Error::InvalidArgument("sparsejax_segment_max: argk must be int32 [S,D]");
  }
  if (values.dimensions()[0] > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument("sparsejax_segment_max: too many entries for int32 argk");
  }
  Entries e{reinterpret_cast<const float*>(values.untyped_data()),
            reinterpret_cast<const int32_t*>(col.untyped_data()),
            reinterpret_cast<const int32_t*>(seg.untyped_data()), values.dimensions()[0],
            dense.dimensions()[0], out->dimensions()[0]};
  const int64_t d = dense.dimensions()[1];
  AdviseHugePages(dense.untyped_data(), static_cast<int64_t>(dense.size_bytes()));
  int32_t* arg = reinterpret_cast<int32_t*>(argk->untyped_data());
  if (dense.element_type() == ffi::DataType::F32) {
    SegMaxImpl<float>(e, reinterpret_cast<const float*>(dense.untyped_data()),
                      reinterpret_cast<float*>(out->untyped_data()), arg, d);
  } else {
    SegMaxImpl<bf16_t>(e, reinterpret_cast<const bf16_t*>(dense.untyped_data()),
                       reinterpret_cast<bf16_t*>(out->untyped_data()), arg, d);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// sparse_apply
// ---------------------------------------------------------------------------

enum OptCode : int32_t {
  kSGD = 0,
  kAdagrad = 1,
  kRowWiseAdagrad = 2,
  kLazyAdam = 3,
  kFTRL = 4,
  kAdagradDecay = 5,
};

constexpr int kNumSlots[] = {0, 1, 1, 2, 2, 2};

// Stable LSD radix sort of keys (id << 32 | k) on bits [32, 32 + id_bits).
// Returns a pointer to whichever buffer holds the result.
uint64_t* RadixSortById(uint64_t* a, uint64_t* b, int64_t n, int id_bits) {
  if (id_bits <= 0 || n <= 1) return a;
  const int passes = (id_bits + 10) / 11;
  const int digit = (id_bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << digit) - 1;
  std::vector<int64_t> hist(static_cast<size_t>(passes) << digit, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t id = a[i] >> 32;
    for (int p = 0; p < passes; ++p) {
      ++hist[(static_cast<size_t>(p) << digit) + ((id >> (p * digit)) & mask)];
    }
  }
  for (int p = 0; p < passes; ++p) {
    int64_t* h = hist.data() + (static_cast<size_t>(p) << digit);
    // Skip passes where every key has the same digit.
    const uint64_t d0 = ((a[0] >> 32) >> (p * digit)) & mask;
    if (h[d0] == n) continue;
    int64_t sum = 0;
    for (uint64_t j = 0; j <= mask; ++j) {
      const int64_t c = h[j];
      h[j] = sum;
      sum += c;
    }
    const int shift = 32 + p * digit;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t key = a[i];
      b[h[(key >> shift) & mask]++] = key;
    }
    std::swap(a, b);
  }
  return a;
}

struct ApplyCtx {
  int32_t opt;
  int64_t v, d, s;
  void* table;
  bool bf16;
  float* slot_f[2];   // per-element [V,D] or per-row [V] f32 slots
  int32_t* slot_i;    // AdagradDecay decay_power
  const int32_t* seg;
  const float* coef;
  const float* grad;  // [S, D]
  float hp[8];
  int32_t step;
};

SJ_INLINE float NanMax(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

SJ_INLINE float Sign(float z) {  // jnp.sign: +-1, +-0 for +-0, NaN for NaN
  const float pos = z > 0.0f ? 1.0f : z;
  return z < 0.0f ? -1.0f : pos;
}

// XLA-style f32 -> s32 conversion (saturating, NaN -> 0).
SJ_INLINE int32_t F32ToS32(float x) {
  if (x != x) return 0;
  if (x >= 2147483648.0f) return std::numeric_limits<int32_t>::max();
  if (x <= -2147483648.0f) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(x);
}

// jnp.floor_divide on int32, without UB for the degenerate divisors.
SJ_INLINE int32_t FloorDiv(int32_t a, int32_t b) {
  if (b == 0) return 0;  // unspecified (AdagradDecay validates decay_step >= 1)
  if (b == -1) return static_cast<int32_t>(0u - static_cast<uint32_t>(a));
  int32_t q = a / b, r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) --q;
  return q;
}

// sum(g*g) with 8 interleaved partial sums (vectorizes; a sequential f32 chain
// costs ~4 cycles per element). XLA's reduction order differs anyway.
SJ_INLINE float SumSquares(const float* SJ_RESTRICT g, int64_t d) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    for (int l = 0; l < 8; ++l) part[l] += g[j + l] * g[j + l];
  }
  for (int l = 0; j < d; ++j, ++l) part[l] += g[j] * g[j];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// Applies the optimizer to one row `w` (f32, length d) with gradient g.
// Mirrors update_rows() of sparsejax/ops/optimizers.py; keep them in sync.
SJ_INLINE void UpdateRow(const ApplyCtx& c, int64_t r, float* SJ_RESTRICT w,
                         const float* SJ_RESTRICT g, float adam_bc1, float adam_bc2,
                         int32_t period) {
  const int64_t d = c.d;
  const float lr = c.hp[0];
  switch (c.opt) {
    case kSGD: {
      for (int64_t j = 0; j < d; ++j) w[j] = w[j] - lr * g[j];
      break;
    }
    case kAdagrad: {
      const float eps = c.hp[1];
      float* SJ_RESTRICT acc = c.slot_f[0] + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float a = acc[j] + g[j] * g[j];
        const float rs = 1.0f / std::sqrt(a + eps);  // computed unconditionally: vectorizes
        const float scale = a > 0.0f ? rs : 0.0f;
        w[j] = w[j] - lr * scale * g[j];
        acc[j] = a;
      }
      break;
    }
    case kRowWiseAdagrad: {
      const float eps = c.hp[1];
      const float sq = SumSquares(g, d);
      const float a = c.slot_f[0][r] + sq / static_cast<float>(d);
      const float mult = lr / (std::sqrt(a) + eps);
      for (int64_t j = 0; j < d; ++j) w[j] = w[j] - mult * g[j];
      c.slot_f[0][r] = a;
      break;
    }
    case kLazyAdam: {
      const float b1 = c.hp[1], b2 = c.hp[2], eps = c.hp[3];
      float* SJ_RESTRICT mu = c.slot_f[0] + r * d;
      float* SJ_RESTRICT nu = c.slot_f[1] + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float m = b1 * mu[j] + (1.0f - b1) * g[j];
        const float n = b2 * nu[j] + (1.0f - b2) * (g[j] * g[j]);
        const float m_hat = m / adam_bc1;
        const float n_hat = n / adam_bc2;
        w[j] = w[j] - lr * m_hat / (std::sqrt(n_hat) + eps);
        mu[j] = m;
        nu[j] = n;
      }
      break;
    }
    case kFTRL: {
      const float l1 = c.hp[1], l2 = c.hp[2], beta = c.hp[3];
      float* SJ_RESTRICT acc = c.slot_f[0] + r * d;
      float* SJ_RESTRICT lin = c.slot_f[1] + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float n = acc[j];
        const float n_new = n + g[j] * g[j];
        const float sigma = (std::sqrt(n_new) - std::sqrt(n)) / lr;
        const float z = lin[j] + g[j] - sigma * w[j];
        const float quadratic = (beta + std::sqrt(n_new)) / lr + 2.0f * l2;
        const float shrunk = (Sign(z) * l1 - z) / quadratic;  // unconditional: vectorizes
        w[j] = std::fabs(z) > l1 ? shrunk : 0.0f;
        acc[j] = n_new;
        lin[j] = z;
      }
      break;
    }
    case kAdagradDecay: {
      const float rate = c.hp[1], baseline = c.hp[2];
      float* SJ_RESTRICT acc = c.slot_f[0] + r * d;
      const int32_t power = c.slot_i[r];
      const int32_t diff =
          static_cast<int32_t>(static_cast<uint32_t>(period) - static_cast<uint32_t>(power));
      const float elapsed = static_cast<float>(diff);
      const bool decay = elapsed > 0.0f;
      const float factor = std::pow(rate, elapsed);
      for (int64_t j = 0; j < d; ++j) {
        float a = acc[j];
        if (decay) a = NanMax(a * factor, baseline);
        a = a + g[j] * g[j];
        w[j] = w[j] - lr * g[j] * (1.0f / std::sqrt(a));
        acc[j] = a;
      }
      c.slot_i[r] = std::max(power, period);
      break;
    }
    default:
      break;
  }
}

SJ_INLINE void PrefetchRowState(const ApplyCtx& c, int64_t r) {
  const int64_t d = c.d;
  const int64_t esz = c.bf16 ? 2 : 4;
  PrefetchBytes<1>(static_cast<char*>(c.table) + r * d * esz, d * esz);
  switch (c.opt) {
    case kAdagrad:
    case kLazyAdam:
    case kFTRL:
    case kAdagradDecay:
      PrefetchBytes<1>(c.slot_f[0] + r * d, d * 4);
      break;
    case kRowWiseAdagrad:
      __builtin_prefetch(c.slot_f[0] + r, 1, 3);
      break;
    default:
      break;
  }
  if (c.opt == kLazyAdam || c.opt == kFTRL) PrefetchBytes<1>(c.slot_f[1] + r * d, d * 4);
  if (c.opt == kAdagradDecay) __builtin_prefetch(c.slot_i + r, 1, 3);
}

// Unique rows prefetched ahead in sparse_apply (table row + slot rows, for write).
constexpr int kApplyPrefetchRuns = 16;

// Processes unique runs [run_begin, run_end): keys[run_start[i] .. run_start[i+1]).
void ApplyRuns(const ApplyCtx& c, const uint64_t* keys, const int64_t* run_start,
               int64_t run_begin, int64_t run_end) {
  const int64_t d = c.d;
  std::vector<float> buf(2 * std::max<int64_t>(d, 1));
  float* SJ_RESTRICT g = buf.data();
  float* SJ_RESTRICT wbuf = buf.data() + std::max<int64_t>(d, 1);
  float bc1 = 1.0f, bc2 = 1.0f;
  if (c.opt == kLazyAdam) {
    const float t = static_cast<float>(c.step);
    bc1 = 1.0f - std::pow(c.hp[1], t);
    bc2 = 1.0f - std::pow(c.hp[2], t);
  }
  const int32_t period = c.opt == kAdagradDecay ? FloorDiv(c.step, F32ToS32(c.hp[3])) : 0;
  for (int64_t i = run_begin; i < std::min(run_end, run_begin + kApplyPrefetchRuns); ++i) {
    PrefetchRowState(c, static_cast<int64_t>(keys[run_start[i]] >> 32));
  }
  for (int64_t i = run_begin; i < run_end; ++i) {
    if (i + kApplyPrefetchRuns < run_end) {
      PrefetchRowState(c, static_cast<int64_t>(keys[run_start[i + kApplyPrefetchRuns]] >> 32));
    }
    const int64_t r = static_cast<int64_t>(keys[run_start[i]] >> 32);
    for (int64_t j = 0; j < d; ++j) g[j] = 0.0f;
    for (int64_t e = run_start[i]; e < run_start[i + 1]; ++e) {
      const int64_t k = static_cast<int64_t>(keys[e] & 0xffffffffu);
      const float cf = c.coef[k];
      const float* SJ_RESTRICT gr = c.grad + static_cast<int64_t>(c.seg[k]) * d;
      for (int64_t j = 0; j < d; ++j) g[j] += cf * gr[j];
    }
    if (c.bf16) {
      bf16_t* row = static_cast<bf16_t*>(c.table) + r * d;
      for (int64_t j = 0; j < d; ++j) wbuf[j] = Bf16ToF32(row[j]);
      UpdateRow(c, r, wbuf, g, bc1, bc2, period);
      for (int64_t j = 0; j < d; ++j) row[j] = F32ToBf16(wbuf[j]);
    } else {
      UpdateRow(c, r, static_cast<float*>(c.table) + r * d, g, bc1, bc2, period);
    }
  }
}

ffi::Error SparseApplyImplHandler(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                  int32_t optimizer) {
  const char* kName = "sparsejax_sparse_apply: ";
  if (optimizer < 0 || optimizer > 5) {
    return ffi::Error::InvalidArgument(std::string(kName) + "unknown optimizer code " +
                                       std::to_string(optimizer));
  }
  const int64_t m = kNumSlots[optimizer];
  if (static_cast<int64_t>(args.size()) != m + 7 || static_cast<int64_t>(rets.size()) != m + 1) {
    return ffi::Error::InvalidArgument(
        std::string(kName) + "optimizer " + std::to_string(optimizer) + " expects " +
        std::to_string(m) + " slots: " + std::to_string(m + 7) + " inputs and " +
        std::to_string(m + 1) + " outputs, got " + std::to_string(args.size()) + " and " +
        std::to_string(rets.size()));
  }
  std::vector<ffi::AnyBuffer> in, out;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(std::string(kName) + "bad input");
    in.push_back(*b);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Error::InvalidArgument(std::string(kName) + "bad output");
    out.push_back(**b);
  }
  ffi::AnyBuffer table = in[0];
  ffi::AnyBuffer ids = in[m + 1], seg = in[m + 2], coef = in[m + 3], grad = in[m + 4],
                 hparams = in[m + 5], step = in[m + 6];
  auto td = table.dimensions();
  if (td.size() != 2 || !IsFloat(table.element_type())) {
    return ffi::Error::InvalidArgument(std::string(kName) + "table must be f32/bf16 [V,D], got " +
                                       ShapeStr(td));
  }
  const int64_t v = td[0], d = td[1];
  for (int64_t i = 0; i <= m; ++i) {
    // Output i aliases input i: same dtype and shape.
    if (out[i].element_type() != in[i].element_type() ||
        ShapeStr(out[i].dimensions()) != ShapeStr(in[i].dimensions())) {
      return ffi::Error::InvalidArgument(std::string(kName) + "output " + std::to_string(i) +
                                         " must match input " + std::to_string(i));
    }
  }
  for (int64_t i = 1; i <= m; ++i) {
    const bool per_row = optimizer == kRowWiseAdagrad || (optimizer == kAdagradDecay && i == 2);
    const ffi::DataType want =
        (optimizer == kAdagradDecay && i == 2) ? ffi::DataType::S32 : ffi::DataType::F32;
    auto sd = in[i].dimensions();
    const bool ok = in[i].element_type() == want &&
                    (per_row ? (sd.size() == 1 && sd[0] == v)
                             : (sd.size() == 2 && sd[0] == v && sd[1] == d));
    if (!ok) {
      return ffi::Error::InvalidArgument(std::string(kName) + "slot " + std::to_string(i - 1) +
                                         " has wrong dtype/shape " + ShapeStr(sd));
    }
  }
  auto nd = ids.dimensions();
  if (ids.element_type() != ffi::DataType::S32 || seg.element_type() != ffi::DataType::S32 ||
      coef.element_type() != ffi::DataType::F32 || nd.size() != 1 ||
      seg.dimensions().size() != 1 || coef.dimensions().size() != 1 ||
      seg.dimensions()[0] != nd[0] || coef.dimensions()[0] != nd[0]) {
    return ffi::Error::InvalidArgument(std::string(kName) +
                                       "ids/segment_ids int32 [N], coef f32 [N] required");
  }
  auto gd = grad.dimensions();
  if (grad.element_type() != ffi::DataType::F32 || gd.size() != 2 || gd[1] != d) {
    return ffi::Error::InvalidArgument(std::string(kName) + "grad must be f32 [S," +
                                       std::to_string(d) + "], got " + ShapeStr(gd));
  }
  if (hparams.element_type() != ffi::DataType::F32 || hparams.element_count() < 8 ||
      step.element_type() != ffi::DataType::S32 || step.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(kName) +
                                       "hparams must be f32[8] and step an int32 scalar");
  }
  const int64_t n = nd[0];
  if (n > std::numeric_limits<uint32_t>::max() || v > std::numeric_limits<uint32_t>::max()) {
    return ffi::Error::InvalidArgument(std::string(kName) + "too many entries or rows");
  }

  // Outputs alias inputs (input_output_aliases). If XLA ever hands us distinct
  // buffers, copy the state first so untouched rows are preserved.
  for (int64_t i = 0; i <= m; ++i) {
    if (out[i].untyped_data() != in[i].untyped_data() && in[i].size_bytes() > 0) {
      std::memcpy(out[i].untyped_data(), in[i].untyped_data(), in[i].size_bytes());
    }
  }

  for (const ffi::AnyBuffer& b : out) {
    AdviseHugePages(b.untyped_data(), static_cast<int64_t>(b.size_bytes()));
  }
  ApplyCtx c{};
  c.opt = optimizer;
  c.v = v;
  c.d = d;
  c.s = gd[0];
  c.table = out[0].untyped_data();
  c.bf16 = table.element_type() == ffi::DataType::BF16;
  c.slot_f[0] = c.slot_f[1] = nullptr;
  c.slot_i = nullptr;
  if (m >= 1) c.slot_f[0] = reinterpret_cast<float*>(out[1].untyped_data());
  if (m >= 2) {
    if (optimizer == kAdagradDecay) {
      c.slot_i = reinterpret_cast<int32_t*>(out[2].untyped_data());
    } else {
      c.slot_f[1] = reinterpret_cast<float*>(out[2].untyped_data());
    }
  }
  c.seg = reinterpret_cast<const int32_t*>(seg.untyped_data());
  c.coef = reinterpret_cast<const float*>(coef.untyped_data());
  c.grad = reinterpret_cast<const float*>(grad.untyped_data());
  std::memcpy(c.hp, hparams.untyped_data(), sizeof(c.hp));
  c.step = *reinterpret_cast<const int32_t*>(step.untyped_data());
  if (n == 0 || v == 0) return ffi::Error::Success();

  // 1. Valid entries as (id << 32 | k), ascending k.
  const int32_t* id_p = reinterpret_cast<const int32_t*>(ids.untyped_data());
  std::unique_ptr<uint64_t[]> keys(new uint64_t[n]), tmp(new uint64_t[n]);
  int64_t nv = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t id = id_p[k], sg = c.seg[k];
    if (id >= 0 && id < v && sg >= 0 && sg < c.s) {
      keys[nv++] = (static_cast<uint64_t>(id) << 32) | static_cast<uint64_t>(k);
    }
  }
  if (nv == 0) return ffi::Error::Success();

  // 2. Stable radix sort by id on ceil(log2 V) bits.
  int id_bits = 0;
  while (id_bits < 32 && (uint64_t{1} << id_bits) < static_cast<uint64_t>(v)) ++id_bits;
  const uint64_t* sorted = RadixSortById(keys.get(), tmp.get(), nv, id_bits);

  // 3. Run-length encode.
  std::vector<int64_t> run_start;
  run_start.reserve(static_cast<size_t>(nv) + 1);
  run_start.push_back(0);
  for (int64_t i = 1; i < nv; ++i) {
    if ((sorted[i] >> 32) != (sorted[i - 1] >> 32)) run_start.push_back(i);
  }
  const int64_t runs = static_cast<int64_t>(run_start.size());
  run_start.push_back(nv);

  // 4. Update unique rows, split over threads at run boundaries by entry count.
  const int nt = ThreadsFor(nv);
  const int nc = nt > 1 ? nt * kChunksPerThread : 1;
  std::vector<int64_t> lo(nc + 1);
  lo[0] = 0;
  lo[nc] = runs;
  for (int t = 1; t < nc; ++t) {
    const int64_t target = nv * t / nc;
    lo[t] = std::upper_bound(run_start.begin(), run_start.begin() + runs, target) -
            run_start.begin() - 1;
    lo[t] = std::max(lo[t], lo[t - 1]);
  }
  ParallelChunks(nt, nc,
                 [&](int64_t t) { ApplyRuns(c, sorted, run_start.data(), lo[t], lo[t + 1]); });
  return ffi::Error::Success();
}

// No C++ exception (e.g. std::bad_alloc) may cross into XLA.
template <typename Fn>
ffi::Error Guarded(const char* name, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string(name) + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(name) + ": unknown C++ exception");
  }
}

ffi::Error SpmmHandler(ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                       ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out) {
  return Guarded("sparsejax_spmm",
                 [&] { return SpmmImplHandler(values, col, seg, dense, out); });
}

ffi::Error SegMaxHandler(ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                         ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> argk) {
  return Guarded("sparsejax_segment_max",
                 [&] { return SegMaxImplHandler(values, col, seg, dense, out, argk); });
}

ffi::Error SparseApplyHandler(ffi::RemainingArgs args, ffi::RemainingRets rets,
                              int32_t optimizer) {
  return Guarded("sparsejax_sparse_apply",
                 [&] { return SparseApplyImplHandler(args, rets, optimizer); });
}

}  // namespace

namespace sparsejax {

void ParallelRange(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int nt = static_cast<int>(std::min<int64_t>(MaxThreads(), max_chunks));
  const int64_t nchunks = std::min<int64_t>(max_chunks, int64_t{nt} * kChunksPerThread);
  const int64_t per = (n + nchunks - 1) / nchunks;
  ParallelChunks(nt, nchunks, [&](int64_t c) {
    const int64_t b = c * per, e = std::min(n, b + per);
    if (b < e) fn(b, e);
  });
}

bool CpuHasAvx2Fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  return HasAvx2Fma();
#else
  return false;
#endif
}

}  // namespace sparsejax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSpmm, SpmmHandler,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // values f32[N]
                                  .Arg<ffi::AnyBuffer>()   // col_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // segment_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // dense T[K,D]
                                  .Ret<ffi::AnyBuffer>());  // out T[S,D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSegmentMax, SegMaxHandler,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // values f32[N]
                                  .Arg<ffi::AnyBuffer>()   // col_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // segment_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // dense T[K,D]
                                  .Ret<ffi::AnyBuffer>()   // out T[S,D]
                                  .Ret<ffi::AnyBuffer>());  // argk i32[S,D]

// Inputs: table, slots..., ids, segment_ids, coef, grad, hparams, step.
// Outputs (aliased): table, slots...
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSparseApply, SparseApplyHandler,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("optimizer"));

// ---------------------------------------------------------------------------
// CPython module
// ---------------------------------------------------------------------------

namespace {

int AddCapsule(PyObject* dict, const char* name, void* fn) {
  PyObject* cap = PyCapsule_New(fn, nullptr, nullptr);
  if (cap == nullptr) return -1;
  int rc = PyDict_SetItemString(dict, name, cap);
  Py_DECREF(cap);
  return rc;
}

PyObject* Registrations(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  if (AddCapsule(d, "sparsejax_spmm", reinterpret_cast<void*>(&SparsejaxSpmm)) < 0 ||
      AddCapsule(d, "sparsejax_segment_max", reinterpret_cast<void*>(&SparsejaxSegmentMax)) < 0 ||
      AddCapsule(d, "sparsejax_sparse_apply", reinterpret_cast<void*>(&SparsejaxSparseApply)) <
          0 ||
      AddCapsule(d, "sparsejax_pairwise_dots", reinterpret_cast<void*>(&SparsejaxPairwiseDots)) <
          0 ||
      AddCapsule(d, "sparsejax_pairwise_dots_bwd",
                 reinterpret_cast<void*>(&SparsejaxPairwiseDotsBwd)) < 0) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

PyMethodDef kMethods[] = {
    {"registrations", Registrations, METH_NOARGS,
     "Dict {ffi target name: PyCapsule(XLA FFI handler)} for jax.ffi.register_ffi_target."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_cpu_ext",
    "sparsejax XLA FFI CPU kernels (spmm, segment_max, sparse_apply, pairwise_dots).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_ext(void) { return PyModule_Create(&kModule); }
