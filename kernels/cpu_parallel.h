// How the C++ CPU kernels (cpu_few_rows*, cpu_mla_decode, cpu_quant_moe) share work between torch's
// threads: runs of consecutive work items, each run taken by whichever thread is free next.
//
// Not a static split: under OMP_WAIT_POLICY=PASSIVE (the engine's default) a region's other threads
// start when they wake, and with a fixed share each the calling thread finished its share and then
// waited a whole wake-up for theirs; here it takes their runs meanwhile. Runs, not single items:
// consecutive items are consecutive weight rows or tiles, so a thread's next item is the one its
// prefetches (which run past the end of an item) already asked for; one item at a time, a thread's
// next item was two on and began with cache misses (at 16 KB expert tiles a decode step's experts ran
// at about half the bandwidth they reach in long runs). 8 runs per thread keep the shares even when
// items differ in cost. Which thread computes an item never changes its bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

namespace kimitui_cpu {

// A job that reads fewer bytes than this runs on the calling thread. Waking a sleeping OpenMP thread
// takes 100-200 us on a KVM guest's idle vCPU (a 2-core Zen 4 VM: a one-row product over 512 KB of
// weights took 77 us on one thread against 115 us on two, 1 MB 118 against 139, 2 MB about even),
// some 10-20 us on bare metal, where one core streams 1 MB in 50-70 us: at most a few tens of us
// lost there, for jobs this small only (a Kimi-sized layer's matrices are all larger).
constexpr int64_t kInlineBytes = int64_t{1} << 20;
// `bytes` for a job that always goes to the threads, whatever it reads.
constexpr int64_t kAlwaysSplit = std::numeric_limits<int64_t>::max();

// fn(i0, i1) over [0, n) in runs of consecutive items, for a job that reads about `bytes`; on the
// calling thread alone (one fn(0, n)) when the job is small (kInlineBytes), torch has one thread, or
// this already runs inside a parallel region.
template <typename F>
void parallel_runs(int64_t n, int64_t bytes, const F& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || bytes < kInlineBytes || at::in_parallel_region()) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t run = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0 = next.fetch_add(run); i0 < n; i0 = next.fetch_add(run)) fn(i0, std::min(n, i0 + run));
  });
}

}  // namespace kimitui_cpu
