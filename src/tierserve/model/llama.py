"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Reads top to bottom: embedding -> N x (attention, MLP) -> norm -> logits. Every input is
explicit: `forward(input_ids, positions, attn, kv_caches)`; nothing hides in globals.

NOTE: one forward pass serves a mixed batch. The T tokens of a step are packed: first D
single-token decodes (one per request), then the prefill chunks, each a contiguous span.
Each layer writes the new K/V of all T tokens into the paged cache through `slot_mapping`,
then attends:
  - decodes together: their K/V blocks are gathered by block table into a padded
    [D, L] batch, and each decode's query heads of one KV head attend as a group (GQA);
  - each prefill chunk alone: over its own fresh K/V when it starts at position 0, or over
    its cached context gathered by block table when it continues a chunk or a cached prefix.
A key is visible to a query when key position <= query position, which masks both the
future and the padding of the gathered blocks.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tierserve.model.shapes import ModelShape


@dataclass
class PrefillChunk:
    start: int
    """Offset of the chunk in the packed batch."""
    end: int
    block_table: Tensor | None
    """[num_blocks] long, when the chunk attends to cached context; None when it starts at 0."""
    mask: Tensor | None
    """[q, num_blocks * block_size] bool, True where a key is visible."""


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor
    """[T] long: cache slot (block * block_size + offset) of each new token's K/V."""
    num_decodes: int
    """The first num_decodes tokens are single-token decodes."""
    decode_block_tables: Tensor | None
    """[D, max_blocks] long, padded with block 0."""
    decode_mask: Tensor | None
    """[D, 1, 1, max_blocks * block_size] bool."""
    prefills: list[PrefillChunk]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, with linear or llama3 frequency scaling."""

    def __init__(self, shape: ModelShape, max_positions: int):
        super().__init__()
        d = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.inv_freq = _scale_frequencies(inv_freq, shape.rope_scaling)  # [d/2] float64
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build()

    def set_frequency_factors(self, factors: Tensor) -> None:
        """GGUF llama3 checkpoints store per-frequency divisors as a tensor (rope_freqs)."""
        self.inv_freq = self.inv_freq / factors.double().cpu()
        self._build()

    def _build(self) -> None:
        t = torch.arange(self.max_positions, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)                             # [P, d/2]
        device = self.cos.device
        self.cos = freqs.cos().float().to(device)
        self.sin = freqs.sin().float().to(device)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)                # [T, 1, d/2]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                           # [T, H, d/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _scale_frequencies(inv_freq: Tensor, scaling: dict | None) -> Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        in_band = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(in_band, mid, out)
    return inv_freq  # "default" and unknown kinds: no scaling


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size, self.kv_size = shape.q_size, shape.kv_size
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k, positions)
        k_cache, v_cache = kv_cache                           # [blocks, block_size, Hkv, d]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, attn.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, attn.slot_mapping, v)
        out = torch.empty_like(q)                             # [T, H, d]
        if attn.num_decodes:
            D = attn.num_decodes
            out[:D] = self._decode(q[:D], k_cache, v_cache, attn)
        for chunk in attn.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return self.o_proj(out.view(T, self.q_size))

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                attn: AttentionMetadata) -> Tensor:
        D, group = q.shape[0], self.num_heads // self.num_kv_heads
        keys = k_cache[attn.decode_block_tables].flatten(1, 2)   # [D, L, Hkv, d]
        values = v_cache[attn.decode_block_tables].flatten(1, 2)
        # The `group` query heads sharing a KV head attend as `group` query rows.
        qg = q.view(D, self.num_kv_heads, group, self.head_dim)    # [D, Hkv, g, d]
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=attn.decode_mask)
        return o.reshape(D, self.num_heads, self.head_dim)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 chunk: PrefillChunk) -> Tensor:
        qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.block_table is None:
            keys, values, mask = k[chunk.start:chunk.end], v[chunk.start:chunk.end], None
        else:
            keys = k_cache[chunk.block_table].flatten(0, 1)         # [L, Hkv, d]
            values = v_cache[chunk.block_table].flatten(0, 1)
            mask = chunk.mask
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return o[0].transpose(0, 1)                                  # [n, H, d]


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.eps = shape.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.attn = Attention(shape)
        self.post_attn_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.mlp = MLP(shape)

    def forward(self, h: Tensor, positions: Tensor, rope: RotaryEmbedding,
                attn: AttentionMetadata, kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        h = h + self.attn(_rms_norm(h, self.input_norm, self.eps), positions, rope, attn, kv_cache)
        return h + self.mlp(_rms_norm(h, self.post_attn_norm, self.eps))


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaModel(nn.Module):
    def __init__(self, shape: ModelShape, max_positions: int):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.rope = RotaryEmbedding(shape, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.lm_head = None if shape.tie_word_embeddings else nn.Linear(
            shape.hidden_size, shape.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, positions, self.rope, attn, kv_cache)
        return _rms_norm(h, self.norm, self.shape.rms_norm_eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
