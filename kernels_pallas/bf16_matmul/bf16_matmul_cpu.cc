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
//   KERNELS_PALLAS_ONEDNN and linked against oneDNN 3 (the package index's onednn-cpu-gomp,
//   a dependency of jaxserve on x86-64 Linux).
// Bf16MatmulOnednnPacked (x bf16): the same product on weights reordered once, at load, into
//   the blocked layout oneDNN's matmul picks for them (`bf16_matmul_onednn_pack`): each call
//   then reads them as they are instead of repacking the plain [N, K] rows into that layout
//   on every call, the cost that made oneDNN slower than the AVX2 kernel for few tokens.
//   w is [(L,) S]: S elements per layer (`bf16_matmul_onednn_packed_elements`, padding
//   included).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

#ifdef KERNELS_PALLAS_ONEDNN
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

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
  Dims d{};  // set by check() when it succeeds
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

// y [M, N] f32 = x [M, K] bf16 times weights `wm` (plain or packed: `packed` keys the cache)
// through oneDNN's matmul: one primitive per shape and layout (the step's buckets are a
// handful), kept.
void onednn_matmul(const void* x, const dnnl::memory::desc& wm, const uint16_t* w, void* y, int64_t M,
                   int64_t K, int64_t N, bool packed) {
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc xm({M, K}, dt::bf16, tag::ab), ym({M, N}, dt::f32, tag::ab);
  static std::map<std::tuple<int64_t, int64_t, int64_t, bool>, dnnl::matmul> primitives;
  std::lock_guard<std::mutex> lk(onednn_mu);
  const auto key = std::make_tuple(M, K, N, packed);
  auto it = primitives.find(key);
  if (it == primitives.end())
    it = primitives.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(engine(), xm, wm, ym))).first;
  dnnl::memory xmem(xm, engine(), const_cast<void*>(x));
  dnnl::memory wmem(wm, engine(), const_cast<uint16_t*>(w));
  dnnl::memory ymem(ym, engine(), y);
  static dnnl::stream s(engine());
  it->second.execute(s, {{DNNL_ARG_SRC, xmem}, {DNNL_ARG_WEIGHTS, wmem}, {DNNL_ARG_DST, ymem}});
  s.wait();
}

ffi::Error OnednnImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  Dims d{};  // set by check() when it succeeds
  if (ffi::Error e = check(x, w, layer, y, "bf16_matmul_onednn", &d); e.failure()) return e;
  // The weights as a [K, N] matrix stored column-major (tag ba): row n of w[l] is column n.
  const dnnl::memory::desc wm({d.K, d.N}, dnnl::memory::data_type::bf16, dnnl::memory::format_tag::ba);
  try {
    onednn_matmul(x.untyped_data(), wm, static_cast<const uint16_t*>(w.untyped_data()) + d.l * d.N * d.K,
                  y->untyped_data(), d.M, d.K, d.N, false);
  } catch (const std::exception& e) {  // no C++ exception may cross the FFI boundary
    return ffi::Error::Internal(std::string("bf16_matmul_onednn: ") + e.what());
  }
  return ffi::Error::Success();
}

// The packed layout is chosen once per (K, N), for this many rows, and used for every row
// count: oneDNN's brgemm matmul takes it at every M (bf16_matmul_onednn_impl reports what runs).
constexpr int64_t kPackRows = 64;

struct Blocked {
  int64_t block;  // B: output channels per block (0: not a layout the few-token kernel reads)
  int64_t kb;     // K-blocks of 32
};

// oneDNN's packed layout of a [K, N] matrix, and whether the few-token kernel reads it.
struct PackedLayout {
  dnnl::memory::desc md;
  Blocked blocked;
};

Blocked blocked_layout(const dnnl::memory::desc& md, int64_t K, int64_t N) {
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  if (K % 32 != 0 || !__builtin_cpu_supports("avx512bf16")) return {0, 0};
  for (auto [t, b] : {std::pair{tag::BA16a64b2a, 64}, {tag::BA16a48b2a, 48}, {tag::BA16a32b2a, 32}})
    if (md == dnnl::memory::desc({K, N}, dt::bf16, t)) return {b, K / 32};
  return {0, 0};
}

std::mutex packed_mu;  // the layout cache, which load-time packing (Python) fills too

const PackedLayout& packed_layout(int64_t K, int64_t N) {
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  static std::map<std::pair<int64_t, int64_t>, PackedLayout> layouts;  // entries never move
  std::lock_guard<std::mutex> lk(packed_mu);
  auto it = layouts.find({K, N});
  if (it == layouts.end()) {
    const dnnl::memory::desc xm({kPackRows, K}, dt::bf16, tag::ab), wm({K, N}, dt::bf16, tag::any),
        ym({kPackRows, N}, dt::f32, tag::ab);
    const dnnl::memory::desc md =
        dnnl::matmul::primitive_desc(engine(), xm, wm, ym).weights_desc();
    it = layouts.emplace(std::make_pair(K, N), PackedLayout{md, blocked_layout(md, K, N)}).first;
  }
  return it->second;
}

dnnl::matmul::primitive_desc packed_primitive_desc(int64_t M, int64_t K, int64_t N) {
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  const dnnl::memory::desc xm({M, K}, dt::bf16, tag::ab), ym({M, N}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(engine(), xm, packed_layout(K, N).md, ym);
}

// Few tokens on packed weights, when the layout is oneDNN's "BA16a<B>b2a" (what its brgemm
// matmul picks for bf16 on AVX512-BF16): blocks of B output channels x 32 inputs, N-blocks
// outermost, so one block's rows over all K are contiguous, each row the pairs of inputs
// (k, k+1) of its B channels. That is vdpbf16ps's operand: one 64-byte load is 16 channels x
// 2 inputs, multiplied by a broadcast pair of activations into 16 float32 sums, no horizontal
// sums. oneDNN reads the same bytes but forks its OpenMP threads per call, which for few
// tokens costs more than the product (docs/benchmarks.md, "Packed bf16 weights").

// T tokens (x: bf16 pairs as uint32, K/2 per token) x one block of 16V channels from n0.
template <int V, int T>
__attribute__((target("avx512f,avx512bf16"))) void dp_tile(const uint32_t* x, int64_t K2,
                                                           const uint16_t* blk, float* y, int64_t N,
                                                           int64_t n0) {
  __m512 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t r = 0; r < K2; ++r, blk += 32 * V) {
    __m512bh w[V];
    for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(blk + 32 * v);
    for (int t = 0; t < T; ++t) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[t * K2 + r]));
      for (int v = 0; v < V; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], w[v], a);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) {
      const int64_t n = n0 + 16 * v, left = N - n;  // the last block's padding channels
      if (left >= 16) _mm512_storeu_ps(y + t * N + n, acc[t][v]);
      else if (left > 0) _mm512_mask_storeu_ps(y + t * N + n, (__mmask16)((1u << left) - 1), acc[t][v]);
    }
}

template <int V>
void dp_block(const uint32_t* x, int64_t M, int64_t K2, const uint16_t* blk, float* y, int64_t N,
              int64_t n0) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) dp_tile<V, 4>(x + t * K2, K2, blk, y + t * N, N, n0);
  switch (M - t) {
    case 3: dp_tile<V, 3>(x + t * K2, K2, blk, y + t * N, N, n0); break;
    case 2: dp_tile<V, 2>(x + t * K2, K2, blk, y + t * N, N, n0); break;
    case 1: dp_tile<V, 1>(x + t * K2, K2, blk, y + t * N, N, n0); break;
    default: break;
  }
}

// Every token for N-block nb.
void packed_block(const uint32_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                  const Blocked& b, int64_t nb) {
  const uint16_t* blk = w + nb * b.kb * 32 * b.block;
  const int64_t n0 = nb * b.block, K2 = K / 2;
  switch (b.block) {
    case 64: dp_block<4>(x, M, K2, blk, y, N, n0); break;
    case 48: dp_block<3>(x, M, K2, blk, y, N, n0); break;
    default: dp_block<2>(x, M, K2, blk, y, N, n0); break;
  }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as XLA's convert (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x rounded to bf16 for both paths: up to few_tokens rows packed_block (where the layout is
// one it reads and the CPU has AVX512-BF16), beyond oneDNN.
ffi::Error OnednnPackedImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                            ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                            int64_t few_tokens) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 1 && r != 2) || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("bf16_matmul_onednn_packed: x [M, K], w [(L,) S], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1], S = wd[r - 1], L = r == 2 ? wd[0] : 1;
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  try {
    const PackedLayout& p = packed_layout(K, N);
    if (static_cast<int64_t>(p.md.get_size() / sizeof(uint16_t)) != S)
      return ffi::Error::InvalidArgument("bf16_matmul_onednn_packed: w was not packed for this K, N");
    const uint16_t* wl = static_cast<const uint16_t*>(w.untyped_data()) + l * S;
    thread_local std::vector<uint16_t> xb;  // x rounded to bf16, for either path
    xb.resize(M * K);
    const float* xp = x.typed_data();
    for (int64_t i = 0; i < M * K; ++i) xb[i] = to_bf16(xp[i]);
    if (M <= few_tokens) {
      const Blocked& b = p.blocked;
      if (b.block) {
        const int64_t blocks = (N + b.block - 1) / b.block;
        const uint32_t* x2 = reinterpret_cast<const uint32_t*>(xb.data());
        float* yp = y->typed_data();
        const int64_t per = (blocks + kernels_pallas::kChunks - 1) / kernels_pallas::kChunks;
        kernels_pallas::Pool::get().run((blocks + per - 1) / per, [&](int64_t c) {
          for (int64_t nb = c * per; nb < std::min(blocks, (c + 1) * per); ++nb)
            packed_block(x2, wl, yp, M, K, N, b, nb);
        });
        return ffi::Error::Success();
      }
    }
    onednn_matmul(xb.data(), p.md, wl, y->untyped_data(), M, K, N, true);
  } catch (const std::exception& e) {  // no C++ exception may cross the FFI boundary
    return ffi::Error::Internal(std::string("bf16_matmul_onednn_packed: ") + e.what());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulOnednnPacked, OnednnPackedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("few_tokens"));

// Whether the few-token kernel reads the packed layout of a [N, K] matrix here (else every
// row count runs oneDNN).
extern "C" int bf16_matmul_packed_few_token_kernel(int64_t K, int64_t N) {
  try {
    return packed_layout(K, N).blocked.block != 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// Elements of one [N, K] matrix in the packed layout (padding included); -1 on failure.
extern "C" int64_t bf16_matmul_onednn_packed_elements(int64_t K, int64_t N) {
  try {
    return static_cast<int64_t>(packed_layout(K, N).md.get_size() / sizeof(uint16_t));
  } catch (const std::exception&) {
    return -1;
  }
}

// w [N, K] (row n: output channel n) -> out, packed_elements(K, N) elements. 0 on success.
extern "C" int bf16_matmul_onednn_pack(const uint16_t* w, uint16_t* out, int64_t K, int64_t N) {
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  try {
    const dnnl::memory::desc& wm = packed_layout(K, N).md;
    std::fill(out, out + wm.get_size() / sizeof(uint16_t), uint16_t{0});  // the padding
    dnnl::memory src({{K, N}, dt::bf16, tag::ba}, engine(), const_cast<uint16_t*>(w));
    dnnl::memory dst(wm, engine(), out);
    dnnl::stream s(engine());
    dnnl::reorder(src, dst).execute(s, src, dst);
    s.wait();
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Which oneDNN implementation runs M rows on packed weights ("brg:avx512_core_bf16", ...),
// written to buf (NUL-terminated); 0 on success.
extern "C" int bf16_matmul_onednn_impl(int64_t M, int64_t K, int64_t N, char* buf, int64_t len) {
  try {
    const std::string name = packed_primitive_desc(M, K, N).impl_info_str();
    std::snprintf(buf, len, "%s", name.c_str());
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// The instruction set oneDNN's kernels use here (the CPU's, within ONEDNN_MAX_CPU_ISA and what
// the OS grants: AMX needs Linux's permission, which oneDNN requests).
dnnl::cpu_isa onednn_isa() { return dnnl::get_effective_cpu_isa(); }

// Whether that instruction set has bf16 arithmetic (AVX512-BF16, or AMX, which implies it);
// without it oneDNN emulates bf16 and float32 XLA is as fast. The ISA values are bit sets,
// each holding the ones below it.
extern "C" int bf16_matmul_onednn_native() {
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (static_cast<unsigned>(onednn_isa()) & bf16) == bf16;
}

// "oneDNN 3.2.0 on avx512_core_amx": what start-up reports. 0 on success.
extern "C" int bf16_matmul_onednn_describe(char* buf, int64_t len) {
  using isa = dnnl::cpu_isa;
  const char* name = "an unnamed instruction set";
  switch (onednn_isa()) {
    case isa::sse41: name = "sse41"; break;
    case isa::avx: name = "avx"; break;
    case isa::avx2: name = "avx2"; break;
    case isa::avx2_vnni: name = "avx2_vnni"; break;
    case isa::avx2_vnni_2: name = "avx2_vnni_2"; break;
    case isa::avx512_core: name = "avx512_core"; break;
    case isa::avx512_core_vnni: name = "avx512_core_vnni"; break;
    case isa::avx512_core_bf16: name = "avx512_core_bf16"; break;
    case isa::avx512_core_fp16: name = "avx512_core_fp16"; break;
    case isa::avx512_core_amx: name = "avx512_core_amx"; break;
    case isa::avx512_core_amx_fp16: name = "avx512_core_amx_fp16"; break;
    default: break;
  }
  const dnnl::version_t* v = dnnl::version();
  std::snprintf(buf, len, "oneDNN %d.%d.%d on %s", v->major, v->minor, v->patch, name);
  return 0;
}
#endif

extern "C" int bf16_matmul_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

extern "C" int bf16_matmul_cpu_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

