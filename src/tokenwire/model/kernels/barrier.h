// A barrier for the threads of one parallel region that spins for a bounded time, then sleeps.
// Part of tokenwire's CPU kernels: included once, by quant_cpu.cpp (via decode_stack.h).
//
// Why not `#pragma omp barrier`: libgomp's waiters spin GOMP_SPINCOUNT iterations (300,000 by
// default, cut to ~1,000 once a process has more OpenMP threads than CPUs) and then sleep on a
// futex, with no bound in time. When another process shares a core, the partner of a waiting
// thread is off its CPU for whole scheduler slices; docs/engine.md ("Sharing the machine") has
// the measurements.
// This one spins at most `g_spin_ns` of wall-clock time (checked every 64 pauses), then sleeps on
// a futex until the last participant arrives, so a preempted partner costs its sleeping
// partners no CPU and a running partner a wait of microseconds.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tw {

// How long a waiter spins before it sleeps (set_barrier_spin_us): a running partner arrives
// within microseconds (a layer's stages are 10-700 us), a preempted one after a time slice.
inline std::atomic<int64_t> g_spin_ns{100'000};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class SpinThenSleepBarrier {
 public:
  // Every participant calls wait(n) with the same n (the region's thread count); returns once
  // all n have arrived, with every write made before any participant's arrival visible.
  // Returns the nanoseconds this participant waited (0 for the last to arrive).
  int64_t wait(int n) {
    if (n <= 1) return 0;
    const uint32_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);  // releases the waiters
      if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
      return 0;
    }
    const int64_t spin_ns = g_spin_ns.load(std::memory_order_relaxed);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (generation_.load(std::memory_order_acquire) != gen) return since(start);
        cpu_relax();
      }
      if (since(start) >= spin_ns) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == gen) sleep_while(gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return since(start);
  }

 private:
  static int64_t since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count();
  }
  // the futex word is the generation: a sleeper re-checks it in the kernel, so a release between
  // its load and its sleep is never missed (the releaser bumps it before reading sleepers_)
  void sleep_while(uint32_t gen) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0);
#else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
  }
  void wake_all() {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#endif
  }
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word must be a plain uint32");
  alignas(64) std::atomic<uint32_t> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

// The team size of the fused decode step, chosen by what the last steps measured. When another
// process holds one of the cores as often as we do (a process in another session: with
// autogroup scheduling a `nice 19` loop there weighs as much as our whole server), every barrier
// waits for a partner that is off its core and the step ping-pongs between the two cores'
// time slices (docs/engine.md, "Sharing the machine"). Two team steps in a row whose threads
// spent more than kContended of their time waiting start a span of solo steps (the calling
// thread alone, no barrier); then one team step probes: if its time per row and layer beats the
// solo steps', the team stays, else the next span is twice as long (8 .. max_span steps, at
// most 1 s). A lone contended step (a low-priority neighbour's slice) stays on the team. Large
// batches often keep the team even when contended: their long matvecs between barriers lose
// less to a late partner than one thread's half speed.
class TeamGate {
 public:
  // waiting above this share of the team's time marks a step contended: quiet steps measured
  // 0.02-0.04 (stack) and 0.00-0.03 (other steps), contended ones 0.17-0.67 (docs/engine.md)
  static constexpr double kContended = 0.35;

  // A solo span ends after max_span units or kMaxSpanNs, whichever comes first: what a return
  // to a quiet machine may cost before a probe sees it. Without the time bound a 1B model's
  // span of 512 decode steps (~50 ms each solo) kept a quiet machine on one thread for 25 s.
  static constexpr int64_t kMaxSpanNs = 1'000'000'000;
  explicit TeamGate(int max_span) : max_span_(max_span) {}

  enum Mode { kFixed = 0, kAdaptive = 1, kSolo = 2 };  // kFixed, kSolo: measurements and tests

  int team(int threads) {
    const int m = mode.load(std::memory_order_relaxed);
    if (threads <= 1 || m == kFixed) return threads;
    if (m == kSolo) return 1;
    const int left = solo_left_.load(std::memory_order_relaxed);
    if (left <= 0) return threads;
    if (now_ns() - span_start_ns_ > kMaxSpanNs) {  // probe now: the machine may be quiet again
      solo_left_.store(0, std::memory_order_relaxed);
      return threads;
    }
    solo_left_.store(left - 1, std::memory_order_relaxed);
    return 1;
  }
  // after every step of `units` rows x layers; `team` = what team() returned, of `threads`
  void report(int64_t waited_ns, int team, int threads, int64_t wall_ns, int64_t units) {
    if (threads <= 1 || wall_ns <= 0 || units <= 0) return;
    const double per_unit = static_cast<double>(wall_ns) / static_cast<double>(units);
    (team == 1 ? solo_total : team_total).fetch_add(1, std::memory_order_relaxed);
    if (team == 1) {  // a solo step
      solo_ns_ += per_unit;
      ++solo_steps_;
      return;
    }
    const double fraction = static_cast<double>(waited_ns) / (static_cast<double>(team) * wall_ns);
    last_fraction.store(fraction, std::memory_order_relaxed);
    if (span_ > 0) {  // the probe after a solo span
      const bool team_wins = solo_steps_ == 0 || per_unit <= solo_ns_ / solo_steps_;
      solo_ns_ = 0;
      solo_steps_ = 0;
      if (team_wins) {
        span_ = strikes_ = 0;
        return;
      }
    } else if (fraction <= kContended || ++strikes_ < 2) {
      if (fraction <= kContended) strikes_ = 0;
      return;
    }
    span_ = std::min(max_span_, std::max(8, span_ * 2));
    span_start_ns_ = now_ns();
    solo_left_.store(span_, std::memory_order_relaxed);
  }
  // a mode change starts afresh: no span under way, nothing learnt (measurements and tests call
  // it between runs, with no step under way)
  void set_mode(int m) {
    mode.store(m, std::memory_order_relaxed);
    solo_left_.store(0, std::memory_order_relaxed);
    span_ = strikes_ = 0;
    solo_ns_ = 0;
    solo_steps_ = 0;
  }
  // whether single-threaded steps are due: the lm_head follows it
  bool solo() const {
    return mode.load(std::memory_order_relaxed) == kSolo || solo_left_.load(std::memory_order_relaxed) > 0;
  }
  int solo_left() const { return solo_left_.load(std::memory_order_relaxed); }

  std::atomic<int> mode{kAdaptive};
  std::atomic<double> last_fraction{0.0};
  std::atomic<int64_t> solo_total{0}, team_total{0};  // steps run each way (diagnostics)

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::atomic<int> solo_left_{0};
  const int max_span_;
  int64_t span_start_ns_ = 0;
  int span_ = 0, strikes_ = 0;
  double solo_ns_ = 0;
  int64_t solo_steps_ = 0;
};

// g_team: the fused decode stack, which measures its barrier waits itself. g_step_team: every
// other step (prefill chunks, mixed batches: MKL's GEMM, torch's attention, qmatmul), whose
// OpenMP waits it cannot see: the engine reports their waiting as the team's CPU time missing
// from threads x wall (engine/step_team.py). Its steps are decoder layers of 2-50 ms (a decode
// step is ~5 ms in all), so its spans stop at 64.
inline TeamGate g_team{512}, g_step_team{64};

// Test hook (the barrier_probe op): `n` threads meet `rounds` times; before each meeting
// participant 0 sleeps `sleep_ms`. Per participant: CPU seconds and wall seconds spent inside
// wait() (its thread CPU clock) and the number of rounds in which it saw every participant's
// write of that round after the barrier.
inline std::vector<double> barrier_probe(int n, int rounds, double sleep_ms) {
  SpinThenSleepBarrier barrier;
  std::vector<int64_t> slots(n, -1);
  std::vector<double> out(3 * n, 0.0);
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  };
  auto body = [&](int id) {
    for (int r = 0; r < rounds; ++r) {
      if (id == 0) std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(sleep_ms * 1000)));
      slots[id] = static_cast<int64_t>(r) * n + id;
      const double c0 = cpu_now();
      const auto w0 = std::chrono::steady_clock::now();
      barrier.wait(n);
      out[3 * id] += cpu_now() - c0;
      out[3 * id + 1] += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      int64_t sum = 0;
      for (int i = 0; i < n; ++i) sum += slots[i];
      out[3 * id + 2] += sum == static_cast<int64_t>(r) * n * n + static_cast<int64_t>(n) * (n - 1) / 2;
      barrier.wait(n);  // nobody writes the next round's slot while another still reads
    }
  };
  std::vector<std::thread> team;
  for (int id = 1; id < n; ++id) team.emplace_back(body, id);
  body(0);
  for (auto& t : team) t.join();
  return out;
}

}  // namespace tw
