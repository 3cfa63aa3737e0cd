// The worker pool of thread_pool.h. A job is published as a generation number; its chunks are claimed with a
// compare-and-swap on one 64-bit word holding (generation, next chunk), so a worker that wakes late, after its
// job finished, can never claim a chunk of the next job with the last job's function: the claim fails on the
// generation. The job's function, context and chunk count are separate words: before writing them, the next
// job moves the claim word to its own generation, and a worker re-reads the claim word after reading them, so a
// worker that read any of them from the next job sees the generation change and claims nothing (it once ran the
// last job's function on the next job's context: a crash with more threads than free cores). The caller claims
// chunks like any worker, then waits until the done count reaches the chunk count.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace pool {
namespace {

// How long an idle worker polls for the next job before it sleeps: long enough to span the gaps between a step's
// ops (microseconds), short enough not to hold a core between steps. It polls with sched_yield, so any other
// runnable thread on its core (the server's) runs first.
constexpr auto kPollFor = std::chrono::microseconds(200);
// The chunk index of a claim word whose job is not yet written: above any chunk count (those are below 2^31).
constexpr uint64_t kNotReady = 0xffffffffu;

struct Pool {
  std::atomic<uint64_t> claim{0};  // generation << 32 | next chunk
  std::atomic<uint32_t> generation{0};
  std::atomic<int64_t> chunks{0}, done{0};
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<void*> context{nullptr};
  std::atomic<int> participants{0};  // the caller and workers 1 .. participants - 1
  std::mutex error_mutex;
  std::exception_ptr error;
  std::mutex sleep_mutex;
  std::condition_variable wake;
  std::mutex submit;  // one job at a time
  int workers = 0;    // started, never stopped (detached; the process's exit ends them)

  // Claims and runs chunks of job `g` until none is left.
  void work(uint32_t g) {
    const ChunkFn f = fn.load(std::memory_order_acquire);
    void* const ctx = context.load(std::memory_order_acquire);
    const int64_t n = chunks.load(std::memory_order_acquire);
    // Read after them: if any of the three is the next job's, written after that job took the claim word (acquire
    // on release), this load sees the next generation and the loop below returns.
    uint64_t v = claim.load(std::memory_order_acquire);
    for (;;) {
      if (uint32_t(v >> 32) != g || int64_t(v & 0xffffffffu) >= n) return;
      if (!claim.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      try {
        f(ctx, int64_t(v & 0xffffffffu));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      done.fetch_add(1, std::memory_order_release);
      v = claim.load(std::memory_order_acquire);
    }
  }

  // Worker `index` runs every job after generation `seen`.
  void worker_loop(int index, uint32_t seen) {
    const std::string name = "llm-kernel-" + std::to_string(index);  // for top -H and /proc (15 bytes)
    pthread_setname_np(pthread_self(), name.c_str());
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint32_t g;
      for (int polls = 1; (g = generation.load(std::memory_order_acquire)) == seen; ++polls) {
        sched_yield();
        if (polls % 16 == 0 && std::chrono::steady_clock::now() - since > kPollFor) {
          std::unique_lock<std::mutex> lock(sleep_mutex);
          wake.wait(lock, [&] { return generation.load(std::memory_order_acquire) != seen; });
          since = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      if (index < participants.load(std::memory_order_acquire)) work(g);
    }
  }

  void run(int64_t n, int threads, ChunkFn f, void* ctx) {
    if (n > 0x7fffffff) throw std::length_error("a parallel loop of more than 2^31 chunks");
    const uint32_t last = generation.load(std::memory_order_relaxed);
    while (workers < threads - 1) {
      std::thread([this, index = ++workers, last] { worker_loop(index, last); }).detach();
    }
    const uint32_t g = last + 1;
    // Every claim of the last job fails from here on (its generation is gone; chunk index kNotReady claims nothing).
    claim.store(uint64_t(g) << 32 | kNotReady, std::memory_order_release);
    error = nullptr;
    fn.store(f, std::memory_order_release);
    context.store(ctx, std::memory_order_release);
    chunks.store(n, std::memory_order_release);
    done.store(0, std::memory_order_release);
    participants.store(threads, std::memory_order_release);
    claim.store(uint64_t(g) << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex);  // a worker between its check and its wait sees it
      generation.store(g, std::memory_order_release);
    }
    wake.notify_all();
    work(g);
    while (done.load(std::memory_order_acquire) < n) _mm_pause();
    if (error) std::rethrow_exception(error);
  }
};

Pool* the_pool = new Pool;  // never destroyed: its detached workers may outlive static destructors

// A forked child has none of the parent's workers (and maybe a lock some thread held): start afresh.
[[maybe_unused]] const int at_fork = pthread_atfork(nullptr, nullptr, [] { the_pool = new Pool; });

}  // namespace

void run(int64_t chunks, int threads, ChunkFn fn, void* context) {
  Pool& p = *the_pool;
  std::unique_lock<std::mutex> lock(p.submit, std::try_to_lock);
  if (threads <= 1 || chunks <= 1 || !lock.owns_lock()) {
    for (int64_t c = 0; c < chunks; ++c) fn(context, c);
    return;
  }
  p.run(chunks, threads, fn, context);
}

namespace {
std::atomic<int> configured{0};
}  // namespace

void set_threads(int threads) { configured.store(threads, std::memory_order_relaxed); }

int threads() {
  const int n = configured.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

}  // namespace pool
