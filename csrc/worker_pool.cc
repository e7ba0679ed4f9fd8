// The persistent worker pool behind ParallelChunks / ParallelRange.

#include "worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace sparsejax {
namespace {

using Clock = std::chrono::steady_clock;

// Waits up to `limit` for pred(), with a `pause` between checks. No sched_yield(): under
// EEVDF (Linux >= 6.6) each yield pushes the thread's deadline a whole slice later, so a
// worker that yield-spins until a job arrives then runs that job behind every other
// runnable thread; a short bounded spin followed by a futex sleep burns less and keeps
// the worker's place.
template <typename Pred>
bool SpinUntil(Pred pred, std::chrono::microseconds limit) {
  const Clock::time_point until = Clock::now() + limit;
  for (int i = 0;; ++i) {
    if (pred()) return true;
#if SJ_HAVE_X86
    __builtin_ia32_pause();
#endif
    if ((i & 63) == 0 && Clock::now() >= until) return pred();
  }
}

// How long an idle worker spins for the next job before it sleeps on a futex
// ($SPARSEJAX_CPU_SPIN_US, default 400 us): back-to-back kernel calls (several per
// training step) then skip a futex wake-up (tens to hundreds of microseconds on a VM),
// while a worker between calls holds a core at most that long. 400 rather than 100:
// on the 2-CPU VM, a forward in one process with PyTorch's EmbeddingBag went from
// 0.92-0.95x torch (alternating) and 0.86-0.93x (beside a busy numpy thread) to
// 1.02-1.03x and 1.04-1.15x, and the end-to-end DLRM step did not slow
// (experiments/RESULTS.md).
std::chrono::microseconds IdleSpin() {
  static const int64_t us = std::max<int64_t>(0, EnvInt("SPARSEJAX_CPU_SPIN_US", 400));
  return std::chrono::microseconds(us);
}

// Asks for a short scheduler slice for this thread ($SPARSEJAX_CPU_WORKER_SLICE_US,
// default 100 us; 0 keeps the kernel's default). On Linux >= 6.12 (EEVDF custom
// slices) a woken worker then preempts a thread that has used up its slice, such as
// another pool's spinning waiter, instead of queueing behind it for a whole default
// slice (1.4 ms on a 2-CPU VM, longer than most kernel calls). It gives no larger share
// of the CPU; older kernels ignore it.
void RequestShortSlice() {
#if defined(__linux__) && defined(SYS_sched_setattr)
  const int64_t us = EnvInt("SPARSEJAX_CPU_WORKER_SLICE_US", 100);
  if (us <= 0) return;
  struct {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
  } attr{};
  attr.size = sizeof(attr);
  attr.policy = 0;  // SCHED_OTHER
  attr.flags = 0;
  attr.nice = getpriority(PRIO_PROCESS, 0);
  attr.runtime = static_cast<uint64_t>(us) * 1000;
  syscall(SYS_sched_setattr, 0, &attr, 0);  // best effort: failure changes nothing
#endif
}

// Runs fn(t) for t in [0, n): fn(0) on the calling thread, the rest on a persistent
// pool of workers (thread start-up costs ~40 us, as much as a small lookup). Workers
// claim shares [1, n) one by one; once fn(0) returns, the caller runs every share no
// worker has claimed yet and waits only for the claimed ones. So a worker that is slow
// to wake (its core busy with other work) delays nothing: the caller does its share
// instead of waiting for it (with dynamic chunks, the caller then takes all chunks).
// If the pool is busy (XLA may run two custom calls at once) or a worker cannot be
// started, the shares also run on the calling thread: results never depend on the split.
//
// Between calls the pool holds no core for long: an idle worker spins IdleSpin() for the
// next job, then sleeps on a futex. During a call the caller spins (up to 1 ms, then
// sleeps) for the shares workers have claimed.
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
    KeepWorkersOffCallerCpu();
    bool wake;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      next_ = 1;
      end_ = n;
      done_.store(0, std::memory_order_relaxed);
      failed_.store(false, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
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
    if (!SpinUntil(all_done, std::chrono::milliseconds(1))) {
      std::unique_lock<std::mutex> lk(mu_);
      caller_sleeping_ = true;
      done_cv_.wait(lk, all_done);
      caller_sleeping_ = false;
    }
    if (failed || failed_.load()) throw std::runtime_error("worker thread failed");
    return true;
  }

 private:
  // Restricts the workers to the process's CPUs other than the one the caller runs on
  // (re-done only when the caller's CPU changes). A woken worker otherwise tends to stay
  // on its waker's CPU, where it only takes turns with the caller, while the other CPU is
  // held by another thread (PyTorch's OpenMP workers spin ~9 ms after each parallel
  // region); a short slice then lets it preempt that spinner. Without this, half the
  // processes of a same-process benchmark ran at one core's speed throughout.
  // Off with $SPARSEJAX_CPU_AVOID_CALLER=0, and when the workers would have no CPU left.
  void KeepWorkersOffCallerCpu() {
#if defined(__linux__)
    static const bool on = EnvInt("SPARSEJAX_CPU_AVOID_CALLER", 1) != 0;
    const int cpu = sched_getcpu();
    if (!on || cpu < 0 || cpu == caller_cpu_ || handles_.empty()) return;
    caller_cpu_ = cpu;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) != 0 || !CPU_ISSET(cpu, &set)) return;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) < static_cast<int>(handles_.size())) return;
    for (pthread_t h : handles_) pthread_setaffinity_np(h, sizeof(set), &set);
#endif
  }

  void EnsureWorkers(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      try {
        workers_.emplace_back([this] { Loop(); });
        handles_.push_back(workers_.back().native_handle());
        workers_.back().detach();
      } catch (...) {
        return;  // the caller runs that share
      }
    }
  }

  void Loop() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "sparsejax-pool");  // as shown by top -H
#endif
    RequestShortSlice();
    uint64_t seen = 0;
    for (;;) {
      auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!SpinUntil(fresh, IdleSpin())) {
        std::unique_lock<std::mutex> lk(mu_);
        ++sleepers_;
        cv_.wait(lk, fresh);
        --sleepers_;
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
      bool wake;
      {
        std::lock_guard<std::mutex> lk(mu_);  // pairs with the caller's wait
        done_.fetch_add(1, std::memory_order_acq_rel);
        wake = caller_sleeping_;
      }
      if (wake) done_cv_.notify_one();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  std::vector<pthread_t> handles_;  // of workers_, for their CPU affinity
  int caller_cpu_ = -1;             // the caller's CPU when the affinity was last set
  const std::function<void(int)>* job_ = nullptr;  // guarded by mu_, as the next four
  int next_ = 0, end_ = 0;                         // shares [next_, end_) are unclaimed
  int sleepers_ = 0;                               // workers blocked in cv_
  bool caller_sleeping_ = false;                   // the caller is blocked in done_cv_
  std::atomic<int> done_{0};                       // claimed shares finished
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> generation_{0};
};

thread_local Executor* tls_executor = nullptr;

// Whether kernels run on the Executor of their FFI call (XLA's intra-op pool):
// $SPARSEJAX_CPU_POOL=xla; by default ("own") they run on this file's pool. Measured on
// the 2-CPU VM (experiments/RESULTS.md, issue 26): the same train step on either, and
// with PyTorch's pool alive in the process ours kept the embedding-bag forward at
// 1.03-1.04x torch's where XLA's fell to 0.91x (its idle threads stay runnable longer).
bool ExecutorsAllowed() {
  const char* v = std::getenv("SPARSEJAX_CPU_POOL");
  return v != nullptr && std::string(v) == "xla";
}

// The shares of one ParallelFor on an Executor; shared with its tasks, which may start
// after the call has returned (they then find no share left and touch nothing else).
struct ExecutorJob {
  const std::function<void(int)>* fn;
  int n;
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::atomic<bool> failed{false};

  // Claims and runs shares until none is left.
  void Work() {
    for (int t = next.fetch_add(1, std::memory_order_relaxed); t < n;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      try {
        (*fn)(t);
      } catch (...) {
        failed.store(true);
      }
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

// As WorkerPool::TryRun, on `ex`: the caller runs shares too and waits only for the
// shares other threads have claimed, so a pool whose threads are all busy (or a pool
// of one, or tasks run inline) never stalls the call.
void RunOnExecutor(Executor& ex, int n, const std::function<void(int)>& fn) {
  auto job = std::make_shared<ExecutorJob>();
  job->fn = &fn;
  job->n = n;
  const int64_t helpers = std::min<int64_t>(n - 1, std::max<int64_t>(ex.NumThreads(), 1));
  for (int64_t h = 0; h < helpers && job->next.load(std::memory_order_relaxed) < n; ++h) {
    ex.Schedule([job] { job->Work(); });
  }
  job->Work();
  auto all_done = [&] { return job->done.load(std::memory_order_acquire) == n; };
  while (!SpinUntil(all_done, std::chrono::milliseconds(1))) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (job->failed.load()) throw std::runtime_error("worker thread failed");
}

void ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  if (tls_executor != nullptr && ExecutorsAllowed()) {
    RunOnExecutor(*tls_executor, n, fn);
    return;
  }
  if (WorkerPool::Get().TryRun(n, fn)) return;
  for (int t = 0; t < n; ++t) fn(t);  // pool busy: this call runs alone
}

}  // namespace

ScopedExecutor::ScopedExecutor(Executor* executor) : saved_(tls_executor) {
  tls_executor = executor;
}

ScopedExecutor::~ScopedExecutor() { tls_executor = saved_; }

// CPUs this process may run on (its affinity mask: taskset, cgroup cpusets), read once.
int AvailableCpus() {
  static const int n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
      return CPU_COUNT(&set);
    }
#endif
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

int MaxThreads() {
  int64_t n = EnvInt("SPARSEJAX_CPU_THREADS", 0);
  if (n <= 0) n = AvailableCpus();
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
