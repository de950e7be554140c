"""`tierserve bill`: the ledger explained.

Totals (machine cost split into prefill, decode, idle and idle held for the fast lane;
charge; margin), a table per group (tenant, tier, model, size or a tag), and findings in
plain words computed from the rows, e.g. which requests cost far more machine time than
their share of tokens, and what they would have cost in a cheaper tier.
"""

import csv
import io
import json
import re
import statistics
from collections import defaultdict
from datetime import datetime, timezone

from tierserve.core.stats import percentile as pct
from tierserve.errors import ConfigError, TierserveError
from tierserve.metering.ledger import connect
from tierserve.tables import table

SIZES = ((64, "<64 out"), (256, "64-255 out"), (None, ">=256 out"))
GROUPINGS = ("tenant", "tier", "model", "size", "route")


def parse_time(text: str | None, now: float) -> float | None:
    """ISO date or date-time (UTC unless it says), unix seconds, or an age like 24h, 7d."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"cannot read the time {text!r}: give an ISO date (2026-11-30, "
                          "2026-11-30T12:00), unix seconds, or an age (24h, 7d)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def size_of(output_tokens: int) -> str:
    for limit, label in SIZES:
        if limit is None or output_tokens < limit:
            return label
    return SIZES[-1][1]


def load(path, since: float | None, until: float | None) -> tuple[list[dict], list[dict]]:
    """The request and idle rows of the ledger at `path` (a SQLite file or a
    `postgresql://` URL) in [since, until)."""
    db = connect(path)
    lo, hi = since if since is not None else float("-inf"), until if until is not None \
        else float("inf")
    db.row_factory = dict
    rows = db.execute("SELECT * FROM requests WHERE time >= ? AND time < ? ORDER BY time, id",
                      (lo, hi)).fetchall()
    idle = db.execute('SELECT * FROM idle WHERE "end" > ? AND start < ?', (lo, hi)).fetchall()
    db.close()
    for r in rows:
        r["tags"] = json.loads(r["tags"] or "{}")
        r["machine_cost"] = r["prefill_cost"] + r["decode_cost"]
        r["size"] = size_of(r["output_tokens"])
    return rows, idle


def group_key(row: dict, by: str) -> str:
    if by == "tier":
        return row["tier_served"]
    if by in ("tenant", "model", "size"):
        return row[by]
    if by == "route":  # a model called by name has no route
        route = row["tags"].get("route")
        return route if route else f"{row['model']} (by name)"
    return str(row["tags"].get(by[4:], "(none)"))  # tag:KEY (checked in summarize)


def summarize(rows: list[dict], idle: list[dict], by: str, large: str | None = None) -> dict:
    """`large` (with `by` route): the model whose fast lane the routes are compared with
    (default: the ledger's most expensive per output token)."""
    if by not in GROUPINGS and not (by.startswith("tag:") and len(by) > 4):
        raise ConfigError(f"--by must be one of {', '.join(GROUPINGS)} or tag:KEY, got {by!r}")
    prefill = sum(r["prefill_cost"] for r in rows)
    decode = sum(r["decode_cost"] for r in rows)
    idle_cost = sum(i["cost"] for i in idle)
    reserved = sum(i["reserved_cost"] for i in idle)
    machine = prefill + decode + idle_cost + reserved
    charge = sum(r["charge"] for r in rows)
    groups = defaultdict(list)
    for r in rows:
        groups[group_key(r, by)].append(r)
    table = []
    for key, rs in sorted(groups.items()):
        out_tokens = sum(r["output_tokens"] for r in rs)
        cost = sum(r["machine_cost"] for r in rs)
        table.append({
            by: key, "requests": len(rs),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rs), "output_tokens": out_tokens,
            "machine_cost": cost, "charge": sum(r["charge"] for r in rs),
            "cost_per_1k_output": 1000 * cost / out_tokens if out_tokens else None,
            "e2e_p50_s": pct([r["e2e_s"] for r in rs], 0.5),
            "e2e_p99_s": pct([r["e2e_s"] for r in rs], 0.99),
            "ttft_p50_s": pct([r["ttft_s"] for r in rs], 0.5),
            "mean_batch_size": statistics.fmean(
                [r["mean_batch_size"] for r in rs if r["mean_batch_size"]] or [0.0])})
    totals = {"requests": len(rows), "machine_cost": machine, "prefill_cost": prefill,
              "decode_cost": decode, "idle_cost": idle_cost, "reserved_idle_cost": reserved,
              "charge": charge, "margin": charge - machine,
              "output_tokens": sum(r["output_tokens"] for r in rows)}
    out = {"by": by, "totals": totals, "groups": table, "findings": findings(rows, totals)}
    if by == "route":
        from tierserve.metering.counterfactual import compare_routes
        compare_routes(out, groups, rows, large)
    return out


def findings(rows: list[dict], totals: dict) -> list[str]:
    """Plain-words observations, each computed from the rows (none is canned)."""
    out = []
    machine, tokens = totals["machine_cost"], totals["output_tokens"]
    if not rows or machine <= 0 or tokens <= 0:
        return out
    cells = defaultdict(list)
    for r in rows:
        cells[(r["tier_served"], r["size"])].append(r)
    per_token = {}
    for tier in ("flex", "batch", "default"):
        rs = [r for r in rows if r["tier_served"] == tier]
        t = sum(r["output_tokens"] for r in rs)
        if t:
            per_token[tier] = sum(r["machine_cost"] for r in rs) / t
    for (tier, size), rs in sorted(cells.items(), key=lambda kv: -sum(r["machine_cost"]
                                                                       for r in kv[1])):
        cost = sum(r["machine_cost"] for r in rs)
        t = sum(r["output_tokens"] for r in rs)
        cost_share, token_share = cost / machine, t / tokens
        if cost_share < 0.1 or cost_share < 2 * token_share:
            continue
        line = (f"{tier} requests with {size.replace(' out', '')} output tokens were "
                f"{token_share:.0%} of output tokens and {cost_share:.0%} of machine cost "
                f"(${1000 * cost / max(t, 1):.4f} per 1K output tokens)")
        cheaper = next((x for x in ("flex", "batch", "default") if x in per_token
                        and x != tier and per_token[x] * t < cost), None)
        if cheaper:
            line += (f"; at {cheaper}'s cost per token they would have cost "
                     f"${cost - per_token[cheaper] * t:.4f} less")
        out.append(line + ".")
    idle = totals["idle_cost"] + totals["reserved_idle_cost"]
    if idle / machine >= 0.05:
        held = totals["reserved_idle_cost"] / machine
        out.append(f"Idle capacity was {idle / machine:.0%} of machine cost"
                   + (f", {held:.0%} of it held for the fast lane." if held else "."))
    if totals["charge"] < machine:
        out.append(f"Charges covered {totals['charge'] / machine:.0%} of machine cost "
                   f"(margin ${totals['margin']:.4f}).")
    return out


# ----------------------------------------------------------------- output
def render(summary: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(summary, indent=2)
    cols = columns(summary["by"])
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, cols)
        w.writeheader()
        for g in summary["groups"]:
            w.writerow(g)
        return buf.getvalue()
    t = summary["totals"]
    lines = [f"machine cost ${t['machine_cost']:.6f} = prefill ${t['prefill_cost']:.6f} + "
             f"decode ${t['decode_cost']:.6f} + idle ${t['idle_cost']:.6f} + idle held for "
             f"priority ${t['reserved_idle_cost']:.6f}",
             f"charged ${t['charge']:.6f}; margin ${t['margin']:.6f}; {t['requests']} requests,"
             f" {t['output_tokens']} output tokens", ""]
    lines += table(cols, [[fmt_value(g[c]) for c in cols] for g in summary["groups"]])
    if summary["findings"]:
        lines += ["", "findings:"] + [f"- {f}" for f in summary["findings"]]
    return "\n".join(lines)


def columns(by: str) -> list[str]:
    """The columns of a group's row, in the order the table and the CSV show them."""
    if by == "route":
        return [by, "requests", "escalated", "output_tokens", "machine_cost",
                "if_large_priority", "saving", "charge", "ttft_p50_s", "e2e_p50_s"]
    return [by, "requests", "prompt_tokens", "output_tokens", "machine_cost", "charge",
            "cost_per_1k_output", "e2e_p50_s", "e2e_p99_s", "ttft_p50_s", "mean_batch_size"]


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


def figure(summary: dict):
    """Cost per 1K output tokens of each group of the summary (its `--by`), and the
    machine cost split. Raises ImportError where matplotlib is not installed (it is an
    optional extra, needed only here)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no backend

    groups, t = summary["groups"], summary["totals"]
    fig = Figure(figsize=(max(12, 5 + 0.8 * len(groups)), 4.5))
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[max(1, len(groups) / 4), 1])
    labels = [_plain(str(g[summary["by"]])) for g in groups]
    ax1.bar(range(len(groups)), [g["cost_per_1k_output"] or 0.0 for g in groups],
            color="tab:blue", tick_label=labels)
    ax1.set_ylabel("machine cost per 1K output tokens (USD)")
    ax1.set_title(_plain(f"cost per 1K output tokens, by {summary['by']}"))
    ax1.tick_params(axis="x", labelsize=8, labelrotation=30 if len(groups) > 6 else 0)
    parts = [("prefill", t["prefill_cost"]), ("decode", t["decode_cost"]),
             ("idle", t["idle_cost"]), ("idle held for priority", t["reserved_idle_cost"])]
    ax2.bar([p for p, _ in parts], [v for _, v in parts], color=["tab:orange", "tab:green",
                                                                 "tab:gray", "tab:red"])
    ax2.set_ylabel("USD")
    ax2.set_title(_plain(f"machine cost ${t['machine_cost']:.4f}, "
                         f"charged ${t['charge']:.4f}"))
    fig.tight_layout()
    return fig


def _plain(text: str) -> str:
    # matplotlib reads text between two unescaped `$` as mathtext (italic math); every
    # label here is plain text, and prices or tag values may carry dollar signs.
    return text.replace("$", r"\$")


def plot(summary: dict, path: str) -> None:
    try:
        fig = figure(summary)
    except ImportError:
        raise TierserveError("--plot needs matplotlib: pip install 'tierserve[plot]'") \
            from None
    fig.savefig(path, format="png", dpi=100)
