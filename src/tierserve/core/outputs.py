"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput."""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tierserve.core.stats import RequestStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    """Output text so far (without a matched stop string)."""
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; then "stop", "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if any."""
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    """Per output token (with SamplingParams.logprobs): its logprob, the top alternatives."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    """Text that became final in this step (what a stream sends)."""
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestStats | None = None


async def read_outputs(queue: asyncio.Queue, abort: Callable[[], None]
                       ) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue until the finished one; an exception put in
    the queue is raised (and ends the request). Closed early (the client left): `abort`."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
