// Experiment (not wired into the model): bf16 weights x bf16 activations -> float32, through
// oneDNN's matmul, as an XLA FFI custom call that reads one layer of a stacked weight in place.
//
//   x bf16 [M, K], w bf16 [L, N, K] (PyTorch's [out, in], as the int8 kernel), layer s32 []
//   -> y f32 [M, N] = x @ w[layer].T
//
// Why: inside the layer scan XLA slices each layer's weights out of the stack and, for bf16
// weights, fuses a convert to float32 into that slice, so the dot runs in float32 over a
// float32 copy (docs/benchmarks.md). A custom call that takes the whole stack and the layer
// index keeps both the in-place read and the bf16 dot. Built and run by
// scripts/bench_onednn_bf16.py against Debian's libdnnl-dev (oneDNN 2.6, OpenMP).
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

std::mutex mu;  // one call at a time: the primitive cache, and each call uses every core
std::map<std::tuple<int64_t, int64_t, int64_t>, dnnl::matmul> primitives;

ffi::Error Impl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::BufferR0<ffi::S32> layer,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("onednn_bf16_matmul: x [M, K], w [L, N, K]");
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);  // as XLA's dynamic index
  using tag = dnnl::memory::format_tag;
  using dt = dnnl::memory::data_type;
  // Weights as a [K, N] matrix stored column-major (tag ba): row n of w[l] is column n.
  const dnnl::memory::desc xm({M, K}, dt::bf16, tag::ab), wm({K, N}, dt::bf16, tag::ba),
      ym({M, N}, dt::f32, tag::ab);
  try {
    std::lock_guard<std::mutex> lk(mu);
    auto key = std::make_tuple(M, K, N);
    auto it = primitives.find(key);
    if (it == primitives.end())
      it = primitives.emplace(key, dnnl::matmul(dnnl::matmul::primitive_desc(
                                       dnnl::matmul::desc(xm, wm, ym), engine()))).first;
    dnnl::memory xmem(xm, engine(), x.untyped_data());
    dnnl::memory wmem(wm, engine(), static_cast<uint16_t*>(w.untyped_data()) + l * N * K);
    dnnl::memory ymem(ym, engine(), y->untyped_data());
    static dnnl::stream s(engine());
    it->second.execute(s, {{DNNL_ARG_SRC, xmem}, {DNNL_ARG_WEIGHTS, wmem}, {DNNL_ARG_DST, ymem}});
    s.wait();
  } catch (const std::exception& e) {  // no C++ exception may cross the FFI boundary
    return ffi::Error::Internal(std::string("onednn_bf16_matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnBf16Matmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
