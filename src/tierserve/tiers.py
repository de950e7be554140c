"""Service tiers: the enum every layer keys by, parsed once at the edge, and the one rule
that picks the tier a tenant's request runs in.

A plain leaf (no other tierserve import): the HTTP layer, the gateway, the engine, the
simulator and the vLLM plugin all use it.
"""

from collections.abc import Collection
from enum import IntEnum


class Tier(IntEnum):
    """Service tiers, best first: a smaller value is served earlier and preempted later.
    Formats as its name (`f"{Tier.FLEX}"` is "flex"); JSON needs `.label`."""

    PRIORITY = 0
    DEFAULT = 1
    FLEX = 2
    BATCH = 3

    @classmethod
    def parse(cls, name: "str | Tier") -> "Tier":
        """A tier by name (or a Tier as it is); ValueError naming the tiers otherwise."""
        if isinstance(name, Tier):
            return name
        try:
            return cls[name.upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"unknown tier {name!r}; expected one of "
                             f"{', '.join(t.label for t in cls)}") from None

    @classmethod
    def from_wire(cls, service_tier: "str | Tier | None") -> "Tier":
        """What OpenAI's `service_tier` asks for: `auto` and no value mean `default`."""
        return cls.DEFAULT if service_tier in (None, "auto") else cls.parse(service_tier)

    @property
    def label(self) -> str:
        return self.name.lower()

    def __bool__(self) -> bool:
        return True  # PRIORITY is 0: without this, `tier or other` would skip it

    def __str__(self) -> str:
        return self.label

    def __format__(self, spec: str) -> str:
        return format(self.label, spec)


TIER_NAMES = tuple(t.label for t in Tier)
"""Every tier's name, best first: the one list of tier names (config, CLI, reports)."""
REQUEST_TIERS = ("auto",) + tuple(t.label for t in Tier if t != Tier.BATCH)
"""What `service_tier` may say on the wire (batch comes only from /v1/batches)."""


def resolve(asked: Tier, allowed: Collection[Tier]) -> Tier | None:
    """The tier a request asking for `asked` runs in when only `allowed` may be used: the
    one asked for, else the nearest allowed below it (cheaper), else the nearest above;
    None when nothing is allowed."""
    if asked in allowed:
        return asked
    below = [t for t in Tier if t > asked and t in allowed]
    above = [t for t in reversed(Tier) if t < asked and t in allowed]
    return (below or above or [None])[0]
