// Embedding bags over row-wise quantized tables as an XLA FFI handler (part of
// `sparsejax._cpu_ext`).
//
// Target
//   sparsejax_quantized_bag   (coef f32[N] or f32[0], ids i32[N], seg i32[N], data u8[V,W],
//                             scale f16[V], zero_point u8[V]; attributes bits (8 or 4),
//                             combiner ("sum" or "max")) -> out f32[S,D]
//     row r, column d dequantizes to x = float(scale[r]) * (q[r,d] - zero_point[r]),
//     q one byte each (bits 8, W = D) or a nibble (bits 4, W = ceil(D/2): column 2j in
//     the low nibble of byte j, 2j+1 in the high one);
//     sum: out[s,:] = sum_{valid k, seg[k]==s} coef[k] * x(ids[k],:)   (coef f32[0]: 1)
//     max: out[s,d] = max_{valid k, seg[k]==s} coef[k] * x(ids[k],d)   (NaN wins; 0 if empty)
//
// Entry k is valid iff 0 <= ids[k] < V and 0 <= seg[k] < S; invalid entries contribute
// nothing and are never dereferenced. Codes are decoded in the inner loop (a row of D
// or D/2 bytes, its scale and zero point: three reads per lookup, prefetched ahead).
// Threads: the entries are split over the worker pool in chunks of about equal size
// that start where a bag starts (as spmm.cc does), each bag pooled by one thread in
// ascending k, so results do not depend on the thread count. Valid entries out of bag
// order (found while pooling) run on one thread that scatters.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common.h"
#include "worker_pool.h"

extern "C" XLA_FFI_Error* SparsejaxQuantizedBag(XLA_FFI_CallFrame* call_frame);

namespace sparsejax {
namespace {

// IEEE half (raw bits) to float; exact (subnormal halves are normal floats).
SJ_INLINE float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {  // inf, NaN
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

enum class Pool { kSumUnit, kSum, kMax };

struct Lookups {
  const float* coef;  // nullptr: every coefficient is 1
  const int32_t* ids;
  const int32_t* seg;
  int64_t n;
  uint32_t v, s;  // rows and bags, clamped to 2^31 (ids are int32)

  // Negative ids wrap to large unsigned values: one compare each checks validity.
  SJ_INLINE bool Valid(int64_t k) const {
    return static_cast<uint32_t>(ids[k]) < v && static_cast<uint32_t>(seg[k]) < s;
  }
};

struct Codes {
  const uint8_t* data;  // [V, width]
  const uint16_t* scale;
  const uint8_t* zero_point;
  int64_t width;
};

// Lookups prefetched ahead: each touches three cache lines (codes, scale, zero point)
// or more (rows over 64 bytes). Distances of 16 to 64 measured alike (AMD EPYC, D=16).
constexpr int64_t kPrefetchLookups = 32;

SJ_INLINE void PrefetchLookup(const Lookups& e, const Codes& t, int64_t k) {
  const uint32_t c = static_cast<uint32_t>(e.ids[k]);
  if (c >= e.v) return;
  const uint8_t* row = t.data + static_cast<int64_t>(c) * t.width;
  for (int64_t o = 0; o < t.width; o += 64) __builtin_prefetch(row + o, 0, 3);
  __builtin_prefetch(t.scale + c, 0, 3);
  __builtin_prefetch(t.zero_point + c, 0, 3);
}

// Eight floats: the accumulator block of the vector path (GCC vector extensions, so the
// same code compiles to AVX2 in the AVX2 copy and to SSE2 pairs in the baseline).
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

// *x = codes [j, j + 8) of a row as floats (j a multiple of 8, inside the row). Written
// so that GCC emits vector code: for int4 an AND, a shift and two byte shuffles
// interleave the nibbles; the element-wise widening becomes one vpmovzxbd.
template <int kBits>
SJ_INLINE void LoadCodes8(const uint8_t* q, int64_t j, F8* x) {
  U8x16 b = {};
  if constexpr (kBits == 8) {
    std::memcpy(&b, q + j, 8);
  } else {  // 4 bytes, column 2i in the low nibble of byte i
    std::memcpy(&b, q + j / 2, 4);
    b = __builtin_shufflevector(b & 15, b >> 4, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                                22, 7, 23);
  }
  const I32x8 i = {b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]};
  *x = __builtin_convertvector(i, F8);
}

// Code j of a row as a float.
template <int kBits>
SJ_INLINE float LoadCode1(const uint8_t* q, int64_t j) {
  if constexpr (kBits == 8) return q[j];
  return (q[j >> 1] >> ((j & 1) * 4)) & 15u;
}

// Adds lookup k (valid) to the accumulator of its bag: kBlocks blocks V of columns (0:
// blocks_runtime), V = F8 (8 columns) or float (one); `first`: acc holds nothing yet
// (max pooling only: sum accumulators start at 0). q - z is exact in f32, and so is
// float(scale) * (q - z); "sum" multiplies by coef * scale (one rounding less than the
// XLA path), "max" by coef * (scale * (q - z)) as the XLA path does, so ties are exact.
template <int kBits, Pool kPool, int kBlocks, typename V>
SJ_INLINE void AddLookup(const Lookups& e, const Codes& t, int64_t k, V* SJ_RESTRICT acc,
                         bool first, int64_t blocks_runtime) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  const int64_t blocks = kBlocks > 0 ? kBlocks : blocks_runtime;
  const int64_t c = e.ids[k];
  const uint8_t* q = t.data + c * t.width;
  const float z = static_cast<float>(t.zero_point[c]);
  const float scale = F16ToF32(t.scale[c]);
  const float v = kPool == Pool::kSumUnit ? 1.0f : e.coef[k];
  const float cs = v * scale;
  for (int64_t b = 0; b < blocks; ++b) {
    V x;
    if constexpr (kLanes == 8) {
      LoadCodes8<kBits>(q, b * 8, &x);
    } else {
      x = LoadCode1<kBits>(q, b);
    }
    x -= z;
    if constexpr (kPool == Pool::kMax) {
      const V p = v * (scale * x);
      const V a = acc[b];
      acc[b] = first ? p : ((p > a) | ((p != p) & (a == a))) ? p : a;  // NaN wins
    } else {
      acc[b] += cs * x;
    }
  }
}

// One chunk of entries [k_begin, k_end), which owns bags [s_begin, s_end): writes every
// one of those output rows (bags without lookups are zeros), each once. Returns false,
// leaving rows half written, if a valid entry is out of bag order or outside the
// chunk's bags; the caller then starts over on the unsorted path (so no separate
// sortedness pass: chunks that all pass are in order as a whole).
// kD > 0: the row width is a compile-time constant, a multiple of 8: the accumulator is
// kD / 8 vectors held in registers. kD == 0: any width, one float at a time.
template <int kBits, int kD, Pool kPool>
SJ_INLINE bool BagChunkBody(const Lookups& e, const Codes& t, float* SJ_RESTRICT out,
                            int64_t d_runtime, int64_t k_begin, int64_t k_end, int64_t s_begin,
                            int64_t s_end) {
  static_assert(kD % 8 == 0, "the fixed widths are multiples of 8");
  using V = std::conditional_t<(kD > 0), F8, float>;
  const int64_t d = kD > 0 ? kD : d_runtime;
  constexpr int64_t kBlocks = kD / 8;
  const int64_t blocks = kD > 0 ? kBlocks : d;
  V acc_fixed[kD > 0 ? kBlocks : 1];
  std::vector<float> acc_buf(kD > 0 ? 0 : std::max<int64_t>(d, 1));
  V* SJ_RESTRICT acc = acc_fixed;
  if constexpr (kD == 0) acc = acc_buf.data();
  auto zero_rows = [&](int64_t s0, int64_t s1) {
    if (s1 > s0) std::memset(out + s0 * d, 0, sizeof(float) * (s1 - s0) * d);
  };
  for (int64_t p = k_begin; p < std::min(k_end, k_begin + kPrefetchLookups); ++p) {
    PrefetchLookup(e, t, p);
  }
  int64_t next_row = s_begin;  // rows [s_begin, next_row) are written
  int64_t k = k_begin;
  for (;;) {
    int64_t g = 0;  // the bag of the next valid entry
    for (; k < k_end; ++k) {
      if (k + kPrefetchLookups < k_end) PrefetchLookup(e, t, k + kPrefetchLookups);
      if (e.Valid(k)) break;
    }
    if (k == k_end) break;
    g = e.seg[k];
    if (g < next_row || g >= s_end) return false;
    zero_rows(next_row, g);
    for (int64_t b = 0; b < blocks; ++b) acc[b] = V{};
    bool first = true;
    for (; k < k_end; ++k) {
      if (k + kPrefetchLookups < k_end) PrefetchLookup(e, t, k + kPrefetchLookups);
      if (!e.Valid(k)) continue;
      if (e.seg[k] != g) break;
      AddLookup<kBits, kPool, kBlocks>(e, t, k, acc, first, blocks);
      first = false;
    }
    // Block by block (not one memcpy of acc): acc stays in registers.
    float* row = out + g * d;
    for (int64_t b = 0; b < blocks; ++b) {
      std::memcpy(row + b * (sizeof(V) / sizeof(float)), &acc[b], sizeof(V));
    }
    next_row = g + 1;
  }
  zero_rows(next_row, s_end);
  return true;
}

template <int kBits, Pool kPool>
SJ_INLINE bool BagChunkAnyD(const Lookups& e, const Codes& t, float* out, int64_t d,
                            int64_t k_begin, int64_t k_end, int64_t s_begin, int64_t s_end) {
#define SJ_QBAG_BODY(KD) \
  BagChunkBody<kBits, KD, kPool>(e, t, out, d, k_begin, k_end, s_begin, s_end)
  switch (d) {
    case 16: return SJ_QBAG_BODY(16);
    case 32: return SJ_QBAG_BODY(32);
    case 64: return SJ_QBAG_BODY(64);
    case 128: return SJ_QBAG_BODY(128);
    default: return SJ_QBAG_BODY(0);
  }
#undef SJ_QBAG_BODY
}

// Compiled twice, as spmm.cc's gather loop: an AVX2+FMA copy picked at run time and
// the portable baseline (they may differ by an ulp).
#if SJ_HAVE_X86
template <int kBits, Pool kPool>
__attribute__((target("avx2,fma"))) bool BagChunkAvx2(const Lookups& e, const Codes& t,
                                                     float* out, int64_t d, int64_t k_begin,
                                                     int64_t k_end, int64_t s_begin,
                                                     int64_t s_end) {
  return BagChunkAnyD<kBits, kPool>(e, t, out, d, k_begin, k_end, s_begin, s_end);
}
#endif

template <int kBits, Pool kPool>
bool BagChunk(const Lookups& e, const Codes& t, float* out, int64_t d, int64_t k_begin,
              int64_t k_end, int64_t s_begin, int64_t s_end) {
#if SJ_HAVE_X86
  if (CpuHasAvx2Fma()) {
    return BagChunkAvx2<kBits, kPool>(e, t, out, d, k_begin, k_end, s_begin, s_end);
  }
#endif
  return BagChunkAnyD<kBits, kPool>(e, t, out, d, k_begin, k_end, s_begin, s_end);
}

// Splits the entries into `parts` chunks that start where a bag starts: chunk c holds
// entries [cut[c], cut[c+1]) and owns bags [bag[c], bag[c+1]), bag[c] being the bag of
// its first valid entry (a chunk without one owns none). Each cut lies at or after
// N c / parts, moved on past the rest of the bag it falls in. For entries out of bag
// order the chunks are still a partition; BagChunkBody then reports the disorder.
void SplitAtBags(const Lookups& e, int64_t parts, int64_t* cut, int64_t* bag) {
  cut[0] = 0;
  bag[0] = 0;
  cut[parts] = e.n;
  bag[parts] = e.s;
  for (int64_t c = 1; c < parts; ++c) {
    int64_t b = std::max(e.n * c / parts, cut[c - 1]);
    int64_t j = b - 1;  // the last valid entry before b, in the previous chunk
    while (j >= cut[c - 1] && !e.Valid(j)) --j;
    if (j >= cut[c - 1]) {
      const int32_t g = e.seg[j];
      while (b < e.n && (!e.Valid(b) || e.seg[b] == g)) ++b;
    }
    cut[c] = b;
    int64_t f = b;
    while (f < e.n && !e.Valid(f)) ++f;
    bag[c] = f < e.n ? e.seg[f] : e.s;
  }
}

// Out-of-order entries: one thread, each valid entry added to its bag's output row.
template <int kBits, Pool kPool>
void BagsUnsorted(const Lookups& e, const Codes& t, float* out, int64_t d) {
  std::memset(out, 0, sizeof(float) * e.s * d);
  std::vector<uint8_t> seen(kPool == Pool::kMax ? e.s : 0, 0);
  for (int64_t k = 0; k < e.n; ++k) {
    if (k + kPrefetchLookups < e.n) PrefetchLookup(e, t, k + kPrefetchLookups);
    if (!e.Valid(k)) continue;
    const int64_t s = e.seg[k];
    bool first = false;
    if constexpr (kPool == Pool::kMax) {
      first = !seen[s];
      seen[s] = 1;
    }
    AddLookup<kBits, kPool, 0>(e, t, k, out + s * d, first, d);
  }
}

template <int kBits, Pool kPool>
void QuantizedBag(const Lookups& e, const Codes& t, float* out, int64_t d) {
  if (e.s == 0 || d == 0) return;
  const int nt = ThreadsFor(e.n);
  const int64_t nc = nt > 1 ? int64_t{nt} * kChunksPerThread : 1;
  std::vector<int64_t> cut(nc + 1), bag(nc + 1);
  SplitAtBags(e, nc, cut.data(), bag.data());
  std::atomic<bool> in_order{true};
  ParallelChunks(nt, nc, [&](int64_t c) {
    if (!BagChunk<kBits, kPool>(e, t, out, d, cut[c], cut[c + 1], bag[c], bag[c + 1])) {
      in_order.store(false, std::memory_order_relaxed);
    }
  });
  if (!in_order.load(std::memory_order_relaxed)) BagsUnsorted<kBits, kPool>(e, t, out, d);
}

template <int kBits>
void QuantizedBagPool(const Lookups& e, const Codes& t, float* out, int64_t d, bool max) {
  if (max) return QuantizedBag<kBits, Pool::kMax>(e, t, out, d);
  if (e.coef == nullptr) return QuantizedBag<kBits, Pool::kSumUnit>(e, t, out, d);
  QuantizedBag<kBits, Pool::kSum>(e, t, out, d);
}

ffi::Error QuantizedBagImpl(ffi::AnyBuffer coef, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
                            ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::AnyBuffer zero_point,
                            int32_t bits, std::string_view combiner,
                            ffi::Result<ffi::AnyBuffer> out) {
  const std::string name = "sparsejax_quantized_bag";
  auto cd = coef.dimensions(), id = ids.dimensions(), sd = seg.dimensions();
  auto dd = data.dimensions(), scd = scale.dimensions(), zd = zero_point.dimensions();
  auto od = out->dimensions();
  if (bits != 8 && bits != 4) {
    return ffi::Error::InvalidArgument(name + ": bits must be 8 or 4, got " +
                                       std::to_string(bits));
  }
  if (combiner != "sum" && combiner != "max") {
    return ffi::Error::InvalidArgument(name + ": combiner must be 'sum' or 'max', got '" +
                                       std::string(combiner) + "'");
  }
  const bool max = combiner == "max";
  if (coef.element_type() != ffi::DataType::F32 || ids.element_type() != ffi::DataType::S32 ||
      seg.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument(name + ": coef must be f32, ids/segment_ids int32");
  }
  if (cd.size() != 1 || id.size() != 1 || sd.size() != 1 || sd[0] != id[0] ||
      (cd[0] != id[0] && !(cd[0] == 0 && !max))) {
    return ffi::Error::InvalidArgument(name + ": coef/ids/segment_ids must be rank-1 of equal "
                                       "length (coef f32[0] for an unweighted sum), got " +
                                       ShapeStr(cd) + " " + ShapeStr(id) + " " + ShapeStr(sd));
  }
  if (data.element_type() != ffi::DataType::U8 || scale.element_type() != ffi::DataType::F16 ||
      zero_point.element_type() != ffi::DataType::U8 ||
      out->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        name + ": data must be uint8, scale float16, zero_point uint8 and out float32");
  }
  if (dd.size() != 2 || scd.size() != 1 || zd.size() != 1 || od.size() != 2 ||
      scd[0] != dd[0] || zd[0] != dd[0] || dd[1] != (bits == 8 ? od[1] : (od[1] + 1) / 2)) {
    return ffi::Error::InvalidArgument(
        name + ": data must be [V, D] (bits 8) or [V, ceil(D/2)] (bits 4), scale and "
        "zero_point [V], out [S, D], got " + ShapeStr(dd) + " " + ShapeStr(scd) + " " +
        ShapeStr(zd) + " " + ShapeStr(od));
  }
  constexpr int64_t kIdLimit = int64_t{1} << 31;  // past any int32 id
  const int64_t n = id[0];
  Lookups e{cd[0] == n && n > 0 ? reinterpret_cast<const float*>(coef.untyped_data()) : nullptr,
            reinterpret_cast<const int32_t*>(ids.untyped_data()),
            reinterpret_cast<const int32_t*>(seg.untyped_data()), n,
            static_cast<uint32_t>(std::min<int64_t>(dd[0], kIdLimit)),
            static_cast<uint32_t>(std::min<int64_t>(od[0], kIdLimit))};
  if (max && e.coef == nullptr && n > 0) {
    return ffi::Error::InvalidArgument(name + ": max pooling needs coef");
  }
  Codes t{reinterpret_cast<const uint8_t*>(data.untyped_data()),
          reinterpret_cast<const uint16_t*>(scale.untyped_data()),
          reinterpret_cast<const uint8_t*>(zero_point.untyped_data()), dd[1]};
  AdviseHugePages(data.untyped_data(), static_cast<int64_t>(data.size_bytes()));
  float* o = reinterpret_cast<float*>(out->untyped_data());
  if (bits == 8) {
    QuantizedBagPool<8>(e, t, o, od[1], max);
  } else {
    QuantizedBagPool<4>(e, t, o, od[1], max);
  }
  return ffi::Error::Success();
}

ffi::Error QuantizedBagHandler(ffi::ThreadPool pool, ffi::AnyBuffer coef, ffi::AnyBuffer ids, ffi::AnyBuffer seg,
                               ffi::AnyBuffer data, ffi::AnyBuffer scale,
                               ffi::AnyBuffer zero_point, int32_t bits,
                               std::string_view combiner, ffi::Result<ffi::AnyBuffer> out) {
  return Guarded("sparsejax_quantized_bag", pool, [&] {
    return QuantizedBagImpl(coef, ids, seg, data, scale, zero_point, bits, combiner, out);
  });
}

}  // namespace
}  // namespace sparsejax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxQuantizedBag, sparsejax::QuantizedBagHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()  // coef f32[N] (f32[0]: all 1)
                                  .Arg<ffi::AnyBuffer>()  // ids i32[N]
                                  .Arg<ffi::AnyBuffer>()  // segment_ids i32[N]
                                  .Arg<ffi::AnyBuffer>()  // data u8[V,W]
                                  .Arg<ffi::AnyBuffer>()  // scale f16[V]
                                  .Arg<ffi::AnyBuffer>()  // zero_point u8[V]
                                  .Attr<int32_t>("bits")
                                  .Attr<std::string_view>("combiner")
                                  .Ret<ffi::AnyBuffer>());  // out f32[S,D]
