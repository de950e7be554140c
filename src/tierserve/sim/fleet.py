"""Fleets for the simulator: what one replica runs on (`Machine`), how many replicas and
how tiers map to them (`FleetConfig`), and the router that picks each arrival's replica.

NOTE: routing
    The router sees only the replicas that take the arriving request's tier (all of them
    in a shared deployment; in a dedicated one the fast-lane replicas for priority and the
    others for every other tier) and picks, at the arrival instant:
      round-robin   the next of them in turn (a counter per set of eligible replicas);
      least-tokens  the one with the fewest outstanding tokens (prompt tokens not yet
                    computed plus output tokens not yet generated, over its unfinished
                    requests), ties to the lowest index;
      gateway       fleet mode's gateway itself (router/flow.py, imported, not re-written):
                    per-tier queues, lower tiers released under the AIMD limit, priority
                    at once to the best-scored replica, prefix affinity.
    Least-tokens sees the work queued, not the request count: one long prompt weighs as
    much as many short ones. Neither looks at the request's own length.
"""

from collections import Counter
from dataclasses import dataclass, replace

from tierserve.config import SchedulerConfig
from tierserve.core.step_time import StepTimeModel, check_way_in, load_way_in_s
from tierserve.core.tier_rules import priority_cap_s
from tierserve.errors import ConfigError
from tierserve.router.flow import FlowConfig
from tierserve.sim.loop import Replica, Simulator

ROUTERS = ("round-robin", "least-tokens", "gateway")
DEPLOYMENTS = ("shared", "dedicated")


@dataclass(frozen=True)
class Machine:
    """What one replica runs on: its step time, KV pool and price."""

    hardware: str
    model: StepTimeModel
    num_blocks: int
    block_size: int
    max_model_len: int
    price_per_hour: float
    """USD per hour of the replica (all its tensor-parallel devices)."""
    way_in_s: float = 0.0
    """What a request spends outside the replica's steps (sim/loop.py's Replica)."""


def machine_for(shape, hardware: str = "h100-sxm", tp: int = 1, dtype_bytes: int = 2,
                block_size: int = 16, num_kv_blocks: int | None = None,
                price_per_hour: float | None = None, step_time_profile: str | None = None,
                kv_cache_memory_gb: float = 1.0, kv_cache_dtype: str = "auto",
                way_in_s: float | None = None) -> Machine:
    """A replica of `shape` (model.shapes.ModelShape) on `hardware` x `tp`: the roofline
    step-time model (or a calibrated profile, cpu-local) and a KV pool of what the memory
    holds after the weights (or `num_kv_blocks`), its blocks sized for `kv_cache_dtype`
    (auto: the compute dtype; int8: a byte a value and a float32 scale per token and KV
    head, the engine's --kv-cache-dtype int8). `way_in_s`: a request's time outside the
    steps; default: the profile's measured `way_in_s` where it has one, else none."""
    from tierserve.metering.prices import machine_price
    from tierserve.hardware.roofline import load_hardware, roofline

    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    if way_in_s is not None:
        check_way_in(way_in_s, "--way-in-s")
    if step_time_profile:
        model, name, mem_gb = StepTimeModel.load(step_time_profile), "cpu-local", None
        if way_in_s is None:
            way_in_s = load_way_in_s(step_time_profile)
    else:
        hw = load_hardware(hardware)
        model, name, mem_gb = roofline(shape, hw, dtype_bytes, tp, kv_cache_dtype), hw.name, \
            hw.mem_gb * tp
        if price_per_hour is None and hw.price_per_hour is not None:  # a user's file
            price_per_hour = hw.price_per_hour
    kv_block = shape.kv_bytes_per_token(dtype_bytes, kv_cache_dtype) * block_size
    if num_kv_blocks:
        num_blocks = num_kv_blocks
    elif mem_gb:
        free = 0.9 * mem_gb * 2**30 - shape.num_params * dtype_bytes
        if free < kv_block:
            raise ConfigError(f"{shape.name} does not fit {name} x{tp}: the weights need "
                              f"{shape.num_params * dtype_bytes / 2**30:.0f} GiB")
        num_blocks = int(free // kv_block)
    else:
        num_blocks = int(kv_cache_memory_gb * 2**30 // kv_block)
    return Machine(name, model, num_blocks, block_size,
                   min(shape.max_position_embeddings, num_blocks * block_size),
                   machine_price(name, price_per_hour) * tp, way_in_s or 0.0)


def step_time_limit(model: StepTimeModel, slo: dict, override: float | None = None) -> float:
    """The tiered step-time cap, by the engine's rule (core/tier_rules.priority_cap_s):
    `override`, else 0.9 of the priority TPOT SLO, else 3x a lone decode step. 0: no cap."""
    return priority_cap_s(model, (slo.get("priority") or (None, None))[1], override)


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 1
    """All replicas, the dedicated ones included."""
    router: str = "least-tokens"
    deployment: str = "shared"
    """`shared`: every replica takes every tier. `dedicated`: `dedicated_replicas` of them
    take priority requests only (fcfs, `dedicated_max_num_seqs` slots, their idle time
    held for the fast lane), the others every other tier."""
    dedicated_replicas: int = 1
    dedicated_max_num_seqs: int = 1
    reserved_priority_seqs: int = 4
    """router gateway: slots per replica the gateway keeps free for priority."""

    def validate(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got "
                              f"{self.router!r}")
        if self.deployment not in DEPLOYMENTS:
            raise ConfigError(f"deployment must be one of {', '.join(DEPLOYMENTS)}, got "
                              f"{self.deployment!r}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.deployment == "dedicated" and not 1 <= self.dedicated_replicas < self.replicas:
            raise ConfigError(f"a dedicated deployment needs 1 <= dedicated replicas < "
                              f"replicas, got {self.dedicated_replicas} of {self.replicas}")
        if self.dedicated_max_num_seqs < 1:
            raise ConfigError("dedicated_max_num_seqs must be >= 1")

    @property
    def min_replicas(self) -> int:
        return self.dedicated_replicas + 1 if self.deployment == "dedicated" else 1

    def describe(self) -> str:
        text = f"replicas={self.replicas} router={self.router} deployment={self.deployment}"
        if self.deployment == "dedicated":
            text += (f" (dedicated {self.dedicated_replicas} x max_num_seqs "
                     f"{self.dedicated_max_num_seqs})")
        return text


class Router:
    """Picks the replica of each arrival (see the module's note)."""

    def __init__(self, policy: str = "least-tokens"):
        if policy not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {policy!r}")
        self.policy = policy
        self._turns: Counter[tuple[int, ...]] = Counter()

    def __call__(self, tier: str, replicas: list[Replica]) -> int:
        eligible = tuple(i for i, r in enumerate(replicas) if r.serves(tier))
        if not eligible:
            raise ConfigError(f"no replica takes {tier} requests")
        if self.policy == "round-robin":
            turn = self._turns[eligible]
            self._turns[eligible] += 1
            return eligible[turn % len(eligible)]
        return min(eligible, key=lambda i: (replicas[i].outstanding_tokens, i))


def make_simulator(machine: Machine, config: SchedulerConfig, fleet: FleetConfig,
                   limit_s: float | None, progress=None, slo: dict | None = None,
                   step_time_margin: float = 0.0) -> Simulator:
    """A simulator of `fleet` replicas of `machine`, each scheduling with `config` (the
    dedicated ones as the server's dedicated engine does: fcfs, few slots, no cap).
    `slo`: {tier: (ttft_s, tpot_s)}, the gateway router's signal. `step_time_margin`:
    every step takes that fraction longer than the machine's model says, while the
    replicas plan with the model as calibrated (so their caps learn the ratio, as an
    engine's do on a machine slower than its calibration)."""
    fleet.validate()
    m = machine
    steps = m.model.scaled(1 + step_time_margin) if step_time_margin else m.model
    plan = m.model if step_time_margin else None
    if fleet.replicas == 1 and fleet.router != "gateway":
        return Simulator(config, m.num_blocks, m.block_size, m.max_model_len, steps,
                         m.price_per_hour, step_time_limit_s=limit_s or None,
                         progress=progress, plan_model=plan, way_in_s=m.way_in_s)
    replicas = []
    if fleet.deployment == "dedicated":
        fast = replace(config, max_num_seqs=fleet.dedicated_max_num_seqs, policy="fcfs",
                       reserved_priority_seqs=0)
        replicas += [Replica(fast, m.num_blocks, m.block_size, m.max_model_len, steps,
                             m.price_per_hour, reserved_fraction=1.0, name=f"fast{i}",
                             tiers=frozenset({"priority"}), plan_model=plan,
                             way_in_s=m.way_in_s)
                     for i in range(fleet.dedicated_replicas)]
        others = frozenset({"default", "flex", "batch"})
        replicas += [Replica(config, m.num_blocks, m.block_size, m.max_model_len, steps,
                             m.price_per_hour, name=f"main{i}", tiers=others,
                             plan_model=plan, way_in_s=m.way_in_s)
                     for i in range(fleet.replicas - fleet.dedicated_replicas)]
    else:
        replicas += [Replica(config, m.num_blocks, m.block_size, m.max_model_len, steps,
                             m.price_per_hour, step_time_limit_s=limit_s or None,
                             name=f"r{i}", plan_model=plan, way_in_s=m.way_in_s)
                     for i in range(fleet.replicas)]
    if fleet.router == "gateway":
        ttft, tpot = (slo or {}).get("priority") or (None, None)
        flow = FlowConfig(reserved_priority_seqs=fleet.reserved_priority_seqs,
                          priority_ttft_s=ttft, priority_tpot_s=tpot,
                          flex_max_wait_s=config.flex_max_wait_s)
        return Simulator.fleet(replicas, None, progress, gateway=flow)
    return Simulator.fleet(replicas, Router(fleet.router), progress)
