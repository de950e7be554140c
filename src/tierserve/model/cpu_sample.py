"""Random sampling in one C++ pass per row: temperature, and top_p by a weighted selection.

NOTE: why. The sampler's torch path for a row at temperature T makes a scaled copy of
the logits, a softmax, a cumulative sum and a search, each a pass over the 49,152-token
vocabulary with its own allocation, plus a top-k search when top_p < 1. On a 2-core EPYC
that cost several times the greedy argmax per row, and it grows with the batch: it is
part of every decode step of a request that samples (OpenAI's default temperature is 1;
SmolLM2's generation defaults are 0.2 / top_p 0.9). benchmarks/sampler.py measures it.

NOTE: what a row does (`sample_rows(logits, temperatures, top_ps, uniforms)`)
    1. m = the row's largest logit, and each block of 16 logits' largest (one pass);
       e_i = exp((x_i - m) / T), Z = sum e_i, vectorized over runs of blocks, and a run
       of blocks whose largest logit is more than 32 T below m written as zeros without
       an exp (e^-32 times the whole vocabulary is below Z's float rounding): at SmolLM2's
       temperature 0.2 that skips about 96% of the vocabulary, at 1 about 1%. A banned
       token's -inf gets e_i = 0 exactly, so a masked token is never drawn.
    2. top_p = 1: the draw is the first i whose running sum of e reaches u Z, over the
       vocabulary in order (what torch's cumsum and searchsorted give).
    3. top_p < 1: the nucleus is the smallest set of largest e, in the order (value
       descending, index ascending), whose mass reaches p Z; a token is kept when the
       mass before it is below p Z, as the torch path keeps it. Only tokens with
       e_i >= v can be kept, for v = (1 - p) Z / V (every smaller one has at least
       Z - V v = p Z of mass before it), or tighter, the lowest v such that the blocks
       whose largest e is at least v hold p Z in those largest tokens alone (a histogram
       of the blocks' largest e by float exponent finds it). Those tokens alone are
       gathered; a quickselect weighted by mass finds the last one kept in linear time,
       without sorting, and the draw walks the kept ones in vocabulary order with u times
       their mass, as torch's path does.
    `uniforms` are in (0, 1] (the sampler draws them from each request's generator), so
    a draw always lands on a token with non-zero probability. Rows run in parallel, each
    thread with buffers kept from call to call.
"""

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace {

struct Candidate { float e; int32_t i; };

// (value descending, index ascending): a strict total order over one row's tokens.
static inline bool before(const Candidate& a, const Candidate& b) {
  return a.e > b.e || (a.e == b.e && a.i < b.i);
}

// The kept prefix of `c` in `before` order: moves the kept tokens to c[0, k) (in no
// particular order) and returns k and their mass. Kept: the mass before a token < need.
static std::pair<int64_t, double> nucleus(Candidate* c, int64_t size, double need) {
  int64_t lo = 0, hi = size;
  double acc = 0.0;                               // mass of c[0, lo): all kept
  while (hi - lo > 16) {
    const int64_t mid = lo + (hi - lo) / 2;       // median of three as the pivot
    Candidate a = c[lo], b = c[mid], d = c[hi - 1];
    if (before(b, a)) std::swap(a, b);
    if (before(d, b)) std::swap(b, d);
    if (before(b, a)) std::swap(a, b);
    const Candidate pivot = b;
    Candidate* split = std::partition(c + lo, c + hi,
                                      [&](const Candidate& x) { return before(x, pivot); });
    const int64_t at = split - c;         // c[at, hi) holds the pivot: put it at `at`
    for (int64_t j = at; j < hi; ++j)
      if (c[j].i == pivot.i) { std::swap(c[at], c[j]); break; }
    double upper = 0.0;
    for (int64_t j = lo; j < at; ++j) upper += c[j].e;
    if (acc + upper >= need) {
      hi = at;                                    // the boundary is among the larger ones
    } else if (acc + upper + pivot.e >= need) {
      return {at + 1, acc + upper + pivot.e};     // the pivot is the last one kept
    } else {
      acc += upper + pivot.e;
      lo = at + 1;
    }
  }
  std::sort(c + lo, c + hi, before);
  int64_t k = lo;
  for (; k < hi && acc < need; ++k) acc += c[k].e;
  return {k, acc};
}

constexpr int KEY_SHIFT = 19;   // a bin: a float's sign, exponent and top 4 mantissa bits
constexpr int BINS = (0x3f800000 >> KEY_SHIFT) + 1;   // every e in [0, 1]

static inline uint32_t key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits >> KEY_SHIFT;    // e >= 0: the bits order as the values do
}

constexpr int64_t BLOCK = 16;    // one AVX-512 vector, two AVX2 ones
constexpr float CUT = 32.0f;     // e^-32 x 2^31 tokens < 2^-24: below Z's float rounding

// The first i in [0, n) where the running sum of e reaches `target`, or -1 if the sum
// stays short. Whole blocks are summed in vector code first; only the block where the
// sum crosses is walked one by one.
static int64_t walk(const float* e, int64_t n, double target, double& acc) {
  for (int64_t b = 0; b < n; b += 4 * BLOCK) {
    const int64_t end = std::min(n, b + 4 * BLOCK);
    float block = 0.0f;
    for (int64_t i = b; i < end; ++i) block += e[i];
    if (acc + block < target) { acc += block; continue; }
    for (int64_t i = b; i < end; ++i) {
      acc += e[i];
      if (acc >= target && e[i] > 0.0f) return i;
    }
  }
  return -1;
}

static int64_t last_kept(const float* e, int64_t n) {
  for (int64_t i = n - 1; i >= 0; --i)
    if (e[i] > 0.0f) return i;
  return 0;
}

// Each whole block's largest value into bm, and the row's largest value.
static float block_maxima(const float* x, int64_t n, float* bm) {
  float m = x[0];
  const int64_t blocks = n / BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    float top = x[b * BLOCK];
    for (int64_t i = b * BLOCK + 1; i < (b + 1) * BLOCK; ++i) top = x[i] > top ? x[i] : top;
    bm[b] = top;
    m = top > m ? top : m;
  }
  for (int64_t i = blocks * BLOCK; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// e_i = exp((x_i - m) / T) over [lo, hi), 0 below the cut; returns their sum.
static float exp_range(const float* x, int64_t lo, int64_t hi, float m, float inv, float* e) {
  // Two loops, so the compiler cannot drop the clamp: glibc's vector exp sends every
  // lane past about -87 to its scalar exp, 8x slower at temperature 0.2.
  for (int64_t i = lo; i < hi; ++i) e[i] = std::exp(std::max((x[i] - m) * inv, -CUT));
  float z = 0.0f;
  for (int64_t i = lo; i < hi; ++i) {
    const float v = (x[i] - m) * inv < -CUT ? 0.0f : e[i];
    e[i] = v;
    z += v;
  }
  return z;
}

// exp_range over the row, runs of blocks wholly below the cut written as zeros without
// an exp: at temperature 0.2 that is about 96% of SmolLM2's vocabulary, at 1 about 1%.
static float exps(const float* x, int64_t n, float m, float inv, const float* bm, float* e) {
  const int64_t blocks = n / BLOCK;
  float z = 0.0f;
  for (int64_t b = 0; b < blocks;) {
    const int64_t first = b;
    const bool dead = (bm[b] - m) * inv < -CUT;
    while (b < blocks && ((bm[b] - m) * inv < -CUT) == dead) ++b;
    if (dead)
      std::memset(e + first * BLOCK, 0, (b - first) * BLOCK * sizeof(float));
    else
      z += exp_range(x, first * BLOCK, b * BLOCK, m, inv, e);
  }
  return z + exp_range(x, blocks * BLOCK, n, m, inv, e);
}

static int64_t sample_row(const float* x, int64_t n, float t, float p, float u,
                          float* e, float* bm, float* hist, Candidate* cand,
                          Candidate* sel) {
  const float m = block_maxima(x, n, bm);
  const float inv = 1.0f / t;
  const float z = exps(x, n, m, inv, bm, e);
  if (!(z > 0.0f)) return 0;                      // a row of NaN: nothing to draw from
  double acc = 0.0;
  if (p >= 1.0f) {
    const int64_t i = walk(e, n, static_cast<double>(u) * z, acc);
    return i >= 0 ? i : last_kept(e, n);          // rounding left the sum short of u Z
  }
  // Only tokens with e >= (1 - p) Z / n can be kept (halved: rounding). A tighter bound
  // from the blocks' largest values: where the blocks whose largest e is at least v hold
  // p Z in those largest tokens alone, every token below v has that much mass before it.
  const int64_t blocks = n / BLOCK;
  const double need = static_cast<double>(p) * z;
  float floor = 0.5f * (1.0f - p) * z / static_cast<float>(n);
  std::fill(hist, hist + BINS, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float arg = (bm[b] - m) * inv;
    const float eb = std::exp(std::max(arg, -CUT));
    hist[key(eb)] += arg < -CUT ? 0.0f : eb;
  }
  double held = 0.0;
  for (int64_t bin = BINS - 1; bin > 0; --bin) {
    held += hist[bin];
    if (held >= need) {                           // the bin's lowest value is such a v
      const uint32_t bits = static_cast<uint32_t>(bin) << KEY_SHIFT;
      float lowest;
      std::memcpy(&lowest, &bits, sizeof lowest);
      floor = std::max(floor, lowest);
      break;
    }
  }
  // The candidates, in vocabulary order, from the blocks whose largest value reaches it.
  const float x_floor = m + t * std::log(floor) - 1e-3f * t;
  int64_t count = 0;
  for (int64_t b = 0; b <= blocks; ++b) {
    if (b < blocks && bm[b] < x_floor) continue;
    const int64_t end = b < blocks ? (b + 1) * BLOCK : n;
    for (int64_t i = b * BLOCK; i < end; ++i) {
      cand[count] = {e[i], static_cast<int32_t>(i)};
      count += e[i] >= floor;
    }
  }
  std::copy(cand, cand + count, sel);
  const auto [k, mass] = nucleus(sel, count, need);
  Candidate last = sel[0];                        // the last kept in `before` order
  for (int64_t j = 1; j < k; ++j)
    if (before(last, sel[j])) last = sel[j];
  // The draw over the kept tokens in vocabulary order, as torch's cumsum makes it.
  const double target = static_cast<double>(u) * mass;
  int64_t hit = last.i;
  for (int64_t j = 0; j < count; ++j) {
    if (!(before(cand[j], last) || cand[j].i == last.i)) continue;
    acc += cand[j].e;
    hit = cand[j].i;
    if (acc >= target) break;
  }
  return hit;
}

}  // namespace

static at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures,
                              const at::Tensor& top_ps, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_rows takes contiguous float32 rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t(1) << 31), "sample_rows: a row of 1 to 2^31 - 1 logits");
  for (const at::Tensor* v : {&temperatures, &top_ps, &uniforms})
    TORCH_CHECK(v->dim() == 1 && v->size(0) == rows && v->scalar_type() == at::kFloat
                && v->is_contiguous(), "sample_rows: one float32 per row");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float *t = temperatures.data_ptr<float>(), *p = top_ps.data_ptr<float>(),
              *u = uniforms.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    // each thread's buffers, kept from call to call (a fresh 1 MB a call was page faults)
    thread_local std::vector<float> e, bm, hist(BINS);
    thread_local std::vector<Candidate> cand, sel;
    if (static_cast<int64_t>(e.size()) < n) {
      e.resize(n); bm.resize(n / BLOCK + 1); cand.resize(n); sel.resize(n);
    }
    for (int64_t r = r0; r < r1; ++r)
      idx[r] = sample_row(x + r * n, n, t[r], p[r], u[r], e.data(), bm.data(), hist.data(),
                          cand.data(), sel.data());
  });
  return out;
}
"""
