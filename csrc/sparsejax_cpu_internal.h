// Internal interface between the translation units of `sparsejax._cpu_ext`.
//
// sparsejax_cpu.cc owns the worker pool and the CPython module; other kernel files
// (sparsejax_interaction.cc) use the pool through ParallelRange and export their XLA
// FFI handlers as extern "C" symbols that the module's registrations() lists.

#ifndef SPARSEJAX_CPU_INTERNAL_H_
#define SPARSEJAX_CPU_INTERNAL_H_

#include <cstdint>
#include <functional>

#include "xla/ffi/api/c_api.h"

namespace sparsejax {

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
