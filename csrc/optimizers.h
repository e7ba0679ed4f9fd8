// The row-wise optimizers of sparse_apply: codes and slot counts, the one source.
//
// The Python side (sparsejax/ops/optimizers.py, each class's `code` and slots) is
// checked against this table when the extension is loaded (module.cc exports it as
// `sparsejax._cpu_ext.optimizers()`), and refuses the extension if they disagree.

#ifndef SPARSEJAX_CSRC_OPTIMIZERS_H_
#define SPARSEJAX_CSRC_OPTIMIZERS_H_

#include <cstdint>

namespace sparsejax {

enum OptCode : int32_t {
  kSGD = 0,
  kAdagrad = 1,
  kRowWiseAdagrad = 2,
  kLazyAdam = 3,
  kFTRL = 4,
  kAdagradDecay = 5,
};

struct OptimizerInfo {
  OptCode code;
  const char* name;  // the Python class name
  int num_slots;     // slot arrays after the table, in `opt.slots()` order
};

// Indexed by code.
constexpr OptimizerInfo kOptimizers[] = {
    {kSGD, "SGD", 0},
    {kAdagrad, "Adagrad", 1},                // accumulator f32[V,D]
    {kRowWiseAdagrad, "RowWiseAdagrad", 1},  // accumulator f32[V]
    {kLazyAdam, "LazyAdam", 2},              // mu, nu f32[V,D]
    {kFTRL, "FTRL", 2},                      // accumulator, linear f32[V,D]
    {kAdagradDecay, "AdagradDecay", 2},      // accumulator f32[V,D], decay_power i32[V]
};

constexpr int kNumOptimizers = sizeof(kOptimizers) / sizeof(kOptimizers[0]);

constexpr bool CodesAreIndices() {
  for (int i = 0; i < kNumOptimizers; ++i) {
    if (kOptimizers[i].code != i) return false;
  }
  return true;
}
static_assert(CodesAreIndices(), "kOptimizers must be indexed by code");

}  // namespace sparsejax

#endif  // SPARSEJAX_CSRC_OPTIMIZERS_H_
