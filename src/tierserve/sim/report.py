"""What a simulation found: per-tier latency and SLO attainment, throughput, and the bill."""

import json

from tierserve.engine.stats import percentile as pct
from tierserve.metering.prices import PriceList
from tierserve.sim.loop import SimResult

TIER_ORDER = ("priority", "default", "flex", "batch")


def summarize(result: SimResult, slo: dict | None = None,
              prices: PriceList | None = None) -> dict:
    """`slo`: tier -> (ttft_s, tpot_s), either may be None."""
    prices, slo = prices or PriceList(), slo or {}
    reqs, span = result.requests, max(result.makespan_s, 1e-9)
    meter = result.meter
    tiers, good = {}, 0
    for tier in TIER_ORDER:
        rs = [r for r in reqs if r.tier == tier]
        if not rs:
            continue
        out_tokens = sum(r.num_output_tokens for r in rs)
        cost = sum(r.cost.machine_cost for r in rs if r.cost)
        ttft_slo, tpot_slo = slo.get(tier, (None, None))
        met = sum(1 for r in rs if r.meets(ttft_slo, tpot_slo))
        good += met
        tiers[tier] = {
            "requests": len(rs), "refused": sum(r.finish_reason == "refused" for r in rs),
            "ttft_p50_s": pct([r.ttft_s for r in rs], 0.5),
            "ttft_p90_s": pct([r.ttft_s for r in rs], 0.9),
            "ttft_p99_s": pct([r.ttft_s for r in rs], 0.99),
            "tpot_p50_s": pct([r.tpot_s for r in rs], 0.5),
            "tpot_p99_s": pct([r.tpot_s for r in rs], 0.99),
            "e2e_p50_s": pct([r.e2e_s for r in rs], 0.5),
            "e2e_p99_s": pct([r.e2e_s for r in rs], 0.99),
            "slo_attainment": met / len(rs) if tier in slo else None,
            "output_tokens": out_tokens, "machine_cost": cost,
            "cost_per_1m_output": 1e6 * cost / out_tokens if out_tokens else None,
            "charge": sum(prices.charge(tier, r.num_prompt_tokens, r.num_cached_tokens,
                                        r.num_output_tokens) for r in rs
                          if r.first_scheduled_time is not None),
            "preemptions": result.preemptions_by_tier.get(tier, 0),
            "wasted_tokens": result.recomputed_tokens_by_tier.get(tier, 0)}
    prefill = sum(r.cost.prefill_cost for r in reqs if r.cost)
    decode = sum(r.cost.decode_cost for r in reqs if r.cost)
    out_tokens = sum(r.num_output_tokens for r in reqs)
    return {
        "requests": len(reqs), "makespan_s": result.makespan_s, "steps": result.num_steps,
        "throughput_tok_s": out_tokens / span, "goodput_req_s": good / span if slo else None,
        "utilization": result.busy_s / span, "mean_kv_usage": result.mean_kv_usage,
        "bill": {"machine_cost": meter.machine_cost, "prefill_cost": prefill,
                 "decode_cost": decode, "idle_cost": meter.idle_cost,
                 "reserved_idle_cost": meter.reserved_idle_cost,
                 "cost_per_1m_output": 1e6 * meter.machine_cost / out_tokens
                 if out_tokens else None,
                 "charge": sum(t["charge"] for t in tiers.values())},
        "tiers": tiers}


def render(summary: dict, config: str, fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps({"config": config, **summary}, indent=2)
    b = summary["bill"]
    lines = [f"sim {config}",
             f"{summary['requests']} requests in {summary['makespan_s']:.1f} s simulated, "
             f"{summary['steps']} steps; {summary['throughput_tok_s']:.1f} output tok/s; "
             f"utilization {summary['utilization']:.0%}; mean KV usage "
             f"{summary['mean_kv_usage']:.0%}"
             + (f"; goodput {summary['goodput_req_s']:.2f} req/s"
                if summary["goodput_req_s"] is not None else ""),
             f"machine ${b['machine_cost']:.4f} = prefill ${b['prefill_cost']:.4f} + decode "
             f"${b['decode_cost']:.4f} + idle ${b['idle_cost'] + b['reserved_idle_cost']:.4f}"
             f"; ${b['cost_per_1m_output'] or 0:.4f} per 1M output tokens; charged "
             f"${b['charge']:.4f}", ""]
    head = ("tier", "n", "ttft p50/p90/p99 ms", "tpot p50/p99 ms", "e2e p50/p99 s", "SLO",
            "$/1M out", "preempt", "wasted")
    rows = []
    for tier, t in summary["tiers"].items():
        rows.append((tier, str(t["requests"]),
                     "/".join(_ms(t[k]) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
                     "/".join(_ms(t[k]) for k in ("tpot_p50_s", "tpot_p99_s")),
                     "/".join(f"{t[k]:.2f}" if t[k] is not None else "-"
                              for k in ("e2e_p50_s", "e2e_p99_s")),
                     f"{t['slo_attainment']:.0%}" if t["slo_attainment"] is not None else "-",
                     f"{t['cost_per_1m_output']:.4f}" if t["cost_per_1m_output"] else "-",
                     str(t["preemptions"]), str(t["wasted_tokens"])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"
