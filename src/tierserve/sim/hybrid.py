"""Hybrid fleets in the simulator: all requests on the large model in the fast lane,
against simple turns on a small model's fast lane and hard ones on the large model,
batched (`tierserve plan --hybrid SMALL`).

The two pools of a hybrid fleet share no replica, so each is planned on its own part of
the workload with its own model's step-time model (roofline on its hardware) and the
cheapest fleet of each that meets its tier's SLO is found by the planner's search; the
hybrid's price is their sum. The workload is the customer-service conversations of
route/conversations.py (the same as benchmarks/hybrid.py): prompt tokens from their text
(about 4 characters a token), output tokens drawn per class (simple answers are short,
hard ones long), Poisson arrivals. Requests are routed by their label, i.e. a perfect
router; the benchmark measures what the real routers get wrong.
"""

import random
from dataclasses import dataclass

from tierserve.errors import ConfigError
from tierserve.route.conversations import workload as conversations
from tierserve.sim.plan import Fit, Planner
from tierserve.sim.workload import SimRequest

SIMPLE_OUTPUT = (16, 80)
HARD_OUTPUT = (128, 512)
"""Output tokens drawn uniformly per class."""


def hybrid_workload(n: int, rate: float, seed: int = 0, hard_share: float = 0.3,
                    output_tokens: int | None = None) -> list[tuple[SimRequest, bool]]:
    """`output_tokens`: every request's (as a benchmark sends with ignore_eos); None:
    drawn per class."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for conv in conversations(n, seed=seed, hard_share=hard_share, label_noise=0.0):
        hard = conv["label"] == "hard"
        chars = sum(len(m["content"]) + 8 for m in conv["messages"])
        low, high = HARD_OUTPUT if hard else SIMPLE_OUTPUT
        t += rng.expovariate(rate)
        n_out = rng.randint(low, high)
        out.append((SimRequest(t, "priority", max(8, chars // 4), output_tokens or n_out,
                               shared_prefix=8), hard))
    return out


@dataclass
class Comparison:
    all_large: Fit
    small: Fit
    large: Fit
    span_h: float
    n: int

    @property
    def hybrid_per_hour(self) -> float:
        return self.small.cost_per_hour + self.large.cost_per_hour

    def per_1k(self, per_hour: float) -> float:
        """USD per 1,000 conversations: the fleet's price over the time they arrived in."""
        return 1000 * per_hour * self.span_h / self.n

    def render(self, small_name: str, large_name: str) -> str:
        a, h = self.all_large.cost_per_hour, self.hybrid_per_hour
        lines = [f"all {large_name} in the priority tier: {self.all_large.replicas} x "
                 f"{self.all_large.cell.describe()} = ${a:.2f}/h "
                 f"(${self.per_1k(a):.4f} per 1K conversations)",
                 f"hybrid: simple turns on {small_name} (priority): {self.small.replicas} x "
                 f"{self.small.cell.describe()} = ${self.small.cost_per_hour:.2f}/h; hard "
                 f"ones on {large_name} (default): {self.large.replicas} x "
                 f"{self.large.cell.describe()} = ${self.large.cost_per_hour:.2f}/h; total "
                 f"${h:.2f}/h (${self.per_1k(h):.4f} per 1K conversations)",
                 f"hybrid is {1 - h / a:.0%} cheaper" if h <= a else
                 f"hybrid costs {h / a - 1:.0%} more (the all-large fleet is no larger than "
                 "the hybrid's large pool)"]
        return "\n".join(lines)


def compare(large_shape, small_shape, large_hw: str, small_hw: str, slo: dict, n: int,
            rate: float, seed: int, max_replicas: int, max_num_seqs: list[int],
            budgets: list[int], attainment: float = 0.9, hard_share: float = 0.3,
            tp: int = 1, profiles: tuple[str, str] | None = None,
            price_per_hour: float | None = None,
            output_tokens: int | None = None) -> Comparison:
    """`slo`: tier -> (ttft_s, tpot_s); priority's applies to the fast lanes, default's to
    the large model's batched pool. `tp`: the large model's (the small one runs on one
    device). `profiles`: (small, large) `tierserve calibrate` files, on `cpu-local`
    machines at `price_per_hour`, instead of the rooflines of the hardware."""
    if "priority" not in slo or "default" not in slo:
        raise ConfigError("plan --hybrid needs --slo priority=... and --slo default=...")
    items = hybrid_workload(n, rate, seed, hard_share, output_tokens)
    everything = [r for r, _ in items]
    simple = [r for r, hard in items if not hard]
    hard = [SimRequest(r.arrival_s, "default", r.prompt_tokens, r.output_tokens,
                       r.shared_prefix) for r, h in items if h]
    if not simple or not hard:
        raise ConfigError("the workload needs both simple and hard requests")

    small_profile, large_profile = profiles or (None, None)

    def best(shape, hw, reqs, tiers, tp, profile) -> Fit:
        planner = Planner(shape, {t: slo[t] for t in tiers}, attainment, tp, seed=seed,
                          step_time_profile=profile, price_per_hour=price_per_hour)
        return planner.search(reqs, ["cpu-local" if profile else hw], ["shared"],
                              max_num_seqs, budgets, max_replicas)[0]

    span_h = everything[-1].arrival_s / 3600
    return Comparison(best(large_shape, large_hw, everything, ["priority"], tp, large_profile),
                      best(small_shape, small_hw, simple, ["priority"], 1, small_profile),
                      best(large_shape, large_hw, hard, ["default"], tp, large_profile),
                      span_h, n)
