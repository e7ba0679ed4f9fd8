// spmm and segment_max as XLA FFI handlers (part of `sparsejax._cpu_ext`).
//
// Targets
//   sparsejax_spmm          out[s,:]  = sum_{valid k, seg[k]==s} v[k] * dense[col[k],:]
//                           (values f32[0]: v[k] = 1, no coefficient array needed)
//   sparsejax_segment_max   out[s,d]  = max_{valid k, seg[k]==s} v[k] * dense[col[k],d],
//                           argk[s,d] = smallest k attaining it (-1, out 0 if empty)
//
// Entry k is valid iff 0 <= col[k] < K and 0 <= seg[k] < S. Invalid entries contribute
// nothing and are never dereferenced. Dense dtype: f32 or bf16 (accumulation in f32;
// bf16 results rounded to nearest even). Summation order is always ascending k within
// an output row, so results do not depend on the thread count or on whether the fast
// path ran. Entries sorted by segment are split over the worker pool at segment
// boundaries; unsorted input runs on one thread.
// Tables of 64 MiB or more are advised onto 2 MiB pages (AdviseHugePages).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "worker_pool.h"

namespace sparsejax {
namespace {

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
// kLocality: __builtin_prefetch's (3: into L1, 1: into L2).
template <typename T, int kLocality = 3>
SJ_INLINE void PrefetchRow(const T* dense, int64_t d, int32_t c, uint32_t k_rows,
                           bool aligned) {
  if (static_cast<uint32_t>(c) >= k_rows) return;
  const char* row = reinterpret_cast<const char*>(dense + static_cast<int64_t>(c) * d);
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, kLocality);
  if (!aligned) __builtin_prefetch(row + row_bytes - 1, 0, kLocality);
}


// Rows the spmm gather prefetches ahead into L1: ~12 KiB of rows, 16 to 64 rows. For
// D=64 f32, 48 rows measured best on AMD EPYC (16 rows reached ~2/3 of the bandwidth).
template <typename T>
constexpr int64_t SpmmPrefetchRows(int64_t d) {
  const int64_t rows = (int64_t{12} << 10) / std::max<int64_t>(d * sizeof(T), 1);
  return std::min<int64_t>(64, std::max<int64_t>(16, rows));
}

// Rows prefetched further ahead into L2 only (4x the L1 distance): L1 holds few misses in
// flight, L2 many more, so the far rows are on their way while L1's are being used.
// D=64 f32 on the AMD EPYC VM: 1.06 -> 0.51-0.60 ms a forward of 53k lookups (from 48%
// to 93-100% of the copy bandwidth; experiments/RESULTS.md, issue 26).
template <typename T>
constexpr int64_t SpmmFarRows(int64_t d) {
  return 4 * SpmmPrefetchRows<T>(d);
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
  const int64_t far = SpmmFarRows<T>(d);
  const bool aligned = (reinterpret_cast<uintptr_t>(dense) | (d * sizeof(T))) % 64 == 0;
  for (int64_t p = k_begin; p < std::min<int64_t>(k_end, k_begin + dist); ++p) {
    PrefetchRow(dense, d, col[p], k_rows, aligned);
  }
  for (int64_t p = k_begin + dist; p < std::min<int64_t>(k_end, k_begin + far); ++p) {
    PrefetchRow<T, 1>(dense, d, col[p], k_rows, aligned);
  }
  int64_t next_zero = s_begin;  // rows [s_begin, next_zero) are written
  int64_t i = k_begin;
  for (;;) {
    uint32_t g = 0;  // the segment of the next valid entry
    for (; i < k_end; ++i) {
      if (i + dist < k_end) PrefetchRow(dense, d, col[i + dist], k_rows, aligned);
      if (i + far < k_end) PrefetchRow<T, 1>(dense, d, col[i + far], k_rows, aligned);
      g = static_cast<uint32_t>(seg[i]);
      if (static_cast<uint32_t>(col[i]) < k_rows && g < n_seg) break;
    }
    if (i == k_end) break;
    if (g < next_zero || g >= s_end) return false;
    ZeroRows(out, next_zero, g, d);
    for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
    for (; i < k_end; ++i) {
      if (i + dist < k_end) PrefetchRow(dense, d, col[i + dist], k_rows, aligned);
      if (i + far < k_end) PrefetchRow<T, 1>(dense, d, col[i + far], k_rows, aligned);
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
#if SJ_HAVE_X86
template <typename T, bool kUnit>
__attribute__((target("avx2,fma"))) bool SpmmSortedRangeAvx2(
    const Entries& e, const T* dense, T* out, int64_t d, int64_t k_begin, int64_t k_end,
    int64_t s_begin, int64_t s_end) {
  return SpmmSortedRangeAnyD<T, kUnit>(e, dense, out, d, k_begin, k_end, s_begin, s_end);
}
#endif

template <typename T, bool kUnit>
bool SpmmSortedRange(const Entries& e, const T* dense, T* out, int64_t d, int64_t k_begin,
                     int64_t k_end, int64_t s_begin, int64_t s_end) {
#if SJ_HAVE_X86
  if (CpuHasAvx2Fma()) {
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

ffi::Error SpmmHandler(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                       ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out) {
  return Guarded("sparsejax_spmm", pool,
                 [&] { return SpmmImplHandler(values, col, seg, dense, out); });
}

ffi::Error SegMaxHandler(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::AnyBuffer col, ffi::AnyBuffer seg,
                         ffi::AnyBuffer dense, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> argk) {
  return Guarded("sparsejax_segment_max", pool,
                 [&] { return SegMaxImplHandler(values, col, seg, dense, out, argk); });
}

}  // namespace
}  // namespace sparsejax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSpmm, sparsejax::SpmmHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // values f32[N]
                                  .Arg<ffi::AnyBuffer>()   // col_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // segment_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // dense T[K,D]
                                  .Ret<ffi::AnyBuffer>());  // out T[S,D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSegmentMax, sparsejax::SegMaxHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()   // values f32[N]
                                  .Arg<ffi::AnyBuffer>()   // col_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // segment_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()   // dense T[K,D]
                                  .Ret<ffi::AnyBuffer>()   // out T[S,D]
                                  .Ret<ffi::AnyBuffer>());  // argk i32[S,D]

