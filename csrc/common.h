// Shared by every translation unit of `sparsejax._cpu_ext`: bf16 conversions, f32/bf16
// element access, prefetch, environment settings, and the XLA FFI helpers (argument
// formatting, exception guard). The FFI handler symbols that module.cc registers are
// declared at the bottom.

#ifndef SPARSEJAX_CSRC_COMMON_H_
#define SPARSEJAX_CSRC_COMMON_H_

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "worker_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define SJ_HAVE_X86 1
#else
#define SJ_HAVE_X86 0
#endif

#define SJ_RESTRICT __restrict__
#define SJ_INLINE inline __attribute__((always_inline))

namespace ffi = xla::ffi;

namespace sparsejax {

// bfloat16 storage: the upper 16 bits of an IEEE float.
using bf16_t = uint16_t;

SJ_INLINE float Bf16ToF32(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

SJ_INLINE bf16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet bit
    return static_cast<bf16_t>((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<bf16_t>(u >> 16);
}

// Element access in f32 whatever the storage type (f32 or bf16).
SJ_INLINE float Load(const float* p, int64_t i) { return p[i]; }
SJ_INLINE float Load(const bf16_t* p, int64_t i) { return Bf16ToF32(p[i]); }
SJ_INLINE void Store(float* p, int64_t i, float v) { p[i] = v; }
SJ_INLINE void Store(bf16_t* p, int64_t i, float v) { p[i] = F32ToBf16(v); }

// Prefetch every cache line of [p, p + bytes) (RW: 0 read, 1 write).
template <int RW>
SJ_INLINE void PrefetchBytes(const void* p, int64_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a), RW, 3);
}

// Integer environment variable `name`, or `dflt` when unset, empty or not a number.
int64_t EnvInt(const char* name, int64_t dflt);

// True on x86-64 CPUs with AVX2 and FMA (false when $SPARSEJAX_CPU_BASELINE_ISA is set).
bool CpuHasAvx2Fma();

// Asks the kernel to back a buffer of 64 MiB or more with 2 MiB pages (see common.cc).
void AdviseHugePages(const void* data, int64_t bytes);

// "[d0,d1,...]" for error messages.
std::string ShapeStr(ffi::AnyBuffer::Dimensions d);

inline bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16;
}

// XLA's intra-op thread pool of an FFI call, as an Executor for the parallel loops.
class XlaPool final : public Executor {
 public:
  explicit XlaPool(ffi::ThreadPool pool) : pool_(pool) {}
  int64_t NumThreads() const override { return pool_.num_threads(); }
  void Schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool pool_;
};

// Runs fn() -> ffi::Error with the kernel's parallel loops on XLA's intra-op `pool`, so
// that no C++ exception (e.g. std::bad_alloc) crosses into XLA.
template <typename Fn>
ffi::Error Guarded(const char* name, ffi::ThreadPool pool, Fn&& fn) {
  XlaPool xla_pool(pool);
  ScopedExecutor on_xla_pool(&xla_pool);
  try {
    return fn();
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string(name) + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(name) + ": unknown C++ exception");
  }
}

}  // namespace sparsejax

// XLA FFI handlers, one per target; module.cc maps target names to them.
extern "C" XLA_FFI_Error* SparsejaxSpmm(XLA_FFI_CallFrame* call_frame);         // spmm.cc
extern "C" XLA_FFI_Error* SparsejaxSegmentMax(XLA_FFI_CallFrame* call_frame);   // spmm.cc
extern "C" XLA_FFI_Error* SparsejaxSparseApply(XLA_FFI_CallFrame* call_frame);  // sparse_apply.cc
extern "C" XLA_FFI_Error* SparsejaxPairwiseDots(XLA_FFI_CallFrame* call_frame);     // interaction.cc
extern "C" XLA_FFI_Error* SparsejaxPairwiseDotsBwd(XLA_FFI_CallFrame* call_frame);  // interaction.cc

#endif  // SPARSEJAX_CSRC_COMMON_H_
