"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, and Gemma 3) over a paged
KV cache.

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

Gemma 3 is this decoder with the ModelShape flags set (shapes.py): q/k norms, norms on the
attention and MLP outputs, GeGLU, scaled embeddings, its attention scale, and sliding-window
layers. A sliding layer keeps every key in the cache like a global one and masks keys more
than `sliding_window - 1` positions behind the query (`sliding_window_metadata`), with its
own RoPE base. Dropping those keys from the cache would save memory; that is not done.
"""

import math
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tierserve.model.cpu_attention import paged_decode
from tierserve.model.shapes import ModelShape


@dataclass
class PrefillChunk:
    start: int
    """Offset of the chunk in the packed batch."""
    end: int
    block_table: Tensor | None
    """[num_blocks] long, when the chunk attends to cached context; None when it starts at 0."""
    mask: Tensor | None
    """[q, num_blocks * block_size] bool, True where a key is visible; for a chunk from 0,
    None (causal) or, in a sliding-window layer, [q, q]."""


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor
    """[T] long: cache slot (block * block_size + offset) of each new token's K/V."""
    num_decodes: int
    """The first num_decodes tokens are queries of the paged decode kernel, each over its
    own context: decodes, a speculating decode's positions and, in the lean step, prompt
    positions (worker/model_runner.py's _paged)."""
    decode_block_tables: Tensor | None
    """[D, max_blocks] long, padded with block 0."""
    decode_mask: Tensor | None
    """[D, 1, 1, max_blocks * block_size] bool."""
    decode_context_lens: Tensor | None
    """[D] long: tokens each decode attends to (its position + 1)."""
    prefills: list[PrefillChunk]
    decode_kernel: object = None
    """The compiled paged decode kernel (model/cpu_attention.py), or None for torch ops."""

    @classmethod
    def one_sequence(cls, length: int, paged_kernel=None, block_size: int = 16
                     ) -> "AttentionMetadata":
        """One sequence of `length` tokens from position 0 in cache blocks 0, 1, ... (for
        teacher-forced quality checks): one prefill chunk for SDPA, or, given the paged
        kernel, each position a query over its own context, as the engine's lean step
        computes a prompt."""
        if paged_kernel is None:
            return cls(slot_mapping=torch.arange(length), num_decodes=0,
                       decode_block_tables=None, decode_mask=None, decode_context_lens=None,
                       prefills=[PrefillChunk(0, length, None, None)])
        return cls(slot_mapping=torch.arange(length), num_decodes=length,
                   decode_block_tables=torch.arange(-(-length // block_size)).repeat(length, 1),
                   decode_mask=None, decode_context_lens=torch.arange(1, length + 1),
                   prefills=[], decode_kernel=paged_kernel)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, with linear or llama3 frequency scaling.
    `local`: the tables of sliding-window layers (their own base, never scaled)."""

    def __init__(self, shape: ModelShape, max_positions: int, local: bool = False):
        super().__init__()
        d = shape.head_dim
        theta = (shape.rope_local_theta or shape.rope_theta) if local else shape.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaling = None if local else shape.rope_scaling
        self.inv_freq = _scale_frequencies(inv_freq, scaling)             # [d/2] float64
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
        # Full-width tables: out = x * cos + swap_halves(x) * sin, with the sign folded in.
        self.cos = torch.cat([freqs.cos()] * 2, dim=-1).float().to(device)          # [P, d]
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).float().to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin for the step's positions: [T, 1, d] each, once per step."""
        return (self.cos[positions].to(dtype).unsqueeze(1),
                self.sin[positions].to(dtype).unsqueeze(1))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on [T, heads, d]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    T, heads, d = x.shape
    swapped = x.view(T, heads, 2, d // 2).flip(2).view(T, heads, d)       # (x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


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
        self.eps = shape.rms_norm_eps
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if shape.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if shape.qk_norm else None
        # SDPA and the decode kernel scale scores by head_dim ** -0.5; a model that wants
        # query_pre_attn_scalar ** -0.5 instead gets q pre-multiplied by the ratio.
        scalar = shape.query_pre_attn_scalar or self.head_dim
        self.q_scale = (self.head_dim / scalar) ** 0.5

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionMetadata,
                kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k heads rotate together: one RoPE call per layer
            q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = apply_rope(_rms_norm(q, self.q_norm, self.eps), *rope)
            k = apply_rope(_rms_norm(k, self.k_norm, self.eps), *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache                           # [blocks, block_size, Hkv, d]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, attn.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, attn.slot_mapping, v)
        D = attn.num_decodes
        if D == T:                                            # a decode-only step
            return self.o_proj(self._decode(q, k_cache, v_cache, attn).view(T, self.q_size))
        out = torch.empty_like(q)                             # [T, H, d]
        if D:
            out[:D] = self._decode(q[:D], k_cache, v_cache, attn)
        for chunk in attn.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return self.o_proj(out.view(T, self.q_size))

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                attn: AttentionMetadata) -> Tensor:
        if attn.decode_kernel is not None:
            return paged_decode(attn.decode_kernel, q, k_cache, v_cache,
                                attn.decode_block_tables, attn.decode_context_lens)
        D, group = q.shape[0], self.num_heads // self.num_kv_heads
        keys = _gather_blocks(k_cache, attn.decode_block_tables)   # [D, L, Hkv, d]
        values = _gather_blocks(v_cache, attn.decode_block_tables)
        # The `group` query heads sharing a KV head attend as `group` query rows.
        qg = q.view(D, self.num_kv_heads, group, self.head_dim)    # [D, Hkv, g, d]
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=attn.decode_mask)
        return o.reshape(D, self.num_heads, self.head_dim)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 chunk: PrefillChunk) -> Tensor:
        qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.block_table is None:  # mask: None (causal) but in a sliding window
            keys, values = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
        else:
            keys = _gather_blocks(k_cache, chunk.block_table)       # [L, Hkv, d]
            values = _gather_blocks(v_cache, chunk.block_table)
        mask = chunk.mask
        o = F.scaled_dot_product_attention(
            qc, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return o[0].transpose(0, 1)                                  # [n, H, d]


def _gather_blocks(cache: Tensor, block_tables: Tensor) -> Tensor:
    """cache [blocks, block_size, Hkv, d], tables [..., n] -> [..., n * block_size, Hkv, d].

    index_select over whole blocks viewed as rows copies each block in one piece, about
    three times faster than advanced indexing of the 4-D cache."""
    num_blocks, block_size, heads, dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.flatten())
    return rows.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, heads, dim)


class MLP(nn.Module):
    """Gated MLP: SwiGLU (silu) or GeGLU (gelu, tanh approximation)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.act = F.silu if shape.hidden_act == "silu" else partial(F.gelu, approximate="tanh")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """h + attn(norm(h)), then h + mlp(norm(h)); with `post_norms` (Gemma) the attention
    and MLP outputs are normed too before they are added."""

    def __init__(self, shape: ModelShape, index: int):
        super().__init__()
        self.eps = shape.rms_norm_eps
        self.sliding = shape.is_sliding(index)
        self.input_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.attn = Attention(shape)
        self.mlp_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.mlp = MLP(shape)
        post = shape.post_norms
        self.attn_out_norm = nn.Parameter(torch.ones(shape.hidden_size)) if post else None
        self.mlp_out_norm = nn.Parameter(torch.ones(shape.hidden_size)) if post else None

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionMetadata,
                kv_cache: tuple[Tensor, Tensor]) -> Tensor:
        a = self.attn(_rms_norm(h, self.input_norm, self.eps), rope, attn, kv_cache)
        if self.attn_out_norm is not None:
            a = _rms_norm(a, self.attn_out_norm, self.eps)
        h = h + a
        m = self.mlp(_rms_norm(h, self.mlp_norm, self.eps))
        if self.mlp_out_norm is not None:
            m = _rms_norm(m, self.mlp_out_norm, self.eps)
        return h + m


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def sliding_window_metadata(attn: AttentionMetadata, positions: Tensor, window: int,
                            block_size: int) -> AttentionMetadata:
    """The step as a sliding-window layer sees it: a key is visible to a query when
    query position - window < key position <= query position. Only the masks change (the
    decode kernel has no window, so decodes take the masked torch path); a step whose
    queries all sit below `window` is returned as it is."""
    if int(positions.max()) < window:
        return attn
    decode_mask = None
    if attn.num_decodes:
        lens = attn.decode_context_lens.unsqueeze(1)                       # [D, 1]
        width = attn.decode_block_tables.shape[1] * block_size
        key_pos = torch.arange(width, device=lens.device)
        decode_mask = ((key_pos < lens) & (key_pos >= lens - window))[:, None, None, :]
    prefills = [_window_chunk(c, positions[c.start:c.end], window) for c in attn.prefills]
    return replace(attn, decode_mask=decode_mask, decode_kernel=None, prefills=prefills)


def _window_chunk(chunk: PrefillChunk, query_pos: Tensor, window: int) -> PrefillChunk:
    if int(query_pos[-1]) < window:
        return chunk
    if chunk.block_table is None:         # keys are the chunk's own tokens, from position 0
        key_pos = query_pos
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    else:
        key_pos = torch.arange(chunk.mask.shape[1], device=query_pos.device)
        causal = chunk.mask
    in_window = key_pos.unsqueeze(0) > query_pos.unsqueeze(1) - window      # [n, L]
    return replace(chunk, mask=causal & in_window)


class LlamaModel(nn.Module):
    def __init__(self, shape: ModelShape, max_positions: int):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.rope = RotaryEmbedding(shape, max_positions)
        self.rope_local = RotaryEmbedding(shape, max_positions, local=True) \
            if shape.sliding_window else None
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        h = self.embed(input_ids)
        rope = self.rope(positions, h.dtype)
        if self.rope_local is not None:
            local = (self.rope_local(positions, h.dtype), sliding_window_metadata(
                attn, positions, self.shape.sliding_window, kv_caches[0][0].shape[1]))
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, *local, kv_cache) if layer.sliding else layer(h, rope, attn, kv_cache)
        return _rms_norm(h, self.norm, self.shape.rms_norm_eps)

    def embed(self, input_ids: Tensor) -> Tensor:
        h = self.embed_tokens(input_ids)
        return h * self.shape.embed_scale if self.shape.embed_scale != 1.0 else h

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [S, hidden] -> float32 logits [S, vocab]."""
        return self.lm_head(hidden).float()
