// CPU kernels that compute directly on GGUF's quantized weight blocks (AVX2 + FMA + F16C, and
// AVX-512 VNNI where the build's flags allow it: native.py compiles this file once per ISA).
//
// The scheme is llama.cpp's: each activation row is quantized to 8 bits per block of 32
// values (Q8 with one float scale per block), and dotted in integers with the weights as
// stored in the file (Q4_1 or Q8_0); one float multiply-add per block applies the scales.
// Weights are re-laid out at load into tiles of 8 output columns so that one 256-bit
// register holds 4 consecutive weights of 8 columns and the activations are broadcast
// (AVX-512 builds put two neighbouring tiles in one 512-bit register for calls of 2 rows or more).
//
// Every kernel is batch-invariant: a row's result depends only on that row (and for
// attention on that row's keys), never on how many rows share the call or on the thread
// count. Each output value is reduced by one thread in one fixed order. That is what makes
// verifying k drafted tokens in one forward give bit-identical results to decoding them
// one at a time, so speculative decoding stays exactly lossless.
//
// Work is spread over the threads in chunks claimed dynamically (chunk_pool.h), so a step
// finishes with the cores that actually run when another process takes one of them.
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <immintrin.h>

// The work of one chunk (chunk_pool.h), in bytes of weights (or cache, or activations) it
// reads. Small enough that the threads end a call within a fraction of a microsecond of each
// other and that a descheduled thread's share is taken over in fine pieces; large enough that
// claims cost little: 16 KB is ~0.6 us of a one-row matmul and a claim on the thread's own
// counter ~10 ns. Measured on 2 idle cores, one-row and four-row matmuls of SmolLM2's shapes:
// 16 KB and 32 KB within 1-3% of the static split (at::parallel_for) they replace; with a single
// shared counter instead of per-thread shares, 64 KB chunks were 3-10% slower (the counter's
// cache line bounced between cores, and the threads ended up to a chunk apart).
// Prefill rows make a tile heavier: then a chunk is one tile.
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 16384
#endif

#include "block_cache.h"
#include "chunk_pool.h"
#include "probes.h"  // (its probes walk chunks of CHUNK_BYTES too)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

// A new CPU tensor, uninitialized: torch::empty without the dispatcher (at::detail::empty_generic,
// what the CPU kernel of torch::empty calls; ~300 ns against ~455 a call, and a forward makes ~14
// of them a layer), its memory from the cache of freed blocks; a small one, a free tensor of the
// same shape from this thread's pool of recent outputs (both in block_cache.h).
#ifndef SPECPLUG_OUTPUT_POOL
#define SPECPLUG_OUTPUT_POOL 1
#endif
inline torch::Tensor new_tensor(c10::IntArrayRef sizes, c10::ScalarType type) {
  auto make = [&] {
    return at::detail::empty_generic(sizes, &block_cache::Cache::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                     type, c10::nullopt);
  };
#if SPECPLUG_OUTPUT_POOL
  return block_cache::OutputPool::mine().take(sizes, type, make);
#else
  return make();
#endif
}

// A 1-D tensor of T holding v's values (token ids, sequences, positions, rows passed as lists).
template <typename T, typename I>
torch::Tensor tensor_of(const std::vector<I>& v) {
  auto t = new_tensor({(int64_t)v.size()}, c10::CppTypeToScalarType<T>::value);
  T* p = t.template data_ptr<T>();
  for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<T>(v[i]);
  return t;
}

// v holds at least n elements (a buffer kept across calls grows, never shrinks).
template <typename V>
inline void grow(std::vector<V>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
}

constexpr int QK = 32;  // values per quantization block
constexpr int NC = 8;   // output columns per weight tile
constexpr int RT = 4;   // activation rows per pass over a tile (more spills registers)
#ifndef TILE_AHEAD
#define TILE_AHEAD 4096  // one-tile path: software prefetch distance in weight bytes (0: none; see tile)
#endif
#ifndef BYTE_ROW_HINT
#define BYTE_ROW_HINT _MM_HINT_NTA  // that prefetch's hint for one row's byte tiles (see tile)
#endif

// Native time per kernel family, for `bench-runtime --profile`: it times the forward as the engine
// runs it (all layers in one call) from inside, where a timer around each Python call would add
// that call's own cost. Off unless asked: then one relaxed atomic load per kernel call.
enum Stage { ST_LINEAR, ST_QUANTIZE, ST_ROPE, ST_ATTENTION, ST_NORM, ST_COUNT };
const char* const STAGE_NAMES[ST_COUNT] = {"linear", "quantize", "rope_store", "attention", "norm"};
std::atomic<bool> g_timing{false};
std::atomic<int64_t> g_stage_ns[ST_COUNT];
std::atomic<int64_t> g_stage_calls[ST_COUNT];

class StageTimer {
 public:
  explicit StageTimer(Stage s) : stage_(s), on_(g_timing.load(std::memory_order_relaxed)) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~StageTimer() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
    g_stage_ns[stage_].fetch_add(ns.count(), std::memory_order_relaxed);
    g_stage_calls[stage_].fetch_add(1, std::memory_order_relaxed);
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  Stage stage_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline int hsum_i32(__m256i v) {
  __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4e));
  lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xb1));
  return _mm_cvtsi128_si32(lo);
}

// exp(x) for x <= 0 on 8 floats (Cephes polynomial, ~1 ulp; below -88.4 the value at -88.4).
// Softmax's arguments (a score less its span's max) are never positive.
inline __m256 exp8_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#if defined(__AVX512F__)
// exp8_nonpos on 16 lanes, each lane the same operations (the same values).
inline __m512 exp16_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

// exp(x) for 8 floats: clamped to +-88.4, then exp8_nonpos's operations (exp8_nonpos less the
// clamp above, which never applies to it).
inline __m256 exp8(__m256 x) { return exp8_nonpos(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f))); }

// Quantize 32 floats to int8 with one scale (round to nearest even); returns d, writes sum(q)*d.
inline float quantize_block(const float* y, int8_t* q, float* s) {
  __m256 v0 = _mm256_loadu_ps(y), v1 = _mm256_loadu_ps(y + 8), v2 = _mm256_loadu_ps(y + 16),
         v3 = _mm256_loadu_ps(y + 24);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  const float amax = hmax(a);
  const float d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
  *s = d * (float)hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
  i0 = _mm256_packs_epi32(i0, i1);
  i2 = _mm256_packs_epi32(i2, i3);
  i0 = _mm256_packs_epi16(i0, i2);
  i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, i0);
  return d;
}

void check_cpu_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// M rows of K values -> int8 blocks q [M, K], block scales d and d*sum(q) [M, K/32].
// row(r, buf) returns row r as floats, computing it into buf (K floats) where needed.
template <typename Row>
std::vector<torch::Tensor> quantize_each_row(int64_t M, int64_t K, const Row& row) {
  TORCH_CHECK(K % QK == 0, "row length must be a multiple of 32");
  const int64_t nb = K / QK;
  auto q = new_tensor({M, K}, torch::kInt8);
  auto d = new_tensor({M, nb}, torch::kFloat32);
  auto s = new_tensor({M, nb}, torch::kFloat32);
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  // at least 16 rows a chunk: decoding's few rows are quantized inline, with no dispatch at all
  chunk_pool::parallel_for(M, std::max<int64_t>(16, CHUNK_BYTES / (4 * K)), [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> buf;  // a row's normalized values; kept across calls (no allocation, no zeroing)
    grow(buf, K);
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = row(r, buf.data());
      for (int64_t b = 0; b < nb; ++b)
        dp[r * nb + b] = quantize_block(src + b * QK, qp + r * K + b * QK, sp + r * nb + b);
    }
  });
  return {q, d, s};
}

// Rows of x (optionally RMS-normalized and scaled by w), quantized.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                         double eps) {
  const StageTimer timer(ST_QUANTIZE);
  check_cpu_f32(x, "x");
  const int64_t K = x.size(1);
  const float* w = nullptr;
  if (norm_w.has_value()) {
    TORCH_CHECK(norm_w->is_contiguous() && norm_w->numel() == K && norm_w->scalar_type() == torch::kFloat32);
    w = norm_w->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  return quantize_each_row(x.size(0), K, [&](int64_t r, float* buf) -> const float* {
    const float* xr = xp + r * ldx;
    if (!w) return xr;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 v = _mm256_loadu_ps(xr + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 sc = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)K + (float)eps));
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(buf + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), sc), _mm256_loadu_ps(w + k)));
    return buf;
  });
}

// silu(g) * u for gu = [g | u] rows, quantized.
std::vector<torch::Tensor> silu_mul_quantize(const torch::Tensor& gu) {
  const StageTimer timer(ST_QUANTIZE);
  check_cpu_f32(gu, "gu");
  const int64_t F = gu.size(1) / 2;
  const float* gp = gu.data_ptr<float>();
  const int64_t ld = gu.stride(0);
  return quantize_each_row(gu.size(0), F, [&](int64_t r, float* buf) -> const float* {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    const float* g = gp + r * ld;
    const float* u = g + F;
    for (int64_t k = 0; k < F; k += 8) {
      __m256 gv = _mm256_loadu_ps(g + k);
      __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg))));
      _mm256_storeu_ps(buf + k, _mm256_mul_ps(sg, _mm256_loadu_ps(u + k)));
    }
    return buf;
  });
}

// gelu(g) * u for gu = [g | u] rows, quantized: GeGLU with the tanh GELU (Gemma),
// 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))), tanh(z) = 1 - 2 / (exp(2z) + 1).
std::vector<torch::Tensor> gelu_mul_quantize(const torch::Tensor& gu) {
  const StageTimer timer(ST_QUANTIZE);
  check_cpu_f32(gu, "gu");
  const int64_t F = gu.size(1) / 2;
  const float* gp = gu.data_ptr<float>();
  const int64_t ld = gu.stride(0);
  return quantize_each_row(gu.size(0), F, [&](int64_t r, float* buf) -> const float* {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
    const __m256 c = _mm256_set1_ps(0.79788456080286535588f), a = _mm256_set1_ps(0.044715f);
    const float* g = gp + r * ld;
    const float* u = g + F;
    for (int64_t k = 0; k < F; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      const __m256 z = _mm256_mul_ps(_mm256_mul_ps(c, gv), _mm256_fmadd_ps(_mm256_mul_ps(a, gv), gv, one));
      const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, z)), one)));
      const __m256 ge = _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, th));
      _mm256_storeu_ps(buf + k, _mm256_mul_ps(ge, _mm256_loadu_ps(u + k)));
    }
    return buf;
  });
}

// residual + rms_norm(y) * w, row by row (Gemma's norms after attention and after the MLP); the
// sum of squares in the same order as quantize_rows' norm.
torch::Tensor rms_norm_add(const torch::Tensor& y, const torch::Tensor& w, double eps, const torch::Tensor& residual) {
  const StageTimer timer(ST_NORM);
  check_cpu_f32(y, "y");
  check_cpu_f32(residual, "residual");
  const int64_t M = y.size(0), K = y.size(1);
  TORCH_CHECK(K % 8 == 0 && residual.size(0) == M && residual.size(1) == K, "y and residual must be [M, K], K % 8 == 0");
  TORCH_CHECK(w.is_contiguous() && w.numel() == K && w.scalar_type() == torch::kFloat32, "w must be float32 [K]");
  auto out = new_tensor({M, K}, torch::kFloat32);
  const float *yp = y.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldy = y.stride(0), ldr = residual.stride(0);
  chunk_pool::parallel_for(M, std::max<int64_t>(16, CHUNK_BYTES / (4 * K)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *yr = yp + r * ldy, *rr = rp + r * ldr;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(yr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const __m256 sc = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)K + (float)eps));
      for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(op + r * K + k, _mm256_add_ps(_mm256_loadu_ps(rr + k),
                                                       _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(yr + k), sc),
                                                                     _mm256_loadu_ps(wp + k))));
    }
  });
  return out;
}

struct Act {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, nb;
  // Signed weights (Q8_0, Q6_K) on VNNI: -128 times the sum of each half (16 values) of each row's
  // block, [M, nb, 2] (scaled_sums<16>); the block dots' starting values, see signed_block_dot.
  const int32_t* off = nullptr;
  // Q4_0 and Q5_0 on every ISA: -BIAS times the sum of each row's block, [M, nb] (scaled_sums<32>); the
  // starting values of q4_1_block_dot<R, BIAS>.
  const int32_t* start = nullptr;
  // Q8_0 at one row with the signs on the weights (AVX2, sign_operands): a load's x and |x| operands.
  const int8_t* ops = nullptr;
};

// factor times the sum of each SEG values of each row of q [M, K], [M, K / SEG]: Act.off (SEG 16,
// factor -128) and Act.start (SEG 32, factor -BIAS). In the calling thread's buffer (kept across
// calls: a decode step's one-row calls allocate nothing; the call's tasks read it while the caller
// waits for them).
template <int SEG>
inline const int32_t* scaled_sums(const int8_t* q, int64_t M, int64_t K, int32_t factor) {
  const int64_t ns = K / SEG;
  thread_local std::vector<int32_t> out;
  if ((int64_t)out.size() < M * ns) out.resize(M * ns);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < ns; ++j) {
      const int8_t* x = q + r * K + j * SEG;
      int32_t sum = 0;
      for (int i = 0; i < SEG; ++i) sum += x[i];
      out[r * ns + j] = factor * sum;
    }
  return out.data();
}

// The integer part of one weight block against R activation rows: s[r] = the 8 columns' exact
// int32 dot products. Two ways, one result: AVX-512 VNNI multiplies unsigned by signed bytes and
// adds groups of 4 into 32 bits in one instruction (vpdpbusd); AVX2 needs vpmaddubsw (pairs into
// 16 bits, which cannot overflow here), vpmaddwd and vpaddd. Integer sums are exact in any
// order, so both paths give the same s and the float code after them is shared.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECPLUG_VNNI 1
#else
#define SPECPLUG_VNNI 0
#endif
#if SPECPLUG_VNNI
// acc + the dot of w's unsigned bytes with the 4 signed bytes at x, broadcast to every 32-bit lane.
// GCC 12 loads the broadcast into a register first (vpbroadcastd), one more instruction for each
// multiply-add one; as vpdpbusd's own memory operand ({1to8}, {1to16}) it is the same operation in
// one instruction: on the Zen 4 the forward's linears at 4-16 rows 1.03-1.05x faster, at one row
// the same; the whole forward 1.00-1.02x (scripts/interleaved_builds.py, docs/results/runtime.md).
// -DSPECPLUG_EMBED_BCAST=0: the intrinsics.
#ifndef SPECPLUG_EMBED_BCAST
#define SPECPLUG_EMBED_BCAST 1
#endif
inline __m256i dot_bcast(__m256i acc, __m256i w, const int32_t* x) {
#if SPECPLUG_EMBED_BCAST
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
#else
  return _mm256_dpbusd_epi32(acc, w, _mm256_set1_epi32(*x));
#endif
}
#if defined(__AVX512BW__)
inline __m512i dot_bcast(__m512i acc, __m512i w, const int32_t* x) {
#if SPECPLUG_EMBED_BCAST
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x));
#endif
}
#endif
#endif

// Software prefetch of the weights on the one-tile path, block by block TILE_AHEAD bytes on (see
// tile), for calls of at most this many rows: the default of g_prefetch_rows, which
// set_prefetch_rows changes at run time (native.py: SPECPLUG_PREFETCH_ROWS or a tuning per CPU;
// 0: never). The same bits either way.
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS (SPECPLUG_VNNI ? 0 : 1)
#endif
std::atomic<int64_t> g_prefetch_rows{PREFETCH_ROWS};

// Q5_0: a block's value u = 0..31 (the weight is (u - 16) d) from Q4_1's nibble bytes and, after
// them (128 bytes on), a plane of its fifth bits, 32 bytes: bit l of byte j is the fifth bit of the
// value whose low 4 bits are in byte j of load l / 2, its low nibble for even l, its high one for
// odd l. fifth_bits(plane, l) is 16 in each byte whose bit l is set, else 0: one shift of the plane
// (in 16-bit lanes, which moves no bit l into another byte's bit 4) and one and, so the nibbles
// take their fifth bit with an or. (A 32-bit mask a load, spread by vpshufb and vpcmpeqb on AVX2,
// would take six instructions for each 32 values instead of three.)
inline __m256i fifth_bits(__m256i plane, int l) {
  const __m256i v = l < 4 ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - l))
                          : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(l - 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(16));
}
#if defined(__AVX512BW__)
inline __m512i fifth_bits(__m512i plane, int l) {
  const __m512i v = l < 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - l))
                          : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(l - 4));
  return _mm512_and_si512(v, _mm512_set1_epi8(16));
}
#endif

// Q4_1: qs holds nb blocks of 4 x 32 bytes; byte c*4+i of load p holds w[c][4p+i] (low nibble)
// and w[c][16+4p+i] (high nibble), as GGUF stores them. BIAS > 0: the weights are (u - BIAS) d, and
// the dot starts at -BIAS sum(x) (Act.start), so it is sum((u - BIAS) x):
// Q4_0 (BIAS 8, u = 0..15) and Q5_0 (BIAS 16, FIFTH: the plane of fifth bits after the nibbles,
// fifth_bits, u = 0..31). That is exactly the integer the Q8_0 blocks of the same weights give, and the float
// code after it (Q8_0's) gives the same bits too.
template <int R, int BIAS = 0, bool FIFTH = false>
inline void q4_1_block_dot(const uint8_t* blk, const Act& a, int64_t r0, int64_t b, __m256i* s) {
  static_assert(BIAS == 0 || BIAS == 8 || BIAS == 16, "BIAS: 0 (Q4_1), 8 (Q4_0) or 16 (Q5_0)");
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i plane = FIFTH ? _mm256_loadu_si256((const __m256i*)(blk + 128)) : _mm256_setzero_si256();
  for (int r = 0; r < R; ++r) s[r] = BIAS ? _mm256_set1_epi32(a.start[(r0 + r) * a.nb + b]) : _mm256_setzero_si256();
#if !SPECPLUG_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[R];
  for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
#endif
  for (int p = 0; p < 4; ++p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + p * 32));
    __m256i lo = _mm256_and_si256(raw, m4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (FIFTH) {
      lo = _mm256_or_si256(lo, fifth_bits(plane, 2 * p));
      hi = _mm256_or_si256(hi, fifth_bits(plane, 2 * p + 1));
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
#if SPECPLUG_VNNI
      s[r] = dot_bcast(s[r], lo, xr + p);
      s[r] = dot_bcast(s[r], hi, xr + p + 4);
#else
      // A maddubs lane sums two products of at most 15*127 (Q4_1, Q4_0: the 8 of a block fit int16)
      // or 31*127 (Q5_0: 4 fit, 4 * 7874 <= 32767, so its 16-bit sums are widened every 2 loads).
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[p])));
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[p + 4])));
      if ((FIFTH && p % 2 == 1) || p == 3) {
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(s16[r], ones));
        s16[r] = _mm256_setzero_si256();
      }
#endif
    }
  }
}

// Signed bytes (Q8_0's and Q6_K's values): byte c*4+i of load j holds w[c][4j+i]. HALVES:
// values 0..15 of each column summed into lo[r] and 16..31 into hi[r] (Q6_K's two sub-blocks, each
// with its own scale); else all 32 into lo[r] (hi unused). The multiply takes unsigned weights. With
// VNNI they are offset, w + 128 (w ^ 0x80), and each dot starts at -128 sum(x) (Act.off): one
// operation a load for every row together. AVX2's vpmaddubsw would saturate 16-bit pairs of
// (w + 128) x: there the weights' signs move onto the activations instead (|w| times x sign(w)),
// for each row; or, at one row on one thread, the activations' signs onto the weights (Act.ops,
// sign_operands). Exact integers every way: the same sums.
template <int R, bool HALVES>
inline void signed_block_dot(const uint8_t* blk, const Act& a, int64_t r0, int64_t b, __m256i* lo, __m256i* hi) {
#if SPECPLUG_VNNI
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  for (int r = 0; r < R; ++r) {
    const int32_t* o = a.off + ((r0 + r) * a.nb + b) * 2;
    if (HALVES) {
      lo[r] = _mm256_set1_epi32(o[0]);
      hi[r] = _mm256_set1_epi32(o[1]);
    } else {
      lo[r] = _mm256_set1_epi32(o[0] + o[1]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(blk + j * 32)), flip);
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
      __m256i& acc = HALVES && j >= 4 ? hi[r] : lo[r];
      acc = dot_bcast(acc, wu, xr + j);
    }
  }
#else
  if constexpr (!HALVES && R == 1)
    if (a.ops) {  // the signs on the weights (sign_operands): x and |x| of load j at ops + (b * 8 + j) * 64
      const __m256i ones = _mm256_set1_epi16(1);
      const int8_t* o = a.ops + b * 8 * 64;
      lo[0] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + j * 32));
        const __m256i ws = _mm256_sign_epi8(w, _mm256_loadu_si256((const __m256i*)(o + j * 64)));
        const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(o + j * 64 + 32)), ws);
        lo[0] = _mm256_add_epi32(lo[0], _mm256_madd_epi16(p, ones));
      }
      return;
    }
  // Q8_0's |w| up to 128: a maddubs lane (2 x 128 x 127) fills int16, so each is widened at once;
  // Q6_K's (HALVES) up to 32: 4 lanes fit (4 x 2 x 32 x 127 = 32512), a half's 4 loads widened once.
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_si256();
    if (HALVES) hi[r] = s16[r] = _mm256_setzero_si256();
  }
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + j * 32));
    const __m256i aw = _mm256_sign_epi8(w, w);  // |w|, with sign moved onto x
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
      const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), w);
      if constexpr (HALVES) {
        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(aw, xs));
        if (j % 4 == 3) {
          __m256i& acc = j >= 4 ? hi[r] : lo[r];
          acc = _mm256_madd_epi16(s16[r], ones);
          s16[r] = _mm256_setzero_si256();
        }
      } else {
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
      }
    }
  }
#endif
}

#if !SPECPLUG_VNNI
// Q8_0 at one row on AVX2 with the signs on the weights: |x| times sign(w, x), one vpsignb a load where
// |w| times sign(x, w) takes two. The same integer sums, so the same bits, except for a weight of -128
// (sign(-128, x) is -128 again for x < 0): only linears without one take it (Lin.signs, checked once
// when a LayerStack takes them). Where the dot's instructions rather than the weights' stream set the
// pace it pays: on an AMD EPYC Zen 1 (AVX2 only, 2026-12-06) one thread's linears take as long from
// the caches as from memory, and the Q8_0 file's one-row forward ran 1.05-1.09x faster with it, the
// Q4_1 file's (its Q8_0 output head) 1.03x; at 2 threads, where the stream sets the pace, 0.96x, and at
// 2-4 rows 0.99 / 0.96x (docs/results/runtime.md). So calls of one row on at most g_sign_threads threads.
#ifndef SIGN_THREADS
#define SIGN_THREADS 1
#endif
std::atomic<int64_t> g_sign_threads{SIGN_THREADS};

// The loads' operands of one row q[0..K): for each 4 values, x broadcast to 32 bytes, then |x| (64
// bytes, a cache line a load), 16 bytes a value (24 KB for K = 1536). Made once a call, in the
// calling thread's buffer (kept across calls; the call's tasks read it while the caller waits).
inline const int8_t* sign_operands(const int8_t* q, int64_t K) {
  thread_local std::vector<int8_t> buf;
  grow(buf, K * 16);
  for (int64_t k = 0; k < K; k += 4) {
    const __m256i v = _mm256_set1_epi32(*(const int32_t*)(q + k));
    _mm256_storeu_si256((__m256i*)(buf.data() + k * 16), v);
    _mm256_storeu_si256((__m256i*)(buf.data() + k * 16 + 32), _mm256_abs_epi8(v));
  }
  return buf.data();
}

// Whether byte tiles hold no byte 0x80 (a Q8_0 weight of -128): Lin.signs.
inline bool no_byte_80(const torch::Tensor& qs) {
  const uint8_t* p = qs.data_ptr<uint8_t>();
  const int64_t n = qs.numel();
  const __m256i m = _mm256_set1_epi8((char)0x80);
  __m256i any = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i*)(p + i)), m));
  bool seen = !_mm256_testz_si256(any, any);
  for (; i < n; ++i) seen |= p[i] == 0x80;
  return !seen;
}
#endif

// Unsigned bytes (Q5_K's 5-bit values 0..31): byte c*4+i of load j holds w[c][4j+i]. On AVX2 a
// maddubs lane sums two products of at most 31*127, so the 16-bit sums of 4 loads fit (4 * 7874 <=
// 32767) and are widened twice a block.
template <int R>
inline void u8_block_dot(const uint8_t* blk, const Act& a, int64_t r0, int64_t b, __m256i* s) {
  for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#if !SPECPLUG_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[R];
  for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
#endif
  for (int j = 0; j < 8; ++j) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + j * 32));
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
#if SPECPLUG_VNNI
      s[r] = dot_bcast(s[r], w, xr + j);
#else
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(xr[j])));
      if (j % 4 == 3) {
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(s16[r], ones));
        s16[r] = _mm256_setzero_si256();
      }
#endif
    }
  }
}

// 8 scales of a tile's block as floats: float16 (Q4_1, Q8_0 as stored) or float32 (the K-quants'
// super-block scale times a sub-block's integer scale, exact in float32).
inline __m256 scales8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }

// The weight kinds a tile can hold (QuantLinear.kind): bytes per block of a tile (4-bit nibbles or
// bytes), scale type, a per-block offset m or not, and one scale per 32 values or two (per 16).
enum Kind { KQ4_1 = 0, KQ8_0 = 1, KQ4_K = 2, KQ5_K = 3, KQ6_K = 4, KQ5_0 = 5, KQ4_0 = 6 };
template <int K> struct KindOf;
template <> struct KindOf<KQ4_1> { using S = uint16_t; static constexpr int bytes = 128, nsc = 1; static constexpr bool m = true; };
template <> struct KindOf<KQ8_0> { using S = uint16_t; static constexpr int bytes = 256, nsc = 1; static constexpr bool m = false; };
template <> struct KindOf<KQ4_K> { using S = float; static constexpr int bytes = 128, nsc = 1; static constexpr bool m = true; };
template <> struct KindOf<KQ5_K> { using S = float; static constexpr int bytes = 256, nsc = 1; static constexpr bool m = true; };
template <> struct KindOf<KQ6_K> { using S = float; static constexpr int bytes = 256, nsc = 2; static constexpr bool m = false; };
template <> struct KindOf<KQ5_0> { using S = uint16_t; static constexpr int bytes = 160, nsc = 1; static constexpr bool m = false; };
template <> struct KindOf<KQ4_0> { using S = uint16_t; static constexpr int bytes = 128, nsc = 1; static constexpr bool m = false; };

// R rows x 8 columns of one tile. Per block b, with s the integer dot of the row's 8-bit block with
// each column's values:
//   offset kinds (Q4_1, Q4_K, Q5_K):  acc += s * (d_w d_x) + m_w (d_x sum(x_q))
//   Q8_0:                             acc += s * (d_w d_x)
//   Q6_K (two halves of 16):          acc += s_lo * (d_lo d_x) + s_hi * (d_hi d_x)
// The same float operations in the same order on every ISA path.
// AHEAD (calls of few rows, see matmul_impl): each block first asks for the cache lines TILE_AHEAD
// bytes on in the weights' stream (a later block of this tile or of the tiles after it; a prefetch
// never faults past the end), one block's worth at a time, so the requests go out at the pace of the
// compute instead of a tile's worth at once. Into L1 (T0), but one row's byte tiles (Q8_0, Q5_K,
// Q6_K: the most bytes a multiply-add) ask for theirs non-temporally (BYTE_ROW_HINT): they are read
// once a step, and the hint asks the caches not to keep them. On an AMD EPYC Zen 1 (2026-12-06) the
// one-row forward of Q8_0 ran 1.03x faster (0.98-1.04x over 5 runs in both orders), Q5_K_M and Q6_K files
// 1.01-1.03x; the nibble kinds did not gain (Q4_1 0.98x), nor did 2 rows (0.97x), so they keep T0
// (docs/results/runtime.md). A template argument: as a run-time flag the test in the block loop made
// the calls without it 2-5% slower at 3-8 rows on the Zen 1.
template <int R, int KIND, bool AHEAD = false>
inline void tile(const uint8_t* qs, const typename KindOf<KIND>::S* wd, const typename KindOf<KIND>::S* wm,
                 const Act& a, int64_t r0, __m256* out) {
  using KO = KindOf<KIND>;
  constexpr int hint = R == 1 && KO::bytes == 256 ? BYTE_ROW_HINT : _MM_HINT_T0;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = qs + b * KO::bytes;
    if constexpr (TILE_AHEAD > 0 && AHEAD)
      for (int l = 0; l < KO::bytes; l += 64) _mm_prefetch((const char*)blk + TILE_AHEAD + l, (_mm_hint)hint);
    const __m256 dw = scales8(wd + b * NC * KO::nsc);
    __m256i s32[R], s_hi[R];
    if constexpr (KIND == KQ4_1 || KIND == KQ4_K)
      q4_1_block_dot<R>(blk, a, r0, b, s32);
    else if constexpr (KIND == KQ8_0)
      signed_block_dot<R, false>(blk, a, r0, b, s32, s_hi);
    else if constexpr (KIND == KQ5_K)
      u8_block_dot<R>(blk, a, r0, b, s32);
    else if constexpr (KIND == KQ5_0)
      q4_1_block_dot<R, 16, true>(blk, a, r0, b, s32);
    else if constexpr (KIND == KQ4_0)
      q4_1_block_dot<R, 8>(blk, a, r0, b, s32);
    else
      signed_block_dot<R, true>(blk, a, r0, b, s32, s_hi);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * a.nb + b;
      const __m256 dx = _mm256_set1_ps(a.d[rb]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, dx), acc[r]);
      if constexpr (KO::m) acc[r] = _mm256_fmadd_ps(scales8(wm + b * NC), _mm256_set1_ps(a.s[rb]), acc[r]);
      if constexpr (KO::nsc == 2)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_hi[r]), _mm256_mul_ps(scales8(wd + b * NC * 2 + NC), dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// tile<R, KIND, AHEAD> for R = n rows (1..RT).
template <int KIND, bool AHEAD>
inline void tile_rows(int64_t n, const uint8_t* qs, const typename KindOf<KIND>::S* wd,
                      const typename KindOf<KIND>::S* wm, const Act& a, int64_t r0, __m256* out) {
  static_assert(RT == 4, "tile_rows dispatches 1..4 rows");
  switch (n) {
    case 4: tile<4, KIND, AHEAD>(qs, wd, wm, a, r0, out); break;
    case 3: tile<3, KIND, AHEAD>(qs, wd, wm, a, r0, out); break;
    case 2: tile<2, KIND, AHEAD>(qs, wd, wm, a, r0, out); break;
    default: tile<1, KIND, AHEAD>(qs, wd, wm, a, r0, out); break;
  }
}

// Two neighbouring tiles at once on 512-bit registers (AVX-512 builds): the low half of a register
// holds tile t's 4 bytes of 8 columns, the high half the same bytes of tile t + 1, so one instruction
// does what two did on 256 bits, and an activation value is broadcast to 16 lanes. Each lane does
// exactly the integer and float operations of tile<> in the same order, so the two give the same
// bits. Where the 512-bit units are separate (Intel's server cores: Cascade Lake measured 2.7x the
// multiply-adds a second of vpdpbusd on 256 bits, `specplug bench-runtime --profile`) this is the faster schedule;
// where they are 256-bit pairs (Zen 4) it halves the instructions at the same multiply-add rate.
// -DSPECPLUG_ZMM=0 turns it off.
#if SPECPLUG_VNNI && defined(__AVX512BW__)
#ifndef SPECPLUG_ZMM
#define SPECPLUG_ZMM 1
#endif
#else
#undef SPECPLUG_ZMM
#define SPECPLUG_ZMM 0
#endif

// Calls of at least this many rows run on tile pairs (fewer: one tile at a time on 256 bits); the
// default of g_pair_rows, which set_pair_rows changes at run time (native.py: SPECPLUG_PAIR_ROWS or a
// tuning per CPU). Both give the same bits, so the choice moves only time. One row is bound by the
// weights' stream: on Cascade Lake the pairs with their software prefetch (PAIR_AHEAD) make the
// forward's linears at one row 1.18x faster (the 256-bit path with its own prefetch: 0.93x). On Zen 4
// the 256-bit path without prefetch was the faster one up to 4 rows while the pairs' prefetch went to
// L1; with it going to L2 (PAIR_HINT) the pairs are as fast at one row and faster at 2-4, so the 4-
// and 5-bit kinds run on pairs from one row on both (scripts/interleaved_builds.py,
// docs/results/runtime.md); the 8-bit kinds have a threshold of their own, below.
#ifndef ZMM_ROWS
#define ZMM_ROWS 1
#endif
std::atomic<int64_t> g_pair_rows{ZMM_ROWS};
// The same for the kinds with a byte a value (Q8_0, Q5_K, Q6_K: 256-byte blocks), whose weights are
// twice the bytes a multiply-add: on Zen 4 one tile at a time with no software prefetch streams them
// faster at 1-2 rows than tile pairs with it (the Q8_0 file's forward 1.08x / 1.05x at 1 / 2 rows),
// where the other kinds are 1.00-1.03x slower on single tiles. set_pair_rows sets both.
std::atomic<int64_t> g_byte_pair_rows{ZMM_ROWS};
// Activation rows per pass over a tile pair: AVX-512's 32 registers hold 8 rows' accumulators and
// integer sums (AVX2's 16 hold 4). Against 4 a pass, Cascade Lake, one thread, SmolLM2's linears
// at 8-16 rows: 1.10-1.35x the multiply-adds a second (the Q8_0 output head 1.26-1.36x).
#ifndef ZMM_RT
#define ZMM_RT 8
#endif

#if SPECPLUG_ZMM
// 32 bytes at p (tile t) and the 32 at p + tb (tile t + 1) as one register.
inline __m512i load_pair(const uint8_t* p, int64_t tb) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)),
                            _mm256_loadu_si256((const __m256i*)(p + tb)), 1);
}
// 8 scales at p (tile t) and the 8 at p + step (tile t + 1) as 16 floats.
inline __m512 scales16(const uint16_t* p, int64_t step) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                 _mm_loadu_si128((const __m128i*)(p + step)), 1));
}
inline __m512 scales16(const float* p, int64_t step) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(p))),
                                             _mm256_castps_pd(_mm256_loadu_ps(p + step)), 1));
}
// acc + w . the activation's 4 bytes j of row r, block b (dot_bcast)
inline __m512i dot_x(__m512i acc, __m512i w, const Act& a, int64_t r, int64_t b, int j) {
  return dot_bcast(acc, w, (const int32_t*)(a.q + r * a.K + b * QK) + j);
}

// The block dots of tile pairs (q4_1_block_dot, u8_block_dot and signed_block_dot on 16 columns).
// Signed weights offset by 128 as in signed_block_dot. BIAS as in q4_1_block_dot; FIFTH (Q5_0): each
// half's fifth bits from its own tile's plane (tile t's in the low 256 bits, tile t + 1's in the high).
template <int R, int BIAS = 0, bool FIFTH = false>
inline void q4_1_pair_dot(const uint8_t* blk, int64_t tb, const Act& a, int64_t r0, int64_t b, __m512i* s) {
  static_assert(BIAS == 0 || BIAS == 8 || BIAS == 16, "BIAS: 0 (Q4_1), 8 (Q4_0) or 16 (Q5_0)");
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i plane = FIFTH ? load_pair(blk + 128, tb) : _mm512_setzero_si512();
  for (int r = 0; r < R; ++r) s[r] = BIAS ? _mm512_set1_epi32(a.start[(r0 + r) * a.nb + b]) : _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p) {
    const __m512i raw = load_pair(blk + p * 32, tb);
    __m512i lo = _mm512_and_si512(raw, m4);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    if constexpr (FIFTH) {
      lo = _mm512_or_si512(lo, fifth_bits(plane, 2 * p));
      hi = _mm512_or_si512(hi, fifth_bits(plane, 2 * p + 1));
    }
    for (int r = 0; r < R; ++r) {
      s[r] = dot_x(s[r], lo, a, r0 + r, b, p);
      s[r] = dot_x(s[r], hi, a, r0 + r, b, p + 4);
    }
  }
}

// HALVES: values 0..15 of each column summed into lo[r], 16..31 into hi[r] (Q6_K's two scales);
// else the whole block into lo[r] (hi unused: 8 rows' sums then fit the registers beside the rest).
template <int R, bool SIGNED, bool HALVES>
inline void bytes_pair_dot(const uint8_t* blk, int64_t tb, const Act& a, int64_t r0, int64_t b, __m512i* lo,
                           __m512i* hi) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int r = 0; r < R; ++r) {
    const int32_t* o = SIGNED ? a.off + ((r0 + r) * a.nb + b) * 2 : nullptr;
    if (HALVES) {
      lo[r] = SIGNED ? _mm512_set1_epi32(o[0]) : _mm512_setzero_si512();
      hi[r] = SIGNED ? _mm512_set1_epi32(o[1]) : _mm512_setzero_si512();
    } else {
      lo[r] = SIGNED ? _mm512_set1_epi32(o[0] + o[1]) : _mm512_setzero_si512();
    }
  }
  for (int j = 0; j < 8; ++j) {
    __m512i w = load_pair(blk + j * 32, tb);
    if (SIGNED) w = _mm512_xor_si512(w, flip);
    for (int r = 0; r < R; ++r) {
      __m512i& acc = HALVES && j >= 4 ? hi[r] : lo[r];
      acc = dot_x(acc, w, a, r0 + r, b, j);
    }
  }
}

// Software prefetch of the weights on tile pairs (first pass over the rows): each block of both tiles
// asks for the bytes PAIR_AHEAD on in its tile's stream (-n: the same block n pairs on; 0: none).
// Without it this core streams the weights and does the multiply-adds one after the other more than
// together: `stream_dots` (probes.h), the least work on the forward's own weight bytes, took 1.25x as
// long at 8 rows as at one, and about the same at every row count when it asked for lines 1-4 KB
// ahead. In the kernels (Cascade Lake, 2 threads, the forward's 121 linears, builds interleaved walk
// by walk): the next pair's block 1.20-1.33x faster at 2-8 rows and 1.03-1.16x at 16; 4 KB ahead
// slightly less, 1 KB ahead not at all.
#ifndef PAIR_AHEAD
#define PAIR_AHEAD -1
#endif
// Where those lines go: L2 (T1). Into L1 (T0) each prefetch holds one of the few L1 miss buffers
// until its line arrives from memory, and on Zen 4 a Q8_0 linear too large for the caches (3072 x
// 576) then ran 1.30x / 1.17x slower at 8 / 16 rows than with T1 (at the speed it has with its
// weights in cache), the forward 1.04-1.06x at 4-16 rows with pairs from one row (T2 the same as T1,
// NTA 0.87x at one row; docs/results/runtime.md). Cascade Lake was tuned with T0 and not re-measured.
#ifndef PAIR_HINT
#define PAIR_HINT _MM_HINT_T1
#endif

// R rows x 16 columns of tiles t and t + 1 (tb bytes apart; their scales sstep, offsets mstep
// elements apart): tile<R, KIND> on both at once.
template <int R, int KIND>
inline void tile_pair(const uint8_t* qs, int64_t tb, const typename KindOf<KIND>::S* wd, int64_t sstep,
                      const typename KindOf<KIND>::S* wm, int64_t mstep, const Act& a, int64_t r0, __m512* out) {
  using KO = KindOf<KIND>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = qs + b * KO::bytes;
    if constexpr (PAIR_AHEAD != 0) {
      if (r0 == 0) {
        const char* ahead = (const char*)blk + (PAIR_AHEAD > 0 ? PAIR_AHEAD : -PAIR_AHEAD * 2 * tb);
        for (int l = 0; l < KO::bytes; l += 64) {
          _mm_prefetch(ahead + l, PAIR_HINT);
          _mm_prefetch(ahead + tb + l, PAIR_HINT);
        }
      }
    }
    const __m512 dw = scales16(wd + b * NC * KO::nsc, sstep);
    __m512i s32[R], s_hi[R];
    if constexpr (KIND == KQ4_1 || KIND == KQ4_K) {
      q4_1_pair_dot<R>(blk, tb, a, r0, b, s32);
    } else if constexpr (KIND == KQ5_0) {
      q4_1_pair_dot<R, 16, true>(blk, tb, a, r0, b, s32);
    } else if constexpr (KIND == KQ4_0) {
      q4_1_pair_dot<R, 8>(blk, tb, a, r0, b, s32);
    } else {
      bytes_pair_dot<R, KIND != KQ5_K, KO::nsc == 2>(blk, tb, a, r0, b, s32, s_hi);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * a.nb + b;
      const __m512 dx = _mm512_set1_ps(a.d[rb]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]), _mm512_mul_ps(dw, dx), acc[r]);
      if constexpr (KO::m) acc[r] = _mm512_fmadd_ps(scales16(wm + b * NC, mstep), _mm512_set1_ps(a.s[rb]), acc[r]);
      if constexpr (KO::nsc == 2)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_hi[r]), _mm512_mul_ps(scales16(wd + b * NC * 2 + NC, sstep), dx),
                                 acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// tile_pair for n <= R rows.
template <int R, int KIND>
inline void tile_pair_rows(int64_t n, const uint8_t* qs, int64_t tb, const typename KindOf<KIND>::S* wd,
                           int64_t sstep, const typename KindOf<KIND>::S* wm, int64_t mstep, const Act& a, int64_t r0,
                           __m512* out) {
  if (n == R)
    tile_pair<R, KIND>(qs, tb, wd, sstep, wm, mstep, a, r0, out);
  else if constexpr (R > 1)
    tile_pair_rows<R - 1, KIND>(n, qs, tb, wd, sstep, wm, mstep, a, r0, out);
}
#endif

// y[M, N] = x @ W.T (+ bias) (+ residual), W given as tiles (see the tile kernels). `signs`: the tiles
// hold no weight of -128 (Lin.signs), so a Q8_0 call may take the signs on the weights (sign_operands).
template <int KIND>
torch::Tensor matmul_impl(const std::vector<torch::Tensor>& xa, const torch::Tensor& qs, const torch::Tensor& wd,
                          const c10::optional<torch::Tensor>& wm, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& residual, int64_t n_out, bool signs = false) {
  const StageTimer timer(ST_LINEAR);
  TORCH_CHECK(xa.size() == 3, "activations are (q, d, s)");
  const auto& xq = xa[0];
  const int64_t M = xq.size(0), K = xq.size(1), nb = K / QK;
  const int64_t ntile = qs.size(0);
  const int64_t N = ntile * NC;
  TORCH_CHECK(qs.size(1) == nb, "weight has ", qs.size(1), " blocks per row, activations ", nb);
  TORCH_CHECK(n_out > N - NC && n_out <= N, "n_out must be within the last tile");
  auto y = new_tensor({M, n_out}, torch::kFloat32);
  Act a{xq.data_ptr<int8_t>(), xa[1].data_ptr<float>(), xa[2].data_ptr<float>(), K, nb};
#if SPECPLUG_VNNI
  if constexpr (KIND == KQ8_0 || KIND == KQ6_K) a.off = scaled_sums<QK / 2>(a.q, M, K, -128);
#endif
  if constexpr (KIND == KQ5_0 || KIND == KQ4_0) a.start = scaled_sums<QK>(a.q, M, K, KIND == KQ5_0 ? -16 : -8);  // every ISA
#if !SPECPLUG_VNNI
  if constexpr (KIND == KQ8_0)
    if (signs && M == 1 && at::get_num_threads() <= g_sign_threads.load(std::memory_order_relaxed))
      a.ops = sign_operands(a.q, K);
#endif
  const uint8_t* qsp = qs.data_ptr<uint8_t>();
  const int64_t tile_bytes = qs.stride(0);
  using S = typename KindOf<KIND>::S;
  constexpr int NSC = KindOf<KIND>::nsc;
  TORCH_CHECK(tile_bytes == nb * KindOf<KIND>::bytes && wd.numel() == ntile * nb * NC * NSC &&
                  wd.element_size() == (int64_t)sizeof(S) && wm.has_value() == KindOf<KIND>::m,
              "weight tiles do not match their kind (", KIND, ")");
  const S* wdp = (const S*)wd.data_ptr();
  const S* wmp = wm.has_value() ? (const S*)wm->data_ptr() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* rp = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    check_cpu_f32(*residual, "residual");
    TORCH_CHECK(residual->size(0) == M && residual->size(1) == n_out, "residual has the wrong shape");
    rp = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  float* yp = y.data_ptr<float>();
  const int64_t scale_bytes = nb * NC * (int64_t)sizeof(S) * NSC;  // a tile's d (and as many of m)
#if SPECPLUG_ZMM
  const bool pairs = M >= (KindOf<KIND>::bytes == 256 ? g_byte_pair_rows : g_pair_rows).load(std::memory_order_relaxed);
  // (tile_pairs below, ZMM_RT rows a pass; else one_tile, RT)
  const int64_t rows_a_pass = pairs ? ZMM_RT : RT;
#else
  const int64_t rows_a_pass = RT;
#endif
  const int64_t prefetch_rows = g_prefetch_rows.load(std::memory_order_relaxed);
  // the bytes a tile costs: its weights and scales, read once a pass over the rows
  const int64_t tile_work = (tile_bytes + scale_bytes * (wmp ? 2 : 1)) * ((M + rows_a_pass - 1) / rows_a_pass);
  // a row's 8 columns of tile t: + bias, + residual, stored (the last tile may be partial)
  auto put = [&](int64_t t, int64_t row, __m256 v) {
    const int64_t nc = std::min<int64_t>(NC, n_out - t * NC);
    if (bp) v = _mm256_add_ps(v, _mm256_loadu_ps(bp + t * NC));
    float* yr = yp + row * n_out + t * NC;
    const float* rr = rp ? rp + row * ldr + t * NC : nullptr;
    if (nc == NC) {
      if (rr) v = _mm256_add_ps(_mm256_loadu_ps(rr), v);
      _mm256_storeu_ps(yr, v);
    } else {
      float tmp[NC];
      _mm256_storeu_ps(tmp, v);
      for (int64_t c = 0; c < nc; ++c) yr[c] = rr ? rr[c] + tmp[c] : tmp[c];
    }
  };
  // one tile's 8 columns for every row, RT rows a pass
  auto one_tile = [&](int64_t t) {
    const uint8_t* tq = qsp + t * tile_bytes;
    const S* td = wdp + t * nb * NC * NSC;
    const S* tm = wmp ? wmp + t * nb * NC : nullptr;
    // With few rows a tile's compute is short and the weight stream sets the pace: then each block
    // asks for the weights TILE_AHEAD bytes on (tile's AHEAD), in calls of at most prefetch_rows
    // rows (a tuning per CPU). Asking for the whole tile two ahead at its start instead, a Zen 3
    // (AVX2) ran one row 8% faster than without, but a Zen 4 (AVX-512) ran 7-11% and a Zen 1 (AVX2)
    // 1.24-1.30x faster without; block by block, the Zen 1 (AMD EPYC, 2026-12-06) runs one row 1.12x
    // (Q4_1) and 1.37x (Q8_0) faster than with none, 2 rows 1.00-1.04x (docs/results/runtime.md).
    const bool ahead = M <= prefetch_rows;
    __m256 out[RT];
    for (int64_t r0 = 0; r0 < M; r0 += RT) {
      const int64_t R = std::min<int64_t>(RT, M - r0);
      if (ahead && r0 == 0)
        tile_rows<KIND, true>(R, tq, td, tm, a, r0, out);
      else
        tile_rows<KIND, false>(R, tq, td, tm, a, r0, out);
      for (int64_t r = 0; r < R; ++r) put(t, r0 + r, out[r]);
    }
  };
#if SPECPLUG_ZMM
  // tiles t and t + 1 together (tile_pair), the same values as one_tile on each
  auto tile_pairs = [&](int64_t t) {
    const uint8_t* tq = qsp + t * tile_bytes;
    const S* td = wdp + t * nb * NC * NSC;
    const S* tm = wmp ? wmp + t * nb * NC : nullptr;
    const int64_t sstep = nb * NC * NSC, mstep = nb * NC;
    __m512 out[ZMM_RT];
    for (int64_t r0 = 0; r0 < M; r0 += ZMM_RT) {
      const int64_t R = std::min<int64_t>(ZMM_RT, M - r0);
      tile_pair_rows<ZMM_RT, KIND>(R, tq, tile_bytes, td, sstep, tm, mstep, a, r0, out);
      for (int64_t r = 0; r < R; ++r) {
        put(t, r0 + r, _mm512_castps512_ps256(out[r]));
        put(t + 1, r0 + r, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out[r]), 1)));
      }
    }
  };
  const int64_t grain = pairs ? std::max<int64_t>(2, (CHUNK_BYTES / tile_work + 1) & ~int64_t(1))  // whole pairs
                              : CHUNK_BYTES / tile_work;
#else
  const int64_t grain = CHUNK_BYTES / tile_work;
#endif
  chunk_pool::parallel_for(ntile, grain, [&](int64_t t0, int64_t t1) {
    int64_t t = t0;
#if SPECPLUG_ZMM
    if (pairs)
      for (; t + 1 < t1; t += 2) tile_pairs(t);
#endif
    for (; t < t1; ++t) one_tile(t);
  });
  return y;
}

// Which kind a linear's tiles hold, from their shapes and types: nibble tiles (128 bytes a block)
// are Q4_1 (float16 scales and offsets), Q4_0 (float16 scales alone) or Q4_K (float32); nibbles and
// fifth bits (160) are Q5_0 (float16);
// byte tiles (256) are Q8_0 (float16), Q5_K (float32 with offsets) or Q6_K (float32, two scales a block).
int kind_of(const torch::Tensor& qs, const torch::Tensor& wd, bool has_m) {
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == torch::kUInt8 && qs.is_contiguous(),
              "weight tiles must be contiguous uint8 [tiles, blocks, bytes]");
  TORCH_CHECK(wd.is_contiguous(), "weight scales must be contiguous");
  const bool f32 = wd.scalar_type() == torch::kFloat32;
  if (qs.size(2) == 128) return f32 ? KQ4_K : has_m ? KQ4_1 : KQ4_0;
  if (qs.size(2) == 160) {
    TORCH_CHECK(!f32 && !has_m, "Q5_0 tiles (160 bytes a block) take float16 scales and no offsets");
    return KQ5_0;
  }
  TORCH_CHECK(qs.size(2) == 256, "weight tiles hold 128 (4-bit), 160 (5-bit) or 256 (8-bit) bytes a block, not ",
              qs.size(2));
  if (!f32) return KQ8_0;
  return has_m ? KQ5_K : KQ6_K;
}

torch::Tensor matmul(const std::vector<torch::Tensor>& xa, const torch::Tensor& qs, const torch::Tensor& wd,
                     const c10::optional<torch::Tensor>& wm, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual, int64_t n_out, bool signs = false) {
  switch (kind_of(qs, wd, wm.has_value())) {
    case KQ4_1: return matmul_impl<KQ4_1>(xa, qs, wd, wm, bias, residual, n_out);
    case KQ8_0: return matmul_impl<KQ8_0>(xa, qs, wd, wm, bias, residual, n_out, signs);
    case KQ4_K: return matmul_impl<KQ4_K>(xa, qs, wd, wm, bias, residual, n_out);
    case KQ5_K: return matmul_impl<KQ5_K>(xa, qs, wd, wm, bias, residual, n_out);
    case KQ5_0: return matmul_impl<KQ5_0>(xa, qs, wd, wm, bias, residual, n_out);
    case KQ4_0: return matmul_impl<KQ4_0>(xa, qs, wd, wm, bias, residual, n_out);
    default: return matmul_impl<KQ6_K>(xa, qs, wd, wm, bias, residual, n_out);
  }
}

torch::Tensor matmul_q4_1(const std::vector<torch::Tensor>& xa, const torch::Tensor& qs, const torch::Tensor& wd,
                          const torch::Tensor& wm, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& residual, int64_t n_out) {
  return matmul_impl<KQ4_1>(xa, qs, wd, wm, bias, residual, n_out);
}

torch::Tensor matmul_q8_0(const std::vector<torch::Tensor>& xa, const torch::Tensor& qs, const torch::Tensor& wd,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual,
                          int64_t n_out) {
  return matmul_impl<KQ8_0>(xa, qs, wd, c10::nullopt, bias, residual, n_out);
}

// D floats into a cache row of float32, or of float16 (round to nearest even).
inline void store_row(char* dst, const float* src, int64_t D, bool half) {
  if (!half) {
    std::memcpy(dst, src, D * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < D; i += 8)
    _mm_storeu_si128((__m128i*)(dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

// 8 cache values as floats, from a float32 or a float16 cache.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

inline void rms_norm_head(float* v, const float* w, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
  const float sc = 1.0f / std::sqrt(ss / (float)D + eps);
  for (int64_t i = 0; i < D; ++i) v[i] = v[i] * sc * w[i];
}

// One layer's K and V caches as the kernels read them: [n_seq, Hkv, cells, D], contiguous, float32
// or float16; from two such tensors, or layer li of stacked [n_layer, ...] ones without making
// views (a view is ~775 ns, two a layer in every forward).
struct CacheRef {
  char *k, *v;
  int64_t n_seq, heads, cells, D;
  bool half;
  CacheRef(const torch::Tensor& kc, const torch::Tensor& vc, int64_t li = -1) {
    const int64_t o = li < 0 ? 0 : 1;  // the layer dimension in front
    TORCH_CHECK(kc.dim() == 4 + o && kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.scalar_type() == vc.scalar_type() &&
                    (kc.scalar_type() == torch::kFloat32 || kc.scalar_type() == torch::kHalf),
                "the K/V caches must be contiguous float32 or float16 tensors of one shape ",
                o ? "[n_layer, n_seq, heads, cells, head_dim]" : "[n_seq, heads, cells, head_dim]");
    TORCH_CHECK(li < (o ? kc.size(0) : 1), "layer ", li, " of a cache of ", kc.size(0));
    n_seq = kc.size(o), heads = kc.size(o + 1), cells = kc.size(o + 2), D = kc.size(o + 3);
    half = kc.scalar_type() == torch::kHalf;
    const int64_t off = o ? li * kc.stride(0) * kc.element_size() : 0;
    k = (char*)kc.data_ptr() + off, v = (char*)vc.data_ptr() + off;
  }
};

// In place on qkv rows [M, (H + 2 Hkv) * D]: optional per-head RMSNorm of q and k, RoPE on
// interleaved pairs; then k and v are written to the layer's caches [n_seq, Hkv, ctx, D] at (seq, pos).
void rope_store_into(torch::Tensor qkv, const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& cos,
                     const torch::Tensor& sin, int64_t H, int64_t Hkv, const c10::optional<torch::Tensor>& q_norm,
                     const c10::optional<torch::Tensor>& k_norm, double eps, const CacheRef& cache) {
  const StageTimer timer(ST_ROPE);
  check_cpu_f32(qkv, "qkv");
  const int64_t M = qkv.size(0), D = cache.D, ncell = cache.cells;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv width does not match the heads");
  TORCH_CHECK(D % 8 == 0, "head_dim must be a multiple of 8");
  const bool half = cache.half;
  float* p = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  const int32_t* sp = seq.data_ptr<int32_t>();
  const int32_t* pp = pos.data_ptr<int32_t>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  char* kcp = cache.k;
  char* vcp = cache.v;
  const int64_t es = half ? 2 : 4;
  for (int64_t r = 0; r < M; ++r) {
    float* row = p + r * ld;
    const int64_t ps = pp[r], s = sp[r];
    TORCH_CHECK(ps >= 0 && ps < cos.size(0), "position out of range");
    const float* c = cp + ps * (D / 2);
    const float* sn = snp + ps * (D / 2);
    for (int64_t h = 0; h < H + Hkv; ++h) {
      float* v = row + h * D;
      if (qn && h < H) rms_norm_head(v, qn, D, (float)eps);
      if (kn && h >= H) rms_norm_head(v, kn, D, (float)eps);
      for (int64_t i = 0; i < D / 2; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * c[i] - b * sn[i];
        v[2 * i + 1] = a * sn[i] + b * c[i];
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {  // position ps lives in cell ps % ncell (a ring when ncell < ctx)
      const int64_t cell = ((s * Hkv + h) * ncell + ps % ncell) * D * es;
      store_row(kcp + cell, row + (H + h) * D, D, half);
      store_row(vcp + cell, row + (H + Hkv + h) * D, D, half);
    }
  }
}

// rope_store_into on a layer's cache tensors [n_seq, Hkv, ctx, D] (the Python-facing kernel).
void rope_store(torch::Tensor qkv, const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& cos,
                const torch::Tensor& sin, int64_t H, int64_t Hkv, const c10::optional<torch::Tensor>& q_norm,
                const c10::optional<torch::Tensor>& k_norm, double eps, torch::Tensor kc, torch::Tensor vc) {
  rope_store_into(qkv, seq, pos, cos, sin, H, Hkv, q_norm, k_norm, eps, CacheRef(kc, vc));
}

// ---- attention ------------------------------------------------------------------------------
//
// A row's keys are cut by position into fixed spans of ATT_SPAN ([0, 128), [128, 256), ...; the
// flash-decoding split). Per span a row gets its scores' max m, the sum l of exp(score - m) and
// the unnormalized sum of exp(score - m) * V; the spans are then combined in position order. The
// spans depend on positions only, never on the rows sharing a call, the threads or the order the
// tasks run in, so a row's result is still a function of its own query and keys (bit for bit).
// Spans give a call enough tasks to keep both cores busy at one row (one task per query head made
// 5:4 tasks per thread of SmolLM2's 9 heads before); the query heads that share a K/V head (GQA)
// go through a span together, and a task's rows go through it a piece at a time, so each K and V
// row read from memory serves all of them from L1. Against one task per query head: 1.1-1.3x at
// 512-1024 positions and 1-8 rows, about even at 128 (docs/results/runtime.md).
constexpr int64_t ATT_SPAN = 128;
constexpr int64_t ATT_ROWS = 16;  // rows of one sequence in one task at most
constexpr int ATT_NQ = 4;         // query heads that share a pass over a span's keys at most
#if defined(__AVX512F__)
constexpr bool ATT_REGS32 = true;  // 32 vector registers (AVX-512 VL encodes ymm16-31)
#else
constexpr bool ATT_REGS32 = false;
#endif
// Keys per pass of the scores and 8-lane groups of V per pass, so that the accumulators, the
// queries (or probabilities) and one loaded vector fit in the registers. Three heads of 4 keys on
// AVX2's 16 registers are 12 accumulators with the queries read from memory: each reduce4 then sums
// 4 scores, not 2 and 2 copies, and attention ran 1.03-1.09x faster than with 2 keys at 1-8 rows after
// 512-1024 positions on an AMD EPYC Zen 1, 2026-12-06 (the same bits; docs/results/runtime.md).
constexpr int att_keys(int nq) { return ATT_REGS32 || nq <= 3 ? 4 : 2; }
constexpr int att_vwidth(int nq) { return ATT_REGS32 ? (nq <= 3 ? 8 : 4) : (nq == 1 ? 8 : nq <= 3 ? 4 : 2); }

// Pointers to `cnt` cache rows (cells[0..cnt)).
template <typename T>
inline void cell_rows(const T* base, const int32_t* cells, int64_t cnt, int64_t D, const T** out) {
  for (int64_t j = 0; j < cnt; ++j) out[j] = base + (int64_t)cells[j] * D;
}

// The 8 lanes of a0..a3 summed, each as ((0+1)+(2+3)) + ((4+5)+(6+7)), to out[0..4). Every score
// is reduced this way whatever shares its call (duplicates fill a group of fewer than 4).
inline void reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Scores of NQ query heads (qs: NQ x D scaled values) against the KJ keys kr[0..KJ), to
// sc[g * ldsc + x]. A score's lanes are a multiply of the first 8 values, then multiply-adds of
// the next 8s in order, then reduce4: a function of its query and key alone.
template <int NQ, int KJ, int ND, typename T>
inline void scores_keys(const float* qs, int64_t nd_rt, const T* const* kr, float* sc, int64_t ldsc) {
  const int64_t nd = ND > 0 ? ND : nd_rt, D = nd * 8;  // ND > 0: the loop over the head unrolls
  __m256 a[NQ][KJ];
  for (int x = 0; x < KJ; ++x) {
    const __m256 k = load8(kr[x]);
    for (int g = 0; g < NQ; ++g) a[g][x] = _mm256_mul_ps(_mm256_loadu_ps(qs + g * D), k);
  }
  for (int64_t i = 1; i < nd; ++i) {
    __m256 qv[NQ];
    for (int g = 0; g < NQ; ++g) qv[g] = _mm256_loadu_ps(qs + g * D + 8 * i);
    for (int x = 0; x < KJ; ++x) {
      const __m256 k = load8(kr[x] + 8 * i);
      for (int g = 0; g < NQ; ++g) a[g][x] = _mm256_fmadd_ps(qv[g], k, a[g][x]);
    }
  }
  for (int g = 0; g < NQ; ++g) {
    float o[4];
    reduce4(a[g][0], a[g][KJ > 1 ? 1 : 0], a[g][KJ > 2 ? 2 : 0], a[g][KJ > 3 ? 3 : 0], o);
    for (int x = 0; x < KJ; ++x) sc[g * ldsc + x] = o[x];
  }
}

// Cache lines of one cache row (K or V) asked for ahead of use: K rows ATT_AHEAD keys ahead into L1,
// and the span's V rows into L2 while its scores are computed (the caches come from memory: a
// forward's weights have evicted them since the layer's last call). 0, 8, 16 and 32 keys read the
// same on the Zen 4; on the Cascade Lake 32 was 1.10-1.17x faster than 8 at 1-2 rows after 512-1024
// positions (30 layers, 14 rounds, docs/results/runtime.md), its memory being farther away.
#ifndef ATT_AHEAD
#define ATT_AHEAD 32
#endif
static_assert(ATT_AHEAD >= 0 && ATT_AHEAD <= 64, "ATT_AHEAD: 0..64 keys");
template <int HINT, typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = (const char*)row;
  for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64) _mm_prefetch(p + b, (_mm_hint)HINT);
}

template <int NQ, int ND, typename T>
inline void scores_span(const float* qs, int64_t nd, const T* const* kr, const T* const* vr, int64_t cnt,
                        int64_t avail, float* sc, int64_t ldsc) {
  constexpr int KJ = att_keys(NQ);
  const int64_t D = nd * 8;
  int64_t j = 0;
  for (; j + KJ <= cnt; j += KJ) {
    for (int x = 0; x < KJ; ++x) {
      if (ATT_AHEAD > 0 && j + x + ATT_AHEAD < avail) prefetch_row<_MM_HINT_T0>(kr[j + x + ATT_AHEAD], D);
      if (ATT_AHEAD > 0 && avail > 0) prefetch_row<_MM_HINT_T1>(vr[j + x], D);
    }
    scores_keys<NQ, KJ, ND, T>(qs, nd, kr + j, sc + j, ldsc);
  }
  for (; j < cnt; ++j) {
    if (ATT_AHEAD > 0 && avail > 0) prefetch_row<_MM_HINT_T1>(vr[j], D);
    scores_keys<NQ, 1, ND, T>(qs, nd, kr + j, sc + j, ldsc);
  }
}

// sc[0..n) -> exp(sc - m) in place, m their max (the tail up to a multiple of 8 is zeroed);
// returns the sum of the exponentials (8 lanes in order, then hsum). The AVX-512 build takes 16
// values a step, each lane the same operations, and adds the halves to the 8 lanes in order, so
// both builds give the same bits; only the padded last group is masked. Against one exp8 with its
// clamps and mask a group, on an AMD EPYC Zen 4, 2026-11-29 (scripts/attention_builds.py, 30 layers after
// 512 positions): the softmax with the call's fixed work 1.20x at 1-16 rows; attention from memory
// 0.95-1.10x over two runs and the forward 0.99-1.03x, within their noise (docs/results/runtime.md).
inline float softmax_span(float* sc, int64_t n, float* m_out) {
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
  float mx = hmax(mx8);
  for (; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
  for (j = n; j < ((n + 7) & ~int64_t(7)); ++j) sc[j] = -INFINITY;  // exp -> 0 in the padded tail
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  const int64_t whole = n & ~int64_t(7);  // groups of 8 without padding: no mask
  j = 0;
#if defined(__AVX512F__)
  const __m512 mv16 = _mm512_set1_ps(mx);
  for (; j + 16 <= whole; j += 16) {
    const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv16));
    _mm512_storeu_ps(sc + j, e);
    sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
    sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; j < whole; j += 8) {
    const __m256 e = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
    _mm256_storeu_ps(sc + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  if (j < n) {  // the last group, padded with -inf
    const __m256 x = _mm256_loadu_ps(sc + j);
    __m256 e = exp8_nonpos(_mm256_sub_ps(x, mv));
    e = _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(sc + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  *m_out = mx;
  return hsum(sum8);
}

// acc[g * lda + 8 (i0 + w) ...] += p[g * ldp + j] * V_j[8 (i0 + w) ...] over j in order, for W
// groups of 8 lanes from i0: each lane one multiply-add chain in key order (continued from the
// value stored in acc, so a span can be summed in pieces with the same bits).
template <int NQ, int W, typename T>
inline void pv_lanes(const float* p, int64_t ldp, const T* const* vr, int64_t cnt, int64_t i0, float* acc,
                     int64_t lda) {
  __m256 a[NQ][W];
  for (int g = 0; g < NQ; ++g)
    for (int w = 0; w < W; ++w) a[g][w] = _mm256_loadu_ps(acc + g * lda + 8 * (i0 + w));
  for (int64_t j = 0; j < cnt; ++j) {
    __m256 pj[NQ];
    for (int g = 0; g < NQ; ++g) pj[g] = _mm256_broadcast_ss(p + g * ldp + j);
    for (int w = 0; w < W; ++w) {
      const __m256 v = load8(vr[j] + 8 * (i0 + w));
      for (int g = 0; g < NQ; ++g) a[g][w] = _mm256_fmadd_ps(pj[g], v, a[g][w]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * lda + 8 * (i0 + w), a[g][w]);
}

#if defined(__AVX512F__) && !defined(ATT_NO_ZMM)
// pv_lanes on 512-bit registers, two 8-lane groups in one (W even): each lane the same multiply-add
// chain in key order, so the same bits.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
template <int NQ, int W, typename T>
inline void pv_lanes16(const float* p, int64_t ldp, const T* const* vr, int64_t cnt, int64_t i0, float* acc,
                       int64_t lda) {
  constexpr int W2 = W / 2;
  __m512 a[NQ][W2];
  for (int g = 0; g < NQ; ++g)
    for (int w = 0; w < W2; ++w) a[g][w] = _mm512_loadu_ps(acc + g * lda + 8 * (i0 + 2 * w));
  for (int64_t j = 0; j < cnt; ++j) {
    __m512 pj[NQ];
    for (int g = 0; g < NQ; ++g) pj[g] = _mm512_set1_ps(p[g * ldp + j]);
    for (int w = 0; w < W2; ++w) {
      const __m512 v = load16(vr[j] + 8 * (i0 + 2 * w));
      for (int g = 0; g < NQ; ++g) a[g][w] = _mm512_fmadd_ps(pj[g], v, a[g][w]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int w = 0; w < W2; ++w) _mm512_storeu_ps(acc + g * lda + 8 * (i0 + 2 * w), a[g][w]);
}
#define ATT_ZMM 1
#else
#define ATT_ZMM 0
#endif

// One row's V sums over a piece for all nd groups of 8 lanes, W groups a pass (16-lane passes first
// where the build has them).
template <int NQ, int W, typename T>
inline void pv_rows(const float* p, int64_t ldp, const T* const* vr, int64_t cnt, int64_t nd, float* acc,
                    int64_t lda) {
  int64_t i = 0;
#if ATT_ZMM
  if constexpr (W % 2 == 0)
    for (; i + W <= nd; i += W) pv_lanes16<NQ, W, T>(p, ldp, vr, cnt, i, acc, lda);
#endif
  for (; i + W <= nd; i += W) pv_lanes<NQ, W, T>(p, ldp, vr, cnt, i, acc, lda);
  for (; i < nd; ++i) pv_lanes<NQ, 1, T>(p, ldp, vr, cnt, i, acc, lda);
}

// Keys per piece of a span that a task's rows go through together, so that the piece's K (V)
// rows, read from memory by the first row, serve the others from L1.
constexpr int64_t ATT_PIECE = 32;

// A float16 cache's piece widened to float32 once for all the rows of a task, from this many rows on
// (0: never), instead of each row widening every K and V value it reads. The same values, the same
// bits. Where widening is dear (Zen 1: a key's scores of 3 heads took 18.7 ns on float16 rows, 12.5 on
// float32 ones, its 8 vcvtph2ps ymm ~2 cycles each beside 24 multiply-adds) it pays from 3 rows:
// 1.08-1.09x at 3, 1.13-1.24x at 4-8 on an AMD EPYC Zen 1, 2026-12-06 (even at 2). Where it is cheap
// (an AMD EPYC Zen 4's AVX-512 build, 2026-11-29) a separate pass waits on the memory reads the scores
// had overlapped: 0.75-0.87x, so the AVX-512 build never widens (docs/results/runtime.md).
#ifndef ATT_WIDEN_ROWS
#if defined(__AVX512F__)
#define ATT_WIDEN_ROWS 0
#else
#define ATT_WIDEN_ROWS 3
#endif
#endif
static_assert(ATT_WIDEN_ROWS >= 0, "ATT_WIDEN_ROWS: 0 (never) or the rows from which a piece is widened once");
// The piece buffer of this thread (ATT_PIECE rows of up to 256 values: head_dim <= 256).
inline float* widened_piece() {
  thread_local std::vector<float> buf(ATT_PIECE * 256);
  return buf.data();
}
// rows[0..cnt) widened into buf, out[j] the widened row j; asking for cache lines as scores_span
// does: K rows ATT_AHEAD keys ahead (`ahead`, n_ahead known) into L1, the piece's V rows into L2.
inline void widen_rows(const uint16_t* const* rows, int64_t cnt, int64_t D, float* buf, const float** out,
                       const uint16_t* const* ahead = nullptr, int64_t n_ahead = 0,
                       const uint16_t* const* v_next = nullptr) {
  for (int64_t j = 0; j < cnt; ++j) {
    if (ATT_AHEAD > 0 && j + ATT_AHEAD < n_ahead) prefetch_row<_MM_HINT_T0>(ahead[j + ATT_AHEAD], D);
    if (ATT_AHEAD > 0 && v_next) prefetch_row<_MM_HINT_T1>(v_next[j], D);
    float* d = buf + j * D;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= D; i += 16) _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rows[j] + i))));
#endif
    for (; i < D; i += 8) _mm256_storeu_ps(d + i, load8(rows[j] + i));
    out[j] = d;
  }
}

// The rows of one task over one span, for NQ query heads that share a K/V head: row r (q[r]: its
// first head's D values, the others ldq apart) sees the span's keys kr/vr[a[r]..e[r]) (none when
// a[r] >= e[r]); each head's partial (acc[0..D), then m, l) goes to part[r] + g * ps. Scores, then
// per row and head its span softmax, then the V sums; pieces of ATT_PIECE keys at a time for all
// the rows (a float16 piece widened once for them from ATT_WIDEN_ROWS rows). `avail`: K rows known
// from kr[0] (the next span's first keys, prefetched ahead).
template <int NQ, int ND, typename T>
void attend_span(int64_t R, const float* const* q, int64_t ldq, int64_t nd_rt, float scale, const T* const* kr,
                 const T* const* vr, const int64_t* a, const int64_t* e, int64_t avail, float* const* part, int64_t ps,
                 float* qs, float* sc, int64_t ldsc) {
  const int64_t nd = ND > 0 ? ND : nd_rt, D = nd * 8;
  int64_t lo = INT64_MAX, hi = 0, first = -1, rows = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (a[r] >= e[r]) continue;
    lo = std::min(lo, a[r]), hi = std::max(hi, e[r]), first = first < 0 ? r : first, ++rows;
    for (int g = 0; g < NQ; ++g)
      for (int64_t i = 0; i < nd; ++i)
        _mm256_storeu_ps(qs + (r * NQ + g) * D + 8 * i,
                         _mm256_mul_ps(_mm256_loadu_ps(q[r] + g * ldq + 8 * i), _mm256_set1_ps(scale)));
  }
  if (first < 0) return;
  constexpr bool half = std::is_same_v<T, uint16_t>;
  const bool widen = half && ATT_WIDEN_ROWS > 0 && rows >= ATT_WIDEN_ROWS;
  const float* wr[ATT_PIECE];
  float* wbuf = widen ? widened_piece() : nullptr;
  for (int64_t b0 = lo; b0 < hi; b0 += ATT_PIECE) {
    if constexpr (half)
      if (widen) widen_rows(kr + b0, std::min(ATT_PIECE, hi - b0), D, wbuf, wr, kr + b0, avail - b0, vr + b0);
    for (int64_t r = first; r < R; ++r) {
      const int64_t s = std::max(b0, a[r]), t = std::min(b0 + ATT_PIECE, e[r]);
      if (s >= t) continue;
      float* out = sc + r * NQ * ldsc + (s - a[r]);
      if (widen)
        scores_span<NQ, ND, float>(qs + r * NQ * D, nd, wr + (s - b0), nullptr, t - s, 0, out, ldsc);
      else
        scores_span<NQ, ND, T>(qs + r * NQ * D, nd, kr + s, vr + s, t - s, r == first ? avail - s : 0, out, ldsc);
    }
  }
  constexpr int W = att_vwidth(NQ);
  for (int64_t r = first; r < R; ++r) {
    if (a[r] >= e[r]) continue;
    for (int g = 0; g < NQ; ++g) {
      float* pg = part[r] + g * ps;
      pg[D + 1] = softmax_span(sc + (r * NQ + g) * ldsc, e[r] - a[r], pg + D);
      for (int64_t i = 0; i < D; ++i) pg[i] = 0.0f;
    }
  }
  for (int64_t b0 = lo; b0 < hi; b0 += ATT_PIECE) {
    if constexpr (half)
      if (widen) widen_rows(vr + b0, std::min(ATT_PIECE, hi - b0), D, wbuf, wr);
    for (int64_t r = first; r < R; ++r) {
      const int64_t s = std::max(b0, a[r]), t = std::min(b0 + ATT_PIECE, e[r]);
      if (s >= t) continue;
      const float* p = sc + r * NQ * ldsc + (s - a[r]);
      if (widen)
        pv_rows<NQ, W, float>(p, ldsc, wr + (s - b0), t - s, nd, part[r], ps);
      else
        pv_rows<NQ, W, T>(p, ldsc, vr + s, t - s, nd, part[r], ps);
    }
  }
}

template <int ND, typename T>
void attend_span_nq(int64_t nq, int64_t R, const float* const* q, int64_t ldq, int64_t nd, float scale,
                    const T* const* kr, const T* const* vr, const int64_t* a, const int64_t* e, int64_t avail,
                    float* const* part, int64_t ps, float* qs, float* sc, int64_t ldsc) {
  switch (nq) {
    case 1: attend_span<1, ND, T>(R, q, ldq, nd, scale, kr, vr, a, e, avail, part, ps, qs, sc, ldsc); break;
    case 2: attend_span<2, ND, T>(R, q, ldq, nd, scale, kr, vr, a, e, avail, part, ps, qs, sc, ldsc); break;
    case 3: attend_span<3, ND, T>(R, q, ldq, nd, scale, kr, vr, a, e, avail, part, ps, qs, sc, ldsc); break;
    default: attend_span<4, ND, T>(R, q, ldq, nd, scale, kr, vr, a, e, avail, part, ps, qs, sc, ldsc); break;
  }
}

// attend_span for G query heads, ATT_NQ at a time (q[r], part[r]: the first head's); head_dim 64
// and 128 with their loops unrolled.
template <typename T>
void attend_span_heads(int64_t G, int64_t R, const float* const* q, int64_t ldq, int64_t nd, float scale,
                       const T* const* kr, const T* const* vr, const int64_t* a, const int64_t* e, int64_t avail,
                       float* const* part, int64_t ps, float* qs, float* sc, int64_t ldsc) {
  const float* qg[ATT_ROWS];
  float* pg[ATT_ROWS];
  for (int64_t g0 = 0; g0 < G; g0 += ATT_NQ) {
    for (int64_t r = 0; r < R; ++r) qg[r] = q[r] + g0 * ldq, pg[r] = part[r] + g0 * ps;
    const int64_t nq = std::min<int64_t>(ATT_NQ, G - g0);
    switch (nd) {
      case 8: attend_span_nq<8, T>(nq, R, qg, ldq, nd, scale, kr, vr, a, e, avail, pg, ps, qs, sc, ldsc); break;
      case 16: attend_span_nq<16, T>(nq, R, qg, ldq, nd, scale, kr, vr, a, e, avail, pg, ps, qs, sc, ldsc); break;
      default: attend_span_nq<0, T>(nq, R, qg, ldq, nd, scale, kr, vr, a, e, avail, pg, ps, qs, sc, ldsc); break;
    }
  }
}

// One head of one row from its spans' partials (part + s * step, s in position order; l = 0 marks
// a span the row does not see): m = the spans' max, then acc and l summed with weights
// exp(m_s - m) in span order, out = acc / l. A row seen in one span gets its acc / l exactly.
inline void combine_spans(const float* part, int64_t step, int64_t nspan, int64_t nd, float* out) {
  const int64_t D = nd * 8;
  float m = -INFINITY;
  for (int64_t s = 0; s < nspan; ++s)
    if (part[s * step + D + 1] != 0.0f) m = std::max(m, part[s * step + D]);
  __m256 acc[32];
  for (int64_t i = 0; i < nd; ++i) acc[i] = _mm256_setzero_ps();
  __m128 l = _mm_setzero_ps();
  for (int64_t s = 0; s < nspan; ++s) {
    const float* p = part + s * step;
    if (p[D + 1] == 0.0f) continue;
    const __m256 w = exp8_nonpos(_mm256_set1_ps(p[D] - m));
    for (int64_t i = 0; i < nd; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8 * i), w, acc[i]);
    l = _mm_fmadd_ss(_mm_set_ss(p[D + 1]), _mm256_castps256_ps128(w), l);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / _mm_cvtss_f32(l));
  for (int64_t i = 0; i < nd; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

// A call's plan: its rows grouped into runs, the cells each run sees with each row's range in
// them, the spans, the tasks. It depends on the rows' sequences, positions and limits, the valid
// map, the layer's window, heads and cache cells, and the thread count; never on the queries or
// the caches' values. So the layers of one forward that share those (every layer of SmolLM2; a
// Gemma forward's sliding and global layers make one each) run on one plan, made by the first
// (AttPlans below). 30 plans a forward were 0.16-0.23 ms of attention's 0.6-0.7 at one row; one
// plan: the forward after 512-1024 positions 1.00-1.04x at one row, 1.00-1.03x at 2-16 (Zen 4).
struct AttPlan {
  struct Task {
    int64_t grp, s0, s1, g0;  // (run, K/V head), spans [s0, s1), query heads from g0
  };
  int64_t M = 0, H = 0, Hkv = 0, D = 0, ncell = 0, window = 0;  // what the plan was made for
  int64_t nrun = 0, hs = 0, ngs = 0;
  bool span_tasks = false;
  // run r: rows [run_start[r], run_start[r + 1]); its cells cell_list[list_start[r]...]; its
  // spans span0[r]...; row i sees entries [ra[i], rn[i]) of its run's cells; (run, K/V head) ->
  // its partials' first block part0
  std::vector<int64_t> run_start, list_start, span0, nspan, part0, ra, rn, span_at;
  std::vector<int32_t> cell_list, cpos;
  std::vector<Task> tasks;

  bool made_for(int64_t m, int64_t h, int64_t hkv, int64_t d, int64_t nc, int64_t w) const {
    return M == m && H == h && Hkv == hkv && D == d && ncell == nc && window == w;
  }
  void make(const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid,
            const c10::optional<torch::Tensor>& limit, int64_t M, int64_t H, int64_t Hkv, int64_t D, int64_t ncell,
            int64_t window);
};

// The plans of one forward, looked up by what they were made for; clear() keeps their buffers.
class AttPlans {
 public:
  void clear() { used_ = 0; }
  const AttPlan& get(const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid,
                     const c10::optional<torch::Tensor>& limit, int64_t M, int64_t H, int64_t Hkv, int64_t D,
                     int64_t ncell, int64_t window) {
    for (size_t i = 0; i < used_; ++i)
      if (plans_[i].made_for(M, H, Hkv, D, ncell, window)) return plans_[i];
    if (used_ == plans_.size()) plans_.emplace_back();
    AttPlan& p = plans_[used_++];
    p.make(seq, pos, valid, limit, M, H, Hkv, D, ncell, window);
    return p;
  }

 private:
  std::vector<AttPlan> plans_;
  size_t used_ = 0;
};

template <typename T>
torch::Tensor attention_run(const AttPlan& plan, const torch::Tensor& q, const T* kcp, const T* vcp,
                            const torch::Tensor& seq, double scale);

// Attention of each query row over its own sequence's valid positions [0, limit] (causal: limit =
// pos; a block drafter attends bidirectionally inside its block: limit = the block's last position);
// with a sliding window (window > 0) only positions p with pos - p < window (llama.cpp's standard
// SWA mask). q: rows of [M, >= H*D] (row stride any); caches [n_seq, Hkv, cells, D] of float32 or
// float16 (float16 halves the bytes attention reads; values are widened to float32 as they load):
// position p lives in cell p % cells, so a sliding-window layer's cache can be a ring of a little
// more than the window (the caller keeps the positions it reads there, KVCache); valid [n_seq, ctx]
// says which positions hold a token. `plans`: a forward's plans, for its layers to share (none:
// the call makes its own).
torch::Tensor attention_planned(const torch::Tensor& q, const CacheRef& cache, const torch::Tensor& seq,
                                const torch::Tensor& pos, const torch::Tensor& valid, int64_t H, double scale,
                                const c10::optional<torch::Tensor>& limit, int64_t window, AttPlans* plans) {
  const StageTimer timer(ST_ATTENTION);
  const int64_t D = cache.D;
  TORCH_CHECK(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
  TORCH_CHECK(q.stride(1) == 1 && q.scalar_type() == torch::kFloat32);
  thread_local AttPlans own;
  if (!plans) own.clear(), plans = &own;
  const AttPlan& plan = plans->get(seq, pos, valid, limit, q.size(0), H, cache.heads, D, cache.cells, window);
  if (cache.half)
    return attention_run<uint16_t>(plan, q, (const uint16_t*)cache.k, (const uint16_t*)cache.v, seq, scale);
  return attention_run<float>(plan, q, (const float*)cache.k, (const float*)cache.v, seq, scale);
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                        const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid, int64_t H,
                        double scale, const c10::optional<torch::Tensor>& limit, int64_t window) {
  return attention_planned(q, CacheRef(kc, vc), seq, pos, valid, H, scale, limit, window, nullptr);
}

void AttPlan::make(const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid,
                   const c10::optional<torch::Tensor>& limit, int64_t M_, int64_t H_, int64_t Hkv_, int64_t D_,
                   int64_t ncell_, int64_t window_) {
  M = M_, H = H_, Hkv = Hkv_, D = D_, ncell = ncell_, window = window_;
  const int64_t G = H / Hkv, ctx = valid.size(1);
  TORCH_CHECK(valid.dim() == 2 && valid.is_contiguous() && window >= 0, "valid must be [n_seq, ctx]; window >= 0");
  const int32_t* sp = seq.data_ptr<int32_t>();
  const int32_t* pp = pos.data_ptr<int32_t>();
  const int32_t* lp = limit.has_value() ? limit->data_ptr<int32_t>() : pp;
  TORCH_CHECK(!limit.has_value() || (limit->numel() == M && limit->scalar_type() == torch::kInt32),
              "limit must hold one int32 per row");
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(lp[r] >= 0 && lp[r] < ctx, "attention limit out of range");
  const bool* vp = valid.data_ptr<bool>();
  // the first position row r may see: 0, or the start of its sliding window
  auto first = [&](int64_t r) -> int64_t { return window > 0 ? std::max<int64_t>(0, pp[r] - window + 1) : 0; };
  // Runs of consecutive rows of one sequence (at most ATT_ROWS) share a task's K/V reads.
  run_start.assign(1, 0);
  for (int64_t r = 1; r < M; ++r)
    if (sp[r] != sp[r - 1] || r - run_start.back() == ATT_ROWS) run_start.push_back(r);
  nrun = (int64_t)run_start.size();
  run_start.push_back(M);
  // Each run's list of the cells its rows see (the valid positions from the lowest first position
  // to the highest limit of its rows; row r sees entries [ra[r], rn[r]) of it), made once here for
  // all the run's tasks, and where each of its spans starts in the list.
  list_start.assign(nrun, 0), span0.assign(nrun + 1, 0), nspan.assign(nrun, 0);
  int64_t full_spans = 0;  // (run, K/V head, span)s of at least a quarter of ATT_SPAN keys
  int64_t span_rows = 0;   // (span, row)s of all runs: one K/V head's partials for all its query heads
  cell_list.clear();
  span_at.clear();
  grow(cpos, ctx);
  grow(ra, M);
  grow(rn, M);
  for (int64_t run = 0; run < nrun; ++run) {
    const int64_t r0 = run_start[run], R = run_start[run + 1] - r0;
    int64_t top = 0, bottom = ctx;
    for (int64_t r = r0; r < r0 + R; ++r) top = std::max<int64_t>(top, lp[r]), bottom = std::min(bottom, first(r));
    const bool* vm = vp + sp[r0] * ctx;
    int64_t m = 0;
    list_start[run] = (int64_t)cell_list.size();
    for (int64_t c = bottom; c <= top; ++c)
      if (vm[c]) cpos[m++] = (int32_t)c, cell_list.push_back((int32_t)(c < ncell ? c : c % ncell));
    for (int64_t r = r0; r < r0 + R; ++r) {
      ra[r] = std::lower_bound(cpos.begin(), cpos.begin() + m, first(r)) - cpos.begin();
      rn[r] = std::upper_bound(cpos.begin(), cpos.begin() + m, lp[r]) - cpos.begin();
    }
    const int64_t s_lo = bottom / ATT_SPAN;
    nspan[run] = top / ATT_SPAN - s_lo + 1;
    span0[run + 1] = span0[run] + nspan[run];
    for (int64_t s = 0; s <= nspan[run]; ++s) {  // the spans' starts, then the list's end
      const int64_t at =
          s < nspan[run] ? std::lower_bound(cpos.begin(), cpos.begin() + m, (s_lo + s) * ATT_SPAN) - cpos.begin() : m;
      if (s > 0) full_spans += Hkv * (at - span_at.back() >= ATT_SPAN / 4);
      span_at.push_back(at);
    }
    span_rows += nspan[run] * R;
  }
  // Tasks: (run, K/V head, spans, query heads): a task goes through one span or all of its run's,
  // for hs of the G query heads that share the K/V head, writing its rows' partials; the last
  // task of a (run, K/V head, query heads) to finish combines them (atomic count, acq_rel: the
  // other tasks' partials are visible to it). How a call is cut changes no bit (a head's
  // arithmetic is the same whichever heads share its pass, and the spans are fixed), so the cut
  // follows the work: whole runs when there are enough of them for the threads (prefill), else
  // one span a task when enough spans hold many keys (long context), else all spans a task and
  // fewer query heads (short context, where a span of a few keys is not worth a task). Two tasks a
  // thread: with four, a row after 129-511 positions would be cut into one task per query head,
  // each reading its K/V head's keys again with one head's accumulators; with two it takes the spans
  // with all its heads. Two against four on an AMD EPYC Zen 4 (2026-11-29): attention from memory
  // after 128-256 positions 1.09-1.42x faster at 1-8 rows, the forward after 256 1.00 / 1.04 / 1.06 /
  // 1.06x at 1 / 2 / 4 / 8 rows; from 512 positions on both cut the same (docs/results/runtime.md).
  const int64_t want = 2 * at::get_num_threads();
  const int64_t ps = D + 8;  // floats per partial: acc[D], m, l (and padding)
  // (span tasks share a buffer of their partials: at most 4 MB of them, else whole runs a task)
  span_tasks = nrun * Hkv < want && full_spans >= want && span_rows * H * ps <= (int64_t(1) << 20);
  hs = G;
  if (nrun * Hkv < want && !span_tasks)
    while (hs > 1 && nrun * Hkv * ((G + hs - 1) / hs) < want) hs = (hs + 1) / 2;
  ngs = (G + hs - 1) / hs;
  part0.assign(nrun * Hkv + 1, 0);
  tasks.clear();
  for (int64_t run = 0; run < nrun; ++run)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t grp = run * Hkv + h, R = run_start[run + 1] - run_start[run];
      part0[grp + 1] = part0[grp] + nspan[run] * R;
      for (int64_t s = 0; s < (span_tasks ? nspan[run] : 1); ++s)
        for (int64_t g0 = 0; g0 < G; g0 += hs) tasks.push_back({grp, s, span_tasks ? s + 1 : nspan[run], g0});
    }
}

// The call's tasks on the pool, by its plan.
template <typename T>
torch::Tensor attention_run(const AttPlan& plan, const torch::Tensor& q, const T* kcp, const T* vcp,
                            const torch::Tensor& seq, double scale) {
  const int64_t M = plan.M, H = plan.H, Hkv = plan.Hkv, ncell = plan.ncell, D = plan.D, G = H / Hkv, nd = D / 8;
  const int64_t nrun = plan.nrun, hs = plan.hs, ngs = plan.ngs, ps = D + 8;
  const bool span_tasks = plan.span_tasks;
  TORCH_CHECK(q.size(0) == M && seq.numel() >= M, "attention: the plan is for ", M, " rows");
  auto out = new_tensor({M, H * D}, torch::kFloat32);
  const float* qp = q.data_ptr<float>();
  const int64_t ldq = q.stride(0);
  const int32_t* sp = seq.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = (float)scale;
  // Partials of tasks that share a (run, K/V head) live in one buffer of the call (few runs: a
  // verification's); a task that goes through all its spans keeps them in its thread's own (a
  // prefill's many runs would need a buffer of runs x spans x rows x heads otherwise). (The
  // calling thread's buffers live across calls: no allocation per call; the tasks on other
  // threads see them through the pointers taken below.)
  thread_local std::vector<float> parts;
  if (span_tasks) grow(parts, plan.part0[nrun * Hkv] * G * ps);
  thread_local std::unique_ptr<std::atomic<int32_t>[]> left_buf;
  thread_local int64_t left_cap = 0;
  if (left_cap < nrun * Hkv * ngs) left_cap = nrun * Hkv * ngs, left_buf.reset(new std::atomic<int32_t>[left_cap]);
  std::atomic<int32_t>* left = left_buf.get();
  for (int64_t grp = 0; grp < nrun * Hkv; ++grp)
    for (int64_t gi = 0; gi < ngs; ++gi)
      left[grp * ngs + gi].store((int32_t)(span_tasks ? plan.nspan[grp / Hkv] : 1), std::memory_order_relaxed);
  const int32_t* cells = plan.cell_list.data();
  const int64_t *rap = plan.ra.data(), *rnp = plan.rn.data(), *sat = plan.span_at.data();
  const int64_t *runs = plan.run_start.data(), *lists = plan.list_start.data(), *spans0 = plan.span0.data(),
                *nspans = plan.nspan.data(), *parts0 = plan.part0.data();
  const AttPlan::Task* taskp = plan.tasks.data();
  float* partp = parts.data();
  chunk_pool::parallel_for((int64_t)plan.tasks.size(), 1, [&](int64_t t0, int64_t t1) {
    // each thread's buffers live across calls (no allocation per task)
    thread_local std::vector<float> qs, sc, own;
    const int64_t ldsc = ATT_SPAN + 8;
    grow(qs, ATT_ROWS * ATT_NQ * D);
    grow(sc, ATT_ROWS * ATT_NQ * ldsc);
    const T* kr[ATT_SPAN + 64];  // ATT_AHEAD <= 64
    const T* vr[ATT_SPAN];
    const float* qr[ATT_ROWS];
    float* pr[ATT_ROWS];
    int64_t ar[ATT_ROWS], er[ATT_ROWS];
    for (int64_t t = t0; t < t1; ++t) {
      const AttPlan::Task& task = taskp[t];
      const int64_t grp = task.grp, g0 = task.g0, gn = std::min(hs, G - g0);
      const int64_t run = grp / Hkv, h = grp % Hkv;
      const int64_t r0 = runs[run], R = runs[run + 1] - r0, sq = sp[r0];
      const int64_t* at = sat + spans0[run] + run;  // the run's nspan + 1 span starts
      const int32_t* cl = cells + lists[run];
      for (int64_t r = 0; r < R; ++r) qr[r] = qp + (r0 + r) * ldq + (h * G + g0) * D;
      // partial (span s, row r, head g0 + g) at base + s * span_step + r * row_step + g * ps
      float* base;
      int64_t row_step, span_step;
      if (span_tasks) {
        base = partp + (parts0[grp] * G + g0) * ps, row_step = G * ps, span_step = R * G * ps;
      } else {
        grow(own, nspans[run] * R * gn * ps);
        base = own.data(), row_step = gn * ps, span_step = R * gn * ps;
      }
      for (int64_t s = task.s0; s < task.s1; ++s) {
        const int64_t e0 = at[s], e1 = at[s + 1];
        // K rows up to ATT_AHEAD entries past the span (the next span's first keys, to prefetch)
        const int64_t k_end = std::min(at[nspans[run]], e1 + ATT_AHEAD);
        cell_rows(kcp + (sq * Hkv + h) * ncell * D, cl + e0, k_end - e0, D, kr);
        cell_rows(vcp + (sq * Hkv + h) * ncell * D, cl + e0, e1 - e0, D, vr);
        for (int64_t r = 0; r < R; ++r) {
          pr[r] = base + s * span_step + r * row_step;
          ar[r] = std::max(rap[r0 + r], e0) - e0, er[r] = std::min(rnp[r0 + r], e1) - e0;
          if (ar[r] >= er[r])
            for (int64_t g = 0; g < gn; ++g) pr[r][g * ps + D + 1] = 0.0f;  // the row does not see this span
        }
        attend_span_heads<T>(gn, R, qr, D, nd, fscale, kr, vr, ar, er, k_end - e0, pr, ps, qs.data(), sc.data(),
                             ldsc);
      }
      if (left[grp * ngs + g0 / hs].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < gn; ++g)
          combine_spans(base + r * row_step + g * ps, span_step, nspans[run], nd,
                        op + (r0 + r) * H * D + (h * G + g0 + g) * D);
    }
  });
  return out;
}

// One linear given as [qs, d, m, bias, norm_weight] (absent ones as empty tensors) and its
// output width; the tiles' shapes and types say which kind (kind_of).
struct Lin {
  torch::Tensor qs, d, m, bias, norm;
  int64_t n_out;
  bool signs = false;  // Q8_0 tiles with no weight of -128 (with_signs; see sign_operands)
};

inline c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

Lin unpack(const std::vector<torch::Tensor>& w, int64_t n_out) {
  TORCH_CHECK(w.size() == 5, "a linear is [qs, d, m, bias, norm_weight]");
  return Lin{w[0], w[1], w[2], w[3], w[4], n_out};
}

// A linear a LayerStack keeps, with signs found once: whether its tiles are Q8_0 with no weight of -128.
Lin with_signs(Lin l) {
#if !SPECPLUG_VNNI
  l.signs = kind_of(l.qs, l.d, l.m.defined() && l.m.numel() > 0) == KQ8_0 && no_byte_80(l.qs);
#endif
  return l;
}

torch::Tensor apply(const Lin& l, const std::vector<torch::Tensor>& xa, const c10::optional<torch::Tensor>& residual) {
  return matmul(xa, l.qs, l.d, opt(l.m), opt(l.bias), residual, l.n_out, l.signs);
}

// What a decoder layer does beyond llama's: Gemma's sliding window (0: none), its norms after
// attention and after the MLP (empty: none; then x + norm(f(x)) in place of x + f(x)), GeGLU.
struct LayerKind {
  int64_t window = 0;
  torch::Tensor post_attn, post_ffn;
  bool gelu = false;
};

// out = residual + f, or residual + rms_norm(f) * post when the layer has that norm.
torch::Tensor add_out(const Lin& l, const std::vector<torch::Tensor>& xa, const torch::Tensor& residual,
                      const torch::Tensor& post, double eps) {
  if (post.defined() && post.numel() > 0) return rms_norm_add(apply(l, xa, c10::nullopt), post, eps, residual);
  return apply(l, xa, residual);
}

// The layer after its attention input is quantized (xq): qkv, RoPE and the cache write, attention,
// o with the residual x, then the FFN.
torch::Tensor layer_rest(const torch::Tensor& x, const std::vector<torch::Tensor>& xq, const Lin& qkv, const Lin& o,
                         const Lin& gu, const Lin& down, const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm, double eps, const CacheRef& cache,
                         const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid,
                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t H, int64_t Hkv, double scale,
                         const c10::optional<torch::Tensor>& limit, const LayerKind& kind = LayerKind(),
                         AttPlans* plans = nullptr) {
  auto h = apply(qkv, xq, c10::nullopt);
  rope_store_into(h, seq, pos, cos, sin, H, Hkv, q_norm, k_norm, eps, cache);
  auto a = attention_planned(h, cache, seq, pos, valid, H, scale, limit, kind.window, plans);
  auto x1 = add_out(o, quantize_rows(a, c10::nullopt, 0.0), x, kind.post_attn, eps);
  auto g = apply(gu, quantize_rows(x1, opt(gu.norm), eps), c10::nullopt);
  return add_out(down, kind.gelu ? gelu_mul_quantize(g) : silu_mul_quantize(g), x1, kind.post_ffn, eps);
}

// A whole decoder layer on the native kernels, the same calls in the same order as the Python
// DecoderLayer makes them (so results are bit-identical to it), in one call from Python:
// x + o(attention(rope(qkv(norm(x))))), then + down(silu(gate) * up)(norm(.)); Gemma's layers
// with a window, post norms (empty tensors: none) and GeGLU. The layer's own arguments come in
// the order LayerStack::add takes them (less its RoPE table index), then the call's.
torch::Tensor layer_forward(const torch::Tensor& x, const std::vector<torch::Tensor>& qkv_w, int64_t qkv_n,
                            const std::vector<torch::Tensor>& o_w, int64_t o_n,
                            const std::vector<torch::Tensor>& gu_w, int64_t gu_n,
                            const std::vector<torch::Tensor>& down_w, int64_t down_n,
                            const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                            double eps, int64_t H, int64_t Hkv, double scale, int64_t window,
                            const torch::Tensor& post_attn, const torch::Tensor& post_ffn, bool gelu, torch::Tensor kc,
                            torch::Tensor vc, const torch::Tensor& seq, const torch::Tensor& pos,
                            const torch::Tensor& valid, const torch::Tensor& cos, const torch::Tensor& sin,
                            const c10::optional<torch::Tensor>& limit) {
  const Lin qkv = unpack(qkv_w, qkv_n), o = unpack(o_w, o_n), gu = unpack(gu_w, gu_n), down = unpack(down_w, down_n);
  return layer_rest(x, quantize_rows(x, opt(qkv.norm), eps), qkv, o, gu, down, q_norm, k_norm, eps, CacheRef(kc, vc),
                    seq, pos, valid, cos, sin, H, Hkv, scale, limit, LayerKind{window, post_attn, post_ffn, gelu});
}

torch::Tensor embed_rows(const torch::Tensor& raw, int64_t type, const torch::Tensor& ids, int64_t d);

// A model's decoder layers held on the C++ side, run in one call from Python: the same
// layer_rest calls in the same order as one layer_forward call per layer (so bit-identical to
// them), without a Python frame and ~30 argument conversions per layer (~0.3 ms of a ~5 ms
// one-row forward of SmolLM2's 30 layers). The caches and RoPE tables are passed per call (a
// forward may use any cache); each layer names which of the call's tables it uses. The layers
// share their attention plans (AttPlan: the same rows, positions and valid map in every layer).
class LayerStack {
 public:
  struct Layer {
    Lin qkv, o, gu, down;
    c10::optional<torch::Tensor> q_norm, k_norm;
    double eps, scale;
    int64_t H, Hkv, rope;
    LayerKind kind;
  };

  void add(const std::vector<torch::Tensor>& qkv_w, int64_t qkv_n, const std::vector<torch::Tensor>& o_w, int64_t o_n,
           const std::vector<torch::Tensor>& gu_w, int64_t gu_n, const std::vector<torch::Tensor>& down_w,
           int64_t down_n, const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
           double eps, int64_t H, int64_t Hkv, double scale, int64_t window, const torch::Tensor& post_attn,
           const torch::Tensor& post_ffn, bool gelu, int64_t rope) {
    TORCH_CHECK(rope >= 0, "a layer's RoPE table index must be >= 0");
    layers_.push_back(Layer{with_signs(unpack(qkv_w, qkv_n)), with_signs(unpack(o_w, o_n)),
                            with_signs(unpack(gu_w, gu_n)), with_signs(unpack(down_w, down_n)), q_norm,
                            k_norm, eps, scale, H, Hkv, rope, LayerKind{window, post_attn, post_ffn, gelu}});
  }

  int64_t size() const { return (int64_t)layers_.size(); }

  // Lin.signs of each layer's qkv, o, gate/up and down, then of the head (false: none set).
  std::vector<bool> signs() const {
    std::vector<bool> out;
    for (const Layer& L : layers_)
      for (const Lin* l : {&L.qkv, &L.o, &L.gu, &L.down}) out.push_back(l->signs);
    out.push_back(head_.signs);
    return out;
  }

  // x through every layer; returns [x after the last layer, then the inputs of the layers in `taps`
  // (ascending; n_layer: the output)]. kc/vc: one [n_layer, ...] cache tensor or one per layer.
  std::vector<torch::Tensor> forward(torch::Tensor x, const std::vector<torch::Tensor>& kc,
                                     const std::vector<torch::Tensor>& vc, const torch::Tensor& seq,
                                     const torch::Tensor& pos, const torch::Tensor& valid,
                                     const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                     const c10::optional<torch::Tensor>& limit, const std::vector<int64_t>& taps) {
    const int64_t n = size();
    const bool stacked = kc.size() == 1 && kc[0].dim() == 5;  // [n_layer, slots, heads, cells, head_dim]
    TORCH_CHECK(stacked ? vc.size() == 1 && kc[0].size(0) == n && vc[0].size(0) == n
                        : (int64_t)kc.size() == n && (int64_t)vc.size() == n,
                "the caches must be one [n_layer, ...] tensor each or one tensor per layer");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    std::vector<torch::Tensor> out{torch::Tensor()};
    size_t t = 0;
    x = x.contiguous();
    thread_local AttPlans plans;  // the layers' attention plans, made by the first layer of each kind
    plans.clear();
    for (int64_t li = 0; li < n; ++li) {
      const Layer& L = layers_[li];
      TORCH_CHECK(L.rope < (int64_t)cos.size(), "layer ", li, " uses RoPE table ", L.rope, " of ", cos.size());
      for (; t < taps.size() && taps[t] == li; ++t) out.push_back(x);
      x = layer_rest(x, quantize_rows(x, opt(L.qkv.norm), L.eps), L.qkv, L.o, L.gu, L.down, L.q_norm, L.k_norm, L.eps,
                     stacked ? CacheRef(kc[0], vc[0], li) : CacheRef(kc[li], vc[li]), seq, pos, valid,
                     cos[L.rope], sin[L.rope], L.H, L.Hkv, L.scale, limit, L.kind, &plans);
    }
    for (; t < taps.size() && taps[t] == n; ++t) out.push_back(x);
    TORCH_CHECK(t == taps.size(), "taps must be ascending layer indices in [0, n_layer]");
    out[0] = x;
    return out;
  }

  // The token embedding table as the file stores it (embed_rows' types) and the factor its rows
  // are multiplied by (Gemma: sqrt(n_embd); 1: none), for forward_tokens.
  void set_embedding(const torch::Tensor& raw, int64_t type, int64_t d, double scale) {
    emb_raw_ = raw, emb_type_ = type, emb_d_ = d, emb_scale_ = scale;
  }

  // The output head (a linear with its norm weight, as add takes one) and its RMSNorm epsilon.
  void set_head(const std::vector<torch::Tensor>& w, int64_t n, double eps) {
    head_ = with_signs(unpack(w, n)), head_eps_ = eps;
  }

  // Token ids to logits in one call: the embedding rows (set_embedding), forward, then the head
  // (set_head) on the output rows `rows` (none given: every row; an empty list: no logits). The
  // same kernel calls in the same order as Python's embedding lookup, forward and head, so the
  // same bits, without ~0.2-0.3 ms a step of Python around them: after a forward's 96 MB of
  // weights the interpreter's code and data come from memory, and each small tensor Python makes
  // (ids, rows, positions, sequences; here made from lists in C++) cost ~65 us then. Returns
  // [logits (empty when none), then forward()'s outputs].
  std::vector<torch::Tensor> forward_tokens(const std::vector<int64_t>& ids, const std::vector<torch::Tensor>& kc,
                                            const std::vector<torch::Tensor>& vc, const std::vector<int32_t>& seq,
                                            const std::vector<int32_t>& pos, const torch::Tensor& valid,
                                            const std::vector<torch::Tensor>& cos,
                                            const std::vector<torch::Tensor>& sin,
                                            const c10::optional<torch::Tensor>& limit,
                                            const std::vector<int64_t>& taps,
                                            const c10::optional<std::vector<int64_t>>& rows) {
    TORCH_CHECK(emb_raw_.defined() && head_.qs.defined(), "forward_tokens needs set_embedding and set_head first");
    const int64_t n = (int64_t)ids.size();
    TORCH_CHECK(n > 0 && (int64_t)seq.size() == n && (int64_t)pos.size() == n,
                "one sequence and one position for each of the ", n, " token ids");
    auto x = embed_rows(emb_raw_, emb_type_, tensor_of<int64_t>(ids), emb_d_);
    if (emb_scale_ != 1.0) x = x * emb_scale_;  // (as Python's x * scale: the same op)
    auto out = forward(x, kc, vc, tensor_of<int32_t>(seq), tensor_of<int32_t>(pos), valid, cos, sin, limit, taps);
    torch::Tensor logits = torch::empty({0}, torch::kFloat32);
    if (!rows.has_value() || !rows->empty()) {
      const torch::Tensor xs = rows.has_value() ? out[0].index_select(0, tensor_of<int64_t>(*rows)) : out[0];
      logits = apply(head_, quantize_rows(xs.contiguous(), opt(head_.norm), head_eps_), c10::nullopt);
    }
    out.insert(out.begin(), logits);
    return out;
  }

 private:
  std::vector<Layer> layers_;
  torch::Tensor emb_raw_;
  int64_t emb_type_ = -1, emb_d_ = 0;
  double emb_scale_ = 1.0, head_eps_ = 0.0;
  Lin head_;  // (qs undefined until set_head)
};

// Token embedding rows gathered from the table as the file stores it ([vocab, bytes per row] of
// GGML type `type`: F32 0, F16 1, Q4_0 2, Q8_0 8), dequantized to float32 with the same single
// float32 product per value that gguf's dequantizer computes (so exactly its values).
void embed_rows_into(const torch::Tensor& raw, int64_t type, const torch::Tensor& ids, int64_t d, float* out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.stride(1) == 1,
              "the embedding table must be [vocab, bytes per row] uint8");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous(), "token ids must be contiguous int64");
  const int64_t V = raw.size(0), ld = raw.stride(0), n = ids.numel();
  const int64_t need = type == 0 ? 4 * d : type == 1 ? 2 * d : type == 2 ? d / 32 * 18 : type == 8 ? d / 32 * 34 : -1;
  TORCH_CHECK(need > 0 && d % 32 == 0 && raw.size(1) == need, "embedding rows of GGML type ", type, " and width ", d,
              " are not ", raw.size(1), " bytes (supported: F32, F16, Q4_0, Q8_0)");
  const uint8_t* base = raw.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < V, "token id ", ip[r], " is outside the embedding table of ", V, " rows");
    const uint8_t* row = base + ip[r] * ld;
    float* y = out + r * d;
    if (type == 0) {
      std::memcpy(y, row, 4 * d);
    } else if (type == 1) {
      for (int64_t k = 0; k < d; ++k) y[k] = _cvtsh_ss(((const uint16_t*)row)[k]);
    } else {
      const int64_t bs = type == 8 ? 34 : 18;
      for (int64_t b = 0; b < d / 32; ++b) {
        const uint8_t* blk = row + b * bs;
        const float sc = _cvtsh_ss(*(const uint16_t*)blk);
        float* yb = y + b * 32;
        if (type == 8) {
          for (int k = 0; k < 32; ++k) yb[k] = sc * (float)((const int8_t*)(blk + 2))[k];
        } else {  // Q4_0: low nibbles are values 0..15, high nibbles 16..31, each (q - 8) * d
          for (int k = 0; k < 16; ++k) {
            yb[k] = sc * (float)((blk[2 + k] & 0x0F) - 8);
            yb[k + 16] = sc * (float)((blk[2 + k] >> 4) - 8);
          }
        }
      }
    }
  }
}

torch::Tensor embed_rows(const torch::Tensor& raw, int64_t type, const torch::Tensor& ids, int64_t d) {
  auto out = new_tensor({ids.numel(), d}, torch::kFloat32);
  embed_rows_into(raw, type, ids, d, out.data_ptr<float>());
  return out;
}

inline void rms_scale_into(const float* x, const float* w, int64_t K, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 sc = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / (float)K + eps));
  for (int64_t k = 0; k < K; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), sc), _mm256_loadu_ps(w + k)));
}

// One draft step of a "pair" head (specplug.heads.PairStep), for n rows (token x_t at position t
// of a sequence, with the state h(t-1) it pairs with), in one call:
//   h    = pre(h) when pre is given                    (Eagle3's fc over the raw taps: its encode)
//   e    = embed(x_t)                                  gathered from the file's blocks
//   pair = [norm_a(first); norm_b(second)]             first/second = (h, e) if h_first else (e, h)
//   with proj (MTP):    x = proj(pair); out = layer(x)                    the usual decoder layer
//   without (Eagle3):   out = layer(h, attention input = pair)            qkv reads pair, residual h
//   for each of `rows`: logits = lm(lm_norm(out)); top-1 (through d2t when given) and its softmax
//   probability; the logits themselves too when want_logits.
// Returns {out [n, d], ids [m] int64, probs [m] float32, logits [m, V] or empty}.
std::vector<torch::Tensor> pair_head_step(
    const torch::Tensor& emb_raw, int64_t emb_type, const torch::Tensor& tokens, const torch::Tensor& h_in,
    const std::vector<torch::Tensor>& pre_w, int64_t pre_n, const torch::Tensor& norm_a, const torch::Tensor& norm_b, bool h_first, double pair_eps,
    const std::vector<torch::Tensor>& proj_w, int64_t proj_n, const std::vector<torch::Tensor>& qkv_w, int64_t qkv_n,
    const std::vector<torch::Tensor>& o_w, int64_t o_n, const std::vector<torch::Tensor>& gu_w, int64_t gu_n,
    const std::vector<torch::Tensor>& down_w, int64_t down_n, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, double eps, torch::Tensor kc, torch::Tensor vc,
    const torch::Tensor& seq, const torch::Tensor& pos, const torch::Tensor& valid, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t H, int64_t Hkv, double scale, const std::vector<torch::Tensor>& lm_w,
    int64_t lm_n, double lm_eps, const torch::Tensor& rows, const torch::Tensor& d2t, bool want_logits,
    const torch::Tensor& h_add, const torch::Tensor& boost_rows, const torch::Tensor& gate_w, double gate_b) {
  check_cpu_f32(h_in, "h");
  // raw states (Eagle3's three tapped layer inputs side by side) go through `pre` (its fc) first
  const bool has_pre = pre_w.size() == 5 && pre_w[0].numel() > 0;
  torch::Tensor h = has_pre ? apply(unpack(pre_w, pre_n), quantize_rows(h_in, c10::nullopt, 0.0), c10::nullopt)
                            : h_in;
  if (h_add.numel() > 0) {  // a head's extra input per row (its pair lookup), added to the state
    TORCH_CHECK(h_add.sizes() == h.sizes() && h_add.scalar_type() == torch::kFloat32, "h_add must be like h");
    h = (h + h_add).contiguous();
  }
  const int64_t n = h.size(0), d = h.size(1);
  TORCH_CHECK(tokens.numel() == n, "one token per row of h");
  TORCH_CHECK(norm_a.numel() == d && norm_b.numel() == d && norm_a.is_contiguous() && norm_b.is_contiguous() &&
                  norm_a.scalar_type() == torch::kFloat32 && norm_b.scalar_type() == torch::kFloat32,
              "the pair norms must be float32 vectors of the state width");
  auto e = embed_rows(emb_raw, emb_type, tokens, d);
  const float *ep = e.data_ptr<float>(), *hp = h.data_ptr<float>(), *wa = norm_a.data_ptr<float>(),
              *wb = norm_b.data_ptr<float>();
  const int64_t ldh = h.stride(0);
  const float feps = (float)pair_eps;
  auto pair = quantize_each_row(n, 2 * d, [&](int64_t r, float* buf) -> const float* {
    const float* first = h_first ? hp + r * ldh : ep + r * d;
    const float* second = h_first ? ep + r * d : hp + r * ldh;
    rms_scale_into(first, wa, d, feps, buf);
    rms_scale_into(second, wb, d, feps, buf + d);
    return buf;
  });
  const Lin qkv = unpack(qkv_w, qkv_n), o = unpack(o_w, o_n), gu = unpack(gu_w, gu_n), down = unpack(down_w, down_n);
  torch::Tensor out;
  if (proj_w.size() == 5 && proj_w[0].numel() > 0) {
    auto x = apply(unpack(proj_w, proj_n), pair, c10::nullopt);
    out = layer_rest(x, quantize_rows(x, opt(qkv.norm), eps), qkv, o, gu, down, q_norm, k_norm, eps,
                     CacheRef(kc, vc), seq, pos, valid, cos, sin, H, Hkv, scale, c10::nullopt);
  } else {
    out = layer_rest(h.contiguous(), pair, qkv, o, gu, down, q_norm, k_norm, eps, CacheRef(kc, vc), seq, pos, valid,
                     cos, sin, H, Hkv, scale, c10::nullopt);
  }
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1, "rows must be a 1-D int64 tensor");
  const int64_t m = rows.numel();
  auto ids = torch::empty({m}, torch::kInt64);
  auto probs = torch::empty({m}, torch::kFloat32);
  torch::Tensor logits;
  if (m > 0) {
    const Lin lm = unpack(lm_w, lm_n);
    const torch::Tensor sel = out.index_select(0, rows).contiguous();
    logits = apply(lm, quantize_rows(sel, opt(lm.norm), lm_eps), c10::nullopt);
    const int64_t V = lm_n;
    if (boost_rows.numel() > 0) {  // a learned logit on one draft row per asked row (-1: none): gate . out + b
      TORCH_CHECK(boost_rows.numel() == m && boost_rows.scalar_type() == torch::kInt64 && gate_w.numel() == d &&
                      gate_w.scalar_type() == torch::kFloat32 && gate_w.is_contiguous(),
                  "boost_rows: one int64 per asked row; gate_w: float32 of the state width");
      const int64_t* bp = boost_rows.data_ptr<int64_t>();
      const float *gw = gate_w.data_ptr<float>(), *op = sel.data_ptr<float>();
      float* lw = logits.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) {
        if (bp[r] < 0) continue;
        TORCH_CHECK(bp[r] < V, "boost row ", bp[r], " is outside the ", V, " draft rows");
        float g = 0.0f;
        for (int64_t k = 0; k < d; ++k) g += gw[k] * op[r * d + k];
        lw[r * V + bp[r]] += g + (float)gate_b;
      }
    }
    const bool mapped = d2t.numel() > 0;
    TORCH_CHECK(!mapped || (d2t.numel() == V && d2t.scalar_type() == torch::kInt64 && d2t.is_contiguous()),
                "d2t must be an int64 vector with one entry per output row");
    const float* lp = logits.data_ptr<float>();
    const int64_t* dp = mapped ? d2t.data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      const float* l = lp + r * V;
      int64_t best = 0;
      float mx = l[0];
      for (int64_t j = 1; j < V; ++j)
        if (l[j] > mx) mx = l[j], best = j;  // the first of equal maxima, as torch's max
      const __m256 mv = _mm256_set1_ps(mx);
      __m256 acc = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= V; j += 8) acc = _mm256_add_ps(acc, exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(l + j), mv)));
      float sum = hsum(acc);
      for (; j < V; ++j) sum += std::exp(l[j] - mx);
      ids.data_ptr<int64_t>()[r] = mapped ? dp[best] : best;
      probs.data_ptr<float>()[r] = 1.0f / sum;
    }
  }
  return {out, ids, probs, want_logits && m > 0 ? logits : torch::empty({0})};
}

// A pair head's parts that stay the same from step to step (specplug.heads.PairStep), held once,
// so that a draft step passes only what changes: its rows and, for a head that reads the context's
// pair lookup (specplug.heads.lookup), each row's lookup. The lookup's addition to a row's state,
// proj(rms_norm(embed(lookup)) * norm), is computed here and kept per token (it never changes);
// the asked rows' boost reads the lookup's draft row (t2d). Same arithmetic as pair_head_step.
class PairHead {
 public:
  PairHead(torch::Tensor emb_raw, int64_t emb_type, std::vector<torch::Tensor> pre_w, int64_t pre_n,
           torch::Tensor norm_a, torch::Tensor norm_b, bool h_first, double pair_eps,
           std::vector<torch::Tensor> proj_w, int64_t proj_n, std::vector<torch::Tensor> qkv_w, int64_t qkv_n,
           std::vector<torch::Tensor> o_w, int64_t o_n, std::vector<torch::Tensor> gu_w, int64_t gu_n,
           std::vector<torch::Tensor> down_w, int64_t down_n, double eps, torch::Tensor kc, torch::Tensor vc,
           torch::Tensor valid, torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t Hkv, double scale,
           std::vector<torch::Tensor> lm_w, int64_t lm_n, double lm_eps, torch::Tensor d2t)
      : emb_raw_(emb_raw), emb_type_(emb_type), pre_w_(pre_w), pre_n_(pre_n), norm_a_(norm_a), norm_b_(norm_b),
        h_first_(h_first), pair_eps_(pair_eps), proj_w_(proj_w), proj_n_(proj_n), qkv_w_(qkv_w), qkv_n_(qkv_n),
        o_w_(o_w), o_n_(o_n), gu_w_(gu_w), gu_n_(gu_n), down_w_(down_w), down_n_(down_n), eps_(eps), kc_(kc),
        vc_(vc), valid_(valid), cos_(cos), sin_(sin), H_(H), Hkv_(Hkv), scale_(scale), lm_w_(lm_w), lm_n_(lm_n),
        lm_eps_(lm_eps), d2t_(d2t) {
    TORCH_CHECK(norm_a.numel() > 0 && norm_a.numel() % 8 == 0, "the state width must be a multiple of 8");
  }

  // The lookup's parts: proj [d, d] and norm [d] float32 (its addition), gate [d] float32 and gate_b
  // (its boost), eps of its norm, t2d [target vocab] int64 (target id -> draft row, -1: none); keep:
  // how many tokens' additions are kept (all are dropped when that many are).
  void set_lookup(torch::Tensor proj, torch::Tensor norm, torch::Tensor gate, double gate_b, double eps,
                  torch::Tensor t2d, int64_t keep) {
    const int64_t d = norm_a_.numel();
    TORCH_CHECK(proj.scalar_type() == torch::kFloat32 && proj.is_contiguous() && proj.dim() == 2 &&
                    proj.size(0) == d && proj.size(1) == d,
                "lookup proj must be a contiguous float32 [d, d]");
    TORCH_CHECK(norm.scalar_type() == torch::kFloat32 && norm.is_contiguous() && norm.numel() == d,
                "lookup norm must be a contiguous float32 [d]");
    TORCH_CHECK(gate.scalar_type() == torch::kFloat32 && gate.is_contiguous() && gate.numel() == d,
                "lookup gate must be a contiguous float32 [d]");
    TORCH_CHECK(t2d.scalar_type() == torch::kInt64 && t2d.is_contiguous() && t2d.dim() == 1, "t2d must be int64 [vocab]");
    TORCH_CHECK(keep >= 1, "keep must be >= 1");
    look_proj_ = proj, look_norm_ = norm, gate_ = gate, gate_b_ = gate_b, look_eps_ = eps, t2d_ = t2d, keep_ = keep;
    additions_.clear();
  }

  bool reads_lookup() const { return look_proj_.defined(); }

  // One step: (out [n, d], top-1 target ids of `rows`, their probabilities, logits [m, V] or empty).
  // lookup: empty, or one target id per row (-1: none), for a head given set_lookup.
  std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<float>, torch::Tensor> step(
      const torch::Tensor& h, const std::vector<int64_t>& tokens, const std::vector<int64_t>& seq,
      const std::vector<int64_t>& pos, const std::vector<int64_t>& rows, const std::vector<int64_t>& lookup,
      bool raw, bool want_logits) {
    const int64_t n = (int64_t)tokens.size(), m = (int64_t)rows.size();
    TORCH_CHECK((int64_t)seq.size() == n && (int64_t)pos.size() == n, "one sequence and position per token");
    TORCH_CHECK(lookup.empty() || (int64_t)lookup.size() == n, "one lookup per row (or none)");
    TORCH_CHECK(!raw || (pre_w_.size() == 5 && pre_w_[0].numel() > 0), "raw states need a `pre` linear");
    for (int64_t r = 0; r < m; ++r)
      TORCH_CHECK(rows[r] >= 0 && rows[r] < n, "asked row ", rows[r], " is outside the ", n, " rows");
    const auto tok_t = tensor_of<int64_t>(tokens), rows_t = tensor_of<int64_t>(rows);
    const auto seq_t = tensor_of<int32_t>(seq), pos_t = tensor_of<int32_t>(pos);
    const torch::Tensor none = torch::empty({0});
    torch::Tensor h_add = none, boost_rows = torch::empty({0}, torch::kInt64), gate = none;
    bool any = false;
    for (int64_t t : lookup) any = any || t >= 0;
    if (any) {
      TORCH_CHECK(reads_lookup(), "lookups given to a head without the lookup's parts (set_lookup)");
      const int64_t d = norm_a_.numel(), V = t2d_.numel();
      h_add = torch::zeros({n, d}, torch::kFloat32);
      for (int64_t i = 0; i < n; ++i)
        if (lookup[i] >= 0) {
          TORCH_CHECK(lookup[i] < V, "lookup ", lookup[i], " is outside the target's ", V, " tokens");
          const std::vector<float>& a = addition(lookup[i]);
          std::copy(a.begin(), a.end(), h_add.data_ptr<float>() + i * d);
        }
      boost_rows = torch::empty({m}, torch::kInt64);
      const int64_t* t2d = t2d_.data_ptr<int64_t>();
      for (int64_t r = 0; r < m; ++r) {
        const int64_t t = lookup[rows[r]];
        boost_rows.data_ptr<int64_t>()[r] = t >= 0 ? t2d[t] : -1;
      }
      gate = gate_;
    }
    static const std::vector<torch::Tensor> empty5(5, torch::empty({0}));
    auto res = pair_head_step(emb_raw_, emb_type_, tok_t, h.contiguous(), raw ? pre_w_ : empty5, raw ? pre_n_ : 0,
                              norm_a_, norm_b_, h_first_, pair_eps_, proj_w_, proj_n_, qkv_w_, qkv_n_, o_w_, o_n_,
                              gu_w_, gu_n_, down_w_, down_n_, c10::nullopt, c10::nullopt, eps_, kc_, vc_, seq_t,
                              pos_t, valid_, cos_, sin_, H_, Hkv_, scale_, lm_w_, lm_n_, lm_eps_, rows_t, d2t_,
                              want_logits, h_add, boost_rows, gate, any ? gate_b_ : 0.0);
    std::vector<int64_t> ids(res[1].data_ptr<int64_t>(), res[1].data_ptr<int64_t>() + m);
    std::vector<float> probs(res[2].data_ptr<float>(), res[2].data_ptr<float>() + m);
    return {res[0], ids, probs, res[3]};
  }

 private:
  // proj @ (rms_norm(embed(t)) * norm) for target token t, kept (a token's addition never changes)
  const std::vector<float>& addition(int64_t t) {
    auto it = additions_.find(t);
    if (it != additions_.end()) return it->second;
    if ((int64_t)additions_.size() >= keep_) additions_.clear();
    const int64_t d = norm_a_.numel();
    std::vector<float> e(d), x(d), y(d);
    auto id = torch::full({1}, t, torch::kInt64);
    embed_rows_into(emb_raw_, emb_type_, id, d, e.data());
    rms_scale_into(e.data(), look_norm_.data_ptr<float>(), d, (float)look_eps_, x.data());
    const float* P = look_proj_.data_ptr<float>();
    for (int64_t k = 0; k < d; ++k) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(P + k * d + j), _mm256_loadu_ps(x.data() + j), acc);
      y[k] = hsum(acc);
    }
    return additions_.emplace(t, std::move(y)).first->second;
  }

  torch::Tensor emb_raw_;
  int64_t emb_type_;
  std::vector<torch::Tensor> pre_w_;
  int64_t pre_n_;
  torch::Tensor norm_a_, norm_b_;
  bool h_first_;
  double pair_eps_;
  std::vector<torch::Tensor> proj_w_;
  int64_t proj_n_;
  std::vector<torch::Tensor> qkv_w_;
  int64_t qkv_n_;
  std::vector<torch::Tensor> o_w_;
  int64_t o_n_;
  std::vector<torch::Tensor> gu_w_;
  int64_t gu_n_;
  std::vector<torch::Tensor> down_w_;
  int64_t down_n_;
  double eps_;
  torch::Tensor kc_, vc_, valid_, cos_, sin_;
  int64_t H_, Hkv_;
  double scale_;
  std::vector<torch::Tensor> lm_w_;
  int64_t lm_n_;
  double lm_eps_;
  torch::Tensor d2t_;
  torch::Tensor look_proj_, look_norm_, gate_, t2d_;
  double gate_b_ = 0.0, look_eps_ = 0.0;
  int64_t keep_ = 1;
  std::unordered_map<int64_t, std::vector<float>> additions_;
};

}  // namespace

// The GIL is released while a kernel runs (none touches Python objects), so other Python threads
// (a server's event loop beside the engine thread) run meanwhile instead of waiting for the
// interpreter's switch interval.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quantize_rows", &quantize_rows, "rows -> Q8 blocks (optionally RMS-normalized first)", nogil);
  m.def("silu_mul_quantize", &silu_mul_quantize, "silu(g) * u -> Q8 blocks", nogil);
  m.def("matmul_q4_1", &matmul_q4_1, "Q8 activations x Q4_1 weight tiles", nogil);
  m.def("matmul_q8_0", &matmul_q8_0, "Q8 activations x Q8_0 weight tiles", nogil);
  m.def("matmul", &matmul,
        "Q8 activations x weight tiles of any kind (Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); signs: the caller vouches that "
        "no Q8_0 weight is -128 (see set_sign_threads)",
        py::arg("xa"), py::arg("qs"), py::arg("wd"), py::arg("wm"), py::arg("bias"), py::arg("residual"),
        py::arg("n_out"), py::arg("signs") = false, nogil);
  m.def("rope_store", &rope_store, "RoPE (and q/k norm) in place, k/v into the cache", nogil);
  m.def("gelu_mul_quantize", &gelu_mul_quantize, "gelu_tanh(g) * u -> Q8 blocks", nogil);
  m.def("rms_norm_add", &rms_norm_add, "residual + rms_norm(y) * w", nogil);
  m.def("attention", &attention, "causal attention over each row's sequence (window > 0: sliding)", py::arg("q"),
        py::arg("kc"), py::arg("vc"), py::arg("seq"), py::arg("pos"), py::arg("valid"), py::arg("H"), py::arg("scale"),
        py::arg("limit"), py::arg("window") = 0, nogil);
  m.def("layer_forward", &layer_forward, "a whole decoder layer in one call", nogil);
  py::class_<LayerStack>(m, "LayerStack", "a model's decoder layers, run in one call")
      .def(py::init<>())
      .def("add", &LayerStack::add, "append a layer (layer_forward's own arguments, then the index of its RoPE table)")
      .def("__len__", &LayerStack::size)
      .def("forward", &LayerStack::forward, "every layer in one call: [x, tapped inputs...]", nogil)
      .def("set_embedding", &LayerStack::set_embedding, "the token embedding table for forward_tokens")
      .def("set_head", &LayerStack::set_head, "the output head (a linear with its norm) for forward_tokens")
      .def("forward_tokens", &LayerStack::forward_tokens,
           "token ids to the logits of the given rows in one call: [logits, x, tapped inputs...]", nogil)
      .def("signs", &LayerStack::signs,
           "per layer qkv, o, gate/up, down, then the head: whether each may take the signs on the weights "
           "(Q8_0 without a weight of -128; see set_sign_threads)");
  m.def("embed_rows", &embed_rows, "token embedding rows from the file's blocks", nogil);
  m.def("isa", []() { return std::string(SPECPLUG_VNNI ? "avx512" : "avx2"); }, "the instruction set this build uses");
  m.def("kept_blocks", []() {
        const auto k = block_cache::Cache::get().kept();
        return py::make_tuple(k.first, k.second);
      }, "(bytes, blocks) of freed kernel outputs kept for reuse (block_cache.h)");
  m.def("release_kept_blocks", []() {
        block_cache::OutputPool::mine().release();
        return block_cache::Cache::get().release();
      }, "free the kept blocks of freed kernel outputs (after this thread's pool lets its outputs go); returns "
         "the bytes freed");
  m.def("pooled_outputs", []() { return block_cache::OutputPool::mine().kept(); },
        "outputs this thread's pool keeps for reuse (block_cache.h: OutputPool)");
  m.def("release_pooled_outputs", []() { return block_cache::OutputPool::mine().release(); },
        "let this thread's pool of outputs go (each freed into the kept blocks once nothing else holds it); "
        "returns how many it kept");
  m.def("dot_peak", &probes::dot_peak, "multiply-adds a second of the build's dot instruction alone, on the runtime's "
        "threads, as the kernels of `bits`-bit weights (4 or 8) use it", py::arg("bits") = 4, nogil);
  m.def("dot_instruction", [](int64_t bits) { return std::string(bits == 8 ? PROBES_DOT_8BIT : PROBES_DOT); },
        "the dot instructions dot_peak(bits) times", py::arg("bits") = 4);
  m.def("fma_peak", &probes::fma_peak, "float multiply-adds a second of the build's multiply-add instruction alone, on "
        "the runtime's threads", nogil);
  m.def("fma_instruction", []() { return std::string(PROBES_FMA); }, "the multiply-add instruction fma_peak times");
  m.def("stream_dots", &probes::stream_dots, "seconds for the least work of one linear call of `rows` rows on its "
        "weights (`bits` 4, 6 or 8) and scales, `repeat` walks", py::arg("weights"), py::arg("extra"), py::arg("rows"),
        py::arg("bits"), py::arg("repeat") = 1, py::arg("ahead") = 0, nogil);
  m.def("set_sign_threads", [](int64_t threads) {
        TORCH_CHECK(threads >= 0, "set_sign_threads: threads must be >= 0, got ", threads);
#if !SPECPLUG_VNNI
        g_sign_threads.store(threads, std::memory_order_relaxed);
#endif
      }, "a LayerStack's one-row Q8_0 calls on at most this many threads take the signs on the weights "
         "(AVX2 builds; 0: never)", py::arg("threads"));
  m.def("sign_threads", []() {
#if SPECPLUG_VNNI
        return int64_t(0);
#else
        return g_sign_threads.load(std::memory_order_relaxed);
#endif
      }, "see set_sign_threads");
  m.def("set_prefetch_rows", [](int64_t rows) {
        TORCH_CHECK(rows >= 0, "set_prefetch_rows: rows must be >= 0, got ", rows);
        g_prefetch_rows.store(rows, std::memory_order_relaxed);
      }, "software prefetch of weight tiles on the one-tile path for calls of at most `rows` rows (0: never)",
      py::arg("rows"));
  m.def("prefetch_rows", []() { return g_prefetch_rows.load(std::memory_order_relaxed); },
        "calls of at most this many rows prefetch weight tiles on the one-tile path");
  m.def("set_pair_rows", [](int64_t rows, int64_t byte_rows) {
        if (byte_rows == 0) byte_rows = rows;
        TORCH_CHECK(rows >= 1 && byte_rows >= 1, "set_pair_rows: rows must be >= 1, got ", rows, " and ", byte_rows);
#if SPECPLUG_ZMM
        g_pair_rows.store(rows, std::memory_order_relaxed);
        g_byte_pair_rows.store(byte_rows, std::memory_order_relaxed);
#endif
      }, "linear calls of at least `rows` rows run on 512-bit tile pairs, and of the kinds with a byte a value "
         "(Q8_0, Q5_K, Q6_K) of at least `byte_rows` (0: `rows`); a tuning, the same bits either way",
        py::arg("rows"), py::arg("byte_rows") = 0);
  m.def("pair_rows", []() -> int64_t { return SPECPLUG_ZMM ? g_pair_rows.load(std::memory_order_relaxed) : 0; },
        "the row count from which linears run on tile pairs (0: this build has no tile pairs)");
  m.def("byte_pair_rows", []() -> int64_t { return SPECPLUG_ZMM ? g_byte_pair_rows.load(std::memory_order_relaxed) : 0; },
        "the same for the kinds with a byte a value (Q8_0, Q5_K, Q6_K)");
  m.def("set_stage_timing", [](bool on) { g_timing.store(on, std::memory_order_relaxed); },
        "time every kernel call natively per family (off by default; for --profile)");
  m.def("stage_times", []() {
        py::dict out;
        for (int i = 0; i < ST_COUNT; ++i)
          out[STAGE_NAMES[i]] = py::make_tuple(g_stage_ns[i].exchange(0) / 1e9, g_stage_calls[i].exchange(0));
        return out;
      }, "{family: (seconds, calls)} since the last call, then zero");
  py::class_<PairHead>(m, "PairHead", "a pair head's constant parts, for its draft steps")
      .def(py::init<torch::Tensor, int64_t, std::vector<torch::Tensor>, int64_t, torch::Tensor, torch::Tensor, bool,
                    double, std::vector<torch::Tensor>, int64_t, std::vector<torch::Tensor>, int64_t,
                    std::vector<torch::Tensor>, int64_t, std::vector<torch::Tensor>, int64_t,
                    std::vector<torch::Tensor>, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, torch::Tensor, int64_t, int64_t, double, std::vector<torch::Tensor>, int64_t,
                    double, torch::Tensor>())
      .def("set_lookup", &PairHead::set_lookup, "the pair lookup's parts: proj, norm, gate, gate bias, eps, t2d, keep")
      .def("step", &PairHead::step, "one draft step: (states, top-1 ids, probabilities, logits or empty)", nogil);
}
