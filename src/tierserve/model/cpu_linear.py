"""Linear layers with weights pre-packed by oneDNN, for CPUs.

NOTE: why. On CPU, `F.linear` in bfloat16 reorders the weight into oneDNN's blocked layout
on every call. Reordering once at load time cuts the linear layers of a SmolLM2-135M decode
step from about 26 ms to 19 ms at batch 1 and from 40 ms to 27 ms at batch 64 on the 2-core
reference machine (benchmarks in docs/benchmarks.md), with bit-identical results. Float32
is faster unpacked at small batches on an AVX-512 CPU, so there only bfloat16 weights are
packed.

NOTE: float32 on an AVX2-only CPU. There oneDNN packs no bfloat16 (`packs_bf16`) and an
unquantized model computes in float32, where torch's `F.linear` runs MKL, whose kernel at
2-3 rows reads the weight once per row: SmolLM2's 49152 x 576 lm_head took 8.0, 17.9,
27.5 and 18.2 ms at 1, 2, 3 and 4 rows on a 2-core EPYC Zen 3, against 3.7, 3.8, 4.3 and
4.8 ms packed by oneDNN (19.6 against 8.9 at 16 rows, 41.3 against 25.6 at 64); the
layers' own linears 1.5-2.5x faster packed from 2 to 16 rows, level at one. So float32
weights are packed where bfloat16 ones cannot be (benchmarks/linear_pack.py).
"""

import copy

import torch
from torch import Tensor, nn

_BATCH_HINT = 16  # oneDNN picks the blocked layout for this batch size; good from 1 to 256


_PACKS: bool | None = None


def _has_onednn() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packs_bf16() -> bool:
    """Whether this CPU's oneDNN packs bfloat16 weights: it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT, and refuses on an AVX2-only CPU (a 2-core EPYC Zen 3, for one).
    Asked once, of oneDNN itself."""
    global _PACKS
    if _PACKS is None:
        _PACKS = _has_onednn()
        if _PACKS:
            try:
                torch.ops.mkldnn._reorder_linear_weight(
                    torch.zeros(16, 16, dtype=torch.bfloat16), _BATCH_HINT)
            except RuntimeError:
                _PACKS = False
    return _PACKS


def packs_float32() -> bool:
    """Whether float32 weights are packed here: where bfloat16 ones cannot be (see the
    note) and oneDNN is there to pack them."""
    return not packs_bf16() and _has_onednn()


def packs(dtype: torch.dtype) -> bool:
    """Whether linear layers with weights of `dtype` are packed on this CPU."""
    return (dtype == torch.bfloat16 and packs_bf16()) or \
        (dtype == torch.float32 and packs_float32())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> Tensor:
        """The weight in torch's plain layout, unpacked: a copy to read (tests compare
        weights); the forward pass uses the packed one."""
        return self.packed.to_dense()

    def plain(self) -> nn.Linear:
        """An nn.Linear of the same weights (copies), in torch's layout."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           dtype=self.packed.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def unpacked_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every PackedLinear back as an nn.Linear (oneDNN's packed
    tensors cannot be deep-copied, nor moved to another dtype)."""
    memo = {id(m): m.plain() for m in model.modules() if isinstance(m, PackedLinear)}
    return copy.deepcopy(model, memo)


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` whose weights this CPU packs (`packs`) by a
    PackedLinear; the rest stay torch's. Returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and packs(child.weight.dtype):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
