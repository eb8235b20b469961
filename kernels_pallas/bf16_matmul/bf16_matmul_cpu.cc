// bf16 weight x activation matrix products for the CPU, as XLA FFI custom calls.
//
//   y[m, n] = sum_k x[m, k] * w[l, n, k]      w bf16 [(L,) N, K] (PyTorch's [out, in]), y f32 [M, N]
//
// Why: inside the layer scan XLA slices each layer's weights out of the stack and, for bf16
// weights, fuses a convert to float32 into that slice, so the dot runs in float32 over a
// float32 copy and bf16 buys nothing (docs/benchmarks.md). These calls take the whole stack
// and the layer index and read the layer in place.
//
// Bf16MatmulCpu (x f32): few tokens. Each bf16 weight is read once, widened to float32 in
//   registers (a 16-bit shift: exact) and multiplied into every token's float32 accumulator;
//   AVX2/FMA, chunks of rows on kernels_pallas/cpu_kernels.h's pool. Memory-bound, so half the
//   bytes of float32 weights is what it buys.
// Bf16MatmulOnednn (x bf16): many tokens, through oneDNN's matmul (bf16 x bf16 with float32
//   accumulation on the CPU's bf16 units: AVX512-BF16 or AMX), when built with
//   KERNELS_PALLAS_ONEDNN and linked against oneDNN (Debian's libdnnl-dev).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

#ifdef KERNELS_PALLAS_ONEDNN
#include <map>
#include <mutex>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#endif

namespace ffi = xla::ffi;

namespace {

using kernels_pallas::hsum;

inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 float (bf16 is float32's top half)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Rows [n0, n1) for T tokens, U vector accumulators per token (independent FMA chains).
template <int T, int U>
void rows_tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m256 acc[T][U];
    for (int t = 0; t < T; ++t)
      for (int u = 0; u < U; ++u) acc[t][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * U) {
      __m256 wv[U];
      for (int u = 0; u < U; ++u) wv[u] = load8(wr + k + 8 * u);
      for (int t = 0; t < T; ++t)
        for (int u = 0; u < U; ++u)
          acc[t][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + t * K + k + 8 * u), acc[t][u]);
    }
    for (int t = 0; t < T; ++t) {
      __m256 a = acc[t][0];
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[t][u]);
      y[t * N + n] = hsum(a);
    }
  }
}

// Every token for rows [n0, n1): tiles of 4 tokens share each widened weight vector.
void rows(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) rows_tile<4, 2>(x + t * K, w, y + t * N, K, N, n0, n1);
  switch (M - t) {
    case 3: rows_tile<3, 2>(x + t * K, w, y + t * N, K, N, n0, n1); break;
    case 2: rows_tile<2, 2>(x + t * K, w, y + t * N, K, N, n0, n1); break;
    case 1: rows_tile<1, 4>(x + t * K, w, y + t * N, K, N, n0, n1); break;
    default: break;
  }
}

// Shapes of x [M, K], w [(L,) N, K], y [M, N]; the layer clamped like XLA's dynamic index.
struct Dims {
  int64_t M, K, N, l;
};

template <typename X>
ffi::Error check(X& x, ffi::Buffer<ffi::BF16>& w, ffi::BufferR0<ffi::S32>& layer,
                 ffi::ResultBuffer<ffi::F32>& y, const char* name, Dims* d) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || yd.size() != 2 || wd[r - 1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[r - 2])
    return ffi::Error::InvalidArgument(std::string(name) + ": x [M, K], w [(L,) N, K], y [M, N]");
  const int64_t L = r == 3 ? wd[0] : 1;
  *d = Dims{xd[0], xd[1], wd[r - 2], std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1)};
  return ffi::Error::Success();
}

ffi::Error Bf16MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  Dims d;
  if (ffi::Error e = check(x, w, layer, y, "bf16_matmul", &d); e.failure()) return e;
  if (d.K % 32 != 0) return ffi::Error::InvalidArgument("bf16_matmul: K must be a multiple of 32");
  const float* xp = x.typed_data();
  const uint16_t* wp = static_cast<const uint16_t*>(w.untyped_data()) + d.l * d.N * d.K;
  float* yp = y->typed_data();
  const int64_t chunk = std::max<int64_t>(8, (d.N / kernels_pallas::kChunks + 7) / 8 * 8);
  const int64_t chunks = (d.N + chunk - 1) / chunk;
  try {  // no C++ exception may cross the FFI boundary
    kernels_pallas::Pool::get().run(chunks, [&](int64_t c) {
      rows(xp, wp, yp, d.M, d.K, d.N, c * chunk, std::min(d.N, (c + 1) * chunk));
    });
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("bf16_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

#ifdef KERNELS_PALLAS_ONEDNN
dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

std::mutex onednn_mu;  // one call at a time: the primitive cache, and each call uses every core

ffi::Error OnednnImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  Dims d;
  if (ffi::Error e = check(x, w, layer, y, "bf16_matmul_onednn", &d); e.failure()) return e;
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  // The weights as a [K, N] matrix stored column-major (tag ba): row n of w[l] is column n.
  const dnnl::memory::desc xm({d.M, d.K}, dt::bf16, tag::ab), wm({d.K, d.N}, dt::bf16, tag::ba),
      ym({d.M, d.N}, dt::f32, tag::ab);
  try {
    static std::map<std::tuple<int64_t, int64_t, int64_t>, dnnl::matmul> primitives;
    std::lock_guard<std::mutex> lk(onednn_mu);
    auto key = std::make_tuple(d.M, d.K, d.N);  // the step's buckets: a handful of shapes
    auto it = primitives.find(key);
    if (it == primitives.end())
      it = primitives.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(
                                       dnnl::matmul::desc(xm, wm, ym), engine()))).first;
    dnnl::memory xmem(xm, engine(), x.untyped_data());
    dnnl::memory wmem(wm, engine(), static_cast<uint16_t*>(w.untyped_data()) + d.l * d.N * d.K);
    dnnl::memory ymem(ym, engine(), y->untyped_data());
    static dnnl::stream s(engine());
    it->second.execute(s, {{DNNL_ARG_SRC, xmem}, {DNNL_ARG_WEIGHTS, wmem}, {DNNL_ARG_DST, ymem}});
    s.wait();
  } catch (const std::exception& e) {  // no C++ exception may cross the FFI boundary
    return ffi::Error::Internal(std::string("bf16_matmul_onednn: ") + e.what());
  }
  return ffi::Error::Success();
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulCpu, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#ifdef KERNELS_PALLAS_ONEDNN
XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulOnednn, OnednnImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif

extern "C" int bf16_matmul_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Whether oneDNN's CPU has bf16 arithmetic worth using (AVX512-BF16 or AMX); without it
// oneDNN emulates bf16 and float32 XLA is as fast.
extern "C" int bf16_matmul_onednn_native() {
  return __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
}
