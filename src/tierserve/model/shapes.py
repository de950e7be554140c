"""Model shapes: the numbers that size weights, KV cache and FLOPs. Plain Python (no torch),
so the simulator can use them."""

from dataclasses import dataclass, field

from tierserve.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0
    """0 means hidden_size // num_heads."""
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    """None, or {"rope_type": "linear"|"llama3", "factor": ..., ...} as in HF configs."""
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    # Gemma 3 differs from Llama only in the fields below; their defaults are Llama's.
    sliding_window: int = 0
    """Keys a local layer sees (its own token included); 0: no local layers."""
    layer_types: tuple[str, ...] = ()
    """"sliding" or "full" per layer; empty means all "full"."""
    rope_local_theta: float = 0.0
    """RoPE base of the sliding layers; 0 means rope_theta. rope_scaling is global-only."""
    qk_norm: bool = False
    """RMSNorm over each q and k head, before RoPE."""
    post_norms: bool = False
    """Also norm the attention and MLP outputs before each residual add (4 norms a layer)."""
    hidden_act: str = "silu"
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    embed_scale: float = 1.0
    """Embeddings are multiplied by this (Gemma: sqrt(hidden_size))."""
    query_pre_attn_scalar: float = 0.0
    """Attention scores are scaled by this ** -0.5; 0 means head_dim."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{self.name}: {len(self.layer_types)} layer_types for "
                              f"{self.num_layers} layers")
        if "sliding" in self.layer_types and self.sliding_window < 1:
            raise ConfigError(f"{self.name}: sliding layers need a sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"{self.name}: unknown hidden_act {self.hidden_act!r}")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size)
                     + self.q_size * self.hidden_size
                     + 3 * self.hidden_size * self.intermediate_size
                     + (4 if self.post_norms else 2) * self.hidden_size
                     + (2 * self.head_dim if self.qk_norm else 0))
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """Keys and values of one token, all layers; an int8 cache adds a float32 scale
        per KV head."""
        if kv_cache_dtype == "int8":
            return 2 * self.num_layers * (self.kv_size + 4 * self.num_kv_heads)
        return 2 * self.num_layers * self.kv_size * dtype_bytes


PRESETS = {
    "smollm2-135m": ModelShape(
        "smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": ModelShape(
        "llama-3.2-1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
        intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3-8b": ModelShape(
        "llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=8192),
    "llama-3-70b": ModelShape(
        "llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        intermediate_size=28672, vocab_size=128256, rope_theta=500000.0,
        max_position_embeddings=8192),
    "qwen2.5-7b": ModelShape(
        "qwen2.5-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
        intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True),
    # Global layers every 6th (5, 11, 17); the rest see the last 512 tokens.
    "gemma3-270m": ModelShape(
        "gemma3-270m", num_layers=18, hidden_size=640, num_heads=4, num_kv_heads=1,
        intermediate_size=2048, vocab_size=262144, head_dim=256, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
        sliding_window=512, layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                              for i in range(18)),
        rope_local_theta=10000.0, qk_norm=True, post_norms=True, hidden_act="gelu_tanh",
        embed_scale=640 ** 0.5, query_pre_attn_scalar=256),
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model shape preset {name!r}; "
                          f"known: {', '.join(sorted(PRESETS))}") from None
