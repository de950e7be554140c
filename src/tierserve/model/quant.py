"""Weights kept quantized in memory (`--quantization`): int8 per output channel, or int4
in groups of 32 along the input dimension.

NOTE: why and how. A decode step at a small batch reads every weight once, so its time is
mostly weight traffic; fewer bytes per weight is less time. PyTorch ships CPU kernels that
read packed integer weights and dequantize them in registers (no C++ of ours):

    int8: y = x @ (q * s[n]).T                 _weight_int8pack_mm(x, q[N,K] int8, s[N])
    int4: y = x @ ((q - 8) * s[g,n] + z[g,n]).T  _weight_int4pack_mm_for_cpu(x, packed,
          q in 0..15, packed by                     group, sz[K/group, N, 2] = (s, z))
          _convert_weight_to_int4pack_for_cpu

(the int4 convention, `(q - 8) * s + z`, was checked numerically; tests/test_quant.py keeps
checking it). Scales share the activations' dtype: the kernels refuse anything else.

A group of a GGUF Q4_0, Q4_1 or Q4_K block is `scale * q + min` with q in 0..15: the int4
format with s = scale, z = min + 8 * scale, so those blocks are kept as they are
(model/gguf_quant.py); only the scales are rounded to the model's dtype.

The kernels dequantize again for every row of x, so their cost grows with the batch: they
beat oneDNN's packed bfloat16 at one row, about tie at 4 and lose from about 8 rows on
(docs/benchmarks.md). Above `_DEQUANT_ROWS` rows (prefill chunks, big decode batches) a
layer dequantizes its weight once and runs one dense matmul instead. On other devices
(CUDA) every call takes that path: plain PyTorch, weights still packed in memory.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUP_SIZE = 32
"""int4 group length along the input dimension: that of GGUF's 4-bit blocks."""
_DEQUANT_ROWS = {8: 32, 4: 96}
"""Rows of x above which dequantize-then-matmul beats the kernel, per bit width
(crossovers measured on SmolLM2-135M's layer shapes, 2-core EPYC Zen 4)."""


class QuantLinear(nn.Module):
    """A linear layer whose weight stays int8 (per output channel) or int4 (per group).

    Build it with `QuantLinear.int8(...)` or `QuantLinear.int4(...)`; `dequantize()` gives
    the weight it stands for, [out_features, in_features] in the model's dtype."""

    def __init__(self, bits: int, weight: Tensor, scales: Tensor, bias: Tensor | None,
                 in_features: int, out_features: int, group_size: int = 0,
                 kernel_layout: bool = False):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", weight)
        """int8 [N, K]; int4 [N, K/2]: the CPU kernel's packing if `kernel_layout`, else
        plain nibbles (even k in the low half of a byte)."""
        self.register_buffer("scales", scales)
        """int8: [N]; int4: [K/group, N, 2] = (s, z) pairs."""
        self.register_buffer("bias", bias)
        self.use_kernel = kernel_layout if bits == 4 else _kernel_fits(weight, scales.dtype)
        # Whether dequantize() reads the weight directly; if not, the CPU layer keeps to
        # the kernel at every batch size.
        self.readable = (bits == 8 or not self.use_kernel
                         or (out_features % 64 == 0 and _int4_layout_known()))
        self.dequant_rows = _DEQUANT_ROWS[bits] if self.readable else None

    @classmethod
    def int8(cls, codes: Tensor, scales: Tensor, bias: Tensor | None = None) -> "QuantLinear":
        """codes [N, K] int8, scales [N] in the activations' dtype: w = codes * scales."""
        n, k = codes.shape
        return cls(8, codes.contiguous(), scales.contiguous(), bias, k, n)

    @classmethod
    def int4(cls, codes: Tensor, scale: Tensor, minimum: Tensor, bias: Tensor | None = None,
             dtype: torch.dtype = torch.bfloat16) -> "QuantLinear":
        """codes [N, K] in 0..15, scale and minimum [N, K/group] (float32):
        w = scale * codes + minimum, per group of K/scale.shape[1] inputs."""
        n, k = codes.shape
        s = scale.to(dtype)
        z = (minimum.float() + 8 * s.float()).to(dtype)  # so that (q - 8) * s + z = s q + min
        sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous()          # [K/g, N, 2]
        kernel = _kernel_fits(codes, dtype) and n % 16 == 0     # the packing's own demand
        if kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:
            codes = codes.to(torch.uint8)
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return cls(4, packed.contiguous(), sz, bias, k, n, group_size=k // scale.shape[1],
                   kernel_layout=kernel)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if not self.use_kernel or (self.dequant_rows is not None
                                   and x2.shape[0] > self.dequant_rows):
            y = F.linear(x2, self.dequantize(), self.bias)
        else:
            if self.bits == 8:
                y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x2.contiguous(), self.weight, self.group_size, self.scales)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:
        """The weight this layer stands for: [out_features, in_features], scales' dtype."""
        if self.bits == 8:
            return self.weight.to(self.scales.dtype) * self.scales.unsqueeze(1)
        if not self.readable:
            # The kernel itself applied to the identity gives W^T: slow, but always right.
            eye = torch.eye(self.in_features, dtype=self.scales.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.weight, self.group_size, self.scales).t().contiguous()
        return _dequantize_int4(self.weight, self.scales, self.group_size, self.use_kernel)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}{group}")


class QuantEmbedding(nn.Module):
    """Token embeddings read from an int8 lm_head's rows, for tied weights: the table is
    held once, as int8, instead of once in bfloat16 for lookups and again for the head."""

    def __init__(self, head: QuantLinear):
        super().__init__()
        assert head.bits == 8, "only per-row int8 tables can be looked up row by row"
        self.register_buffer("weight", head.weight)   # the same tensors, not copies
        self.register_buffer("scales", head.scales)

    def forward(self, input_ids: Tensor) -> Tensor:
        rows = F.embedding(input_ids, self.weight).to(self.scales.dtype)
        return rows * self.scales[input_ids].unsqueeze(-1)


# ------------------------------------------------------------------ conversion
def int8_per_channel(w: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output row: codes [N, K] int8 and scales [N] in `dtype`, the
    codes rounded against the scale as stored (so the rounding of the scale costs nothing)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float16).tiny).to(dtype)
    codes = torch.round(w / scales.float().unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def _kernel_fits(weight: Tensor, dtype: torch.dtype) -> bool:
    """The kernels are vectorized for bfloat16 activations only (float32 and float16 run
    10-100x slower than a dense matmul), and the int8 one reads K in steps of 16 with no
    tail (K = 8, 24 or 100 crash it in torch 2.13): all else dequantizes per call."""
    return (weight.device.type == "cpu" and dtype == torch.bfloat16
            and weight.shape[-1] % 16 == 0)


def int8_linear(w: Tensor, bias: Tensor | None, dtype: torch.dtype) -> QuantLinear:
    return QuantLinear.int8(*int8_per_channel(w, dtype), bias)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Groups tile K, and N suits the CPU packing (a multiple of 16)."""
    return in_features % GROUP_SIZE == 0 and out_features % 16 == 0


def quantize_lm_head(model: nn.Module, values: Tensor | None = None) -> None:
    """The output layer to int8, from `values` (float32, exact) or its loaded weight; with
    tied embeddings the lookup then reads the same int8 table."""
    head = model.lm_head
    tied = head.weight is model.embed_tokens.weight
    w = head.weight if values is None else values
    model.lm_head = int8_linear(w, head.bias, head.weight.dtype)
    if tied:
        model.embed_tokens = QuantEmbedding(model.lm_head)


def _linears(model: nn.Module):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                yield parent, name, child


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: parameters, quantized buffers and oneDNN's
    packed copies (a tied lm_head packed by cpu_linear holds its own), each storage once."""
    seen, total = set(), 0
    tensors = list(model.parameters())
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            tensors += [b for b in m.buffers(recurse=False) if b is not None]
        packed = getattr(m, "packed", None)
        if isinstance(packed, Tensor):
            tensors.append(packed)
    for t in tensors:
        if t.is_mkldnn:      # oneDNN's opaque packed tensor: no storage to ask, no sharing
            key, size = id(t), t.numel() * t.element_size()
        else:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += size
    return total


# ------------------------------------------------------------ int4 dequantization
def _dequantize_int4(weight: Tensor, sz: Tensor, group: int, cpu_layout: bool) -> Tensor:
    """[N, K] in sz's dtype from packed nibbles and (s, z) pairs [K/g, N, 2], computed in
    float32 and rounded once."""
    groups, n, _ = sz.shape
    k = groups * group
    s = sz[..., 0].float()
    z8 = sz[..., 1].float() - 8 * s                              # w = q s + (z - 8 s)
    if cpu_layout:
        # The kernel's layout: blocks of 64 output rows, k-major, 32 bytes per (block, k)
        # with rows 0..31 in the low nibbles and 32..63 in the high ones.
        b = weight.view(n // 64, k, 32)
        q = torch.cat([b & 15, b >> 4], dim=-1).view(n // 64, groups, group, 64)
        s = s.view(groups, n // 64, 64).permute(1, 0, 2).unsqueeze(2)    # [N/64, G, 1, 64]
        z8 = z8.view(groups, n // 64, 64).permute(1, 0, 2).unsqueeze(2)
        w = q.float().mul_(s).add_(z8).to(sz.dtype)   # in place: q's layout [N/64, G, g, 64]
        return w.view(n // 64, k, 64).permute(0, 2, 1).reshape(n, k)
    q = torch.stack([weight & 15, weight >> 4], dim=-1).view(n, groups, group)
    w = q.float().mul_(s.t().unsqueeze(-1)).add_(z8.t().unsqueeze(-1))
    return w.to(sz.dtype).view(n, k)


@functools.cache
def _int4_layout_known() -> bool:
    """Does `_dequantize_int4` read this torch build's CPU packing of 64-row blocks? (The
    layout is the AVX-512 kernel's; another build may pack differently, and then the layer
    keeps to the kernel, whose product with the identity is a slow but exact dequantization.)"""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 2 * GROUP_SIZE), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if tuple(packed.shape) != (128, GROUP_SIZE) or packed.dtype != torch.uint8:
        return False
    sz = torch.stack([torch.ones(2, 128), torch.full((2, 128), 8.0)], dim=-1)  # w = q
    return torch.equal(_dequantize_int4(packed, sz, GROUP_SIZE, True), codes.float())
