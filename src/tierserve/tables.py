"""Plain-text tables for the command line (bill, sim, plan, forecast): a leaf, so any
command may print one without importing another's package."""


def table(head, rows) -> list[str]:
    """Left-aligned columns, two spaces apart: the header line, then one line per row."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
            for r in [tuple(head), *rows]]
