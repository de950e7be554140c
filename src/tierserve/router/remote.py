"""Remote replicas: what the gateway is told of each (`ReplicaSpec`), and one streamed
request to a replica over its OpenAI-compatible HTTP API.

A replica is vLLM (`kind: vllm`, started with `--scheduling-policy priority` so the
gateway's `priority` field orders its queue; lower runs first), another tierserve
(`kind: tierserve`, which takes the tier itself as `service_tier` and reports its exact
cost), or any OpenAI-compatible server (`kind: openai`: neither field is sent).

A vLLM replica running tierserve's plugin (tierserve/vllm: found by its
`/tierserve/v1/info`, or `plugin: true`) gets the tier, tenant and the gateway's request
id as `vllm_xargs`: it orders, preempts and meters by tier itself, so the gateway does not
hold lower tiers back for it, and reads each request's exact cost from
`/tierserve/v1/costs` when its stream ends.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from tierserve.errors import ConfigError, UpstreamError
from tierserve.tiers import Tier

KINDS = ("vllm", "tierserve", "openai")
UNKNOWN_SLOTS = 256
"""A replica's slot count where neither the config nor the replica says (vLLM's default
`--max-num-seqs` on a GPU)."""


@dataclass
class ReplicaSpec:
    url: str
    """Base URL, e.g. http://10.0.0.5:8000 (the /v1 routes are below it)."""
    models: list[str] = field(default_factory=list)
    """Model names it serves; the first is sent upstream (empty: the gateway's name)."""
    kind: str | None = None
    """vllm, tierserve or openai (see the module docstring); None: asked of the replica
    at start (`discover`), vllm where it does not answer."""
    api_key: str | None = None
    """Bearer key the gateway sends to it."""
    price_per_hour: float | None = None
    """USD per hour of its machine; None: the --hardware profile's price."""
    hardware: str | None = None
    """A price profile (metering.prices) for this replica; None: the server's."""
    max_num_seqs: int | None = None
    """Requests it runs at once (vLLM's --max-num-seqs); None: asked of the replica at
    start (`discover`), UNKNOWN_SLOTS where it does not say."""
    plugin: bool | None = None
    """kind vllm: runs tierserve's scheduler plugin (None: ask the replica)."""
    name: str = ""
    max_model_len: int | None = None
    """Its context length: from the config, else its model card at start (`discover`;
    vLLM's and tierserve's cards say it); None where neither says."""

    @property
    def auth_headers(self) -> dict[str, str]:
        """The header that authenticates the gateway to it (none without `api_key`)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"backend url must start with http:// or https://, got "
                              f"{self.url!r}")
        if self.kind is not None and self.kind not in KINDS:
            raise ConfigError(f"backend {self.url}: kind must be one of {', '.join(KINDS)}, "
                              f"got {self.kind!r}")
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ConfigError(f"backend {self.url}: {name} must be an integer >= 1, "
                                  f"got {value!r}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ConfigError(f"backend {self.url}: price_per_hour must be >= 0")

    @classmethod
    def parse(cls, raw, index: int) -> "ReplicaSpec":
        """A URL, or a YAML mapping with these fields."""
        if isinstance(raw, str):
            spec = cls(url=raw)
        elif isinstance(raw, dict) and "url" in raw:
            unknown = set(raw) - set(cls.__dataclass_fields__)
            if unknown:
                raise ConfigError(f"backends[{index}]: unknown key {sorted(unknown)[0]!r}")
            raw = dict(raw)
            if isinstance(raw.get("models"), str):
                raw["models"] = [raw["models"]]
            spec = cls(**raw)
        else:
            raise ConfigError(f"backends[{index}]: expected a URL or {{url: ..., ...}}, got "
                              f"{raw!r}")
        spec.url = spec.url.rstrip("/")
        if spec.url.endswith("/v1"):  # a base URL as OpenAI clients take it
            spec.url = spec.url[:-3]
        spec.name = spec.name or f"r{index}"
        spec.validate()
        return spec


def discover(spec: ReplicaSpec, timeout_s: float = 3.0) -> str:
    """Ask a replica what the config did not say: the models it serves (its /v1/models),
    its kind (the models' `owned_by`: tierserve, vllm, else openai) and its slot count
    (a tierserve replica's model card; tierserve's vLLM plugin's /tierserve/v1/info; vLLM's
    /server_info where its dev mode is on). Returns the start-up log's line for it."""
    import httpx

    try:
        r = httpx.get(spec.url + "/v1/models", headers=spec.auth_headers, timeout=timeout_s)
        data = r.json()["data"] if r.status_code == 200 else None
        if not isinstance(data, list):
            raise ValueError(f"/v1/models answered {r.status_code}")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        known = spec.kind is not None
        spec.kind = spec.kind or "vllm"
        slots = _slots_line(spec, None, False)
        return (f"replica {spec.name} ({spec.url}) did not answer /v1/models "
                f"({type(exc).__name__}: {exc}); {'kind' if known else 'taken as'} "
                f"{spec.kind}" + ("" if spec.models else ", serving the gateway's model")
                + f"; {slots}")
    cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    owners = {m.get("owned_by") for m in cards}
    detected = spec.kind is None
    if detected:
        spec.kind = "tierserve" if "tierserve" in owners else \
            "vllm" if "vllm" in owners else "openai"
    learned = not spec.models
    if learned:  # a tierserve replica's route aliases are its own business, not models
        spec.models = [m["id"] for m in cards if "routes_to" not in m]
    first = next((c for c in cards if c["id"] == (spec.models or [None])[0]), None)
    if spec.max_model_len is None and first is not None \
            and isinstance(first.get("max_model_len"), int):
        spec.max_model_len = first["max_model_len"]
    said = None
    if spec.max_num_seqs is None:
        said = _slots_of(spec, cards, httpx, timeout_s)
    return (f"replica {spec.name} ({spec.url}) answered: {spec.kind}"
            f"{' (detected)' if detected else ''}, serves {', '.join(spec.models) or 'nothing'}"
            f"{' (learned)' if learned else ''}; {_slots_line(spec, said, True)}")


def _slots_of(spec: ReplicaSpec, cards: list, httpx, timeout_s: float) -> str | None:
    """The replica's own slot count, where it tells (sets `spec.max_num_seqs`); the
    source named for the log."""
    first = next((c for c in cards if c["id"] == (spec.models or [None])[0]), None)
    if spec.kind == "tierserve" and first and isinstance(first.get("max_num_seqs"), int):
        spec.max_num_seqs = first["max_num_seqs"]
        return "its model card"
    if spec.kind != "vllm":
        return None
    for path, read in (("/tierserve/v1/info", lambda j: j["max_num_seqs"]),
                       ("/server_info?config_format=json",
                        lambda j: j["vllm_config"]["scheduler_config"]["max_num_seqs"])):
        try:
            r = httpx.get(spec.url + path, headers=spec.auth_headers, timeout=timeout_s)
            n = read(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            n = None
        if isinstance(n, int) and n > 0:
            spec.max_num_seqs = n
            return path.split("?")[0]
    return None


def _slots_line(spec: ReplicaSpec, said: str | None, answered: bool) -> str:
    if spec.max_num_seqs is not None:
        return f"{spec.max_num_seqs} slots ({'from ' + said if said else 'configured'})"
    spec.max_num_seqs = UNKNOWN_SLOTS
    return (f"{UNKNOWN_SLOTS} slots assumed ({'it does not say' if answered else 'unknown'};"
            " set the backend's max_num_seqs)")


class ReplicaDown(Exception):
    """The replica could not be reached or broke the connection (a gateway matter: retry
    elsewhere or report; never shown to a client as is)."""


def upstream_body(spec: ReplicaSpec, path: str, body: dict, model: str, tier: Tier,
                  priority: int, plugin: bool = False, request_id: str = "",
                  tenant: str = "") -> dict:
    """The request a replica gets: the client's, streamed with usage, plus the tier as
    the replica's kind understands it (`plugin`: tierserve's vLLM plugin runs there)."""
    # the replica's own name for the model (its first), unless it lists the gateway's
    named = model if model in spec.models or not spec.models else spec.models[0]
    body = {**body, "model": named, "stream": True,
            "stream_options": {"include_usage": True}}
    body.pop("service_tier", None)
    body.pop("priority", None)
    if spec.kind == "vllm" and plugin:
        body["priority"] = priority  # within the tier; the plugin orders tiers itself
        body["vllm_xargs"] = {"tier": tier.label, "tierserve_id": request_id,
                              **({"tenant": tenant} if tenant else {})}
    elif spec.kind == "vllm":
        # vLLM: lower first. Priority's band is below 0 and flex's above, as the plugin
        # reads a bare `priority`, so a replica not yet found to run it still gets the
        # right tier.
        body["priority"] = (int(tier) - 1) * 1000 + priority
    elif spec.kind == "tierserve":
        body["service_tier"] = "default" if tier == Tier.BATCH else tier.label
        body["priority"] = priority
    return body


def session(connect_timeout_s: float, read_timeout_s: float) -> aiohttp.ClientSession:
    """The gateway's connections to its replicas, kept alive.

    NOTE: why aiohttp for the streamed requests (httpx does the health checks)
        Profiled under the ceiling load (64 clients, a one-token upstream), httpx and
        httpcore took three quarters of the gateway's CPU: its pool scans every pooled
        connection, with a syscall per idle one, whenever a request starts or ends.
        aiohttp's pool and its C HTTP parser do not. Idle connections are dropped after
        4 s, before uvicorn's 5 s keep-alive closes them from the other side."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s,
                                      sock_read=read_timeout_s),
        read_bufsize=1 << 20, skip_auto_headers=("User-Agent",))


async def stream(client: aiohttp.ClientSession, spec: ReplicaSpec, path: str,
                 body: dict) -> AsyncIterator[dict]:
    """The replica's SSE chunks, parsed. Raises ReplicaDown (connection, 5xx) or
    UpstreamError (the replica refused the request: 4xx, passed on)."""
    headers = {"Content-Type": "application/json", **spec.auth_headers}
    raw_body = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    try:
        async with client.post(spec.url + path, data=raw_body, headers=headers) as r:
            if r.status >= 400:
                raw = await r.read()
                error = _error_of(raw)
                if r.status >= 500 or r.status == 429:
                    raise ReplicaDown(f"{spec.name} answered {r.status}: "
                                      f"{error.get('message', raw[:200])}")
                raise UpstreamError(error.get("message") or f"replica answered "
                                    f"{r.status}", r.status, error.get("param"),
                                    error.get("code"))
            done = False
            async for line in r.content:
                # Read on to the body's end after [DONE]: a response left unread closes its
                # connection, and the next request pays for a new one.
                if done or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ReplicaDown(f"{spec.name} reported an error mid-stream: "
                                      f"{chunk['error']}")
                yield chunk
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # JSON, UTF-8
        raise ReplicaDown(f"{spec.name} ({spec.url}): {type(exc).__name__}: {exc}") from exc


def _error_of(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(body, dict) and isinstance(body.get("message"), str):  # vLLM's older shape
        return body
    return {}
