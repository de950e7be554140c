"""The plugin's settings (`--additional-config '{"tierserve": {...}}'`) and how a vLLM
request names its tier and tenant. No vLLM import: tested without it."""

import logging
from dataclasses import dataclass, fields

from tierserve.config import SchedulerConfig
from tierserve.core.request import Owner
from tierserve.errors import ConfigError
from tierserve.metering.prices import machine_price
from tierserve.tiers import Tier

log = logging.getLogger("tierserve.vllm")

TIER_BAND = 1 << 20
"""vLLM's `priority` is set to tier rank x TIER_BAND + the request's own priority, so
vLLM's own preemption victim (largest priority) is always of the lowest tier first."""
TIER_FIELDS = ("reserved_priority_seqs", "reserved_priority_blocks", "default_aging_s",
               "flex_max_wait_s", "priority_guard_s", "priority_step_time_s",
               "decode_step_time_s")
"""The plugin's keys that are tierserve's SchedulerConfig fields (same meaning)."""
DEFAULTS = {"decode_step_time_s": 0.0}
"""Where the plugin's default differs from tierserve's engine: no decode cap, so default
traffic runs exactly as vLLM's own chunked prefill paces it (the plugin costs nothing
when there is no priority work); set decode_step_time_s to smooth streams."""


@dataclass
class PluginConfig:
    """`--additional-config '{"tierserve": {...}}'`: the tier fields of tierserve's
    SchedulerConfig (TIER_FIELDS, the same names and defaults), and these."""

    hardware: str = "cpu-local"
    """Price profile of this replica's machine (metering/prices.py)."""
    price_per_hour: float | None = None
    """USD per hour of the machine; None: the hardware's list price."""
    priority_sync: bool = True
    """While priority is about and for `priority_guard_s` after, schedule a step only once
    the one before it is done: vLLM's async scheduling queues the next step while one runs,
    so a priority arrival would wait for both; this costs the overlap, only then."""

    @classmethod
    def parse(cls, raw, vllm_scheduler) -> tuple["PluginConfig", SchedulerConfig]:
        raw = dict(raw or {})
        own = {f.name for f in fields(cls)}
        unknown = set(raw) - own - set(TIER_FIELDS)
        if unknown:
            raise ConfigError(f"--additional-config tierserve: unknown key "
                              f"{sorted(unknown)[0]!r}; keys: "
                              f"{', '.join(sorted(own | set(TIER_FIELDS)))}")
        plugin = cls(**{k: v for k, v in raw.items() if k in own})
        tiers = SchedulerConfig(max_num_seqs=vllm_scheduler.max_num_seqs,
                                max_num_batched_tokens=vllm_scheduler.max_num_batched_tokens,
                                policy="tiered", **{**DEFAULTS, **{
                                    k: v for k, v in raw.items() if k in TIER_FIELDS}})
        tiers.validate()
        machine_price(plugin.hardware, plugin.price_per_hour)  # ConfigError if unknown
        return plugin, tiers


def tier_of(request) -> tuple[Tier, int, Owner, str]:
    """(tier, priority within it, owner, cost key) of a vLLM request."""
    xargs = (request.sampling_params.extra_args if request.sampling_params else None) or {}
    priority = request.priority
    if "tier" in xargs:
        try:
            tier = Tier.parse(str(xargs["tier"]))
        except ValueError:
            log.warning("request %s: unknown tier %r, served as default", request.request_id,
                        xargs["tier"])
            tier = Tier.DEFAULT
    else:
        tier = Tier.PRIORITY if priority < 0 else Tier.FLEX if priority > 0 else Tier.DEFAULT
    try:
        weight = float(xargs.get("weight", 1.0))
    except (TypeError, ValueError):
        weight = 1.0
    owner = Owner(str(xargs.get("tenant", "")), weight if weight > 0 else 1.0)
    return tier, priority, owner, str(xargs.get("tierserve_id", request.request_id))
