"""The in-process engine as a backend: one AsyncEngine (shared deployment) or the
dedicated pair (router/dedicated.py)."""

from collections import Counter

from tierserve.core.request import Owner, RequestStatus, Tier
from tierserve.engine.async_engine import AsyncEngine
from tierserve.errors import InvalidRequestError
from tierserve.router.backend import Chat, Load, Prompt
from tierserve.router.dedicated import DedicatedEngines
from tierserve.sampling_params import SamplingParams


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
        self.slo = dict(main.config.tiers.slo)
        self._sink = None

    @property
    def errored(self) -> BaseException | None:
        return self.deployment.errored

    def served_tier(self, tier: Tier) -> Tier:
        return self.deployment.served_tier(tier)

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

    def load(self) -> Load:
        running, waiting = Counter(), Counter()
        usage = 0.0
        for part in self.deployment.engines:
            sched = part.engine.scheduler
            for request in list(sched.requests.values()):  # one C call: safe mid-step
                busy = request.status == RequestStatus.RUNNING and request.num_output_tokens
                (running if busy else waiting)[request.tier.label] += 1
            usage = max(usage, part.engine.block_manager.usage)
        return Load(dict(running), dict(waiting), usage)

    def meter(self, recorder, price_per_hour: float, sink) -> None:
        self._sink = sink
        for part in self.deployment.engines:
            sched = part.engine.config.scheduler
            reserved = 1.0 if part is not self.deployment.engines[-1] else \
                sched.reserved_priority_seqs / sched.max_num_seqs  # a dedicated fast lane: all
            recorder.attach(part.engine, price_per_hour * self.machine_share, reserved)
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
