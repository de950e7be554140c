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

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")

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
                     + 2 * self.hidden_size)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
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
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model shape preset {name!r}; "
                          f"known: {', '.join(sorted(PRESETS))}") from None
