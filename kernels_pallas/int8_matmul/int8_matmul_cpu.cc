// int8 weight x float activation matrix product for the CPU, as an XLA FFI custom call.
//
//   y[m, n] = sum_g scale[l, n, g] * sum_{k in group g} x[m, k] * qweight[l, n, k]
//
// x f32 [M, K], qweight s8 [L, N, K] (or [N, K]), scale f32 [L, N, G], layer s32 [] -> y f32 [M, N].
//
// Why it exists: XLA's CPU backend dequantizes an int8 operand into a float temporary before
// its dot, so a decode step of few tokens reads each weight as int8, writes it as float32 and
// reads it again, and a layer-scan slice of stacked weights is copied before a custom call
// could see it. This kernel reads each int8 weight once, converts it in registers (AVX2) and
// multiplies it into every token's accumulator; `layer` selects one layer of a stacked
// [L, N, K] operand so the layer scan passes the whole stack without slicing it.
//
// Threads: chunks of output rows on kernels_pallas/cpu_kernels.h's pool.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kernels_pallas::hsum;

inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows [n0, n1) for T tokens. Each group of `gsize` inputs is summed unscaled in U vector
// accumulators per token (independent FMA chains), then scaled once into the token's total.
template <int T, int U>
void rows_tile(const float* x, const int8_t* w, const float* s, float* y, int64_t K, int64_t N,
               int64_t G, int64_t n0, int64_t n1) {
  const int64_t gsize = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    const float* sr = s + n * G;
    __m256 tot[T];
    for (int t = 0; t < T; ++t) tot[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[T][U];
      for (int t = 0; t < T; ++t)
        for (int u = 0; u < U; ++u) acc[t][u] = _mm256_setzero_ps();
      for (int64_t k = g * gsize; k < (g + 1) * gsize; k += 8 * U) {
        __m256 wv[U];
        for (int u = 0; u < U; ++u) wv[u] = load8(wr + k + 8 * u);
        for (int t = 0; t < T; ++t)
          for (int u = 0; u < U; ++u)
            acc[t][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + t * K + k + 8 * u), acc[t][u]);
      }
      const __m256 sc = _mm256_broadcast_ss(sr + g);
      for (int t = 0; t < T; ++t) {
        __m256 a = acc[t][0];
        for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[t][u]);
        tot[t] = _mm256_fmadd_ps(a, sc, tot[t]);
      }
    }
    for (int t = 0; t < T; ++t) y[t * N + n] = hsum(tot[t]);
  }
}

// Every token for rows [n0, n1): tiles of 4 tokens share each converted weight vector.
void rows(const float* x, const int8_t* w, const float* s, float* y, int64_t M, int64_t K,
          int64_t N, int64_t G, int64_t n0, int64_t n1) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) rows_tile<4, 2>(x + t * K, w, s, y + t * N, K, N, G, n0, n1);
  switch (M - t) {
    case 3: rows_tile<3, 2>(x + t * K, w, s, y + t * N, K, N, G, n0, n1); break;
    case 2: rows_tile<2, 2>(x + t * K, w, s, y + t * N, K, N, G, n0, n1); break;
    case 1: rows_tile<1, 4>(x + t * K, w, s, y + t * N, K, N, G, n0, n1); break;
    default: break;
  }
}

ffi::Error Int8MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> qweight,
                          ffi::Buffer<ffi::F32> scale, ffi::BufferR0<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = qweight.dimensions(), sd = scale.dimensions();
  const auto yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || sd.size() != r || yd.size() != 2)
    return ffi::Error::InvalidArgument("int8_matmul: x [M, K], qweight [(L,) N, K], scale [(L,) N, G]");
  const int64_t M = xd[0], K = xd[1], N = wd[r - 2], G = sd[r - 1];
  const int64_t L = r == 3 ? wd[0] : 1;
  if (wd[r - 1] != K || sd[r - 2] != N || (r == 3 && sd[0] != L) || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("int8_matmul: operand shapes disagree");
  if (G <= 0 || K % G != 0 || (K / G) % 32 != 0)
    return ffi::Error::InvalidArgument("int8_matmul: K must be G groups of a multiple of 32");
  // Clamped like XLA's dynamic index (the reference), rather than read out of bounds.
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const float* xp = x.typed_data();
  const int8_t* wp = qweight.typed_data() + l * N * K;
  const float* sp = scale.typed_data() + l * N * G;
  float* yp = y->typed_data();
  // kernels_pallas::kChunks chunks of rows, each a multiple of 8 rows.
  const int64_t chunk = std::max<int64_t>(8, (N / kernels_pallas::kChunks + 7) / 8 * 8);
  const int64_t chunks = (N + chunk - 1) / chunk;
  try {  // no C++ exception may cross the FFI boundary
    kernels_pallas::Pool::get().run(chunks, [&](int64_t c) {
      rows(xp, wp, sp, yp, M, K, N, G, c * chunk, std::min(N, (c + 1) * chunk));
    });
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("int8_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8MatmulCpu, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int int8_matmul_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
