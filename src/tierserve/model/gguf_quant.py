"""`--quantization gguf`: a GGUF file's quantized linear weights kept in their own bits.

Each weight tensor of the file becomes, by its block type:

    Q4_0, Q4_1, Q4_K   -> int4 groups of 32, as stored: a group is scale * q + min with
                          q in 0..15 (Q4_0: scale d, min -8d; Q4_1: d, m; Q4_K: each
                          32-weight sub-block's d * sc, -dmin * m from its 6-bit sc, m)
    Q8_0, Q5_*, Q6_K,  -> int8 per output channel, requantized from the exact block values
    Q2_K, Q3_K            (the kernels have no group-scaled int8 nor 5/6-bit path)
    F32, F16, BF16     -> left as loaded (bfloat16, packed by model/cpu_linear.py)

A fused layer (qkv_proj, gate_up_proj) is int4 only when all its parts are, else int8
from all parts' exact values (Q4_K_M files store some attn_v and ffn_down as Q6_K), and it
stays unquantized if any part is a float tensor. A quantized output layer (or, tied, token
embeddings) becomes int8 per channel from its exact values, and a tied embedding lookup
reads that table (model/quant.py).

The block layouts are ggml's (a fp16 scale then packed codes); tests/test_quant.py checks
the decoding here against the `gguf` package's own dequantization.
"""

import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from tierserve.errors import ConfigError, ModelLoadError
from tierserve.model.gguf_file import GGUFCheckpoint, hf_name, unpermute
from tierserve.model.quant import (GROUP_SIZE, QuantLinear, _linears, int4_fits,
                                   int8_linear, quantize_lm_head)

FLOAT_TYPES = ("F32", "F16", "BF16")
_PARTS = {"self_attn.q_proj": ("attn.qkv_proj", 0, 3), "self_attn.k_proj": ("attn.qkv_proj", 1, 3),
          "self_attn.v_proj": ("attn.qkv_proj", 2, 3), "self_attn.o_proj": ("attn.o_proj", 0, 1),
          "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2), "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
          "mlp.down_proj": ("mlp.down_proj", 0, 1)}
"""HF sub-layer -> (fused module under the layer, part index, parts)."""


@dataclass
class Int4Groups:
    """Rows of a weight as w = scale * codes + minimum, per group of 32 inputs."""

    codes: Tensor
    """[N, K] uint8 in 0..15."""
    scale: Tensor
    """[N, K/32] float32."""
    minimum: Tensor

    def dequantize(self) -> Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (q * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn) -> "Int4Groups":
        return Int4Groups(fn(self.codes), fn(self.scale), fn(self.minimum))


def quantize_from_gguf(model: nn.Module, path: str, lm_head: bool = True) -> int:
    """Replace the model's linear layers by QuantLinear built from the GGUF file's blocks.
    Returns how many layers were replaced."""
    ckpt = GGUFCheckpoint(path)
    shape = model.shape
    pending: dict[str, dict[int, Int4Groups | Tensor | None]] = {}
    head_values, count = None, 0
    for t in ckpt.reader.tensors:
        name = hf_name(t.name)
        if name == ("model.embed_tokens.weight" if shape.tie_word_embeddings
                    else "lm_head.weight"):
            if lm_head and t.tensor_type.name not in FLOAT_TYPES:
                head_values = _values(ckpt, t)
            continue
        target = _part(name)
        if target is None:
            continue
        module, index, num_parts = target
        rows = None if t.tensor_type.name in FLOAT_TYPES else _decode(ckpt, t)
        if (rows is not None and ckpt.arch == "llama"
                and name.endswith(("q_proj.weight", "k_proj.weight"))):  # as gguf_file does
            heads = shape.num_heads if "q_proj" in name else shape.num_kv_heads
            rows = (rows.map_rows(lambda x: unpermute(x, heads))
                    if isinstance(rows, Int4Groups) else unpermute(rows, heads))
        parts = pending.setdefault(module, {})
        parts[index] = rows
        if len(parts) == num_parts:
            count += _replace(model, module, [parts[i] for i in range(num_parts)])
            del pending[module]
    if head_values is not None and isinstance(model.lm_head, nn.Linear):
        quantize_lm_head(model, head_values.to(model.lm_head.weight.device))
        count += 1
    return count


def _part(name: str | None):
    """(module path, part index, parts) of a layer weight's HF name, or None."""
    m = name and re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight", name)
    if not m or m.group(2) not in _PARTS:
        return None
    sub, index, num_parts = _PARTS[m.group(2)]
    return f"layers.{m.group(1)}.{sub}", index, num_parts


def _replace(model: nn.Module, path: str, parts: list) -> int:
    try:
        old = model.get_submodule(path)
    except AttributeError:
        return 0                     # a model without this layer (another architecture)
    if not isinstance(old, nn.Linear) or any(p is None for p in parts):
        return 0
    device, dtype = old.weight.device, old.weight.dtype
    n = sum(p.codes.shape[0] if isinstance(p, Int4Groups) else p.shape[0] for p in parts)
    if all(isinstance(p, Int4Groups) for p in parts) and int4_fits(n, old.in_features):
        new = QuantLinear.int4(*(torch.cat(x).to(device) for x in zip(
            *((p.codes, p.scale, p.minimum) for p in parts))), old.bias, dtype)
    else:
        values = torch.cat([p.dequantize() if isinstance(p, Int4Groups) else p for p in parts])
        new = int8_linear(values.to(device), old.bias, dtype)
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, new)
    return 1


# ---------------------------------------------------------------- block decoding
def _decode(ckpt: GGUFCheckpoint, t) -> Int4Groups | Tensor:
    """A quantized tensor as int4 groups (4-bit types) or exact float32 values [N, K]."""
    raw = torch.from_numpy(np.array(t.data, dtype=np.uint8)).view(len(t.data), -1)
    qtype = t.tensor_type.name
    if qtype in DECODERS:
        return DECODERS[qtype](raw)
    return _values(ckpt, t)


def _values(ckpt: GGUFCheckpoint, t) -> Tensor:
    """Exact float32 values [N, K] of any tensor type, by the `gguf` package."""
    from gguf import quants

    try:
        array = quants.dequantize(t.data, t.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"{ckpt.path}: cannot decode tensor {t.name} "
                             f"({t.tensor_type.name}): {exc}") from None
    k = int(t.shape[0])
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(-1, k))


def _f16(raw: Tensor) -> Tensor:
    """Little-endian fp16 from the last dimension's 2 bytes, as float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def decode_q4_0(raw: Tensor) -> Int4Groups:
    """Q4_0: 18-byte blocks of 32: fp16 d, 16 bytes of codes; w = d * (q - 8)."""
    blk = raw.view(raw.shape[0], -1, 18)
    d = _f16(blk[..., 0:2])
    return Int4Groups(_nibbles(blk[..., 2:]).reshape(raw.shape[0], -1), d, -8 * d)


def decode_q4_1(raw: Tensor) -> Int4Groups:
    """Q4_1: 20-byte blocks of 32: fp16 d, fp16 m, 16 bytes of codes; w = d * q + m."""
    blk = raw.view(raw.shape[0], -1, 20)
    return Int4Groups(_nibbles(blk[..., 4:]).reshape(raw.shape[0], -1),
                      _f16(blk[..., 0:2]), _f16(blk[..., 2:4]))


def decode_q4_k(raw: Tensor) -> Int4Groups:
    """Q4_K: 144-byte super-blocks of 256: fp16 d, fp16 dmin, 12 bytes of eight 6-bit
    (sc, m) pairs, 128 bytes of codes; sub-block j is w = d sc_j q - dmin m_j."""
    n = raw.shape[0]
    blk = raw.view(n, -1, 144)
    d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
    s = blk[..., 4:16].to(torch.int32)                                    # [N, S, 12]
    # Pairs 0-3: low 6 bits of bytes 0-3 (sc) and 4-7 (m). Pairs 4-7: a nibble of bytes
    # 8-11 below the top 2 bits of bytes 0-3 (sc) and 4-7 (m).
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    # Codes: four 32-byte chunks; chunk c's low nibbles are sub-block 2c, high ones 2c + 1.
    qs = blk[..., 16:].reshape(n, -1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1)          # [N, K]
    scale = (d.unsqueeze(-1) * sc).reshape(n, -1)                         # [N, K/32]
    minimum = -(dmin.unsqueeze(-1) * m).reshape(n, -1)
    return Int4Groups(codes, scale, minimum)


DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q4_K": decode_q4_k}


def quantize_model(model: nn.Module, method: str, checkpoint: str | None = None,
                   lm_head: bool = True) -> int:
    """Replace the model's linear layers by QuantLinear, in place, after its weights are
    loaded. `method`: none, int8 (any checkpoint) or gguf (the GGUF file `checkpoint`'s
    own blocks). `lm_head`: quantize the output layer too (int8; with tied embeddings the
    lookup then reads the same int8 table). Returns how many layers were replaced."""
    if method == "none":
        return 0
    if method == "gguf":
        if not checkpoint or os.path.isdir(checkpoint):
            raise ConfigError("quantization gguf needs a GGUF checkpoint (use int8 for "
                              "Hugging Face folders and dummy weights)")
        return quantize_from_gguf(model, checkpoint, lm_head)
    if method != "int8":
        raise ConfigError(f"unknown quantization {method!r}")
    count = 0
    for parent, name, child in _linears(model):
        if name != "lm_head":
            setattr(parent, name, int8_linear(child.weight, child.bias, child.weight.dtype))
            count += 1
    if lm_head:
        quantize_lm_head(model)
        count += 1
    return count
