"""The series vLLM also exports, under vLLM's names and labels, so that dashboards and
alerts written for vLLM (its Grafana dashboard filters on `model_name`) work unchanged.

Only what tierserve measures the same way is exported: the request timeline, token
counts, scheduler state, KV use, preemptions and prefix-cache hits. Labels are vLLM's:
`model_name` and `engine` ("0", or `fast`/`main` in the dedicated deployment). Per-tier
figures stay in the `tierserve_` families (server/metrics.py).

Two series exist only for dashboards that still chart them: `vllm:num_requests_swapped`
and `vllm:cpu_cache_usage_perc` are always 0, because tierserve recomputes a preempted
request instead of swapping its KV blocks out, so nothing is ever swapped.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierserve.core.stats import RequestStats, StepStats

# vLLM's own bucket edges would do; these reach hours because a batch line may wait a
# day in the queue (issue 18: queue-time buckets that reach hours).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 3600.0,
                   7200.0, 14400.0, 43200.0, 86400.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                 50000, 100000)
FINISHED_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
"""tierserve's finish reasons as vLLM spells them; anything else (an error) is `error`."""


class VllmMetrics:
    def cache_config_info(self, block_size: int, num_blocks: int) -> None:
        self.cache_config.labels(self.model, "0", str(block_size), str(num_blocks)).set(1)

    def __init__(self, registry: CollectorRegistry, model: str):
        self.model = model
        r, labels = registry, ["model_name", "engine"]

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests producing tokens.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("vllm:num_requests_swapped", "Always 0: tierserve never swaps.")
        self.kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.")
        self.gpu_kv = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0 to 1 (the old "
                            "name; on a CPU engine the cache is in host memory).")
        self.cpu_kv = gauge("vllm:cpu_cache_usage_perc", "Always 0: no swap space.")
        self.cache_config = Gauge("vllm:cache_config_info", "The KV cache's shape (value 1; "
                                  "the labels say it), as an Inference Extension gateway "
                                  "reads it.", ["model_name", "engine", "block_size",
                                                "num_gpu_blocks"], registry=r)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.")
        self.spec_drafts = counter("vllm:spec_decode_num_draft_tokens",
                                   "Draft tokens verified (speculative decoding).")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Draft tokens verified and kept.")
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("vllm:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.")
        self.success = counter("vllm:request_success", "Finished requests by reason.",
                               ["finished_reason"])
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.")
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds",
                                "Time between output tokens (the old name).")
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "A request's mean time per output token after the first.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduling.")
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "First scheduling to first token.")
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.")
        self.inference = hist("vllm:request_inference_time_seconds",
                              "First scheduling to finish.")
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.",
                               TOKEN_BUCKETS)
        self.req_generation = hist("vllm:request_generation_tokens",
                                   "Output tokens per request.", TOKEN_BUCKETS)
        self.req_max_generation = hist("vllm:request_max_num_generation_tokens",
                                       "Output tokens of a request's longest sequence "
                                       "(one sequence per request here).", TOKEN_BUCKETS)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step.",
                                     TOKEN_BUCKETS)

    def on_step(self, s: StepStats) -> None:
        self.iteration_tokens.labels(s.model or self.model, s.engine).observe(s.num_tokens)

    def observe_request(self, s: RequestStats) -> None:
        labels = (s.model or self.model, s.engine)
        for hist, value in ((self.ttft, s.ttft_s), (self.e2e, s.e2e_s), (self.queue, s.queue_s),
                            (self.prefill, s.prefill_s), (self.decode, s.decode_s),
                            (self.tpot, s.tpot_s)):
            if value is not None:
                hist.labels(*labels).observe(value)
        if s.finished_time is not None and s.first_scheduled_time is not None:
            self.inference.labels(*labels).observe(s.finished_time - s.first_scheduled_time)
        itl, legacy = self.itl.labels(*labels), self.tpot_legacy.labels(*labels)
        for gap in s.inter_token_s:
            itl.observe(gap)
            legacy.observe(gap)
        self.prompt_tokens.labels(*labels).inc(s.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(s.num_output_tokens)
        self.preemptions.labels(*labels).inc(s.num_preemptions)
        self.spec_drafts.labels(*labels).inc(s.num_draft_tokens)
        self.spec_accepted.labels(*labels).inc(s.num_accepted_tokens)
        self.cache_queries.labels(*labels).inc(s.num_prompt_tokens)
        self.cache_hits.labels(*labels).inc(s.num_cached_tokens)
        self.req_prompt.labels(*labels).observe(s.num_prompt_tokens)
        self.req_generation.labels(*labels).observe(s.num_output_tokens)
        self.req_max_generation.labels(*labels).observe(s.num_output_tokens)
        reason = FINISHED_REASONS.get(s.finish_reason or "", "error")
        self.success.labels(*labels, reason).inc()

    def set_units(self, units: list[dict], model: str | None = None) -> None:
        """Each engine's or replica's load (`Backend.units()`), read at each scrape."""
        for unit in units:
            labels = (model or self.model, unit["name"])
            self.running.labels(*labels).set(unit["running"])
            self.waiting.labels(*labels).set(unit["waiting"])
            self.swapped.labels(*labels).set(0)
            self.cpu_kv.labels(*labels).set(0)
            if unit["kv_usage"] is not None:
                self.kv.labels(*labels).set(unit["kv_usage"])
                self.gpu_kv.labels(*labels).set(unit["kv_usage"])
