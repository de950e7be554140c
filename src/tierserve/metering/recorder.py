"""From engine stats to the bill: per-engine cost meters, the price list, the ledger and
tenant budgets, behind one object the server holds.

A request is registered when the server adds it (tenant, tier asked for, tags). The
recorder is a stat sink right after each engine's cost meter: when a request finishes the
meter has put its machine cost on its stats, and the recorder adds the charge, writes the
ledger row and counts the tenant's spend, before any later sink (the server) sees it.
"""

import calendar
import time
from dataclasses import dataclass

from tierserve.errors import ConfigError, OverloadedError
from tierserve.metering.cost import CostMeter, IdleInterval
from tierserve.metering.ledger import Ledger, RequestRow, connect
from tierserve.metering.prices import PriceList

PERIODS = ("day", "month", "total")


@dataclass
class Budget:
    amount_usd: float
    period: str = "month"
    """`day` or `month` (calendar, UTC), or `total`."""

    def validate(self, tenant: str) -> None:
        if self.amount_usd < 0 or self.period not in PERIODS:
            raise ConfigError(f"budgets.{tenant}: need amount_usd >= 0 and period in "
                              f"{', '.join(PERIODS)}, got {self.amount_usd} per {self.period}")

    def period_start(self, now: float) -> float:
        t = time.gmtime(now)
        if self.period == "day":
            return calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        if self.period == "month":
            return calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        return 0.0


@dataclass
class _Pending:
    tenant: str
    tier_requested: str
    tags: dict


class Recorder:
    def __init__(self, model: str, prices: PriceList, ledger: Ledger | None,
                 budgets: dict[str, Budget] | None = None, on_cost=None, on_idle=None):
        """`on_cost(tier, stats)`, `on_idle(interval)`: told of each finished request and
        each idle interval (Prometheus counters)."""
        self.model, self.prices, self.ledger = model, prices, ledger
        self.budgets = dict(budgets or {})
        self.on_cost, self.on_idle = on_cost, on_idle
        self.meters: list[CostMeter] = []
        self._engines: list = []
        self._pending: dict[str, _Pending] = {}
        self._unix_offset = time.time() - time.monotonic()
        self._spend: dict[str, tuple[float, float]] = {}  # tenant -> (period start, USD)
        self.idle_cost_usd = 0.0

    def attach(self, engine, price_per_hour: float, reserved_fraction: float) -> CostMeter:
        """Meter `engine`: a cost meter and this recorder become its first stat sinks (so
        stats carry their cost and charge before anything else sees them)."""
        model = engine.scheduler.step_time_model
        meter = CostMeter(price_per_hour, reserved_fraction=reserved_fraction,
                          **({"work_model": model} if model is not None else {}))
        engine.stat_sinks[:0] = [meter, self]
        self.meters.append(meter)
        self._engines.append(engine)
        return meter

    # StatSink --------------------------------------------------------------
    def on_step(self, stats) -> None:
        self.flush_idle()

    def on_request_finished(self, stats) -> None:
        self.finished(stats.tier, stats)

    # -------------------------------------------------------------- requests
    def register(self, request_id: str, tenant: str, tier_requested: str,
                 tags: dict | None) -> None:
        self._pending[request_id] = _Pending(tenant, tier_requested, dict(tags or {}))

    def check_budget(self, tenant: str) -> None:
        budget = self.budgets.get(tenant)
        if budget is None:
            return
        spent = self.spent(tenant)
        if spent >= budget.amount_usd:
            raise OverloadedError(
                f"tenant {tenant!r} has used its budget of ${budget.amount_usd:g} per "
                f"{budget.period} (spent ${spent:.6f}); requests resume next period or when "
                "the budget is raised", retry_after_s=3600, code="insufficient_quota")

    def spent(self, tenant: str) -> float:
        budget = self.budgets[tenant]
        start = budget.period_start(time.time())
        cached = self._spend.get(tenant)
        if cached is None or cached[0] != start:
            total = 0.0
            if self.ledger is not None:
                db = connect(self.ledger.path)
                total = db.execute("SELECT coalesce(sum(charge), 0) FROM requests WHERE "
                                   "tenant = ? AND time >= ?", (tenant, start)).fetchone()[0]
                db.close()
            cached = (start, total)
            self._spend[tenant] = cached
        return cached[1]

    def finished(self, tier_served: str, stats) -> None:
        """Charge a finished request, write its row, count its tenant's spend."""
        pending = self._pending.pop(stats.request_id, None) or _Pending("anonymous",
                                                                        tier_served, {})
        cost = stats.cost
        ran = stats.first_scheduled_time is not None  # refused, or aborted while waiting: no
        stats.charge = self.prices.charge(tier_served, stats.num_prompt_tokens,
                                          stats.num_cached_tokens,
                                          stats.num_output_tokens) if ran else 0.0
        if pending.tenant in self.budgets:
            start, total = self._spend.get(pending.tenant) or (None, None)
            if start is None:
                self.spent(pending.tenant)  # loads the period's spend (this row not yet in)
                start, total = self._spend[pending.tenant]
            self._spend[pending.tenant] = (start, total + stats.charge)
        if self.on_cost is not None:
            self.on_cost(tier_served, stats)
        if self.ledger is None:
            return
        finished = stats.finished_time if stats.finished_time is not None else time.monotonic()
        self.ledger.record(RequestRow(
            time=finished + self._unix_offset, request_id=stats.request_id,
            tenant=pending.tenant, model=self.model, tier_requested=pending.tier_requested,
            tier_served=tier_served, prompt_tokens=stats.num_prompt_tokens,
            cached_tokens=stats.num_cached_tokens, output_tokens=stats.num_output_tokens,
            queue_s=stats.queue_s, prefill_s=stats.prefill_s, decode_s=stats.decode_s,
            prefill_cost=cost.prefill_cost if cost else 0.0,
            decode_cost=cost.decode_cost if cost else 0.0, charge=stats.charge,
            finish_reason=stats.finish_reason or "error", tags=pending.tags,
            mean_batch_size=cost.mean_batch_size if cost else None, ttft_s=stats.ttft_s,
            e2e_s=stats.e2e_s))

    def forget(self, request_id: str) -> None:
        """A request that never reached the engine (an error while adding it)."""
        self._pending.pop(request_id, None)

    # ------------------------------------------------------------------ idle
    def flush_idle(self, final: bool = False) -> list[IdleInterval]:
        out = []
        for meter in self.meters:
            if final:
                meter.close_window(time.monotonic())
            for interval in meter.take_idle(flush=final):
                out.append(interval)
                self.idle_cost_usd += interval.cost + interval.reserved_cost
                if self.on_idle is not None:
                    self.on_idle(interval)
                if self.ledger is not None:
                    self.ledger.record_idle(interval.start + self._unix_offset,
                                            interval.end + self._unix_offset, self.model,
                                            interval.cost, interval.reserved_cost)
        return out

    def close(self) -> None:
        """Account the last idle time, leave the engines' sinks, write what is queued."""
        self.flush_idle(final=True)
        for engine, meter in zip(self._engines, self.meters):
            for sink in (meter, self):
                if sink in engine.stat_sinks:
                    engine.stat_sinks.remove(sink)
        if self.ledger is not None:
            self.ledger.close()

