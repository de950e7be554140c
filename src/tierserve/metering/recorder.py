"""From engine stats to the bill: per-engine cost meters, the price list, the ledger and
tenant budgets, behind one object the server holds.

A request is registered when the server adds it (tenant, tier asked for, tags). Each
engine gets one `EngineMetering` (its cost meter, then this recorder), and a fleet of
replicas one `FleetMetering` (metering/estimate.py: a meter per replica, then this
recorder), as its request accounting's metering (core/accounting.py), called before any
sink: when a request finishes, the meter gives its machine cost, the recorder its charge,
the ledger row and the tenant's spend, and the resulting `Bill` is on the request's stats
before a sink (the server) sees it. Idle time accrues as it passes: `accrue()` (each
scrape, dashboard poll and step) books every meter's idle time up to now.

NOTE: budgets hold under concurrency
    A request of a tenant with a budget reserves its worst-case charge when it is admitted
    (`reserve`: its prompt and `max_tokens` at its tier's price) and is admitted only
    while the tenant's spend plus what is reserved is below the budget. When it finishes
    (or is aborted) the reservation is settled to the real charge; a request that never
    reached the engine releases it (`forget`). So however many requests a tenant sends at
    once, its spend can pass its budget by at most one request's worst case: the last one
    admitted while something was left. Gateways sharing a PostgreSQL ledger hold and
    settle in the database instead (metering/shared.py), so the bound is for all of them
    together.
"""

import asyncio
import calendar
import threading
import time
from dataclasses import dataclass

from tierserve.core.stats import Bill, Metering, RequestCost
from tierserve.errors import ConfigError, OverloadedError
from tierserve.metering.cost import CostMeter, IdleInterval
from tierserve.metering.ledger import Ledger, RequestRow
from tierserve.metering.prices import PriceList
from tierserve.tiers import Tier

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
    tier_requested: Tier
    tags: dict
    model: str | None = None
    """The served model (where a server serves several); None: the recorder's."""


class EngineMetering(Metering):
    """One engine's metering: its cost meter prices the steps and each finished request's
    machine cost, then the recorder charges and records it."""

    def __init__(self, meter: CostMeter, recorder: "Recorder"):
        self.meter, self.recorder = meter, recorder

    def on_step_starting(self, start: float) -> None:
        self.meter.on_step_starting(start)

    def on_step(self, stats) -> None:
        self.meter.on_step(stats)
        self.recorder.flush_idle()

    def on_request_finished(self, stats) -> Bill:
        cost = self.meter.take(stats.request_id)
        return Bill(cost, self.recorder.finished(stats, cost))


class Recorder:
    def __init__(self, model: str, prices: PriceList, ledger: Ledger | None,
                 budgets: dict[str, Budget] | None = None):
        self.model, self.prices, self.ledger = model, prices, ledger
        self.budgets = dict(budgets or {})
        self.meters: list[CostMeter] = []
        self._meter_models: dict[int, str] = {}
        """id(meter) -> the served model its idle time is labelled with."""
        self._engines: list = []
        self._pending: dict[str, _Pending] = {}
        self._unix_offset = time.time() - time.monotonic()
        self._spend: dict[str, tuple[float, float]] = {}  # tenant -> (period start, USD)
        self._read_at: dict[str, float] = {}
        self._holds: dict[str, tuple[str, float]] = {}  # request id -> (tenant, USD held)
        self._reserved: dict[str, float] = {}  # tenant -> USD held by its requests
        self._charged: dict[str, float] = {}  # tenant -> USD charged by this process
        self.request_cost_usd = 0.0
        """Machine cost of the requests finished by this process (USD)."""
        self._hold_lock = threading.Lock()  # reserve (event loop) vs settle (engine thread)
        self.shared_refresh_s = 0.5
        """How stale another gateway's spend may be (a shared PostgreSQL ledger)."""
        self.shared = None
        """metering/shared.py's SharedState where the ledger is a PostgreSQL database:
        holds and rate-limit buckets that every gateway of it shares."""
        if ledger is not None and ledger.dialect == "postgresql":
            from tierserve.metering.shared import SharedState
            self.shared = SharedState(ledger.path)

    def attach(self, engine, price_per_hour: float, reserved_fraction: float,
               model: str | None = None) -> CostMeter:
        """Meter `engine` (its `set_metering`): stats carry their cost and charge before
        any sink sees them. `model`: the served model (where a server serves several)."""
        work = engine.scheduler.step_time_model
        meter = CostMeter(price_per_hour, reserved_fraction=reserved_fraction,
                          **({"work_model": work} if work is not None else {}))
        engine.set_metering(EngineMetering(meter, self))
        self.add_meter(meter, model)
        self._engines.append(engine)
        return meter

    def add_meter(self, meter: CostMeter, model: str | None = None) -> None:
        """A meter whose idle time this recorder accrues, records and counts."""
        self.meters.append(meter)
        self._meter_models[id(meter)] = model or self.model

    # -------------------------------------------------------------- requests
    def register(self, request_id: str, tenant: str, tier_requested: Tier,
                 tags: dict | None, model: str | None = None) -> None:
        self._pending[request_id] = _Pending(tenant, tier_requested, dict(tags or {}), model)

    def reserve(self, tenant: str, holds: list[tuple[str, float]]) -> None:
        """Admit requests of `tenant`, each (request id, worst-case charge in USD), or
        raise 429 insufficient_quota holding nothing (see the note on budgets)."""
        budget = self.budgets.get(tenant)
        if budget is None:
            return
        if self.shared is not None:
            return self._hold_shared(tenant, budget, holds)
        with self._hold_lock:  # a request settling meanwhile moves held to spent at once
            self._hold(tenant, budget, self.spent(tenant), holds)

    def _hold_shared(self, tenant: str, budget: Budget, holds: list[tuple[str, float]]) -> None:
        from tierserve.metering.shared import Refused
        try:
            self.shared.hold(tenant, budget.amount_usd, budget.period_start(time.time()),
                             holds)
        except Refused as exc:
            self._refuse(tenant, budget, exc.found["spent"], exc.found["held"])
        with self._hold_lock:  # this gateway's part, for reserved() and the settle
            for request_id, usd in holds:
                self._holds[request_id] = (tenant, usd)
                self._reserved[tenant] = self._reserved.get(tenant, 0.0) + usd

    @staticmethod
    def _refuse(tenant: str, budget: Budget, spent: float, reserved: float):
        raise OverloadedError(
            f"tenant {tenant!r} has used its budget of ${budget.amount_usd:g} per "
            f"{budget.period} (spent ${spent:.6f}, ${reserved:.6f} held by requests "
            "running); requests resume next period, when the budget is raised, or "
            "(if something is held) when running requests finish",
            retry_after_s=1 if reserved else 3600, code="insufficient_quota")

    def _hold(self, tenant: str, budget: Budget, spent: float,
              holds: list[tuple[str, float]]) -> None:
        reserved = self._reserved.get(tenant, 0.0)
        if spent + reserved >= budget.amount_usd:
            self._refuse(tenant, budget, spent, reserved)
        for request_id, usd in holds:
            self._holds[request_id] = (tenant, usd)
            reserved += usd
        self._reserved[tenant] = reserved

    def reserved(self, tenant: str) -> float:
        """USD held by the tenant's admitted, unfinished requests."""
        return self._reserved.get(tenant, 0.0)

    def _release(self, request_id: str) -> None:
        """Drop a request's hold (the caller holds `_hold_lock`)."""
        held = self._holds.pop(request_id, None)
        if held is not None:
            tenant, usd = held
            left = self._reserved[tenant] - usd
            self._reserved[tenant] = left if left > 1e-15 else 0.0

    def spent(self, tenant: str) -> float:
        """The tenant's spend this budget period: the ledger's sum, read once per period
        from a file only this server writes, or every `shared_refresh_s` from a database
        that other gateways write too; plus what this server charged since it read."""
        budget = self.budgets[tenant]
        now = time.time()
        start = budget.period_start(now)
        cached = self._spend.get(tenant)
        stale = cached is None or cached[0] != start or (
            self.ledger is not None and self.ledger.dialect == "postgresql"
            and now - self._read_at.get(tenant, 0.0) >= self.shared_refresh_s)
        if stale:
            total = self.ledger.spent(tenant, start) if self.ledger is not None else 0.0
            if cached is not None and cached[0] == start:  # rows of ours still queued
                total = max(total, cached[1])
            cached = (start, total)
            self._spend[tenant] = cached
            self._read_at[tenant] = now
        return cached[1]

    def spent_since(self, tenant: str, since_unix: float) -> float:
        """What `tenant` was charged since `since_unix`: the ledger's committed rows, or,
        without a ledger, what this process charged it (since it started)."""
        if self.ledger is not None:
            return self.ledger.spent(tenant, since_unix)
        return self._charged.get(tenant, 0.0)

    def finished(self, stats, cost: RequestCost, note: dict | None = None) -> float:
        """Charge a finished request (in the tier that served it), write its row, count
        its tenant's spend; returns the charge. `note`: more tags for its row (how the
        cost was made), under `tierserve.`-prefixed keys."""
        tier_served = stats.billed_tier
        pending = self._pending.pop(stats.request_id, None) or _Pending("anonymous",
                                                                        tier_served, {})
        ran = stats.first_scheduled_time is not None  # refused, or aborted while waiting: no
        charge = self.prices.charge(tier_served, stats.num_prompt_tokens,
                                    stats.num_cached_tokens,
                                    stats.num_output_tokens) if ran else 0.0
        with self._hold_lock:  # the charge replaces the hold in one move
            self.request_cost_usd += cost.machine_cost if cost is not None else 0.0
            self._charged[pending.tenant] = self._charged.get(pending.tenant, 0.0) + charge
            if pending.tenant in self.budgets:
                start, total = self._spend.get(pending.tenant) or (None, None)
                if start is None:
                    self.spent(pending.tenant)  # loads the period's spend (row not yet in)
                    start, total = self._spend[pending.tenant]
                self._spend[pending.tenant] = (start, total + charge)
            held = stats.request_id in self._holds
            self._release(stats.request_id)
        if note:
            pending.tags = {**pending.tags, **{f"tierserve.{k}": v for k, v in note.items()}}
        if self.ledger is not None:
            self._write(stats, cost, charge, pending, held and self.shared is not None)
        return charge

    def _write(self, stats, cost: RequestCost, charge: float, pending: _Pending,
               settles_hold: bool = False) -> None:
        finished = stats.finished_time if stats.finished_time is not None else time.monotonic()
        self.ledger.record(settles_hold=settles_hold, row=RequestRow(
            time=finished + self._unix_offset, request_id=stats.request_id,
            tenant=pending.tenant, model=pending.model or self.model,
            tier_requested=pending.tier_requested.label,
            tier_served=stats.billed_tier.label, prompt_tokens=stats.num_prompt_tokens,
            cached_tokens=stats.num_cached_tokens, output_tokens=stats.num_output_tokens,
            queue_s=stats.queue_s, prefill_s=stats.prefill_s, decode_s=stats.decode_s,
            prefill_cost=cost.prefill_cost, decode_cost=cost.decode_cost, charge=charge,
            finish_reason=stats.finish_reason or "error", tags=pending.tags,
            mean_batch_size=cost.mean_batch_size, ttft_s=stats.ttft_s,
            e2e_s=stats.e2e_s))

    async def committed(self, timeout_s: float = 5.0) -> None:
        """Wait until the rows recorded so far are committed (at most `timeout_s`: a
        database that is down delays answers by that much, it does not stop them)."""
        if self.ledger is None:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake():
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop has closed (shutdown): nobody waits any more
                pass

        self.ledger.barrier(wake)
        await asyncio.wait([done], timeout=timeout_s)

    def forget(self, request_id: str) -> None:
        """A request that never reached the engine (an error while adding it)."""
        self._pending.pop(request_id, None)
        with self._hold_lock:
            held = request_id in self._holds
            self._release(request_id)
        if held and self.shared is not None:
            self.shared.release([request_id])

    # ------------------------------------------------------------------ idle
    def accrue(self) -> None:
        """Book every meter's idle time up to now (a meter whose step is running keeps
        it), and write the idle intervals that closed."""
        now = time.monotonic()
        for meter in self.meters:
            meter.close_window(now)
        self.flush_idle()

    def machine_totals(self) -> dict:
        """This process's machine cost so far, idle booked up to now: requests finished +
        idle (+ what requests still running used) = machine."""
        self.accrue()
        return {"machine_usd": sum(m.machine_cost for m in self.meters),
                "requests_usd": self.request_cost_usd,
                "idle_usd": sum(m.idle_cost for m in self.meters),
                "idle_reserved_usd": sum(m.reserved_idle_cost for m in self.meters)}

    def idle_totals(self) -> dict[str, tuple[float, float]]:
        """Served model -> (unreserved, reserved) idle cost so far, open intervals too."""
        out: dict[str, tuple[float, float]] = {}
        for meter in self.meters:
            model = self._meter_models.get(id(meter), self.model)
            idle, held = out.get(model, (0.0, 0.0))
            out[model] = (idle + meter.idle_cost, held + meter.reserved_idle_cost)
        return out

    def flush_idle(self, final: bool = False) -> list[IdleInterval]:
        out = []
        for meter in self.meters:
            if final:
                meter.close_window(time.monotonic())
            model = self._meter_models.get(id(meter), self.model)
            for interval in meter.take_idle(flush=final):
                out.append(interval)
                if self.ledger is not None:
                    self.ledger.record_idle(interval.start + self._unix_offset,
                                            interval.end + self._unix_offset, model,
                                            interval.cost, interval.reserved_cost)
        return out

    def close(self) -> None:
        """Account the last idle time, leave the engines' sinks, write what is queued."""
        self.flush_idle(final=True)
        for engine in self._engines:
            engine.set_metering(None)
        if self.ledger is not None:
            self.ledger.close()
        if self.shared is not None:
            self.shared.close()

