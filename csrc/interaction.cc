// DLRM dot interaction as XLA FFI handlers (part of `sparsejax._cpu_ext`).
//
// Targets
//   sparsejax_pairwise_dots      x T[B,F,D] -> out T[B,P], P = F(F-1)/2,
//                                out[b,p] = <x[b,i], x[b,j]> for the p-th pair (i, j), i < j,
//                                in row-major order (np.triu_indices(F, k=1)).
//   sparsejax_pairwise_dots_bwd  (g T[B,P], x T[B,F,D]) -> dx T[B,F,D],
//                                dx[b,i] = sum_{j != i} g[b,(min(i,j),max(i,j))] * x[b,j]
//                                (the vjp of the above).
//
// T is f32 or bf16; products are accumulated in f32 and bf16 results rounded to
// nearest even. Per example the F x D block (27 x 64 floats for DLRM = 7 KB) stays in
// L1: the forward computes only the upper triangle, 8 pairs at a time (8 running
// AVX2 accumulators reduced by a transposing horizontal add), the backward is a dense
// [F,F] x [F,D] product with the symmetric, zero-diagonal matrix of g (register
// blocked: 2 rows of dx x 32 columns). Rows whose D is not a multiple of 8 (and bf16
// rows) are copied into a zero-padded f32 scratch first. Examples are split over the
// shared worker pool (worker_pool.h); every example is computed by one thread in
// a fixed order, so results do not depend on the thread count.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "worker_pool.h"

#if SJ_HAVE_X86
#include <immintrin.h>
#endif

namespace sparsejax {
namespace {

// Examples per work item handed to the pool (each example is ~F*F*D flops).
constexpr int64_t kGrainFlops = int64_t{1} << 20;

int64_t RoundUp8(int64_t d) { return (d + 7) & ~int64_t{7}; }

// ---------------------------------------------------------------------------
// Per-example kernels on f32 rows: row f at x + f * ld, columns [0, dp), dp % 8 == 0
// (columns >= D are zero).
// ---------------------------------------------------------------------------

// Portable versions (any ISA; the compiler vectorizes the inner loops).
void DotsPortable(const float* x, int64_t ld, int64_t f, int64_t dp, float* out) {
  int64_t p = 0;
  for (int64_t i = 0; i < f; ++i) {
    const float* xi = x + i * ld;
    for (int64_t j = i + 1; j < f; ++j) {
      const float* xj = x + j * ld;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t d = 0; d < dp; d += 8) {
        for (int l = 0; l < 8; ++l) acc[l] += xi[d + l] * xj[d + l];
      }
      out[p++] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  }
}

// dx[i, :] = sum_j gs[i, j] * x[j, :], gs [f, f] symmetric with a zero diagonal.
void BwdPortable(const float* gs, const float* x, int64_t ld, int64_t f, int64_t dp, float* dx,
                 int64_t ldo) {
  for (int64_t i = 0; i < f; ++i) {
    float* o = dx + i * ldo;
    for (int64_t d = 0; d < dp; ++d) o[d] = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const float g = gs[i * f + j];
      const float* xj = x + j * ld;
      for (int64_t d = 0; d < dp; ++d) o[d] += g * xj[d];
    }
  }
}

#if SJ_HAVE_X86
#define SJ_AVX2 __attribute__((target("avx2,fma")))
#define SJ_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

// [sum(a0), ..., sum(a7)].
SJ_AVX2_INLINE __m256 Reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                              __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// [sum(a0), ..., sum(a3)].
SJ_AVX2_INLINE __m128 Reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

SJ_AVX2_INLINE float Reduce1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// a[w] = 8 partial sums of <xi, xj + w * ld> for w in [0, W) (W running accumulators).
template <int W>
SJ_AVX2_INLINE void DotBlockAvx2(const float* xi, const float* xj, int64_t ld, int64_t dp,
                                 __m256 (&a)[W]) {
  for (int w = 0; w < W; ++w) a[w] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dp; d += 8) {
    const __m256 v = _mm256_loadu_ps(xi + d);
    for (int w = 0; w < W; ++w) a[w] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xj + w * ld + d), a[w]);
  }
}

SJ_AVX2 void DotsAvx2(const float* x, int64_t ld, int64_t f, int64_t dp, float* out) {
  int64_t p = 0;
  for (int64_t i = 0; i < f; ++i) {
    const float* xi = x + i * ld;
    int64_t j = i + 1;
    for (; j + 8 <= f; j += 8, p += 8) {
      __m256 a[8];
      DotBlockAvx2<8>(xi, x + j * ld, ld, dp, a);
      _mm256_storeu_ps(out + p, Reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    }
    for (; j + 4 <= f; j += 4, p += 4) {
      __m256 a[4];
      DotBlockAvx2<4>(xi, x + j * ld, ld, dp, a);
      _mm_storeu_ps(out + p, Reduce4(a[0], a[1], a[2], a[3]));
    }
    for (; j < f; ++j, ++p) {
      __m256 a[1];
      DotBlockAvx2<1>(xi, x + j * ld, ld, dp, a);
      out[p] = Reduce1(a[0]);
    }
  }
}

// Rows [i, i + R) x columns [d0, d0 + 8V) of dx = gs @ x.
template <int R, int V>
SJ_AVX2_INLINE void BwdBlockAvx2(const float* gs, const float* x, int64_t ld, int64_t f,
                                 int64_t i, int64_t d0, float* dx, int64_t ldo) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < f; ++j) {
    __m256 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(x + j * ld + d0 + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 g = _mm256_broadcast_ss(gs + (i + r) * f + j);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(g, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(dx + (i + r) * ldo + d0 + 8 * v, acc[r][v]);
}

template <int V>
SJ_AVX2_INLINE void BwdColumnsAvx2(const float* gs, const float* x, int64_t ld, int64_t f,
                                   int64_t d0, float* dx, int64_t ldo) {
  int64_t i = 0;
  for (; i + 2 <= f; i += 2) BwdBlockAvx2<2, V>(gs, x, ld, f, i, d0, dx, ldo);
  if (i < f) BwdBlockAvx2<1, V>(gs, x, ld, f, i, d0, dx, ldo);
}

SJ_AVX2 void BwdAvx2(const float* gs, const float* x, int64_t ld, int64_t f, int64_t dp,
                     float* dx, int64_t ldo) {
  int64_t d0 = 0;
  for (; d0 + 32 <= dp; d0 += 32) BwdColumnsAvx2<4>(gs, x, ld, f, d0, dx, ldo);
  for (; d0 < dp; d0 += 8) BwdColumnsAvx2<1>(gs, x, ld, f, d0, dx, ldo);
}
#endif  // SJ_HAVE_X86

void Dots(bool avx2, const float* x, int64_t ld, int64_t f, int64_t dp, float* out) {
#if SJ_HAVE_X86
  if (avx2) return DotsAvx2(x, ld, f, dp, out);
#endif
  (void)avx2;
  DotsPortable(x, ld, f, dp, out);
}

void Bwd(bool avx2, const float* gs, const float* x, int64_t ld, int64_t f, int64_t dp, float* dx,
         int64_t ldo) {
#if SJ_HAVE_X86
  if (avx2) return BwdAvx2(gs, x, ld, f, dp, dx, ldo);
#endif
  (void)avx2;
  BwdPortable(gs, x, ld, f, dp, dx, ldo);
}

// Example b's rows as f32 with a row stride that is a multiple of 8 and zero padding:
// the input itself (f32, D % 8 == 0) or a copy in `scratch` ([F, dp]).
template <typename T>
const float* Rows(const T* x, int64_t b, int64_t f, int64_t d, int64_t dp, float* scratch) {
  const T* xb = x + b * f * d;
  if constexpr (std::is_same_v<T, float>) {
    if (d == dp) return xb;
  }
  for (int64_t r = 0; r < f; ++r) {
    for (int64_t c = 0; c < d; ++c) scratch[r * dp + c] = Load(xb, r * d + c);
    for (int64_t c = d; c < dp; ++c) scratch[r * dp + c] = 0.0f;
  }
  return scratch;
}

template <typename T>
void ForwardImpl(const T* x, T* out, int64_t nb, int64_t f, int64_t d) {
  const int64_t np = f * (f - 1) / 2, dp = RoundUp8(d);
  const bool avx2 = CpuHasAvx2Fma();
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, np * dp));
  ParallelRange(nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(static_cast<size_t>(f * dp)), dots(static_cast<size_t>(np));
    for (int64_t b = b0; b < b1; ++b) {
      const float* xr = Rows(x, b, f, d, dp, rows.data());
      if constexpr (std::is_same_v<T, float>) {
        Dots(avx2, xr, dp, f, dp, out + b * np);
      } else {
        Dots(avx2, xr, dp, f, dp, dots.data());
        for (int64_t p = 0; p < np; ++p) Store(out, b * np + p, dots[p]);
      }
    }
  });
}

template <typename T>
void BackwardImpl(const T* g, const T* x, T* dx, int64_t nb, int64_t f, int64_t d) {
  const int64_t np = f * (f - 1) / 2, dp = RoundUp8(d);
  const bool avx2 = CpuHasAvx2Fma();
  const int64_t grain = std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, f * f * dp));
  ParallelRange(nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(static_cast<size_t>(f * dp)), gs(static_cast<size_t>(f * f), 0.0f),
        out(static_cast<size_t>(f * dp));
    for (int64_t b = b0; b < b1; ++b) {
      const float* xr = Rows(x, b, f, d, dp, rows.data());
      const T* gb = g + b * np;
      for (int64_t i = 0, p = 0; i < f; ++i) {  // the diagonal stays 0
        for (int64_t j = i + 1; j < f; ++j, ++p) {
          const float v = Load(gb, p);
          gs[i * f + j] = v;
          gs[j * f + i] = v;
        }
      }
      T* dxb = dx + b * f * d;
      if constexpr (std::is_same_v<T, float>) {
        if (d == dp) {
          Bwd(avx2, gs.data(), xr, dp, f, dp, dxb, d);
          continue;
        }
      }
      Bwd(avx2, gs.data(), xr, dp, f, dp, out.data(), dp);
      for (int64_t r = 0; r < f; ++r) {
        for (int64_t c = 0; c < d; ++c) Store(dxb, r * d + c, out[r * dp + c]);
      }
    }
  });
}

ffi::Error ForwardHandler(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kName = "sparsejax_pairwise_dots";
  return Guarded(kName, pool, [&]() -> ffi::Error {
    auto xd = x.dimensions(), od = out->dimensions();
    if (!IsFloat(x.element_type()) || out->element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kName) +
                                         ": x must be f32 or bf16 and match the output dtype");
    }
    if (xd.size() != 3 || od.size() != 2 || od[0] != xd[0] || od[1] != xd[1] * (xd[1] - 1) / 2) {
      return ffi::Error::InvalidArgument(std::string(kName) + ": need x [B,F,D] and out " +
                                         "[B,F(F-1)/2], got " + ShapeStr(xd) + " " + ShapeStr(od));
    }
    const int64_t nb = xd[0], f = xd[1], d = xd[2];
    if (nb == 0 || f < 2) return ffi::Error::Success();
    if (x.element_type() == ffi::DataType::F32) {
      ForwardImpl<float>(static_cast<const float*>(x.untyped_data()),
                         static_cast<float*>(out->untyped_data()), nb, f, d);
    } else {
      ForwardImpl<bf16_t>(static_cast<const bf16_t*>(x.untyped_data()),
                          static_cast<bf16_t*>(out->untyped_data()), nb, f, d);
    }
    return ffi::Error::Success();
  });
}

ffi::Error BackwardHandler(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> dx) {
  constexpr const char* kName = "sparsejax_pairwise_dots_bwd";
  return Guarded(kName, pool, [&]() -> ffi::Error {
    auto gd = g.dimensions(), xd = x.dimensions(), od = dx->dimensions();
    if (!IsFloat(x.element_type()) || g.element_type() != x.element_type() ||
        dx->element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kName) +
                                         ": g, x and dx must all be f32 or all bf16");
    }
    if (xd.size() != 3 || gd.size() != 2 || od.size() != 3 || gd[0] != xd[0] ||
        gd[1] != xd[1] * (xd[1] - 1) / 2 || od[0] != xd[0] || od[1] != xd[1] || od[2] != xd[2]) {
      return ffi::Error::InvalidArgument(std::string(kName) + ": need g [B,F(F-1)/2], x and dx " +
                                         "[B,F,D], got " + ShapeStr(gd) + " " + ShapeStr(xd) + " " +
                                         ShapeStr(od));
    }
    const int64_t nb = xd[0], f = xd[1], d = xd[2];
    if (nb == 0 || f == 0 || d == 0) return ffi::Error::Success();
    if (x.element_type() == ffi::DataType::F32) {
      BackwardImpl<float>(static_cast<const float*>(g.untyped_data()),
                          static_cast<const float*>(x.untyped_data()),
                          static_cast<float*>(dx->untyped_data()), nb, f, d);
    } else {
      BackwardImpl<bf16_t>(static_cast<const bf16_t*>(g.untyped_data()),
                           static_cast<const bf16_t*>(x.untyped_data()),
                           static_cast<bf16_t*>(dx->untyped_data()), nb, f, d);
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace sparsejax

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxPairwiseDots, sparsejax::ForwardHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()    // x T[B,F,D]
                                  .Ret<ffi::AnyBuffer>());  // out T[B,F(F-1)/2]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparsejaxPairwiseDotsBwd, sparsejax::BackwardHandler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()    // g T[B,F(F-1)/2]
                                  .Arg<ffi::AnyBuffer>()    // x T[B,F,D]
                                  .Ret<ffi::AnyBuffer>());  // dx T[B,F,D]
