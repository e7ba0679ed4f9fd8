// Internal interface between the translation units of `sparsejax._cpu_ext`.
//
// sparsejax_cpu.cc owns the worker pool and the CPython module; other kernel files
// (sparsejax_interaction.cc) use the pool through ParallelRange and export their XLA
// FFI handlers as extern "C" symbols that the module's registrations() lists.

#ifndef SPARSEJAX_CPU_INTERNAL_H_
#define SPARSEJAX_CPU_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <functional>

#include "xla/ffi/api/c_api.h"

namespace sparsejax {

// bfloat16 storage: the upper 16 bits of an IEEE float.
using bf16_t = uint16_t;

inline __attribute__((always_inline)) float Bf16ToF32(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __attribute__((always_inline)) bf16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet bit
    return static_cast<bf16_t>((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<bf16_t>(u >> 16);
}

// Element access in f32 whatever the storage type (f32 or bf16).
inline __attribute__((always_inline)) float Load(const float* p, int64_t i) { return p[i]; }
inline __attribute__((always_inline)) float Load(const bf16_t* p, int64_t i) {
  return Bf16ToF32(p[i]);
}
inline __attribute__((always_inline)) void Store(float* p, int64_t i, float v) { p[i] = v; }
inline __attribute__((always_inline)) void Store(bf16_t* p, int64_t i, float v) {
  p[i] = F32ToBf16(v);
}

// Runs fn(begin, end) over disjoint ranges covering [0, n), on up to
// $SPARSEJAX_CPU_THREADS threads of the shared worker pool (dynamic chunks, each of
// at least `grain` items; one thread when n <= grain). Exceptions propagate.
void ParallelRange(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// True on x86-64 CPUs with AVX2 and FMA (false when $SPARSEJAX_CPU_BASELINE_ISA is set).
bool CpuHasAvx2Fma();

}  // namespace sparsejax

// sparsejax_interaction.cc
extern "C" XLA_FFI_Error* SparsejaxPairwiseDots(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* SparsejaxPairwiseDotsBwd(XLA_FFI_CallFrame* call_frame);

#endif  // SPARSEJAX_CPU_INTERNAL_H_
