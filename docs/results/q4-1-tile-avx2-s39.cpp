// Where the AVX2 Q4_1 tile's time goes on weights that stay in L2 (session 39, docs/results/runtime.md).
// A copy of gguf_kernels.cpp's tile<R, KQ4_1> and q4_1_block_dot (AVX2 branch) as of 6f6a03e, with
// variants chosen by -DVAR (bits):
//   1: activations pre-broadcast (a 32-byte load a group of 4 instead of vpbroadcastd)
//   2: the 16-bit sums widened by shifts and an add instead of vpmaddwd
//   4: the block's 8 nibble vectors unpacked first, then each row's 8 products (rows outer)
//   8: no float work (the integer dots added into the accumulators as integers)
// -DRR: rows a pass (RT: 4). One thread, 64 tiles of K = 576 (147 KB), 20000 passes, 3 reps.
//   g++ -O3 -mavx2 -mfma -mf16c -DVAR=0 -DRR=4 -o tile q4-1-tile-avx2-s39.cpp && ./tile
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
constexpr int QK=32, NC=8;
struct Act { const int8_t* q; const float* d; const float* s; int64_t K, nb; const int32_t* qb; };
#ifndef VAR
#define VAR 0
#endif
#ifndef RR
#define RR 4
#endif
template <int R>
inline void q4_1_block_dot(const uint8_t* blk, const Act& a, int64_t r0, int64_t b, __m256i* s) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[R];
  for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + p * 32));
    __m256i lo = _mm256_and_si256(raw, m4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    for (int r = 0; r < R; ++r) {
#if VAR & 1
      const __m256i* xb = (const __m256i*)(a.qb + ((r0 + r) * a.K + b * QK) * 2);  // 8 groups x 8 lanes
      __m256i x0 = _mm256_loadu_si256(xb + p), x1 = _mm256_loadu_si256(xb + p + 4);
#else
      const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
      __m256i x0 = _mm256_set1_epi32(xr[p]), x1 = _mm256_set1_epi32(xr[p + 4]);
#endif
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, x0));
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, x1));
    }
  }
  for (int r = 0; r < R; ++r) {
#if VAR & 2
    s[r] = _mm256_add_epi32(_mm256_srai_epi32(s16[r], 16), _mm256_srai_epi32(_mm256_slli_epi32(s16[r], 16), 16));
#else
    s[r] = _mm256_madd_epi16(s16[r], ones);
#endif
  }
}
#if VAR & 4
template <int R>
inline void q4_1_block_dot_ro(const uint8_t* blk, const Act& a, int64_t r0, int64_t b, __m256i* s) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w8[8];
  for (int p = 0; p < 4; ++p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + p * 32));
    w8[p] = _mm256_and_si256(raw, m4);
    w8[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
  for (int r = 0; r < R; ++r) {
    const int32_t* xr = (const int32_t*)(a.q + (r0 + r) * a.K + b * QK);
    __m256i s16 = _mm256_maddubs_epi16(w8[0], _mm256_set1_epi32(xr[0]));
    for (int j = 1; j < 8; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w8[j], _mm256_set1_epi32(xr[j])));
    s[r] = _mm256_madd_epi16(s16, ones);
  }
}
#define q4_1_block_dot q4_1_block_dot_ro
#endif
inline __m256 scales8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
template <int R>
__attribute__((noinline)) void tile(const uint8_t* qs, const uint16_t* wd, const uint16_t* wm, const Act& a, int64_t r0, __m256* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = qs + b * 128;
    const __m256 dw = scales8(wd + b * NC);
    __m256i s32[R];
    q4_1_block_dot<R>(blk, a, r0, b, s32);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * a.nb + b;
      const __m256 dx = _mm256_set1_ps(a.d[rb]);
#if VAR & 8
      acc[r] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(acc[r]), s32[r]));
#else
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(scales8(wm + b * NC), _mm256_set1_ps(a.s[rb]), acc[r]);
#endif
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}
int main(int argc, char** argv) {
  const int R = RR; const int64_t K = 576, nb = K / 32, T = 64;
  uint8_t* w = (uint8_t*)aligned_alloc(64, T * nb * 128); for (int64_t i = 0; i < T*nb*128; i++) w[i] = rand();
  uint16_t* sc = (uint16_t*)aligned_alloc(64, T * nb * 8 * 2); for (int64_t i = 0; i < T*nb*8; i++) sc[i] = 0x3c00;
  int8_t* q = (int8_t*)aligned_alloc(64, R * K); for (int i = 0; i < R*K; i++) q[i] = rand() % 255 - 127;
  int32_t* qb = (int32_t*)aligned_alloc(64, R * K * 8);
  for (int r = 0; r < R; r++) for (int64_t g = 0; g < K / 4; g++) for (int l = 0; l < 8; l++) qb[(r*K/4 + g)*8 + l] = ((int32_t*)q)[r*K/4 + g];
  float d[R * 18], s[R * 18]; for (int i = 0; i < R*18; i++) d[i] = 0.01f, s[i] = 1.f;
  Act a{q, d, s, K, nb, qb};
  __m256 out[R]; float chk = 0;
  for (int rep = 0; rep < 3; rep++) {
    auto t0 = std::chrono::steady_clock::now();
    const int N = 20000;
    for (int n = 0; n < N; n++) for (int64_t t = 0; t < T; t++) { tile<R>(w + t*nb*128, sc + t*nb*8, sc + t*nb*8, a, 0, out); chk += out[0][0]; }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("VAR %d: %.2f GMAC/s/thread (chk %g)\n", VAR, double(N) * T * 8 * K * R / dt / 1e9, chk);
  }
}
