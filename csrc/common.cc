// Definitions of the helpers declared in common.h.

#include "common.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace sparsejax {

int64_t EnvInt(const char* name, int64_t dflt) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return dflt;
  char* end = nullptr;
  long long v = std::strtoll(e, &end, 10);
  if (end == e) return dflt;
  return static_cast<int64_t>(v);
}

bool CpuHasAvx2Fma() {
#if SJ_HAVE_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         EnvInt("SPARSEJAX_CPU_BASELINE_ISA", 0) == 0;
  return ok;
#else
  return false;
#endif
}

// Random row access over a GiB table otherwise misses the TLB on nearly every row.
// MADV_HUGEPAGE covers future faults; MADV_COLLAPSE (Linux >= 6.1) converts the pages
// already there, in a background thread so no step stalls. Both leave the contents
// unchanged, so advising memory XLA later frees is harmless. Once per (address, size);
// off with SPARSEJAX_HUGE_PAGES=0.
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

std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

}  // namespace sparsejax
