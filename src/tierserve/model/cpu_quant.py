"""The C++ kernels of quantized linear layers, for the lean step (cpu_step.py): int4 and
int8 products read straight from quant.py's packed weights, and the 4-bit weight
dequantized to W^T for wide inputs. About 1,500 lines because it is one kernel family in
one C++ source string, written twice (AVX-512 VNNI and AVX2: the intrinsics take many
lines); cpu_step.py holds the forward pass.

NOTE: the 4- and 8-bit kernels. At a few rows a quantized layer is bound by reading its
weights; torch's int4 kernel read them at 10-19 GB/s here. `int4_matmul` (AVX-512 VNNI)
rounds x to int8 per group of 32 inputs, as llama.cpp does for its 4-bit formats, and sums
four 4-bit x 8-bit products per lane with vpdpbusd. At one to four rows each 32-byte chunk
of the packing is unpacked in registers as it is read (2.6 ms for SmolLM2-135M's 120 int4
layers at one row, about 26 GB/s, against torch's 4.1); at more rows a block's 64 outputs
are unpacked once for all of its inputs (36-96 KB, in L2) and rows go two at a time over
them with their sums in registers (at 16 rows 12.5 ms against 25 for a dense bfloat16 matmul
of the same layers, when a group was unpacked at a time and each row's sums went through
memory; with the sums in registers, from 16 rows, on a 2-core EPYC Zen 4, interleaved in one
process: 64 rows 0.86-0.93 of the time before, 32 rows 0.95, 512 rows 0.97, the same bits;
three rows at a time: no faster; below 16 rows the group-at-a-time tile is faster).

NOTE: AVX2 without VNNI (EPYC Zen 2-3, most Intel client cores). There torch packs int4
weights in blocks of 32 outputs, not 64 (`int4_pack_block` asks torch which), and its int4
kernel read SmolLM2-135M's 120 4-bit layers in 9.6 ms at one row (about 7 GB/s) on a
2-core EPYC Zen 3, two thirds of a lone decode step. `int4_rows_avx2` does what
int4_rows_vnni does with vpmaddubsw and vpmaddwd: 3.3-3.7 ms at one row (0.35-0.40x
torch's), 0.64x at four, 0.37-0.47x at 16-512 rows, where a block was unpacked once and
rows went two at a time over each half (WIDE); since the fortieth session WIDE unpacks
with outputs in lanes (`int4_lanes_avx2`, no permute per row and step) and takes rows 64
at a time over the blocks (each block unpacked once per 64 rows): 0.83-0.84x that time
at 64 and 512 rows; since the forty-first, four rows at a time for groups of 32
(`int4_lanes4_avx2`, each weight vector loaded once for four rows): 0.73-0.75x again at
64 and 512 rows. Since the forty-second, the lean step holds each layer's (s, z) pairs
also in block order (`int4_blocked_scales`: a block's pairs one after the other, not two
lines for each of its 18-48 groups, N outputs apart; 13 MB for SmolLM2-135M) and the
one-to-four-row loop loads two inputs' codes a 32-byte load (`unpack8_odd_even`, no
inserts) and bfloat16 pairs without a shuffle: a lone decode step in 0.92-0.94x the time.
Since the forty-eighth, two to four rows with groups of 32 pair inputs in 16-bit lanes
(`int4_pairs_avx2`, one round of unpacking, the same bits): the 120 layers in 0.73x the
time at four rows, 0.83x at three, 0.93x at two; the lean step at four streams 0.80x.
`int8_matmul_avx2` is the
4-bit model's int8 head with its input rounded the same way, on weights repacked once
with outputs in lanes: 0.94 ms at one row, 18 at 64 (0.82x and 0.68x the earlier loop's).
Elsewhere (no AVX2, or another packing) the lean step keeps torch's int4 kernel for few
rows and `dequantize_int4_t` then one dense matmul for many. `int8_matmul` widens int8 weight rows to bfloat16 (exact) and sums
with vdpbf16ps, two weight rows per pass (one row of x: float32 multiply-adds): the 4-bit
model's int8 lm_head takes 1.1 ms at one row against torch's 2.2, 14 against 43 at 64 rows.
"""

SOURCE = r"""
// Round n float32 values to the model's dtype. bf16: round to nearest even on the raw
// bits (c10's conversion for finite values), written so the compiler vectorizes it.
template <typename T>
static inline void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
static inline void narrow(const float* src, at::BFloat16* dst, int64_t n) {
  const uint32_t* raw = reinterpret_cast<const uint32_t*>(src);
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<uint16_t>((raw[i] + 0x7FFFu + ((raw[i] >> 16) & 1u)) >> 16);
}

// An int4 weight in torch's CPU packing (model/quant.py, _dequantize_int4: blocks of 64
// output rows, k-major, 32 bytes per (block, k), rows 0..31 in the low nibbles and 32..63
// in the high ones) as the dense transpose W^T [K, N]: w = q * s + (z - 8 s) per group of
// inputs, in float32, rounded once. Transposed because that is the packing's own order:
// for one k, a block's 32 bytes give its 64 rows' values side by side, so the reads,
// the arithmetic and the writes are all sequential and vectorize.
template <typename T>
static void dequantize_int4_t(const uint8_t* codes, const T* sz, T* out, int64_t n, int64_t k,
                              int64_t group) {
  at::parallel_for(0, k / group, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> s(n), z(n), row(n);
    for (int64_t g = g0; g < g1; ++g) {
      const T* p = sz + g * n * 2;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = static_cast<float>(p[2 * j]);
        z[j] = static_cast<float>(p[2 * j + 1]) - 8.f * s[j];
      }
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        for (int64_t b = 0; b < n / 64; ++b) {
          const uint8_t* src = codes + (b * k + i) * 32;
          float* dst = row.data() + b * 64;
          const float* sb = s.data() + b * 64;
          const float* zb = z.data() + b * 64;
          for (int64_t j = 0; j < 32; ++j) {
            dst[j] = static_cast<float>(src[j] & 15) * sb[j] + zb[j];
            dst[32 + j] = static_cast<float>(src[j] >> 4) * sb[32 + j] + zb[32 + j];
          }
        }
        narrow(row.data(), out + i * n, n);
      }
    }
  });
}

// W^T [K, N] of an int4 layer (for tests: .t() is the [N, K] weight).
static at::Tensor dequantize_int4_t_dense(const at::Tensor& codes, const at::Tensor& sz,
                                          int64_t group) {
  TORCH_CHECK(codes.is_contiguous() && sz.is_contiguous() && codes.scalar_type() == at::kByte);
  const int64_t n = sz.size(1), k = sz.size(0) * group;
  TORCH_CHECK(n % 64 == 0 && codes.numel() == n * k / 2, "not torch's CPU int4 packing");
  at::Tensor dense = at::empty({k, n}, sz.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4", [&] {
    dequantize_int4_t<scalar_t>(codes.data_ptr<uint8_t>(), sz.data_ptr<scalar_t>(),
                                dense.data_ptr<scalar_t>(), n, k, group);
  });
  return dense;
}

#if defined(__x86_64__)
#include <immintrin.h>
#endif
constexpr int64_t MAX_GROUP = 64;   // the largest group the kernels are written for and
                                    // tested with (GGUF's 4-bit formats have 32)
// PREFETCH: at one to four rows, int4_rows_vnni asks for the codes and scales PF groups
// ahead (8 KB of codes for groups of 32) before it unpacks a group: a block's stream is
// short (18 KB for a 576-input layer) and crosses a 4 KB page every four groups, where the
// hardware prefetcher stops. A lone 4-bit decode step (forward and head) took 6-8% less
// time with it on a 2-core EPYC (Zen 5; the head's own kernel gained nothing from it).
// Into L2 rather than L1 (as the paged attention's Prefetcher): the 120 4-bit layers took
// 0.92 of their time at one and at four rows on a 2-core Zen 4, the whole step 0.94. Past
// a block's last group it asks for the next block's first ones: the codes follow on, but
// a group's scales are n outputs apart, and each block began with PF groups of scales
// read on demand (2,430 blocks a step for SmolLM2-135M): 0.94-0.97 of the layers' time at
// one row, 0.96 at four, the whole lone step 0.95-0.96 (Zen 4). int4_rows_avx2 reads ahead
// the same way (4 and 16 groups were no faster there: 2-core EPYC Zen 3).
constexpr int64_t PF = 8;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TIERSERVE_VNNI 1
// The same product with integer dot products, as llama.cpp computes its 4-bit formats: x
// is rounded to int8 per group of 32 inputs (xq, scale d: x ~ d xq), and vpdpbusd sums four
// (u4 weight x s8 input) products per 32-bit lane. The packing holds 64 rows per (block, k);
// four consecutive k are interleaved by bytes so that each lane holds one row's four, then
// split into low (rows 0..31) and high (32..63) nibbles. Lanes come out in the order
// [0-3, 16-19, 4-7, 20-23] / [8-11, 24-27, 12-15, 28-31] (+32 for the high nibbles) and are
// left so: s and z are put in that lane order once per group (group_scales), applied as
//   y_j += s_j d sum(xq q) + (z_j - 8 s_j) d sum(xq)
// and the sums go back to row order once per block (lanes_to_rows). A tile of five rows or
// more takes a group at a time, every row over each unpacked group (int4_tile_groups), or
// from TILE_BLOCK_ROWS rows the block's groups unpacked at once (int4_tile_block).

// Four consecutive inputs' weights of one block (4 x 32 bytes) as four vectors of u8:
// lanes of rows [0-3, 16-19, 4-7, 20-23], [8-11, 24-27, 12-15, 28-31], then the same +32.
static inline void unpack4(const uint8_t* src, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  const __m256i c2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
  const __m256i c3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
  const __m256i a0 = _mm256_unpacklo_epi8(c0, c1), a1 = _mm256_unpackhi_epi8(c0, c1);
  const __m256i b0 = _mm256_unpacklo_epi8(c2, c3), b1 = _mm256_unpackhi_epi8(c2, c3);
  const __m512i z0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a0, b0)),
                                        _mm256_unpackhi_epi16(a0, b0), 1);
  const __m512i z1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a1, b1)),
                                        _mm256_unpackhi_epi16(a1, b1), 1);
  w[0] = _mm512_and_si512(z0, low);
  w[1] = _mm512_and_si512(z1, low);
  w[2] = _mm512_and_si512(_mm512_srli_epi16(z0, 4), low);
  w[3] = _mm512_and_si512(_mm512_srli_epi16(z1, 4), low);
}

// s and (z - 8 s) of one group's 64 outputs, from their (s, z) bf16 pairs, in the lane
// order of unpack4's sums ([0-3, 16-19, 4-7, 20-23], [8-11, 24-27, 12-15, 28-31], then +32):
// the scales are put in the sums' order once per group, for every row of x, instead of
// each row's sums in the rows' order (four permutes per row and group; the sums go back to
// row order once, in lanes_to_rows).
static inline void group_scales(const at::BFloat16* pairs, __m512* s, __m512* z) {
  const int32_t* p = reinterpret_cast<const int32_t*>(pairs);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int half = 0; half < 2; ++half) {   // rows 0-31, then 32-63
    const __m512i a = _mm512_loadu_si512(p + 32 * half), b = _mm512_loadu_si512(p + 32 * half + 16);
    const __m512i lanes[2] = {_mm512_permutex2var_epi32(a, first, b),
                              _mm512_permutex2var_epi32(a, second, b)};
    for (int v = 0; v < 2; ++v) {
      const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(lanes[v], 16));
      s[2 * half + v] = sv;
      z[2 * half + v] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sv,
          _mm512_castsi512_ps(_mm512_and_si512(lanes[v], _mm512_set1_epi32(-65536))));
    }
  }
}

// tot (64 outputs in unpack4's lane order) += s d sum(xq q) + (z - 8 s) d sum(xq), from one
// row's group sums.
template <int V0 = 0, int V1 = 4>
static inline void add_group(const __m512i* acc, const __m512* s, const __m512* z, float d,
                             float dsum, __m512* tot) {
  const __m512 dv = _mm512_set1_ps(d), sum = _mm512_set1_ps(dsum);
  for (int v = V0; v < V1; ++v)
    tot[v] = _mm512_fmadd_ps(_mm512_mul_ps(s[v], dv), _mm512_cvtepi32_ps(acc[v]),
                             _mm512_fmadd_ps(z[v], sum, tot[v]));
}

// 64 outputs from unpack4's lane order to row order, in place.
static inline void lanes_to_rows(__m512* tot) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512 rows[4] = {_mm512_permutex2var_ps(tot[0], lo, tot[1]),
                          _mm512_permutex2var_ps(tot[0], hi, tot[1]),
                          _mm512_permutex2var_ps(tot[2], lo, tot[3]),
                          _mm512_permutex2var_ps(tot[2], hi, tot[3])};
  for (int v = 0; v < 4; ++v) tot[v] = rows[v];
}

// R rows of x against one unpacked group (w: group/4 x 4 vectors): tot[r][64] += ...
// xq4: row r's group at xq4[r * xstride]; dx, xs: row r's at [r * gstride].
template <int R>
static inline void group_rows(const __m512i* w, int64_t steps, const int32_t* xq4,
                              int64_t xstride, const float* dx, const float* xs,
                              int64_t gstride, const __m512* s, const __m512* z, float* tot) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t t = 0; t < steps; ++t) {
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_set1_epi32(xq4[r * xstride + t]);
    for (int v = 0; v < 4; ++v) {
      const __m512i wv = _mm512_load_si512(w + 4 * t + v);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv, xv[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 t4[4];
    for (int v = 0; v < 4; ++v) t4[v] = _mm512_loadu_ps(tot + r * 64 + 16 * v);
    add_group(acc[r], s, z, dx[r * gstride], xs[r * gstride], t4);
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(tot + r * 64 + 16 * v, t4[v]);
  }
}

// Up to four rows of x against one block, the weights unpacked in registers as they are
// read: at one to four rows (decode steps) this keeps to the memory's pace. HALF 0: the
// block's 64 outputs; 1 and 2: only its first or last 32 (the low or the high nibbles of
// the same bytes, accumulators 0-1 or 2-3), each with the whole block's bits.
template <int R, int HALF = 0>
static void int4_rows_vnni(const int32_t* xq4, const float* dx, const float* xsum,
                           const uint8_t* blk, const at::BFloat16* sz, float* out, int64_t n,
                           int64_t k, int64_t group) {
  const int64_t groups = k / group;
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][4];
    {   // the group PF ahead, codes and scales (PREFETCH); past the block's last group,
        // the next block's first ones (its codes follow these; its scales are 64 outputs on)
      const int64_t ahead = g + PF;
      const char* c = reinterpret_cast<const char*>(blk + ahead * group * 32);
      for (int64_t l = 0; l < group * 32; l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
      if (ahead < 2 * groups) {   // (a layer of PF groups or fewer: nothing to ask for)
        const char* z = reinterpret_cast<const char*>(
            ahead < groups ? sz + ahead * n * 2 : sz + ((ahead - groups) * n + 64) * 2);
        for (int64_t l = 0; l < 256; l += 64) _mm_prefetch(z + l, _MM_HINT_T1);
      }
    }
    constexpr int V0 = HALF == 2 ? 2 : 0, V1 = HALF == 1 ? 2 : 4;
    for (int r = 0; r < R; ++r)
      for (int v = V0; v < V1; ++v) acc[r][v] = _mm512_setzero_si512();
    for (int64_t i = g * group; i < (g + 1) * group; i += 4) {
      __m512i w[4];
      unpack4(blk + i * 32, w);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xq4[r * (k / 4) + i / 4]);
        for (int v = V0; v < V1; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xv);
      }
    }
    __m512 s[4], z[4];
    group_scales(sz + g * n * 2, s, z);
    for (int r = 0; r < R; ++r)
      add_group<V0, V1>(acc[r], s, z, dx[r * groups + g], xsum[r * groups + g], tot[r]);
  }
  for (int r = 0; r < R; ++r) {
    lanes_to_rows(tot[r]);
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * 64 + 16 * v, tot[r][v]);
  }
}

constexpr int64_t TILE_BLOCK_ROWS = 16;

// Rows [r0, r1) of y for one block b of 64 outputs, a group at a time: each unpacked group
// (2 KB for 32 inputs) stays in L1 for every row of the tile, four at a time, and the
// rows' sums go through memory. Below TILE_BLOCK_ROWS rows this is the faster: with the
// block's groups unpacked at once (int4_tile_block) the 120 layers of SmolLM2-135M alone
// took 1.21x this one's time at 7 rows and 1.11x at 8; at 16 they took 0.98-1.08x alone
// but the whole step 0.97-0.99x, and 0.97x at 24, 0.95x at 32, 0.86-0.93x at 64 (2-core
// EPYC Zen 4, benchmarks/kernel_ab.py).
static void int4_tile_groups(const int32_t* xq4, const float* dx, const float* xsum,
                             const uint8_t* codes, const at::BFloat16* sz, at::BFloat16* y,
                             int64_t b, int64_t r0, int64_t r1, int64_t n, int64_t k,
                             int64_t group) {
  const int64_t groups = k / group, steps = group / 4;
  alignas(64) __m512i w[MAX_GROUP];
  std::vector<float> tot((r1 - r0) * 64, 0.f);
  const uint8_t* blk = codes + b * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < steps; ++t) unpack4(blk + (g * group + 4 * t) * 32, w + 4 * t);
    __m512 s[4], z[4];
    group_scales(sz + (g * n + b * 64) * 2, s, z);
    for (int64_t r = r0; r < r1; r += 4) {
      const int32_t* xr = xq4 + r * (k / 4) + g * steps;
      const float* dr = dx + r * groups + g;
      const float* sr = xsum + r * groups + g;
      float* tr = tot.data() + (r - r0) * 64;
      switch (std::min<int64_t>(4, r1 - r)) {
        case 1: group_rows<1>(w, steps, xr, k / 4, dr, sr, groups, s, z, tr); break;
        case 2: group_rows<2>(w, steps, xr, k / 4, dr, sr, groups, s, z, tr); break;
        case 3: group_rows<3>(w, steps, xr, k / 4, dr, sr, groups, s, z, tr); break;
        default: group_rows<4>(w, steps, xr, k / 4, dr, sr, groups, s, z, tr);
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    float* tr = tot.data() + (r - r0) * 64;
    __m512 t4[4];
    for (int v = 0; v < 4; ++v) t4[v] = _mm512_loadu_ps(tr + 16 * v);
    lanes_to_rows(t4);
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(tr + 16 * v, t4[v]);
    narrow(tr, y + r * n + b * 64, 64);
  }
}

// R rows of x against a whole unpacked block (w: the block's groups, each group/4 x 4
// vectors; s, z: each group's 4 + 4 scale vectors), the rows' sums kept in registers
// across the groups. add_group's operations and their order are int4_tile_groups', so the
// result is the same bit for bit; what goes is a load and a store of every row's 64 sums
// per group (a third of the non-VNNI work at 64 rows).
template <int R>
static inline void block_rows(const __m512i* w, const __m512* s, const __m512* z,
                              int64_t groups, int64_t steps, const int32_t* xq4,
                              int64_t xstride, const float* dx, const float* xs, __m512* out) {
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
    const __m512i* wg = w + g * steps * 4;
    for (int64_t t = 0; t < steps; ++t) {
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_set1_epi32(xq4[r * xstride + g * steps + t]);
      for (int v = 0; v < 4; ++v) {
        const __m512i wv = _mm512_load_si512(wg + 4 * t + v);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wv, xv[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      add_group(acc[r], s + 4 * g, z + 4 * g, dx[r * groups + g], xs[r * groups + g], tot[r]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) out[4 * r + v] = tot[r][v];
}

// Rows [r0, r1) of y for one block b of 64 outputs: the block's groups unpacked once (the
// weights of a 1536-input layer: 96 KB, in L2), then two rows at a time over all of them.
// The same bits as int4_tile_groups.
static void int4_tile_block(const int32_t* xq4, const float* dx, const float* xsum,
                            const uint8_t* codes, const at::BFloat16* sz, at::BFloat16* y,
                            int64_t b, int64_t r0, int64_t r1, int64_t n, int64_t k,
                            int64_t group) {
  const int64_t groups = k / group, steps = group / 4;
  thread_local std::vector<__m512i> w;
  thread_local std::vector<__m512> sc;
  w.resize(groups * steps * 4);
  sc.resize(groups * 8);
  const uint8_t* blk = codes + b * k * 32;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < steps; ++t)
      unpack4(blk + (g * group + 4 * t) * 32, w.data() + (g * steps + t) * 4);
    group_scales(sz + (g * n + b * 64) * 2, sc.data() + 4 * g, sc.data() + 4 * (groups + g));
  }
  const __m512* s = sc.data();
  const __m512* z = sc.data() + 4 * groups;
  __m512 out[2 * 4];
  for (int64_t r = r0; r < r1; r += 2) {
    const int64_t rows = std::min<int64_t>(2, r1 - r);
    const int32_t* xr = xq4 + r * (k / 4);
    const float *dr = dx + r * groups, *sr = xsum + r * groups;
    if (rows == 2)
      block_rows<2>(w.data(), s, z, groups, steps, xr, k / 4, dr, sr, out);
    else
      block_rows<1>(w.data(), s, z, groups, steps, xr, k / 4, dr, sr, out);
    for (int64_t i = 0; i < rows; ++i) {
      alignas(64) float tr[64];
      lanes_to_rows(out + 4 * i);
      for (int v = 0; v < 4; ++v) _mm512_store_ps(tr + 16 * v, out[4 * i + v]);
      narrow(tr, y + (r + i) * n + b * 64, 64);
    }
  }
}

static inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16(const at::BFloat16* x) {   // bf16 -> float32: a shift, exact
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// x [M, K] (float32 or bfloat16, read as it is: a float32 copy of x cost about a
// microsecond per layer, a tenth of a small layer at one row) rounded to int8 per group
// of 32 (group % 16 == 0): xq, its scale d per group and d times the sum of the group's xq.
template <typename X>
static void quantize_rows(const X* x, int8_t* xq, float* dx, float* xsum, int64_t m,
                          int64_t k, int64_t group) {
  const int64_t groups = k / group;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const X* xg = x + r * k + g * group;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t i = 0; i < group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(xg + i)));
        const float top = _mm512_reduce_max_ps(amax);
        const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < group; i += 16) {
          const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xg + i), inv));  // nearest even
          sum = _mm512_add_epi32(sum, q);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + g * group + i), _mm512_cvtsepi32_epi8(q));
        }
        dx[r * groups + g] = top / 127.f;
        // d times the rounded inputs' sum, not x's: w = s q + (z - 8 s) is a small
        // difference of two large terms, and only the same inputs in both keep it one
        xsum[r * groups + g] = top / 127.f * static_cast<float>(_mm512_reduce_add_epi32(sum));
      }
  });
}

#endif

#if !defined(TIERSERVE_VNNI) && defined(__AVX2__) && defined(__FMA__)
#define TIERSERVE_INT4_AVX2 1
// AVX2 without VNNI (Zen 2 and 3, most Intel client cores): the same integer dot products
// with vpmaddubsw (pairs of u4 x s8 products, summed to int16) and vpmaddwd, on torch's
// AVX2 packing, whose blocks hold 32 outputs (16 bytes per block and input: outputs
// 0..15 in the low nibbles, 16..31 in the high ones). Eight consecutive inputs are taken
// at once, four in each 32-bit lane's low 128 bits and four in the high ones (the even and
// the odd inputs: unpack8_odd_even), so that after a group the two halves add up to
// outputs in their own order and the scales need no permuting (the loop for one row, and
// for two to four with groups other than 32: int4_pairs_avx2). A group's int16 sums cannot
// overflow: at most 64 inputs is 8 steps of two products of at most 15 x 128. From five
// rows (WIDE) a block is unpacked again with outputs in lanes (unpack_block_lanes).
constexpr int64_t PACKED_ROWS = 4;   // up to this many rows read the packing as it is (WIDE)
constexpr int64_t WIDE_CHUNK = 64;   // WIDE's rows a pass over the blocks

// load8 (eight float32 or bfloat16 values as float32): cpu_attention.py's

// x [M, K] rounded to int8 per group as the VNNI quantize_rows rounds it: xq, its scale d
// per group and d times the sum of the group's xq.
template <typename X>
static void quantize_rows(const X* x, int8_t* xq, float* dx, float* xsum, int64_t m,
                          int64_t k, int64_t group) {
  const int64_t groups = k / group;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const X* xg = x + r * k + g * group;
        __m256 amax = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 8)
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(xg + i)));
        __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
        const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
        __m256i sum = _mm256_setzero_si256();
        int8_t* out = xq + r * k + g * group;
        for (int64_t i = 0; i < group; i += 8) {
          const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xg + i), inv));  // nearest even
          sum = _mm256_add_epi32(sum, q);
          const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(q16, q16));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        dx[r * groups + g] = top / 127.f;
        xsum[r * groups + g] = top / 127.f * static_cast<float>(_mm_cvtsi128_si32(s4));
      }
  });
}

// unpack8's last round: bytes paired by input (a0, a1: two inputs' bytes interleaved, for
// outputs 0-7 and 8-15 of each nibble; b0, b1: two more) to four inputs a 32-bit lane, then
// the low nibbles (outputs 0-15) and the high (16-31) as bytes.
static inline void nibbles8(__m256i a0, __m256i a1, __m256i b0, __m256i b1, __m256i* w) {
  const __m256i v[4] = {_mm256_unpacklo_epi16(a0, b0), _mm256_unpackhi_epi16(a0, b0),
                        _mm256_unpacklo_epi16(a1, b1), _mm256_unpackhi_epi16(a1, b1)};
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    w[j] = _mm256_and_si256(v[j], low);
    w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), low);
  }
}

// Eight consecutive inputs' weights of one block (8 x 16 bytes) as eight vectors of u8,
// each 32-bit lane one output's four inputs (0-3 in the low 128 bits, 4-7 in the high):
// w[j] holds outputs 4j..4j+3 (j < 4, low nibbles) or 16 + 4(j - 4).. (high nibbles).
static inline void unpack8(const uint8_t* src, __m256i* w) {
  const __m128i* c = reinterpret_cast<const __m128i*>(src);
  const auto pair = [&](int lo, int hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(c + lo)),
                                   _mm_loadu_si128(c + hi), 1);
  };
  const __m256i p = pair(0, 4), q = pair(1, 5), r = pair(2, 6), t = pair(3, 7);
  const __m256i a0 = _mm256_unpacklo_epi8(p, q), a1 = _mm256_unpackhi_epi8(p, q);
  const __m256i b0 = _mm256_unpacklo_epi8(r, t), b1 = _mm256_unpackhi_epi8(r, t);
  nibbles8(a0, a1, b0, b1, w);
}

// unpack8 with the inputs in another order: each 32-bit lane one output's four inputs, the
// even ones (0, 2, 4, 6) in the low 128 bits and the odd ones in the high, as
// int4_rows_avx2 reads them: w[j] holds outputs 4j..4j+3 (j < 4, low nibbles) or
// 16 + 4(j - 4).. (high nibbles). Two inputs a 32-byte load, so that the bytes need two
// rounds of unpacking and no inserts (x_pattern puts x's bytes in the same order).
static inline void unpack8_odd_even(const uint8_t* src, __m256i* w) {
  const __m256i* c = reinterpret_cast<const __m256i*>(src);
  const __m256i p = _mm256_loadu_si256(c), q = _mm256_loadu_si256(c + 1);
  const __m256i r = _mm256_loadu_si256(c + 2), t = _mm256_loadu_si256(c + 3);
  const __m256i a0 = _mm256_unpacklo_epi8(p, q), a1 = _mm256_unpackhi_epi8(p, q);
  const __m256i b0 = _mm256_unpacklo_epi8(r, t), b1 = _mm256_unpackhi_epi8(r, t);
  nibbles8(a0, a1, b0, b1, w);
}

// Eight inputs of x in unpack8_odd_even's order: every 32-bit lane of the low 128 bits holds
// x0 x2 x4 x6, of the high x1 x3 x5 x7 (one broadcast load and one shuffle in a lane).
static inline __m256i x_pattern(const int8_t* x) {
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                         1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
  int64_t eight;
  std::memcpy(&eight, x, 8);
  return _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), order);
}

// s and (z - 8 s) of eight consecutive outputs, from their (s, z) pairs.
template <typename T>
static inline void scales8(const T* pairs, __m256* s, __m256* z) {
  const __m256 a = load8(pairs), b = load8(pairs + 8);
  const __m256 sv = _mm256_castpd_ps(_mm256_permute4x64_pd(
      _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  const __m256 zv = _mm256_castpd_ps(_mm256_permute4x64_pd(
      _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  *s = sv;
  *z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sv, zv);
}

// The same from bfloat16 pairs without a shuffle: a pair is one 32-bit lane, s in its low
// half and z in its high, and a bfloat16 is the high half of its float32 (exact).
static inline void scales8(const at::BFloat16* pairs, __m256* s, __m256* z) {
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
  const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
  const __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32(-65536)));
  *s = sv;
  *z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sv, zv);
}

// Where a block's (s, z) pairs lie, in elements: `group` apart from one group of inputs to
// the next, `block` from one block of 32 outputs to the next. torch's order ([K/group, N,
// 2]) puts a group's pairs N outputs apart (group 2N, block 64), so that one block reads
// two lines for each of its 18-48 groups, 2.3-12 KB apart; block order ([N/32, K/group, 32,
// 2], BLOCKED_SCALES) puts them one after the other (group 64, block 64 K/group), one
// stream as the codes are.
struct ScaleOrder {
  int64_t group, block;
};

// Before a block's group g is read, ask for group g + PF (its codes, then its scales), as
// int4_rows_vnni does (PREFETCH); past the block's last group, the next block's first ones.
template <typename T>
static inline void read_ahead(const uint8_t* blk, const T* sz, int64_t g, int64_t groups,
                              int64_t group, const ScaleOrder& order) {
  const int64_t ahead = g + PF;
  const char* c = reinterpret_cast<const char*>(blk + ahead * group * 16);
  for (int64_t l = 0; l < group * 16; l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
  if (ahead < 2 * groups) {
    const char* z = reinterpret_cast<const char*>(
        ahead < groups ? sz + ahead * order.group
                       : sz + (ahead - groups) * order.group + order.block);
    for (int64_t l = 0; l < 64 * static_cast<int64_t>(sizeof(T)); l += 64)
      _mm_prefetch(z + l, _MM_HINT_T1);
  }
}

// R rows of x (1-4) against one block of 32 outputs, unpacked in registers as it is read.
// HALF 0: the block's 32 outputs; 1 and 2: only its first or last 16. out: R x 32 floats.
// Each row's sums are its own (integer sums, then the same float operations in the same
// order as int4_lanes_avx2's), so a row's outputs do not depend on the rows computed
// beside it, nor on which of the two loops computed them.
template <int R, int HALF, typename T>
static void int4_rows_avx2(const int8_t* xq, const float* dx, const float* xsum,
                           const uint8_t* blk, const T* sz, float* out, int64_t k,
                           int64_t group, const ScaleOrder& order) {
  constexpr int J0 = HALF == 2 ? 4 : 0, J1 = HALF == 1 ? 4 : 8;
  const int64_t groups = k / group;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    read_ahead(blk, sz, g, groups, group, order);
    __m256i acc[R][8];
    for (int r = 0; r < R; ++r)
      for (int j = J0; j < J1; ++j) acc[r][j] = _mm256_setzero_si256();
    for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
      __m256i w[8];
      unpack8_odd_even(blk + i * 16, w);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = x_pattern(xq + r * k + i);
        for (int j = J0; j < J1; ++j)
          acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(w[j], xv));
      }
    }
    for (int v = J0 / 2; v < J1 / 2; ++v) {   // outputs 8v..8v+7: acc 2v and 2v + 1
      __m256 s, z;
      scales8(sz + g * order.group + 16 * v, &s, &z);
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_madd_epi16(acc[r][2 * v], ones);
        const __m256i b = _mm256_madd_epi16(acc[r][2 * v + 1], ones);
        const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                             _mm256_permute2x128_si256(a, b, 0x31));
        tot[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g])),
                                    _mm256_cvtepi32_ps(sum),
                                    _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]),
                                                    tot[r][v]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = J0 / 2; v < J1 / 2; ++v) _mm256_storeu_ps(out + r * 32 + 8 * v, tot[r][v]);
}

// PAIRS: int4_rows_avx2 for groups of 32 with one round of unpacking instead of two. Two
// inputs' bytes interleaved (i with i + 2 in a 128-bit lane, i + 1 with i + 3 in the
// other) already put two inputs of one output in each 16-bit lane, which is what
// vpmaddubsw sums; the lanes' int16 sums then hold eight outputs' partial sums twice (one
// per lane) and are added at the end of the group, widened to int32. That is four unpacks
// per eight inputs instead of eight (and two shuffles of each row's x instead of one),
// and 4R accumulators instead of 8R (16 instead of 32 at four rows; the loop before
// spilled two of its eight to the stack even at one row). A lane holds 16 products of at
// most 15 x 128 over a group of 32 (30,720: no overflow), so only groups up to 32 can take
// it; the sums are the same integers, then the same float operations in the same order,
// so the outputs are the same bits.
// On a 2-core EPYC Zen 3, one thread, a layer's blocks from L2: 0.69-0.84 of the time at
// one row, 0.81 at two, 0.74-0.76 at three, 0.62-0.72 at four; the 120 layers of
// SmolLM2-135M read from memory (kernel_ab --part int4): 0.93 at two rows, 0.83 at three,
// 0.73 at four, but 1.04-1.05 at one (where the layers wait on memory; why it is slower
// there is not known), so one row keeps int4_rows_avx2.
template <int R, int HALF, typename T>
static void int4_pairs_avx2(const int8_t* xq, const float* dx, const float* xsum,
                            const uint8_t* blk, const T* sz, float* out, int64_t k,
                            const ScaleOrder& order) {
  constexpr int64_t group = 32;
  constexpr int V0 = HALF == 2 ? 2 : 0, V1 = HALF == 1 ? 2 : 4;   // outputs 8v..8v+7
  const int64_t groups = k / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  // x_i x_{i+2} in every 16-bit lane of the low 128 bits, x_{i+1} x_{i+3} in the high
  const __m256i pairs = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                         1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
  __m256 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    read_ahead(blk, sz, g, groups, group, order);
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = V0; v < V1; ++v) acc[r][v] = _mm256_setzero_si256();
    const uint8_t* cg = blk + g * group * 16;
    for (int64_t i = 0; i < group; i += 4) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + i * 16));
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + i * 16 + 32));
      // bytes 0-7 (outputs 0-7 low, 16-23 high) and 8-15 (8-15, 24-31) of the four inputs
      const __m256i a0 = _mm256_unpacklo_epi8(p, q), a1 = _mm256_unpackhi_epi8(p, q);
      __m256i w[4];
      if (HALF != 2) {
        w[0] = _mm256_and_si256(a0, low);
        w[1] = _mm256_and_si256(a1, low);
      }
      if (HALF != 1) {
        w[2] = _mm256_and_si256(_mm256_srli_epi16(a0, 4), low);
        w[3] = _mm256_and_si256(_mm256_srli_epi16(a1, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k + g * group + i, 4);
        const __m256i xv = _mm256_shuffle_epi8(_mm256_set1_epi32(four), pairs);
        for (int v = V0; v < V1; ++v)
          acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(w[v], xv));
      }
    }
    for (int v = V0; v < V1; ++v) {
      __m256 s, z;
      scales8(sz + g * order.group + 16 * v, &s, &z);
      for (int r = 0; r < R; ++r) {
        const __m256i sum = _mm256_add_epi32(
            _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[r][v])),
            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[r][v], 1)));
        tot[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g])),
                                    _mm256_cvtepi32_ps(sum),
                                    _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]),
                                                    tot[r][v]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = V0; v < V1; ++v) _mm256_storeu_ps(out + r * 32 + 8 * v, tot[r][v]);
}

// int4_rows_avx2 (int4_pairs_avx2 for two to four rows and groups of 32) for m rows (1-4)
// and a half, the block read as packed.
template <typename T>
static void rows_dispatch(int64_t m, int half, const int8_t* xq, const float* dx,
                          const float* xs, const uint8_t* blk, const T* bsz, float* out,
                          int64_t k, int64_t group, const ScaleOrder& order) {
#define TS_ROWS(R)                                                                       \
  if (R > 1 && group == 32) switch (half) {                                              \
    case 0: int4_pairs_avx2<R, 0>(xq, dx, xs, blk, bsz, out, k, order); break;           \
    case 1: int4_pairs_avx2<R, 1>(xq, dx, xs, blk, bsz, out, k, order); break;           \
    default: int4_pairs_avx2<R, 2>(xq, dx, xs, blk, bsz, out, k, order);                 \
  } else switch (half) {                                                                 \
    case 0: int4_rows_avx2<R, 0>(xq, dx, xs, blk, bsz, out, k, group, order); break;     \
    case 1: int4_rows_avx2<R, 1>(xq, dx, xs, blk, bsz, out, k, group, order); break;     \
    default: int4_rows_avx2<R, 2>(xq, dx, xs, blk, bsz, out, k, group, order);           \
  }
  switch (m) {
    case 1: TS_ROWS(1) break;
    case 2: TS_ROWS(2) break;
    case 3: TS_ROWS(3) break;
    default: TS_ROWS(4)
  }
#undef TS_ROWS
}

// A block's scales as scales8 gives them (s, z - 8 s for each group and eight outputs),
// for the rows of a wide x to read in turn.
template <typename T>
static void block_scales(const T* sz, int64_t k, int64_t group, const ScaleOrder& order,
                         __m256* sc) {
  for (int64_t g = 0; g < k / group; ++g)
    for (int v = 0; v < 4; ++v)
      scales8(sz + g * order.group + 16 * v, sc + (g * 4 + v) * 2, sc + (g * 4 + v) * 2 + 1);
}

// WIDE's unpacking: a block's codes with outputs in lanes, for each eight inputs i..i+7
// eight vectors: the four octets of outputs (0-7, 8-15, 16-23, 24-31) at inputs i..i+3,
// then the same at i+4..i+7; each 32-bit lane is one output's four inputs, so a row of x
// needs only its four bytes broadcast (unpack8's layout needed a cross-lane permute per
// row and step, and one more per group to put the outputs back in order).
static void unpack_block_lanes(const uint8_t* blk, int64_t k, __m256i* w) {
  for (int64_t i = 0; i < k; i += 8) {
    __m256i u[8];
    unpack8(blk + i * 16, u);                 // u[2q], u[2q+1]: outputs 8q..8q+3, +4..+7
    for (int q = 0; q < 4; ++q) {
      w[i + q] = _mm256_permute2x128_si256(u[2 * q], u[2 * q + 1], 0x20);
      w[i + 4 + q] = _mm256_permute2x128_si256(u[2 * q], u[2 * q + 1], 0x31);
    }
  }
}

// R rows of x against two octets of a block's outputs (Q0, Q0 + 1: the block's first or
// last 16) from unpack_block_lanes' vectors and block_scales'. A lane's int16 sum
// takes four products a step (at most 4 x 15 x 127), so it is widened to int32 every 32
// inputs; a group's int32 sums and the float operations after them are int4_rows_avx2's,
// in its order: the same bits as the packed loop at one to four rows.
template <int R, int Q0>
static void int4_lanes_avx2(const int8_t* xq, const float* dx, const float* xsum,
                            const __m256i* w, float* out, int64_t k, int64_t group,
                            const __m256* sc) {
  const int64_t groups = k / group;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[R][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int64_t i0 = g * group; i0 < (g + 1) * group; i0 += 32) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t i = i0; i < std::min(i0 + 32, (g + 1) * group); i += 8) {
        const __m256i* wv = w + i;
        for (int r = 0; r < R; ++r) {
          int32_t lo, hi;
          std::memcpy(&lo, xq + r * k + i, 4);
          std::memcpy(&hi, xq + r * k + i + 4, 4);
          const __m256i x0 = _mm256_set1_epi32(lo), x1 = _mm256_set1_epi32(hi);
          for (int q = 0; q < 2; ++q) {
            acc[r][q] = _mm256_add_epi16(acc[r][q], _mm256_maddubs_epi16(wv[Q0 + q], x0));
            acc[r][q] = _mm256_add_epi16(acc[r][q], _mm256_maddubs_epi16(wv[4 + Q0 + q], x1));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < 2; ++q)
          sum[r][q] = _mm256_add_epi32(sum[r][q], _mm256_madd_epi16(acc[r][q], ones));
    }
    for (int q = 0; q < 2; ++q) {
      const __m256 s = sc[(g * 4 + Q0 + q) * 2], z = sc[(g * 4 + Q0 + q) * 2 + 1];
      for (int r = 0; r < R; ++r)
        tot[r][q] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g])),
                                    _mm256_cvtepi32_ps(sum[r][q]),
                                    _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]),
                                                    tot[r][q]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 2; ++q) _mm256_storeu_ps(out + r * 32 + 8 * (Q0 + q), tot[r][q]);
}

// int4_lanes_avx2 for four rows and groups of 32 inputs (GGUF's 4-bit formats): a group
// is one widening, so its int32 sums need no registers of their own, and the running
// float sums stay in `out` (read and written once a group), which leaves the eight int16
// sums, the step's four weight vectors and a row's two broadcasts in the 16 registers.
// Each vector of weights then serves four rows, not two: a step (eight inputs) loads 12
// vectors for 16 multiplies where int4_lanes_avx2<2> loads 8 (the compiler reloaded its
// weights: 12) for 8. The same integer sums and float operations in the same order: the
// same bits.
template <int Q0>
static void int4_lanes4_avx2(const int8_t* xq, const float* dx, const float* xsum,
                             const __m256i* w, float* out, int64_t k, const __m256* sc) {
  constexpr int R = 4;
  const int64_t groups = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 2; ++q) _mm256_storeu_ps(out + r * 32 + 8 * (Q0 + q), _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t i = g * 32; i < g * 32 + 32; i += 8) {
      const __m256i* wv = w + i;
      __m256i a0 = wv[Q0], a1 = wv[Q0 + 1], b0 = wv[4 + Q0], b1 = wv[5 + Q0];
      asm("" : "+v"(a0), "+v"(a1), "+v"(b0), "+v"(b1));   // loaded once, not at each use
      for (int r = 0; r < R; ++r) {
        int32_t lo, hi;
        std::memcpy(&lo, xq + r * k + i, 4);
        std::memcpy(&hi, xq + r * k + i + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(lo), x1 = _mm256_set1_epi32(hi);
        // each product added where it is made: the empty asm keeps the compiler from
        // pairing products first, which needs one register more than there are
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(a0, x0));
        asm("" : "+v"(acc[r][0]));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(a1, x0));
        asm("" : "+v"(acc[r][1]));
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(b0, x1));
        asm("" : "+v"(acc[r][0]));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(b1, x1));
        asm("" : "+v"(acc[r][1]));
      }
    }
    for (int q = 0; q < 2; ++q) {
      const __m256 s = sc[(g * 4 + Q0 + q) * 2], z = sc[(g * 4 + Q0 + q) * 2 + 1];
      for (int r = 0; r < R; ++r) {
        float* t = out + r * 32 + 8 * (Q0 + q);
        const __m256i sum = _mm256_madd_epi16(acc[r][q], ones);
        _mm256_storeu_ps(t, _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g])),
                                            _mm256_cvtepi32_ps(sum),
                                            _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[r * groups + g]),
                                                            _mm256_loadu_ps(t))));
      }
    }
  }
}
#endif

#if defined(TIERSERVE_VNNI) || defined(TIERSERVE_INT4_AVX2)
// quantize_rows on a tensor: bfloat16 read in place, any other dtype through float32.
static void quantize_input(const at::Tensor& x, int8_t* xq, float* dx, float* xsum, int64_t m,
                           int64_t k, int64_t group) {
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous()) {
    quantize_rows(x.data_ptr<at::BFloat16>(), xq, dx, xsum, m, k, group);
    return;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  quantize_rows(xf.data_ptr<float>(), xq, dx, xsum, m, k, group);
}
#endif

// Outputs per block of torch's CPU int4 packing in this process: it follows the CPU
// capability ATen dispatches to at run time (64 with AVX-512, 32 with AVX2; the
// ATEN_CPU_CAPABILITY variable can lower it), so it is asked of torch itself, once.
// Every byte of a packing of 128 x 64 codes is compared with each layout (block b, input
// i, byte d: outputs b B + d and b B + d + B/2); 0 (no kernel of ours) if neither holds or
// torch refuses.
static int64_t int4_pack_block() {
  static const int64_t block = [] {
    try {
      constexpr int64_t N = 128, K = 64;
      // codes that differ between every two outputs a layout could pair
      const at::Tensor r = at::arange(N, at::TensorOptions().dtype(at::kInt)).unsqueeze(1);
      const at::Tensor i = at::arange(K, at::TensorOptions().dtype(at::kInt)).unsqueeze(0);
      const at::Tensor codes = (r * r * 5 + at::floor_divide(r, 3) + i * 7 + r * i)
                                   .remainder(16).to(at::kInt).contiguous();
      const at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(codes, 1).contiguous();
      if (packed.numel() != N * K / 2 || packed.scalar_type() != at::kByte) return int64_t{0};
      const int32_t* c = codes.data_ptr<int32_t>();
      const uint8_t* p = packed.data_ptr<uint8_t>();
      for (const int64_t B : {int64_t{64}, int64_t{32}}) {
        bool same = true;
        for (int64_t b = 0; b < N / B && same; ++b)
          for (int64_t i = 0; i < K && same; ++i)
            for (int64_t d = 0; d < B / 2 && same; ++d)
              same = p[(b * K + i) * (B / 2) + d] ==
                     (c[(b * B + d) * K + i] | (c[(b * B + d + B / 2) * K + i] << 4));
        if (same) return B;
      }
    } catch (const std::exception&) {
    }
    return int64_t{0};
  }();
  return block;
}

// Whether int4_matmul computes this layer: built with AVX-512 VNNI, bfloat16 (s, z) pairs,
// groups of 16..64 inputs, torch packing 64 outputs a block; or built with AVX2 (no VNNI),
// bfloat16 or float32 pairs, groups of 8..64 (a multiple of 8), torch packing 32 a block. Elsewhere the lean
// step keeps torch's int4 kernel (few rows) and dequantize-then-matmul (many).
static bool int4_fast(const at::Tensor& sz, int64_t group) {
#if defined(TIERSERVE_VNNI)
  return sz.scalar_type() == at::kBFloat16 && group > 0 && group % 16 == 0 &&
         group <= MAX_GROUP && int4_pack_block() == 64;
#elif defined(TIERSERVE_INT4_AVX2)
  return (sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat) &&
         group > 0 && group % 8 == 0 && group <= MAX_GROUP && int4_pack_block() == 32;
#else
  return false;
#endif
}

#if defined(TIERSERVE_INT4_AVX2)
// int4_matmul on AVX2: threads take halves of blocks (16 outputs each) as the VNNI kernel
// does at one to four rows (BALANCE: a block's two halves that one thread takes go to one
// call), and go over every row of x for each, up to four at a time, or from five rows
// (WIDE) over up to WIDE_CHUNK rows at a time, so that a block's unpacked bytes (18-48 KB
// in SmolLM2-135M's layers) stay in L1 or L2 for all of them.
template <typename T, typename Y>
static void int4_matmul_avx2(const int8_t* xq, const float* dx, const float* xs,
                             const uint8_t* cp, const T* zp, Y* yp, int64_t m, int64_t n,
                             int64_t k, int64_t group, bool blocked) {
  const int64_t nb = n / 32, groups = k / group;
  const ScaleOrder order = blocked ? ScaleOrder{64, 64 * groups} : ScaleOrder{2 * n, 64};
  at::parallel_for(0, 2 * nb, 1, [&](int64_t i0, int64_t i1) {
    float out[4 * 32];
    std::vector<__m256i> w(m > PACKED_ROWS ? k : 0);
    std::vector<__m256> sc(m > PACKED_ROWS ? k / group * 8 : 0);
    if (m <= PACKED_ROWS) {
      for (int64_t i = i0; i < i1;) {
        const int64_t b = i / 2, e = std::min(i1, 2 * b + 2);
        const int half = e - i == 2 ? 0 : (i % 2 == 0 ? 1 : 2);
        const int64_t o0 = half == 2 ? 16 : 0, width = half == 0 ? 32 : 16;
        rows_dispatch(m, half, xq, dx, xs, cp + b * k * 16, zp + b * order.block, out, k, group,
                      order);
        for (int64_t r = 0; r < m; ++r)
          narrow(out + r * 32 + o0, yp + r * n + b * 32 + o0, width);
        i = e;
      }
      return;
    }
    // WIDE: more rows take the block unpacked (unpack_block_lanes, and its scales), then
    // four rows (groups of 32: int4_lanes4_avx2, its float sums in the output tile) or
    // two and 16 outputs at a time, their sums in registers; rows in chunks of WIDE_CHUNK,
    // each chunk over all the thread's blocks, so that the chunk's x stays in L2 (a block
    // is unpacked again for each chunk: about 3% of the chunk's instructions, by count).
    // Four rows at a time over the packed block kept 32 vectors of sums and spilled them;
    // all 512 rows of a prefill step in one chunk was slower too (docs/benchmarks.md,
    // fortieth session).
    for (int64_t c0 = 0; c0 < m; c0 += WIDE_CHUNK) {
      const int64_t c1 = std::min(m, c0 + WIDE_CHUNK);
      for (int64_t i = i0; i < i1;) {
        const int64_t b = i / 2, e = std::min(i1, 2 * b + 2);
        const int half = e - i == 2 ? 0 : (i % 2 == 0 ? 1 : 2);
        const int64_t o0 = half == 2 ? 16 : 0, width = half == 0 ? 32 : 16;
        const uint8_t* blk = cp + b * k * 16;
        unpack_block_lanes(blk, k, w.data());
        block_scales(zp + b * order.block, k, group, order, sc.data());
        for (int64_t r0 = c0, rows; r0 < c1; r0 += rows) {
          rows = group == 32 && c1 - r0 >= 4 ? 4 : std::min<int64_t>(2, c1 - r0);
          const int8_t* xr = xq + r0 * k;
          const float *dr = dx + r0 * groups, *sr = xs + r0 * groups;
          for (int h = half == 2 ? 2 : 1; h <= (half == 1 ? 1 : 2); ++h) {
            if (rows == 4)
              (h == 1 ? int4_lanes4_avx2<0> : int4_lanes4_avx2<2>)(
                  xr, dr, sr, w.data(), out, k, sc.data());
            else if (rows == 2)
              (h == 1 ? int4_lanes_avx2<2, 0> : int4_lanes_avx2<2, 2>)(
                  xr, dr, sr, w.data(), out, k, group, sc.data());
            else
              (h == 1 ? int4_lanes_avx2<1, 0> : int4_lanes_avx2<1, 2>)(
                  xr, dr, sr, w.data(), out, k, group, sc.data());
          }
          for (int64_t r = 0; r < rows; ++r)
            narrow(out + r * 32 + o0, yp + (r0 + r) * n + b * 32 + o0, width);
        }
        i = e;
      }
    }
  });
}
#endif

#ifdef TIERSERVE_VNNI
// int4_rows_vnni for m rows (1-4) and a half (0: the whole block; 1, 2: first, last 32).
static void rows_dispatch(int64_t m, int half, const int32_t* xq4, const float* dx,
                          const float* xs, const uint8_t* blk, const at::BFloat16* bsz,
                          float* out, int64_t n, int64_t k, int64_t group) {
#define TS_ROWS(R)                                                                   \
  switch (half) {                                                                    \
    case 0: int4_rows_vnni<R, 0>(xq4, dx, xs, blk, bsz, out, n, k, group); break;    \
    case 1: int4_rows_vnni<R, 1>(xq4, dx, xs, blk, bsz, out, n, k, group); break;    \
    default: int4_rows_vnni<R, 2>(xq4, dx, xs, blk, bsz, out, n, k, group);          \
  }
  switch (m) {
    case 1: TS_ROWS(1) break;
    case 2: TS_ROWS(2) break;
    case 3: TS_ROWS(3) break;
    default: TS_ROWS(4)
  }
#undef TS_ROWS
}
#endif

// BLOCKED_SCALES: an int4 layer's (s, z) pairs [K/group, N, 2] in block order for
// int4_matmul on AVX2, [N/32, K/group, 32, 2] (ScaleOrder): a lone 4-bit decode step reads
// them as one stream with the codes instead of two lines a group, N outputs apart. The
// lean step keeps this copy beside the layer's own (torch's order, which torch's kernels
// and dequantizing read): 4 bytes per 32 weights, 13 MB for SmolLM2-135M.
static at::Tensor int4_blocked_scales(const at::Tensor& sz) {
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.size(1) % 32 == 0,
              "int4_blocked_scales takes (s, z) pairs [K/group, N, 2] with 32 | N");
  return sz.reshape({sz.size(0), sz.size(1) / 32, 32, 2}).permute({1, 0, 2, 3}).contiguous();
}

// y [M, N] = x W^T for an int4 layer in torch's CPU packing, without dequantizing it; its
// (s, z) pairs in torch's order [K/group, N, 2] or (AVX2) int4_blocked_scales' [N/32,
// K/group, 32, 2].
static at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                              int64_t group) {
  const bool blocked = sz.dim() == 4;
  TORCH_CHECK(x.dim() == 2 && (sz.dim() == 3 || (blocked && sz.size(2) == 32)) &&
              sz.size(-1) == 2 && group > 0,
              "int4_matmul takes x [M, K], (s, z) pairs [K/group, N, 2] or [N/32, K/group, "
              "32, 2] and a group > 0");
#ifdef TIERSERVE_VNNI
  TORCH_CHECK(!blocked, "int4_matmul with AVX-512 VNNI takes (s, z) pairs in torch's order");
#endif
  const int64_t m = x.size(0), k = x.size(1), groups = k / group;
  const int64_t n = blocked ? sz.size(0) * 32 : sz.size(1);
  const int64_t block = int4_pack_block();
  TORCH_CHECK(block > 0 && n % block == 0 && codes.numel() == n * k / 2 && k % group == 0 &&
              sz.size(blocked ? 1 : 0) == groups && codes.is_contiguous(),
              "not torch's CPU int4 packing");
  TORCH_CHECK(int4_fast(sz, group), "int4_matmul needs AVX-512 VNNI and bfloat16 scales, "
              "or AVX2 and bfloat16 or float32 scales");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(TIERSERVE_INT4_AVX2)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int4_matmul takes bfloat16 or float32 x");
  const at::Tensor szc = sz.contiguous();
  const std::unique_ptr<int8_t[]> xq(new int8_t[m * k]);
  const std::unique_ptr<float[]> dx(new float[m * groups]), xs(new float[m * groups]);
  quantize_input(x, xq.get(), dx.get(), xs.get(), m, k, group);
  const auto run = [&](auto* zp) {
    if (y.scalar_type() == at::kBFloat16)
      int4_matmul_avx2(xq.get(), dx.get(), xs.get(), codes.data_ptr<uint8_t>(), zp,
                       y.data_ptr<at::BFloat16>(), m, n, k, group, blocked);
    else
      int4_matmul_avx2(xq.get(), dx.get(), xs.get(), codes.data_ptr<uint8_t>(), zp,
                       y.data_ptr<float>(), m, n, k, group, blocked);
  };
  if (szc.scalar_type() == at::kBFloat16)
    run(szc.data_ptr<at::BFloat16>());
  else
    run(szc.data_ptr<float>());
#endif
#ifdef TIERSERVE_VNNI
  const at::Tensor szc = sz.contiguous();
  // not std::vectors, which zeroed them first (memset was 1-2.5% of a 64-stream step)
  const std::unique_ptr<int8_t[]> xq(new int8_t[m * k]);
  const std::unique_ptr<float[]> dx(new float[m * groups]), xs(new float[m * groups]);
  quantize_input(x, xq.get(), dx.get(), xs.get(), m, k, group);
  const float *dxp = dx.get(), *xsp = xs.get();
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq.get());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::BFloat16* zp = szc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t nb = n / 64;
  // BALANCE: work items are halves of a block (of its outputs at one to four rows, of its
  // rows from five), in order; the halves of a block that one thread takes both go to one
  // call. With two threads and an odd number of blocks (9 in a 576-output layer, 15 in
  // SmolLM2's qkv) one thread took a whole block more than the other and the other waited
  // (5:4 in o_proj and down_proj); now the middle block is shared, which costs one more
  // read of that block's bytes (the second thread starts with it and the first ends with
  // it, half a layer later, probably from L3) and one more unpack.
  if (m <= 4) {
    at::parallel_for(0, 2 * nb, 1, [&](int64_t i0, int64_t i1) {
      float out[4 * 64];
      for (int64_t i = i0; i < i1;) {
        const int64_t b = i / 2, e = std::min(i1, 2 * b + 2);
        const int half = e - i == 2 ? 0 : (i % 2 == 0 ? 1 : 2);
        const uint8_t* blk = cp + b * k * 32;
        const at::BFloat16* bsz = zp + b * 64 * 2;
        rows_dispatch(m, half, xq4, dxp, xsp, blk, bsz, out, n, k, group);
        const int64_t o0 = half == 2 ? 32 : 0, width = half == 0 ? 64 : 32;
        for (int64_t r = 0; r < m; ++r) narrow(out + r * 64 + o0, yp + r * n + b * 64 + o0, width);
        i = e;
      }
    });
    return y;
  }
  // work items: (row tile of up to 128, block of 64 outputs, half of the tile's rows), the
  // blocks of one tile adjacent. The tiles are of equal size (to 4 rows): each thread takes
  // a contiguous range of items, and a 128-row tile beside a 16-row one (144 rows: a
  // prefill chunk and 16 decodes) gave one thread most of the work (a 16-decode step with
  // a 128-token prompt took 150 ms where the two apart took 100). A row's bits do not
  // depend on which rows it is computed with.
  const int64_t tiles = (m + 127) / 128, tile = ((m + tiles - 1) / tiles + 3) / 4 * 4;
  at::parallel_for(0, 2 * nb * tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t item = i / 2, e = std::min(i1, 2 * item + 2);
      const int64_t t0 = (item / nb) * tile, t1 = std::min(m, t0 + tile);
      const int64_t mid = std::min(t1, t0 + ((t1 - t0) / 2 + 3) / 4 * 4);
      const int64_t r0 = i % 2 ? mid : t0, r1 = e - i == 2 || i % 2 ? t1 : mid;
      if (r1 > r0)
        (r1 - r0 < TILE_BLOCK_ROWS ? int4_tile_groups : int4_tile_block)(
            xq4, dxp, xsp, cp, zp, yp, item % nb, r0, r1, n, k, group);
      i = e;
    }
  });
#endif
  return y;
}

// y [M, N] = (x W^T) * scale for an int8 layer (w [N, K], one scale per output row), read
// once per four rows of x, in float32.
template <int R, typename T>
static void int8_rows(const float* x, const int8_t* w, const T* scales, T* y, int64_t n0,
                      int64_t n1, int64_t n, int64_t k) {
  for (int64_t o = n0; o < n1; ++o) {
    const int8_t* wr = w + o * k;
    float acc[R] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float wv = static_cast<float>(wr[i]);
      for (int r = 0; r < R; ++r) acc[r] += x[r * k + i] * wv;
    }
    const float s = static_cast<float>(scales[o]);
    for (int r = 0; r < R; ++r) y[r * n + o] = static_cast<T>(acc[r] * s);
  }
}

#if defined(__AVX512BF16__)
// With bfloat16 inputs: each int8 weight row is widened to bfloat16 once (exact: int8 values
// are bfloat16 numbers) and dotted with every row of x by vdpbf16ps, 32 products per
// instruction, summed in float32: the same products and sums as above, about twice as
// many per instruction as float32 multiply-adds.
// Two weight rows at once (w0, w1: steps vectors apart), each x load used twice.
template <int R>
static inline void bf16_dots(const __m512i* wv, int64_t steps, const at::BFloat16* x,
                              int64_t k, float* out0, float* out1) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < steps; ++t) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(wv + t);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(wv + steps + t);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + 32 * t);
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, xv);
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    out0[r] = _mm512_reduce_add_ps(a0[r]);
    out1[r] = _mm512_reduce_add_ps(a1[r]);
  }
}

static inline void widen_row(const int8_t* wr, int64_t steps, __m512i* wv) {
  for (int64_t t = 0; t < steps; ++t) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * t));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    wv[t] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

static void int8_matmul_bf16(const at::BFloat16* x, const int8_t* w, const at::BFloat16* sc,
                             at::BFloat16* y, int64_t m, int64_t n, int64_t k) {
  const int64_t steps = k / 32;
  at::parallel_for(0, (n + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    std::vector<__m512i> wv(2 * steps);
    float d0[6], d1[6];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t o = 2 * p;
      const bool pair = o + 1 < n;
      widen_row(w + o * k, steps, wv.data());     // an odd last row is paired with itself
      widen_row(w + (pair ? o + 1 : o) * k, steps, wv.data() + steps);
      const float s0 = static_cast<float>(sc[o]), s1 = pair ? static_cast<float>(sc[o + 1]) : 0.f;
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const at::BFloat16* xr = x + r0 * k;
        const int64_t rows = std::min<int64_t>(6, m - r0);
        switch (rows) {
          case 1: bf16_dots<1>(wv.data(), steps, xr, k, d0, d1); break;
          case 2: bf16_dots<2>(wv.data(), steps, xr, k, d0, d1); break;
          case 3: bf16_dots<3>(wv.data(), steps, xr, k, d0, d1); break;
          case 4: bf16_dots<4>(wv.data(), steps, xr, k, d0, d1); break;
          case 5: bf16_dots<5>(wv.data(), steps, xr, k, d0, d1); break;
          default: bf16_dots<6>(wv.data(), steps, xr, k, d0, d1);
        }
        for (int64_t r = 0; r < rows; ++r) {
          y[(r0 + r) * n + o] = static_cast<at::BFloat16>(d0[r] * s0);
          if (pair) y[(r0 + r) * n + o + 1] = static_cast<at::BFloat16>(d1[r] * s1);
        }
      }
    }
  });
}
#endif

static at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.size(1) == k);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && k % 32 == 0 && m > 1) {
    const at::Tensor xc = x.contiguous(), sc = scales.to(at::kBFloat16).contiguous();
    at::Tensor y = at::empty({m, n}, x.options());
    int8_matmul_bf16(xc.data_ptr<at::BFloat16>(), w.data_ptr<int8_t>(),
                     sc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), m, n, k);
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous(), sc = scales.to(x.scalar_type());
  at::Tensor y = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8mm", [&] {
    using T = scalar_t;
    const float* xp = xf.data_ptr<float>();
    const int8_t* wp = w.data_ptr<int8_t>();
    const T* sp = sc.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float* xr = xp + r0 * k;
        T* yr = yp + r0 * n;
        switch (std::min<int64_t>(4, m - r0)) {
          case 1: int8_rows<1, T>(xr, wp, sp, yr, n0, n1, n, k); break;
          case 2: int8_rows<2, T>(xr, wp, sp, yr, n0, n1, n, k); break;
          case 3: int8_rows<3, T>(xr, wp, sp, yr, n0, n1, n, k); break;
          default: int8_rows<4, T>(xr, wp, sp, yr, n0, n1, n, k);
        }
      }
    });
  });
  return y;
}

// The lm_head with integer dot products (cpu_step.py's set_head): int8 weights [N, K], one
// scale per output row, against x rounded to int8 per group of 32 inputs as int4_matmul
// rounds it. Both kernels hold the weights repacked once in tiles of T outputs,
// [N/T][K/4][T outputs][4 inputs], so that one load is T/4 outputs' next four inputs
// each and x's four bytes are broadcast: outputs sit in lanes, nothing is summed across
// a vector, and a group's integer sums are scaled in float32 once per vector of outputs.
// flip adds 128 to each weight (vpdpbusd multiplies unsigned by signed bytes).
static at::Tensor pack_int8_tiles(const at::Tensor& w, int64_t tile, bool flip) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.dim() == 2);
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % tile == 0 && k % 32 == 0, "an int8 head's packing needs N a multiple of ",
              tile, " and K of 32");
  at::Tensor out = at::empty({n * k}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint8_t add = flip ? 0x80u : 0u;
  at::parallel_for(0, n / tile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < k / 4; ++s)
        for (int64_t o = 0; o < tile; ++o)
          for (int64_t i = 0; i < 4; ++i)
            dst[((t * (k / 4) + s) * tile + o) * 4 + i] =
                static_cast<uint8_t>(src[(t * tile + o) * k + 4 * s + i]) ^ add;
  });
  return out;
}

// int8_matmul_vnni's packing: tiles of 32 outputs (16 per 64-byte load), w + 128. The
// +128 comes back as one number per row, 128 d sum(xq) over its groups (quantize_rows'
// xsum): 2.2x the bf16 kernel above at 1 to 128 rows.
static at::Tensor pack_int8_vnni(const at::Tensor& w) { return pack_int8_tiles(w, 32, true); }

// int8_matmul_avx2's packing: tiles of 16 outputs (8 per 32-byte load), w as it is; a
// last partial tile padded with zero rows (any N: 50257 outputs stay on this kernel). A
// copy beside the module's own int8 weight: N x K bytes more (28 MB for SmolLM2's head).
static at::Tensor pack_int8_avx2(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_int8_avx2 takes an int8 weight [N, K]");
  const int64_t pad = (16 - w.size(0) % 16) % 16;
  if (pad == 0) return pack_int8_tiles(w.contiguous(), 16, false);
  return pack_int8_tiles(at::cat({w, at::zeros({pad, w.size(1)}, w.options())}), 16, false);
}

#if defined(TIERSERVE_INT4_AVX2)
// The lm_head on AVX2 (no VNNI), what int8_matmul_vnni computes where VNNI is, on
// pack_int8_avx2's tiles of 16 outputs. vpmaddubsw multiplies unsigned by signed bytes and
// saturates each pair's sum at int16, so a product is taken as |w| times x with w's sign
// (a pair at most 2 x 127 x 127: no saturation), then vpmaddwd sums pairs to int32. A
// group's 32 inputs are 8 steps of two loads, each used for R rows of x (one broadcast of
// x's four bytes serves both); each row's group sum is exact in int32 and scaled once by
// x's d in float32, per 8 outputs. Against the earlier layout (one output row per pass, a
// float scaling per group and row, a sum across the vector at the end): the head at 16
// and 64 rows in 0.68x the time, at one row 0.82x (Zen 3; docs/benchmarks.md).
// HEAD_PF: a tile's first pass asks for the bytes 1 KB ahead into L2 (the next tile's,
// past its end: a thread's tiles lie one after the other; the last tile asks for none).
// Each thread streams 14 MB of SmolLM2's head, crossing a 4 KB page every 64 steps, where
// the hardware prefetcher stops. At one row the head took 0.705x its time, the whole lone
// step 0.92x (2-core EPYC Zen 3); 8 KB ahead was no faster in the step, 512 B slower.
// Later passes (rows 5 on) find a tile in L1 while it fits (16 x K bytes: 9 KB for K 576).
constexpr int64_t HEAD_PF = 1024;
template <int R, typename Y>
static void int8_tile_avx2(const int8_t* wt, const int32_t* xq4, const float* dx,
                           const float* sc, Y* y, int64_t k, int64_t n, int64_t groups,
                           bool ahead) {
  const int64_t steps = k / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[R][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t s = g * 8; s < g * 8 + 8; ++s) {
      if (ahead)
        _mm_prefetch(reinterpret_cast<const char*>(wt + s * 64 + HEAD_PF), _MM_HINT_T1);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + s * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + s * 64 + 32));
      const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(xq4[r * steps + s]);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(
            _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(dx[r * groups + g]);
      tot[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), d, tot[r][0]);
      tot[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), d, tot[r][1]);
    }
  }
  const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
  for (int r = 0; r < R; ++r) {
    float v[16];
    _mm256_storeu_ps(v, _mm256_mul_ps(tot[r][0], s0));
    _mm256_storeu_ps(v + 8, _mm256_mul_ps(tot[r][1], s1));
    narrow(v, y + r * n, 16);
  }
}
#endif

// Whether int8_matmul_avx2 is compiled in (AVX2 without VNNI).
static bool int8_avx2() {
#if defined(TIERSERVE_INT4_AVX2)
  return true;
#else
  return false;
#endif
}

// int8_matmul_avx2's scales: float32, padded with zeros to whole tiles of 16 outputs. Kept
// so by the lean step's head (made once); given otherwise, made here each call.
static at::Tensor int8_avx2_scales(const at::Tensor& scales, int64_t n) {
  const int64_t padded = (n + 15) / 16 * 16;
  if (scales.scalar_type() == at::kFloat && scales.numel() == padded && scales.is_contiguous())
    return scales;
  TORCH_CHECK(scales.numel() == n, "int8_matmul_avx2 takes N scales, or N padded with "
              "zeros to a multiple of 16 in float32");
  at::Tensor sc = at::zeros({padded}, scales.options().dtype(at::kFloat));
  sc.narrow(0, 0, n).copy_(scales.reshape({n}));       // the padding's scales: 0
  return sc;
}

// y [M, N] = (x W^T) * scales from pack_int8_avx2's packing, x rounded to int8 per group
// of 32 (AVX2); scales [N] or int8_avx2_scales' float32 copy.
static at::Tensor int8_matmul_avx2(const at::Tensor& x, const at::Tensor& packed,
                                   const at::Tensor& scales, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32, tiles = (n + 15) / 16;
  TORCH_CHECK(x.dim() == 2 && packed.scalar_type() == at::kByte &&
              packed.numel() == tiles * 16 * k && k % 32 == 0,
              "int8_matmul_avx2 takes x [M, K] (K a multiple of 32) and an int8 weight "
              "[N, K] packed by pack_int8_avx2");
  TORCH_CHECK(int8_avx2(), "int8_matmul_avx2 is built on AVX2 CPUs without AVX-512 VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int8_matmul_avx2 takes bfloat16 or float32 x");
  const at::Tensor sc = int8_avx2_scales(scales, n);   // checks their count
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(TIERSERVE_INT4_AVX2)
  const std::unique_ptr<int8_t[]> xq(new int8_t[std::max<int64_t>(1, m * k)]);
  const std::unique_ptr<float[]> dx(new float[std::max<int64_t>(1, m * groups)]),
      xs(new float[std::max<int64_t>(1, m * groups)]);
  quantize_input(x, xq.get(), dx.get(), xs.get(), m, k, 32);
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq.get());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  const auto run = [&](auto* yp) {
    // a tile (16 outputs: 9 KB of SmolLM2's head, in L1) for every row of x in turn, so
    // that the head is read from memory once however many rows there are
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      using Y = std::remove_pointer_t<decltype(yp)>;
      Y part[4 * 16];                       // a partial last tile's outputs, then copied
      for (int64_t t = t0; t < t1; ++t) {
        const int8_t* wt = reinterpret_cast<const int8_t*>(wp + t * 16 * k);
        const int64_t width = std::min<int64_t>(16, n - t * 16);
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
          const int32_t* xr = xq4 + r0 * (k / 4);
          const float* dr = dx.get() + r0 * groups;
          const int64_t rows = std::min<int64_t>(4, m - r0);
          Y* yr = width == 16 ? yp + r0 * n + t * 16 : part;
          const int64_t stride = width == 16 ? n : 16;
          const bool ahead = r0 == 0 && t + 1 < tiles;  // the first pass reads it in
          switch (rows) {
            case 1: int8_tile_avx2<1>(wt, xr, dr, sp + t * 16, yr, k, stride, groups, ahead); break;
            case 2: int8_tile_avx2<2>(wt, xr, dr, sp + t * 16, yr, k, stride, groups, ahead); break;
            case 3: int8_tile_avx2<3>(wt, xr, dr, sp + t * 16, yr, k, stride, groups, ahead); break;
            default: int8_tile_avx2<4>(wt, xr, dr, sp + t * 16, yr, k, stride, groups, ahead);
          }
          if (width < 16)
            for (int64_t r = 0; r < rows; ++r)
              std::copy(part + r * 16, part + r * 16 + width, yp + (r0 + r) * n + t * 16);
        }
      }
    });
  };
  if (y.scalar_type() == at::kBFloat16)
    run(y.data_ptr<at::BFloat16>());
  else
    run(y.data_ptr<float>());
#endif
  return y;
}

// Whether int8_matmul_vnni is compiled in (its epilogue stores bfloat16 with AVX-512 BF16).
static bool int8_vnni() {
#if defined(TIERSERVE_VNNI) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(TIERSERVE_VNNI) && defined(__AVX512BF16__)
template <int R>
static inline void int8_tile_vnni(const uint8_t* wt, const int32_t* xq4, const float* dx,
                                  const float* corr, const float* sc, at::BFloat16* y,
                                  int64_t k, int64_t n, int64_t groups) {
  const int64_t steps = k / 4;
  __m512 tot[R][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t s = g * 8; s < g * 8 + 8; ++s) {
      const __m512i w0 = _mm512_loadu_si512(wt + s * 128);
      const __m512i w1 = _mm512_loadu_si512(wt + s * 128 + 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(xq4[r * steps + s]);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * groups + g]);
      tot[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), d, tot[r][0]);
      tot[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), d, tot[r][1]);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(tot[r][0], c), s0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(tot[r][1], c), s1)));
  }
}
#endif

// y [M, N] = (x W^T) * scales from pack_int8_vnni's packing, x rounded to int8 per group of 32.
static at::Tensor int8_matmul_vnni(const at::Tensor& x, const at::Tensor& packed,
                                   const at::Tensor& scales, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / 32;
  TORCH_CHECK(packed.numel() == n * k && n % 32 == 0 && k % 32 == 0);
  TORCH_CHECK(int8_vnni(), "int8_matmul_vnni needs AVX-512 VNNI and BF16");
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kBFloat16));
#if defined(TIERSERVE_VNNI) && defined(__AVX512BF16__)
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  const std::unique_ptr<int8_t[]> xq(new int8_t[m * k]);   // not zeroed: all written
  const std::unique_ptr<float[]> dx(new float[m * groups]), xs(new float[m * groups]);
  std::vector<float> corr(m, 0.f);
  quantize_input(x, xq.get(), dx.get(), xs.get(), m, k, 32);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) corr[r] += 128.f * xs[r * groups + g];
  const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq.get());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, n / 32, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = wp + t * 32 * k;
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const int32_t* xr = xq4 + r0 * (k / 4);
        const float* dr = dx.get() + r0 * groups;
        at::BFloat16* yr = yp + r0 * n + t * 32;
        switch (std::min<int64_t>(6, m - r0)) {
          case 1: int8_tile_vnni<1>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups); break;
          case 2: int8_tile_vnni<2>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups); break;
          case 3: int8_tile_vnni<3>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups); break;
          case 4: int8_tile_vnni<4>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups); break;
          case 5: int8_tile_vnni<5>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups); break;
          default: int8_tile_vnni<6>(wt, xr, dr, corr.data() + r0, sp + t * 32, yr, k, n, groups);
        }
      }
    }
  });
#endif
  return y;
}
"""
