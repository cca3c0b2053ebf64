// Q8_0 one-row tile dot variants on AVX2, cache-resident weights: G MAC/s.
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <cstring>
static inline double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
constexpr int NC = 8, QK = 32;
// layout: tile t, block b: 256 bytes, load j (0..7): byte c*4+i = w[c][b*32 + 4j + i]
template <int V>
__attribute__((noinline)) void run(const int8_t* W, int64_t ntile, int64_t nb, const int8_t* x, const uint8_t* xa_vec,
                                   const int8_t* xs_vec, const uint8_t* xabs, const float* dx, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = 0; t < ntile; ++t) {
    __m256 acc = _mm256_setzero_ps();
    const int8_t* tw = W + t * nb * 256;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* blk = tw + b * 256;
      __m256i s = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + j * 32));
        if constexpr (V == 0) {
          const __m256i aw = _mm256_sign_epi8(w, w);
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(((const int32_t*)(x + b * 32))[j]), w);
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
        } else if constexpr (V == 1) {
          const __m256i xb = _mm256_set1_epi32(((const int32_t*)(x + b * 32))[j]);
          const __m256i ab = _mm256_set1_epi32(((const int32_t*)(xabs + b * 32))[j]);
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(w, xb)), ones));
        } else {
          const __m256i xb = _mm256_loadu_si256((const __m256i*)(xs_vec + (b * 8 + j) * 32));
          const __m256i ab = _mm256_loadu_si256((const __m256i*)(xa_vec + (b * 8 + j) * 32));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(w, xb)), ones));
        }
      }
      const __m256 dw = _mm256_set1_ps(0.01f);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx[b])), acc);
    }
    _mm256_storeu_ps(out + t * 8, acc);
  }
}
int main(int argc, char** argv) {
  int64_t K = argc > 1 ? atoll(argv[1]) : 576, N = argc > 2 ? atoll(argv[2]) : 576;
  int reps = argc > 3 ? atoi(argv[3]) : 2000;
  int64_t nb = K / 32, ntile = N / 8;
  std::vector<int8_t> W(ntile * nb * 256), x(K), xs(nb * 8 * 32);
  std::vector<uint8_t> xa(nb * 8 * 32), xabs(K);
  std::vector<float> dx(nb, 0.5f), o1(N), o2(N), o3(N);
  srand(1);
  for (auto& v : W) v = (int8_t)(rand() % 255 - 127);
  for (auto& v : x) v = (int8_t)(rand() % 255 - 127);
  for (int64_t k = 0; k < K; ++k) xabs[k] = (uint8_t)std::abs(x[k]);
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < 8; ++j)
      for (int c = 0; c < 8; ++c)
        for (int i = 0; i < 4; ++i) {
          xs[(b * 8 + j) * 32 + c * 4 + i] = x[b * 32 + 4 * j + i];
          xa[(b * 8 + j) * 32 + c * 4 + i] = xabs[b * 32 + 4 * j + i];
        }
  run<0>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o1.data());
  run<1>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o2.data());
  run<2>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o3.data());
  printf("same: %d %d\n", memcmp(o1.data(), o2.data(), N * 4) == 0, memcmp(o1.data(), o3.data(), N * 4) == 0);
  for (int round = 0; round < 5; ++round) {
    double best[3];
    for (int v = 0; v < 3; ++v) {
      double t0 = now();
      for (int r = 0; r < reps; ++r) {
        if (v == 0) run<0>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o1.data());
        if (v == 1) run<1>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o1.data());
        if (v == 2) run<2>(W.data(), ntile, nb, x.data(), xa.data(), xs.data(), xabs.data(), dx.data(), o1.data());
      }
      best[v] = (double)K * N * reps / (now() - t0) / 1e9;
    }
    printf("G MAC/s: current %.2f  two-bcast %.2f  vectors %.2f\n", best[0], best[1], best[2]);
  }
}
