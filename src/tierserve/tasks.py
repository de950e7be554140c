"""A coroutine run in the background for the length of a `with` block: the server's
lifespan holds three of them (the batch runner, the dashboard's sampler, the capacity
schedule's follower)."""

import asyncio
import contextlib
from collections.abc import Coroutine


@contextlib.asynccontextmanager
async def background(coro: Coroutine):
    """Start `coro` as a task; on leaving the block, cancel it and wait until it has
    stopped (its own `finally` clauses run before the caller's)."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
