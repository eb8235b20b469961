// What the CPU kernels (int8_matmul, bf16_matmul, the attention kernels) share: a horizontal
// sum, exps, the AVX-512 helpers of the attention kernels, and a small
// thread pool: a call's chunks of output rows are taken from a shared counter by the calling thread and the helpers (one
// per other core, or KERNELS_PALLAS_INT8_THREADS in all), so the caller never waits for a
// helper that has not started. One call runs at a time; each already uses every core.
// Header-only: each kernel's shared library holds its own pool.
#pragma once

// GCC 12.0-12.2's AVX-512 intrinsics fill the unused merge operand with a deliberately
// uninitialized vector (`__m512 __Y = __Y;`), which -Wall reports wherever they are inlined
// (GCC bug 105593, fixed in 12.3): off for the header only. The kernels include immintrin.h
// through this header so that this include is the first.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace kernels_pallas {

inline float hsum(__m256 a) {  // the 8 lanes' sum
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_hadd_ps(h, h);
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(h);
}

// Cephes' expf, e^x = 2^n * p(r) with n = round(x * log2 e), r = x - n ln 2 (ln 2 in two
// parts), p a degree-7 polynomial: relative error ~2e-7. The attention kernels' exps (AVX2 and
// AVX-512 widths) share these.
namespace expf_coeffs {
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_coeffs

// AVX-512 helpers of the attention kernels. Each function carries a target attribute, so a
// library holding them loads on any x86-64 CPU; they run only where the CPU has the ISA.
#define K512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define K512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))

// e^x for 16 lanes (x clamped to [-87, 88]; Cephes' expf polynomial, relative error ~2e-7).
K512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  namespace c = expf_coeffs;
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(c::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(c::kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

K512 inline __m512 soft_cap16(__m512 s, float cap) {  // cap * tanh(s / cap)
  const __m512 e = exp16(_mm512_mul_ps(s, _mm512_set1_ps(2.0f / cap)));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                 _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// bf16 (round to nearest even) of 16 floats, in the low or high half of each 32-bit lane.
K512 inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
}

// Row chunks per call: enough for every core to stay busy whatever the others are doing.
constexpr int64_t kChunks = 16;

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may outlive static teardown
    return *pool;
  }

  // Calls fn(c) for every c in [0, n), on this thread and the helpers; returns when all ran.
  template <typename F>
  void run(int64_t n, const F& fn) {
    std::lock_guard<std::mutex> call(call_mu_);
    if (helpers_.empty() || n == 1) {
      for (int64_t c = 0; c < n; ++c) fn(c);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = [&fn](int64_t c) { fn(c); };
      n_ = n;
      next_.store(0);
      open_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load() > 0) cv_.notify_all();
    work();
    {
      std::lock_guard<std::mutex> lk(mu_);
      open_ = false;  // no helper joins from now on
    }
    // Helpers still on their last chunk: poll, and yield now and then so that a helper
    // preempted on a loaded machine can get the core back.
    for (int spins = 0; active_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins % 1024 == 1023) sched_yield();
      else _mm_pause();
    }
  }

 private:
  Pool() {
    cpu_set_t set;
    long cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (const char* v = std::getenv("KERNELS_PALLAS_INT8_THREADS")) cores = std::strtol(v, nullptr, 10);
    // A call has about kChunks chunks, so more helpers than that would only wait.
    cores = std::clamp(cores, 1L, static_cast<long>(kChunks));
    for (long i = 1; i < cores; ++i) {
      try {
        helpers_.emplace_back([this] { helper(); });
        helpers_.back().detach();
      } catch (const std::system_error&) {
        break;  // out of threads (a container's limit): run with the helpers we have
      }
    }
  }

  void work() {
    int64_t c;
    while ((c = next_.fetch_add(1)) < n_) job_(c);
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      // Poll briefly (the next call is often microseconds away), then sleep until woken:
      // polling for longer measured no faster in a decode step and takes the core from XLA.
      for (int spins = 0; gen_.load(std::memory_order_acquire) == seen && spins < 1024; ++spins)
        _mm_pause();
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (gen_.load() == seen) {
          sleeping_.fetch_add(1);
          cv_.wait(lk, [&] { return gen_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
        seen = gen_.load();
        if (!open_) continue;  // that call already finished
        active_.fetch_add(1);
      }
      work();
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> helpers_;
  std::function<void(int64_t)> job_;
  int64_t n_ = 0;
  bool open_ = false;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
};

}  // namespace kernels_pallas
