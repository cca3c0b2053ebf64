// Scratch microbenchmark (session 36): attention's scores loop (scores_keys<3, 4, 8> as in
// specplug/runtime/csrc/gguf_kernels.cpp: 3 query heads x 4 keys, head_dim 64) over 128 keys in L1,
// with and without its horizontal reduction (reduce4), float16 and float32 keys. Zen 4 (session 36):
// 16.1-19.5 ns a group of 4 keys x 3 heads with the reduction, 13.2-15.3 without (three runs); 96 multiply-adds
// at 2 a cycle ~13 ns. Build and run:
//   g++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -o sk attention-scores-loop-s36.cpp && ./sk
#include <immintrin.h>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <vector>
#include <cstring>
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
template <int NQ, int KJ, int ND, typename T, bool RED = true>
__attribute__((always_inline)) inline void scores_keys(const float* qs, const T* const* kr, float* sc, int64_t ldsc) {
  const int64_t nd = ND, D = nd * 8;
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
  if (RED) {
  for (int g = 0; g < NQ; ++g) {
    float o[4];
    reduce4(a[g][0], a[g][KJ > 1 ? 1 : 0], a[g][KJ > 2 ? 2 : 0], a[g][KJ > 3 ? 3 : 0], o);
    for (int x = 0; x < KJ; ++x) sc[g * ldsc + x] = o[x];
  }
  } else {
    for (int g = 0; g < NQ; ++g) for (int x = 0; x < KJ; ++x) _mm256_storeu_ps(sc + (g * KJ + x) * 8, a[g][x]);
  }
}
template <typename T, bool RED>
__attribute__((noinline)) void run(const float* qs, const T* const* kr, float* sc, int64_t cnt) {
  for (int64_t j = 0; j + 4 <= cnt; j += 4) scores_keys<3, 4, 8, T, RED>(qs, kr + j, sc + (RED ? j : 0), 136);
}
template <typename T, bool RED>
double bench(int64_t cnt) {
  std::vector<T> K(cnt * 64);
  for (size_t i = 0; i < K.size(); ++i) { if constexpr (sizeof(T) == 2) K[i] = 0x3c00; else K[i] = 1.0f; }
  std::vector<const T*> kr(cnt); for (int64_t j = 0; j < cnt; ++j) kr[j] = K.data() + j * 64;
  std::vector<float> qs(3 * 64, 0.5f), sc(3 * 136 + 4096);
  double best = 1e9;
  for (int rep = 0; rep < 50; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 1000; ++it) run<T, RED>(qs.data(), kr.data(), sc.data(), cnt);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  // ns per (4 keys x 3 heads) group
  return best / 1000 / (cnt / 4) * 1e9;
}
int main() {
  printf("f16 red  %.2f ns/group\n", bench<uint16_t, true>(128));
  printf("f32 red  %.2f ns/group\n", bench<float, true>(128));
  printf("f16 nored %.2f ns/group\n", bench<uint16_t, false>(128));
  printf("f32 nored %.2f ns/group\n", bench<float, false>(128));
  // fma peak reference: 96 FMAs at 2/cycle
}
