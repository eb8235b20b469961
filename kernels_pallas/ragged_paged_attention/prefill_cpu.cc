// Prefill attention for the CPU over the paged KV cache, read in place, as an XLA FFI call.
//
//   out[t, h*g + i] = softmax_j(scale * q[t, h*g + i] . K[j, h]) @ V[j, h]
//       over the keys j of t's sequence from its window's start to t's position (causal)
//
// Why: the XLA loop (cpu.py's _prefill) gathers each key block into a temporary, transposes
// it for two batched dots and makes the masks, the exps and the rescales separate passes;
// here one pass per key tile does it all in registers. Work items are (sequence, block of
// query tokens, kv head); each walks its keys once per 32 query rows.
//
// Query rows sit in vector lanes: a row block is 32 rows (two 16-lane vectors, row
// m = token * group + q head), and every score, mask, max and rescale of the online
// softmax is a lane-wise vector op, with keys and values broadcast from the cache rows.
//   - float32 dots (AVX-512F): a float32 cache in place; a bfloat16 one widened per tile.
//   - bfloat16 dots (AVX512-BF16, vdpbf16ps): for a bfloat16 cache only. q and the softmax
//     weights are rounded to bf16 (as the cache's keys and values already are); sums,
//     maxima and exps stay float32.
// Every function that executes AVX-512 carries a target attribute, so the library loads on
// any x86-64 CPU and `prefill_attention_supported` decides at run time.
//
// Layout (kernels_pallas/kv_cache.py, "standard"): cache [num_pages, page_size, 2 * kvh, D],
// key of kv head h at row 2h, value at 2h + 1. Keys outside a row block's visible range are
// never summed (their slots may hold NaN); page-table entries are clamped into the cache.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kernels_pallas::bf16_bits;
using kernels_pallas::exp16;
using kernels_pallas::soft_cap16;

constexpr int kLanes = 16;
constexpr int kRows = 2 * kLanes;  // query rows per row block
constexpr int kKeys = 32;          // keys per tile
constexpr int kKeyGroup = 8;       // keys scored together: 2 x 8 accumulators
constexpr int kMaxD = 256;

struct Params {
  int64_t num_pages, page_size, pages_per_seq, kvh, group, D;
  float scale, soft_cap;
  int64_t window;  // 0: none
  const float* sinks;  // [kvh * group] attention sinks (reference.py), or nullptr: none
};

// One work item: tokens [t0, t0 + nq) of a sequence (first at position pos0), kv head h.
struct Item {
  int64_t seq, t0, nq, pos0, h;
};

// The state of one row block: running max and sum per row, output transposed [D][kRows].
struct RowBlock {
  alignas(64) float m[kRows];
  alignas(64) float l[kRows];
  alignas(64) int32_t pos[kRows];  // -1: a padding lane (sees nothing)
  alignas(64) int32_t lo[kRows];   // first visible key
  float* o;                        // [D][kRows]
  uint32_t* qp;                    // bf16 dots: q as bf16 pairs [D/2][kRows]; f32: q [D][kRows]
};

// Row pointers of a tile's keys and values (key j -> its cache row), pages clamped.
template <typename T>
void tile_rows(const Params& p, const T* cache, const int32_t* table, int64_t h, int64_t t0,
               const T** krow, const T** vrow) {
  const int64_t stride = 2 * p.kvh * p.D;
  for (int j = 0; j < kKeys; ++j) {
    const int64_t k = t0 + j;
    const int64_t page = std::clamp<int64_t>(
        table[std::min(k / p.page_size, p.pages_per_seq - 1)], 0, p.num_pages - 1);
    krow[j] = cache + (page * p.page_size + k % p.page_size) * stride + 2 * h * p.D;
    vrow[j] = krow[j] + p.D;
  }
}

// Masked, scaled scores s[j][row] -> softmax weights in place; updates m, l and the rescale
// alpha (per lane) the caller applies to o. Keys outside [jlo, jhi] get weight 0.
K512 void softmax_tile(const Params& p, RowBlock& rb, int64_t t0, int jlo, int jhi,
                       float (*s)[kRows], __m512* alpha) {
  for (int v = 0; v < 2; ++v) {
    const __m512i pos = _mm512_load_si512(rb.pos + v * kLanes);
    const __m512i lo = _mm512_load_si512(rb.lo + v * kLanes);
    __m512 mt = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 vis[kKeys];
    for (int j = jlo; j <= jhi; ++j) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
      vis[j] = _mm512_cmple_epi32_mask(key, pos) & _mm512_cmpge_epi32_mask(key, lo);
      __m512 x = _mm512_load_ps(s[j] + v * kLanes);
      if (p.soft_cap > 0.0f) x = soft_cap16(x, p.soft_cap);
      x = _mm512_mask_blend_ps(vis[j], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x);
      _mm512_store_ps(s[j] + v * kLanes, x);
      mt = _mm512_max_ps(mt, x);
    }
    const __m512 m_old = _mm512_load_ps(rb.m + v * kLanes);
    const __m512 m_new = _mm512_max_ps(m_old, mt);  // m starts finite: never -inf - -inf
    alpha[v] = exp16(_mm512_sub_ps(m_old, m_new));
    __m512 lt = _mm512_setzero_ps();
    for (int j = 0; j < kKeys; ++j) {
      __m512 e = _mm512_setzero_ps();
      if (j >= jlo && j <= jhi) e = _mm512_maskz_mov_ps(vis[j], exp16(_mm512_sub_ps(_mm512_load_ps(s[j] + v * kLanes), m_new)));
      _mm512_store_ps(s[j] + v * kLanes, e);
      lt = _mm512_add_ps(lt, e);
    }
    _mm512_store_ps(rb.m + v * kLanes, m_new);
    _mm512_store_ps(rb.l + v * kLanes, _mm512_fmadd_ps(_mm512_load_ps(rb.l + v * kLanes), alpha[v], lt));
  }
}

// float32 dots: scores of 32 keys (rows in lanes, keys broadcast), then o = alpha * o + P V.
template <typename T>
K512 void tile_f32(const Params& p, RowBlock& rb, const T* const* krow, const T* const* vrow,
                   int64_t t0, int jlo, int jhi, float* kbuf, float* vbuf) {
  const int64_t D = p.D;
  const float* K[kKeys];
  const float* V[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    if constexpr (std::is_same<T, float>::value) {
      K[j] = krow[j], V[j] = vrow[j];
    } else {  // widen the tile once (keys outside [jlo, jhi] are never read)
      K[j] = kbuf + j * D, V[j] = vbuf + j * D;
      if (j < jlo || j > jhi) continue;
      for (int64_t d = 0; d < D; d += 16) {
        const __m256i kb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[j] + d));
        const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[j] + d));
        _mm512_storeu_ps(kbuf + j * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(kb), 16)));
        _mm512_storeu_ps(vbuf + j * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vb), 16)));
      }
    }
  }
  alignas(64) float s[kKeys][kRows];
  const float* q = reinterpret_cast<const float*>(rb.qp);  // [D][kRows]
  for (int j0 = jlo / kKeyGroup * kKeyGroup; j0 <= jhi; j0 += kKeyGroup) {
    __m512 a[kKeyGroup][2];
    for (int u = 0; u < kKeyGroup; ++u) a[u][0] = a[u][1] = _mm512_setzero_ps();
    const float* Kc[kKeyGroup];
    for (int u = 0; u < kKeyGroup; ++u) Kc[u] = K[std::clamp(j0 + u, jlo, jhi)];
    for (int64_t d = 0; d < D; ++d) {
      const __m512 q0 = _mm512_loadu_ps(q + d * kRows), q1 = _mm512_loadu_ps(q + d * kRows + kLanes);
      for (int u = 0; u < kKeyGroup; ++u) {
        const __m512 k = _mm512_set1_ps(Kc[u][d]);
        a[u][0] = _mm512_fmadd_ps(q0, k, a[u][0]);
        a[u][1] = _mm512_fmadd_ps(q1, k, a[u][1]);
      }
    }
    for (int u = 0; u < kKeyGroup; ++u) {
      _mm512_store_ps(s[j0 + u], a[u][0]);
      _mm512_store_ps(s[j0 + u] + kLanes, a[u][1]);
    }
  }
  __m512 alpha[2];
  softmax_tile(p, rb, t0, jlo, jhi, s, alpha);
  for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8 channels x 2 row vectors of o at a time
    __m512 o[8][2];
    for (int u = 0; u < 8; ++u) {
      o[u][0] = _mm512_mul_ps(_mm512_loadu_ps(rb.o + (d0 + u) * kRows), alpha[0]);
      o[u][1] = _mm512_mul_ps(_mm512_loadu_ps(rb.o + (d0 + u) * kRows + kLanes), alpha[1]);
    }
    for (int j = jlo; j <= jhi; ++j) {
      const __m512 p0 = _mm512_load_ps(s[j]), p1 = _mm512_load_ps(s[j] + kLanes);
      for (int u = 0; u < 8; ++u) {
        const __m512 v = _mm512_set1_ps(V[j][d0 + u]);
        o[u][0] = _mm512_fmadd_ps(p0, v, o[u][0]);
        o[u][1] = _mm512_fmadd_ps(p1, v, o[u][1]);
      }
    }
    for (int u = 0; u < 8; ++u) {
      _mm512_storeu_ps(rb.o + (d0 + u) * kRows, o[u][0]);
      _mm512_storeu_ps(rb.o + (d0 + u) * kRows + kLanes, o[u][1]);
    }
  }
}

// bfloat16 dots (vdpbf16ps): each 32-bit lane holds a pair, channels (d, d+1) of q against
// the same pair of the key row (one 32-bit broadcast), keys (j, j+1) of the weights against
// values packed as (V[j][d], V[j+1][d]).
K512BF void tile_bf16(const Params& p, RowBlock& rb, const uint16_t* const* krow,
                      const uint16_t* const* vrow, int64_t t0, int jlo, int jhi, uint32_t* vpair) {
  const int64_t D = p.D, D2 = D / 2;
  alignas(64) float s[kKeys][kRows];
  for (int j0 = jlo / kKeyGroup * kKeyGroup; j0 <= jhi; j0 += kKeyGroup) {
    __m512 a[kKeyGroup][2];
    for (int u = 0; u < kKeyGroup; ++u) a[u][0] = a[u][1] = _mm512_setzero_ps();
    const uint32_t* Kc[kKeyGroup];
    for (int u = 0; u < kKeyGroup; ++u)
      Kc[u] = reinterpret_cast<const uint32_t*>(krow[std::clamp(j0 + u, jlo, jhi)]);
    for (int64_t c = 0; c < D2; ++c) {
      const __m512bh q0 = (__m512bh)_mm512_loadu_si512(rb.qp + c * kRows);
      const __m512bh q1 = (__m512bh)_mm512_loadu_si512(rb.qp + c * kRows + kLanes);
      for (int u = 0; u < kKeyGroup; ++u) {
        const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(Kc[u][c]));
        a[u][0] = _mm512_dpbf16_ps(a[u][0], q0, k);
        a[u][1] = _mm512_dpbf16_ps(a[u][1], q1, k);
      }
    }
    for (int u = 0; u < kKeyGroup; ++u) {
      _mm512_store_ps(s[j0 + u], a[u][0]);
      _mm512_store_ps(s[j0 + u] + kLanes, a[u][1]);
    }
  }
  __m512 alpha[2];
  softmax_tile(p, rb, t0, jlo, jhi, s, alpha);
  // Values of keys (2c, 2c+1) packed per channel; a key outside [jlo, jhi] packs as 0.
  const int c_lo = jlo / 2, c_hi = jhi / 2;
  for (int c = c_lo; c <= c_hi; ++c) {
    const int j = 2 * c;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i a = (j >= jlo) ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(vrow[j] + d))) : _mm512_setzero_si512();
      const __m512i b = (j + 1 <= jhi) ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(vrow[j + 1] + d))) : _mm512_setzero_si512();
      _mm512_storeu_si512(vpair + c * D + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
  __m512i w[kKeys / 2][2];  // weights of keys (2c, 2c+1) as bf16 pairs, per row vector
  for (int c = c_lo; c <= c_hi; ++c)
    for (int v = 0; v < 2; ++v)
      w[c][v] = _mm512_or_si512(bf16_bits(_mm512_load_ps(s[2 * c] + v * kLanes)),
                                _mm512_slli_epi32(bf16_bits(_mm512_load_ps(s[2 * c + 1] + v * kLanes)), 16));
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    __m512 o[8][2];
    for (int u = 0; u < 8; ++u) {
      o[u][0] = _mm512_mul_ps(_mm512_loadu_ps(rb.o + (d0 + u) * kRows), alpha[0]);
      o[u][1] = _mm512_mul_ps(_mm512_loadu_ps(rb.o + (d0 + u) * kRows + kLanes), alpha[1]);
    }
    for (int c = c_lo; c <= c_hi; ++c) {
      const __m512bh w0 = (__m512bh)w[c][0], w1 = (__m512bh)w[c][1];
      for (int u = 0; u < 8; ++u) {
        const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(vpair[c * D + d0 + u]));
        o[u][0] = _mm512_dpbf16_ps(o[u][0], w0, v);
        o[u][1] = _mm512_dpbf16_ps(o[u][1], w1, v);
      }
    }
    for (int u = 0; u < 8; ++u) {
      _mm512_storeu_ps(rb.o + (d0 + u) * kRows, o[u][0]);
      _mm512_storeu_ps(rb.o + (d0 + u) * kRows + kLanes, o[u][1]);
    }
  }
}

// One item: its query rows in blocks of kRows, each walking its visible keys in tiles.
template <typename T>
K512 void run_item(const Params& p, const Item& it, const float* q, const T* cache,
                   const int32_t* table, bool bf16_dots, float* out) {
  const int64_t G = p.group, D = p.D, qh = p.kvh * G, M = it.nq * G;
  std::vector<float> obuf(D * kRows), kbuf(kKeys * D), vbuf(kKeys * D);
  std::vector<uint32_t> qbuf(D * kRows), vpair(kKeys / 2 * D);
  RowBlock rb;
  rb.o = obuf.data();
  rb.qp = qbuf.data();
  const T* krow[kKeys];
  const T* vrow[kKeys];
  for (int64_t r0 = 0; r0 < M; r0 += kRows) {
    int64_t klo = std::numeric_limits<int64_t>::max(), khi = -1;
    for (int m = 0; m < kRows; ++m) {
      const int64_t r = r0 + m;
      rb.m[m] = -1e30f;  // finite: a lane with nothing seen yet rescales by exp(0)
      rb.l[m] = 0.0f;
      rb.pos[m] = r < M ? static_cast<int32_t>(it.pos0 + r / G) : -1;
      rb.lo[m] = r < M && p.window > 0 ? std::max<int32_t>(0, rb.pos[m] - p.window + 1) : 0;
      if (r < M) klo = std::min<int64_t>(klo, rb.lo[m]), khi = std::max<int64_t>(khi, rb.pos[m]);
      const float* qr = q + ((it.t0 + std::min(r, M - 1) / G) * qh + it.h * G + std::min(r, M - 1) % G) * D;
      if (bf16_dots) {
        for (int64_t c = 0; c < D / 2; ++c) {
          float a = qr[2 * c] * p.scale, b = qr[2 * c + 1] * p.scale;
          uint32_t ua, ub;
          std::memcpy(&ua, &a, 4);
          std::memcpy(&ub, &b, 4);
          ua = (ua + 0x7fff + ((ua >> 16) & 1)) >> 16;
          ub = (ub + 0x7fff + ((ub >> 16) & 1)) >> 16;
          rb.qp[c * kRows + m] = ua | (ub << 16);
        }
      } else {
        float* qf = reinterpret_cast<float*>(rb.qp);
        for (int64_t d = 0; d < D; ++d) qf[d * kRows + m] = qr[d] * p.scale;
      }
    }
    std::fill(obuf.begin(), obuf.end(), 0.0f);
    for (int64_t t0 = klo / kKeys * kKeys; t0 <= khi; t0 += kKeys) {
      const int jlo = static_cast<int>(std::max(klo, t0) - t0);
      const int jhi = static_cast<int>(std::min(khi, t0 + kKeys - 1) - t0);
      tile_rows(p, cache, table, it.h, t0, krow, vrow);
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (bf16_dots) {
          tile_bf16(p, rb, krow, vrow, t0, jlo, jhi, vpair.data());
          continue;
        }
      }
      tile_f32(p, rb, krow, vrow, t0, jlo, jhi, kbuf.data(), vbuf.data());
    }
    for (int m = 0; m < kRows && r0 + m < M; ++m) {
      const int64_t r = r0 + m;
      float l = rb.l[m];
      if (p.sinks) l += std::exp(p.sinks[it.h * G + r % G] - rb.m[m]);  // reference.py: sink_denominator
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      float* o = out + ((it.t0 + r / G) * qh + it.h * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = rb.o[d * kRows + m] * inv;
    }
  }
}

template <typename T>
ffi::Error Run(const Params& p, const float* q, const T* cache, const int32_t* tables,
               int64_t num_seqs, const int32_t* cu, const int32_t* q_lens, const int32_t* kv_lens,
               int64_t decode_q_len, int64_t block_q, int64_t num_tokens, bool bf16_dots, float* out) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ql = q_lens[s], start = cu[s];
    if (ql <= decode_q_len || start < 0 || start + ql > num_tokens || kv_lens[s] < ql) continue;
    for (int64_t t = 0; t < ql; t += block_q)
      for (int64_t h = 0; h < p.kvh; ++h)
        items.push_back({s, start + t, std::min(block_q, ql - t), kv_lens[s] - ql + t, h});
  }
  // Longest first (the last blocks of a prompt see the most keys): the pool stays balanced.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.pos0 + a.nq > b.pos0 + b.nq;
  });
  try {  // no C++ exception may cross the FFI boundary
    kernels_pallas::Pool::get().run(static_cast<int64_t>(items.size()), [&](int64_t i) {
      const Item& it = items[i];
      run_item(p, it, q, cache, tables + it.seq * p.pages_per_seq, bf16_dots, out);
    });
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("paged_prefill_attention: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error PrefillImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                       ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu,
                       ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::F32> sinks,
                       float sm_scale, float soft_cap, int64_t sliding_window,
                       int64_t decode_q_len, int64_t block_q, bool bf16_dots,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = cache.dimensions(), td = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || cd[2] % 2 != 0 || cd[3] != qd[2])
    return ffi::Error::InvalidArgument(
        "paged_prefill_attention: q [T, qh, D], cache [pages, page_size, 2 * kvh, D], "
        "page_indices [S, P]");
  Params p{cd[0], cd[1], td[1], cd[2] / 2, 0, qd[2], sm_scale, soft_cap, sliding_window,
           sinks.element_count() ? sinks.typed_data() : nullptr};
  // Element counts are size_t, dimensions int64_t: compared as int64_t.
  const auto count = [](const auto& buffer) { return static_cast<int64_t>(buffer.element_count()); };
  if (count(sinks) != 0 && count(sinks) != qd[1])
    return ffi::Error::InvalidArgument("paged_prefill_attention: sinks must be [num_q_heads]");
  const int64_t S = td[0];
  if (p.kvh == 0 || qd[1] % p.kvh != 0 || p.D % 16 != 0 || p.D > kMaxD || block_q < 1 ||
      count(cu) != S + 1 || count(q_lens) != S || count(kv_lens) != S)
    return ffi::Error::InvalidArgument("paged_prefill_attention: unsupported shapes");
  if (bf16_dots && cache.element_type() != ffi::DataType::BF16 && cache.element_type() != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("paged_prefill_attention: bf16 dots need a bfloat16 cache");
  p.group = qd[1] / p.kvh;
  float* o = out->typed_data();
  std::fill(o, o + qd[0] * qd[1] * qd[2], 0.0f);  // rows of no prefill item stay 0
  switch (cache.element_type()) {
    case ffi::DataType::F32:
      return Run(p, q.typed_data(), static_cast<const float*>(cache.untyped_data()),
                 page_indices.typed_data(), S, cu.typed_data(), q_lens.typed_data(),
                 kv_lens.typed_data(), decode_q_len, block_q, qd[0], false, o);
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // bf16 bits (kernels_pallas/kv_cache.py: as_bits)
      return Run(p, q.typed_data(), static_cast<const uint16_t*>(cache.untyped_data()),
                 page_indices.typed_data(), S, cu.typed_data(), q_lens.typed_data(),
                 kv_lens.typed_data(), decode_q_len, block_q, qd[0], bf16_dots, o);
    default:
      return ffi::Error::InvalidArgument("paged_prefill_attention: cache must be float32 or bfloat16 (or its bits)");
  }
}

}  // namespace

// 1: AVX-512 (float32 dots); 2: and AVX512-BF16 (bfloat16 dots for a bfloat16 cache); 0: neither.
extern "C" int prefill_attention_supported() {
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma")))
    return 0;
  return __builtin_cpu_supports("avx512bf16") ? 2 : 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedPrefillAttentionCpu, PrefillImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("decode_q_len")
                                  .Attr<int64_t>("block_q")
                                  .Attr<bool>("bf16_dots")
                                  .Ret<ffi::Buffer<ffi::F32>>());
