// The persistent worker pool behind ParallelChunks / ParallelRange.

#include "worker_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common.h"

namespace sparsejax {
namespace {

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
#if SJ_HAVE_X86
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

void ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  if (WorkerPool::Get().TryRun(n, fn)) return;
  for (int t = 0; t < n; ++t) fn(t);  // pool busy: this call runs alone
}

}  // namespace

int MaxThreads() {
  int64_t n = EnvInt("SPARSEJAX_CPU_THREADS", 0);
  if (n <= 0) n = static_cast<int64_t>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  return static_cast<int>(std::min<int64_t>(n, 256));
}

int ThreadsFor(int64_t work) {
  int64_t min_work = EnvInt("SPARSEJAX_CPU_MIN_PARALLEL", 4096);
  if (min_work < 1) min_work = 1;
  int64_t t = work / min_work;
  t = std::max<int64_t>(1, std::min<int64_t>(t, MaxThreads()));
  return static_cast<int>(t);
}

void ParallelChunks(int nthreads, int64_t nchunks, const std::function<void(int64_t)>& fn) {
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

}  // namespace sparsejax
