// Decode attention for the CPU over the paged KV cache, read in place, as an XLA FFI call.
//
//   out[r, h*g + i] = softmax_j(scale * q[r, h*g + i] . K[j, h]) @ V[j, h]
//       over the keys j of row r's sequence from its window's start to row_pos[r] (causal)
//
// Why: the XLA loop (cpu.py's _decode) gathers every key block into a temporary, transposes
// it for the batched dots and merges the partial softmaxes with scatters; at decode that is
// memory traffic several times the cache itself. Here each (row, kv head, key chunk) item
// streams its keys straight from the cache pages (float32 or bfloat16, widened in registers),
// with an online softmax; the items of one row are merged at the end (split-K: one long row
// still spreads over every core). AVX2/FMA; items on kernels_pallas/cpu_kernels.h's pool.
// Over a bfloat16 cache on a CPU with AVX512-BF16 (`bf16_dots`) a tile's keys sit in the lanes
// of one vector and both dots run vdpbf16ps (`attend_bf16`): q and the softmax weights are
// rounded to bf16, as the cache's keys and values already are; sums, maxima and exps stay
// float32. Those functions carry target attributes, so the library loads on any x86-64 CPU.
//
// Layout (kernels_pallas/kv_cache.py, "standard"): cache [num_pages, page_size, 2 * kvh, D],
// key of kv head h at row 2h, value at 2h + 1. Keys past row_pos are never read (their slots
// may hold anything); page-table entries are clamped into the cache.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int paged_decode_attention_supported();

namespace {

using kernels_pallas::exp16;
using kernels_pallas::hsum;
using kernels_pallas::soft_cap16;

constexpr int kTile = 16;      // keys scored together (at most one page)
constexpr int kMaxGroup = 16;  // q heads per kv head
constexpr int kMaxHeads = 64;  // kv heads (on this device)
constexpr int64_t kChunkKeys = 256;  // keys per work item (a multiple of the page size)
constexpr int64_t kMaxBf16D = 256;   // head_dim bound of the bf16 path (a multiple of 32)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 float (bf16 is float32's top half)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// e^x for 8 lanes, x <= 0 (Cephes' expf: 2^n * p(r)); relative error ~2e-7, e^-88 and below -> ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  namespace c = kernels_pallas::expf_coeffs;
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(c::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(c::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(c::kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c::kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct Params {
  int64_t num_pages, page_size, pages_per_seq, kvh, group, D;
  float scale, soft_cap;
  int64_t window;  // 0: none
  const float* sinks;  // [kvh * group] attention sinks (reference.py), or nullptr: none
};

// The cache rows of key t0 of a sequence with page table `table` (entries clamped into the
// cache): all its kv heads' keys and values, then the next keys' of the same page.
template <typename T>
inline const T* slot_rows(const Params& p, const T* cache, const int32_t* table, int64_t t0) {
  const int64_t page = std::clamp<int64_t>(
      table[std::min(t0 / p.page_size, p.pages_per_seq - 1)], 0, p.num_pages - 1);
  return cache + (page * p.page_size + t0 % p.page_size) * 2 * p.kvh * p.D;
}

// One item's partial softmax: running max m, sum l and unnormalised output acc, per q head.
struct Partial {
  float* m;    // [group]
  float* l;    // [group]
  float* acc;  // [group, D]
};

// The sums of 8 vectors' lanes, as one vector (lane k: the sum of v[k]).
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// A tile's keys and values as float32 rows [kTile, D]: in place for a float32 cache, widened
// once into `buf` for bfloat16 (so the group's q heads do not each widen them again).
inline const float* rows_f32(const float* src, int64_t, int64_t, int64_t, float*) { return src; }
inline const float* rows_f32(const uint16_t* src, int64_t n, int64_t stride, int64_t D, float* buf) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(buf + j * D + d, load8(src + j * stride + d));
  return buf;
}

// Keys [k0, k1] (inclusive) of every kv head for one row's q heads `q` [kvh * group, D];
// out[h]: head h's partial. Tiles of `tile` keys (8 or 16, within one page) at absolute
// multiples of `tile`: a tile's slots are contiguous (all heads' keys and values), and the
// next tile's are prefetched (the next page may be anywhere). Keys of a tile outside
// [k0, k1] are scored but never used (their slots may hold NaN).
template <typename T>
void attend(const Params& p, const T* cache, const int32_t* table, const float* q,
            int64_t k0, int64_t k1, Partial* out) {
  const int64_t G = p.group, D = p.D, H = p.kvh, row_stride = 2 * H * D;
  const int64_t tile = p.page_size % 16 == 0 ? 16 : 8;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < G; ++i) {
      out[h].m[i] = -std::numeric_limits<float>::infinity();
      out[h].l[i] = 0.0f;
    }
    std::fill(out[h].acc, out[h].acc + G * D, 0.0f);
  }
  alignas(32) float s[kTile];
  alignas(32) float pr[kTile];
  constexpr bool in_place = std::is_same<T, float>::value;
  std::vector<float> kbuf, vbuf;
  if (!in_place) kbuf.resize(kTile * D), vbuf.resize(kTile * D);
  const int64_t ks = in_place ? row_stride : D;  // row stride of K / V as read
  auto tile_base = [&](int64_t t0) { return slot_rows(p, cache, table, t0); };
  const int64_t tile_bytes = tile * row_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t t0 = k0 / tile * tile; t0 <= k1; t0 += tile) {
    const int64_t lo = std::max(k0, t0) - t0, hi = std::min(k1, t0 + tile - 1) - t0;  // valid keys
    const T* slots = tile_base(t0);
    if (t0 + tile <= k1) {
      const char* next = reinterpret_cast<const char*>(tile_base(t0 + tile));
      // Into L2: into L1 the next tile evicts the one being read.
      for (int64_t b = 0; b < tile_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* K = rows_f32(slots + 2 * h * D, tile, row_stride, D, kbuf.data());
      const float* V = rows_f32(slots + (2 * h + 1) * D, tile, row_stride, D, vbuf.data());
      for (int64_t i = 0; i < G; ++i) {
        const float* qi = q + (h * G + i) * D;
        for (int64_t j8 = 0; j8 < tile; j8 += 8) {  // scores of 8 keys at once
          __m256 a[8];
          for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qi + d);
            for (int u = 0; u < 8; ++u)
              a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(K + (j8 + u) * ks + d), a[u]);
          }
          _mm256_store_ps(s + j8, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(p.scale)));
        }
        if (p.soft_cap > 0.0f)
          for (int64_t j = lo; j <= hi; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
        float mt = s[lo];
        for (int64_t j = lo + 1; j <= hi; ++j) mt = std::max(mt, s[j]);
        Partial& o = out[h];
        const float m_new = std::max(o.m[i], mt);
        const float alpha = std::exp(o.m[i] - m_new);  // 0 for the first tile (m = -inf)
        const __m256 mv = _mm256_set1_ps(m_new);
        for (int64_t j = 0; j < tile; j += 8)
          _mm256_store_ps(pr + j, exp8(_mm256_sub_ps(_mm256_load_ps(s + j), mv)));
        float lt = 0.0f;
        for (int64_t j = lo; j <= hi; ++j) lt += pr[j];
        o.l[i] = o.l[i] * alpha + lt;
        o.m[i] = m_new;
        float* acc = o.acc + i * D;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 32) {  // up to 4 accumulators (D: a multiple of 8)
          const int64_t w = std::min<int64_t>(4, (D - d) / 8);
          __m256 v[4];
          for (int u = 0; u < w; ++u) v[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * u), av);
          for (int64_t j = lo; j <= hi; ++j) {
            const __m256 pj = _mm256_set1_ps(pr[j]);
            for (int u = 0; u < w; ++u)
              v[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(V + j * ks + d + 8 * u), v[u]);
          }
          for (int u = 0; u < w; ++u) _mm256_storeu_ps(acc + d + 8 * u, v[u]);
        }
      }
    }
  }
}

// The 16 vectors' lane sums as one vector: lane j holds the sum of a[j]'s lanes (pairs
// interleaved and added, then 64-bit pairs, then 128-bit blocks twice).
K512 inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                         _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int k = 0; k < 2; ++k)
    d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// `attend` over a bfloat16 cache with bf16 dots, in steps of kSub tiles of 16 keys (page_size
// % 16 == 0, D % 32 == 0). Scores: each key row's vdpbf16ps with q's bf16 pairs, a tile's 16
// partial vectors summed across (hsum16) into one vector, a key a lane. The online softmax
// runs once per step (its reductions and exps are serial: amortized over 64 keys). Values: two
// keys' rows interleaved per channel, (V[j][d], V[j+1][d]), against the two weights as one bf16
// pair; the output vectors hold channels in unpack order (lane 4b + t of vector 2c + half:
// channel 32c + 8b + 4half + t), put back in order into `out` at the end.
constexpr int kSub = 4;
K512BF void attend_bf16(const Params& p, const uint16_t* cache, const int32_t* table,
                        const float* q, int64_t k0, int64_t k1, Partial* out) {
  const int64_t G = p.group, D = p.D, H = p.kvh, row_stride = 2 * H * D, C = D / 32, NV = 2 * C;
  constexpr int64_t kStep = 16 * kSub;
  std::vector<uint32_t> qb(H * G * D / 2);  // q as bf16 pairs
  for (int64_t r = 0; r < H * G; ++r)
    for (int64_t c = 0; c < C; ++c)
      _mm512_storeu_si512(qb.data() + r * D / 2 + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(
          _mm512_loadu_ps(q + r * D + 32 * c + 16), _mm512_loadu_ps(q + r * D + 32 * c)));
  std::vector<float> m(H * G, -std::numeric_limits<float>::infinity()), l(H * G, 0.0f);
  std::vector<float> acc(H * G * D, 0.0f);  // in unpack order
  // A step's values of one kv head, keys paired: [tile][pair][vector].
  __m512i vp[kSub * 8 * 2 * (kMaxBf16D / 32)];
  auto tile_base = [&](int64_t t0) { return slot_rows(p, cache, table, t0); };
  const int64_t tile_bytes = 16 * row_stride * 2;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = k0 / kStep * kStep; t0 <= k1; t0 += kStep) {
    const uint16_t* slots[kSub];
    __mmask16 valid[kSub];
    int lo[kSub], hi[kSub], n = 0;  // tiles [0, n) hold keys of [k0, k1]
    for (int u = 0; u < kSub; ++u) {
      const int64_t ts = t0 + 16 * u;
      if (ts > k1) break;
      lo[u] = static_cast<int>(std::max(k0, ts) - ts), hi[u] = static_cast<int>(std::min(k1, ts + 15) - ts);
      valid[u] = lo[u] <= hi[u] ? static_cast<__mmask16>(((2u << hi[u]) - 1) & ~((1u << lo[u]) - 1)) : 0;
      slots[u] = tile_base(ts);
      n = u + 1;
    }
    for (int64_t ts = t0 + kStep; ts < t0 + 2 * kStep && ts <= k1; ts += 16) {
      const char* next = reinterpret_cast<const char*>(tile_base(ts));
      // Into L2: into L1 the next tiles evict the ones being read.
      for (int64_t b = 0; b < tile_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int u = 0; u < n; ++u) {
        const uint16_t* V = slots[u] + (2 * h + 1) * D;
        for (int j = 0; j < 16; j += 2) {  // keys outside [lo, hi] pair as 0 (their slots: anything)
          for (int64_t c = 0; c < C; ++c) {
            const __m512i a = (j >= lo[u] && j <= hi[u])
                ? _mm512_loadu_si512(V + j * row_stride + 32 * c) : _mm512_setzero_si512();
            const __m512i b = (j + 1 >= lo[u] && j + 1 <= hi[u])
                ? _mm512_loadu_si512(V + (j + 1) * row_stride + 32 * c) : _mm512_setzero_si512();
            vp[(u * 8 + j / 2) * NV + 2 * c] = _mm512_unpacklo_epi16(a, b);
            vp[(u * 8 + j / 2) * NV + 2 * c + 1] = _mm512_unpackhi_epi16(a, b);
          }
        }
      }
      for (int64_t i = 0; i < G; ++i) {
        const int64_t r = h * G + i;
        const uint32_t* qr = qb.data() + r * D / 2;
        __m512 s[kSub];
        __m512 smax = neg_inf;
        for (int u = 0; u < n; ++u) {
          const uint16_t* K = slots[u] + 2 * h * D;
          __m512 a[16];
          for (int j = 0; j < 16; ++j) {
            a[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; ++c)
              a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(qr + 16 * c),
                                      (__m512bh)_mm512_loadu_si512(K + j * row_stride + 32 * c));
          }
          s[u] = _mm512_mul_ps(hsum16(a), _mm512_set1_ps(p.scale));
          if (p.soft_cap > 0.0f) s[u] = soft_cap16(s[u], p.soft_cap);
          s[u] = _mm512_mask_blend_ps(valid[u], neg_inf, s[u]);
          smax = _mm512_max_ps(smax, s[u]);
        }
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(smax));
        const float alpha = std::exp(m[r] - m_new);  // 0 for the first step (m = -inf)
        const __m512 mv = _mm512_set1_ps(m_new);
        alignas(32) uint32_t w[kSub][8];  // the weights of keys (2k, 2k+1) as a bf16 pair
        __m512 lsum = _mm512_setzero_ps();
        for (int u = 0; u < n; ++u) {
          const __m512 e = _mm512_maskz_mov_ps(valid[u], exp16(_mm512_sub_ps(s[u], mv)));
          lsum = _mm512_add_ps(lsum, e);
          _mm256_store_si256(reinterpret_cast<__m256i*>(w[u]), (__m256i)_mm512_cvtneps_pbh(e));
        }
        l[r] = l[r] * alpha + _mm512_reduce_add_ps(lsum);
        m[r] = m_new;
        float* o = acc.data() + r * D;
        // Two sets of accumulators (even and odd key pairs): twice the independent chains.
        __m512 ov[2][2 * (kMaxBf16D / 32)];
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t v = 0; v < NV; ++v) {
          ov[0][v] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * v), av);
          ov[1][v] = _mm512_setzero_ps();
        }
        for (int u = 0; u < n; ++u)
          for (int k = lo[u] / 2; k <= hi[u] / 2; ++k) {
            const __m512bh wk = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[u][k]));
            const __m512i* vk = vp + (u * 8 + k) * NV;
            for (int64_t v = 0; v < NV; ++v)
              ov[k & 1][v] = _mm512_dpbf16_ps(ov[k & 1][v], wk, (__m512bh)vk[v]);
          }
        for (int64_t v = 0; v < NV; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_add_ps(ov[0][v], ov[1][v]));
      }
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < G; ++i) {
      const int64_t r = h * G + i;
      out[h].m[i] = m[r];
      out[h].l[i] = l[r];
      const float* o = acc.data() + r * D;
      for (int64_t v = 0; v < NV; ++v)
        for (int lane = 0; lane < 16; ++lane)
          out[h].acc[i * D + 32 * (v / 2) + 8 * (lane / 4) + 4 * (v % 2) + lane % 4] = o[16 * v + lane];
    }
}

template <typename T>
ffi::Error Run(const Params& p, const float* q, const T* cache, const int32_t* tables,
               int64_t num_seqs, const int32_t* row_seq, const int32_t* row_pos, int64_t rows,
               bool bf16_dots, float* out) {
  const int64_t G = p.group, D = p.D, H = p.kvh;
  // Partials (row, chunk of kChunkKeys keys at absolute multiples of kChunkKeys, kv head).
  std::vector<int64_t> first(rows), ends(rows);
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = row_pos[r];
    first[r] = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    total += (pos / kChunkKeys - first[r] / kChunkKeys + 1) * H;
    ends[r] = total;
  }
  const int64_t stride = G * (D + 2);
  std::vector<float> scratch(static_cast<size_t>(total * stride));
  auto partial = [&](int64_t item) {
    float* base = scratch.data() + item * stride;
    return Partial{base, base + G, base + 2 * G};
  };
  try {  // no C++ exception may cross the FFI boundary
    // One work item per (row, chunk); its heads' partials are items c * H + h of the row.
    kernels_pallas::Pool::get().run(total / H, [&](int64_t item) {
      const int64_t r = std::upper_bound(ends.begin(), ends.end(), item * H) - ends.begin();
      const int64_t begin = r ? ends[r - 1] : 0, c = item - begin / H;
      const int64_t c0 = first[r] / kChunkKeys + c;
      const int64_t k0 = std::max(first[r], c0 * kChunkKeys);
      const int64_t k1 = std::min<int64_t>(row_pos[r], (c0 + 1) * kChunkKeys - 1);
      const int64_t s = std::clamp<int64_t>(row_seq[r], 0, num_seqs - 1);
      Partial parts[kMaxHeads];
      for (int64_t h = 0; h < H; ++h) parts[h] = partial(item * H + h);
      const int32_t* table = tables + s * p.pages_per_seq;
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (bf16_dots) return attend_bf16(p, cache, table, q + r * H * G * D, k0, k1, parts);
      }
      attend(p, cache, table, q + r * H * G * D, k0, k1, parts);
    });
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("paged_decode_attention: ") + e.what());
  }
  // Merge each (row, head)'s chunks: items of chunk c of head h sit at ends[r-1] + c*H + h.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t begin = r ? ends[r - 1] : 0, chunks = (ends[r] - begin) / H;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < G; ++i) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) m = std::max(m, partial(begin + c * H + h).m[i]);
        float l = 0.0f;
        float* o = out + ((r * H + h) * G + i) * D;
        std::fill(o, o + D, 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const Partial pc = partial(begin + c * H + h);
          const float f = std::exp(pc.m[i] - m);
          l += pc.l[i] * f;
          for (int64_t d = 0; d < D; ++d) o[d] += pc.acc[i * D + d] * f;
        }
        if (p.sinks) l += std::exp(p.sinks[h * G + i] - m);  // reference.py: sink_denominator
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                      ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> row_seq,
                      ffi::Buffer<ffi::S32> row_pos, ffi::Buffer<ffi::S32> num_rows,
                      ffi::Buffer<ffi::F32> sinks,
                      float sm_scale, float soft_cap, int64_t sliding_window, bool bf16_dots,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = cache.dimensions(), td = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || cd[2] % 2 != 0 || cd[3] != qd[2])
    return ffi::Error::InvalidArgument(
        "paged_decode_attention: q [R, qh, D], cache [pages, page_size, 2 * kvh, D], "
        "page_indices [S, P]");
  Params p{cd[0], cd[1], td[1], cd[2] / 2, 0, qd[2], sm_scale, soft_cap, sliding_window,
           sinks.element_count() ? sinks.typed_data() : nullptr};
  // Element counts are size_t, dimensions int64_t: compared as int64_t.
  const auto count = [](const auto& buffer) { return static_cast<int64_t>(buffer.element_count()); };
  if (count(sinks) != 0 && count(sinks) != qd[1])
    return ffi::Error::InvalidArgument("paged_decode_attention: sinks must be [num_q_heads]");
  if (p.kvh == 0 || qd[1] % p.kvh != 0 || qd[1] / p.kvh > kMaxGroup || p.kvh > kMaxHeads || p.D % 8 != 0 ||
      kChunkKeys % p.page_size != 0 || p.page_size % 8 != 0 || count(row_seq) != qd[0] ||
      count(row_pos) != qd[0] || count(num_rows) != 1)
    return ffi::Error::InvalidArgument("paged_decode_attention: unsupported shapes");
  p.group = qd[1] / p.kvh;
  if (bf16_dots && (cache.element_type() == ffi::DataType::F32 || p.D % 32 != 0 || p.D > kMaxBf16D ||
                    p.page_size % 16 != 0 || paged_decode_attention_supported() != 2))
    return ffi::Error::InvalidArgument(
        "paged_decode_attention: bf16_dots needs a bfloat16 cache, head_dim a multiple of 32 "
        "(at most 256), pages of a multiple of 16 tokens and a CPU with AVX512-BF16");
  const int64_t R = qd[0];
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, R);
  float* o = out->typed_data();
  std::fill(o + rows * qd[1] * p.D, o + R * qd[1] * p.D, 0.0f);  // rows past the real ones
  switch (cache.element_type()) {
    case ffi::DataType::F32:
      return Run(p, q.typed_data(), static_cast<const float*>(cache.untyped_data()),
                 page_indices.typed_data(), td[0], row_seq.typed_data(), row_pos.typed_data(),
                 rows, false, o);
    case ffi::DataType::BF16:
    case ffi::DataType::U16:  // bf16 bits (kernels_pallas/kv_cache.py: as_bits)
      return Run(p, q.typed_data(), static_cast<const uint16_t*>(cache.untyped_data()),
                 page_indices.typed_data(), td[0], row_seq.typed_data(), row_pos.typed_data(),
                 rows, bf16_dots, o);
    default:
      return ffi::Error::InvalidArgument("paged_decode_attention: cache must be float32 or bfloat16 (or its bits)");
  }
}

}  // namespace

// 1: AVX2/FMA (float32 dots); 2: and AVX-512 with AVX512-BF16 (bf16 dots over a bf16 cache).
extern "C" int paged_decode_attention_supported() {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512bf16")
             ? 2 : 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeAttentionCpu, DecodeImpl,
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
                                  .Attr<bool>("bf16_dots")
                                  .Ret<ffi::Buffer<ffi::F32>>());
