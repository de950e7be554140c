"""The in-process engine as a backend: one AsyncEngine (shared deployment) or the
dedicated pair (router/dedicated.py).

A capacity-schedule entry (`reconfigure`) sets each engine's max_num_seqs, token budget,
priority reserve and priority step-time cap, never above what the engine was started
with (its buffers and KV pool were sized for those). The scheduler reads its config at
every step; a new config object is swapped in whole, so a step sees the old entry or the
new one, never a mix.
"""

import dataclasses

from tierserve.core.request import Owner, RequestStatus
from tierserve.engine.async_engine import AsyncEngine
from tierserve.errors import InvalidRequestError
from tierserve.router.backend import Chat, Prompt
from tierserve.router.dedicated import DedicatedEngines
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier


class LocalBackend:
    def __init__(self, deployment: AsyncEngine | DedicatedEngines, name: str | None = None):
        """`name`: the served model's, on every step and request (a server serving
        several models tells them apart by it)."""
        self.deployment = deployment
        self.name = name
        self.machine_share = 1.0
        """The share of the machine its engines own (the cores are split between the
        models of a hybrid server): what share of the machine's price its steps cost."""
        main = deployment.engine  # the batching engine stands for the deployment
        self.engine = main
        self.tokenizer = main.tokenizer
        self.max_model_len = main.max_model_len
        self.max_num_seqs = main.config.scheduler.max_num_seqs
        self.generation_defaults = main.generation_defaults
        """The model's sampling defaults for what a request leaves out."""
        self.slo = dict(main.config.tiers.slo)
        self.tier_map = deployment.tier_map
        self._sink = None
        self._started: dict[int, tuple] = {}
        """id(scheduler) -> (its config, its step-time cap) before the first reconfigure."""

    @property
    def errored(self) -> BaseException | None:
        return self.deployment.errored

    def prepare(self, prompt: Prompt) -> Prompt:
        if not isinstance(prompt, Chat):
            return prompt
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", param="messages")
        return self.tokenizer.apply_chat_template(prompt.messages)

    async def submit(self, prompt: Prompt, params: SamplingParams, tier: Tier,
                     priority: int = 0, request_id: str | None = None,
                     owner: Owner | None = None) -> str:
        return await self.deployment.add_request(prompt, params, request_id, tier=tier,
                                                 priority=priority, owner=owner)

    def stream(self, request_id: str):
        return self.deployment.stream(request_id)

    def abort(self, request_id: str) -> None:
        self.deployment.abort(request_id)

    def meter(self, recorder, price_per_hour: float, sink) -> None:
        self._sink = sink
        for part in self.deployment.engines:
            sched = part.engine.config.scheduler
            reserved = 1.0 if part is not self.deployment.engines[-1] else \
                sched.reserved_priority_seqs / sched.max_num_seqs  # a dedicated fast lane: all
            recorder.attach(part.engine, price_per_hour * self.machine_share, reserved,
                            self.name)
            part.engine.add_sink(_Labelled(sink, self.engine_label(part), self.name))

    def engine_label(self, part: AsyncEngine) -> str:
        """vLLM's `engine` label: "0" for the one engine; `fast` and `main` for the
        dedicated pair."""
        if not isinstance(self.deployment, DedicatedEngines):
            return "0"
        return "fast" if part is self.deployment.fast else "main"

    def units(self) -> list[dict]:
        """Each engine's load, for the dashboard."""
        out = []
        for part in self.deployment.engines:
            engine = part.engine
            sched = engine.scheduler
            running = sum(1 for r in list(sched.requests.values())
                          if r.status == RequestStatus.RUNNING)
            out.append({"name": self.engine_label(part), "kind": "engine",
                        "healthy": part.errored is None, "running": running,
                        "waiting": len(sched.requests) - running,
                        "max_num_seqs": engine.config.scheduler.max_num_seqs,
                        "kv_usage": engine.block_manager.usage})
        return out

    def kv_blocks_in_use(self) -> int:
        return sum(p.engine.block_manager.num_blocks - p.engine.block_manager.num_free_blocks
                   for p in self.deployment.engines)

    def kv_cache_config(self) -> tuple[int, int]:
        managers = [p.engine.block_manager for p in self.deployment.engines]
        return managers[0].block_size, sum(m.num_blocks for m in managers)

    def reconfigure(self, entry) -> dict:
        applied = {}
        for part in self.deployment.engines:
            sched = part.engine.scheduler
            config, cap = self._started.setdefault(id(sched), (sched.config,
                                                               sched.step_time_limit_s))
            seqs = min(entry.max_num_seqs, config.max_num_seqs)
            new = dataclasses.replace(
                config, max_num_seqs=seqs,
                max_num_batched_tokens=min(entry.max_num_batched_tokens,
                                           config.max_num_batched_tokens),
                reserved_priority_seqs=min(entry.reserved_priority_seqs, seqs - 1)
                if config.policy == "tiered" else config.reserved_priority_seqs)
            new.validate()
            sched.config = new  # one reference swap: a step reads the old or the new whole
            sched.step_time_limit_s = cap if entry.priority_step_time_s is None \
                else entry.priority_step_time_s or None
            applied = {"max_num_seqs": new.max_num_seqs,
                       "max_num_batched_tokens": new.max_num_batched_tokens,
                       "reserved_priority_seqs": new.reserved_priority_seqs,
                       "priority_step_time_s": sched.step_time_limit_s}
        return applied

    def restore(self) -> None:
        for part in self.deployment.engines:  # an engine may outlive a server (tests)
            sched = part.engine.scheduler
            if id(sched) in self._started:
                sched.config, sched.step_time_limit_s = self._started.pop(id(sched))

    async def stop(self) -> None:
        await self.deployment.stop()
        for part in self.deployment.engines:  # the engine may outlive a server (tests)
            part.engine.remove_sink(_Labelled(self._sink, self.engine_label(part), self.name))


class _Labelled:
    """A sink that tags each step and request with the engine it came from. Equal when
    the sink and label are, so `remove_sink` finds the one `add_sink` was given."""

    def __init__(self, sink, label: str, model: str | None):
        self.sink, self.label, self.model = sink, label, model

    def __eq__(self, other) -> bool:
        return isinstance(other, _Labelled) and (other.sink, other.label, other.model) == \
            (self.sink, self.label, self.model)

    def __hash__(self) -> int:
        return hash((id(self.sink), self.label, self.model))

    def on_step(self, stats) -> None:
        stats.engine, stats.model = self.label, self.model
        self.sink.on_step(stats)

    def on_request_finished(self, stats) -> None:
        stats.engine, stats.model = self.label, self.model
        self.sink.on_request_finished(stats)
