// sparse_apply as an XLA FFI handler (part of `sparsejax._cpu_ext`).
//
// Target
//   sparsejax_sparse_apply  lazy row-sparse optimizer update, outputs aliased to
//                           (table, slots...); mirrors `update_rows` in
//                           sparsejax/ops/optimizers.py line by line.
//
// For every unique valid id r (0 <= ids[k] < V and 0 <= seg[k] < S): g = sum over its
// entries k, in ascending k, of coef[k] * grad[seg[k]] (f32), then row r of the table
// and its slots is updated. Entries are grouped by the top bits of their id, each group
// sorted and run-length encoded, and the groups' unique rows updated, all split over
// threads by groups; untouched rows are bit-identical. Table dtype f32 or bf16 (updated in f32, rounded to nearest even, or
// stochastically with the `stochastic_rounding` attribute).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "optimizers.h"
#include "worker_pool.h"

namespace sparsejax {
namespace {

// Entries are grouped by the top kGroupBits bits of their row's id before sorting.
constexpr int kGroupBits = 11;

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
  bool stochastic;  // bf16: stochastic rounding (optimizers.store_rows)
};

SJ_INLINE uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// Unbiased rounding of f32 to bf16: noise from (row, column, step) added to the bits
// below bf16's, then truncated; inf and NaN round to nearest. Mirrors store_rows.
SJ_INLINE bf16_t F32ToBf16Stochastic(float f, int64_t row, int64_t col, int32_t step) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return F32ToBf16(f);
  const uint32_t key = static_cast<uint32_t>(row) * 0x9E3779B1u +
                       static_cast<uint32_t>(col) * 0x85EBCA77u +
                       static_cast<uint32_t>(step) * 0xC2B2AE3Du;
  u += Mix32(key) & 0xFFFFu;
  return static_cast<bf16_t>(u >> 16);
}

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
// Entries whose gradient rows are prefetched ahead.
constexpr int kApplyPrefetchEntries = 32;

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
  // The entries' gradient rows: sorted by id they are random rows of `grad`, read
  // kApplyPrefetchEntries entries ahead.
  const int64_t entry_end = run_start[run_end];
  for (int64_t e = run_start[run_begin];
       e < std::min(entry_end, run_start[run_begin] + kApplyPrefetchEntries); ++e) {
    PrefetchBytes<0>(c.grad + static_cast<int64_t>(c.seg[keys[e] & 0xffffffffu]) * d, d * 4);
  }
  for (int64_t i = run_begin; i < run_end; ++i) {
    if (i + kApplyPrefetchRuns < run_end) {
      PrefetchRowState(c, static_cast<int64_t>(keys[run_start[i + kApplyPrefetchRuns]] >> 32));
    }
    const int64_t r = static_cast<int64_t>(keys[run_start[i]] >> 32);
    for (int64_t j = 0; j < d; ++j) g[j] = 0.0f;
    for (int64_t e = run_start[i]; e < run_start[i + 1]; ++e) {
      if (e + kApplyPrefetchEntries < entry_end) {
        const int64_t ahead = static_cast<int64_t>(keys[e + kApplyPrefetchEntries] & 0xffffffffu);
        PrefetchBytes<0>(c.grad + static_cast<int64_t>(c.seg[ahead]) * d, d * 4);
      }
      const int64_t k = static_cast<int64_t>(keys[e] & 0xffffffffu);
      const float cf = c.coef[k];
      const float* SJ_RESTRICT gr = c.grad + static_cast<int64_t>(c.seg[k]) * d;
      for (int64_t j = 0; j < d; ++j) g[j] += cf * gr[j];
    }
    if (c.bf16) {
      bf16_t* row = static_cast<bf16_t*>(c.table) + r * d;
      for (int64_t j = 0; j < d; ++j) wbuf[j] = Bf16ToF32(row[j]);
      UpdateRow(c, r, wbuf, g, bc1, bc2, period);
      if (c.stochastic) {
        for (int64_t j = 0; j < d; ++j) row[j] = F32ToBf16Stochastic(wbuf[j], r, j, c.step);
      } else {
        for (int64_t j = 0; j < d; ++j) row[j] = F32ToBf16(wbuf[j]);
      }
    } else {
      UpdateRow(c, r, static_cast<float*>(c.table) + r * d, g, bc1, bc2, period);
    }
  }
}

ffi::Error SparseApplyImplHandler(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                  int32_t optimizer, int32_t stochastic_rounding) {
  const char* kName = "sparsejax_sparse_apply: ";
  if (optimizer < 0 || optimizer >= kNumOptimizers) {
    return ffi::Error::InvalidArgument(std::string(kName) + "unknown optimizer code " +
                                       std::to_string(optimizer));
  }
  const int64_t m = kOptimizers[optimizer].num_slots;
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
  c.stochastic = stochastic_rounding != 0;
  if (n == 0 || v == 0) return ffi::Error::Success();

  // The valid entries as keys (id << 32 | k), grouped by the top bits of their id
  // (stable in k), then each group sorted, run-length encoded and applied by one thread:
  // groups hold disjoint rows, so every step but a prefix sum over the groups runs in
  // parallel (the route of FBGEMM's radix-sort dedup).
  const int32_t* id_p = reinterpret_cast<const int32_t*>(ids.untyped_data());
  int id_bits = 0;
  while (id_bits < 32 && (uint64_t{1} << id_bits) < static_cast<uint64_t>(v)) ++id_bits;
  const int low_bits = id_bits - std::min(id_bits, kGroupBits);
  const int64_t groups = int64_t{1} << (id_bits - low_bits);
  const int nt = ThreadsFor(n);
  auto valid = [&](int64_t k) {
    const int64_t id = id_p[k], sg = c.seg[k];
    return id >= 0 && id < v && sg >= 0 && sg < c.s;
  };
  auto range = [&](int64_t t) { return std::make_pair(n * t / nt, n * (t + 1) / nt); };

  // 1. Per range of entries, the entries of each group; then, per (group, range), where
  //    its entries go: ranges in order within a group keep the entries in k order.
  std::vector<int64_t> place(static_cast<size_t>(nt * groups), 0);
  ParallelChunks(nt, nt, [&](int64_t t) {
    int64_t* h = place.data() + t * groups;
    for (auto [k, e] = range(t); k < e; ++k) {
      if (valid(k)) ++h[id_p[k] >> low_bits];
    }
  });
  std::vector<int64_t> group_start(static_cast<size_t>(groups) + 1);
  int64_t nv = 0;
  for (int64_t g = 0; g < groups; ++g) {
    group_start[g] = nv;
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t count = place[t * groups + g];
      place[t * groups + g] = nv;
      nv += count;
    }
  }
  group_start[groups] = nv;
  if (nv == 0) return ffi::Error::Success();

  // 2. Scatter the keys into their groups.
  std::unique_ptr<uint64_t[]> keys(new uint64_t[nv]);
  ParallelChunks(nt, nt, [&](int64_t t) {
    int64_t* at = place.data() + t * groups;
    for (auto [k, e] = range(t); k < e; ++k) {
      if (valid(k)) {
        const uint64_t id = static_cast<uint64_t>(id_p[k]);
        keys[at[id >> low_bits]++] = (id << 32) | static_cast<uint64_t>(k);
      }
    }
  });

  // 3. Chunks of whole groups with about equal entries: sort each group (by id, then k),
  //    run-length encode, update the unique rows.
  const int nc = nt > 1 ? nt * kChunksPerThread : 1;
  std::vector<int64_t> lo(nc + 1);
  lo[0] = 0;
  lo[nc] = groups;
  for (int t = 1; t < nc; ++t) {
    const int64_t target = nv * t / nc;
    lo[t] = std::upper_bound(group_start.begin(), group_start.end() - 1, target) -
            group_start.begin() - 1;
    lo[t] = std::max(lo[t], lo[t - 1]);
  }
  ParallelChunks(nt, nc, [&](int64_t t) {
    const int64_t begin = group_start[lo[t]], end = group_start[lo[t + 1]];
    if (begin == end) return;
    for (int64_t g = lo[t]; g < lo[t + 1]; ++g) {
      std::sort(keys.get() + group_start[g], keys.get() + group_start[g + 1]);
    }
    std::vector<int64_t> run_start;
    run_start.reserve(static_cast<size_t>(end - begin) + 1);
    run_start.push_back(begin);
    for (int64_t i = begin + 1; i < end; ++i) {
      if ((keys[i] >> 32) != (keys[i - 1] >> 32)) run_start.push_back(i);
    }
    const int64_t runs = static_cast<int64_t>(run_start.size());
    run_start.push_back(end);
    ApplyRuns(c, keys.get(), run_start.data(), 0, runs);
  });
  return ffi::Error::Success();
}

ffi::Error SparseApplyHandler(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                              int32_t optimizer, int32_t stochastic_rounding) {
  return Guarded("sparsejax_sparse_apply", pool, [&] {
    return SparseApplyImplHandler(args, rets, optimizer, stochastic_rounding);
  });
}
}  // namespace
}  // namespace sparsejax

// Inputs: table, slots..., ids, segment_ids, coef, grad, hparams, step.
// Outputs (aliased): table, slots...
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxSparseApply, sparsejax::SparseApplyHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("optimizer")
                                  .Attr<int32_t>("stochastic_rounding"));
