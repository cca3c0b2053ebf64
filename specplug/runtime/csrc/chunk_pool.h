// A small persistent thread pool whose parallel calls finish with the cores that actually run.
//
// Why not at::parallel_for (OpenMP): it splits a call statically, one range per thread, and the
// caller waits at the region's barrier for every thread. When the OS deschedules one thread (a
// browser, a second job, `specplug train data` beside a benchmark), the whole step waits for it:
// on 2 cores with one busy neighbour, 2 threads decoded at 0.46x the speed of 1 thread (issue 27).
//
// Here a call is cut into short chunks. Each thread (the caller is one) owns a contiguous share
// of them, as in a static split, and claims its chunks in order from an atomic counter of its
// own; a thread that has finished its share claims the rest of the others' shares from their
// back ends. So on idle cores a call runs like a static split (each thread streams its own part
// of the weights, counters stay in their owners' caches), and when the OS deschedules a thread
// the running ones take over its unclaimed chunks. The call is over when every chunk is done
// (counted atomically): nobody waits for a worker to arrive anywhere. A worker that wakes late
// finds no chunk left and goes back to waiting. The only wait left is for a chunk another
// thread claimed and has not finished, so chunks are kept short (the kernels size them; see
// CHUNK_BYTES in gguf_kernels.cpp).
//
// Exactness is the caller's: each chunk writes its own outputs in a fixed order, so which thread
// runs a chunk changes no bit of the result.
//
// Waiting: spin briefly (a new call or the last chunk usually comes within microseconds), then
// park on a futex (frees the core for whoever has work, and lets the scheduler move a straggler
// onto it). A worker that arrived late to a call it was spinning for has not been getting a core
// in time; it then parks at once after each call for a while, so it no longer takes time from
// the threads doing the work.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace chunk_pool {

// Wait budgets. Worker: inside a forward calls come every few to ~20 us (Python between layers),
// so it spins 50 us after a call, then parks. Caller: another thread's last chunk ends within a
// chunk's time (~1 us; tens of us for a prefill tile) when that thread runs; past 10 us it
// probably waits for a core, so park and leave ours to it. No sched_yield phase: on Linux 6.6+
// (EEVDF) each yield pushes the yielder's deadline a slice later, so a thread that yields while
// waiting is the last to run when its work comes (measured here, 6.18: with one busy neighbour,
// 2 threads that yielded decoded at 0.74x of 1 thread).
constexpr int64_t WORKER_SPIN_NS = 50'000, CALLER_SPIN_NS = 10'000;
constexpr int64_t LATE_CALLS = 256;  // after a late arrival a worker parks at once for this many calls
constexpr int64_t MAX_CHUNKS = 0xFFFF;  // chunk indices are 16 bits in the claim words

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void park(std::atomic<uint32_t>* word, uint32_t seen) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
  if (word->load() == seen) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

inline void wake_all(std::atomic<uint32_t>* word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#endif
}

// Spin for spin_ns, then park on `word` (announced in `parked`) until ready() is true. Returns
// whether it parked.
template <typename Ready>
bool wait_until(const Ready& ready, int64_t spin_ns, std::atomic<uint32_t>& word, std::atomic<int>& parked) {
  const int64_t t0 = now_ns();
  for (int i = 1;; ++i) {
    if (ready()) return false;
    if ((i & 63) == 0 && now_ns() - t0 > spin_ns) break;
    _mm_pause();
  }
  for (;;) {
    const uint32_t seen = word.load();
    parked.fetch_add(1);  // seq_cst: either the waker sees us parked, or we see ready()
    if (ready()) {
      parked.fetch_sub(1);
      return true;
    }
    park(&word, seen);
    parked.fetch_sub(1);
    if (ready()) return true;
  }
}

using ChunkFn = void (*)(const void* ctx, int64_t chunk);

class Pool {
 public:
  static constexpr int MAX_THREADS = 256;

  static Pool& get() {
    static Pool* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { new (&get()) Pool(); });  // a forked child has no workers
      return new Pool();                                              // never destroyed: workers outlive exit
    }();
    return *pool;
  }

  // Run fn(ctx, c) for c in [0, n) on up to `threads` threads (the caller included).
  void run(int64_t n, int threads, ChunkFn fn, const void* ctx) {
    if (n <= 0) return;
    threads = std::min<int64_t>({threads, MAX_THREADS, n});
    if (threads <= 1 || in_call_) {  // nested calls run inline
      for (int64_t c = 0; c < n; ++c) fn(ctx, c);
      return;
    }
    TORCH_CHECK(n <= MAX_CHUNKS, "chunk_pool: ", n, " chunks, at most ", MAX_CHUNKS);
    std::lock_guard<std::mutex> one_call_at_a_time(call_mu_);
    grow(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = uint64_t(epoch_of(state_.load(std::memory_order_relaxed)) + 1) << 32;
    for (int p = 0; p < threads; ++p)
      ranges_[p].word.store(epoch | uint64_t(n * p / threads) << 16 | uint64_t(n * (p + 1) / threads),
                            std::memory_order_relaxed);
    const uint64_t job = epoch | uint64_t(threads) << 16 | uint64_t(n);
    state_.store(job);  // seq_cst: publishes the ranges; paired with the workers' parked count
    if (workers_parked_.load() > 0) {
      job_seq_.fetch_add(1);
      wake_all(&job_seq_);
    }
    in_call_ = true;
    const int64_t mine = work(job, 0);
    in_call_ = false;
    if (done_.fetch_add(mine) + mine < n)
      wait_until([&] { return done_.load() == n; }, CALLER_SPIN_NS, done_seq_, caller_parked_);
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
  }

 private:
  Pool() = default;

  // state_: epoch << 32 | threads << 16 | chunks. ranges_[p]: epoch << 32 | lo << 16 | hi, the
  // chunks [lo, hi) of thread p's share not yet claimed.
  static uint32_t epoch_of(uint64_t s) { return uint32_t(s >> 32); }
  static int64_t mid_of(uint64_t s) { return int64_t((s >> 16) & 0xFFFF); }
  static int64_t low_of(uint64_t s) { return int64_t(s & 0xFFFF); }

  // Claim one chunk of range p: the owner from the front (its chunks in order, so its weight
  // stream and prefetches stay sequential as in a static split), others from the back. -1: none
  // left. The CAS checks the epoch, so a late thread can never take a chunk of a later call, and
  // a call's fn and ctx stay valid while any of its chunks is claimed and unfinished.
  int64_t claim(int p, uint32_t epoch, bool owner) {
    std::atomic<uint64_t>& r = ranges_[p].word;
    uint64_t s = r.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = mid_of(s), hi = low_of(s);
      if (epoch_of(s) != epoch || lo >= hi) return -1;
      if (r.compare_exchange_weak(s, owner ? s + (1 << 16) : s - 1, std::memory_order_acq_rel,
                                  std::memory_order_relaxed))
        return owner ? lo : hi - 1;
    }
  }

  // Thread p's part of the call `job`: its own share first, then what is left of the others'
  // (a descheduled thread's whole share, at worst). Returns how many chunks it ran.
  int64_t work(uint64_t job, int p, int64_t* own = nullptr) {
    const uint32_t epoch = epoch_of(job);
    const int threads = int(mid_of(job));
    int64_t ran = 0;
    for (int i = 0; i < threads; ++i) {
      const int q = (p + i) % threads;
      if (i == 1 && own) *own = ran;
      for (int64_t c; (c = claim(q, epoch, i == 0)) >= 0; ++ran) {
        try {
          fn_(ctx_, c);
        } catch (...) {
          if (!failed_.exchange(true)) error_ = std::current_exception();
        }
      }
    }
    return ran;
  }

  void worker(int index) {
    in_call_ = true;  // a kernel called from a chunk runs inline
    const int p = index + 1;  // the caller is thread 0
    uint32_t seen = epoch_of(state_.load());
    bool used = true;  // whether the last call had a share for this thread
    int64_t calls_since_late = LATE_CALLS;
    for (;;) {
      auto fresh = [&] { return epoch_of(state_.load()) != seen; };
      // Spin only while it has been punctual: a worker late to a call it was spinning for did not
      // get a core in time, and spinning would then only take time from the threads that do the
      // work (ours or the neighbour's). Parked, it costs the caller a wake-up per call instead.
      const bool spin = used && calls_since_late >= LATE_CALLS;
      const bool parked = wait_until(fresh, spin ? WORKER_SPIN_NS : 0, job_seq_, workers_parked_);
      const uint64_t s = state_.load(std::memory_order_acquire);
      seen = epoch_of(s);
      used = p < mid_of(s);
      if (!used) continue;
      const int64_t n = low_of(s), threads = mid_of(s);
      int64_t own = 0;
      const int64_t ran = work(s, p, &own);
      // late: other threads ran most of this one's share before it got to it, though it was
      // spinning for the call (on idle cores it starts within a microsecond); a wake-up from
      // parked is late by design and does not count
      const bool late = !parked && 2 * own < n * (p + 1) / threads - n * p / threads;
      calls_since_late = late ? 0 : calls_since_late + 1;
      if (ran == 0) continue;
      if (done_.fetch_add(ran) + ran == low_of(s) && caller_parked_.load() > 0) {
        done_seq_.fetch_add(1);
        wake_all(&done_seq_);
      }
    }
  }

  void grow(int n) {
    while (n_workers_ < n) {
      std::thread(&Pool::worker, this, n_workers_).detach();
      ++n_workers_;
    }
  }

  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};
  };
  std::mutex call_mu_;
  int n_workers_ = 0;
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  Range ranges_[MAX_THREADS];
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> job_seq_{0}, done_seq_{0};
  std::atomic<int> workers_parked_{0}, caller_parked_{0};
  static inline thread_local bool in_call_ = false;  // true in workers and in a caller inside run()
};

// f(begin, end) over [0, n) in ranges of `per_chunk` (made larger if there would be too many),
// on at::get_num_threads() threads: the runtime's `threads` (torch.set_num_threads).
template <typename F>
void parallel_for(int64_t n, int64_t per_chunk, const F& f) {
  if (n <= 0) return;
  per_chunk = std::max<int64_t>({per_chunk, 1, (n + MAX_CHUNKS - 1) / MAX_CHUNKS});
  const int64_t chunks = (n + per_chunk - 1) / per_chunk;
  struct Ctx {
    const F* f;
    int64_t n, per;
  } ctx{&f, n, per_chunk};
  Pool::get().run(chunks, at::get_num_threads(),
                  [](const void* p, int64_t c) {
                    const Ctx& x = *static_cast<const Ctx*>(p);
                    (*x.f)(c * x.per, std::min(x.n, (c + 1) * x.per));
                  },
                  &ctx);
}

}  // namespace chunk_pool
