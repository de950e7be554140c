"""The lean step: a Llama model's whole forward pass (every layer) in one C++ call.

NOTE: why. At one sequence a decode step of SmolLM2-135M spent about 7 ms of its 19 ms
outside the weight reads: some 40 PyTorch operators per layer, each a Python call and a
dispatch (the RMSNorm alone decomposes into eight, 35 us per call), times 30 layers. Here
each layer is four linear calls and four fused loops, driven from C++:

    x = rmsnorm(h)                       (fused with the previous layer's residual add)
    qkv = linear(x)
    rope(q), rope(k); k, v -> paged cache   (one pass over the row)
    attention: by the paged kernel (cpu_attention), each position a query over its own
               context (the runner sends prompt rows so too, except over an int8 KV
               cache, where prefill chunks take SDPA; worker/model_runner.py's _paged)
    h += linear(attn); x = rmsnorm(h)    (one pass)
    x = silu(gate) * up                  (one pass)
    m = linear(x); the next layer's norm adds it to h

The linears are the same ones the Python model holds: oneDNN's packed bfloat16
(cpu_linear.py), a dense matmul, cpu_quant.py's kernels over quant.py's packed int4 and int8
weights (on a CPU with AMX, above DENSE_ROWS rows, a bfloat16 copy of those weights that
oneDNN runs on AMX tiles: `dense_copies`), or, for anything else (an int8 layer over its
dequantize threshold), the Python module itself. The math matches the Python path's up
to rounding: the fused loops compute in float32 and round once, where the torch ops round
after each operator; and the 4-bit kernel rounds its inputs to int8 per group of 32, as
llama.cpp does for its 4-bit formats (measured against float32 in docs/benchmarks.md; the
AMX copies do not, so a step's width decides which rounding a row gets).

The GIL is released for the step (taken back only for a Python-module linear), so the
server's event loop keeps answering while the engine thread computes.

Llama-shaped models only: no q/k norms, no output norms, no sliding window, SiLU, the
standard attention scale (Gemma 3 keeps the Python path). Compiled with the decode kernel
as one extension (model/kernels.py), after the 4- and 8-bit kernels (cpu_quant.py). About
690 lines because the C++ source is one string with the extension's bindings (and the
greedy argmax the sampler takes from it, `argmax_rows`) at its end, and the helpers that
build the KV caches (bf16 or int8, `new_kv_caches`) and decode teacher-forced for quality
checks (`decode_logits`), and choose its AMX copies (`dense_copies`), sit beside the step
they feed.
"""

import torch
from torch import Tensor, nn

from tierserve.model.shapes import ModelShape

SOURCE = r"""
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <pybind11/stl.h>
#include <optional>

namespace py = pybind11;

enum LinearKind : int64_t { ONEDNN = 0, INT8 = 1, INT4 = 2, DENSE = 3, MODULE = 4 };

static inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 8192 / width); }

struct LeanLinear {
  int64_t kind;
  at::Tensor w, aux;                   // aux: int8 scales or int4 (s, z) pairs
  std::optional<at::Tensor> bias;
  int64_t group, max_rows;             // kernel kinds: above max_rows, dequantize (int4
                                       // here, int8 by the module) and run a dense matmul
  py::object module;
  at::Tensor vnni;                     // the head's int8 weight in pack_int8_vnni's packing
  at::Tensor avx2;                     // ... in pack_int8_avx2's (AVX2, no VNNI)
  at::Tensor avx2_scales;              // and its scales as that kernel reads them
  at::Tensor blocked;                  // an int4 layer's pairs in block order (AVX2;
                                       // int4_blocked_scales)
  at::Tensor dense;                    // a kernel kind's weight in bfloat16, packed by
  int64_t dense_rows = 0;              // oneDNN: run above dense_rows (AMX; DENSE_ROWS)

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (dense.defined() && rows > dense_rows) return onednn_linear(x, dense, bias);
    at::Tensor y;
    // whole blocks of 64 rows (two of the 32-row blocks torch packs on an AVX2 CPU)
    const bool blocks = kind == INT4 && aux.size(1) % 64 == 0;
    if (vnni.defined()) {
      y = int8_matmul_vnni(x, vnni, aux, w.size(0));
    } else if (avx2.defined()) {
      y = int8_matmul_avx2(x, avx2, avx2_scales, w.size(0));
    } else if (blocks && int4_fast(aux, group)) {
      y = int4_matmul(x, w, blocked.defined() ? blocked : aux, group);
    } else if (blocks && rows > max_rows) {    // wide x, no VNNI: dequantize once, dense
      y = at::mm(x, dequantize_int4_t_dense(w, aux, group));
    } else if (kind == INT4 && rows <= max_rows) {
      y = at::_weight_int4pack_mm_for_cpu(x, w, group, aux);
    } else if (kind == INT8 && rows <= max_rows) {
      y = int8_matmul(x, w, aux);
    } else if (kind == INT4 || kind == INT8 || kind == MODULE) {
      py::gil_scoped_acquire gil;
      return module(x).cast<at::Tensor>();
    }
    if (y.defined()) {
      if (bias.has_value()) y.add_(*bias);
      return y;
    }
    if (kind == ONEDNN) return onednn_linear(x, w, bias);
    return at::linear(x, w, bias);            // DENSE
  }

  // x W^T + bias with W packed by torch.ops.mkldnn._reorder_linear_weight.
  static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                                  const std::optional<at::Tensor>& bias) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
        "mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack;
    stack.emplace_back(x);
    stack.emplace_back(packed);
    stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

// h += a (rounded as the model's dtype, like torch's add), then x = rmsnorm(h) * w.
// With `a` undefined, only the norm.
template <typename T>
static void add_rmsnorm(T* h, const T* a, const T* w, T* x, int64_t rows, int64_t n,
                        float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> hf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * n;
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        float v = static_cast<float>(hr[i]);
        if (a) { hr[i] = static_cast<T>(v + static_cast<float>(a[r * n + i])); v = static_cast<float>(hr[i]); }
        hf[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / n + eps);
      for (int64_t i = 0; i < n; ++i) x[r * n + i] = static_cast<T>(hf[i] * inv * static_cast<float>(w[i]));
    }
  });
}

// A head's d values into the 8-bit cache (quantize_i8: int8 on one float32 scale), and back
// into x as the values they stand for, so a fresh prefill chunk attends to the keys and
// values the cache holds, as a later chunk or a decode will (an answer does not depend on
// whether its prompt was cached or where a chunk split it).
template <typename T>
static inline void store_head(T* x, int8_t* dst, float* scale, int64_t d) {
  *scale = quantize_i8(x, dst, d);
  for (int64_t i = 0; i < d; ++i) x[i] = static_cast<T>(static_cast<float>(dst[i]) * *scale);
}
template <typename T>
static inline void store_head(T* x, T* dst, float*, int64_t d) {
  std::memcpy(dst, x, d * sizeof(T));
}

// Rotate-half RoPE of q and k from a qkv row; q to its own buffer, k back in place and, with
// v, into the paged cache at the token's slot. cos/sin: float32 [rows, d], sin signed. C: the
// cache's element type, T or int8_t (then ks / vs take each head's scale).
template <typename T, typename C>
static void rope_store(T* qkv, T* q, const float* cos, const float* sin, const int64_t* slots,
                       C* kc, C* vc, float* ks, float* vs, int64_t rows, int64_t nh,
                       int64_t nkv, int64_t d) {
  const int64_t width = (nh + 2 * nkv) * d, half = d / 2;
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(d);
    for (int64_t r = begin; r < end; ++r) {
      T* row = qkv + r * width;
      const float* c = cos + r * d;
      const float* s = sin + r * d;
      const int64_t slot = slots[r] * nkv;
      for (int64_t hd = 0; hd < nh + nkv; ++hd) {
        T* x = row + hd * d;
        for (int64_t i = 0; i < d; ++i) xf[i] = static_cast<float>(x[i]);
        T* dst = hd < nh ? q + (r * nh + hd) * d : x;
        for (int64_t i = 0; i < d; ++i)
          dst[i] = static_cast<T>(xf[i] * c[i] + xf[i < half ? i + half : i - half] * s[i]);
        if (hd >= nh) {
          const int64_t kh = slot + hd - nh;
          store_head(x, kc + kh * d, ks ? ks + kh : nullptr, d);
        }
      }
      for (int64_t kh = 0; kh < nkv; ++kh)
        store_head(row + (nh + nkv + kh) * d, vc + (slot + kh) * d,
                   vs ? vs + slot + kh : nullptr, d);
    }
  });
}

// out[r] = silu(gu[r, :n]) * gu[r, n:]
template <typename T>
static void silu_mul(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gv = static_cast<float>(g[i]);
        out[r * n + i] = static_cast<T>(gv / (1.f + std::exp(-gv)) * static_cast<float>(g[n + i]));
      }
    }
  });
}

struct LeanModel {
  int64_t hidden, nh, nkv, d;
  double eps;
  std::vector<at::Tensor> norms;       // per layer: input, mlp; then the final norm
  std::vector<LeanLinear> linears;     // per layer: qkv, o, gate_up, down
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<at::Tensor> k_scales, v_scales;  // the 8-bit cache's (int8 caches); else empty
  bool group_chunks = true;            // fresh prefill chunks of one length: one SDPA call

  LeanModel(int64_t hidden, int64_t nh, int64_t nkv, int64_t d, double eps,
            std::vector<at::Tensor> norms, std::vector<at::Tensor> k_caches,
            std::vector<at::Tensor> v_caches, std::vector<at::Tensor> k_scales,
            std::vector<at::Tensor> v_scales)
      : hidden(hidden), nh(nh), nkv(nkv), d(d), eps(eps), norms(std::move(norms)),
        k_caches(std::move(k_caches)), v_caches(std::move(v_caches)),
        k_scales(std::move(k_scales)), v_scales(std::move(v_scales)) {
    TORCH_CHECK(this->k_scales.size() == (int8() ? this->k_caches.size() : 0) &&
                this->v_scales.size() == this->k_scales.size(),
                "an int8 cache needs a scale tensor per layer, and only it");
  }

  bool int8() const { return !k_caches.empty() && k_caches[0].scalar_type() == at::kChar; }

  void add_linear(int64_t kind, at::Tensor w, at::Tensor aux, std::optional<at::Tensor> bias,
                  int64_t group, int64_t max_rows, py::object module) {
    linears.push_back({kind, w, aux, bias, group, max_rows, module, at::Tensor()});
#if defined(TIERSERVE_INT4_AVX2)
    if (kind == INT4 && aux.size(1) % 64 == 0 && int4_fast(aux, group))
      linears.back().blocked = int4_blocked_scales(aux);
#endif
  }

  // Layer `index` (add_linear's order; -1: the head) also runs `packed`, its weight in
  // bfloat16 packed by oneDNN, for inputs of more than `rows` rows.
  void set_dense(int64_t index, at::Tensor packed, int64_t rows) {
    TORCH_CHECK(index >= 0 || head.has_value(), "set the head before its copy");
    LeanLinear& l = index < 0 ? *head : linears.at(index);
    l.dense = packed;
    l.dense_rows = rows;
  }

  std::optional<LeanLinear> head;        // lm_head: logits = head(final normed hidden)

  void set_head(int64_t kind, at::Tensor w, at::Tensor aux, std::optional<at::Tensor> bias,
                int64_t group, int64_t max_rows, py::object module, bool round_input) {
    head = LeanLinear{kind, w, aux, bias, group, max_rows, module, at::Tensor()};
    // an int8 head (per-row scales, bfloat16 activations) on integer dot products where
    // the CPU has them and the body's layers already round x to int8 per group of 32
    // (4-bit weights on our kernel: body_rounds): the head's input is then rounded the same
    // way. A weight-only int8 model keeps bfloat16 activations in its head too (round_input
    // false).
    const bool body_rounds = int4_fast(at::empty({0}, at::kBFloat16), 32);
    if (round_input && kind == INT8 && int8_vnni() && w.size(0) % 32 == 0 &&
        w.size(1) % 32 == 0 && body_rounds &&
        aux.dim() == 1 && aux.scalar_type() == at::kBFloat16 && !bias.has_value())
      head->vnni = pack_int8_vnni(w);
    else if (round_input && kind == INT8 && int8_avx2() && w.size(1) % 32 == 0 &&
             aux.dim() == 1 && !bias.has_value() && body_rounds) {
      head->avx2 = pack_int8_avx2(w);
      head->avx2_scales = int8_avx2_scales(aux, w.size(0));
    }
  }

  at::Tensor logits(const at::Tensor& x) {
    TORCH_CHECK(head.has_value(), "no head set");
    py::gil_scoped_release nogil;
    return (*head)(x.contiguous());
  }

  // h: [T, hidden] embeddings (overwritten: it is the residual stream). Returns the final
  // normed hidden states.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     int64_t num_decodes, std::optional<at::Tensor> decode_tables,
                     std::optional<at::Tensor> decode_lens, std::vector<int64_t> starts,
                     std::vector<int64_t> ends, std::vector<std::optional<at::Tensor>> tables,
                     std::vector<std::optional<at::Tensor>> masks) {
    TORCH_CHECK(h.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
    TORCH_CHECK(cos.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong);
    py::gil_scoped_release nogil;
    const int64_t T = h.size(0), L = static_cast<int64_t>(k_caches.size());
    const int64_t q_size = nh * d, kv_size = nkv * d;
    at::Tensor x = at::empty_like(h);
    at::Tensor q = at::empty({T, nh, d}, h.options());
    at::Tensor m;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "lean", [&] {
      using T_ = scalar_t;
      add_rmsnorm<T_>(h.data_ptr<T_>(), nullptr, norms[0].data_ptr<T_>(), x.data_ptr<T_>(),
                      T, hidden, eps);
      for (int64_t l = 0; l < L; ++l) {
        const LeanLinear* lin = &linears[4 * l];
        at::Tensor qkv = lin[0](x).contiguous();
        if (int8())
          rope_store<T_, int8_t>(qkv.data_ptr<T_>(), q.data_ptr<T_>(), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), slots.data_ptr<int64_t>(),
                                 k_caches[l].data_ptr<int8_t>(), v_caches[l].data_ptr<int8_t>(),
                                 k_scales[l].data_ptr<float>(), v_scales[l].data_ptr<float>(),
                                 T, nh, nkv, d);
        else
          rope_store<T_, T_>(qkv.data_ptr<T_>(), q.data_ptr<T_>(), cos.data_ptr<float>(),
                             sin.data_ptr<float>(), slots.data_ptr<int64_t>(),
                             k_caches[l].data_ptr<T_>(), v_caches[l].data_ptr<T_>(), nullptr,
                             nullptr, T, nh, nkv, d);
        at::Tensor attn = attention(q, qkv, l, num_decodes, decode_tables, decode_lens,
                                    starts, ends, tables, masks, q_size, kv_size);
        at::Tensor o = lin[1](attn.view({T, q_size})).contiguous();
        add_rmsnorm<T_>(h.data_ptr<T_>(), o.data_ptr<T_>(), norms[2 * l + 1].data_ptr<T_>(),
                        x.data_ptr<T_>(), T, hidden, eps);
        at::Tensor gu = lin[2](x).contiguous();
        const int64_t inter = gu.size(1) / 2;
        at::Tensor act = at::empty({T, inter}, h.options());
        silu_mul<T_>(gu.data_ptr<T_>(), act.data_ptr<T_>(), T, inter);
        m = lin[3](act).contiguous();
        add_rmsnorm<T_>(h.data_ptr<T_>(), m.data_ptr<T_>(), norms[2 * l + 2].data_ptr<T_>(),
                        x.data_ptr<T_>(), T, hidden, eps);
      }
    });
    return x;
  }

  at::Tensor attention(const at::Tensor& q, const at::Tensor& qkv, int64_t l, int64_t D,
                       const std::optional<at::Tensor>& decode_tables,
                       const std::optional<at::Tensor>& decode_lens,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
                       const std::vector<std::optional<at::Tensor>>& tables,
                       const std::vector<std::optional<at::Tensor>>& masks,
                       int64_t q_size, int64_t kv_size) {
    const int64_t T = q.size(0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    at::Tensor decoded;
    const bool i8 = int8();
    if (D) decoded = paged_decode(D == T ? q : q.narrow(0, 0, D), k_caches[l], v_caches[l],
                                  *decode_tables, *decode_lens, scale,
                                  i8 ? std::optional<at::Tensor>(k_scales[l]) : std::nullopt,
                                  i8 ? std::optional<at::Tensor>(v_scales[l]) : std::nullopt);
    if (D == T) return decoded;
    at::Tensor out = at::empty_like(q);
    if (D) out.narrow(0, 0, D).copy_(decoded);
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, nkv, d});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, nkv, d});
    for (size_t c = 0; c < starts.size(); ++c) {
      const int64_t s = starts[c], n = ends[c] - starts[c];
      // Fresh chunks of one length side by side (a burst's prompts) go to SDPA in one
      // call, the batch dimension theirs: with this torch each is computed as it is
      // alone, bit for bit (tests/test_lean_step.py), in one parallel region instead of
      // one per chunk. `group_chunks` is off only to measure or test that.
      size_t e = c + 1;
      if (group_chunks && !tables[c].has_value() && !masks[c].has_value())
        while (e < starts.size() && !tables[e].has_value() && !masks[e].has_value() &&
               ends[e] - starts[e] == n && starts[e] == ends[e - 1])
          ++e;
      if (e > c + 1) {
        const int64_t B = static_cast<int64_t>(e - c);
        auto heads = [&](const at::Tensor& t, int64_t h) {
          return t.narrow(0, s, B * n).view({B, n, h, d}).transpose(1, 2);
        };
        at::Tensor o = at::scaled_dot_product_attention(
            heads(q, nh), heads(k, nkv), heads(v, nkv), std::nullopt, 0.0, true,
            std::nullopt, /*enable_gqa=*/true);
        out.narrow(0, s, B * n).view({B, n, nh, d}).copy_(o.transpose(1, 2));
        c = e - 1;
        continue;
      }
      at::Tensor keys, values;
      if (tables[c].has_value()) {
        const auto& table = *tables[c];
        const int64_t blocks = k_caches[l].size(0), bs = k_caches[l].size(1);
        // whole blocks as rows; the 8-bit cache's widened by their scales to q's dtype
        auto gather = [&](const at::Tensor& cache, const at::Tensor* scales) {
          at::Tensor rows = cache.view({blocks, -1}).index_select(0, table)
                                .view({table.size(0) * bs, nkv, d});
          if (!scales) return rows;
          at::Tensor s = scales->view({blocks, -1}).index_select(0, table)
                             .view({table.size(0) * bs, nkv, 1});
          return (rows.to(at::kFloat) * s).to(q.scalar_type());
        };
        keys = gather(k_caches[l], i8 ? &k_scales[l] : nullptr);
        values = gather(v_caches[l], i8 ? &v_scales[l] : nullptr);
      } else {
        keys = k.narrow(0, s, n);
        values = v.narrow(0, s, n);
      }
      at::Tensor o = at::scaled_dot_product_attention(
          q.narrow(0, s, n).transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
          values.transpose(0, 1).unsqueeze(0), masks[c], 0.0, !masks[c].has_value(),
          std::nullopt, /*enable_gqa=*/true);
      out.narrow(0, s, n).copy_(o[0].transpose(0, 1));
    }
    return out;
  }
};

// The index of each row's largest value (the first, on ties; a row holding NaN gives its
// first NaN, as torch.max does), rows in parallel. torch's max(dim=-1) took 0.84 ms for 64
// rows of SmolLM2's 49,152 logits and 0.05 ms for one (2-core EPYC Zen 5), single-threaded;
// this takes 0.25 and 0.008.
static inline bool is_nan(float v) {   // on the bits: -ffast-math may fold std::isnan away
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return (b & 0x7FFFFFFFu) > 0x7F800000u;
}

static at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows takes contiguous float32 rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * n;
      int64_t best = 0, i = 0;
      bool nan = false;
#if defined(__AVX512F__)
      if (n >= 16) {   // per lane: its largest value and where it first was
        __m512 top = _mm512_loadu_ps(row);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i pos = at;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
          pos = _mm512_add_epi32(pos, step);
          const __m512 v = _mm512_loadu_ps(row + i);
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 more = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
          top = _mm512_mask_mov_ps(top, more, v);
          at = _mm512_mask_mov_epi32(at, more, pos);
        }
        nan = unordered != 0;
        if (!nan) {   // (with a NaN lane the largest is undefined: the scan below decides)
          const float m = _mm512_reduce_max_ps(top);
          const __mmask16 tied = _mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ);
          best = tied ? _mm512_mask_reduce_min_epi32(tied, at) : 0;
        }
      }
#endif
      for (; i < n; ++i) {   // the tail (and all of a short row, or without AVX-512)
        if (row[i] > row[best]) best = i;
        nan = nan || is_nan(row[i]);
      }
      if (nan || is_nan(row[best]))
        for (int64_t j = 0; j < n; ++j)
          if (is_nan(row[j])) { best = j; break; }
      idx[r] = best;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "each float32 row's first largest value's index");
  m.def("sample_rows", &sample_rows, "a token per float32 row at its temperature and top_p "
        "(cpu_sample.py)");
  m.def("paged_decode", &paged_decode, "paged decode attention (cpu_attention.py)");
  m.def("dequantize_int4_t", &dequantize_int4_t_dense, "torch's CPU int4 packing as W^T");
  m.def("int4_matmul", &int4_matmul, "x W^T from torch's CPU int4 packing (AVX-512 VNNI "
        "or AVX2)");
  m.def("int4_blocked_scales", &int4_blocked_scales, "an int4 layer's (s, z) pairs in "
        "block order, for int4_matmul on AVX2");
  m.attr("int4_kernel") = py::bool_(int4_fast(at::empty({0}, at::kBFloat16), 32));
#ifdef TIERSERVE_VNNI
  m.attr("int4_vnni") = py::bool_(int4_fast(at::empty({0}, at::kBFloat16), 32));
#else
  m.attr("int4_vnni") = py::bool_(false);
#endif
  m.def("int8_matmul", &int8_matmul, "(x W^T) * scales for an int8 weight");
  m.def("pack_int8_vnni", &pack_int8_vnni, "an int8 weight repacked for int8_matmul_vnni");
  m.def("int8_matmul_vnni", &int8_matmul_vnni, "(x W^T) * scales, x rounded to int8 (VNNI)");
  m.attr("int8_vnni") = py::bool_(int8_vnni());
  m.def("pack_int8_avx2", &pack_int8_avx2, "an int8 weight repacked for int8_matmul_avx2");
  m.def("int8_matmul_avx2", &int8_matmul_avx2, "(x W^T) * scales, x rounded to int8 (AVX2)");
  m.attr("int8_avx2") = py::bool_(int8_avx2());
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.attr("kv_int8_vnni") = py::bool_(true);   // one_sequence_i8 (cpu_attention.py) built
#else
  m.attr("kv_int8_vnni") = py::bool_(false);
#endif
  py::class_<LeanModel>(m, "LeanModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>>())
      .def("add_linear", &LeanModel::add_linear)
      .def("set_head", &LeanModel::set_head)
      .def("set_dense", &LeanModel::set_dense)
      .def("logits", &LeanModel::logits)
      .def("forward", &LeanModel::forward)
      .def_readwrite("group_chunks", &LeanModel::group_chunks);
}
"""


def supports(shape: ModelShape) -> bool:
    """The architectures the lean step computes exactly (Gemma 3's extras are not in it)."""
    return not (shape.qk_norm or shape.post_norms or shape.sliding_window
                or shape.query_pre_attn_scalar) and shape.hidden_act == "silu"


class LeanForward:
    """The C++ twin of LlamaModel's layers, over the model's own weights and KV caches."""

    def __init__(self, kernel, model: nn.Module, kv_caches: list[tuple[Tensor, ...]]):
        """kv_caches: per layer (k, v), or (k, v, k_scales, v_scales) for an int8 cache."""
        shape = model.shape
        norms = [w for layer in model.layers for w in (layer.input_norm, layer.mlp_norm)]
        self.impl = kernel.LeanModel(
            shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.rms_norm_eps, [w.detach() for w in norms + [model.norm]],
            [c[0] for c in kv_caches], [c[1] for c in kv_caches],
            [c[2] for c in kv_caches if len(c) == 4], [c[3] for c in kv_caches if len(c) == 4])
        rounded = False  # does any body layer round x to int8 (the 4-bit kernel)?
        linears = [linear for layer in model.layers
                   for linear in (layer.attn.qkv_proj, layer.attn.o_proj,
                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        for linear in linears:
            spec = _linear_spec(linear)
            rounded = rounded or spec[0] == 2
            self.impl.add_linear(*spec)
        self.impl.set_head(*_linear_spec(model.lm_head), rounded)
        self.rope = model.rope
        self.dense_bytes = 0
        """Bytes of the bfloat16 copies kept for wide inputs (`dense_copies`); 0: none."""
        layers = linears + [model.lm_head]          # set_dense's indices; -1: the head
        copies, self.dense_note = dense_copies(layers)
        """Why a CPU with AMX holds no copies (too large for its memory); '' otherwise."""
        for index, (linear, packed) in enumerate(zip(layers, copies or ())):
            if packed is not None:
                self.impl.set_dense(index if index < len(linears) else -1, packed, DENSE_ROWS)
                self.dense_bytes += _copy_bytes(linear)

    def __call__(self, h: Tensor, positions: Tensor, attn) -> Tensor:
        chunks = attn.prefills
        return self.impl.forward(
            h.contiguous(), self.rope.cos[positions].float(), self.rope.sin[positions].float(),
            attn.slot_mapping, attn.num_decodes, attn.decode_block_tables,
            attn.decode_context_lens, [c.start for c in chunks], [c.end for c in chunks],
            [c.block_table for c in chunks], [c.mask for c in chunks])

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab] (the model's compute_logits)."""
        return self.impl.logits(hidden).float()


DENSE_ROWS = 32
"""Rows of x above which, on a CPU with AMX, a 4- or 8-bit layer of the lean step runs a
bfloat16 copy of its weight packed by oneDNN (AMX tiles) instead of its integer kernel
(AVX-512 VNNI). Measured on SmolLM2-135M's 120 4-bit layers, 2-vCPU Intel Xeon (family 6
model 167, AMX), integer kernel against copy: 16.3 against 16.3 ms at 32 rows, 22.2
against 17.4 at 48, 27.6 against 19.1 at 64, 49.7 against 27.8 at 128, 186 against 85 at
512; its 49152 x 576 int8 head 2.9 against 2.7 ms at 32 rows, 5.3 against 2.8 at 64
(docs/benchmarks.md). At a few rows the copy's bytes cost 3x (13.5 against 4.5 ms at 4
rows): decode steps of up to 32 sequences keep the integer kernels."""
DENSE_SHARE = 0.1
"""The most of the machine's memory (or of its cgroup's limit) the copies may take; past
it a model keeps its integer kernels at every width (SmolLM2-135M's copies: 269 MB; an 8B
model's, about 16 GB, are refused on a 24 GiB machine)."""


def dense_copies(linears: list) -> tuple[list | None, str]:
    """(per layer its weight in bfloat16 packed by oneDNN, or None for a layer that keeps
    its kernel at every width; why none are kept where they would help). The list is None
    where no copies are kept: no AMX, activations not in bfloat16, no integer-kernel layer,
    `TIERSERVE_NO_DENSE_COPY` set, or the copies over DENSE_SHARE of memory (then said)."""
    import os

    from tierserve.model.cpu_linear import _BATCH_HINT, packs_bf16
    from tierserve.model.quant import QuantLinear

    wanted = [isinstance(m, QuantLinear) and m.use_kernel and m.readable
              and m.scales.dtype == torch.bfloat16 for m in linears]  # kinds INT8 and INT4
    if not any(wanted) or os.environ.get("TIERSERVE_NO_DENSE_COPY") or not packs_bf16() \
            or not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None, ""
    total = sum(_copy_bytes(m) for m, w in zip(linears, wanted) if w)
    if total > DENSE_SHARE * _memory_bytes():
        return None, (f"AMX here, but the 4/8-bit layers' bfloat16 copies ({total / 1e9:.1f} "
                      f"GB) would take over {DENSE_SHARE:.0%} of memory: wide steps keep the "
                      "integer kernels")
    with torch.inference_mode():
        return [torch.ops.mkldnn._reorder_linear_weight(m.dequantize().contiguous(),
                                                        _BATCH_HINT)
                if w else None for m, w in zip(linears, wanted)], ""


def _copy_bytes(linear) -> int:
    """Bytes of a layer's bfloat16 copy."""
    return linear.in_features * linear.out_features * 2


def _memory_bytes() -> int:
    """This machine's memory, or its cgroup's limit (cgroup v2) where that is lower."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def int8_kv_refusal(shape: ModelShape, device: str, kernel) -> str | None:
    """Why `--kv-cache-dtype int8` cannot run here (only the lean step reads and writes
    it), or None where it can. `kernel`: kernels.load()'s module, or None."""
    from tierserve.model import cpu_attention

    if str(device).split(":")[0] == "cpu" and kernel is not None and supports(shape) \
            and cpu_attention.supports(shape.num_heads, shape.num_kv_heads, shape.head_dim):
        return None
    return (f"--kv-cache-dtype int8 needs the lean CPU step (a Llama-shaped model on a CPU "
            f"with the compiled kernels); {shape.name} on {device}"
            f"{'' if kernel is not None else ' without the kernels'} runs the Python layers")


def new_kv_caches(shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto", device: str | torch.device = "cpu") -> list:
    """Zeroed KV caches, per layer (k, v) [blocks, block_size, Hkv, d] in `dtype`, or for
    `kv_cache_dtype` int8 (k, v, k_scales, v_scales): int8 values with a float32 scale per
    position and KV head [blocks, block_size, Hkv] (the lean step's 8-bit cache)."""
    values = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    if kv_cache_dtype == "int8":
        return [tuple(torch.zeros(values, dtype=torch.int8, device=device) for _ in "kv")
                + tuple(torch.zeros(values[:-1], device=device) for _ in "kv")
                for _ in range(shape.num_layers)]
    return [tuple(torch.zeros(values, dtype=dtype, device=device) for _ in "kv")
            for _ in range(shape.num_layers)]


def decode_logits(kernel, model: nn.Module, tokens: list[int],
                  kv_cache_dtype: str = "auto") -> Tensor:
    """Teacher-forced float32 logits [T, vocab] computed as the engine decodes: one token
    per lean step from position 0, each attending through the paged decode kernel to the
    cache (in `kv_cache_dtype`) the earlier steps wrote. For quality checks of the cache
    formats (benchmarks/quant_quality.py --decode, tests)."""
    from tierserve.model.llama import AttentionMetadata

    blocks = -(-len(tokens) // 16)
    lean = LeanForward(kernel, model, new_kv_caches(
        model.shape, blocks, 16, next(model.parameters()).dtype, kv_cache_dtype))
    table = torch.arange(blocks).view(1, blocks)
    rows = []
    with torch.inference_mode():
        for t, token in enumerate(tokens):
            attn = AttentionMetadata(
                slot_mapping=torch.tensor([t]), num_decodes=1, decode_block_tables=table,
                decode_mask=None, decode_context_lens=torch.tensor([t + 1]), prefills=[])
            rows.append(lean.logits(lean(model.embed(torch.tensor([token])),
                                         torch.tensor([t]), attn)))
    return torch.cat(rows)


_NEVER = 1 << 62
LEAN_INT8_ROWS = 384
"""Rows of x up to which the lean step keeps an int8 layer on cpu_quant's kernel (above,
the module dequantizes and runs a dense matmul). Measured on the 49152 x 576 int8 lm_head,
2-core EPYC Zen 4: 14 ms against 53 at 64 rows, 26 against 59 at 128, 52 against 76 at
256, 150 against 125 at 512.
"""


def _linear_spec(linear: nn.Module) -> tuple:
    """(kind, weight, aux, bias, group, max_rows, module) for LeanLinear in the C++ source."""
    from tierserve.model.cpu_linear import PackedLinear
    from tierserve.model.quant import QuantLinear

    none = torch.empty(0)
    if isinstance(linear, PackedLinear):
        return 0, linear.packed, none, _detach(linear.bias), 0, _NEVER, linear
    if isinstance(linear, QuantLinear) and linear.use_kernel:
        rows = _NEVER if linear.dequant_rows is None else linear.dequant_rows
        if linear.bits == 8:
            rows = max(rows, LEAN_INT8_ROWS)
        kind = 1 if linear.bits == 8 else 2
        return kind, linear.weight, linear.scales, linear.bias, linear.group_size, rows, linear
    if type(linear) is nn.Linear:
        return 3, linear.weight.detach(), none, _detach(linear.bias), 0, _NEVER, linear
    return 4, none, none, None, 0, _NEVER, linear


def _detach(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()
