"""A minimal OpenAI-compatible upstream for `bench fleet ceiling` only: it answers every
completion with one fixed token at once, so the benchmark measures the gateway alone.
Never a replica for anything else.

    python -m tierserve.bench.stub_upstream PORT
"""

import json
import sys

CHUNK = {"id": "stub", "object": "text_completion", "model": "stub",
         "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/health":
        body, kind = b"{}", b"application/json"
    else:
        events = [CHUNK, {**CHUNK, "choices": [], "usage": USAGE}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + \
            b"data: [DONE]\n\n"
        kind = b"text/event-stream"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    import uvicorn
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
