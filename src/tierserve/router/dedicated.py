"""The `dedicated` deployment: priority requests on an engine of their own.

The classic "fast mode" silo: one engine instance serves priority requests alone with a
small `max_num_seqs` (`dedicated_max_num_seqs`), beside a batching instance for every
other tier. Each engine has its own step thread and KV pool, and the machine's cores are
split between them, so nothing the batching engine does can slow the fast lane, and
nothing the fast lane leaves idle can be used by the batching engine. It exists so that
the trade-off against the `shared` deployment can be measured on the same hardware
(`tierserve bench tiers`), not as the recommended setup.

`DedicatedEngines` has the AsyncEngine interface the server uses; request ids are made
here so the two engines' ids cannot collide.
"""

import itertools

from tierserve.core.request import Owner
from tierserve.engine.async_engine import AsyncEngine
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier


class DedicatedEngines:
    def __init__(self, fast: AsyncEngine, main: AsyncEngine):
        self.fast, self.main = fast, main
        fast.engine.core.dedicate(Tier.PRIORITY)  # fcfs inside, priority on the bill
        self.engine = main.engine
        """The batching engine: its config and stat sinks stand for the deployment."""
        self.tier_map = {t: self._target(t).tier_map[t] for t in Tier}
        """Tier asked for -> served: priority on the fast engine, the rest on the main."""
        self._owner: dict[str, AsyncEngine] = {}
        self._ids = itertools.count()

    @property
    def engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        return self.fast, self.main

    @property
    def errored(self) -> BaseException | None:
        return self.fast.errored or self.main.errored

    def _target(self, tier: Tier) -> AsyncEngine:
        return self.fast if tier == Tier.PRIORITY else self.main

    async def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                          tier: Tier = Tier.DEFAULT, priority: int = 0,
                          owner: Owner | None = None) -> str:
        target = self._target(Tier.parse(tier))
        request_id = request_id or f"{'fast' if target is self.fast else 'main'}-" \
                                   f"{next(self._ids)}"
        request_id = await target.add_request(prompt, params, request_id, tier, priority,
                                              owner)
        self._owner[request_id] = target
        return request_id

    async def stream(self, request_id: str):
        try:
            async for out in self._owner[request_id].stream(request_id):
                yield out
        finally:
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        engine = self._owner.get(request_id)
        if engine is not None:
            engine.abort(request_id)

    async def stop(self) -> None:
        await self.fast.stop()
        await self.main.stop()
