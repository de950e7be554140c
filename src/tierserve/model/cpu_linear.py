"""bfloat16 linear layers with weights pre-packed by oneDNN, for CPUs.

NOTE: why. On CPU, `F.linear` in bfloat16 reorders the weight into oneDNN's blocked layout
on every call. Reordering once at load time cuts the linear layers of a SmolLM2-135M decode
step from about 26 ms to 19 ms at batch 1 and from 40 ms to 27 ms at batch 64 on the 2-core
reference machine (benchmarks in docs/benchmarks.md), with bit-identical results. Float32
is faster unpacked at small batches, so only bfloat16 weights are packed.
"""

import torch
from torch import Tensor, nn

_BATCH_HINT = 16  # oneDNN picks the blocked layout for this batch size; good from 1 to 256


_PACKS: bool | None = None


def packs_bf16() -> bool:
    """Whether this CPU's oneDNN packs bfloat16 weights: it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT, and refuses on an AVX2-only CPU (a 2-core EPYC Zen 3, for one).
    Asked once, of oneDNN itself."""
    global _PACKS
    if _PACKS is None:
        _PACKS = (torch.backends.mkldnn.is_available()
                  and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        if _PACKS:
            try:
                torch.ops.mkldnn._reorder_linear_weight(
                    torch.zeros(16, 16, dtype=torch.bfloat16), _BATCH_HINT)
            except RuntimeError:
                _PACKS = False
    return _PACKS


def can_pack(model: nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.bfloat16 and packs_bf16()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear, where this CPU packs bfloat16
    (else none: they stay torch's). Returns how many."""
    count = 0
    if not packs_bf16():
        return 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
