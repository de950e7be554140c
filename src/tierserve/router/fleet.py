"""Fleet mode: remote replicas as one backend, with the gateway's tiers, routing, health
checks, retries and metering.

About 640 lines, kept whole: the Backend methods, the dispatcher and the health loop share
one request table; a request's dispatch, retry, metering and single finish share its
`_Request` record, and "finishes exactly once" is readable only in one place.

NOTE: one request's life
    `submit` queues it at the gateway (router/flow.py decides when and where it goes); the
    dispatcher sends it (through `transport`: this process itself, or Envoy for the
    endpoint picker, epp/handoff.py) and streams the replica's chunks back as
    RequestOutputs. What
    happened is told to the one request accounting the engine uses too
    (core/accounting.py: timeline, metering, sinks; the replica's meter is
    metering/estimate.py's, plugged in as its metering) and to the gateway's latency
    signal; this file keeps no bookkeeping of its own. A replica
    that fails before the request's first token: the request goes back to the head of its
    queue, once, excluding that replica. After a token: the stream ends with an error
    (nothing can be replayed without sending text twice), except for a batch line, whose
    client sees only the final result: it goes back to the queue, up to three attempts.
    Whatever happens, the request finishes exactly once: its cost (every attempt's) is
    billed once and its slot freed.

NOTE: health
    Each replica's /health is polled every `health_interval_s`, and vLLM's /metrics (KV
    use, waiting queue) scraped with it. A refused or failed poll, or a broken request,
    takes the replica out of the rotation; a poll answered too late does only the
    SLOW_CHECKS-th time in a row (a replica busy with a full batch answers late and still
    serves). The next good poll brings it back.
"""

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierserve.core.accounting import Accounting
from tierserve.core.clock import Clock
from tierserve.core.outputs import CompletionOutput, RequestOutput, read_outputs
from tierserve.core.request import NO_OWNER, Owner
from tierserve.core.stats import RequestCost, RequestStats
from tierserve.core.step_time import StepTimeModel
from tierserve.tiers import Tier
from tierserve.errors import (ConfigError, InvalidRequestError, ReplicaUnavailableError,
                              TierserveError, UpstreamError)
from tierserve.metering.estimate import FleetMetering, ReplicaMeter
from tierserve.router import remote
from tierserve.router.backend import Chat, Prompt
from tierserve.router.flow import FlowConfig, Gateway, Pending, ReplicaState, prefix_keys
from tierserve.sampling_params import SamplingParams

log = logging.getLogger("tierserve.fleet")

KV_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
              "tierserve_kv_cache_usage_ratio")
WAITING_METRICS = ("vllm:num_requests_waiting",)
MAX_BATCH_ATTEMPTS = 3
"""A batch line whose replica fails is run again, up to this many times in all."""
SLOW_CHECKS = 3
"""Health checks answered too late, in a row, that take a replica out of the rotation."""
CHARS_PER_TOKEN = 4
"""Prompt length estimate for text when the gateway has no tokenizer."""


@dataclass(eq=False)
class _Request:
    """What the gateway needs to send a request and relay its answer (its timeline and
    cost are the accounting's, in `stats`)."""

    pending: Pending
    prompt: Prompt
    params: SamplingParams
    priority: int
    stats: RequestStats
    owner: Owner = NO_OWNER
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""
    attempts: int = 0
    task: asyncio.Task | None = None
    done: bool = False


DEFAULT_PARAMS = SamplingParams()
PASSED_THROUGH = ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
                  "stop_token_ids", "skip_special_tokens")
"""Sampling fields sent to a replica when set (the first two are OpenAI's own)."""


class FleetBackend:
    def __init__(self, specs: list[remote.ReplicaSpec], model_name: str,
                 work_model: StepTimeModel, flow: FlowConfig | None = None, slo=None,
                 tokenizer=None, clock: Clock | None = None, health_interval_s: float = 2.0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 transport=None):
        """`work_model`: the step-time model of one replica (splits its cost);
        `tokenizer`: counts prompt tokens for routing and metering (else estimated);
        `transport(request_id, spec, path, body)`: the replica's answer as chunk dicts
        (default: this gateway sends the request itself; the endpoint picker's hands it
        to Envoy, epp/handoff.py)."""
        for s in specs:  # not asked (discover): vLLM's protocol, vLLM's default slots
            s.kind = s.kind or "vllm"
            s.max_num_seqs = s.max_num_seqs or remote.UNKNOWN_SLOTS
        for s in specs:  # a pool serves one model: never send it to another one
            if len(s.models) > 1 and model_name not in s.models:
                raise ConfigError(f"replica {s.name} serves {', '.join(s.models)}, not this "
                                  f"pool's model {model_name!r}; one pool serves one model "
                                  "(list the replica's name for it first)")
        self.specs = {s.name: s for s in specs}
        self.model_name = model_name
        self.work_model = work_model
        self.slo = dict(slo or {})
        self.tokenizer = tokenizer
        self.clock = clock or Clock()
        self.health_interval_s = health_interval_s
        self._slow = Counter({s.name: SLOW_CHECKS for s in specs})
        """Health checks in a row that each replica answered too late (until its first
        answer, as many as take it out: one that never answered gets no grace)."""
        self.gateway = Gateway([ReplicaState(s.name, s.max_num_seqs, protects=bool(s.plugin))
                                for s in specs], flow or FlowConfig())
        self._flow_started: FlowConfig | None = None
        """The gateway's flow config before the first `reconfigure`."""
        known = [s.max_model_len for s in specs if s.max_model_len]
        self.max_model_len = min(known) if known else None
        """The pool's context length: its shortest replica's (None: none said)."""
        self.max_num_seqs = sum(s.max_num_seqs for s in specs)
        self.generation_defaults: dict = {}
        """None here: what a request leaves out is not sent, so each replica applies its
        model's own defaults."""
        self.tier_map = {t: t for t in Tier}
        """The gateway serves each tier as asked (a replica's own tiers are its own)."""
        self.accounting = Accounting()
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._client: httpx.AsyncClient | None = None
        """Health checks and /metrics; requests go through `_session` (remote.session)."""
        self._session = None
        self._shared = None
        """Other gateways of this database (metering/shared.py): their load per replica."""
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.transport = transport or (
            lambda rid, spec, path, body: remote.stream(self._session, spec, path, body))

    # ------------------------------------------------------------ Backend
    @property
    def errored(self) -> BaseException | None:
        if any(r.healthy for r in self.gateway.replicas):
            return None
        return ReplicaUnavailableError("no replica is healthy")

    def prepare(self, prompt: Prompt) -> Prompt:
        return prompt

    async def submit(self, prompt: Prompt, params: SamplingParams, tier: Tier,
                     priority: int = 0, request_id: str | None = None,
                     owner: Owner | None = None) -> str:
        self._start()
        if not any(r.takes(tier) for r in self.gateway.replicas):
            raise ReplicaUnavailableError("no healthy replica can take this request now")
        if params.logprobs is not None:  # refused, not dropped: the relay carries text only
            raise InvalidRequestError("logprobs are not relayed in fleet mode yet",
                                      param="logprobs", code="unsupported_parameter")
        rid = request_id or f"fleet-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        now = self.clock.now()
        tokens = self._tokens(prompt)
        n = len(tokens) if tokens is not None else \
            max(1, len(self._text(prompt)) // CHARS_PER_TOKEN)
        max_tokens = params.max_tokens or 256
        owner = owner or NO_OWNER
        pending = Pending(rid, tier, n, max_tokens, now,
                          prefix_keys(tokens if tokens is not None else self._text(prompt)),
                          tenant=owner.tenant, weight=owner.weight)
        stats = self.accounting.start(rid, now, tier, tier, n)
        self._requests[rid] = _Request(pending, prompt, params, priority, stats, owner)
        self.gateway.submit(pending)
        self._wake.set()
        return rid

    def stream(self, request_id: str):
        return read_outputs(self._requests[request_id].queue, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.done:
            return
        if req.task is not None:
            req.task.cancel()  # its own finally finishes it
        elif self.gateway.remove(req.pending):
            self._finish(req, "abort")

    def units(self) -> list[dict]:
        """Each replica's load and health, for the dashboard."""
        return [{"name": r.name, "kind": "replica", "healthy": r.healthy,
                 "running": r.num_in_flight, "waiting": r.num_waiting or 0,
                 "max_num_seqs": r.max_num_seqs, "kv_usage": r.kv_usage}
                for r in self.gateway.replicas]

    def kv_blocks_in_use(self) -> None:
        return None  # the replicas hold the KV caches

    def kv_cache_config(self) -> None:
        return None

    def reconfigure(self, entry) -> dict:
        """The gateway's priority reserve per replica (the replicas size themselves)."""
        self._flow_started = self._flow_started or self.gateway.config
        self.gateway.config = dataclasses.replace(
            self._flow_started, reserved_priority_seqs=entry.reserved_priority_seqs)
        return {"reserved_priority_seqs": entry.reserved_priority_seqs}

    def restore(self) -> None:
        if self._flow_started is not None:
            self.gateway.config, self._flow_started = self._flow_started, None

    def meter(self, recorder, price_per_hour: float, sink) -> None:
        from tierserve.metering.prices import machine_price

        meters = {}
        for name, spec in self.specs.items():
            price = price_per_hour if spec.price_per_hour is None and spec.hardware is None \
                else machine_price(spec.hardware or "cpu-local", spec.price_per_hour)
            meters[name] = ReplicaMeter(price, self.work_model)
        self.accounting.metering = FleetMetering(recorder, meters)
        self.accounting.sinks = [sink]
        self._shared = getattr(recorder, "shared", None)
        if self._shared is not None:  # one lower-tier limit per replica for all gateways
            self.gateway.acquire = self._acquire_lower
            if self._tasks:  # started already (the probe)
                self._tasks.append(
                    asyncio.get_running_loop().create_task(self._exchange_loads()))

    @property
    def meters(self) -> dict[str, ReplicaMeter]:
        """Each replica's meter (empty until `meter()`)."""
        metering = self.accounting.metering
        return metering.meters if metering is not None else {}

    @property
    def cost_checks(self):
        """(estimated, reported) machine cost of recent requests (metering/estimate.py)."""
        metering = self.accounting.metering
        return metering.cost_checks if metering is not None else ()

    async def stop(self) -> None:
        for req in list(self._requests.values()):
            self.abort(req.pending.request_id)
        tasks = self._tasks + [r.task for r in self._requests.values() if r.task]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()
            await self._session.close()
            self._client = self._session = None

    # ------------------------------------------------------------ prompts
    def _tokens(self, prompt: Prompt) -> list[int] | None:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            return None
        if isinstance(prompt, Chat):
            return self.tokenizer.apply_chat_template(prompt.messages)
        return self.tokenizer.encode(prompt)

    @staticmethod
    def _text(prompt: Prompt) -> str:
        if isinstance(prompt, Chat):
            return "".join(f"{m['role']}:{m['content']}\n" for m in prompt.messages)
        return prompt

    # ---------------------------------------------------------- dispatching
    def _start(self) -> None:
        if self._client is None:
            connect_s, read_s = self._timeouts
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(read_s, connect=connect_s))
            self._session = remote.session(connect_s, read_s)
            self._tasks = [asyncio.create_task(self._dispatch()),
                           *(asyncio.create_task(self._watch(r))
                             for r in self.gateway.replicas)]
            if self._shared is not None:
                self._tasks.append(asyncio.create_task(self._exchange_loads()))

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = self.clock.now()
            released, refused = self.gateway.release(now)
            for pending, replica in released:
                req = self._requests[pending.request_id]
                req.task = asyncio.create_task(self._run(req, replica))
            for pending in refused:
                self._finish(self._requests[pending.request_id], "refused")
            for pending in self.gateway.stranded():
                self._finish(self._requests[pending.request_id], "error",
                             ReplicaUnavailableError(
                                 f"no healthy replica of {self.model_name} is left to serve "
                                 "this request; retry later"))
            timer = loop.call_later(0.05 if self.gateway.num_queued else 1.0, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    async def _run(self, req: _Request, replica: ReplicaState) -> None:
        spec, stats, acc = self.specs[replica.name], req.stats, self.accounting
        req.attempts += 1
        stats.model = self.model_name
        acc.scheduled(stats, self.clock.now(), replica.name)
        path, body = self._upstream(req, spec)
        reason, retry, error = None, False, None
        try:
            async for chunk in self.transport(req.pending.request_id, spec, path, body):
                reason = self._on_chunk(req, chunk) or reason
            if req.pending.replica is not None:  # where it ran (Envoy may have moved it)
                spec = self.specs[req.pending.replica.name]
            if spec.plugin:
                record = await self._exact_cost(req, spec)
                if record is not None and record.get("refused"):
                    reason = "refused"  # the plugin's flex limit (vLLM streams no chunk)
            if reason is None:  # vLLM stopped by SIGTERM can end a cut stream with [DONE]
                raise remote.ReplicaDown(f"{spec.name} ended the stream without a "
                                         "finish_reason")
        except asyncio.CancelledError:
            reason = "abort"
        except remote.ReplicaDown as exc:
            log.warning("replica %s failed: %s", replica.name, exc)
            replica.healthy = False
            # Nothing sent to a client yet (no token, or a batch line, whose client reads
            # only the final result): it goes back to the queue, within a few attempts.
            batch = req.pending.tier == Tier.BATCH
            retry = (stats.first_token_time is None or batch) and \
                req.attempts < (MAX_BATCH_ATTEMPTS if batch else 2)
            error = ReplicaUnavailableError(f"the replica serving this request failed: {exc}")
        except UpstreamError as exc:
            error = exc
        finally:
            now = self.clock.now()
            acc.left(stats, now)
            req.task = None
            if retry and not req.done:
                req.text = ""
                acc.restart(stats)
                self.gateway.retry(req.pending)
            else:
                self.gateway.finished(req.pending, now, stats.ttft_s, stats.tpot_s)
                if not req.done:
                    self._finish(req, "error" if error else reason, error)
            self._wake.set()

    def moved(self, request_id: str, name: str) -> None:
        """The request was sent to replica `name`, not the one it was given (Envoy retried
        it on the next endpoint the picker named): that one failed before answering."""
        req = self._requests.get(request_id)
        if req is None or req.pending.replica is None or req.pending.replica.name == name:
            return
        target = next(r for r in self.gateway.replicas if r.name == name)
        log.warning("replica %s failed before answering %s; it went to %s",
                    req.pending.replica.name, request_id, name)
        req.pending.replica.healthy = False
        now = self.clock.now()
        self.accounting.left(req.stats, now)
        self.gateway.finished(req.pending, now)
        self.gateway.sent(req.pending, target, now)
        if self._shared is not None and target.limits(req.pending.tier):
            # its row rises with it, as after a grant
            try:
                self._shared.raise_lower(self.specs[name].url, target.lower_in_flight)
            except Exception as exc:
                log.warning("shared replica load not raised (%s)", exc)
        self.accounting.scheduled(req.stats, now, name)

    async def _exact_cost(self, req: _Request, spec: remote.ReplicaSpec) -> dict | None:
        """A plugin replica's exact cost of the request, from /tierserve/v1/costs (left
        to the estimate when it does not answer); the replica's record of it."""
        rid = req.pending.request_id
        try:
            r = await self._client.get(f"{spec.url}/tierserve/v1/costs", params={"ids": rid},
                                       headers=spec.auth_headers, timeout=5.0)
            record = r.json()["data"].get(rid) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("replica %s: no exact cost for %s (%s); billed as estimated",
                        spec.name, rid, exc)
            return None
        if record is not None and "output_tokens" in record:  # the engine's own counts
            self.accounting.usage(req.stats, record["prompt_tokens"],
                                  record.get("cached_tokens", 0), record["output_tokens"])
        meter = self.meters.get(spec.name)
        if record is not None and meter is not None:  # its machine time, at our price
            pps = meter.price_per_second
            self.accounting.reported_cost(req.stats, RequestCost(
                record["prefill_machine_s"] * pps, record["decode_machine_s"] * pps))
        return record

    def _upstream(self, req: _Request, spec: remote.ReplicaSpec) -> tuple[str, dict]:
        p = req.params
        body = {k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p")
                if k not in p.defaulted}
        if p.top_k:
            body["top_k"] = p.top_k
        if p.min_tokens:
            body["min_tokens"] = p.min_tokens
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        if p.ignore_eos:
            body["ignore_eos"] = True
        for name in PASSED_THROUGH:  # under vLLM's names, only where not the default
            if getattr(p, name) != getattr(DEFAULT_PARAMS, name):
                body[name] = getattr(p, name)
        if p.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
        if p.grammar is not None:
            body["structured_outputs"] = p.grammar.to_vllm()
        if req.owner.cache_salt is not None:  # vLLM keys its prefix cache by it too; as a
            # digest: vLLM takes at most 128 characters and no @ / \ NUL, and a replica
            # need not learn tenant names
            body["cache_salt"] = hashlib.sha256(req.owner.cache_salt.encode()).hexdigest()
        if isinstance(req.prompt, Chat):
            path, body["messages"] = "/v1/chat/completions", req.prompt.messages
        else:
            path, body["prompt"] = "/v1/completions", req.prompt
        return path, remote.upstream_body(spec, path, body, self.model_name,
                                          req.pending.tier, req.priority, bool(spec.plugin),
                                          req.pending.request_id, req.owner.tenant)

    def _on_chunk(self, req: _Request, chunk: dict) -> str | None:
        now, stats = self.clock.now(), req.stats
        reason = None
        for choice in chunk.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            reason = choice.get("finish_reason") or reason
            if text:
                if stats.first_token_time is None:
                    self.gateway.first_token(req.pending, now)
                self.accounting.tokens(stats, 1, now)
                req.text += text
                req.queue.put_nowait(self._output(req, text, None))
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            self.accounting.usage(stats, usage.get("prompt_tokens", stats.num_prompt_tokens),
                                  details.get("cached_tokens") or 0,
                                  usage.get("completion_tokens", 0))
            cost = usage.get("cost_details")
            if isinstance(cost, dict) and "machine_usd" in cost:
                self.accounting.reported_cost(stats, RequestCost(
                    cost.get("prefill_usd", 0.0), cost.get("decode_usd", 0.0)))
        return reason

    def _output(self, req: _Request, delta: str, reason: str | None) -> RequestOutput:
        finished = reason is not None
        return RequestOutput(req.pending.request_id, None, [],
                             [CompletionOutput(0, req.text, [], reason)], finished,
                             delta, [], req.stats)

    def _finish(self, req: _Request, reason: str, error: TierserveError | None = None) -> None:
        """Account the request once (the accounting bills it and tells the sinks), then
        its last output or its error."""
        req.done = True
        self.accounting.finish(req.pending.request_id, self.clock.now(), reason)
        self._requests.pop(req.pending.request_id, None)
        req.queue.put_nowait(error if error is not None else self._output(req, "", reason))

    def _acquire_lower(self, replica: ReplicaState) -> bool:
        """A slot of the replica's lower-tier limit, shared with the other gateways (one
        round trip, on the event loop: the release that asks waits for it anyway)."""
        try:
            return self._shared.acquire_lower(self.specs[replica.name].url,
                                              replica.lower_in_flight, int(replica.limit))
        except Exception as exc:  # the database away: this gateway's own count decides
            log.warning("shared replica limit not checked (%s)", exc)
            return True

    async def _exchange_loads(self) -> None:
        """Publish this gateway's lower-tier load per replica and read the others'
        (metering/shared.py's note on one order between tiers), off the event loop."""
        from tierserve.metering.shared import LOAD_INTERVAL_S

        while True:
            # counted with the grants so far, on this loop (where grants happen): the
            # thread below must not publish a count a grant made meanwhile has outdated
            mine = {self.specs[r.name].url: r.lower_in_flight for r in self.gateway.replicas}
            granted = dict(self._shared.granted)
            try:
                others = await asyncio.to_thread(self._shared.exchange_loads, mine, granted)
            except Exception as exc:  # the database away: count our own only meanwhile
                log.warning("replica loads not exchanged (%s)", exc)
                others = {}
            changed = False
            for r in self.gateway.replicas:
                n = others.get(self.specs[r.name].url, 0)
                changed |= n < r.elsewhere
                r.elsewhere = n
            if changed:
                self._wake.set()  # room freed elsewhere: release what waits
            await asyncio.sleep(LOAD_INTERVAL_S)

    # --------------------------------------------------------------- health
    async def _watch(self, replica: ReplicaState) -> None:
        while True:
            await self._check(replica)
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, replica: ReplicaState) -> None:
        """One health check: /health, vLLM's /metrics, and (once, for a vLLM replica)
        whether tierserve's plugin runs there."""
        spec = self.specs[replica.name]
        headers = spec.auth_headers
        was = replica.healthy
        try:
            r = await self._client.get(spec.url + "/health", headers=headers,
                                       timeout=self.health_interval_s)
            replica.healthy = r.status_code == 200
            if replica.healthy and spec.kind == "vllm" and spec.plugin is None:
                await self._detect_plugin(replica, spec, headers)
            if replica.healthy and spec.kind != "openai":
                self._scrape(replica, (await self._client.get(
                    spec.url + "/metrics", headers=headers,
                    timeout=self.health_interval_s)).text)
            self._slow[replica.name] = 0
        except httpx.TimeoutException:
            # a replica busy with a full batch can answer late and still be serving: it
            # leaves the rotation after SLOW_CHECKS late answers in a row (Kubernetes'
            # failureThreshold), where a refused connection or a 503 takes it out at once
            self._slow[replica.name] += 1
            replica.healthy = was and self._slow[replica.name] < SLOW_CHECKS
        except httpx.HTTPError:
            replica.healthy = False
        if replica.healthy != was:
            log.warning("replica %s is %s", replica.name,
                        "back" if replica.healthy else "down")
            self._wake.set()
            c = self.gateway.config
            if replica.healthy and replica.idle_ttft is None and \
                    c.priority_ttft_s is None and c.priority_tpot_s is None:
                self._tasks.append(asyncio.create_task(self._time_idle(replica)))

    async def _detect_plugin(self, replica: ReplicaState, spec: remote.ReplicaSpec,
                             headers: dict) -> None:
        r = await self._client.get(spec.url + "/tierserve/v1/info", headers=headers,
                                   timeout=self.health_interval_s)
        try:
            info = r.json() if r.status_code == 200 else {}
        except ValueError:
            info = {}
        spec.plugin = isinstance(info, dict) and info.get("plugin") == "tierserve"
        replica.protects = spec.plugin
        if spec.plugin:
            log.warning("replica %s runs tierserve's vLLM plugin: it orders and preempts "
                        "by tier itself, so lower tiers are not held back for it, and it "
                        "reports each request's exact cost", replica.name)

    async def probe(self, say=None) -> None:
        """Check every replica once now (a gateway does before it says it is ready); with
        no priority SLO configured, time each healthy replica at idle, which sets the
        fast lane's default target (router/flow.py), and say so through `say`."""
        self._start()
        await asyncio.gather(*(self._check(r) for r in self.gateway.replicas))
        c = self.gateway.config
        if c.priority_ttft_s is not None or c.priority_tpot_s is not None:
            return
        up = [r for r in self.gateway.replicas if r.healthy]
        await asyncio.gather(*(self._time_idle(r) for r in up))
        timed = [r for r in up if r.idle_ttft is not None]
        if say is not None and timed:
            parts = ", ".join(
                f"{r.name} TTFT {1e3 * r.idle_ttft[0]:.1f} ms + "
                f"{1e6 * r.idle_ttft[1]:.0f} us/prompt token, TPOT "
                f"{1e3 * (r.idle_tpot_s or 0):.1f} ms" for r in timed)
            say(f"{self.model_name}: no priority SLO configured; the fast lane's target is "
                f"{c.idle_factor:g}x each replica's idle timing, measured now: {parts} "
                "(YAML slo: {priority: ...} or fleet: priority_ttft_s sets one)")

    async def _time_idle(self, replica: ReplicaState) -> None:
        """Idle TTFT at a short and a long prompt (a base and a cost per token, fitted
        through the two medians) and TPOT, on one replica, after one warm-up request."""
        spec = self.specs[replica.name]
        short, long_ = [], []
        try:
            for i, words in enumerate((24, 24, 24, 24, 480, 480, 480)):
                ttft, tpot, n = await self._time_one(spec, words, i)
                if i:
                    (short if words == 24 else long_).append((ttft, tpot, n))
        except (remote.ReplicaDown, UpstreamError, ValueError) as exc:
            log.warning("replica %s: not timed at idle (%s); no default target for it",
                        replica.name, exc)
            return
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        t0, n0 = med([t for t, _, _ in short]), med([n for _, _, n in short])
        t1, n1 = med([t for t, _, _ in long_]), med([n for _, _, n in long_])
        per_token = max(0.0, (t1 - t0) / max(n1 - n0, 1))
        replica.idle_ttft = (max(t0 - per_token * n0, 0.0), per_token)
        tpots = [p for _, p, _ in short if p is not None]
        replica.idle_tpot_s = med(tpots) if tpots else None

    async def _time_one(self, spec: remote.ReplicaSpec, words: int, i: int):
        """One priority request of about `words` tokens and 16 output tokens: (TTFT s,
        TPOT s or None, prompt tokens)."""
        prompt = f"{i} {hashlib.sha256(str((i, self.clock.now())).encode()).hexdigest()}" + \
            " hello" * words  # a new start each time: no prefix cache hit
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        if spec.kind != "openai":
            body["ignore_eos"] = True
        body = remote.upstream_body(spec, "/v1/completions", body, self.model_name,
                                    Tier.PRIORITY, 0, bool(spec.plugin),
                                    f"tierserve-probe-{i}")
        start = self.clock.now()
        times, prompt_tokens = [], words + 8
        async for chunk in remote.stream(self._session, spec, "/v1/completions", body):
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(self.clock.now())
            usage = chunk.get("usage") or {}
            prompt_tokens = usage.get("prompt_tokens") or prompt_tokens
        if not times:
            raise ValueError("no token came back")
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return times[0] - start, tpot, prompt_tokens

    @staticmethod
    def _scrape(replica: ReplicaState, text: str) -> None:
        """KV use and queue from the replica's /metrics (unknown where it has none: text
        that is not Prometheus's must not stop the health checks)."""
        kv, waiting = None, None
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in KV_METRICS:
                        kv = max(kv or 0.0, sample.value)
                    elif sample.name in WAITING_METRICS:
                        waiting = int((waiting or 0) + sample.value)
        except ValueError:
            kv = waiting = None
        replica.kv_usage, replica.num_waiting = kv, waiting
