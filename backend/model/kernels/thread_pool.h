// The kernels' own worker pool: a parallel loop whose caller returns when every chunk of work is done, not when
// every thread has arrived. Chunks are claimed one at a time from a shared counter, so a thread the OS has taken
// off its core (for tritonserver, the stub's sender thread, a client) leaves its share to the others instead of
// holding up the whole op, as a fork/join region (OpenMP's, which ATen's parallel_for uses) does at its closing
// barrier. Idle workers poll for a short while, then sleep.
#pragma once
#include <algorithm>
#include <cstdint>

namespace pool {

using ChunkFn = void (*)(void* context, int64_t chunk);

// Runs fn(context, c) for every c in [0, chunks) on the calling thread and up to `threads` - 1 workers, returning
// when all are done; rethrows the first exception a chunk threw. Serial where threads <= 1, chunks == 1 or the
// pool is busy with another caller's job.
void run(int64_t chunks, int threads, ChunkFn fn, void* context);

// Threads a loop gets: as set (the engine sets its thread count), else torch's intra-op thread count.
int threads();
void set_threads(int threads);  // 0: follow torch.set_num_threads

// body(begin, end) over [0, n) in chunks of `grain`, on `threads()` threads.
template <class Body>
void parallel_for(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  struct Loop {
    const Body* body;
    int64_t n, grain;
  } loop{&body, n, grain};
  run((n + grain - 1) / grain, threads(),
      [](void* context, int64_t chunk) {
        const Loop* l = static_cast<const Loop*>(context);
        const int64_t begin = chunk * l->grain;
        (*l->body)(begin, std::min(l->n, begin + l->grain));
      },
      &loop);
}

}  // namespace pool
