"""Running chat and completion requests: admission, the engine requests behind one HTTP
request, whole or streamed answers; and the same path for one line of a batch job.

About 400 lines, kept whole: admission, the run of a request's choices and its answer
(whole or streamed) share the `ChoiceRun` record, and what an admitted request gives
back on every path (slots, holds, bucket tokens) reads in one place.
"""

import asyncio
import json

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from tierserve.errors import InvalidRequestError, OverloadedError, TierserveError
from tierserve.router.backend import Backend, Chat, Prompt
from tierserve.server import openai_format as fmt
from tierserve.server import tools
from tierserve.server.http_errors import error_body, validation_error
from tierserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.server.routing import Choice, choose, escalation
from tierserve.server.settings import Tenant
from tierserve.tiers import Tier

KINDS = {"/v1/chat/completions": ("chat", ChatCompletionRequest),
         "/v1/completions": ("completion", CompletionRequest)}
"""Endpoint -> (kind, request body model)."""


def prompts(state, body: ChatCompletionRequest | CompletionRequest,
            backend: Backend | None = None) -> list[Prompt]:
    """The prompts of one request, as `backend` (default: the main model's) takes them."""
    backend = backend or state.ready()
    if isinstance(body, ChatCompletionRequest):
        return [backend.prepare(Chat(tools.render(body)))]
    p = body.prompt
    found = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not found or any(len(x) == 0 for x in found):
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return [backend.prepare(x) for x in found]


async def execute(state, endpoint: str, raw: dict, tenant: Tenant, tags: dict,
                  rid: str) -> tuple[int, dict]:
    """One batch line, run whole in the batch tier under request id `rid`: (HTTP status,
    response body). Errors become the body the HTTP route would have answered, so a bad
    line fails alone."""
    kind, model = KINDS[endpoint]
    try:
        try:
            body = model.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        if body.stream:
            raise InvalidRequestError("stream is not supported in a batch", param="stream")
        state.check_model(body.model)
        choice = choose(state, body, tenant, batch=True)
        found = prompts(state, body, choice.served.backend)
        run, tier = await start(state, body, found, tenant, rid, choice, tags=tags,
                                queue_limit=False)
        result, _ = await collect(state, run, kind, tier, body, found)
        return 200, result
    except TierserveError as exc:
        return error_body(exc)


FLEET_CONTEXT_GUESS = 32768
"""Context length assumed for a worst case where the backend does not know the model's
(fleet mode) and the request gives no max_tokens."""


def worst_case_tokens(backend: Backend, prompt: Prompt, params) -> tuple[int, int]:
    """(prompt tokens, output tokens) at most: what a request may be charged for, before
    it runs. A text is counted as its UTF-8 bytes (a token is at least one byte) and a
    chat as its JSON's bytes, where the prompt is not already token ids."""
    if isinstance(prompt, list):
        n = len(prompt)
    elif isinstance(prompt, str):
        n = len(prompt.encode())
    else:
        n = len(json.dumps(prompt.messages).encode())
    room = (backend.max_model_len or FLEET_CONTEXT_GUESS) - n
    return n, params.max_tokens or max(room, 1)


async def start(state, body, prompts: list, tenant: Tenant, rid: str, choice: Choice,
                tags: dict | None = None,
                queue_limit: bool = True) -> tuple["ChoiceRun", Tier]:
    """Admit the request and add every choice to the backend of `choice` (the served model,
    the tier it runs in, the route). The first choice runs under the response's id `rid`,
    choice i under `rid-i`: the ledger row of a response is found by its id. Admission
    takes, in order: the tenant's rate limits, a reservation of its worst-case charge
    against its budget, a place in the tier's queue; a refusal at any of them gives back
    what was taken. Returns the run and the tier that serves it (the backend's tier map
    of the tier asked for); the run's `headers` carry the tenant's rate-limit state."""
    if body.n > state.settings.max_n:
        raise InvalidRequestError(f"n must be at most {state.settings.max_n}", param="n")
    state.ready()
    backend, admission = choice.served.backend, choice.served.admission
    asked = choice.tier
    served = backend.tier_map[asked]
    params = [body.sampling_params(i, backend.generation_defaults) for i in range(body.n)]
    hidden = choice.escalate is not None and choice.escalate.min_mean_logprob is not None \
        and params[0].logprobs is None
    for p in params if hidden else ():  # the cascade's check reads them; the client not
        p.logprobs = 0
    worst = [(p, worst_case_tokens(backend, p, sp)) for p in prompts for sp in params]
    ids = [f"{rid}-{i}" if i else rid for i in range(len(worst))]
    tokens = sum(a + b for _, (a, b) in worst) if queue_limit else 0
    # Batch lines (queue_limit off) skip the per-minute limits: a 429 would fail the line
    # for good, and the batch runner already bounds how many run at once.
    headers = await _shared(state, state.limiter.take, tenant.name, 1 if queue_limit else 0,
                            tokens)
    prices = state.recorder.prices
    try:
        await _shared(state, state.recorder.reserve, tenant.name, [
            (i, prices.charge(served, a, 0, b)) for i, (_, (a, b)) in zip(ids, worst)])
        try:
            admission.admit(served, len(worst), enforce=queue_limit)
        except Exception:
            for i in ids:
                state.recorder.forget(i)
            raise
    except Exception:
        state.limiter.give_back(tenant.name, 1 if queue_limit else 0, tokens)
        raise
    run = ChoiceRun(state, backend, served, expected=len(worst), admission=admission)
    run.headers = headers
    run.choice, run.hidden_logprobs = choice, hidden
    if choice.route is not None:
        run.headers["x-tierserve-route"] = choice.header
    route = {"route": choice.route} if choice.route is not None else {}
    if choice.fallback_from is not None:
        run.headers["x-tierserve-fallback-from"] = choice.fallback_from
        route["fallback_from"] = choice.fallback_from
    owner = tenant.owner(body.cache_salt)
    several = len(state.served) > 1
    try:
        for index, request_id in enumerate(ids):
            prompt, p = prompts[index // body.n], params[index % body.n]
            state.recorder.register(request_id, tenant.name, asked,
                                    {**body.tags(), **(tags or {}), **route},
                                    choice.served.name if several else None)
            await run.add(prompt, p, asked, body.priority, request_id, owner)
    except Exception:
        for i in ids[len(run.request_ids):]:
            state.recorder.forget(i)  # never reached the engine: nothing to settle
        run.close()
        raise
    return run, served


async def _shared(state, fn, *args):
    """`fn(*args)`; on a thread where it is a round trip to the database other gateways
    share (metering/shared.py), so the event loop serves other requests meanwhile."""
    if state.recorder.shared is None:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def collect(state, run: "ChoiceRun", kind: str, tier: Tier, body,
                  prompts: list) -> tuple[dict, list]:
    """Wait for every choice: (the whole response body, the final outputs)."""
    try:
        finals = {}
        async for index, out in run.outputs():
            if out.finished:
                finals[index] = out
    finally:
        run.close()
    await state.recorder.committed()  # answered only once billed (see ledger's note)
    outputs = [finals[i] for i in range(len(run.request_ids))]
    esc = run.choice.escalate
    if esc is not None and len(outputs) == 1:
        c = outputs[0].outputs[0]
        run.failed = esc.fails(c.text, c.finish_reason, c.logprobs)
    if run.hidden_logprobs:
        for o in outputs:
            o.outputs[0].logprobs = None
    calls = [tools.parse_calls(o.outputs[0].text, body) for o in outputs] \
        if kind == "chat" else None
    result = fmt.completion_body(kind, run.request_ids[0], run.choice.served.name, tier,
                                 outputs, len(prompts), echoes(body, prompts, run.backend),
                                 run.backend.tokenizer, calls)
    return result, outputs


def echoes(body, prompts: list, backend: Backend) -> list[str] | None:
    """With `echo`, each prompt's text (put ahead of its choices' text)."""
    if not getattr(body, "echo", False):
        return None
    texts = []
    for p in prompts:
        if isinstance(p, str):
            texts.append(p)
        elif backend.tokenizer is not None:
            texts.append(backend.tokenizer.decode(list(p), skip_special_tokens=False))
        else:
            raise InvalidRequestError("echo of a token-id prompt needs the model's tokenizer, "
                                      "which this gateway does not have", param="echo")
    return texts


async def serve(state, kind: str, body, found: list, tenant: Tenant, choice: Choice,
                notice: bool = False, usage_comment: bool = False):
    """Answer one HTTP request, whole or as a stream. `notice`: a stream routed to a
    batched tier opens with a `tierserve.route` event (the client asked for it);
    `usage_comment`: a stream without usage asked for ends with it in an SSE comment."""
    echo = echoes(body, found, choice.served.backend)
    rid = fmt.new_id("chatcmpl" if kind == "chat" else "cmpl")
    run, tier = await start(state, body, found, tenant, rid, choice)
    if body.stream:
        events = run.outputs()
        first = None
        if tier == Tier.FLEX:  # may be refused: answer 429, not a broken stream
            try:
                first = await events.__anext__()
            except BaseException:
                run.close()
                raise
        slow = choice.route is not None and tier != Tier.PRIORITY
        return StreamingResponse(_sse(run, events, first, kind, rid, choice.served.name, tier,
                                      body, len(found), echo, run.backend.tokenizer,
                                      opening=route_opening(choice, tier, notice) if slow
                                      else None, usage_comment=usage_comment),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "x-request-id": rid,
                                          "x-tierserve-served-tier": tier.label,
                                          **run.headers})
    result, outputs = await collect(state, run, kind, tier, body, found)
    if run.failed:  # a cascade: the first answer failed its check; both are billed
        second = escalation(state, choice, run.failed, tenant)
        rid = f"{rid}-escalated"
        again = prompts(state, body, second.served.backend)  # its own chat template
        run, tier = await start(state, body, again, tenant, rid, second,
                                tags={"cascade": "escalation"})
        result, outputs = await collect(state, run, kind, tier, body, again)
    return JSONResponse(result, headers={"x-request-id": rid, **run.headers,
                                         **fmt.cost_headers(outputs, tier)})


def route_opening(choice: Choice, tier: Tier, notice: bool) -> str:
    """What a stream routed to a batched tier opens with: an SSE comment, which OpenAI
    clients skip, and, when asked for, an event a UI can show as "thinking"."""
    out = f": routed to {choice.served.name} in the {tier} tier ({choice.route})\n\n"
    if notice:
        out += ("event: tierserve.route\ndata: " + json.dumps(
            {"route": choice.route, "model": choice.served.name, "tier": tier.label,
             "notice": "thinking"}) + "\n\n")
    return out


async def _sse(run: "ChoiceRun", events, first, kind: str, rid: str, model: str, tier: Tier,
               body, num_prompts: int, echo: list[str] | None = None, tokenizer=None,
               opening: str | None = None, usage_comment: bool = False):
    """SSE chunks of `events` (run.outputs(), whose first item may already be in `first`);
    with `echo`, a choice's first chunk starts with its prompt; `opening` comes first."""
    if opening:
        yield opening
    include_usage = body.include_usage
    started, finals = set(), {}
    held = {} if kind == "chat" and tools.active(body) else None
    """With tools: each choice's text, held back until it is known whether it is calls."""

    async def all_events():
        if first is not None:
            yield first
        async for item in events:
            yield item

    try:
        async for index, out in all_events():
            first = index not in started
            started.add(index)
            text = out.delta_text
            if first and echo:
                text = echo[index * num_prompts // len(run.request_ids)] + (text or "")
            lp = _new_logprobs(kind, out, tokenizer)
            reason = out.outputs[0].finish_reason
            if held is not None:
                held[index] = held.get(index, "") + (text or "")
                if out.finished:
                    calls = tools.parse_calls(held[index], body)
                    yield fmt.chunk(kind, rid, model, tier, index, None if calls else held[index],
                                    None, True, include_usage, tool_calls=calls)
                    reason = "tool_calls" if calls else reason
            elif text or first or lp:
                yield fmt.chunk(kind, rid, model, tier, index, text, None, first, include_usage,
                                lp)
            if out.finished:
                finals[index] = out
                yield fmt.chunk(kind, rid, model, tier, index, None, reason,
                                include_usage=include_usage)
        if include_usage or usage_comment:
            outputs = [finals[i] for i in range(len(run.request_ids))]
            usage = fmt.usage_chunk(kind, rid, model, tier, outputs, num_prompts)
            yield usage if include_usage else ": usage " + usage[len("data: "):]
        await run.state.recorder.committed()  # [DONE] only once billed
        yield "data: [DONE]\n\n"
    except Exception as exc:  # under way: the stream ends with an error event, not a cut
        status, body = error_body(exc)
        yield fmt.sse(body)
    finally:
        run.close()  # a client that left aborts whatever is still running


def _new_logprobs(kind: str, out, tokenizer) -> dict | None:
    """The logprobs of the tokens this output added (with the chunk that carries them)."""
    c = out.outputs[0]
    if c.logprobs is None or not out.delta_token_ids:
        return None
    n = len(out.delta_token_ids)
    return fmt.logprobs_object(kind, c.logprobs[-n:], c.token_ids[-n:], tokenizer)


class ChoiceRun:
    """The backend requests behind one HTTP request (n choices x prompts), merged into one
    stream of (choice index, output); keeps admission counts right whatever happens."""

    def __init__(self, state, backend: Backend, tier: Tier, expected: int, admission=None):
        self.state, self.backend, self.tier = state, backend, tier
        self.admission = admission or state.admission
        self.choice: Choice | None = None
        self.hidden_logprobs = False
        """Logprobs asked for the cascade's check only: dropped before the answer."""
        self.failed: str | None = None
        """Why the answer failed the cascade's check (None: it passed, or no check)."""
        self.expected = expected
        """Admission slots taken for this run: one per choice, added or not."""
        self.request_ids: list[str] = []
        self.headers: dict[str, str] = {}
        """The tenant's x-ratelimit-* state after this request was admitted."""
        self._started: set[str] = set()
        self._done: set[str] = set()
        self._closed = False

    async def add(self, prompt: Prompt, params, tier: Tier, priority: int = 0,
                  request_id: str | None = None, owner=None) -> str:
        rid = await self.backend.submit(prompt, params, tier, priority, request_id, owner)
        self.request_ids.append(rid)
        return rid

    async def outputs(self):
        """(choice index, output) as they come. One request's stream is read as it is;
        several are merged through a queue, a task each (the common case, n=1 and one
        prompt, saves that hop on every token)."""
        events = self._one() if len(self.request_ids) == 1 else self._merged()
        try:
            async for index, out in events:
                self._account(self.request_ids[index], out)
                if out.finished and out.outputs[0].finish_reason == "refused":
                    raise OverloadedError(
                        f"the {self.tier} tier has no capacity for this request now (it "
                        "waited past the tier's limit without starting); retry later or use "
                        "another tier", retry_after_s=self.admission.retry_after_s(
                            self.tier), code="resource_unavailable")
                yield index, out
        finally:
            await events.aclose()

    async def _one(self):
        async for out in self.backend.stream(self.request_ids[0]):
            yield 0, out

    async def _merged(self):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: str):
            try:
                async for out in self.backend.stream(rid):
                    queue.put_nowait((index, out))
            except Exception as exc:
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.request_ids)]
        done = 0
        try:
            while done < len(self.request_ids):
                index, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                done += out.finished
                yield index, out
        finally:
            for t in tasks:
                t.cancel()

    def _account(self, rid: str, out) -> None:
        adm = self.admission
        started = out.metrics is not None and out.metrics.first_token_time is not None
        if started and rid not in self._started:
            self._started.add(rid)
            adm.started(self.tier)
        if out.finished and rid not in self._done:
            self._done.add(rid)
            adm.finished(self.tier, rid in self._started, out.metrics and out.metrics.e2e_s)

    def close(self) -> None:
        """Abort unfinished choices and release their admission slots (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for rid in self.request_ids:
            if rid not in self._done:
                self.backend.abort(rid)
                self._done.add(rid)
                self.admission.finished(self.tier, rid in self._started)
        for _ in range(self.expected - len(self.request_ids)):  # never added (an error)
            self.admission.finished(self.tier, False)


