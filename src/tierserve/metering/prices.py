"""What the machine costs (hardware prices) and what tenants are charged (the price list).

Machine prices are on-demand list prices per hour, rounded, for one accelerator (or, for
`cpu-local`, a small 2-vCPU cloud VM like the one tierserve's CPU figures come from). They
are defaults to be overridden (`--machine-price-per-hour`, `machine_price_per_hour:` in the
config), not quotes.
"""

from dataclasses import dataclass, field

from tierserve.errors import ConfigError
from tierserve.tiers import Tier

MACHINE_PRICE_PER_HOUR = {
    "cpu-local": 0.10,
    "l4": 0.80,
    "l40s": 1.90,
    "a100-80gb": 3.70,
    "h100-sxm": 6.90,
    "h200": 8.00,
}

TIER_MULTIPLIERS = {Tier.PRIORITY: 2.0, Tier.DEFAULT: 1.0, Tier.FLEX: 0.5, Tier.BATCH: 0.5}


@dataclass
class PriceList:
    """USD per million tokens, before the tier multiplier of the tier that served."""

    input_per_m: float = 0.10
    cached_input_per_m: float = 0.05
    output_per_m: float = 0.40
    tier_multipliers: dict[Tier, float] = field(default_factory=lambda: dict(TIER_MULTIPLIERS))

    def charge(self, tier: Tier, prompt_tokens: int, cached_tokens: int,
               output_tokens: int) -> float:
        """What a request served in `tier` is charged (an aborted one: for what ran)."""
        base = ((prompt_tokens - cached_tokens) * self.input_per_m
                + cached_tokens * self.cached_input_per_m
                + output_tokens * self.output_per_m) / 1e6
        return base * self.tier_multipliers.get(tier, 1.0)

    def validate(self) -> None:
        for name in ("input_per_m", "cached_input_per_m", "output_per_m"):
            if getattr(self, name) < 0:
                raise ConfigError(f"prices: {name} must be >= 0")
        bad = {t.label: m for t, m in self.tier_multipliers.items() if m < 0}
        if bad:
            raise ConfigError(f"prices: tier multipliers must be >= 0, got {bad}")


def machine_price(hardware: str | None, override: float | None) -> float:
    if override is not None:
        if override < 0:
            raise ConfigError(f"machine price per hour must be >= 0, got {override}")
        return override
    name = hardware or "cpu-local"
    if name not in MACHINE_PRICE_PER_HOUR:
        raise ConfigError(f"unknown hardware {name!r}; known: "
                          f"{', '.join(MACHINE_PRICE_PER_HOUR)} (or give a price per hour)")
    return MACHINE_PRICE_PER_HOUR[name]
