"""Paged decode attention for CPUs: a small C++ kernel that reads K/V blocks in place.

NOTE: why a kernel. The torch path gathers every decode's K/V blocks into a padded batch
(`index_select`, a full copy per layer), then runs SDPA on it: at 64 sequences that is
about 20 ms of copies plus 22 ms of SDPA per step on the 2-core reference machine. This
kernel walks each sequence's block table and reads keys and values where they lie, once.

For each sequence, in parallel (for each of its KV heads, when there are fewer sequences
than twice the threads): every query head takes its scores against every context position
of its KV head, then a softmax and the weighted sum of values, all in float32. Each
sequence is computed alone, so a sequence's output does not depend on what else is in the
batch. A head's keys and values are short pieces of each position's row, so the kernel
asks for them 64 positions before it reads them (16 on AVX2), into L2 (`Prefetcher`). With bfloat16
caches on a CPU with AVX-512 BF16 (`one_sequence_bf16`) the key dots run on the bf16
rows directly, 16 positions at a time, and the values of two positions are summed per
instruction with the probabilities in bfloat16: a step's cost per context token at 64 sequences fell from 0.154 to
0.085-0.116 ms with the first, and each layer's attention by another 20% with the second
(docs/benchmarks.md).

The 8-bit cache (`--kv-cache-dtype int8`: int8 rows, a float32 scale per position and KV
head) has its own loops on integer dot products (`one_sequence_i8`, AVX-512 VNNI): a
step's attention at 64 sequences took 0.68-0.89 of the bf16 kernel's time
(benchmarks/decode_attention.py); elsewhere the AVX2 loops or the scalar one read it.

On a CPU with AVX2 and without AVX-512 BF16 (a Zen 3; an AVX-512 Xeon before Cooper Lake)
bfloat16 and float32 queries over their own dtype's cache or the 8-bit one go to
`run_avx2`: 8-lane float32 vectors, and work items of
(sequence, KV head, 256 positions) combined as flash-decoding combines them, so that one
long sequence is shared by the threads and a chunk's values are asked for while its keys
are read. The 30 layers' attention of a lone sequence at 512 positions, read cold, took
0.43-0.49 of the scalar loop's time, and the 8-bit cache's at 64 sequences 0.37-0.58
(2-core EPYC Zen 3). About 750 lines: the C++ is one
string, four variants of one algorithm (scalar, bf16, int8, AVX2) whose
instruction-level differences are the point of each.

The kernel is compiled with the lean step as one extension (model/kernels.py: at install
time, or on first use). If that fails, or with TIERSERVE_NO_KERNELS=1, `kernels.load()`
returns None and the model uses the torch path.
"""

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512BF16__)
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

// L scores replaced by exp(score - their max), in place; the max and the sum returned
// (softmax's numerators: run_avx2 combines chunks of a row from these).
static inline void exp_shifted(float* s, int64_t L, float* max, float* sum) {
  float mx = -INFINITY, total = 0.f;
  for (int64_t t = 0; t < L; ++t) mx = std::max(mx, s[t]);
  for (int64_t t = 0; t < L; ++t) s[t] = expf(s[t] - mx);
  for (int64_t t = 0; t < L; ++t) total += s[t];
  *max = mx;
  *sum = total;
}

// Softmax of each of g rows of L scores, in place.
static inline void softmax_rows(float* scores, int64_t g, int64_t L) {
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * L;
    float mx, sum;
    exp_shifted(sj, L, &mx, &sum);
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) sj[t] *= inv;
  }
}

// d values as int8 on one symmetric scale, returned: the largest magnitude / 127, each
// value rounded to the nearest step. The 8-bit KV cache's format (cpu_step's store_head)
// and the int8 kernel's query rounding.
template <typename T>
static inline float quantize_i8(const T* x, int8_t* dst, int64_t d) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < d; ++i)
    dst[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inv));
  return amax / 127.f;
}

// One sequence, head dim D fixed at compile time so the per-head accumulators stay in
// vector registers. Loop order: per KV head, per token: widen K (or V) once, use it for
// the g query heads that share it.
// C: the cache's element type, T's own or int8_t with a scale per position and KV head in
// ks / vs (null for T's).
template <typename T, typename C, int D>
static void one_sequence(const T* q, const C* kc, const C* vc, const float* ks,
                         const float* vs, const int64_t* table, int64_t L, T* out, int64_t H,
                         int64_t Hkv, int64_t bs, float scale, float* scores, float* kf,
                         int64_t h0, int64_t h1) {
  const int64_t g = H / Hkv, row = Hkv * D;
  for (int64_t h = h0; h < h1; ++h) {
    float qf[8][D];  // g <= 8 query heads per KV head
    for (int64_t j = 0; j < g; ++j)
      for (int x = 0; x < D; ++x) qf[j][x] = to_float(q[(h * g + j) * D + x]) * scale;
    int64_t blk = 0, off = 0;
    for (int64_t t = 0; t < L; ++t) {
      const int64_t pos = table[blk] * bs + off;
      if (++off == bs) { off = 0; ++blk; }
      widen(kc + pos * row + h * D, kf, D);
      const float ksc = ks ? ks[pos * Hkv + h] : 1.f;
      for (int64_t j = 0; j < g; ++j) {
        float dot = 0.f;
        for (int x = 0; x < D; ++x) dot += qf[j][x] * kf[x];
        scores[j * L + t] = dot * ksc;
      }
    }
    softmax_rows(scores, g, L);
    float acc[8][D] = {};
    blk = off = 0;
    for (int64_t t = 0; t < L; ++t) {
      const int64_t pos = table[blk] * bs + off;
      if (++off == bs) { off = 0; ++blk; }
      widen(vc + pos * row + h * D, kf, D);
      const float vsc = vs ? vs[pos * Hkv + h] : 1.f;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * L + t] * vsc;
        for (int x = 0; x < D; ++x) acc[j][x] += p * kf[x];
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int x = 0; x < D; ++x) out[(h * g + j) * D + x] = static_cast<T>(acc[j][x]);
  }
}

#if defined(__AVX2__)
// Eight values as float32: the AVX2 attention's rows here, cpu_quant's x and scales (this
// source is the extension's first part).
static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
static inline __m256 load8(const at::BFloat16* x) {   // bf16 -> float32: a shift, exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
#endif

#if defined(__AVX2__) || defined(__AVX512BF16__)
// A cursor over a sequence's positions in a paged cache that asks for each position's head
// slice (D values) before it is read, Ahead positions before (walking the block table as the
// reads do, without a division per position). A head's keys and values are short strided
// pieces of each position's row (128 of 384 bytes for SmolLM2) scattered over the blocks:
// without it, at 600 tokens of context, the attention of 30 layers read its 14 MB at
// 14 GB/s, four times a layer's time alone (2-core EPYC Zen 5). Into L2, not L1, and 64
// positions ahead: with 32 into L1 a 2-core Zen 4 read the caches of 30 layers at 1.6-2.0
// us per context token and step whatever the batch (13 GB/s of its 55); into L2 it took
// 0.60-0.75 of that time at 2-64 sequences (0.64 at 64 x 190 tokens; 32 or 128 ahead, or
// the L3 hint, no better; whole rows for every head at once, worse). An L1 hint fills the
// small L1 with lines needed only 32 positions later, probably pushing out ones in use.
// The AVX2 loops (chunk_avx2: a Zen 3, or an AVX-512 CPU without BF16) 16 instead.
constexpr int64_t AHEAD = 64;
// chunk_avx2's distance. Each work item starts by asking for its first positions at once;
// on a 2-core EPYC Zen 3 every distance under 64 read the caches faster than 64
// (benchmarks/kernel_ab.py --part attention, 30 layers read cold; 16 against 64: 0.71 at
// one sequence of 128 tokens, 0.96-0.97 at one of 512 or 1,024, 0.87 at 16 x 128, 0.91 at
// 64 x 256; 4, 8 and 32, measured at fewer sizes, within a few percent of 16 either way;
// docs/benchmarks.md). Not measured on an AVX-512 CPU without BF16.
constexpr int64_t AHEAD_AVX2 = 16;
// E: the cache's element type (bfloat16 or float32, or int8_t for the 8-bit cache, whose scales, one
// float per position and KV head, are asked for a block at a time).
template <int D, typename E, int64_t Ahead = AHEAD>
struct Prefetcher {
  const char* base;
  const char* scales;
  const int64_t* table;
  int64_t L, bs, row_bytes, block_scale_bytes, t = 0, blk = 0, off = 0;
  Prefetcher(const E* cache, const float* scales, const int64_t* table, int64_t L, int64_t bs,
             int64_t row, int64_t h)
      : base(reinterpret_cast<const char*>(cache + h * D)),
        scales(reinterpret_cast<const char*>(scales)), table(table), L(L), bs(bs),
        row_bytes(row * sizeof(E)), block_scale_bytes(bs * (row / D) * 4) {
    for (int64_t i = 0; i < Ahead; ++i) next();
  }
  inline void next() {   // the next position: ask for it, move on
    if (t >= L) return;
    const char* p = base + (table[blk] * bs + off) * row_bytes;
    for (int l = 0; l < D * static_cast<int>(sizeof(E)); l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
    if (scales && off == 0)
      for (int64_t l = 0; l < block_scale_bytes; l += 64)
        _mm_prefetch(scales + table[blk] * block_scale_bytes + l, _MM_HINT_T1);
    ++t;
    if (++off == bs) { off = 0; ++blk; }
  }
};

#endif

#if defined(__AVX512BF16__)
// The sum of each of 16 vectors: lane i of the result is the sum of v[i]'s lanes. A tree of
// in-register shuffles (4 levels, 45 instructions for 16 sums) instead of a horizontal
// reduction per vector (about 8 each).
static inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // quarters: [a(q0+q2), a(q1+q3), b(q0+q2), b(q1+q3)]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter m: 4 partial sums of v[4i + m]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  // lane 4m + j holds the sum of v[4j + m]
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x44), _mm512_shuffle_ps(z0, z1, 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// Round n floats to bfloat16 bits (nearest even, as c10 does for finite values).
static inline void to_bf16_bits(const float* src, uint16_t* dst, int64_t n) {
  int64_t t = 0;
  for (; t + 32 <= n; t += 32)
    _mm512_storeu_si512(dst + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + t + 16),
                                                              _mm512_loadu_ps(src + t)));
  const uint32_t* raw = reinterpret_cast<const uint32_t*>(src);
  for (; t < n; ++t)
    dst[t] = static_cast<uint16_t>((raw[t] + 0x7FFFu + ((raw[t] >> 16) & 1u)) >> 16);
}

// 32 output dimensions from the two accumulators of a value loop that summed two
// positions' rows interleaved by 16-bit unpacks ([0]: dims {0-3, 8-11, 16-19, 24-27}, [1]:
// the rest), put back in order and rounded to bfloat16 at `o`.
static inline void store_pair_sums(__m512 a, __m512 b, at::BFloat16* o) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, lo, b)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, hi, b)));
}

// The same for bfloat16 with AVX-512 BF16, in registers (products of two bf16 numbers are
// exact; sums in float32). Keys: 16 positions at a time, each dotted with a query head by
// vdpbf16ps, the 16 dots summed by sum16. Values: two positions' rows interleaved by
// 16-bit unpacks, so one vdpbf16ps adds p_t v_t + p_t+1 v_t+1 for 16 dimensions, with the
// probabilities rounded to bfloat16 (as the output is). The block table is walked, not
// divided into per position. At 64 sequences of ~190 tokens on a 2-core EPYC (Zen 4) a
// layer took 0.46 ms, against 0.36 here (0.33 and 0.26 with the cache warm).
template <int D>
static void one_sequence_bf16(const at::BFloat16* q, const at::BFloat16* kc,
                              const at::BFloat16* vc, const int64_t* table, int64_t L,
                              at::BFloat16* out, int64_t H, int64_t Hkv, int64_t bs,
                              float scale, float* scores, uint16_t* probs, int64_t h0,
                              int64_t h1) {
  constexpr int KV = D / 32;  // vectors of 32 bf16 per row
  const int64_t g = H / Hkv, row = Hkv * D;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t h = h0; h < h1; ++h) {
    __m512bh qv[8][KV];
    for (int64_t j = 0; j < g; ++j)
      for (int v = 0; v < KV; ++v)
        qv[j][v] = (__m512bh)_mm512_loadu_si512(q + (h * g + j) * D + 32 * v);
    int64_t blk = 0, off = 0;
    Prefetcher<D, at::BFloat16> kpf(kc, nullptr, table, L, bs, row, h);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
      const at::BFloat16* kp[16];
      for (int i = 0; i < n; ++i) {
        kp[i] = kc + (table[blk] * bs + off) * row + h * D;
        if (++off == bs) { off = 0; ++blk; }
        kpf.next();
      }
      for (int64_t j = 0; j < g; ++j) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) {
          a[i] = _mm512_setzero_ps();
          if (i < n)
            for (int v = 0; v < KV; ++v)
              a[i] = _mm512_dpbf16_ps(a[i], qv[j][v], (__m512bh)_mm512_loadu_si512(kp[i] + 32 * v));
        }
        _mm512_mask_storeu_ps(scores + j * L + t0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(sum16(a), sc));
      }
    }
    softmax_rows(scores, g, L);
    for (int64_t j = 0; j < g; ++j) {
      to_bf16_bits(scores + j * L, probs + j * (L + 2), L);
      probs[j * (L + 2) + L] = 0;  // an odd last position pairs with a zero row
    }
    __m512 acc[8][2 * KV];  // [2u]: dims 32u + {0-3, 8-11, 16-19, 24-27}; [2u+1]: the rest
    for (int64_t j = 0; j < g; ++j)
      for (int u = 0; u < 2 * KV; ++u) acc[j][u] = _mm512_setzero_ps();
    blk = off = 0;
    Prefetcher<D, at::BFloat16> vpf(vc, nullptr, table, L, bs, row, h);
    for (int64_t t = 0; t < L; t += 2) {
      vpf.next();
      vpf.next();
      __m512i a[KV], b[KV];
      const at::BFloat16* v0 = vc + (table[blk] * bs + off) * row + h * D;
      if (++off == bs) { off = 0; ++blk; }
      for (int u = 0; u < KV; ++u) a[u] = _mm512_loadu_si512(v0 + 32 * u);
      if (t + 1 < L) {
        const at::BFloat16* v1 = vc + (table[blk] * bs + off) * row + h * D;
        if (++off == bs) { off = 0; ++blk; }
        for (int u = 0; u < KV; ++u) b[u] = _mm512_loadu_si512(v1 + 32 * u);
      } else {
        for (int u = 0; u < KV; ++u) b[u] = _mm512_setzero_si512();
      }
      __m512bh pairs[2 * KV];
      for (int u = 0; u < KV; ++u) {
        pairs[2 * u] = (__m512bh)_mm512_unpacklo_epi16(a[u], b[u]);
        pairs[2 * u + 1] = (__m512bh)_mm512_unpackhi_epi16(a[u], b[u]);
      }
      for (int64_t j = 0; j < g; ++j) {
        int32_t p2;
        std::memcpy(&p2, probs + j * (L + 2) + t, sizeof(p2));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(p2);
        for (int u = 0; u < 2 * KV; ++u) acc[j][u] = _mm512_dpbf16_ps(acc[j][u], pairs[u], p);
      }
    }
    for (int64_t j = 0; j < g; ++j)
      for (int u = 0; u < KV; ++u)
        store_pair_sums(acc[j][2 * u], acc[j][2 * u + 1], out + (h * g + j) * D + 32 * u);
  }
}
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The 8-bit cache (int8 rows, a float32 scale per position and KV head) on integer dot
// products (AVX-512 VNNI). Keys: each query head rounded to int8 with its own scale, and
// each key row's bytes read as unsigned by flipping their sign bit (k + 128, what vpdpbusd
// multiplies), so one instruction takes a position's 64-byte dot with a query head; the
// 128 * sum(q) it adds is taken off after the 16 dots are summed (exact in float32: every
// partial sum is an integer below 2^24). Values: the probabilities times each position's
// value scale, as int16 on a scale per query head that keeps 127 * their sum below 2^31,
// and the rows widened to int16, so vpdpwssd adds p_t v_t + p_t+1 v_t+1 for 16 dimensions
// (two positions interleaved, as the bfloat16 kernel does). Per position and head this is
// about as many instructions as the bfloat16 kernel, on half the bytes.
template <int D>
static void one_sequence_i8(const at::BFloat16* q, const int8_t* kc, const int8_t* vc,
                            const float* ks, const float* vs, const int64_t* table, int64_t L,
                            at::BFloat16* out, int64_t H, int64_t Hkv, int64_t bs, float scale,
                            float* scores, int16_t* probs, float* vscale, int64_t h0,
                            int64_t h1) {
  constexpr int K8 = D / 64;   // vectors of 64 int8 per row
  constexpr int K16 = D / 32;  // vectors of 32 int16 per row
  const int64_t g = H / Hkv, row = Hkv * D;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t h = h0; h < h1; ++h) {
    __m512i qv[8][K8];
    float qscale[8];
    __m512 qcorr[8];
    for (int64_t j = 0; j < g; ++j) {
      alignas(64) int8_t q8[D];
      qscale[j] = quantize_i8(q + (h * g + j) * D, q8, D) * scale;
      int32_t sum = 0;
      for (int x = 0; x < D; ++x) sum += q8[x];
      for (int v = 0; v < K8; ++v) qv[j][v] = _mm512_load_si512(q8 + 64 * v);
      qcorr[j] = _mm512_set1_ps(128.f * static_cast<float>(sum));
    }
    int64_t blk = 0, off = 0;
    Prefetcher<D, int8_t> kpf(kc, ks, table, L, bs, row, h);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, L - t0));
      __m512i kr[16][K8];
      float ksc[16] = {};
      for (int i = 0; i < n; ++i) {
        const int64_t pos = table[blk] * bs + off;
        if (++off == bs) { off = 0; ++blk; }
        for (int v = 0; v < K8; ++v)
          kr[i][v] = _mm512_xor_si512(_mm512_loadu_si512(kc + pos * row + h * D + 64 * v), flip);
        ksc[i] = ks[pos * Hkv + h];
        kpf.next();
      }
      const __m512 kscale = _mm512_loadu_ps(ksc);
      for (int64_t j = 0; j < g; ++j) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) {
          __m512i acc = _mm512_setzero_si512();
          if (i < n)
            for (int v = 0; v < K8; ++v) acc = _mm512_dpbusd_epi32(acc, kr[i][v], qv[j][v]);
          a[i] = _mm512_cvtepi32_ps(acc);
        }
        const __m512 dots = _mm512_sub_ps(sum16(a), qcorr[j]);
        _mm512_mask_storeu_ps(scores + j * L + t0, static_cast<__mmask16>((1u << n) - 1),
                              _mm512_mul_ps(_mm512_mul_ps(dots, kscale),
                                            _mm512_set1_ps(qscale[j])));
      }
    }
    softmax_rows(scores, g, L);
    blk = off = 0;
    for (int64_t t = 0; t < L; ++t) {
      vscale[t] = vs[(table[blk] * bs + off) * Hkv + h];
      if (++off == bs) { off = 0; ++blk; }
    }
    float unscale[8];
    for (int64_t j = 0; j < g; ++j) {
      float* sj = scores + j * L;
      float top = 0.f, sum = 0.f;
      for (int64_t t = 0; t < L; ++t) {
        sj[t] *= vscale[t];
        top = std::max(top, sj[t]);
        sum += sj[t];
      }
      const float S = top > 0.f ? std::min(32767.f / top, 0.99f * 2147483648.f / (127.f * sum))
                                : 0.f;
      int16_t* pj = probs + j * (L + 2);
      for (int64_t t = 0; t < L; ++t) pj[t] = static_cast<int16_t>(std::nearbyint(sj[t] * S));
      pj[L] = 0;  // an odd last position pairs with a zero row
      unscale[j] = S > 0.f ? 1.f / S : 0.f;
    }
    __m512i acc[8][2 * K16];  // [2u]: dims 32u + {0-3, 8-11, 16-19, 24-27}; [2u+1]: the rest
    for (int64_t j = 0; j < g; ++j)
      for (int u = 0; u < 2 * K16; ++u) acc[j][u] = _mm512_setzero_si512();
    blk = off = 0;
    Prefetcher<D, int8_t> vpf(vc, nullptr, table, L, bs, row, h);   // (vs read above)
    for (int64_t t = 0; t < L; t += 2) {
      vpf.next();
      vpf.next();
      __m512i a[K16], b[K16];
      const int8_t* v0 = vc + (table[blk] * bs + off) * row + h * D;
      if (++off == bs) { off = 0; ++blk; }
      for (int u = 0; u < K16; ++u)
        a[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32 * u)));
      if (t + 1 < L) {
        const int8_t* v1 = vc + (table[blk] * bs + off) * row + h * D;
        if (++off == bs) { off = 0; ++blk; }
        for (int u = 0; u < K16; ++u)
          b[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32 * u)));
      } else {
        for (int u = 0; u < K16; ++u) b[u] = _mm512_setzero_si512();
      }
      __m512i pairs[2 * K16];
      for (int u = 0; u < K16; ++u) {
        pairs[2 * u] = _mm512_unpacklo_epi16(a[u], b[u]);
        pairs[2 * u + 1] = _mm512_unpackhi_epi16(a[u], b[u]);
      }
      for (int64_t j = 0; j < g; ++j) {
        int32_t p2;
        std::memcpy(&p2, probs + j * (L + 2) + t, sizeof(p2));
        const __m512i p = _mm512_set1_epi32(p2);
        for (int u = 0; u < 2 * K16; ++u) acc[j][u] = _mm512_dpwssd_epi32(acc[j][u], pairs[u], p);
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      const __m512 un = _mm512_set1_ps(unscale[j]);
      for (int u = 0; u < K16; ++u)
        store_pair_sums(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[j][2 * u]), un),
                        _mm512_mul_ps(_mm512_cvtepi32_ps(acc[j][2 * u + 1]), un),
                        out + (h * g + j) * D + 32 * u);
    }
  }
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// CPUs with AVX2 but without AVX-512 BF16 (a Zen 3; an AVX-512 Xeon before Cooper Lake):
// one_sequence's float32 sums on explicit 8-lane vectors, over a cache in q's dtype
// (bfloat16 or float32) or the 8-bit one, in chunks of positions combined at the end
// (run_avx2), asking for each position 16 ahead (Prefetcher, AHEAD_AVX2). The
// scalar loop, without read-ahead, took a tenth of a lone 4-bit decode step at 128-928
// tokens of context, on the calling thread two thirds of it (perf, 2-core EPYC Zen 3).
static inline __m256 load8(const int8_t* x) {   // the 8-bit cache's values, unscaled
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}

// Lane i of the result: the sum of v[i]'s lanes.
static inline __m256 sum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  // [sums of v0-v3's low halves | of their high halves], the same for v4-v7
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Positions of a sequence that one work item reads: a whole number of cache blocks near
// CHUNK_POSITIONS. A long context is split along its positions so that one sequence's
// attention is shared by the threads (with three KV heads, two threads split a lone
// sequence 2:1 by head); the split depends only on the sequence's length and the block
// size, never on the batch, so a sequence's output does not depend on what else runs.
// Each chunk starts with its first rows unasked-for: with the 30 layers' caches read cold
// at one sequence of 512 positions (benchmarks/kernel_ab.py --part attention, 2-core
// EPYC Zen 3) chunks of 64, 128 and 256 took 0.60, 0.49 and 0.43 of the scalar loop's time.
constexpr int64_t CHUNK_POSITIONS = 256;
static inline int64_t chunk_positions(int64_t bs) {
  return std::max<int64_t>(1, CHUNK_POSITIONS / bs) * bs;
}

// One KV head h over L positions (a chunk: `table` starts at its first block). Keys: eight
// positions at a time, each row widened once and dotted with the g query heads (8-lane
// partial sums, then sum8 for the eight positions of a head). Values: each row widened
// once and added to the g heads' sums with exp(score - the chunk's max). part: per query
// head, D sums, then the max and the sum of the exponentials, for run_avx2 to combine.
// C: the cache's element type, T's own or int8_t with a scale per position and KV head in
// ks / vs (null for T's): a key's dots are scaled after the sum, a value's probability
// before.
template <typename T, typename C, int D, int G>
static void chunk_avx2(const T* q, const C* kc, const C* vc, const float* ks, const float* vs,
                       const int64_t* table, int64_t L, int64_t h, int64_t Hkv, int64_t bs,
                       float scale, float* scores, float* part) {
  constexpr int V = D / 8;   // vectors of 8 floats per row
  constexpr int64_t g = G;   // query heads per KV head
  const int64_t row = Hkv * D;
  alignas(32) float qf[G][D];
  for (int64_t j = 0; j < g; ++j)
    for (int x = 0; x < D; ++x) qf[j][x] = to_float(q[(h * g + j) * D + x]) * scale;
  int64_t blk = 0, off = 0;
  Prefetcher<D, C, AHEAD_AVX2> kpf(kc, ks, table, L, bs, row, h);
  // the values are asked for as the keys are read: the chunk's rows are in L2 (2 x 32 KB
  // at 256 positions of 64 bf16) when the value loop reads them (0.58 -> 0.49 of the
  // scalar loop's time, measured as above at chunks of 128)
  Prefetcher<D, C, AHEAD_AVX2> vpf(vc, vs, table, L, bs, row, h);
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, L - t0));
    __m256 dots[G][8];   // [head][position]: 8-lane partial dots
    alignas(32) float ksc[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
    for (int i = 0; i < 8; ++i) {
      __m256 a[G];
      for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
      if (i < n) {
        const int64_t pos = table[blk] * bs + off;
        if (ks) ksc[i] = ks[pos * Hkv + h];
        const C* k = kc + pos * row + h * D;
        if (++off == bs) { off = 0; ++blk; }
        kpf.next();
        vpf.next();
        for (int u = 0; u < V; ++u) {
          const __m256 kv = load8(k + 8 * u);
          for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_load_ps(qf[j] + 8 * u), kv, a[j]);
        }
      }
      for (int j = 0; j < G; ++j) dots[j][i] = a[j];
    }
    const __m256 kscale = _mm256_load_ps(ksc);
    for (int64_t j = 0; j < g; ++j) {
      if (n == 8) {
        _mm256_storeu_ps(scores + j * L + t0, _mm256_mul_ps(sum8(dots[j]), kscale));
        continue;
      }
      alignas(32) float d8[8];
      _mm256_store_ps(d8, _mm256_mul_ps(sum8(dots[j]), kscale));
      std::memcpy(scores + j * L + t0, d8, n * sizeof(float));
    }
  }
  for (int64_t j = 0; j < g; ++j)
    exp_shifted(scores + j * L, L, part + j * (D + 2) + D, part + j * (D + 2) + D + 1);
  // Values, W vectors of 8 dimensions at a time, so that the G heads' sums, a row's W
  // vectors and a probability fit in the 16 registers (G = 3: 17 with W = 4, which
  // spilled); the chunk's rows are read from L2 again after the first pass.
  constexpr int W = G <= 2 ? 4 : (G <= 6 ? 2 : 1);
  for (int d0 = 0; d0 < D; d0 += 8 * W) {
    __m256 acc[G][W];
    for (int j = 0; j < G; ++j)
      for (int u = 0; u < W; ++u) acc[j][u] = _mm256_setzero_ps();
    blk = off = 0;
    for (int64_t t = 0; t < L; ++t) {
      const int64_t pos = table[blk] * bs + off;
      const C* v = vc + pos * row + h * D + d0;
      const float vsc = vs ? vs[pos * Hkv + h] : 1.f;
      if (++off == bs) { off = 0; ++blk; }
      __m256 vv[W];
      for (int u = 0; u < W; ++u) vv[u] = load8(v + 8 * u);
      for (int j = 0; j < G; ++j) {
        const __m256 p = _mm256_set1_ps(scores[j * L + t] * vsc);
        for (int u = 0; u < W; ++u) acc[j][u] = _mm256_fmadd_ps(p, vv[u], acc[j][u]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int u = 0; u < W; ++u) _mm256_storeu_ps(part + j * (D + 2) + d0 + 8 * u, acc[j][u]);
  }
}

// run() on AVX2: work items are (sequence, KV head, chunk of positions), taken by the
// threads in contiguous ranges; then each query head's chunks are combined in order
// (rescaled to the largest max: flash-decoding's reduction).
template <typename T, typename C, int D>
static void run_avx2(const T* q, const C* kc, const C* vc, const float* ks, const float* vs,
                     const int64_t* tables, const int64_t* lens, T* out, int64_t B, int64_t H,
                     int64_t Hkv, int64_t bs, int64_t width, float scale) {
  const int64_t g = H / Hkv, chunk = chunk_positions(bs);
  std::vector<int64_t> first(B + 1, 0);   // each sequence's first item
  for (int64_t s = 0; s < B; ++s)
    first[s + 1] = first[s] + Hkv * std::max<int64_t>(1, (lens[s] + chunk - 1) / chunk);
  std::vector<float> parts(first[B] * g * (D + 2));
  at::parallel_for(0, first[B], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(8 * chunk);
    int64_t s = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first[s + 1]) ++s;
      const int64_t chunks = (first[s + 1] - first[s]) / Hkv, local = item - first[s];
      const int64_t h = local / chunks, t0 = local % chunks * chunk;
      const T* qs = q + s * H * D;
      const int64_t* table = tables + s * width + t0 / bs;
      const int64_t L = std::min(chunk, lens[s] - t0);
      float* part = parts.data() + item * g * (D + 2);
      switch (g) {   // query heads per KV head, known to the compiler: sums in registers
#define TS_G(G) case G: chunk_avx2<T, C, D, G>(qs, kc, vc, ks, vs, table, L, h, Hkv, bs, scale, scores.data(), part); break;
        TS_G(1) TS_G(2) TS_G(3) TS_G(4) TS_G(5) TS_G(6) TS_G(7)
        default: chunk_avx2<T, C, D, 8>(qs, kc, vc, ks, vs, table, L, h, Hkv, bs, scale, scores.data(), part);
#undef TS_G
      }
    }
  });
  at::parallel_for(0, B * Hkv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / Hkv, h = i % Hkv, chunks = (first[s + 1] - first[s]) / Hkv;
      const float* p0 = parts.data() + (first[s] + h * chunks) * g * (D + 2);
      for (int64_t j = 0; j < g; ++j) {
        float top = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, p0[(c * g + j) * (D + 2) + D]);
        alignas(32) float o[D] = {};
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pc = p0 + (c * g + j) * (D + 2);
          const float w = pc[D + 1] > 0.f ? expf(pc[D] - top) : 0.f;
          total += w * pc[D + 1];
          for (int x = 0; x < D; ++x) o[x] += w * pc[x];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int x = 0; x < D; ++x) out[(s * H + h * g + j) * D + x] = static_cast<T>(o[x] * inv);
      }
    }
  });
}
#endif

template <typename T, typename C, int D>
static void run(const T* q, const C* kc, const C* vc, const float* ks, const float* vs,
                const int64_t* tables, const int64_t* lens, T* out, int64_t B, int64_t H,
                int64_t Hkv, int64_t bs, int64_t width, float scale) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
  if constexpr ((std::is_same<T, at::BFloat16>::value || std::is_same<T, float>::value) &&
                (std::is_same<C, T>::value || std::is_same<C, int8_t>::value)) {
    run_avx2<T, C, D>(q, kc, vc, ks, vs, tables, lens, out, B, H, Hkv, bs, width, scale);
    return;
  }
#endif
  int64_t max_len = 0;
  for (int64_t s = 0; s < B; ++s) max_len = std::max(max_len, lens[s]);
  // Queries are taken from both ends in turn (0, B-1, 1, B-2, ...): a speculating decode's
  // queries have growing contexts, and each thread takes a contiguous range. With fewer
  // queries than twice the threads, each (query, KV head) is a work item of its own: one
  // sequence alone kept one core busy and the other idle (a tenth of a lone decode step at
  // 600 tokens of context, perf, 2-core EPYC). A head's output does not depend on which
  // thread computes it.
  const int64_t per = B < 2 * at::get_num_threads() ? 1 : Hkv;   // KV heads per item
  at::parallel_for(0, B * Hkv / per, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(8 * max_len), kf(D), vscale(max_len);
    std::vector<int16_t> probs(8 * (max_len + 2));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item * per / Hkv, h0 = item * per % Hkv, h1 = h0 + per;
      const int64_t s = i % 2 ? B - 1 - i / 2 : i / 2;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same<T, at::BFloat16>::value && std::is_same<C, T>::value) {
        one_sequence_bf16<D>(q + s * H * D, kc, vc, tables + s * width, lens[s],
                             out + s * H * D, H, Hkv, bs, scale, scores.data(),
                             reinterpret_cast<uint16_t*>(probs.data()), h0, h1);
        continue;
      }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if constexpr (std::is_same<T, at::BFloat16>::value && std::is_same<C, int8_t>::value) {
        one_sequence_i8<D>(q + s * H * D, kc, vc, ks, vs, tables + s * width, lens[s],
                           out + s * H * D, H, Hkv, bs, scale, scores.data(), probs.data(),
                           vscale.data(), h0, h1);
        continue;
      }
#endif
#endif
      one_sequence<T, C, D>(q + s * H * D, kc, vc, ks, vs, tables + s * width, lens[s],
                            out + s * H * D, H, Hkv, bs, scale, scores.data(), kf.data(),
                            h0, h1);
    }
  });
}

// Caches [blocks, block_size, Hkv, d] in q's dtype, or int8 with float32 scales
// [blocks, block_size, Hkv] (the 8-bit cache).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           double scale, std::optional<torch::Tensor> k_scales,
                           std::optional<torch::Tensor> v_scales) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 8, "need num_heads / num_kv_heads <= 8");
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == k_scales.has_value() && int8 == v_scales.has_value() &&
              v_cache.scalar_type() == k_cache.scalar_type(),
              "an int8 cache needs its scales, and only it");
  TORCH_CHECK(int8 || k_cache.scalar_type() == q.scalar_type(), "cache and q dtypes differ");
  if (int8)
    TORCH_CHECK(k_scales->scalar_type() == at::kFloat && v_scales->scalar_type() == at::kFloat &&
                k_scales->is_contiguous() && v_scales->is_contiguous() &&
                k_scales->numel() == k_cache.numel() / d && v_scales->numel() == k_scales->numel(),
                "scales: contiguous float32 [blocks, block_size, Hkv]");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto go = [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if (int8)
        run<scalar_t, int8_t, D>(
            q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
            k_scales->data_ptr<float>(), v_scales->data_ptr<float>(),
            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
            out.data_ptr<scalar_t>(), B, H, Hkv, bs, width, static_cast<float>(scale));
      else
        run<scalar_t, scalar_t, D>(
            q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
            nullptr, nullptr, block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
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
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [D, H, d]; caches [blocks, block_size, Hkv, d]; tables [D, width]; lens [D]. An
    int8 cache comes with its float32 scales [blocks, block_size, Hkv]."""
    return kernel.paged_decode(q.contiguous(), k_cache, v_cache, block_tables, context_lens,
                               q.shape[-1] ** -0.5, k_scales, v_scales)
