"""`tierserve bill --html`: the bill as one self-contained page.

Everything the page shows is in the file: the CSS inline, the plot as inline SVG (its
text drawn as paths, so no font is fetched), no script and no link to anything outside,
so the page opens offline and can be attached to a ticket or a mail as it is. The numbers
are the text bill's (the same summary, each value formatted by the same `fmt_value`).
"""

import html
import io
import time
from datetime import datetime, timezone

from tierserve.db import is_postgres, redact
from tierserve.metering.bill import (columns, figure, fmt_value, load, parse_time, plot,
                                     render, summarize)

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
dl.header { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; }
dl.header dt { color: #666; }
dl.header dd { margin: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .7em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f6f6f6; font-weight: 600; }
th:first-child, td:first-child { text-align: left; }
ul.findings li { margin: .3em 0; }
.note { color: #666; }
figure, .wide { margin: 1em 0; overflow-x: auto; }
figure svg { max-width: 100%; height: auto; }
"""

TOTALS = (("machine_cost", "machine cost"), ("prefill_cost", "prefill"),
          ("decode_cost", "decode"), ("idle_cost", "idle"),
          ("reserved_idle_cost", "idle held for priority"), ("charge", "charged"),
          ("margin", "margin"), ("requests", "requests"), ("output_tokens", "output tokens"))
USD = {"machine_cost", "prefill_cost", "decode_cost", "idle_cost", "reserved_idle_cost",
       "charge", "margin"}


def render_html(summary: dict, rows: list[dict], idle: list[dict], *, ledger,
                since: float | None, until: float | None, now: float) -> str:
    """The page for `summary` (bill.summarize) of the ledger rows `rows` and `idle` read
    in [since, until); `now` is the time the bill was made (shown, not read here)."""
    esc = html.escape
    body = [f"<h1>tierserve bill, by {esc(summary['by'])}</h1>",
            header(summary, rows, idle, ledger=ledger, since=since, until=until, now=now),
            "<h2>Totals</h2>", totals_table(summary["totals"]),
            f"<h2>By {esc(summary['by'])}</h2>", groups_table(summary),
            "<h2>Findings</h2>", findings_list(summary["findings"]),
            "<h2>Plots</h2>", plots(summary)]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>tierserve bill</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def header(summary: dict, rows: list[dict], idle: list[dict], *, ledger, since, until,
           now) -> str:
    where = redact(ledger) if is_postgres(ledger) else str(ledger)
    period = f"{_utc(since) if since is not None else 'the start of the ledger'} to " \
             f"{_utc(until) if until is not None else 'now'}"
    items = [("period", "period", period), ("ledger", "ledger", where),
             ("machine_price", "machine price", machine_price(summary["totals"], rows, idle)),
             ("made", "made", _utc(now))]
    if rows:
        items.insert(1, ("finished", "requests finished", f"from {_utc(rows[0]['time'])} "
                                                          f"to {_utc(rows[-1]['time'])}"))
    return "<dl class=\"header\">\n" + "\n".join(
        f"<dt>{label}</dt><dd data-key=\"{key}\">{html.escape(v)}</dd>"
        for key, label, v in items) + "\n</dl>"


def machine_price(totals: dict, rows: list[dict], idle: list[dict]) -> str:
    """The machine's cost per hour, as the ledger implies it.

    The ledger stores costs, not the price `serve` was given: every second from an
    engine's first step to its shutdown is charged to a request or to idle time, so the
    machine cost over the span the rows cover is about the price per hour (the sum of the
    engines' prices where several served at once)."""
    starts = [r["time"] - (r["e2e_s"] or 0.0) for r in rows] + [i["start"] for i in idle]
    ends = [r["time"] for r in rows] + [i["end"] for i in idle]
    if not starts or max(ends) <= min(starts):
        return "unknown (no time covered)"
    hours = (max(ends) - min(starts)) / 3600
    return (f"about ${totals['machine_cost'] / hours:.4f} per hour (machine cost "
            f"${totals['machine_cost']:.6f} over {hours:.3f} h of ledger time)")


def totals_table(totals: dict) -> str:
    cells = []
    for key, label in TOTALS:
        value = f"${totals[key]:.6f}" if key in USD else str(totals[key])
        cells.append(f"<tr><th>{label}</th><td data-key=\"{key}\">{value}</td></tr>")
    return "<table class=\"totals\">\n" + "\n".join(cells) + "\n</table>"


def groups_table(summary: dict) -> str:
    cols = columns(summary["by"])
    if not summary["groups"]:
        return "<p class=\"note\">No requests in this period.</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(fmt_value(g[c]))}</td>"
                                      for c in cols) + "</tr>" for g in summary["groups"])
    return (f"<div class=\"wide\"><table id=\"groups\" "
            f"data-by=\"{html.escape(summary['by'])}\">\n"
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table></div>")


def findings_list(findings: list[str]) -> str:
    if not findings:
        return "<p class=\"note\">No findings for this period.</p>"
    return "<ul class=\"findings\">\n" + "\n".join(
        f"<li>{html.escape(f)}</li>" for f in findings) + "\n</ul>"


def plots(summary: dict) -> str:
    try:
        fig = figure(summary)
    except ImportError:
        return ("<p class=\"note\" id=\"no-plots\">Plots left out: matplotlib is not "
                "installed (pip install 'tierserve[plot]').</p>")
    return f"<figure>\n{svg(fig)}\n</figure>"


def svg(fig) -> str:
    """The figure as an `<svg>` element to inline in HTML: without the XML declaration
    and DOCTYPE a standalone file has, and with ids that are the same on every run."""
    from matplotlib import rc_context

    buf = io.StringIO()
    # ids are hashes salted with a random value unless a salt is set: same bill, same page
    with rc_context({"svg.hashsalt": "tierserve-bill", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run(args) -> int:
    """`tierserve bill`: the text (or JSON, CSV) bill, and with --plot and --html its
    plot and page. Here, not in bill.py, so that bill.py need not import this module."""
    now = time.time()
    since, until = parse_time(args.since, now), parse_time(args.until, now)
    rows, idle = load(args.ledger, since, until)
    summary = summarize(rows, idle, args.by, getattr(args, "large", None))
    print(render(summary, args.format))
    if args.plot:
        plot(summary, args.plot)
    if args.html:
        page = render_html(summary, rows, idle, ledger=args.ledger, since=since,
                           until=until, now=now)
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
    return 0
