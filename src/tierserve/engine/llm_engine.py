"""LLMEngine: one step = plan (EngineCore), run the model, apply (EngineCore), make outputs.

The step's bookkeeping is the core's (core/engine_core.py), shared with the simulator;
what is the engine's own is the model runner, tokenizing and detokenizing.
"""

import itertools
from dataclasses import dataclass, field

from tierserve.config import EngineConfig
from tierserve.core.clock import Clock
from tierserve.core.engine_core import EngineCore
from tierserve.core.outputs import CompletionOutput, RequestOutput
from tierserve.core.request import NO_OWNER, Owner, Request, RequestStatus
from tierserve.core.stats import Metering, RequestStats, StatSink
from tierserve.core.step_time import StepTimeModel
from tierserve.core.tier_rules import priority_cap_s
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.errors import ConfigError, ContextLengthError, InvalidRequestError
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier

MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class _Tracked:
    """Engine-side state of one request: what the scheduler does not need to know."""

    request: Request
    prompt: str | None
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stats: RequestStats
    num_sent_tokens: int = 0
    logprobs: list = field(default_factory=list)
    """Per output token, where the request asked for logprobs."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None,
                 stat_sinks: list[StatSink] | None = None, progress=None):
        """`progress`, if given, is called with a line per loading stage."""
        from tierserve.model.loader import load_model
        from tierserve.model.tokenizer import Tokenizer
        from tierserve.worker.model_runner import ModelRunner

        self.config = config = config or EngineConfig()
        config.validate()
        if config.tiers.deployment != "shared":
            raise ConfigError("the dedicated deployment is two engines: run it with "
                              "`tierserve serve --deployment dedicated`")
        self.clock = clock or Clock()
        mc, cc = config.model, config.cache
        if mc.load_format == "dummy":
            from tierserve.model.shapes import preset
            shape = preset(mc.model or "smollm2-135m")
        else:
            from tierserve.model.metadata import default_model_path, read_shape
            shape = read_shape(mc.model or default_model_path(), mc.load_format)
        if cc.kv_cache_dtype == "int8":   # refused before the weights load
            from tierserve.model import cpu_step, kernels
            reason = cpu_step.int8_kv_refusal(shape, mc.device, kernels.load())
            if reason:
                raise ConfigError(reason)
        widened = _widen_bf16(mc)
        dtype_bytes = 4 if mc.dtype == "float32" else 2
        num_blocks = cc.num_kv_blocks or int(
            cc.kv_cache_memory_gb * 2**30
            // (shape.kv_bytes_per_token(dtype_bytes, cc.kv_cache_dtype) * cc.block_size))
        if num_blocks < 1:
            raise ConfigError("kv_cache_memory_gb is too small for one KV block")
        self.max_model_len = min(mc.max_model_len or min(shape.max_position_embeddings,
                                                         MAX_DEFAULT_MODEL_LEN),
                                 num_blocks * cc.block_size)
        if not config.scheduler.enable_chunked_prefill:  # a (re)computed prompt must fit a step
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        say = progress or (lambda line: None)
        if widened:
            say("bfloat16 computes in float32 here: this CPU has no bfloat16 matmul (oneDNN "
                "needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT), where torch's bf16 linear layers "
                "run 4-8x slower than float32 at 64-512 rows (2-core EPYC Zen 3, AVX2); the "
                "bf16 weights are exact in float32, packed by oneDNN (1.4-3.1x torch's "
                "float32 decode step at 1-16 streams there)")
        say(f"loading weights of {mc.model or 'the default model'} ({mc.dtype}, {mc.device})")
        self.loaded = load_model(mc, max_positions=self.max_model_len)
        say(f"loaded {self.loaded.shape.num_params / 1e6:.0f}M parameters; loading tokenizer")
        self.shape = self.loaded.shape
        self._grammars = None
        self.tokenizer = Tokenizer.load(self.loaded.tokenizer_source) \
            if self.loaded.tokenizer_source else None
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else None
        if mc.quantization == "none" and mc.device == "cpu" and \
                str(self.loaded.source).endswith(".gguf"):
            from tierserve.model import kernels
            from tierserve.model.cpu_linear import packs_bf16

            built = kernels.load()
            avx2 = bool(getattr(built, "int4_kernel", False)
                        and not getattr(built, "int4_vnni", False))
            say(f"weights in {mc.dtype} (--quantization none); --quantization gguf keeps this "
                "file's 4-bit blocks packed: " + (
                    "on this CPU (AVX2, no AVX-512) 4x float32's tokens/s at one stream and "
                    "1.45x or more at 16 and 64 (offline, 128/128 tokens, 2-core EPYC Zen 3"
                    if avx2 else
                    "on this CPU (no AVX-512, and no 4-bit kernel of ours built) what torch's "
                    "int4 kernel gives: 1.7x float32's tokens/s at one stream, behind it from "
                    "16 streams (2-core EPYC Zen 3 before its AVX2 kernels"
                    if not packs_bf16() else
                    "on a CPU about 2.3x bf16's tokens/s at one stream and level with it at "
                    "16-64 streams, where bf16's prompts start sooner (2-core EPYC Zen 5")
                + "; docs/benchmarks.md; `make serve` uses gguf)")
        from tierserve.model.generation import describe, generation_defaults
        self.generation_defaults, source = generation_defaults(
            mc.generation_config, None if mc.load_format == "dummy" else self.loaded.source,
            self.shape.name)
        if self.generation_defaults:
            say(f"sampling defaults where a request gives none: "
                f"{describe(self.generation_defaults)} (from {source}; "
                "--generation-config vllm: OpenAI's)")
        self.core = EngineCore(config.scheduler, num_blocks, cc.block_size, self.max_model_len,
                               cc.enable_prefix_caching, speculative=config.speculative)
        if config.speculative is not None:
            spec = config.speculative
            say(f"speculative decoding: n-gram prompt lookup, up to "
                f"{spec.num_speculative_tokens} draft tokens ({spec.prompt_lookup_min}-"
                f"{spec.prompt_lookup_max}-grams) for {', '.join(spec.tiers)}, while at most "
                f"{spec.disable_by_batch_size} requests run")
        self.core.accounting.sinks.extend(stat_sinks or [])
        self.scheduler, self.block_manager = self.core.scheduler, self.core.block_manager
        self.runner = ModelRunner(self.loaded.model, num_blocks, cc.block_size, mc.seed,
                                  kv_cache_dtype=cc.kv_cache_dtype)
        lean = self.runner.lean
        if lean is not None and lean.dense_bytes:
            from tierserve.model.cpu_step import DENSE_ROWS
            say(f"AMX here: the 4/8-bit layers are also held in bfloat16 "
                f"({lean.dense_bytes / 1e6:.0f} MB) for steps over {DENSE_ROWS} rows (prompt "
                "chunks, large batches): level with their integer kernels at 32 rows, "
                "1.4-2.2x their speed from 64 on a 2-vCPU Xeon; TIERSERVE_NO_DENSE_COPY=1 "
                "keeps the integer kernels")
        elif lean is not None and lean.dense_note:
            say(lean.dense_note)
        if cc.kv_cache_dtype == "int8":
            import torch
            fast = self.runner.decode_kernel.kv_int8_vnni and self.runner.dtype == torch.bfloat16
            say("KV cache in int8 (a float32 scale per token and KV head): decode attention "
                + ("on integer dot products (AVX-512 VNNI)" if fast else
                   "by the kernel's scalar loop here (it takes bfloat16 on a CPU with "
                   "AVX-512 BF16 and VNNI for its fast path): slower than the "
                   "uncompressed cache, kept for memory"))
        say(f"KV cache: {num_blocks} blocks of {cc.block_size} tokens"
            f"{' in int8' if cc.kv_cache_dtype == 'int8' else ''}; "
            f"max_model_len {self.max_model_len}")
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        if self.core.policy.tiered and config.scheduler.priority_step_time_s != 0:
            self._set_step_time_cap(say)

    def _set_step_time_cap(self, say) -> None:
        """The tiered policy's cap: a step-time model (from a profile, or this machine's
        cached calibration, or calibrated now) and the limit (core/tier_rules.py's
        priority_cap_s: explicit, else 0.9 of the priority TPOT SLO, else 3x a lone
        decode step)."""
        from tierserve.engine.calibrate import calibrate_cached

        profile = self.config.tiers.step_time_profile
        model = StepTimeModel.load(profile) if profile else calibrate_cached(self, say)
        slo = self.config.tiers.slo.get("priority")
        limit = priority_cap_s(model, slo and slo.tpot_s,
                               self.config.scheduler.priority_step_time_s or None)
        self.scheduler.step_time_model = model
        self.scheduler.step_time_limit_s = limit
        say(f"priority step-time cap {limit * 1e3:.1f} ms (a lone decode step: "
            f"{model.predict_s([(1, 256)]) * 1e3:.1f} ms); steps with decodes "
            f"{(self.scheduler.decode_time_limit_s or 0) * 1e3:.1f} ms (0: off)")

    # ---------------------------------------------------------------- sinks
    def add_sink(self, sink: StatSink) -> None:
        self.core.accounting.sinks.append(sink)

    def remove_sink(self, sink: StatSink) -> None:
        if sink in self.core.accounting.sinks:
            self.core.accounting.sinks.remove(sink)

    def set_metering(self, metering: Metering | None) -> None:
        """The one consumer that prices steps and requests, before every sink."""
        self.core.accounting.metering = metering

    # ------------------------------------------------------------- requests
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, tier: Tier | str = Tier.DEFAULT,
                    priority: int = 0, owner: Owner | None = None) -> str:
        """Queue a request (text, or token ids) asking for a service tier (it is served in
        `served_tier(tier)`); `priority` orders requests within a tier, lower first;
        `owner` (tenant, weight, cache salt) sets its fair share and which cached prefixes
        it may reuse (None: the anonymous owner).
        Raises InvalidRequestError, queuing nothing."""
        params = params or SamplingParams()
        try:
            asked = Tier.parse(tier)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="service_tier") from None
        tier_value = self.core.tier_map[asked]
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(prompt_ids, params, self.scheduler.max_len(tier_value))
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id, stop_token_ids=list(params.stop_token_ids),
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos, tier=tier_value,
            priority=priority, owner=owner or NO_OWNER,
            can_speculate=params.logprobs is None)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                           params.skip_special_tokens, params.min_tokens)
        grammar = self._compile(params.grammar) if params.grammar is not None else None
        self.runner.add_request(request_id, params, self.eos_token_id, prompt_ids, grammar)
        stats = self.core.add(request, asked)
        self._tracked[request_id] = _Tracked(request, prompt_text, params, detok, stats)
        return request_id

    def _compile(self, spec):
        """The request's grammar, compiled (cached by spec); the compiler, with its table of
        the vocabulary (about 0.7 s to build), is made for the first structured request."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs the model's tokenizer",
                                      param=spec.param)
        if self._grammars is None:
            from tierserve.worker.grammar import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer)
        return self._grammars.compile(spec)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (dummy weights): "
                                          "give token ids", param="prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            if not all(isinstance(t, int) and 0 <= t < self.shape.vocab_size for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.shape.vocab_size})",
                    param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return text, ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams,
                       limit: int) -> int:
        room = limit - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context "
                f"length is {limit} tokens", param="messages")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; the "
                f"prompt has {len(prompt_ids)} and max_tokens asks for {params.max_tokens}",
                param="max_tokens")
        return params.max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks return to the pool before this returns."""
        request = self.core.end(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._output(self._tracked[request_id], self.clock.now())

    @property
    def tier_map(self) -> dict[Tier, Tier]:
        """Tier asked for -> the tier it is served in (the policy's word, fixed)."""
        return self.core.tier_map

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        begin = self.clock.now()
        scheduled, refused = self.core.plan(begin)
        outputs = [self._output(self._tracked[r.request_id], begin) for r in refused]
        if scheduled.is_empty:
            return outputs
        start = self.clock.now()
        self.core.begin(start)
        result = self.runner.execute(scheduled)
        end = self.clock.now()
        touched = self.core.apply(scheduled, result, start, end,
                                  measured_s=end - begin)  # the whole step, as a token waits
        for rid, entry in result.logprobs.items():
            tracked = self._tracked.get(rid)
            if tracked is not None:
                tracked.logprobs.append(entry)
        return outputs + [self._output(self._tracked[r.request_id], end) for r in touched]

    def _output(self, tracked: _Tracked, now: float) -> RequestOutput:
        request, stats, detok = tracked.request, tracked.stats, tracked.detokenizer
        new_ids = request.output_token_ids[tracked.num_sent_tokens:]
        tracked.num_sent_tokens = request.num_output_tokens
        if detok is not None:
            for i, token in enumerate(new_ids):
                if detok.add_token(token):  # a stop string matched: it ends the request
                    request.stop_reason = detok.stop_reason
                    self._drop_after(tracked, len(new_ids) - i - 1)
                    new_ids = new_ids[:i + 1]
                    if request.is_finished:
                        request.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.core.end(request.request_id, RequestStatus.FINISHED_STOPPED)
                    break
        finished = request.is_finished
        delta = detok.take_delta(finished) if detok is not None else ""
        completion = CompletionOutput(
            index=0, text=detok.text if detok else "", token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
            logprobs=list(tracked.logprobs) if tracked.params.logprobs is not None else None)
        if finished:
            self._finish(tracked, now)
        return RequestOutput(request.request_id, tracked.prompt, request.prompt_token_ids,
                             [completion], finished, delta, new_ids, stats)

    @staticmethod
    def _drop_after(tracked: _Tracked, extra: int) -> None:
        """Tokens a step made past a matched stop string (a speculating step makes
        several) are not output: drop them from the request and its timeline."""
        if extra <= 0:
            return
        del tracked.request.output_token_ids[-extra:]
        del tracked.stats.token_times[-extra:]
        tracked.num_sent_tokens -= extra

    def _finish(self, tracked: _Tracked, now: float) -> None:
        self._tracked.pop(tracked.request.request_id, None)
        self.runner.remove_request(tracked.request.request_id)
        self.core.finish(tracked.request, now)


def _widen_bf16(mc) -> bool:
    """An unquantized bfloat16 model on a CPU without bfloat16 matmul (AVX2 only) is run in
    float32 (mc.dtype set so); True if so. Quantized models keep bfloat16 activations:
    their layers are quant.py's kernels, not oneDNN's."""
    if mc.dtype != "bfloat16" or mc.device != "cpu" or mc.quantization != "none":
        return False
    from tierserve.model.cpu_linear import packs_bf16

    if packs_bf16():
        return False
    mc.dtype = "float32"
    return True
