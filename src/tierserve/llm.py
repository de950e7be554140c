"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams)`."""

from tierserve.config import (SLO, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                              SpeculativeConfig, TierConfig)
from tierserve.engine.llm_engine import LLMEngine
from tierserve.core.outputs import RequestOutput
from tierserve.sampling_params import SamplingParams

_MODEL_KEYS = set(ModelConfig.__dataclass_fields__)
_CACHE_KEYS = set(CacheConfig.__dataclass_fields__)
_SCHED_KEYS = set(SchedulerConfig.__dataclass_fields__)
_TIER_KEYS = set(TierConfig.__dataclass_fields__)


def engine_config(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (vLLM's style)."""
    from tierserve.errors import ConfigError

    parts = {"model": {}, "cache": {}, "scheduler": {}, "tiers": {}}
    speculative = None
    for key, value in kwargs.items():
        if key == "speculative_config":    # vLLM's keyword: a dict (or its JSON)
            speculative = SpeculativeConfig.parse(value) if value else None
        elif key in _MODEL_KEYS:
            parts["model"][key] = value
        elif key in _CACHE_KEYS:
            parts["cache"][key] = value
        elif key in _SCHED_KEYS:
            parts["scheduler"][key] = value
        elif key in _TIER_KEYS:
            parts["tiers"][key] = value
        else:
            raise ConfigError(f"unknown engine option {key!r}")
    if "slo" in parts["tiers"]:
        parts["tiers"]["slo"] = parse_slo(parts["tiers"]["slo"])
    return EngineConfig(ModelConfig(**parts["model"]), CacheConfig(**parts["cache"]),
                        SchedulerConfig(**parts["scheduler"]), TierConfig(**parts["tiers"]),
                        speculative)


def parse_slo(raw) -> dict[str, SLO]:
    """{tier: {ttft_s, tpot_s}} (as in YAML) or {tier: SLO} -> {tier: SLO}."""
    from tierserve.errors import ConfigError

    out = {}
    for tier, spec in (raw or {}).items():
        if isinstance(spec, SLO):
            out[tier] = spec
            continue
        if not isinstance(spec, dict) or set(spec) - {"ttft_s", "tpot_s"}:
            raise ConfigError(f"slo.{tier}: expected {{ttft_s: seconds, tpot_s: seconds}}, "
                              f"got {spec!r}")
        out[tier] = SLO(**{k: float(v) for k, v in spec.items()})
    return out


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(engine_config(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            from tierserve.errors import InvalidRequestError
            raise InvalidRequestError("need one SamplingParams, or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        return self.generate([tok.apply_chat_template(c) for c in convs], sampling_params)
