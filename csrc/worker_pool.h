// The shared worker pool of `sparsejax._cpu_ext` and the parallel loops built on it.
//
// Thread count: $SPARSEJAX_CPU_THREADS, or by default the CPUs in the process's affinity
// mask (taskset, cgroup cpusets), the calling thread included. Work below
// $SPARSEJAX_CPU_MIN_PARALLEL items per thread (default 4096) runs on fewer threads (one
// for tiny inputs). Results never depend on the thread count: every loop below hands
// out disjoint chunks, and each chunk is computed the same way on whichever thread.
//
// With $SPARSEJAX_CPU_POOL=xla, the loops of an XLA FFI call run on XLA's own intra-op
// pool instead (see Executor).
//
// The pool shares the machine with other thread pools (PyTorch's OpenMP team, XLA's,
// data loaders): idle workers spin briefly ($SPARSEJAX_CPU_SPIN_US, default 400) and
// then sleep, a late worker's share is run by the caller, workers keep off the
// caller's CPU ($SPARSEJAX_CPU_AVOID_CALLER=0 turns that off) and ask for a short
// scheduler slice ($SPARSEJAX_CPU_WORKER_SLICE_US, default 100; 0 = the kernel default)
// so that they are not queued behind another pool's spinning thread. See worker_pool.cc.

#ifndef SPARSEJAX_CSRC_WORKER_POOL_H_
#define SPARSEJAX_CSRC_WORKER_POOL_H_

#include <cstdint>
#include <functional>

namespace sparsejax {

// Chunks per thread for dynamic scheduling.
constexpr int kChunksPerThread = 8;

// The most threads a kernel may use.
int MaxThreads();

// Number of threads for `work` items: one per $SPARSEJAX_CPU_MIN_PARALLEL items.
int ThreadsFor(int64_t work);

// A thread pool other than ours that ParallelChunks may run on, e.g. XLA's intra-op pool
// during an FFI call (common.h XlaPool): its threads are the ones XLA already keeps busy,
// so a kernel adds no threads of its own that would compete with them for the cores.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual int64_t NumThreads() const = 0;
  // Runs task() on some thread of the pool, possibly later, possibly on the caller.
  virtual void Schedule(std::function<void()> task) = 0;
};

// While alive, ParallelChunks calls on this thread run on `executor` (nullptr: on ours)
// when $SPARSEJAX_CPU_POOL=xla (see worker_pool.cc ExecutorsAllowed for the default).
class ScopedExecutor {
 public:
  explicit ScopedExecutor(Executor* executor);
  ~ScopedExecutor();
  ScopedExecutor(const ScopedExecutor&) = delete;
  ScopedExecutor& operator=(const ScopedExecutor&) = delete;

 private:
  Executor* saved_;
};

// Runs fn(c) for every chunk c in [0, nchunks) on up to `nthreads` threads (the caller
// among them) that grab chunks dynamically, so a thread that is slow to run (its core
// busy with other work) only delays the chunk it holds. Exceptions propagate.
void ParallelChunks(int nthreads, int64_t nchunks, const std::function<void(int64_t)>& fn);

// Runs fn(begin, end) over disjoint ranges covering [0, n), on up to MaxThreads()
// threads (dynamic chunks, each of at least `grain` items; one thread when n <= grain).
void ParallelRange(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace sparsejax

#endif  // SPARSEJAX_CSRC_WORKER_POOL_H_
