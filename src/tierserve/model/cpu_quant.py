"""The C++ kernels of quantized linear layers, for the lean step (cpu_step.py): int4 and
int8 products read straight from quant.py's packed weights, and the 4-bit weight
dequantized to W^T for wide inputs.

NOTE: the 4- and 8-bit kernels. At a few rows a quantized layer is bound by reading its
weights; torch's int4 kernel read them at 10-19 GB/s here. `int4_matmul` reads each 32-byte
chunk of the packing once for up to four rows of x and sums with vpdpbusd (AVX-512 VNNI;
elsewhere float32 multiply-adds), at about 26 GB/s: 2.6 ms for SmolLM2-135M's 120 int4
layers at one row against torch's 4.1. `int8_matmul` does the same for int8 rows (the
4-bit model's lm_head: 0.9 ms against 1.7). Above `max_rows` a 4-bit layer dequantizes to
W^T once and runs one dense matmul.
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

// Decode steps (a few rows of x) against an int4 layer, straight from the packing: each
// (block, k) chunk of 32 bytes is unpacked once into 64 floats and used for up to four rows
// of x. Per group of inputs, sum_k x_k q_k is scaled by s and (z - 8 s) sum_k x_k added, so
// the dequantized weight is never formed; float32 throughout, rounded once.
template <int R, typename T>
static void int4_rows(const float* x, const float* xsum, const uint8_t* blk, const T* sz,
                      float* out, int64_t n, int64_t k, int64_t group) {
  float acc[R][64], tot[R][64] = {};
  for (int64_t g = 0; g < k / group; ++g) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 64; ++j) acc[r][j] = 0.f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const uint8_t* src = blk + i * 32;
      float q[64];
      for (int j = 0; j < 32; ++j) {
        q[j] = static_cast<float>(src[j] & 15);
        q[32 + j] = static_cast<float>(src[j] >> 4);
      }
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * k + i];
        for (int j = 0; j < 64; ++j) acc[r][j] += xv * q[j];
      }
    }
    const T* p = sz + g * n * 2;
    for (int j = 0; j < 64; ++j) {
      const float s = static_cast<float>(p[2 * j]), z = static_cast<float>(p[2 * j + 1]) - 8.f * s;
      for (int r = 0; r < R; ++r) tot[r][j] += s * acc[r][j] + z * xsum[r * (k / group) + g];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 64; ++j) out[r * 64 + j] = tot[r][j];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIERSERVE_VNNI 1
// The same product with integer dot products, as llama.cpp computes its 4-bit formats: x
// is rounded to int8 per group of 32 inputs (xq, scale d: x ~ d xq), and vpdpbusd sums four
// (u4 weight x s8 input) products per 32-bit lane. The packing holds 64 rows per (block, k);
// four consecutive k are interleaved by bytes so that each lane holds one row's four, then
// split into low (rows 0..31) and high (32..63) nibbles. Lanes come out in the order
// [0-3, 16-19, 4-7, 20-23] / [8-11, 24-27, 12-15, 28-31] (+32 for the high nibbles) and are
// put back in row order once per group, where s and z are applied:
//   y_j += s_j d sum(xq q) + (z_j - 8 s_j) sum(x)
// xq4: [R][k/4] the int8 inputs four to an int32; dx: [R][groups] d; xsum: [R][groups].
template <int R>
static void int4_rows_vnni(const int32_t* xq4, const float* dx, const float* xsum,
                           const uint8_t* blk, const at::BFloat16* sz, float* out, int64_t n,
                           int64_t k, int64_t group) {
  const int64_t groups = k / group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lo_rows = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi_rows = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
    for (int64_t i = g * group; i < (g + 1) * group; i += 4) {
      const uint8_t* src = blk + i * 32;
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
      const __m512i w[4] = {_mm512_and_si512(z0, low), _mm512_and_si512(z1, low),
                            _mm512_and_si512(_mm512_srli_epi16(z0, 4), low),
                            _mm512_and_si512(_mm512_srli_epi16(z1, 4), low)};
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xq4[r * (k / 4) + i / 4]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xv);
      }
    }
    // s and z of this group's 64 rows: (s, z) bf16 pairs, one per 32-bit lane
    const int32_t* p = reinterpret_cast<const int32_t*>(sz + g * n * 2);
    __m512 s[4], z[4];
    for (int v = 0; v < 4; ++v) {
      const __m512i pair = _mm512_loadu_si512(p + 16 * v);
      s[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      z[v] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s[v],
                              _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(-65536))));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * groups + g]), xs = _mm512_set1_ps(xsum[r * groups + g]);
      const __m512i rows[4] = {_mm512_permutex2var_epi32(acc[r][0], lo_rows, acc[r][1]),
                               _mm512_permutex2var_epi32(acc[r][0], hi_rows, acc[r][1]),
                               _mm512_permutex2var_epi32(acc[r][2], lo_rows, acc[r][3]),
                               _mm512_permutex2var_epi32(acc[r][2], hi_rows, acc[r][3])};
      for (int v = 0; v < 4; ++v)
        tot[r][v] = _mm512_fmadd_ps(_mm512_mul_ps(s[v], d), _mm512_cvtepi32_ps(rows[v]),
                                    _mm512_fmadd_ps(z[v], xs, tot[r][v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * 64 + 16 * v, tot[r][v]);
}
#endif

// y [M, N] = x W^T for an int4 layer in torch's CPU packing, without dequantizing it.
static at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                              int64_t group) {
  const int64_t m = x.size(0), k = x.size(1), n = sz.size(1), groups = k / group;
  TORCH_CHECK(n % 64 == 0 && codes.numel() == n * k / 2 && k % group == 0,
              "not torch's CPU int4 packing");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), szc = sz.contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum(m * groups, 0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xsum[r * groups + i / group] += xp[r * k + i];
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef TIERSERVE_VNNI
  if (sz.scalar_type() == at::kBFloat16 && group % 4 == 0) {
    std::vector<int8_t> xq(m * k);
    std::vector<float> dx(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = xp + r * k + g * group;
        float amax = 0.f;
        for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::abs(xg[i]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        dx[r * groups + g] = d;
        int32_t sum = 0;
        for (int64_t i = 0; i < group; ++i) {
          xq[r * k + g * group + i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
          sum += xq[r * k + g * group + i];
        }
        // the rounded inputs' sum, not x's: w = s q + (z - 8 s) is a small difference of
        // two large terms, and only the same inputs in both keep it one
        xsum[r * groups + g] = d * static_cast<float>(sum);
      }
    const int32_t* xq4 = reinterpret_cast<const int32_t*>(xq.data());
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const at::BFloat16* zp = szc.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, n / 64, 1, [&](int64_t b0, int64_t b1) {
      float out[4 * 64];
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
          const int32_t* xr = xq4 + r0 * (k / 4);
          const float* dr = dx.data() + r0 * groups;
          const float* sr = xsum.data() + r0 * groups;
          const uint8_t* blk = cp + b * k * 32;
          const at::BFloat16* bsz = zp + b * 64 * 2;
          const int64_t rows = std::min<int64_t>(4, m - r0);
          switch (rows) {
            case 1: int4_rows_vnni<1>(xr, dr, sr, blk, bsz, out, n, k, group); break;
            case 2: int4_rows_vnni<2>(xr, dr, sr, blk, bsz, out, n, k, group); break;
            case 3: int4_rows_vnni<3>(xr, dr, sr, blk, bsz, out, n, k, group); break;
            default: int4_rows_vnni<4>(xr, dr, sr, blk, bsz, out, n, k, group);
          }
          for (int64_t r = 0; r < rows; ++r) narrow(out + r * 64, yp + (r0 + r) * n + b * 64, 64);
        }
      }
    });
    return y;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4mm", [&] {
    using T = scalar_t;
    const T* zp = szc.data_ptr<T>();
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, n / 64, 1, [&](int64_t b0, int64_t b1) {
      float out[4 * 64];
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = cp + b * k * 32;
        const T* bsz = zp + b * 64 * 2;
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
          const float* xr = xp + r0 * k;
          const float* sr = xsum.data() + r0 * groups;
          const int64_t rows = std::min<int64_t>(4, m - r0);
          switch (rows) {
            case 1: int4_rows<1, T>(xr, sr, blk, bsz, out, n, k, group); break;
            case 2: int4_rows<2, T>(xr, sr, blk, bsz, out, n, k, group); break;
            case 3: int4_rows<3, T>(xr, sr, blk, bsz, out, n, k, group); break;
            default: int4_rows<4, T>(xr, sr, blk, bsz, out, n, k, group);
          }
          for (int64_t r = 0; r < rows; ++r) narrow(out + r * 64, yp + (r0 + r) * n + b * 64, 64);
        }
      }
    });
  });
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

static at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.size(1) == k);
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
"""
