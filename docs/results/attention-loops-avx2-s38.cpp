// Scratch microbenchmark (session 38): attention's AVX2 loops as in specplug/runtime/csrc/gguf_kernels.cpp
// (scores_keys with reduce4, pv_lanes; 3 query heads, head_dim 64) on float16 and float32 rows in L1,
// ns a key for 32 keys a call. AMD EPYC Zen 1 (session 38): scores of 2 keys a pass 22.4, of 4 18.7
// (15.5 without the reduction), of 4 on float32 rows 12.5; V sums 16.9 (float32 10.6); one ymm
// multiply-add 0.408 ns, so a key's 24 + 24 multiply-adds take 19.6 ns at the peak. Build and run:
//   g++ -O3 -mavx2 -mfma -mf16c -o att attention-loops-avx2-s38.cpp && ./att
#include <immintrin.h>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <vector>
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
template <int NQ, int KJ, int ND, bool RED, typename T>
inline void scores_keys(const float* qs, const T* const* kr, float* sc, int64_t ldsc) {
  constexpr int64_t nd = ND, D = nd * 8;
  __m256 a[NQ][KJ];
  for (int x = 0; x < KJ; ++x) { const __m256 k = load8(kr[x]);
    for (int g = 0; g < NQ; ++g) a[g][x] = _mm256_mul_ps(_mm256_loadu_ps(qs + g * D), k); }
  for (int64_t i = 1; i < nd; ++i) {
    __m256 qv[NQ];
    for (int g = 0; g < NQ; ++g) qv[g] = _mm256_loadu_ps(qs + g * D + 8 * i);
    for (int x = 0; x < KJ; ++x) { const __m256 k = load8(kr[x] + 8 * i);
      for (int g = 0; g < NQ; ++g) a[g][x] = _mm256_fmadd_ps(qv[g], k, a[g][x]); }
  }
  for (int g = 0; g < NQ; ++g) {
    if (RED) { float o[4];
      reduce4(a[g][0], a[g][KJ > 1 ? 1 : 0], a[g][KJ > 2 ? 2 : 0], a[g][KJ > 3 ? 3 : 0], o);
      for (int x = 0; x < KJ; ++x) sc[g * ldsc + x] = o[x];
    } else for (int x = 0; x < KJ; ++x) _mm256_storeu_ps(sc + 8*(g * ldsc + x), a[g][x]);
  }
}
template <int NQ, int KJ, bool RED, typename T>
__attribute__((noinline)) void scores(const float* qs, const T* const* kr, int64_t cnt, float* sc, int64_t ldsc) {
  for (int64_t j = 0; j + KJ <= cnt; j += KJ) scores_keys<NQ, KJ, 8, RED, T>(qs, kr + j, sc + (RED ? j : 8*j), ldsc);
}
template <int NQ, int W, typename T>
__attribute__((noinline)) void pv_lanes(const float* p, int64_t ldp, const T* const* vr, int64_t cnt, int64_t i0, float* acc, int64_t lda) {
  __m256 a[NQ][W];
  for (int g = 0; g < NQ; ++g) for (int w = 0; w < W; ++w) a[g][w] = _mm256_loadu_ps(acc + g * lda + 8 * (i0 + w));
  for (int64_t j = 0; j < cnt; ++j) {
    __m256 pj[NQ];
    for (int g = 0; g < NQ; ++g) pj[g] = _mm256_broadcast_ss(p + g * ldp + j);
    for (int w = 0; w < W; ++w) { const __m256 v = load8(vr[j] + 8 * (i0 + w));
      for (int g = 0; g < NQ; ++g) a[g][w] = _mm256_fmadd_ps(pj[g], v, a[g][w]); }
  }
  for (int g = 0; g < NQ; ++g) for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * lda + 8 * (i0 + w), a[g][w]);
}
using clk = std::chrono::steady_clock;
int main() {
  const int cnt = 32, D = 64;
  std::vector<uint16_t> K(cnt * D, 0x3c00); std::vector<float> Kf(cnt*D, 1.0f);
  std::vector<const uint16_t*> kr(cnt); std::vector<const float*> kf(cnt);
  for (int j = 0; j < cnt; ++j) kr[j] = K.data() + j * D, kf[j] = Kf.data() + j*D;
  std::vector<float> q(3 * D, 0.001f), sc(3 * 8 * 1024), acc(3 * D);
  auto run = [&](const char* name, auto f) {
    for (int w = 0; w < 1000; ++w) f();
    double best = 1e9;
    for (int rep = 0; rep < 20; ++rep) { auto t = clk::now(); for (int i = 0; i < 20000; ++i) f();
      double ns = std::chrono::duration<double, std::nano>(clk::now() - t).count() / 20000 / cnt; best = std::min(best, ns); }
    printf("%-28s %.2f ns a key (3 heads, D 64)\n", name, best);
  };
  run("scores KJ2 f16", [&] { scores<3, 2, true>(q.data(), kr.data(), cnt, sc.data(), 1024); });
  run("scores KJ4 f16", [&] { scores<3, 4, true>(q.data(), kr.data(), cnt, sc.data(), 1024); });
  run("scores KJ4 f16 no reduce", [&] { scores<3, 4, false>(q.data(), kr.data(), cnt, sc.data(), 1024); });
  run("scores KJ2 f16 no reduce", [&] { scores<3, 2, false>(q.data(), kr.data(), cnt, sc.data(), 1024); });
  run("scores KJ4 f32", [&] { scores<3, 4, true>(q.data(), kf.data(), cnt, sc.data(), 1024); });
  run("pv W4 f16 (x2 passes)", [&] { pv_lanes<3, 4>(sc.data(), 1024, kr.data(), cnt, 0, acc.data(), D); pv_lanes<3, 4>(sc.data(), 1024, kr.data(), cnt, 4, acc.data(), D); });
  run("pv W2 f16 (x4 passes)", [&] { for (int i = 0; i < 8; i += 2) pv_lanes<3, 2>(sc.data(), 1024, kr.data(), cnt, i, acc.data(), D); });
  run("pv W4 f32 (x2 passes)", [&] { pv_lanes<3, 4>(sc.data(), 1024, kf.data(), cnt, 0, acc.data(), D); pv_lanes<3, 4>(sc.data(), 1024, kf.data(), cnt, 4, acc.data(), D); });
  // FMA peak reference: 12 independent chains
  __m256 r[12]; for (auto& x : r) x = _mm256_set1_ps(1.0f); const __m256 m = _mm256_set1_ps(0.999f);
  auto t = clk::now(); for (int i = 0; i < 10000000; ++i) for (int k = 0; k < 12; ++k) r[k] = _mm256_fmadd_ps(r[k], m, m);
  double ns = std::chrono::duration<double, std::nano>(clk::now() - t).count() / 1e8 / 1.2;
  float o = 0; for (auto& x : r) o += _mm256_cvtss_f32(x);
  printf("one ymm FMA: %.3f ns (%g)\n", ns, o);
}
