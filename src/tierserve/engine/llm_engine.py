"""LLMEngine: one step = schedule, run, update, make outputs."""

import itertools
from dataclasses import dataclass

from tierserve.config import EngineConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.clock import Clock
from tierserve.core.policy import make_policy
from tierserve.core.request import Request, RequestStatus, Tier
from tierserve.core.scheduler import Scheduler, SchedulerOutput
from tierserve.core.step_time import StepTimeModel
from tierserve.engine.detokenizer import IncrementalDetokenizer
from tierserve.engine.outputs import CompletionOutput, RequestOutput
from tierserve.engine.stats import RequestStats, SeqStepStats, StatSink, StepStats
from tierserve.errors import ConfigError, ContextLengthError, InvalidRequestError
from tierserve.sampling_params import SamplingParams

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
        self.stat_sinks = list(stat_sinks or [])
        mc, cc = config.model, config.cache
        if mc.load_format == "dummy":
            from tierserve.model.shapes import preset
            shape = preset(mc.model or "smollm2-135m")
        else:
            from tierserve.model.loader import default_model_path, read_shape
            shape = read_shape(mc.model or default_model_path(), mc.load_format)
        dtype_bytes = 4 if mc.dtype == "float32" else 2
        num_blocks = cc.num_kv_blocks or int(
            cc.kv_cache_memory_gb * 2**30 // (shape.kv_bytes_per_token(dtype_bytes) * cc.block_size))
        if num_blocks < 1:
            raise ConfigError("kv_cache_memory_gb is too small for one KV block")
        self.max_model_len = min(mc.max_model_len or min(shape.max_position_embeddings,
                                                         MAX_DEFAULT_MODEL_LEN),
                                 num_blocks * cc.block_size)
        if not config.scheduler.enable_chunked_prefill:  # a (re)computed prompt must fit a step
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        say = progress or (lambda line: None)
        say(f"loading weights of {mc.model or 'the default model'} ({mc.dtype}, {mc.device})")
        self.loaded = load_model(mc, max_positions=self.max_model_len)
        say(f"loaded {self.loaded.shape.num_params / 1e6:.0f}M parameters; loading tokenizer")
        self.shape = self.loaded.shape
        self.tokenizer = Tokenizer.load(self.loaded.tokenizer_source) \
            if self.loaded.tokenizer_source else None
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else None
        policy = make_policy(config.scheduler.policy)
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching,
                                          evict_by_tier=policy.tiered)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   policy)
        self.runner = ModelRunner(self.loaded.model, num_blocks, cc.block_size, mc.seed)
        say(f"KV cache: {num_blocks} blocks of {cc.block_size} tokens; "
            f"max_model_len {self.max_model_len}")
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._step_index = 0
        if policy.tiered and config.scheduler.priority_step_time_s != 0:
            self._set_step_time_cap(say)

    def _set_step_time_cap(self, say) -> None:
        """The tiered policy's cap: a step-time model (from a profile, or calibrated now)
        and the limit (explicit, else the priority TPOT SLO, else 3x a lone decode step)."""
        from tierserve.engine.calibrate import calibrate

        profile = self.config.tiers.step_time_profile
        if profile:
            model = StepTimeModel.load(profile)
        else:
            say("calibrating the step-time model (tierserve calibrate saves one to reuse)")
            model = calibrate(self)
        slo = self.config.tiers.slo.get("priority")
        limit = (self.config.scheduler.priority_step_time_s or (slo and slo.tpot_s)
                 or 3 * model.predict_s([(1, 256)]))
        self.scheduler.step_time_model = model
        self.scheduler.step_time_limit_s = limit
        say(f"priority step-time cap {limit * 1e3:.1f} ms (a lone decode step: "
            f"{model.predict_s([(1, 256)]) * 1e3:.1f} ms)")

    # ------------------------------------------------------------- requests
    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, tier: str = "default",
                    priority: int = 0) -> str:
        """Queue a request (text, or token ids) in a service tier; `priority` orders
        requests within a tier, lower first. Raises InvalidRequestError, queuing nothing."""
        params = params or SamplingParams()
        try:
            tier_value = Tier.parse(tier)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="service_tier") from None
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(prompt_ids, params)
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id, stop_token_ids=list(params.stop_token_ids),
            min_tokens=params.min_tokens, ignore_eos=params.ignore_eos, tier=tier_value,
            priority=priority)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                           params.skip_special_tokens, params.min_tokens)
        stats = RequestStats(request_id, request.arrival_time, num_prompt_tokens=len(prompt_ids),
                             tier=tier_value.label)
        self._tracked[request_id] = _Tracked(request, prompt_text, params, detok, stats)
        self.runner.add_request(request_id, params, self.eos_token_id)
        self.scheduler.add_request(request)
        return request_id

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

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens", param="messages")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(prompt_ids)} and max_tokens asks for {params.max_tokens}",
                param="max_tokens")
        return params.max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks return to the pool before this returns."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._output(self._tracked[request_id], self.clock.now())

    def served_tier(self, tier: str) -> str:
        """The tier a request asking for `tier` is served in: itself, except under the FCFS
        policy, which serves every request alike (as `default`)."""
        return tier if self.scheduler.policy.name != "fcfs" else "default"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        begin = self.clock.now()
        scheduled = self.scheduler.schedule(begin)
        refused = [self._output(self._tracked[i], begin) for i in scheduled.refused_ids]
        if scheduled.is_empty:
            return refused
        start = self.clock.now()
        result = self.runner.execute(scheduled)
        end = self.clock.now()
        touched = self.scheduler.update(scheduled, result)
        self._record_step(scheduled, start, end)
        outputs = refused + [self._output(self._tracked[r.request_id], end) for r in touched]
        if scheduled.predicted_s is not None:  # the whole step, as a token's wait sees it
            self.scheduler.observe_step_time(scheduled.predicted_s, self.clock.now() - begin)
        return outputs

    def _record_step(self, scheduled: SchedulerOutput, start: float, end: float) -> None:
        seqs = []
        for s in scheduled.seqs:
            tracked = self._tracked.get(s.request_id)
            if tracked is not None and tracked.stats.first_scheduled_time is None:
                tracked.stats.first_scheduled_time = start
            seqs.append(SeqStepStats(s.request_id, len(s.token_ids),
                                     s.start_pos + len(s.token_ids), s.is_decode))
        stats = StepStats(
            step_index=self._step_index, start_time=start, duration_s=end - start,
            num_seqs=len(scheduled.seqs), num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_preempted=len(scheduled.preempted_ids), kv_usage=self.block_manager.usage,
            num_waiting=self.scheduler.num_waiting, seqs=seqs)
        self._step_index += 1
        for sink in self.stat_sinks:
            sink.on_step(stats)

    def _output(self, tracked: _Tracked, now: float) -> RequestOutput:
        request, stats, detok = tracked.request, tracked.stats, tracked.detokenizer
        new_ids = request.output_token_ids[tracked.num_sent_tokens:]
        tracked.num_sent_tokens = request.num_output_tokens
        if new_ids:
            if stats.first_token_time is None:
                stats.first_token_time = now
            stats.token_times += [now] * len(new_ids)
        if detok is not None:
            for token in new_ids:
                if detok.add_token(token):  # a stop string matched: it ends the request
                    request.stop_reason = detok.stop_reason
                    if request.is_finished:
                        request.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish_request(request.request_id,
                                                      RequestStatus.FINISHED_STOPPED)
                    break
        finished = request.is_finished
        delta = detok.take_delta(finished) if detok is not None else ""
        completion = CompletionOutput(
            index=0, text=detok.text if detok else "", token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason)
        if finished:
            self._finish(tracked, now)
        return RequestOutput(request.request_id, tracked.prompt, request.prompt_token_ids,
                             [completion], finished, delta, new_ids, stats)

    def _finish(self, tracked: _Tracked, now: float) -> None:
        request, stats = tracked.request, tracked.stats
        stats.finished_time = now
        stats.num_cached_tokens = max(request.num_cached_tokens, 0)
        stats.num_output_tokens = request.num_output_tokens
        stats.num_preemptions = request.num_preemptions
        stats.num_recomputed_tokens = request.num_recomputed_tokens
        stats.finish_reason = request.status.finish_reason
        self._tracked.pop(request.request_id, None)
        self.runner.remove_request(request.request_id)
        for sink in self.stat_sinks:
            sink.on_request_finished(stats)
