"""AsyncEngine: the step loop as an asyncio task, with a stream of deltas per request.

NOTE: threading. `LLMEngine.step()` runs on an executor's thread so the event loop stays
free for I/O (and sees disconnects) while a step runs. Give it the single thread that
built the engine: oneDNN's packed weights run about 1.5x
slower on a thread other than the one that packed them (measured, docs/benchmarks.md).
Nothing else touches the engine while a step is in flight. Requests added or
aborted during a step are queued and applied the moment it returns; when no step is in
flight they are applied at once. So `abort()` frees the request's KV blocks at once, or
right after the step that is running.
"""

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor

from tierserve.core.outputs import RequestOutput, read_outputs
from tierserve.core.request import Owner
from tierserve.engine.llm_engine import LLMEngine
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier


class AsyncEngine:
    def __init__(self, engine: LLMEngine, executor: Executor | None = None):
        """`executor`: where steps run; by default a thread of its own."""
        self.engine = engine
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.yields_between_steps = 4
        """Event-loop turns between steps: enough for a token to travel from the engine to
        the socket (queue -> merge -> SSE -> write) before the next step starts, so HTTP
        work does not compete with the step for the two cores."""
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_aborts: list[str] = []
        self._idle = asyncio.Event()
        """Set while no step is in flight: only then may the engine be touched."""
        self._idle.set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.errored: BaseException | None = None

    @property
    def engines(self) -> tuple["AsyncEngine", ...]:
        return (self,)

    @property
    def tier_map(self) -> dict[Tier, Tier]:
        return self.engine.tier_map

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, tier: Tier | str = Tier.DEFAULT,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (each with its delta) until it finishes.
        Leaving the iteration early (client gone) aborts the request."""
        request_id = await self.add_request(prompt, params, request_id, tier, priority)
        async for out in self.stream(request_id):
            yield out

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request until it finishes; closing early aborts it."""
        try:
            async for item in read_outputs(self._streams[request_id],
                                           lambda: self.abort(request_id)):
                yield item
        finally:
            self._streams.pop(request_id, None)

    async def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                          tier: Tier | str = Tier.DEFAULT, priority: int = 0,
                          owner: Owner | None = None) -> str:
        self.start()
        while not self._idle.is_set():  # the engine is not thread-safe: wait out the step
            await self._idle.wait()
        request_id = self.engine.add_request(request_id, prompt, params, tier=tier,
                                             priority=priority, owner=owner)
        self._streams[request_id] = asyncio.Queue()
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        if not self._idle.is_set():
            self._pending_aborts.append(request_id)
        else:
            self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.get(request_id)
        if out is not None and stream is not None:
            stream.put_nowait(out)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
            self._idle.clear()
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.step)
            except Exception as exc:  # a failed step fails every request in flight
                self.errored = exc
                self._fail_all(exc)
                outputs = []
            finally:
                self._idle.set()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            while self._pending_aborts:
                self._abort_now(self._pending_aborts.pop())
            for _ in range(self.yields_between_steps):  # let streams write before the next step
                await asyncio.sleep(0)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put_nowait(exc)
