"""What routed requests would have cost on the large model in the fast lane, for
`tierserve bill --by route`.

No such request ran, so the figure is estimated from the ledger itself: the large model's
own priority-tier rows give its machine cost as a linear function of uncached prompt
tokens and output tokens (least squares, coefficients kept non-negative), which is
then applied to each route's requests. Where the large model has too few priority rows
the comparison is left out and the bill says why.
"""

import numpy as np

MIN_ROWS = 5


def fit(rows: list[dict]) -> np.ndarray | None:
    """(per uncached prompt token, per output token, per request) in USD, or None."""
    if len(rows) < MIN_ROWS:
        return None
    x = np.array([[r["prompt_tokens"] - r["cached_tokens"], r["output_tokens"], 1.0]
                  for r in rows])
    y = np.array([r["machine_cost"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if (coef < 0).any():  # refit without the negative terms: a token never saves money
        keep = coef >= 0
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0].clip(min=0)
    return coef


def predict(coef: np.ndarray, r: dict) -> float:
    return float(coef @ [r["prompt_tokens"] - r["cached_tokens"], r["output_tokens"], 1.0])


def most_expensive(rows: list[dict]) -> str | None:
    by_model: dict[str, list] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    costs = {m: sum(r["machine_cost"] for r in rs) / max(1, sum(r["output_tokens"] for r in rs))
             for m, rs in by_model.items()}
    return max(costs, key=costs.get) if costs else None


def compare_routes(summary: dict, groups: dict, rows: list[dict], large: str | None) -> None:
    """Add `if_large_priority` and `saving` to each route's row, and a finding."""
    large = large or most_expensive(rows)
    basis = [r for r in rows if r["model"] == large and r["tier_served"] == "priority"]
    coef = fit(basis)
    for g in summary["groups"]:
        g["if_large_priority"] = g["saving"] = None
        # second attempts of a cascade (billed too, and counted in `requests`)
        g["escalated"] = sum(r["tags"].get("cascade") == "escalation"
                             for r in groups[g["route"]])
        if coef is not None:
            alt = sum(predict(coef, r) for r in groups[g["route"]])
            g["if_large_priority"] = alt
            g["saving"] = 1 - g["machine_cost"] / alt if alt > 0 else None
    if coef is None:
        summary["findings"].append(
            f"No comparison with {large or 'a large model'} in the priority tier: the ledger "
            f"has {len(basis)} such requests, {MIN_ROWS} are needed to estimate its cost.")
        return
    cost = sum(g["machine_cost"] for g in summary["groups"])
    alt = sum(g["if_large_priority"] for g in summary["groups"])
    summary["large"] = {"model": large, "basis_requests": len(basis), "if_large_priority": alt}
    summary["findings"].append(
        f"These requests cost ${cost:.6f} of machine time as routed; on {large} in the "
        f"priority tier they would have cost about ${alt:.6f} (estimated from its "
        f"{len(basis)} priority requests in this ledger): {1 - cost / alt:.0%} less.")
