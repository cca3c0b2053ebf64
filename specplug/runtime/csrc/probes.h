// What this machine's cores do with the kernels' own instructions, for the roofline of
// `bench-runtime --profile`. Both run on the runtime's threads (chunk_pool), so they see
// the cores, caches and memory the kernels see.
//
//  - dot_peak(): the integer dot instruction alone, on the widest registers the build uses, as the
//    4-bit kernels use it (AVX-512 VNNI: vpdpbusd on 512 bits, 64 multiply-adds into 32 bits; AVX2:
//    vpmaddubsw on 256 bits, 32, added into 16-bit sums, which one vpmaddwd + vpaddd widens after
//    every 8, as q4_1_block_dot does), 16 independent accumulators a thread (AVX2: 6 16-bit sums
//    and the 6 they widen into, in its 16 registers) so its latency hides: the ISA's own ceiling of
//    multiply-adds a second, which no kernel on this build can pass; dot_peak(8) times the 8-bit
//    kernels' mix (AVX2: vpmaddubsw + vpmaddwd + vpaddd, each dot widened; VNNI: the same vpdpbusd).
//    (Widened after every vpmaddubsw, as in the 8-bit mix, the 4-bit probe would pay two multiplies
//    per 32 multiply-adds and read half the 4-bit ceiling: on a Zen 1, below what its Q4_1 kernel runs.)
//  - fma_peak(): the float multiply-add alone (vfmadd on the same registers: 16 lanes a 512-bit one,
//    8 a 256-bit one), 16 independent accumulators a thread (12 in AVX2's 16 registers, where 16
//    spill and read half the peak): the ceiling of attention's float work (its scores and weighted
//    V sums are multiply-adds), which no attention kernel on this build can pass.
//  - stream_dots(): the floor of a linear, the least work a k-row linear does on the bytes of its
//    weights: load, split 4-bit values into low and high nibbles (8-bit: offset by 128), one dot
//    instruction per row per half (AVX2, 4-bit: into 16-bit sums widened once a block, as above; 8-bit:
//    widened every time, as its kernels must; 6-bit, the 5- and 6-bit values Q5_K and Q6_K hold a byte
//    each: one dot a load, into 16-bit sums widened every 4 loads, as their kernels do), the scales
//    read and not used, and nothing else (no float work, activations at hand). Over the weights as
//    the runtime holds them it tells what the kernels could at best do with their stream; walked
//    again from the caches (`repeat`), what the same work costs without it. So it measures whether
//    this core overlaps the stream with the multiply-adds (streamed = the larger of the two) or pays
//    for both (their sum), with a kernel that has nothing else in its way, and with software
//    prefetch `ahead` bytes on or without.
//
// Included by gguf_kernels.cpp once per ISA build, after chunk_pool.h and CHUNK_BYTES.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "chunk_pool.h"

namespace probes {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using V = __m512i;
constexpr int MACS_PER_DOT = 64;
inline V vload(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
inline V vzero() { return _mm512_setzero_si512(); }
inline V nibbles_lo(V raw) { return _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)); }
inline V nibbles_hi(V raw) { return _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F)); }
inline V vadd(V a, V b) { return _mm512_add_epi32(a, b); }
inline V flip_signs(V v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }
inline V dot(V acc, V w, int32_t x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)); }
inline int64_t vsum(V v) { return _mm512_reduce_add_epi32(v); }
inline void opaque(V& v) { __asm__ volatile("" : "+v"(v)); }
// 4-bit weights: the dot goes into 32 bits directly (nothing to widen)
constexpr bool WIDENS = false;
constexpr int WIDEN_EVERY = 1;
inline V dot16(V acc, V w, int32_t x) { return dot(acc, w, x); }
inline V widen(V acc, V) { return acc; }
#define PROBES_DOT "vpdpbusd zmm"
#define PROBES_DOT_8BIT "vpdpbusd zmm"
constexpr int DOT_CHAINS = 16;  // accumulators a thread when each dot goes into 32 bits
using F = __m512;
constexpr int LANES_PER_FMA = 16;
inline F fma_op(F acc, F w, F c) { return _mm512_fmadd_ps(acc, w, c); }
inline F fset(float x) { return _mm512_set1_ps(x); }
inline double fsum(F v) { return _mm512_reduce_add_ps(v); }
inline void opaque(F& v) { __asm__ volatile("" : "+v"(v)); }
#define PROBES_FMA "vfmadd zmm"
constexpr int FMA_CHAINS = 16;  // accumulators a thread (with w and the addend, in the 32 registers)
constexpr int PASS_ROWS = 8;
#else
using V = __m256i;
constexpr int MACS_PER_DOT = 32;
inline V vload(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline V vzero() { return _mm256_setzero_si256(); }
inline V nibbles_lo(V raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
inline V nibbles_hi(V raw) { return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)); }
inline V vadd(V a, V b) { return _mm256_add_epi32(a, b); }
inline V flip_signs(V v) { return _mm256_sign_epi8(v, v); }  // |w| (AVX2 moves the sign onto x)
inline V dot(V acc, V w, int32_t x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x)),
                                                 _mm256_set1_epi16(1)));
}
inline int64_t vsum(V v) {
  alignas(32) int32_t t[8];
  _mm256_store_si256((__m256i*)t, v);
  int64_t s = 0;
  for (int i = 0; i < 8; ++i) s += t[i];
  return s;
}
inline void opaque(V& v) { __asm__ volatile("" : "+x"(v)); }
// 4-bit weights (values 0..15): a vpmaddubsw lane sums two products of at most 15 x 127, so 8 of
// them add up in 16 bits (vpaddw), widened once a block (vpmaddwd by ones, vpaddd): one multiply
// instruction per 32 multiply-adds, not two as `dot` (the 8-bit weights' mix)
constexpr bool WIDENS = true;
constexpr int WIDEN_EVERY = 8;  // vpmaddubsw results a 16-bit sum takes (one block of q4_1_block_dot)
inline V dot16(V acc16, V w, int32_t x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x))); }
inline V widen(V acc, V acc16) { return _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1))); }
#define PROBES_DOT "vpmaddubsw+vpaddw ymm, vpmaddwd+vpaddd once in 8"
#define PROBES_DOT_8BIT "vpmaddubsw+vpmaddwd+vpaddd ymm"
constexpr int DOT_CHAINS = 10;  // accumulators a thread for `dot`, beside w and its two constants (16 spill)
using F = __m256;
constexpr int LANES_PER_FMA = 8;
inline F fma_op(F acc, F w, F c) { return _mm256_fmadd_ps(acc, w, c); }
inline F fset(float x) { return _mm256_set1_ps(x); }
inline double fsum(F v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  double s = 0;
  for (float x : t) s += x;
  return s;
}
inline void opaque(F& v) { __asm__ volatile("" : "+x"(v)); }
#define PROBES_FMA "vfmadd ymm"
constexpr int FMA_CHAINS = 12;  // accumulators a thread, in the 16 registers beside w and the addend (16 spill)
constexpr int PASS_ROWS = 4;
#endif
constexpr int VB = sizeof(V);            // bytes a load
#ifndef CHUNK_BYTES
#error "define CHUNK_BYTES (gguf_kernels.cpp's chunk of work) before including probes.h"
#endif
constexpr int64_t CHUNK = CHUNK_BYTES;   // bytes a chunk, as the matmuls
constexpr int64_t PEAK_DOTS = 1 << 25;   // dot instructions a thread in dot_peak

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline std::atomic<int64_t> g_sink{0};  // the probes' sums end here, so no loop is optimized away

// Multiply-adds a second of the dot instruction on the runtime's threads together: as the 4-bit
// kernels use it (SUM16, AVX2: into 16-bit sums, each widened after WIDEN_EVERY dots), or as the
// 8-bit kernels do (each dot into 32 bits: AVX2's vpmaddubsw + vpmaddwd + vpaddd, two multiplies per
// 32 multiply-adds; on AVX-512 VNNI both are vpdpbusd).
template <bool SUM16>
inline double dot_peak_of() {
  // accumulators a thread; AVX2, 16-bit sums: 6 of them and the 6 they widen into, beside w and the ones
  constexpr int CH = SUM16 ? 6 : DOT_CHAINS;
  constexpr int E = SUM16 ? WIDEN_EVERY : 1;  // dots a sum takes between widenings
  constexpr int64_t GROUPS = PEAK_DOTS / (CH * E);
  const int threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  chunk_pool::parallel_for(threads, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      V acc[CH], acc16[CH];
      for (int j = 0; j < CH; ++j) acc[j] = acc16[j] = vzero();
      V w = vadd(vzero(), vzero());
      opaque(w);
      for (int64_t g = 0; g < GROUPS; ++g) {
        for (int e = 0; e < E; ++e)
          for (int j = 0; j < CH; ++j) {
            if constexpr (SUM16) acc16[j] = dot16(acc16[j], w, 0x01020304);
            else acc[j] = dot(acc[j], w, 0x01020304);
            opaque(w);  // a "new" w each time: no part of one instruction is shared with the next
          }
        if constexpr (SUM16)
          for (int j = 0; j < CH; ++j) acc[j] = widen(acc[j], acc16[j]), acc16[j] = vzero();
      }
      int64_t s = 0;
      for (auto& a : acc) s += vsum(a);
      g_sink.fetch_add(s, std::memory_order_relaxed);
    }
  });
  return double(threads) * GROUPS * CH * E * MACS_PER_DOT / seconds_since(t0);
}

// The dot's ceiling for weights of `bits` bits (4: the 4- and 5-bit kinds' mix; 8: Q8_0, Q5_K, Q6_K).
inline double dot_peak(int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "dot_peak: bits must be 4 or 8, not ", bits);
  return bits == 4 && WIDENS ? dot_peak_of<true>() : dot_peak_of<false>();
}

// Float multiply-adds a second of the multiply-add instruction on the runtime's threads together
// (acc = acc * w + c, PEAK_DOTS of them a thread, FMA_CHAINS independent: their latency hides; the
// values stay about 1).
inline double fma_peak() {
  constexpr int CH = FMA_CHAINS;
  const int threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  chunk_pool::parallel_for(threads, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      F acc[CH];
      for (auto& a : acc) a = fset(1.0f);
      F w = fset(0.5f), add = fset(0.5f);
      for (int64_t i = 0; i < PEAK_DOTS / CH; ++i) {
        for (int j = 0; j < CH; ++j) {
          acc[j] = fma_op(acc[j], w, add);
          opaque(w);
        }
      }
      double s = 0;
      for (auto& a : acc) s += fsum(a);
      g_sink.fetch_add((int64_t)s, std::memory_order_relaxed);
    }
  });
  return double(threads) * PEAK_DOTS * LANES_PER_FMA / seconds_since(t0);
}

// The least work of an R-row linear on n bytes at p: BITS = 4, two dots a load per row (low and high
// nibbles); BITS = 8, one (the bytes offset by 128, as the kernels' signed weights); BITS = 6, one on
// the bytes as they are (values of at most 6 bits, whose AVX2 products add up in 16 bits over 4
// loads: 4 x 2 x 32 x 127 fits); R = 0, the loads alone, added up. Bytes past the last whole pair of
// loads are not read (under 128 of a chunk).
// `pass` varies the activations between passes over the same bytes; `ahead` > 0: software prefetch.
// AVX2, 4- and 6-bit: a row's products go into one 16-bit sum (acc16), widened into its acc after every
// two steps (4 loads: 8 dots of nibbles, a block, as q4_1_block_dot does; 4 dots of bytes, as
// u8_block_dot and signed_block_dot's halves do).
template <int R, int BITS>
inline int64_t dots_over(const uint8_t* p, int64_t n, int pass = 0, int64_t ahead = 0) {
  static_assert(BITS == 4 || BITS == 6 || BITS == 8, "BITS: 4 (nibbles), 6 (small values in bytes) or 8");
  constexpr bool SUM16 = WIDENS && BITS != 8 && R >= 1;
  constexpr int A = R >= 1 && !SUM16 ? 2 : 1;  // accumulators a row
  static_assert(R <= PASS_ROWS, "more rows a pass than the registers hold");
  V acc[R == 0 ? 1 : R * A], acc16[SUM16 ? R : 1];
  for (auto& a : acc) a = vzero();
  for (auto& a : acc16) a = vzero();
  int64_t step = 0;
  for (int64_t off = 0; off + 2 * VB <= n; off += 2 * VB, ++step) {  // two loads a step
    if (ahead > 0)  // each cache line of the pair's, `ahead` bytes on (a prefetch never faults past the end)
      for (int64_t l = 0; l < 2 * VB; l += 64) _mm_prefetch((const char*)(p + off + ahead + l), _MM_HINT_T0);
    const V raw0 = vload(p + off), raw1 = vload(p + off + VB);
    if constexpr (R == 0) {
      acc[0] = vadd(acc[0], vadd(raw0, raw1));
    } else if constexpr (SUM16) {
      if constexpr (BITS == 6) {
        for (int r = 0; r < R; ++r) {
          acc16[r] = dot16(acc16[r], raw0, 0x01010101 * (2 * r + 1 + pass));
          acc16[r] = dot16(acc16[r], raw1, 0x01010101 * (2 * r + 2 + pass));
        }
      } else {
        for (const V raw : {raw0, raw1}) {
          const V lo = nibbles_lo(raw), hi = nibbles_hi(raw);
          for (int r = 0; r < R; ++r) {
            acc16[r] = dot16(acc16[r], lo, 0x01010101 * (2 * r + 1 + pass));
            acc16[r] = dot16(acc16[r], hi, 0x01010101 * (2 * r + 2 + pass));
          }
        }
      }
      if (step % 2 == 1)  // 4 loads a widening, either way
        for (int r = 0; r < R; ++r) acc[r] = widen(acc[r], acc16[r]), acc16[r] = vzero();
    } else if constexpr (BITS == 4) {
      for (const V raw : {raw0, raw1}) {
        const V lo = nibbles_lo(raw), hi = nibbles_hi(raw);
        for (int r = 0; r < R; ++r) {
          acc[r * A] = dot(acc[r * A], lo, 0x01010101 * (2 * r + 1 + pass));
          acc[r * A + A - 1] = dot(acc[r * A + A - 1], hi, 0x01010101 * (2 * r + 2 + pass));
        }
      }
    } else {  // bytes, each dot into 32 bits (8-bit on AVX2; 6- and 8-bit on VNNI)
      const V u0 = BITS == 8 ? flip_signs(raw0) : raw0, u1 = BITS == 8 ? flip_signs(raw1) : raw1;
      for (int r = 0; r < R; ++r) {
        acc[r * A] = dot(acc[r * A], u0, 0x01010101 * (2 * r + 1 + pass));
        acc[r * A + A - 1] = dot(acc[r * A + A - 1], u1, 0x01010101 * (2 * r + 2 + pass));
      }
    }
  }
  if constexpr (SUM16)
    for (int r = 0; r < R; ++r) acc[r] = widen(acc[r], acc16[r]);  // after an odd number of steps
  int64_t s = 0;
  for (auto& a : acc) s += vsum(a);
  return s;
}

using DotsFn = int64_t (*)(const uint8_t*, int64_t, int64_t);

// R rows as the kernels take them: at most PASS_ROWS a pass (their ZMM_RT on AVX-512, RT on AVX2:
// the accumulators with their operands fill the registers), the chunk read again from the cache for
// each further pass.
template <int R, int BITS>
inline int64_t in_passes(const uint8_t* p, int64_t n, int64_t ahead) {
  constexpr int P = R < PASS_ROWS ? R : PASS_ROWS;
  if constexpr (R == 0) return dots_over<0, BITS>(p, n, 0, ahead);
  int64_t s = 0;
  for (int i = 0; i < R / P; ++i) s += dots_over<P, BITS>(p, n, i, i == 0 ? ahead : 0);  // other activations each pass
  return s;
}

template <int BITS>
inline DotsFn dots_for(int64_t rows) {
  switch (rows) {
    case 0: return &in_passes<0, BITS>;
    case 1: return &in_passes<1, BITS>;
    case 2: return &in_passes<2, BITS>;
    case 4: return &in_passes<4, BITS>;
    case 8: return &in_passes<8, BITS>;
    case 16: return &in_passes<16, BITS>;
    default: TORCH_CHECK(false, "stream_dots: rows must be 0, 1, 2, 4, 8 or 16, not ", rows);
  }
}

inline const uint8_t* bytes_of(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "stream_dots: ", what, " must be a contiguous CPU tensor");
  return (const uint8_t*)t.data_ptr();
}

// Seconds for the least work of one linear call of `rows` rows on its weights as the runtime holds
// them: `weights` (4-, 6- or 8-bit values, `bits`: see dots_over) and its scales `extra` (read, not
// computed with), cut into chunks of about CHUNK weight bytes on the runtime's threads, each chunk
// with its share of every scale tensor, as matmul_impl's tiles read theirs. `repeat` > 1 walks them
// that many times in one call (from the caches, when they fit). `ahead` > 0: each pair of weight
// loads also asks for the line that many bytes on (software prefetch), to see whether it helps this
// core overlap.
inline double stream_dots(const torch::Tensor& weights, const std::vector<torch::Tensor>& extra, int64_t rows,
                          int64_t bits, int64_t repeat, int64_t ahead) {
  TORCH_CHECK(ahead >= 0, "stream_dots: ahead must be 0 (no software prefetch) or a distance in bytes");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "stream_dots: bits must be 4, 6 or 8, not ", bits);
  TORCH_CHECK(repeat >= 1, "stream_dots: repeat must be at least 1");
  const DotsFn fn = bits == 4 ? dots_for<4>(rows) : bits == 6 ? dots_for<6>(rows) : dots_for<8>(rows);
  const DotsFn load = dots_for<4>(0);
  const uint8_t* w = bytes_of(weights, "weights");
  const int64_t wn = weights.nbytes();
  std::vector<std::pair<const uint8_t*, int64_t>> xs;
  for (const auto& t : extra) xs.emplace_back(bytes_of(t, "a scale tensor"), (int64_t)t.nbytes());
  const int64_t per = std::max<int64_t>(1, (wn + CHUNK - 1) / CHUNK);  // chunks a walk
  // chunk c of a walk: [c/per, (c+1)/per) of a tensor of n bytes, cut on whole cache lines
  auto span = [per](int64_t n, int64_t c) {
    auto cut = [&](int64_t i) { return i == per ? n : (n * i / per) & ~int64_t(63); };
    return std::pair<int64_t, int64_t>{cut(c), cut(c + 1)};
  };
  const auto t0 = std::chrono::steady_clock::now();
  chunk_pool::parallel_for(per * repeat, 1, [&](int64_t c0, int64_t c1) {
    int64_t s = 0;
    for (int64_t cc = c0; cc < c1; ++cc) {
      const int64_t c = cc % per;
      const auto [a, b] = span(wn, c);
      s += fn(w + a, b - a, ahead);
      for (const auto& [p, n] : xs) {
        const auto [xa, xb] = span(n, c);
        s += load(p + xa, xb - xa, 0);
      }
    }
    g_sink.fetch_add(s, std::memory_order_relaxed);
  });
  return seconds_since(t0);
}

}  // namespace probes
