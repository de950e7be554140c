"""Admission control: bounded per-tier queues, so load gets 429s and never a 500.

A request is *queued* from acceptance until its first output (it holds a slot in the
engine's waiting queue or its prefill), then *running* until it finishes. Only queued
requests count against `queue_limits`: running ones are bounded by max_num_seqs.
"""

import math
from collections import Counter

from tierserve.errors import OverloadedError
from tierserve.tiers import Tier


class Admission:
    def __init__(self, limits: dict[str, int], max_num_seqs: int):
        """`limits`: tier name -> requests (the settings' `queue_limits`)."""
        self.limits = {Tier.parse(t): n for t, n in limits.items()}
        self.max_num_seqs = max_num_seqs
        self.queued: Counter[Tier] = Counter()
        self.running: Counter[Tier] = Counter()
        self._recent_e2e_s = 1.0

    def admit(self, tier: Tier, n: int = 1, enforce: bool = True) -> None:
        """Count `n` queued requests; beyond the tier's limit, 429 (unless not `enforce`d:
        batch lines, whose number in flight the batch runner bounds)."""
        limit = self.limits.get(tier)
        if enforce and self.full(tier, n):
            raise OverloadedError(
                f"the {tier} tier's queue is full ({limit} requests waiting); retry later",
                retry_after_s=self.retry_after_s(tier))
        self.queued[tier] += n

    def full(self, tier: Tier, n: int = 1) -> bool:
        """`admit(tier, n)` would refuse."""
        limit = self.limits.get(tier)
        return limit is not None and self.queued[tier] + n > limit

    def started(self, tier: Tier) -> None:
        self.queued[tier] -= 1
        self.running[tier] += 1

    def finished(self, tier: Tier, started: bool, e2e_s: float | None = None) -> None:
        if started:
            self.running[tier] -= 1
        else:
            self.queued[tier] -= 1
        if e2e_s is not None:
            self._recent_e2e_s = 0.9 * self._recent_e2e_s + 0.1 * e2e_s

    def retry_after_s(self, tier: Tier) -> int:
        """Seconds until about one queue's worth of work has drained."""
        waves = self.queued[tier] / max(self.max_num_seqs, 1)
        return max(1, math.ceil(waves * self._recent_e2e_s))
