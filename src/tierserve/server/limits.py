"""Per-tenant rate limits: requests and tokens per minute, with OpenAI's headers.

Each limit is a token bucket holding one minute's allowance, refilled continuously (a
tenant with 60 requests per minute may send 60 at once, then one a second). A request
takes one request and its worst-case tokens (prompt plus `max_tokens`, as OpenAI counts
them) at admission; what it takes is not given back. A request that does not fit gets 429
`rate_limit_exceeded` with `Retry-After` (seconds until it would fit) and takes nothing.
Every answer to a limited tenant carries OpenAI's `x-ratelimit-limit-*`,
`x-ratelimit-remaining-*` and `x-ratelimit-reset-*` headers (reset: until the bucket is
full again, written like OpenAI's `6m0s` / `1.5s`).
"""

import math
import time
from dataclasses import dataclass

from tierserve.errors import ConfigError, OverloadedError


@dataclass
class RateLimit:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def validate(self, tenant: str) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"rate_limits.{tenant}.{name} must be a positive integer, "
                                  f"got {value!r}")

    @classmethod
    def parse(cls, tenant: str, spec) -> "RateLimit":
        if not isinstance(spec, dict) or set(spec) - set(cls.__dataclass_fields__):
            raise ConfigError(f"rate_limits.{tenant}: expected {{requests_per_minute: N, "
                              f"tokens_per_minute: N}}, got {spec!r}")
        limit = cls(**spec)
        limit.validate(tenant)
        return limit


class _Bucket:
    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level, self.at = self.capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` fits (inf: it never will, being above the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def reset_s(self) -> float:
        return (self.capacity - self.level) / self.rate


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: `1s`, `1.5s`, `6m0s`."""
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


class RateLimiter:
    def __init__(self, limits: dict[str, RateLimit], clock=time.monotonic, shared=None):
        """`shared`: metering/shared.py's SharedState (gateways of one PostgreSQL
        database): the buckets live there, one per tenant and kind for all of them."""
        self.limits = dict(limits)
        self.clock = clock
        self.shared = shared
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def set(self, tenant: str, limit: RateLimit | None) -> None:
        """Change a tenant's limits (admin API); its buckets start full again."""
        if limit is None:
            self.limits.pop(tenant, None)
        else:
            self.limits[tenant] = limit
        self._buckets.pop((tenant, "requests"), None)
        self._buckets.pop((tenant, "tokens"), None)
        if self.shared is not None:
            self.shared.reset(tenant)

    def _wants(self, tenant: str, requests: int, tokens: int) -> list:
        limit = self.limits.get(tenant)
        if limit is None:
            return []
        return [(kind, per_minute, amount) for kind, per_minute, amount in
                (("requests", limit.requests_per_minute, requests),
                 ("tokens", limit.tokens_per_minute, tokens)) if per_minute is not None]

    def _pairs(self, tenant: str, now: float):
        limit = self.limits.get(tenant)
        if limit is None:
            return []
        out = []
        for kind, per_minute in (("requests", limit.requests_per_minute),
                                 ("tokens", limit.tokens_per_minute)):
            if per_minute is None:
                continue
            bucket = self._buckets.get((tenant, kind))
            if bucket is None or bucket.capacity != per_minute:
                bucket = self._buckets[tenant, kind] = _Bucket(per_minute, now)
            bucket.refill(now)
            out.append((kind, bucket))
        return out

    def take(self, tenant: str, requests: int, tokens: int) -> dict[str, str]:
        """Take `requests` and `tokens` from the tenant's buckets, or raise 429 taking
        nothing. Returns the x-ratelimit-* headers (empty for an unlimited tenant)."""
        if self.shared is not None:
            return self._take_shared(tenant, requests, tokens)
        now = self.clock()
        pairs = self._pairs(tenant, now)
        want = {"requests": requests, "tokens": tokens}
        wait = max((b.wait_s(want[k]) for k, b in pairs), default=0.0)
        if wait > 0:
            kind = max(pairs, key=lambda p: p[1].wait_s(want[p[0]]))[0]
            if math.isinf(wait):
                raise OverloadedError(
                    f"this request needs {want[kind]} {kind} but tenant {tenant!r} may use "
                    f"at most {int(self.limits[tenant].__dict__[kind + '_per_minute'])} "
                    f"{kind} per minute; lower max_tokens or the prompt",
                    retry_after_s=60, code="rate_limit_exceeded",
                    headers=self.headers(tenant))
            raise OverloadedError(
                f"rate limit reached for tenant {tenant!r}: {kind} per minute; retry in "
                f"{math.ceil(wait)} s", retry_after_s=math.ceil(wait),
                code="rate_limit_exceeded", headers=self.headers(tenant))
        for kind, bucket in pairs:
            bucket.level -= want[kind]
        return self._headers(pairs)

    def _take_shared(self, tenant: str, requests: int, tokens: int) -> dict[str, str]:
        from tierserve.metering.shared import Refused

        wants = self._wants(tenant, requests, tokens)
        if not wants:
            return {}
        try:
            got = self.shared.take(tenant, wants)
        except Refused as exc:
            kind, wait = exc.found["kind"], exc.found["wait_s"]
            per_minute = next(p for k, p, _ in wants if k == kind)
            headers = {f"x-ratelimit-limit-{k}": str(int(p)) for k, p, _ in wants}
            if math.isinf(wait):
                raise OverloadedError(
                    f"this request needs {requests if kind == 'requests' else tokens} {kind} "
                    f"but tenant {tenant!r} may use at most {int(per_minute)} {kind} per "
                    "minute; lower max_tokens or the prompt", retry_after_s=60,
                    code="rate_limit_exceeded", headers=headers)
            raise OverloadedError(
                f"rate limit reached for tenant {tenant!r}: {kind} per minute; retry in "
                f"{math.ceil(wait)} s", retry_after_s=math.ceil(wait),
                code="rate_limit_exceeded", headers=headers)
        out = {}
        for kind, (capacity, level, reset) in got.items():
            out[f"x-ratelimit-limit-{kind}"] = str(int(capacity))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            out[f"x-ratelimit-reset-{kind}"] = _duration(reset)
        return out

    def give_back(self, tenant: str, requests: int, tokens: int) -> None:
        """Return what `take` took for a request refused later in admission."""
        if self.shared is not None:
            wants = self._wants(tenant, requests, tokens)
            if wants:
                self.shared.give_back(tenant, wants)
            return
        for kind, bucket in self._pairs(tenant, self.clock()):
            bucket.level = min(bucket.capacity, bucket.level + (
                requests if kind == "requests" else tokens))

    def headers(self, tenant: str) -> dict[str, str]:
        return self._headers(self._pairs(tenant, self.clock()))

    @staticmethod
    def _headers(pairs) -> dict[str, str]:
        out = {}
        for kind, bucket in pairs:
            out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{kind}"] = _duration(bucket.reset_s())
        return out
