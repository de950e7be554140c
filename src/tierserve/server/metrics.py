"""Prometheus metrics: base units, `tierserve_` prefix, `tier` and `model` labels (and
`engine` on step figures: `fast` or `main` in the dedicated deployment).

Step-level figures come from the engine's StepStats (`on_step`); request-level figures
(`observe_request`) are labelled with the tier a request was served and billed in. The series vLLM also has are exported under vLLM's names as well
(server/metrics_vllm.py). Each app has its own registry.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from tierserve.core.stats import RequestStats, StepStats
from tierserve.server.metrics_vllm import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0, 120.0)
_WAIT_BUCKETS = _LATENCY_BUCKETS + (300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
                                    43200.0, 86400.0)
"""Queue and end-to-end times: a batch line may wait hours for idle capacity."""
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self, model: str, slo: dict | None = None):
        """`slo`: tier -> config.SLO, for SLO attainment counters."""
        self.model = model
        self._slo = dict(slo or {})
        self.registry = r = CollectorRegistry()
        tm = ["tier", "model"]

        def hist(name, doc, buckets=_LATENCY_BUCKETS, labels=tm):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("tierserve_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("tierserve_inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("tierserve_e2e_request_latency_seconds", "Arrival to finish.",
                        _WAIT_BUCKETS)
        self.queue = hist("tierserve_request_queue_time_seconds", "Arrival to first scheduling.",
                          _WAIT_BUCKETS)
        self.prefill = hist("tierserve_request_prefill_time_seconds",
                            "First scheduling to first token.")
        self.decode = hist("tierserve_request_decode_time_seconds", "First token to finish.")
        self.prompt_tokens = Counter("tierserve_prompt_tokens", "Prompt tokens.", tm, registry=r)
        self.generation_tokens = Counter("tierserve_generation_tokens", "Output tokens.", tm,
                                         registry=r)
        self.cached_tokens = Counter("tierserve_prompt_cached_tokens",
                                     "Prompt tokens served from the prefix cache.", tm,
                                     registry=r)
        self.finished = Counter("tierserve_request_finished", "Finished requests by reason.",
                                tm + ["finish_reason"], registry=r)
        self.wasted = Counter("tierserve_wasted_tokens",
                              "Tokens recomputed after preemption.", tm, registry=r)
        self.running = Gauge("tierserve_requests_running", "Requests producing tokens.", tm,
                             registry=r)
        self.waiting = Gauge("tierserve_requests_waiting", "Requests accepted, no token yet.",
                             tm, registry=r)
        self.kv_usage = Gauge("tierserve_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                              ["model", "engine"], registry=r)
        self.kv_blocks_in_use = Gauge(
            "tierserve_kv_blocks_in_use", "KV blocks held by requests, read at each scrape "
            "(in-process engines; cached-but-free blocks count as free).", ["model"], registry=r)
        self.spec_drafts = Counter("tierserve_spec_draft_tokens", "Draft tokens verified "
                                   "(speculative decoding), by tier.", tm, registry=r)
        self.spec_accepted = Counter("tierserve_spec_accepted_tokens",
                                     "Draft tokens verified and kept, by tier.", tm, registry=r)
        self.preemptions = Counter("tierserve_preemptions",
                                   "Preemptions of requests, by the preempted one's tier.", tm,
                                   registry=r)
        self.slo_met = Counter("tierserve_slo_met_requests",
                               "Finished requests that met their tier's TTFT and TPOT SLOs "
                               "(tiers with an SLO configured).", tm, registry=r)
        self.slo_checked = Counter("tierserve_slo_checked_requests",
                                   "Finished requests of tiers with an SLO configured.", tm,
                                   registry=r)
        step = ["model", "engine"]
        self.step_tokens = hist("tierserve_step_tokens", "Tokens per engine step.",
                                buckets=_TOKEN_BUCKETS, labels=step)
        self.step_seqs = hist("tierserve_step_sequences", "Sequences per engine step (batch size).",
                              buckets=_TOKEN_BUCKETS, labels=step)
        self.step_time = hist("tierserve_step_duration_seconds", "Engine step time.",
                              labels=step)

        self.machine_cost = Counter("tierserve_machine_cost_usd",
                                    "Machine cost attributed to requests (USD).",
                                    tm + ["phase"], registry=r)
        self.charge = Counter("tierserve_charge_usd", "What tenants were charged (USD).", tm,
                              registry=r)
        self.fallbacks = Counter("tierserve_fallbacks",
                                 "Requests sent to a fallback model (YAML fallbacks:), by the "
                                 "model asked for, the one that served and why (down, "
                                 "queue_full).", ["model", "to", "reason"], registry=r)
        self.vllm = VllmMetrics(r, model)
        self.slo = self._slo

    @property
    def slo(self) -> dict:
        return self._slo

    @slo.setter
    def slo(self, slo: dict) -> None:
        """Tiers with an SLO get their attainment series at once (0 of 0), so dashboards
        show the tier before its first request finishes."""
        self._slo = dict(slo)
        for tier in self._slo:
            self.slo_met.labels(tier, self.model)
            self.slo_checked.labels(tier, self.model)

    # StatSink ------------------------------------------------------------
    def on_step(self, s: StepStats) -> None:
        labels = (s.model or self.model, s.engine)
        self.kv_usage.labels(*labels).set(s.kv_usage)
        self.step_tokens.labels(*labels).observe(s.num_tokens)
        self.step_seqs.labels(*labels).observe(s.num_seqs)
        self.step_time.labels(*labels).observe(s.duration_s)
        self.vllm.on_step(s)

    def watch_kv_blocks(self, read) -> None:
        """Read `tierserve_kv_blocks_in_use` with `read()` at each scrape: the step gauge
        keeps the last step's value while the engine is idle, so only a live read shows
        blocks that outlive their requests (a leak)."""
        self.kv_blocks_in_use.labels(self.model).set_function(read)

    # server side ---------------------------------------------------------
    def observe_request(self, s: RequestStats) -> None:
        """A finished request's latency, tokens, SLO and cost, under the tier that served
        it (the tier it is billed in)."""
        tier = s.billed_tier
        labels = (tier.label, s.model or self.model)
        for hist, value in ((self.ttft, s.ttft_s), (self.e2e, s.e2e_s),
                            (self.queue, s.queue_s), (self.prefill, s.prefill_s),
                            (self.decode, s.decode_s)):
            if value is not None:
                hist.labels(*labels).observe(value)
        itl = self.itl.labels(*labels)
        for gap in s.inter_token_s:
            itl.observe(gap)
        self.prompt_tokens.labels(*labels).inc(s.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(s.num_output_tokens)
        self.cached_tokens.labels(*labels).inc(s.num_cached_tokens)
        self.wasted.labels(*labels).inc(s.num_recomputed_tokens)
        self.preemptions.labels(*labels).inc(s.num_preemptions)
        self.spec_drafts.labels(*labels).inc(s.num_draft_tokens)
        self.spec_accepted.labels(*labels).inc(s.num_accepted_tokens)
        slo = self.slo.get(tier.label)
        if slo is not None:
            self.slo_checked.labels(*labels).inc()
            if s.meets(slo.ttft_s, slo.tpot_s):
                self.slo_met.labels(*labels).inc()
        self.finished.labels(*labels, s.finish_reason or "error").inc()
        self.vllm.observe_request(s)
        if s.cost is not None:
            self.machine_cost.labels(*labels, "prefill").inc(s.cost.prefill_cost)
            self.machine_cost.labels(*labels, "decode").inc(s.cost.decode_cost)
        if s.charge:
            self.charge.labels(*labels).inc(s.charge)

    def watch_idle(self, recorder) -> None:
        """`tierserve_idle_cost_usd_total{model,kind}` read off `recorder` at each scrape,
        after it books idle time up to now: idle cost shows while it accrues, not once
        the next step starts (kind reserved: capacity held for the priority tier)."""
        self.registry.register(_IdleCollector(recorder, self.model))

    def set_queue_gauges(self, queued: dict, running: dict, units: list[dict] = (),
                         model: str | None = None) -> None:
        """By tier (the server's admission), and by engine or replica (`units`), of one
        served model (None: the server's only one)."""
        model = model or self.model
        for tier in set(queued) | set(running):
            self.waiting.labels(tier.label, model).set(queued.get(tier, 0))
            self.running.labels(tier.label, model).set(running.get(tier, 0))
        self.vllm.set_units(list(units), model)

    def render(self) -> bytes:
        return generate_latest(self.registry)



class _IdleCollector:
    def __init__(self, recorder, model: str):
        self.recorder, self.model = recorder, model

    def collect(self):
        family = CounterMetricFamily(
            "tierserve_idle_cost_usd", "Machine cost of time with no step running (USD); "
            "kind reserved: capacity held for the priority tier.", labels=["model", "kind"])
        self.recorder.accrue()
        totals = self.recorder.idle_totals() or {self.model: (0.0, 0.0)}
        for model, (idle, held) in totals.items():
            family.add_metric([model, "unreserved"], idle)
            family.add_metric([model, "reserved"], held)
        yield family
