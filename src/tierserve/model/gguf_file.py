"""Read a llama.cpp GGUF file's tensors, dequantized by `gguf` (its metadata and shape:
model/metadata.py).

Tensor names are translated to Hugging Face names here, once, so the weight mapping in
`loader.py` knows one naming. llama.cpp's converter permutes the rows of Q and K of
`llama`-architecture models (to interleave the rotary pairs); we undo that so the model
uses the rotate-half layout of the Hugging Face checkpoints.

Gemma 3 has two more norms a layer and q/k norms, and its `ffn_norm` is the pre-MLP norm
(Llama's post_attention_layernorm has that role). Its RMSNorm multiplies by (1 + w); the
converter stored 1 + w, which is what our plain RMSNorm wants, so those weights are kept
as they are (transformers subtracts the 1 and adds it back in its forward).
"""

import re
from collections.abc import Iterator

import numpy as np
import torch

from tierserve.errors import ModelLoadError, UnsupportedModelError
from tierserve.model.metadata import GGUFMetadata
from tierserve.model.shapes import ModelShape

SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs",
}


class GGUFCheckpoint(GGUFMetadata):
    """A GGUF file's tensors, decoded to float32 torch tensors."""

    def tensors(self, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor, Q/K un-permuted."""
        from gguf import quants

        for t in self.reader.tensors:
            qtype = t.tensor_type.name
            if qtype not in SUPPORTED_QUANTS:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name} uses quantization type {qtype}, which "
                    f"tierserve does not load (supported: {', '.join(SUPPORTED_QUANTS)})")
            name = hf_name(t.name, self.arch)
            if name is None:
                continue
            try:
                array = quants.dequantize(t.data, t.tensor_type)
            except Exception as exc:
                raise ModelLoadError(f"{self.path}: cannot decode tensor {t.name} "
                                     f"({qtype}): {exc}") from None
            array = np.array(array, dtype=np.float32, copy=not array.flags.writeable).reshape(
                tuple(int(d) for d in reversed(t.shape)))
            tensor = torch.from_numpy(array)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                tensor = unpermute(tensor, shape.num_heads)
            elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                tensor = unpermute(tensor, shape.num_kv_heads)
            yield name, tensor


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation (per head: interleaved -> halves)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))
