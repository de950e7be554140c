"""OpenAI response bodies: completions, chat completions, stream chunks, usage, errors."""

import json
import time
import uuid

from tierserve.engine.outputs import RequestOutput
from tierserve.server.metrics import decode_s, prefill_s


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outputs: list[RequestOutput], num_prompts: int = 1) -> dict:
    """Prompt tokens count once per distinct prompt; timing is the slowest choice's."""
    per_prompt = len(outputs) // max(num_prompts, 1)
    firsts = outputs[::max(per_prompt, 1)]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
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
        "timing": {"queue_s": worst(lambda s: s.queue_s), "prefill_s": worst(prefill_s),
                   "decode_s": worst(decode_s)},
    }


def completion_body(kind: str, rid: str, model: str, tier: str, outputs: list[RequestOutput],
                    num_prompts: int) -> dict:
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text},
                    "logprobs": None, "finish_reason": o.outputs[0].finish_reason}
                   for i, o in enumerate(outputs)]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": o.outputs[0].text, "logprobs": None,
                    "finish_reason": o.outputs[0].finish_reason}
                   for i, o in enumerate(outputs)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs, num_prompts), "service_tier": tier,
            "system_fingerprint": None}


def chunk(kind: str, rid: str, model: str, tier: str, index: int, text: str | None,
          finish_reason: str | None, first: bool = False, include_usage: bool = False) -> str:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": tier, "system_fingerprint": None}
    if include_usage:
        body["usage"] = None
    return sse(body)


def usage_chunk(kind: str, rid: str, model: str, tier: str, outputs, num_prompts: int) -> str:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return sse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                "choices": [], "service_tier": tier, "system_fingerprint": None,
                "usage": usage(outputs, num_prompts)})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
