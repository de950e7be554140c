"""`tierserve plan`: the cheapest fleets that meet every SLO for a workload, and what the
fast lane costs.

NOTE: the search
    The grid is hardware x deployment x max_num_seqs x max_num_batched_tokens. In each
    cell the workload is simulated on 1, 2, ... replicas (a dedicated deployment starts at
    its dedicated replicas + 1) up to `max_replicas`, stopping at the first count where
    every tier with an SLO has at least `attainment` of its requests within both its TTFT
    and TPOT targets (report.summarize's slo_attainment; a refused request misses): more
    replicas would only cost more, fewer did not meet. That assumes attainment does not
    fall as replicas are added, which holds for these routers in practice but is not
    checked. Cells that never meet drop out; the rest are ranked by the fleet's price per
    hour (hardware price x tp x replicas), then by machine cost per 1M output tokens.

NOTE: the fast-mode curve
    For the cheapest configuration the replica search is repeated (a) with a share f of
    the requests moved into the priority tier (seeded; the others keep their tiers, former
    priority ones become default), and (b) with the priority TPOT target scaled, which
    also sets the tiered step-time cap (at 0.9 of it). Each point is the fleet needed, its
    machine cost per 1M output tokens, and the share of it attributed to priority requests
    per 1M of theirs.
    In an open-loop workload the fleet's cost is its price times the time the arrivals
    span, so the total moves only when the fast lane forces another replica; the priority
    column shows the per-token premium the cost meter charges the fast lane meanwhile.

NOTE: the step-time headroom
    The cheapest configuration's fleet is simulated again with every step 5, 10, 20, 30
    and 50% slower than the step-time model (HEADROOM_STEPS; on top of
    `--step-time-margin`), up to the first that misses an SLO. A plan at its workload's
    knee meets its SLOs as predicted and misses them when the machine runs a little
    slower: on a shared 2-vCPU VM steps ran 0.8-1.3x a calibration made minutes before,
    and a plan predicted at 93% in its default tier measured 57% with its steps 1.10x
    the profile (docs/benchmarks.md, issue 34). The headroom says how close to that edge
    a plan is; `--step-time-margin` plans with a margin instead. (Not `plan --forecast
    --headroom`, which is extra traffic.)
"""

import json
from dataclasses import asdict, dataclass, replace

from tierserve.config import SchedulerConfig
from tierserve.errors import ConfigError
from tierserve.hardware.roofline import load_hardware
from tierserve.sim.fleet import FleetConfig, Machine, machine_for, make_simulator, \
    step_time_limit
from tierserve.sim.report import summarize
from tierserve.sim.workload import with_priority_fraction
from tierserve.tables import table


HEADROOM_STEPS = (0.05, 0.1, 0.2, 0.3, 0.5)
"""How much slower than the step-time model (and its margin) the step-time headroom check
runs the plan's steps, in turn."""


@dataclass(frozen=True)
class Cell:
    """One point of the grid, before the replica count."""

    hardware: str
    deployment: str
    max_num_seqs: int
    max_num_batched_tokens: int

    def describe(self) -> str:
        return (f"{self.hardware} {self.deployment} max_num_seqs={self.max_num_seqs} "
                f"max_num_batched_tokens={self.max_num_batched_tokens}")


@dataclass
class Fit:
    """A configuration that met every SLO with the fewest replicas its cell allows."""

    cell: Cell
    replicas: int
    cost_per_hour: float
    cost_per_1m_output: float | None
    attainment: dict[str, float]
    """Per tier with an SLO: the share of its requests within both targets."""
    priority_cost_per_1m_output: float | None = None
    """The machine cost attributed to priority requests, per 1M of their output tokens."""


class Planner:
    def __init__(self, shape, slo: dict, attainment: float = 0.9, tp: int = 1,
                 dtype_bytes: int = 2, block_size: int = 16, router: str = "least-tokens",
                 dedicated_replicas: int = 1, dedicated_max_num_seqs: int = 1,
                 policy: str = "tiered", seed: int = 0, step_time_profile: str | None = None,
                 price_per_hour: float | None = None, step_time_margin: float = 0.0,
                 kv_cache_dtype: str = "auto"):
        """`slo`: tier -> (ttft_s, tpot_s), either may be None; `step_time_profile`: a
        `tierserve calibrate` file instead of the roofline (its hardware is `cpu-local`,
        priced at `price_per_hour`); `step_time_margin`: plan as if every step took that
        fraction longer than the model predicts (a machine that drifts from its
        calibration; see make_simulator)."""
        if not slo:
            raise ConfigError("plan needs at least one --slo TIER=TTFT_S,TPOT_S")
        if not 0 < attainment <= 1:
            raise ConfigError(f"attainment must be in (0, 1], got {attainment}")
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        if not 0 <= step_time_margin < 10:
            raise ConfigError(f"--step-time-margin must be a fraction in [0, 10), got "
                              f"{step_time_margin:g}")
        self.step_time_margin = step_time_margin
        self.shape, self.slo, self.attainment = shape, slo, attainment
        self.tp, self.dtype_bytes, self.block_size = tp, dtype_bytes, block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.fleet = FleetConfig(router=router, dedicated_replicas=dedicated_replicas,
                                 dedicated_max_num_seqs=dedicated_max_num_seqs)
        self.policy, self.seed = policy, seed
        self.profile, self.price_per_hour = step_time_profile, price_per_hour
        self.num_simulations = 0
        self.best_miss: tuple[float, str] = (-1.0, "")
        """The highest worst-tier attainment seen among configurations that missed."""
        self._machines: dict[str, Machine] = {}
        self.skipped: dict[str, str] = {}
        """Hardware left out of the search, and why (the model does not fit...)."""

    def machine(self, hardware: str) -> Machine:
        if hardware not in self._machines:
            self._machines[hardware] = machine_for(
                self.shape, hardware, self.tp, self.dtype_bytes, self.block_size,
                price_per_hour=self.price_per_hour, step_time_profile=self.profile,
                kv_cache_dtype=self.kv_cache_dtype)
        return self._machines[hardware]

    # ------------------------------------------------------------- one cell
    def simulate(self, cell: Cell, replicas: int, workload, slo: dict,
                 margin: float | None = None) -> dict | None:
        """The run's summary, or None where the engine could not run the workload (a
        request the KV pool cannot hold). `margin`: steps that fraction slower than the
        model (default: the planner's step_time_margin)."""
        margin = self.step_time_margin if margin is None else margin
        machine = self.machine(cell.hardware)
        config = SchedulerConfig(max_num_seqs=cell.max_num_seqs,
                                 max_num_batched_tokens=cell.max_num_batched_tokens,
                                 policy=self.policy)
        fleet = replace(self.fleet, replicas=replicas, deployment=cell.deployment)
        sim = make_simulator(machine, config, fleet, step_time_limit(machine.model, slo),
                             slo=slo, step_time_margin=margin)
        self.num_simulations += 1
        try:
            return summarize(sim.run(workload), slo)
        except ConfigError:
            return None

    def smallest_fleet(self, cell: Cell, workload, max_replicas: int,
                       slo: dict | None = None) -> Fit | None:
        """The fewest replicas of `cell` meeting every SLO (see the module's note)."""
        slo = slo or self.slo
        start = replace(self.fleet, deployment=cell.deployment).min_replicas
        for replicas in range(start, max_replicas + 1):
            summary = self.simulate(cell, replicas, workload, slo)
            if summary is None:
                continue
            shares = slo_shares(summary, slo)
            worst = min(shares.values(), default=1.0)
            if worst >= self.attainment:
                return Fit(cell, replicas, self.machine(cell.hardware).price_per_hour * replicas,
                           summary["bill"]["cost_per_1m_output"], shares,
                           summary["tiers"].get("priority", {}).get("cost_per_1m_output"))
            if worst > self.best_miss[0]:
                where = f"{cell.describe()} x{replicas}"
                if shares:   # the tier that binds there
                    where += f", where the {min(shares, key=shares.get)} tier meets its SLO"
                self.best_miss = (worst, where)
        return None

    # ---------------------------------------------------------------- search
    def search(self, workload, hardware: list[str], deployments: list[str],
               max_num_seqs: list[int], max_num_batched_tokens: list[int],
               max_replicas: int, progress=None) -> list[Fit]:
        """Every cell's smallest fleet that meets the SLOs, cheapest first."""
        for h in hardware:
            if not self.profile:
                load_hardware(h)  # an unknown name is an error, not a skip
            try:
                self.machine(h)
            except ConfigError as exc:  # the model does not fit, or no price for it
                self.skipped[h] = str(exc)
        cells = [Cell(h, d, s, b) for h in hardware if h not in self.skipped
                 for d in deployments for s in max_num_seqs for b in max_num_batched_tokens]
        if not cells:
            raise ConfigError("no candidate hardware holds the model: "
                              + "; ".join(self.skipped.values()))
        for d in deployments:  # bad values fail here, not as "no configuration meets"
            fleet = replace(self.fleet, deployment=d)
            replace(fleet, replicas=fleet.min_replicas).validate()
        for seqs in max_num_seqs:
            for budget in max_num_batched_tokens:
                SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                policy=self.policy).validate()
        fits = []
        for i, cell in enumerate(cells):
            fit = self.smallest_fleet(cell, workload, max_replicas)
            if fit:
                fits.append(fit)
            if progress:
                progress(i + 1, len(cells))
        if not fits:
            worst, where = self.best_miss
            raise ConfigError(
                f"no configuration meets every SLO at attainment {self.attainment:g} within "
                f"the search space ({len(cells)} configurations, up to {max_replicas} "
                f"replicas); closest: {where} at {worst:.0%}. Raise --max-replicas, add "
                "hardware or relax --slo")
        return sorted(fits, key=lambda f: (f.cost_per_hour, f.cost_per_1m_output or 0.0,
                                           -min(f.attainment.values(), default=1.0)))

    def step_time_headroom(self, fit: Fit, workload,
                           steps: tuple[float, ...] = HEADROOM_STEPS) -> dict:
        """How much slower than the step-time model (on top of step_time_margin) `fit`'s
        steps can run before it misses an SLO: its fleet simulated again at each of
        `steps` in turn, up to the first that misses (see the module's note)."""
        held, missed = 0.0, None
        for extra in steps:
            margin = (1 + self.step_time_margin) * (1 + extra) - 1
            summary = self.simulate(fit.cell, fit.replicas, workload, self.slo, margin)
            shares = slo_shares(summary, self.slo) if summary is not None else {}
            if summary is not None and min(shares.values(), default=1.0) >= self.attainment:
                held = extra
                continue
            tier = min(shares, key=shares.get) if shares else None
            missed = {"slower": extra, "tier": tier, "attainment": shares.get(tier)}
            break
        return {"margin": self.step_time_margin, "holds_at_slower": held, "misses": missed,
                "asked": self.attainment}

    def fast_mode_curve(self, best: Fit, workload, fractions: list[float],
                        tpot_scales: list[float], max_replicas: int,
                        progress=None) -> dict:
        """The fleet `best.cell` needs, and its cost, against the priority share and
        against the priority TPOT target (see the module's note)."""
        points = len(fractions) + len(tpot_scales)

        def point(fit: Fit | None, **key) -> dict:
            if progress:
                progress(sum(map(len, curve.values())) + 1, points)
            return {**key, "replicas": fit.replicas if fit else None,
                    "cost_per_hour": fit.cost_per_hour if fit else None,
                    "cost_per_1m_output": fit.cost_per_1m_output if fit else None,
                    "priority_cost_per_1m_output":
                        fit.priority_cost_per_1m_output if fit else None}

        curve = {"by_priority_fraction": [], "by_priority_tpot": []}
        for f in fractions:
            shifted = with_priority_fraction(workload, f, self.seed)
            curve["by_priority_fraction"].append(point(
                self.smallest_fleet(best.cell, shifted, max_replicas), priority_fraction=f))
        ttft, tpot = self.slo.get("priority", (None, None))
        for scale in tpot_scales if tpot else []:
            slo = {**self.slo, "priority": (ttft, tpot * scale)}
            curve["by_priority_tpot"].append(point(
                self.smallest_fleet(best.cell, workload, max_replicas, slo),
                tpot_scale=scale, priority_tpot_s=tpot * scale))
        return curve


def slo_shares(summary: dict, slo: dict) -> dict[str, float]:
    """Per tier with an SLO that ran in `summary`: the share of its requests within both
    targets."""
    return {t: v["slo_attainment"] for t, v in summary["tiers"].items() if t in slo}


# ------------------------------------------------------------------ output
def render(fits: list[Fit], curve: dict | None, config: str, searched: int,
           simulations: int, top: int, skipped: dict, fmt: str = "table",
           headroom: dict | None = None) -> str:
    if fmt == "json":
        return json.dumps({"config": config, "configurations_searched": searched,
                           "simulations": simulations, "meeting_slos": len(fits),
                           "skipped_hardware": skipped,
                           "fits": [{**asdict(f.cell), **{k: v for k, v in asdict(f).items()
                                                          if k != "cell"}}
                                    for f in fits[:top]],
                           "step_time_headroom": headroom, "fast_mode": curve}, indent=2)
    lines = [f"plan {config}",
             f"{searched} configurations searched in {simulations} simulations; "
             f"{len(fits)} meet every SLO; the cheapest {min(top, len(fits))}:"]
    lines += [f"skipped {h}: {why}" for h, why in skipped.items()] + [""]
    head = ("#", "hardware", "deployment", "max_num_seqs", "budget", "replicas", "$/hour",
            "$/1M out", "priority $/1M", "SLO attainment")
    rows = [(str(i + 1), f.cell.hardware, f.cell.deployment, str(f.cell.max_num_seqs),
             str(f.cell.max_num_batched_tokens), str(f.replicas), f"{f.cost_per_hour:.2f}",
             _money(f.cost_per_1m_output), _money(f.priority_cost_per_1m_output),
             " ".join(f"{t} {a:.0%}" for t, a in f.attainment.items()))
            for i, f in enumerate(fits[:top])]
    lines += table(head, rows)
    if headroom:
        lines += ["", "step-time headroom of #1: " + describe_headroom(headroom)]
    if curve:
        lines += ["", f"what fast mode costs, on #1 ({fits[0].cell.describe()}):", ""]
        point_head = ("replicas", "$/hour", "$/1M out", "priority $/1M")
        lines += table(("priority share", *point_head), [
            (f"{p['priority_fraction']:.0%}", *_point(p)) for p in curve["by_priority_fraction"]])
        if curve["by_priority_tpot"]:
            lines.append("")
            lines += table(("priority TPOT target", *point_head), [
                (f"{p['priority_tpot_s'] * 1e3:.0f} ms (x{p['tpot_scale']:g})", *_point(p))
                for p in curve["by_priority_tpot"]])
    return "\n".join(lines)


def describe_headroom(headroom: dict) -> str:
    """Planner.step_time_headroom's result as one sentence."""
    held, missed, base = headroom["holds_at_slower"], headroom["misses"], headroom["margin"]
    than = "than the step-time model" + (f" with its margin of {base:.0%}" if base else "")
    if missed is None:
        return f"meets every SLO with steps up to {held:.0%} slower {than} (the most tried)"
    if missed["tier"] is None:
        where = "the simulated engine cannot run the workload"
    else:
        where = (f"the {missed['tier']} tier meets {missed['attainment']:.0%} "
                 f"(asked {headroom['asked']:.0%})")
    if not held:
        return (f"at its workload's knee, with steps {missed['slower']:.0%} slower {than}: "
                f"{where}")
    return (f"meets every SLO with steps up to {held:.0%} slower {than}; "
            f"{missed['slower']:.0%} slower, {where}")


def _point(p: dict) -> tuple[str, str, str, str]:
    if p["replicas"] is None:
        return "not met", "-", "-", "-"
    return (str(p["replicas"]), f"{p['cost_per_hour']:.2f}", _money(p["cost_per_1m_output"]),
            _money(p["priority_cost_per_1m_output"]))


def _money(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"
