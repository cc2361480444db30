// Helper threads for jaxserve's C++ kernels on a CPU (models/ggml_ffi.cc, pallas_kernels/cpu_attention.cc):
// Parallel(tasks, body) runs body(i) for every task on the calling thread and the helpers.
//
// XLA's intra-op pool wakes its threads too late for a call of tens of microseconds, so the helpers spin a while
// after each job (as ggml's own threads do), then sleep. Built with g++, the libraries that include this share one set
// of helpers (an inline function's static is then one object per process).

#ifndef JAXSERVE_CPU_THREADS_H_
#define JAXSERVE_CPU_THREADS_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace jaxserve {

// The cores this process may run on (its affinity: a container's share, not the host's count).
inline unsigned Cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// The helpers: one fewer than the cores.
class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers(Cores() - 1);  // never freed
    return *helpers;
  }
  int64_t size() const { return static_cast<int64_t>(threads_); }

  // Hands `job` to every helper; returns at once. A job posted before the helpers took the last one replaces it:
  // its caller runs whatever tasks are left itself.
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      posted_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
  }

 private:
  explicit Helpers(unsigned threads) : threads_(threads) {
    for (unsigned i = 0; i < threads; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(500);
      while (posted_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();  // free at once where a core is, and no core taken where none is (tests, TP)
      }
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return posted_.load() != seen; });
        seen = posted_.load();
        job = job_;
      }
      job();
    }
  }

  unsigned threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::function<void()> job_;
  std::atomic<uint64_t> posted_{0};
};

// Runs body(i) for i in [0, tasks) on the caller and the helpers, taking tasks from a shared counter; returns when
// all are done. A helper that starts late finds none left (the state outlives the call).
template <typename Body>
void Parallel(int64_t tasks, Body body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, body]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < tasks; state->done.fetch_add(1)) body(i);
  };
  if (tasks > 1 && Helpers::Get().size() > 0) Helpers::Get().Post(run);
  run();
  while (state->done.load() < tasks) {
    std::this_thread::yield();  // a helper that took a task may be waiting for this core
  }
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_THREADS_H_
