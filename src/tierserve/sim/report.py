"""What a simulation found: per-tier latency and SLO attainment, throughput, and the bill;
its plots; and the fast-vs-batch report."""

import json

from tierserve.core.stats import percentile as pct
from tierserve.metering.prices import PriceList
from tierserve.sim.loop import SimResult
from tierserve.tables import table
from tierserve.tiers import Tier


def summarize(result: SimResult, slo: dict | None = None,
              prices: PriceList | None = None) -> dict:
    """`slo`: tier -> (ttft_s, tpot_s), either may be None."""
    prices, slo = prices or PriceList(), slo or {}
    reqs, span = result.requests, max(result.makespan_s, 1e-9)
    meter = result.meter
    tiers, good = {}, 0
    for tier in Tier:
        rs = [r for r in reqs if r.tier == tier]
        if not rs:
            continue
        out_tokens = sum(r.num_output_tokens for r in rs)
        cost = sum(r.cost.machine_cost for r in rs if r.cost)
        ttft_slo, tpot_slo = slo.get(tier.label, (None, None))
        met = sum(1 for r in rs if r.meets(ttft_slo, tpot_slo))
        good += met
        tiers[tier.label] = {
            "requests": len(rs), "refused": sum(r.finish_reason == "refused" for r in rs),
            "ttft_p50_s": pct([r.ttft_s for r in rs], 0.5),
            "ttft_p90_s": pct([r.ttft_s for r in rs], 0.9),
            "ttft_p99_s": pct([r.ttft_s for r in rs], 0.99),
            "tpot_p50_s": pct([r.tpot_s for r in rs], 0.5),
            "tpot_p99_s": pct([r.tpot_s for r in rs], 0.99),
            "e2e_p50_s": pct([r.e2e_s for r in rs], 0.5),
            "e2e_p99_s": pct([r.e2e_s for r in rs], 0.99),
            "slo_attainment": met / len(rs) if tier.label in slo else None,
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
    replicas = [{"name": p.name, "requests": len(p.request_ids), "steps": p.num_steps,
                 "utilization": p.busy_s / span, "mean_kv_usage": p.mean_kv_usage,
                 "machine_cost": p.meter.machine_cost} for p in result.replicas]
    return {
        "requests": len(reqs), "makespan_s": result.makespan_s, "steps": result.num_steps,
        "throughput_tok_s": out_tokens / span, "goodput_req_s": good / span if slo else None,
        "utilization": result.busy_s / span / max(len(replicas), 1),
        "mean_kv_usage": result.mean_kv_usage,
        "bill": {"machine_cost": meter.machine_cost, "prefill_cost": prefill,
                 "decode_cost": decode, "idle_cost": meter.idle_cost,
                 "reserved_idle_cost": meter.reserved_idle_cost,
                 "cost_per_1m_output": 1e6 * meter.machine_cost / out_tokens
                 if out_tokens else None,
                 "charge": sum(t["charge"] for t in tiers.values())},
        "tiers": tiers, "replicas": replicas if len(replicas) > 1 else []}


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
             f"${b['charge']:.4f}"]
    if summary["replicas"]:
        lines.append("replicas (utilization, requests, machine $): " + ", ".join(
            f"{p['name']} {p['utilization']:.0%} {p['requests']} ${p['machine_cost']:.4f}"
            for p in summary["replicas"]) + f"; mean utilization {summary['utilization']:.0%}")
    lines.append("")
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
    return "\n".join(lines + table(head, rows))


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


# ------------------------------------------------------------------ plots
def plot(result: SimResult, summary: dict, directory: str) -> list[str]:
    """latency_cdf.png (TTFT and e2e CDFs per tier) and cost_split.png (prefill and
    decode cost per tier, beside idle) in `directory`; returns the paths."""
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, label in ((axes[0], "ttft_s", "time to first token (s)"),
                              (axes[1], "e2e_s", "end-to-end latency (s)")):
        for tier in summary["tiers"]:
            values = sorted(v for r in result.requests if r.tier.label == tier
                            for v in [getattr(r, metric)] if v is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                        where="post", label=f"{tier} (n={len(values)})")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("TTFT CDF by tier")
    axes[1].set_title("end-to-end latency CDF by tier")
    fig.tight_layout()
    paths = [str(out / "latency_cdf.png"), str(out / "cost_split.png")]
    fig.savefig(paths[0], format="png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tiers = list(summary["tiers"])
    prefill = [sum(r.cost.prefill_cost for r in result.requests if r.tier.label == t and r.cost)
               for t in tiers]
    decode = [sum(r.cost.decode_cost for r in result.requests if r.tier.label == t and r.cost)
              for t in tiers]
    b = summary["bill"]
    ax.bar(tiers, prefill, color="tab:orange", label="prefill")
    ax.bar(tiers, decode, bottom=prefill, color="tab:green", label="decode")
    ax.bar(["idle"], [b["idle_cost"]], color="tab:gray", label="idle")
    ax.bar(["idle"], [b["reserved_idle_cost"]], bottom=[b["idle_cost"]], color="tab:red",
           label="idle held for priority")
    ax.set_ylabel("machine cost (USD)")
    ax.set_title(f"machine cost ${b['machine_cost']:.4f}, by tier and idle")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], format="png", dpi=100)
    plt.close(fig)
    return paths


# ---------------------------------------------------------- fast vs batch
def fast_vs_batch(machine, batch_sizes: list[int], prompt_tokens: int = 512,
                  output_tokens: int = 256, max_num_batched_tokens: int = 2048,
                  policy: str = "tiered", rounds: int = 4, progress=None) -> dict:
    """What exclusive ("fast mode", batch 1) serving costs against batching: for each batch
    size b, `b` closed-loop users each sending `rounds` requests of fixed lengths to one
    replica of `machine` (sim.fleet.Machine) with max_num_seqs = b. Per batch size:
    output tok/s, machine cost per 1M output tokens, TTFT and TPOT p50, and the ratio of
    batch 1's cost per token to this one's."""
    from tierserve.config import SchedulerConfig
    from tierserve.sim.loop import Simulator
    from tierserve.sim.workload import ClosedLoop, SimRequest

    m, rows = machine, []
    for i, b in enumerate(batch_sizes):
        config = SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=max_num_batched_tokens,
                                 policy=policy)
        sim = Simulator(config, m.num_blocks, m.block_size, m.max_model_len, m.model,
                        m.price_per_hour, way_in_s=m.way_in_s)
        result = sim.run(ClosedLoop(b, [SimRequest(0.0, "default", prompt_tokens, output_tokens)
                                        for _ in range(b * rounds)]))
        s = summarize(result)
        t = s["tiers"]["default"]
        rows.append({"batch_size": b, "throughput_tok_s": s["throughput_tok_s"],
                     "cost_per_1m_output": s["bill"]["cost_per_1m_output"],
                     "ttft_p50_s": t["ttft_p50_s"], "tpot_p50_s": t["tpot_p50_s"]})
        if progress:
            progress(i + 1, len(batch_sizes))
    base = rows[0]["cost_per_1m_output"] if rows and rows[0]["batch_size"] == 1 else None
    for row in rows:
        row["exclusive_over_batched"] = base / row["cost_per_1m_output"] if base else None
    return {"hardware": m.hardware, "price_per_hour": m.price_per_hour,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "max_num_batched_tokens": max_num_batched_tokens, "rows": rows}


def render_fast_vs_batch(report: dict, config: str, fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps({"config": config, **report}, indent=2)
    head = ("batch", "output tok/s", "$/1M out", "ttft p50 ms", "tpot p50 ms",
            "exclusive/batched")
    rows = [(str(r["batch_size"]), f"{r['throughput_tok_s']:.1f}",
             f"{r['cost_per_1m_output']:.4f}", _ms(r["ttft_p50_s"]),
             f"{r['tpot_p50_s'] * 1e3:.1f}" if r["tpot_p50_s"] is not None else "-",
             f"{r['exclusive_over_batched']:.1f}x" if r["exclusive_over_batched"] else "-")
            for r in report["rows"]]
    return "\n".join([f"fast-vs-batch {config}", ""] + table(head, rows))
