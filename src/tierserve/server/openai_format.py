"""OpenAI response bodies: completions, chat completions, stream chunks, usage, errors."""

import json
import time
import uuid

from tierserve.core.outputs import RequestOutput
from tierserve.tiers import Tier


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outputs: list[RequestOutput], num_prompts: int = 1, tier: Tier | None = None) -> dict:
    """Prompt tokens count once per distinct prompt; timing is the slowest choice's."""
    per_prompt = len(outputs) // max(num_prompts, 1)
    firsts = outputs[::max(per_prompt, 1)]
    # From the stats: a remote replica's outputs carry counts, not token ids.
    prompt_tokens = sum(o.metrics.num_prompt_tokens if o.metrics else len(o.prompt_token_ids)
                        for o in firsts)
    completion = sum(o.metrics.num_output_tokens if o.metrics else len(o.outputs[0].token_ids)
                     for o in outputs)
    stats = [o.metrics for o in outputs if o.metrics is not None]
    cached = sum(o.metrics.num_cached_tokens for o in firsts if o.metrics is not None)

    def worst(fn):
        values = [v for v in map(fn, stats) if v is not None]
        return round(max(values), 6) if values else None

    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0},
        "timing": {"queue_s": worst(lambda s: s.queue_s),
                   "prefill_s": worst(lambda s: s.prefill_s),
                   "decode_s": worst(lambda s: s.decode_s)},
        **(cost_fields(stats, tier) if tier and any(s.cost for s in stats) else {}),
    }


def cost_fields(stats: list, tier: Tier) -> dict:
    """`usage.cost`, the charge in USD as a number (what OpenRouter's usage accounting and
    LiteLLM's `Usage.cost` read), and `usage.cost_details`, the machine cost behind it."""
    prefill = sum(s.cost.prefill_cost for s in stats if s.cost)
    decode = sum(s.cost.decode_cost for s in stats if s.cost)
    charge = round(sum(s.charge or 0.0 for s in stats), 12)
    return {"cost": charge,
            "cost_details": {"prefill_usd": round(prefill, 12), "decode_usd": round(decode, 12),
                             "machine_usd": round(prefill + decode, 12), "charge_usd": charge,
                             "currency": "USD", "served_tier": tier.label}}


def cost_headers(outputs: list[RequestOutput], tier: Tier) -> dict:
    stats = [o.metrics for o in outputs if o.metrics is not None]
    headers = {"x-tierserve-served-tier": tier.label}
    if any(s.cost for s in stats):
        c = cost_fields(stats, tier)["cost_details"]
        headers.update({"x-tierserve-prefill-cost-usd": f"{c['prefill_usd']:.12f}",
                        "x-tierserve-decode-cost-usd": f"{c['decode_usd']:.12f}",
                        "x-tierserve-charge-usd": f"{c['charge_usd']:.12f}"})
    return headers


def logprobs_object(kind: str, entries: list | None, token_ids: list[int],
                    tokenizer) -> dict | None:
    """OpenAI's logprobs of some output tokens: chat's `content` list, or completions'
    parallel lists (`text_offset` counted from the first of these tokens)."""
    if entries is None:
        return None

    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer else str(t)

    pairs = list(zip(token_ids, entries))
    if kind == "chat":
        def item(t: int, lp: float) -> dict:
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**item(t, lp), "top_logprobs": [item(a, x) for a, x in top]}
                            for t, (lp, top) in pairs], "refusal": None}
    tokens = [text(t) for t, _ in pairs]
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in pairs],
            "top_logprobs": [{text(a): x for a, x in top} for _, (_, top) in pairs],
            "text_offset": offsets}


def completion_body(kind: str, rid: str, model: str, tier: Tier, outputs: list[RequestOutput],
                    num_prompts: int, echo: list[str] | None = None, tokenizer=None,
                    calls: list | None = None) -> dict:
    """`echo`: each prompt's text, put ahead of its choices' text (completions); `calls`:
    each chat choice's tool calls, where its answer was calls (server/tools.py)."""
    def logprobs(o: RequestOutput) -> dict | None:
        c = o.outputs[0]
        return logprobs_object(kind, c.logprobs, c.token_ids, tokenizer)

    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text},
                    "logprobs": logprobs(o), "finish_reason": o.outputs[0].finish_reason}
                   for i, o in enumerate(outputs)]
        for choice, found in zip(choices, calls or []):
            if found:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": found}
                choice["finish_reason"] = "tool_calls"
        obj = "chat.completion"
    else:
        per_prompt = len(outputs) // max(num_prompts, 1)
        choices = [{"index": i, "text": (echo[i // per_prompt] if echo else "")
                    + o.outputs[0].text, "logprobs": logprobs(o),
                    "finish_reason": o.outputs[0].finish_reason}
                   for i, o in enumerate(outputs)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs, num_prompts, tier), "service_tier": tier.label,
            "system_fingerprint": None}


def chunk(kind: str, rid: str, model: str, tier: Tier, index: int, text: str | None,
          finish_reason: str | None, first: bool = False, include_usage: bool = False,
          logprobs: dict | None = None, tool_calls: list | None = None) -> str:
    """`tool_calls`: a chat chunk carrying whole calls (index, id, type, function)."""
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        if tool_calls:
            delta = {"role": "assistant", "content": None, "tool_calls": [
                {"index": k, **call} for k, call in enumerate(tool_calls)]}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": tier.label, "system_fingerprint": None}
    if include_usage:
        body["usage"] = None
    return sse(body)


def usage_chunk(kind: str, rid: str, model: str, tier: Tier, outputs, num_prompts: int) -> str:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return sse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                "choices": [], "service_tier": tier.label, "system_fingerprint": None,
                "usage": usage(outputs, num_prompts, tier)})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
