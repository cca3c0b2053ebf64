// The kernels' output tensors from a cache of freed blocks.
//
// A forward makes ~14 output tensors a layer (each linear's y, the quantized activations' three
// parts, attention's output, ...) and frees them a few microseconds later; the next layer asks for
// the same sizes again. Through torch's CPU allocator each is a posix_memalign and a free in glibc
// (its aligned path splits chunks, and every so often a larger request makes it consolidate its
// fast bins: `perf` put malloc, free and malloc_consolidate at 1.4-2% of a one-row forward's
// samples). Here a freed block goes back on a list of its size and the next request of that size
// takes it, under one uncontended mutex (a tensor may be freed on any thread). On an AMD EPYC Zen 4
// (2026-11-29), builds call by call (scripts/interleaved_builds.py, four runs in both orders): the
// forward after 512 positions 1.01-1.05x faster at one row, 1.01-1.04x at 2, 1.01-1.03x at 4-8;
// prefill the same (docs/results/runtime.md).
//
// Blocks are 64-byte aligned, as torch's own; a block's size class is its size rounded up to 64
// bytes, stored in a header before its data. At most MAX_KEPT bytes are kept (a forward reuses the
// same few sizes: SmolLM2's one-row steps keep 0.23 MB in 19 blocks, 8-row ones 2 MB more, a
// prefill of 512 tokens 18 MB in all), and no block larger than MAX_BLOCK (a prefill's every-row
// logits): those go back to the C library. From Python, `kept_blocks()` says what is kept and
// `release_kept_blocks()` frees it all.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <pthread.h>

#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace block_cache {

class Cache final : public c10::Allocator {
 public:
  static constexpr size_t HEADER = 64;                     // the size class, before the data (keeps its alignment)
  static constexpr size_t MAX_KEPT = size_t(64) << 20;     // bytes kept for reuse at most
  static constexpr size_t MAX_BLOCK = size_t(16) << 20;    // larger blocks are never kept

  static Cache& get() {
    static Cache* cache = [] {
      // a forked child may have been forked while another thread held the lock
      pthread_atfork(nullptr, nullptr, [] { new (&get().mu_) std::mutex(); });
      return new Cache();  // never destroyed: tensors may be freed after static destructors ran
    }();
    return *cache;
  }

  c10::DataPtr allocate(size_t n) override {
    const size_t cls = (n + 63) & ~size_t(63);
    void* base = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        base = it->second.back();
        it->second.pop_back();
        kept_ -= cls;
      }
    }
    if (!base) {
      base = std::aligned_alloc(64, HEADER + cls);
      TORCH_CHECK(base, "out of memory: a kernel's output of ", n, " bytes");
    }
    *static_cast<size_t*>(base) = cls;
    return {static_cast<char*>(base) + HEADER, base, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Frees every kept block (as torch.cuda.empty_cache does its cache's); returns the bytes freed.
  size_t release() {
    std::unordered_map<size_t, std::vector<void*>> blocks;
    size_t bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      bytes = kept_;
      kept_ = 0;
    }
    for (auto& kv : blocks)
      for (void* base : kv.second) std::free(base);
    return bytes;
  }

  // (bytes kept for reuse, blocks kept)
  std::pair<size_t, size_t> kept() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t blocks = 0;
    for (const auto& kv : free_) blocks += kv.second.size();
    return {kept_, blocks};
  }

 private:
  Cache() = default;

  static void give_back(void* base) {
    Cache& c = get();
    const size_t cls = *static_cast<size_t*>(base);
    if (cls <= MAX_BLOCK) {
      std::lock_guard<std::mutex> lock(c.mu_);
      if (c.kept_ + cls <= MAX_KEPT) {
        c.free_[cls].push_back(base);
        c.kept_ += cls;
        return;
      }
    }
    std::free(base);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // size class -> freed blocks, the latest last
  size_t kept_ = 0;
};

// A thread's recent small outputs, whole tensors, handed out again once nothing holds them.
//
// The cache above saves the C library's calls, but each output is still a new tensor: a TensorImpl
// and a StorageImpl built and destroyed, the cache's lock taken twice, ~0.5 us on an AMD EPYC Zen 1
// (2026-12-06), and a one-row forward makes ~17 outputs a layer. Here the last SLOTS outputs of at most
// MAX_BYTES each made on this thread stay referenced; a request of the same shape and type takes one
// that only the pool still holds (its tensor and its storage each counted once: no tensor, no view,
// no Python object has it), so the next layer's same-shaped outputs reuse the last layer's. Only the
// calling thread's pool is searched (no lock); a tensor held elsewhere is skipped, and freed on any
// thread it becomes free here. Outputs larger than MAX_BYTES (a prefill's) go through the cache
// above alone. A tensor that went to Python stays held while the pool keeps it (torch keeps its
// Python object alive with it), so it is only let go when its slot is taken. SmolLM2 Q8_0, Q4_1 and
// Q4_K_M after 128 positions, builds side by side in both orders: 1.022-1.026x at one row,
// 1.01-1.02x at 2-4, 1.006x at 8; a 512-token prefill 0.98-1.01x (docs/results/runtime.md).
class OutputPool {
 public:
  static constexpr size_t SLOTS = 32;
  static constexpr size_t MAX_BYTES = size_t(256) << 10;

  static OutputPool& mine() {
    thread_local OutputPool pool;
    return pool;
  }

  // A tensor of these sizes and type: a free one of the pool's, or make() (kept when small).
  template <typename Make>
  at::Tensor take(c10::IntArrayRef sizes, c10::ScalarType type, const Make& make) {
    for (const auto& t : kept_)
      if (t.use_count() == 1 && t.storage().use_count() == 1 && t.scalar_type() == type && t.sizes() == sizes)
        return t;
    at::Tensor t = make();
    if (t.nbytes() <= MAX_BYTES) {
      if (kept_.size() < SLOTS) kept_.push_back(t);
      else kept_[next_++ % SLOTS] = t;  // the oldest slot lets its tensor go (freed when nothing else holds it)
    }
    return t;
  }

  // Let go of every tensor kept (each freed when nothing else holds it); returns how many were kept.
  size_t release() {
    const size_t n = kept_.size();
    kept_.clear();
    next_ = 0;
    return n;
  }

  size_t kept() const { return kept_.size(); }

 private:
  std::vector<at::Tensor> kept_;
  size_t next_ = 0;
};

}  // namespace block_cache
