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


def can_pack(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear. Returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
