// nnlite's native kernels' one parallel loop (nnlite/core/_native.py compiles the kernels
// with this folder on the include path): work(unit) for every unit in [0, units), run on
// XLA's own thread pool and on the calling thread, so nnlite's threads never contend with
// XLA's for the cores. The caller takes units too: it never waits on a unit that no thread
// has started, and it returns once every unit is done.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace nnlite {

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units, int64_t threads,
                        const std::function<void(int64_t)>& work) {
  struct Job {
    std::atomic<int64_t> next{0}, left{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto job = std::make_shared<Job>();
  job->left = units;
  auto run = [job, units, &work] {
    for (int64_t u; (u = job->next.fetch_add(1)) < units;) {
      work(u);
      if (job->left.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(job->mu);
        job->cv.notify_all();
      }
    }
  };
  // A helper scheduled after the last unit finds none left and returns without touching
  // `work`, which is gone by then.
  const int64_t helpers = std::min(threads, units) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([run] { run(); });
  run();
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->left.load() == 0; });
}

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units,
                        const std::function<void(int64_t)>& work) {
  ParallelFor(pool, units, pool.num_threads(), work);
}

}  // namespace nnlite
