"""Paged decode attention for CPUs: a small C++ kernel that reads K/V blocks in place.

NOTE: why a kernel. The torch path gathers every decode's K/V blocks into a padded batch
(`index_select`, a full copy per layer), then runs SDPA on it: at 64 sequences that is
about 20 ms of copies plus 22 ms of SDPA per step on the 2-core reference machine. This
kernel walks each sequence's block table and reads keys and values where they lie, once.

For each sequence, in parallel: every query head takes its scores against every context
position of its KV head (each token's K and V row, all KV heads, is read once and
contiguously), then a softmax and the weighted sum of values, all in float32. Each sequence is computed alone, so a sequence's output
does not depend on what else is in the batch. With bfloat16 caches on a CPU with AVX-512
BF16 (`one_sequence_bf16`) the key dots run on the bf16 rows directly and the value rows are
widened in registers: a step's cost per context token at 64 sequences fell from 0.154 to
0.085-0.116 ms (benchmarks/decode_context.py, docs/benchmarks.md).

The kernel is compiled with the lean step as one extension (model/kernels.py: at install
time, or on first use). If that fails, or with TIERSERVE_NO_KERNELS=1, `kernels.load()`
returns None and the model uses the torch path.
"""

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <math.h>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static inline float to_float(float x) { return x; }
static inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
static inline float to_float(at::Half x) { return static_cast<float>(x); }

// Widen n values to float32. The bf16 case is a plain shift of the raw bits, written so
// the compiler vectorizes it.
template <typename T>
static inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
static inline void widen(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
static inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

// Softmax of each of g rows of L scores, in place.
static inline void softmax_rows(float* scores, int64_t g, int64_t L) {
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * L;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sj[t]);
    for (int64_t t = 0; t < L; ++t) sj[t] = expf(sj[t] - mx);
    for (int64_t t = 0; t < L; ++t) sum += sj[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) sj[t] *= inv;
  }
}

// One sequence, head dim D fixed at compile time so the per-head accumulators stay in
// vector registers. Loop order: per KV head, per token: widen K (or V) once, use it for
// the g query heads that share it.
template <typename T, int D>
static void one_sequence(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t L,
                         T* out, int64_t H, int64_t Hkv, int64_t bs, float scale,
                         float* scores, float* kf) {
  const int64_t g = H / Hkv, row = Hkv * D;
  for (int64_t h = 0; h < Hkv; ++h) {
    float qf[8][D];  // g <= 8 query heads per KV head
    for (int64_t j = 0; j < g; ++j)
      for (int x = 0; x < D; ++x) qf[j][x] = to_float(q[(h * g + j) * D + x]) * scale;
    for (int64_t t = 0; t < L; ++t) {
      const T* k = kc + (table[t / bs] * bs + t % bs) * row + h * D;
      widen(k, kf, D);
      for (int64_t j = 0; j < g; ++j) {
        float dot = 0.f;
        for (int x = 0; x < D; ++x) dot += qf[j][x] * kf[x];
        scores[j * L + t] = dot;
      }
    }
    softmax_rows(scores, g, L);
    float acc[8][D] = {};
    for (int64_t t = 0; t < L; ++t) {
      const T* v = vc + (table[t / bs] * bs + t % bs) * row + h * D;
      widen(v, kf, D);
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * L + t];
        for (int x = 0; x < D; ++x) acc[j][x] += p * kf[x];
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int x = 0; x < D; ++x) out[(h * g + j) * D + x] = static_cast<T>(acc[j][x]);
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 with AVX-512 BF16, in registers: each key row is dotted with the
// query heads by vdpbf16ps (products of two bf16 numbers are exact; sums in float32, as
// above) with no widened copy, and each value row is widened once in registers for all g
// heads. The scale multiplies the dot instead of the query. At 64 sequences of ~190
// tokens the portable loop above took ~27 ms of a 100 ms step (2-core EPYC).
template <int D>
static void one_sequence_bf16(const at::BFloat16* q, const at::BFloat16* kc,
                              const at::BFloat16* vc, const int64_t* table, int64_t L,
                              at::BFloat16* out, int64_t H, int64_t Hkv, int64_t bs,
                              float scale, float* scores) {
  constexpr int KV = D / 32, VV = D / 16;  // vectors of 32 bf16 / 16 floats per row
  const int64_t g = H / Hkv, row = Hkv * D;
  for (int64_t h = 0; h < Hkv; ++h) {
    __m512bh qv[8][KV];
    for (int64_t j = 0; j < g; ++j)
      for (int v = 0; v < KV; ++v)
        qv[j][v] = (__m512bh)_mm512_loadu_si512(q + (h * g + j) * D + 32 * v);
    for (int64_t t = 0; t < L; ++t) {
      const at::BFloat16* k = kc + (table[t / bs] * bs + t % bs) * row + h * D;
      __m512bh kv[KV];
      for (int v = 0; v < KV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(k + 32 * v);
      for (int64_t j = 0; j < g; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int v = 0; v < KV; ++v) a = _mm512_dpbf16_ps(a, qv[j][v], kv[v]);
        scores[j * L + t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    softmax_rows(scores, g, L);
    __m512 acc[8][VV];
    for (int64_t j = 0; j < g; ++j)
      for (int u = 0; u < VV; ++u) acc[j][u] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const at::BFloat16* v = vc + (table[t / bs] * bs + t % bs) * row + h * D;
      __m512 vf[VV];
      for (int u = 0; u < VV; ++u)
        vf[u] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(v + 16 * u)));
      for (int64_t j = 0; j < g; ++j) {
        const __m512 p = _mm512_set1_ps(scores[j * L + t]);
        for (int u = 0; u < VV; ++u) acc[j][u] = _mm512_fmadd_ps(p, vf[u], acc[j][u]);
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int u = 0; u < VV; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (h * g + j) * D + 16 * u),
                            (__m256i)_mm512_cvtneps_pbh(acc[j][u]));
  }
}
#endif

template <typename T, int D>
static void run(const T* q, const T* kc, const T* vc, const int64_t* tables,
                const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t bs,
                int64_t width, float scale) {
  int64_t max_len = 0;
  for (int64_t s = 0; s < B; ++s) max_len = std::max(max_len, lens[s]);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(8 * max_len), kf(D);
    for (int64_t s = begin; s < end; ++s) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same<T, at::BFloat16>::value) {
        one_sequence_bf16<D>(q + s * H * D, kc, vc, tables + s * width, lens[s],
                             out + s * H * D, H, Hkv, bs, scale, scores.data());
        continue;
      }
#endif
      one_sequence<T, D>(q + s * H * D, kc, vc, tables + s * width, lens[s], out + s * H * D,
                         H, Hkv, bs, scale, scores.data(), kf.data());
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 8, "need num_heads / num_kv_heads <= 8");
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto go = [&](auto dim) {
      run<scalar_t, decltype(dim)::value>(
          q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
          block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
          out.data_ptr<scalar_t>(), B, H, Hkv, bs, width, static_cast<float>(scale));
    };
    if (d == 64) go(std::integral_constant<int, 64>{});
    else go(std::integral_constant<int, 128>{});
  });
  return out;
}
"""

def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel is compiled for."""
    return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8 \
        and head_dim in (64, 128)


def paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [D, H, d]; caches [blocks, block_size, Hkv, d]; tables [D, width]; lens [D]."""
    return kernel.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens,
                               q.shape[-1] ** -0.5)
