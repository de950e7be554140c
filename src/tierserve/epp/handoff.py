"""The fleet backend's transport when Envoy carries the request: instead of sending it,
the gateway hands the chosen replica and the request's scheduling fields to the ext_proc
stream that holds it (epp/service.py), and reads the replica's answer from the response
chunks Envoy shows that stream.

NOTE: one request's handoff
    The ext_proc handler opens a `Slot` before it submits the request. When the gateway
    releases it (router/flow.py, as in `tierserve serve --backend`), the fleet backend
    calls `stream(...)`: the slot's `sent` future gets (replica, the body to send) and
    the handler answers Envoy with the destination. The meter's ext_proc stream then
    feeds what Envoy shows of the answer: `feed` per response chunk (SSE events, or one
    JSON body for a request that did not stream), `end` at its end. So the backend
    times, meters and finishes the request exactly as it does one it sent itself; only
    who moves the bytes differs.
"""

import asyncio
import json
from dataclasses import dataclass, field

from tierserve.errors import UpstreamError

SCHEDULING_FIELDS = ("model", "priority", "vllm_xargs", "service_tier", "cache_salt")
"""What the gateway adds to or changes in a client's body for its replica; the rest of
the client's body goes through as the client wrote it."""
USAGE_COMMENT = b": usage "
"""How a tierserve replica asked with `x-tierserve-usage: comment` gives a stream's usage
the client did not ask for: an SSE comment, which clients skip."""
_END = object()


@dataclass(eq=False)
class Slot:
    client_body: dict
    sent: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                 .create_future())
    """Resolves to (ReplicaSpec, the body to send) when the gateway releases it."""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    status: int = 200
    raw: bytearray = field(default_factory=bytearray)
    """Bytes not yet parsed (an SSE event split across chunks, or a whole JSON body)."""

    @property
    def stream(self) -> bool:
        """The client asked for a stream (the replica answers as the client asked)."""
        return bool(self.client_body.get("stream"))

    # ------------------------------------------------- the handler feeds these
    def feed(self, data: bytes) -> None:
        """A response chunk, as Envoy saw it pass (an event split across chunks is read
        once whole)."""
        self.raw += data
        if not self.stream or self.status != 200:
            return  # one JSON body (or an error): read at its end
        while True:
            cut = self.raw.find(b"\n\n")
            if cut < 0:
                return
            event = bytes(self.raw[:cut])
            del self.raw[:cut + 2]
            self._event(event)

    def end(self) -> None:
        if self.status != 200:
            self.events.put_nowait(UpstreamError(_message(bytes(self.raw)), self.status))
        elif self.stream:
            if self.raw.strip():
                self._event(bytes(self.raw))
        else:
            try:
                self.events.put_nowait(_as_chunk(json.loads(bytes(self.raw))))
            except ValueError:
                self.events.put_nowait(UpstreamError("the replica's answer is not JSON", 502))
        self.raw.clear()
        self.events.put_nowait(_END)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
            elif line.startswith(USAGE_COMMENT):  # a tierserve replica's usage, unasked
                data = line[len(USAGE_COMMENT):].strip()
            else:
                continue
            if data and data != b"[DONE]":
                try:
                    self.events.put_nowait(json.loads(data))
                except ValueError:
                    continue  # not a chunk of ours


def _as_chunk(body: dict) -> dict:
    """A whole completion read as one stream chunk (its text and usage)."""
    choices = []
    for c in body.get("choices") or []:
        text = c.get("text")
        if text is None:
            text = (c.get("message") or {}).get("content") or ""
        choices.append({"text": text, "finish_reason": c.get("finish_reason")})
    return {"choices": choices, "usage": body.get("usage")}


def _message(raw: bytes) -> str:
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else err
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        return raw.decode(errors="replace")[:500] or "the replica answered with an error"


class Handoff:
    """The transport (FleetBackend's `transport`): one slot per request Envoy holds."""

    def __init__(self):
        self.slots: dict[str, Slot] = {}

    def open(self, request_id: str, client_body: dict) -> Slot:
        slot = Slot(dict(client_body))
        self.slots[request_id] = slot
        return slot

    def close(self, request_id: str) -> None:
        self.slots.pop(request_id, None)

    async def __call__(self, request_id: str, spec, path: str, body: dict):
        slot = self.slots.get(request_id)
        if slot is None or slot.sent.done():  # Envoy routes a request once: no retry here
            raise UpstreamError("the request's stream to Envoy is gone", 502)
        slot.sent.set_result((spec, self.body(slot, body)))
        while True:
            item = await slot.events.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    @staticmethod
    def body(slot: Slot, built: dict) -> dict:
        """The client's body with the gateway's scheduling fields for this replica. The
        stream itself is never changed: usage is in it where the client asked for it
        (else counted from the chunks, or a tierserve replica's usage comment)."""
        out = {k: v for k, v in slot.client_body.items() if k not in SCHEDULING_FIELDS}
        out.update({k: built[k] for k in SCHEDULING_FIELDS if k in built})
        return out
