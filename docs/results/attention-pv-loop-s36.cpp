// Scratch microbenchmark (session 36): attention's V sums (pv_lanes16<3, 8> as in
// specplug/runtime/csrc/gguf_kernels.cpp: 3 query heads, head_dim 64, 512-bit registers), float16 V rows
// in L1, per key for 32 / 64 / 128 keys a call. Zen 4 (session 36): 4.3 / 4.1 / 4.0 ns a key against
// ~3.3 for its 12 multiply-adds of 16 lanes at one a cycle. Build and run:
//   g++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -o pv attention-pv-loop-s36.cpp && ./pv
#include <immintrin.h>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <vector>
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
template <int NQ, int W, typename T>
__attribute__((noinline)) void pv_lanes16(const float* p, int64_t ldp, const T* const* vr, int64_t cnt, int64_t i0, float* acc, int64_t lda) {
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
template <typename T> double bench(int64_t cnt) {
  std::vector<T> V(cnt * 64); for (auto& x : V) { if constexpr (sizeof(T) == 2) x = 0x3c00; else x = 1.0f; }
  std::vector<const T*> vr(cnt); for (int64_t j = 0; j < cnt; ++j) vr[j] = V.data() + j * 64;
  std::vector<float> p(3 * 136, 0.01f), acc(3 * 72, 0.f);
  double best = 1e9;
  for (int rep = 0; rep < 50; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 1000; ++it) pv_lanes16<3, 8, T>(p.data(), 136, vr.data(), cnt, 0, acc.data(), 72);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / 1000 / cnt * 1e9;  // ns per key (3 heads x 64 dims)
}
int main() { for (int r = 0; r < 2; ++r) printf("cnt32 %.2f cnt64 %.2f cnt128 %.2f ns/key\n", bench<uint16_t>(32), bench<uint16_t>(64), bench<uint16_t>(128)); }
