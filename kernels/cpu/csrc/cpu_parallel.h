// How the C++ CPU kernels (cpu_few_rows*, cpu_mla_decode, cpu_quant_moe) share work between threads:
// runs of consecutive work items, each run taken by whichever thread is free next, on the kernels'
// own team of torch's thread count (cpu_team.h; torch's OpenMP threads sleep between regions).
//
// Not a static split: a pass's other threads start when they see it (at once when spinning, after a
// wake-up when they had gone to sleep), and with a fixed share each the calling thread finished its
// share and then waited for theirs; here it takes their runs meanwhile. Runs, not single items:
// consecutive items are consecutive weight rows or tiles, so a thread's next item is the one its
// prefetches (which run past the end of an item) already asked for; one item at a time, a thread's
// next item was two on and began with cache misses (at 16 KB expert tiles a decode step's experts ran
// at about half the bandwidth they reach in long runs). 8 runs per thread keep the shares even when
// items differ in cost. Which thread computes an item never changes its bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <cstdint>
#include <limits>

#include "cpu_team.h"

namespace kimitui_cpu {

// A job that reads fewer bytes than this runs on the calling thread: below it, handing a pass to the
// team costs what the second thread saves (a one-row float32 product, weights in cache, on a 2-core
// Zen 4 KVM guest with the team awake: 128 KB 4.2 us alone, 4.3 on two threads; 256 KB 6.3 against
// 5.5; 512 KB 11.0 against 7.7; 1 MB 21.4 against 12.7). With OpenMP's sleeping threads one
// thread beat two up to about 2 MB: a wake-up cost 100-200 us.
constexpr int64_t kInlineBytes = int64_t{256} << 10;
// `bytes` for a job that always goes to the threads, whatever it reads.
constexpr int64_t kAlwaysSplit = std::numeric_limits<int64_t>::max();

// The team passes run on: this extension's own (Team::run_on), or the one use_team() installed.
inline TeamRun& team_run() {
  static TeamRun run = &Team::run_on;
  return run;
}

namespace detail {

// fn(i0, i1) over [0, n) in runs of `run` items from a shared counter, on `threads` team threads.
template <typename F>
void team_for(int64_t threads, int64_t n, int64_t run, const F& fn) {
  struct Job {
    const F& fn;
    int64_t n, run;
    std::atomic<int64_t> next{0};
    std::exception_ptr error;
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
  } job{fn, n, run};
  team_run()(threads, [](void* ctx, int64_t) {
    auto& j = *static_cast<Job*>(ctx);
    try {
      for (int64_t i0 = j.next.fetch_add(j.run); i0 < j.n; i0 = j.next.fetch_add(j.run))
        j.fn(i0, std::min(j.n, i0 + j.run));
    } catch (...) {  // the first error goes to the caller; the other threads take no more runs
      j.next.store(j.n);
      if (!j.failed.test_and_set()) j.error = std::current_exception();
    }
  }, &job);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace detail

// fn(i0, i1) over [0, n) in runs of consecutive items, for a job that reads about `bytes`; on the
// calling thread alone (one fn(0, n)) when the job is small (kInlineBytes), torch has one thread, or
// this already runs inside an OpenMP region (inside a team pass the team runs it on one thread too).
template <typename F>
void parallel_runs(int64_t n, int64_t bytes, const F& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || bytes < kInlineBytes || at::in_parallel_region()) {
    fn(int64_t{0}, n);
    return;
  }
  detail::team_for(threads, n, std::max<int64_t>(1, n / (8 * threads)), fn);
}

// fn(i) for i in [0, n), each item taken by whichever thread is free next (items of very unequal cost).
// `calls_aten`: some item calls ATen (a BLAS product): then the items run on torch's OpenMP threads,
// inside whose region ATen and BLAS stay on the calling thread (on a team thread they would start
// OpenMP teams of their own).
template <typename F>
void dynamic_for(int64_t n, bool calls_aten, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (calls_aten) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < n; i = next++) fn(i);
    });
    return;
  }
  detail::team_for(threads, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i);
  });
}

}  // namespace kimitui_cpu
