"""Random sampling in one C++ pass per row: temperature, and top_p by a weighted selection.

NOTE: why. The sampler's torch path for a row at temperature T makes a scaled copy of
the logits, a softmax, a cumulative sum and a search, each a pass over the 49,152-token
vocabulary with its own allocation, plus a top-k search when top_p < 1. On a 2-core EPYC
that cost several times the greedy argmax per row, and it grows with the batch: it is
part of every decode step of a request that samples (OpenAI's default temperature is 1;
SmolLM2's generation defaults are 0.2 / top_p 0.9). benchmarks/sampler.py measures it.

NOTE: what a row does (`sample_rows(logits, temperatures, top_ps, uniforms)`)
    1. m = the row's largest logit; e_i = exp((x_i - m) / T), Z = sum e_i (one pass,
       vectorized). A logit more than 80 T below m (a banned token's -inf among them)
       gets e_i = 0 exactly, so a masked token is never drawn.
    2. top_p = 1: the draw is the first i whose running sum of e reaches u Z, over the
       vocabulary in order (what torch's cumsum and searchsorted give).
    3. top_p < 1: the nucleus is the smallest set of largest e, in the order (value
       descending, index ascending), whose mass reaches p Z; a token is kept when the
       mass before it is below p Z, as the torch path keeps it. Only tokens with
       e_i >= (1 - p) Z / V can be kept (every smaller one has at least Z - V t >= p Z of
       mass before it), so they alone are gathered; a quickselect weighted by mass then
       finds the boundary in linear time, without sorting. The draw is made over the kept
       tokens in the order the selection leaves them, with u times their mass.
    `uniforms` are in (0, 1] (the sampler draws them from each request's generator), so
    a draw always lands on a token with non-zero probability. Rows run in parallel.
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
constexpr int64_t BLOCK = 64;

static inline uint32_t key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits >> KEY_SHIFT;    // e >= 0: the bits order as the values do
}

// The first i in [0, n) where the running sum of the kept e reaches `target` (kept: key
// above `above`, all when above < 0), or -1 if the sum stays short. Whole blocks are
// summed in vector code first; only the block where the sum crosses is walked one by one.
static int64_t walk(const float* e, int64_t n, double target, int64_t above, double& acc) {
  for (int64_t b = 0; b < n; b += BLOCK) {
    const int64_t end = std::min(n, b + BLOCK);
    float block = 0.0f;
    for (int64_t i = b; i < end; ++i)
      block += (above < 0 || static_cast<int64_t>(key(e[i])) > above) ? e[i] : 0.0f;
    if (acc + block < target) { acc += block; continue; }
    for (int64_t i = b; i < end; ++i) {
      if (above < 0 || static_cast<int64_t>(key(e[i])) > above) {
        acc += e[i];
        if (acc >= target && e[i] > 0.0f) return i;
      }
    }
  }
  return -1;
}

static int64_t last_kept(const float* e, int64_t n, int64_t above) {
  for (int64_t i = n - 1; i >= 0; --i)
    if (e[i] > 0.0f && (above < 0 || static_cast<int64_t>(key(e[i])) > above)) return i;
  return 0;
}

static int64_t sample_row(const float* x, int64_t n, float t, float p, float u,
                          std::vector<float>& e, std::vector<Candidate>& cand,
                          std::vector<float>& hist) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  const float inv = 1.0f / t;
  // Two loops, so the compiler cannot drop the clamp: glibc's vector exp sends every
  // lane past about -87 to its scalar exp, 8x slower at temperature 0.2.
  for (int64_t i = 0; i < n; ++i) e[i] = std::exp(std::max((x[i] - m) * inv, -80.0f));
  float z = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = (x[i] - m) * inv < -80.0f ? 0.0f : e[i];
    e[i] = v;
    z += v;
  }
  if (!(z > 0.0f)) return 0;                      // a row of NaN: nothing to draw from
  double acc = 0.0;
  if (p >= 1.0f) {
    const int64_t i = walk(e.data(), n, static_cast<double>(u) * z, -1, acc);
    return i >= 0 ? i : last_kept(e.data(), n, -1);  // rounding left the sum short of u Z
  }
  // The mass of each bin, in two interleaved copies (neighbours often share a bin).
  std::fill(hist.begin(), hist.end(), 0.0f);
  float* h0 = hist.data();
  float* h1 = hist.data() + BINS;
  int64_t i = 0;
  for (; i + 1 < n; i += 2) { h0[key(e[i])] += e[i]; h1[key(e[i + 1])] += e[i + 1]; }
  if (i < n) h0[key(e[i])] += e[i];
  const double need = static_cast<double>(p) * z;
  double above = 0.0;
  int64_t edge = BINS - 1;                        // the bin where the mass reaches p Z
  for (; edge > 0; --edge) {
    const double here = static_cast<double>(h0[edge]) + h1[edge];
    if (above + here >= need) break;
    above += here;
  }
  Candidate* c = cand.data();                     // the edge bin's tokens: some are kept
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {               // written always, counted when in the bin
    c[count] = {e[j], static_cast<int32_t>(j)};
    count += static_cast<int64_t>(key(e[j])) == edge && e[j] > 0.0f;
  }
  const auto [k, edge_mass] = nucleus(c, count, need - above);
  const double target = static_cast<double>(u) * (above + edge_mass);
  const int64_t hit = walk(e.data(), n, target, edge, acc);   // the bins above the edge
  if (hit >= 0) return hit;
  for (int64_t j = 0; j < k; ++j) {               // then the edge bin's kept tokens
    acc += c[j].e;
    if (acc >= target) return c[j].i;
  }
  return k ? c[k - 1].i : last_kept(e.data(), n, edge);
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
    std::vector<float> e(n), hist(2 * BINS);
    std::vector<Candidate> cand(n);
    for (int64_t r = r0; r < r1; ++r)
      idx[r] = sample_row(x + r * n, n, t[r], p[r], u[r], e, cand, hist);
  });
  return out;
}
"""
