// The worker threads the C++ CPU kernels' parallel passes run on (cpu_parallel.h's parallel_runs):
// the calling thread plus torch's thread count less one, kept awake between passes for a while.
//
// Why not torch's OpenMP pool: the engine runs OpenMP with OMP_WAIT_POLICY=PASSIVE (engine/__init__.py:
// spinning OpenMP threads made a step 10x slower when other work shared the cores), so each of a
// decode step's 50-70 passes woke a sleeping thread, and on a KVM guest's idle vCPU a wake-up and the
// join after it cost 100-200 us (a 2-core Zen 4 VM: a one-row product over 4 MB of float32 weights
// took about 200 us on two OpenMP threads, 90 us on one, 50 us on this team).
//
// Here a worker that finishes a pass spins (pause instructions) for up to the spin window
// (KIMITUI_CPU_SPIN_US, 5000 us by default), then sleeps: the passes of one decode step, 20-200 us
// apart, and the next step's first pass find it awake, while an idle engine's workers sleep. Spinning
// is right only while the team has the cores to itself: a spinning thread holds a core that another
// runnable thread (another process, the TUI, torch's own OpenMP threads) then waits for, and once
// preempted it waits a whole time slice for it back, where a thread waking from sleep is let in
// at once (with two busy processes on a 2-core machine, a decode step took 60-80 ms spinning, 40-70
// ms with OpenMP's sleeping threads). So while more threads are runnable on the machine than it
// has CPUs online (/proc/loadavg), workers sleep as soon as a pass ends and the caller waits for
// the workers' last runs asleep, as OpenMP's passive threads do.
//
// One team per calling thread, as libgomp keeps one pool per thread that starts a region: the engine's
// thread has one, and so does each host-experts worker (one per NUMA node, pinned to the node's CPUs:
// its team's threads inherit the mask, and a team has at most one thread per CPU of that mask). A
// thread's team stops when the thread exits. Both extensions compile this header; kernels/
// cpu_quant_moe.py hands the few-row extension's teams (team_capsule) to the packed-experts extension
// (use_team), so a thread calling both runs one team, not two spinning against each other.
#pragma once

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KIMITUI_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define KIMITUI_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define KIMITUI_CPU_RELAX() ((void)0)
#endif

namespace kimitui_cpu {

// body(ctx, i) for i in [0, threads): the calling thread runs i = 0. The bodies must each be able to
// finish the whole job alone (they take their work from a shared counter): a nested call (from inside
// a pass) runs body(ctx, 0) alone on the calling thread.
using TeamBody = void (*)(void* ctx, int64_t index);
using TeamRun = void (*)(int64_t threads, TeamBody body, void* ctx);
// The name of the Python capsule that carries a TeamRun from one extension to another.
constexpr const char* kTeamCapsule = "kimitui_cpu.TeamRun";

class Team : public std::enable_shared_from_this<Team> {
 public:
  // The calling thread's team, started on its first pass.
  static Team& get() {
    static const bool registered = [] {
      // a forked child has only the forking thread: it starts a new team on its first pass (the
      // parent's is left as it was, never destroyed: its threads are gone, perhaps with a lock held)
      pthread_atfork(nullptr, nullptr, [] { new std::shared_ptr<Team>(std::move(holder().team)); });
      return true;
    }();
    (void)registered;
    auto& h = holder();
    if (!h.team) h.team = std::make_shared<Team>();
    return *h.team;
  }

  // TeamRun for the calling thread's team.
  static void run_on(int64_t threads, TeamBody body, void* ctx) { get().run(threads, body, ctx); }

  // While quiet (QuietTeam below), workers sleep as soon as a pass ends, and a worker still spinning
  // after an earlier pass goes to sleep.
  void quiet(int delta) { quiet_.fetch_add(delta, std::memory_order_relaxed); }

  void run(int64_t threads, TeamBody body, void* ctx) {
    threads = std::min({threads, kMaxThreads, cpus_});
    if (threads <= 1 || t_inside_) {  // (only the owning thread runs its team's passes: get())
      body(ctx, 0);
      return;
    }
    grow(threads - 1);
    body_ = body;
    ctx_ = ctx;
    pending_.store(threads - 1, std::memory_order_relaxed);
    // the pass's thread count travels in the low bits of gen_, so a worker outside this pass never reads
    // a later pass's fields; seq_cst: against a worker's sleepers_ increment (wait_for_pass)
    const uint64_t next = ((gen_.load(std::memory_order_relaxed) >> kCountBits) + 1) << kCountBits;
    gen_.store(next | static_cast<uint64_t>(threads));
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    t_inside_ = true;
    body(ctx, 0);
    t_inside_ = false;
    join();
  }

 private:
  static constexpr int kCountBits = 16;
  static constexpr int64_t kMaxThreads = (int64_t{1} << kCountBits) - 1;
  static constexpr int64_t kSpinWindowUs = 5000;  // KIMITUI_CPU_SPIN_US overrides
  using Clock = std::chrono::steady_clock;
  // The caller waits this long for the workers' last runs spinning, then asleep.
  static constexpr auto kJoinSpin = std::chrono::microseconds(50);
  // How often the machine's runnable threads are counted (crowded).
  static constexpr auto kSample = std::chrono::milliseconds(1);

  // A thread's team, told to stop when the thread exits (its workers then end, the last one freeing it).
  struct Holder {
    std::shared_ptr<Team> team;
    ~Holder() {
      if (team) team->stop();
    }
  };
  static Holder& holder() {
    static thread_local Holder h;
    return h;
  }

  static std::chrono::microseconds spin_window() {
    const char* env = std::getenv("KIMITUI_CPU_SPIN_US");
    return std::chrono::microseconds(env && *env ? std::max(0L, std::atol(env)) : kSpinWindowUs);
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
  }

  // More runnable threads on the machine than it has CPUs online (Linux's /proc/loadavg, read at most
  // once per kSample): a spinning thread would take a core another thread is waiting for. Where the
  // file cannot be read, never crowded.
  bool crowded(Clock::time_point now) {
    const int64_t t = now.time_since_epoch().count();
    if (t - sampled_at_.load(std::memory_order_relaxed) < std::chrono::duration_cast<Clock::duration>(kSample).count())
      return crowded_.load(std::memory_order_relaxed);
    sampled_at_.store(t, std::memory_order_relaxed);
    const bool c = runnable_threads() > online_cpus_;
    crowded_.store(c, std::memory_order_relaxed);
    return c;
  }

  // The 4th field of /proc/loadavg, "running/total": threads runnable now, the reader included; 0 when
  // unreadable.
  static int64_t runnable_threads() {
    char buf[128];
    const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
    ::close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char* p = buf;
    for (int field = 0; field < 3 && p; ++field)
      if ((p = std::strchr(p, ' '))) ++p;
    return p ? std::strtoll(p, nullptr, 10) : 0;
  }

  static int64_t allowed_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return std::max(1u, std::thread::hardware_concurrency());
    return std::max(1, CPU_COUNT(&set));
  }

  // Workers 1..n exist (the calling thread is index 0).
  void grow(int64_t n) {
    while (workers_ < n) {
      const int64_t index = ++workers_;
      std::thread([self = shared_from_this(), index, seen = gen_.load()] { self->work(index, seen); }).detach();
    }
  }

  void work(int64_t index, uint64_t seen) {
    t_inside_ = true;  // a kernel's nested pass runs on this thread alone
    for (;;) {
      seen = wait_for_pass(seen);
      if (stop_.load()) return;
      if (index < static_cast<int64_t>(seen & kMaxThreads)) {
        body_(ctx_, index);
        // seq_cst, then read joiner_asleep_: the caller sets it, then reads pending_ (join)
        if (pending_.fetch_sub(1) == 1 && joiner_asleep_.load()) {
          std::lock_guard<std::mutex> lock(mutex_);
          done_.notify_one();
        }
      }
    }
  }

  // Spin until done() holds; false, giving up, at `until`, when the machine is crowded or the team stops
  // (the clock and the machine are looked at every 64 pauses).
  template <typename Done>
  bool spin_until(const Done& done, Clock::time_point until) {
    for (int64_t i = 1; !done(); ++i) {
      if (i % 64 == 1) {
        const auto now = Clock::now();
        if (now >= until || crowded(now) || stop_.load()) return false;
      }
      KIMITUI_CPU_RELAX();
    }
    return true;
  }

  // Spin until the next pass or the end of the spin window (at once when the machine is crowded), then
  // sleep until it comes.
  uint64_t wait_for_pass(uint64_t seen) {
    auto next = [&] { return gen_.load(std::memory_order_acquire) != seen; };
    auto quiet = [&] { return quiet_.load(std::memory_order_relaxed) > 0; };
    if (!quiet() && spin_until([&] { return next() || quiet(); }, Clock::now() + spin_) && next())
      return gen_.load(std::memory_order_acquire);
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1);  // seq_cst, then read gen_: run() stores gen_, then reads sleepers_
    wake_.wait(lock, [&] { return gen_.load() != seen || stop_.load(); });
    sleepers_.fetch_sub(1);
    return gen_.load(std::memory_order_acquire);
  }

  // Wait for the workers' last runs: spinning for up to kJoinSpin (the runs are short when the workers
  // have their cores), then asleep, as at once on a crowded machine: a worker that lost its core needs
  // one back.
  void join() {
    if (spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, Clock::now() + kJoinSpin)) return;
    std::unique_lock<std::mutex> lock(mutex_);
    joiner_asleep_.store(true);  // seq_cst, then read pending_: a worker decrements it, then reads this
    done_.wait(lock, [&] { return pending_.load() == 0; });
    joiner_asleep_.store(false);
  }

  static inline thread_local bool t_inside_ = false;

  std::mutex mutex_;  // for the condition variables
  std::condition_variable wake_;  // a pass for sleeping workers
  std::condition_variable done_;  // the last worker's run for a sleeping caller
  std::atomic<uint64_t> gen_{0};  // pass number << kCountBits | the pass's thread count
  std::atomic<int64_t> pending_{0};  // workers yet to finish this pass
  std::atomic<int64_t> sleepers_{0};
  std::atomic<bool> joiner_asleep_{false};
  std::atomic<int64_t> sampled_at_{std::numeric_limits<int64_t>::min() / 2};  // crowded_'s Clock time
  std::atomic<bool> crowded_{false};
  const int64_t cpus_ = allowed_cpus();  // the creating (calling) thread's CPUs: at most one thread each
  const int64_t online_cpus_ = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  std::atomic<bool> stop_{false};
  std::atomic<int> quiet_{0};  // QuietTeam guards alive on the owning thread
  int64_t workers_ = 0;  // started (by the owning thread only)
  TeamBody body_ = nullptr;
  void* ctx_ = nullptr;
  const std::chrono::microseconds spin_ = spin_window();
};

// The calling thread's team kept quiet while this lives (when `on`): its workers sleep as soon as a
// pass ends instead of spinning for the spin window. For calls whose other passes run on torch's
// OpenMP threads (oneDNN's bf16 products from 6 rows on): there a spinning worker holds a core that
// an OpenMP thread then waits for. A decode step of 64 rows on the 2-core AMX Xeon (bf16 model of
// benchmarks/vs_vllm_cpu.py), whose products are oneDNN's and whose MLA and MoE run on this team, took
// 155 ms spinning against 98 ms with KIMITUI_CPU_SPIN_US=0 (contended, load average 1.2-1.6); the
// passes of a quiet call pay a wake-up each instead.
class QuietTeam {
 public:
  explicit QuietTeam(bool on) : team_(on ? &Team::get() : nullptr) {
    if (team_) team_->quiet(1);
  }
  ~QuietTeam() {
    if (team_) team_->quiet(-1);
  }
  QuietTeam(const QuietTeam&) = delete;
  QuietTeam& operator=(const QuietTeam&) = delete;

 private:
  Team* team_;
};

}  // namespace kimitui_cpu
