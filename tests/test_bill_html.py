"""`tierserve bill --html` and `--plot`: the page read back with html.parser, on ledgers
with real rows (SQLite and PostgreSQL); the figure inspected without drawing a PNG."""

import json
import re
import sys
from html.parser import HTMLParser

import pytest
from matplotlib import cbook
from pg import dialect, pg_database, pg_server  # noqa: F401 (fixtures)
from test_bill import make_row

from tierserve.cli import main
from tierserve.metering import bill
from tierserve.metering.ledger import Ledger

TENANTS = ("acme", "$bob", "cyd & co")  # a dollar sign and an ampersand to escape


class Page(HTMLParser):
    """What the tests look at: values marked `data-key`, the groups table, the findings,
    every attribute (for links out) and the tags used."""

    def __init__(self, text: str):
        super().__init__()
        self.keyed, self.head, self.rows, self.findings = {}, [], [], []
        self.attrs, self.tags = [], set()
        self._key = self._in = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        self.attrs += attrs
        if tag == "table" and a.get("id") == "groups":
            self._in = "groups"
        elif tag == "ul" and a.get("class") == "findings":
            self._in = "findings"
        elif tag == "tr" and self._in == "groups":
            self.rows.append([])
        self._key = a.get("data-key")
        self._cell = tag if tag in ("th", "td", "li") else None

    def handle_endtag(self, tag):
        if tag in ("table", "ul"):
            self._in = None
        self._key = self._cell = None

    def handle_data(self, data):
        if self._key:
            self.keyed[self._key] = self.keyed.get(self._key, "") + data
        if self._in == "groups" and self._cell in ("th", "td"):
            self.rows[-1].append(data)
        if self._in == "findings" and self._cell == "li":
            self.findings.append(data)


@pytest.fixture
def target(dialect, tmp_path, request):  # noqa: F811
    """The ledger: a SQLite file, or a fresh PostgreSQL database, with 30 requests of
    three tenants in two tiers and an idle interval partly held for priority."""
    where = str(tmp_path / "l.db") if dialect == "sqlite" else \
        request.getfixturevalue("pg_database")
    ledger = Ledger(where)
    for i in range(30):
        tier, out, cost = ("priority", 30, 0.031) if i % 3 == 0 else ("default", 970, 0.069)
        ledger.record(make_row(i, tier, out, cost, tenant=TENANTS[i % 3]))
    ledger.record_idle(1_800_000_000.0, 1_800_000_060.0, "m", 0.05, 0.02)
    ledger.close()
    return where


def bill_page(target, tmp_path, capsys, *args) -> tuple[Page, str]:
    out = tmp_path / "bill.html"
    assert main(["bill", "--ledger", target, "--html", str(out), *args]) == 0
    return Page(out.read_text(encoding="utf-8")), capsys.readouterr().out


def test_the_page_shows_the_text_bill(target, tmp_path, capsys):
    page, text = bill_page(target, tmp_path, capsys, "--by", "tenant")
    assert main(["bill", "--ledger", target, "--by", "tenant", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key, value in summary["totals"].items():
        shown = page.keyed[key]
        assert float(shown.lstrip("$")) == pytest.approx(value, abs=1e-6)
        if shown.startswith("$"):  # the text bill prints the same figure
            assert shown in text
    assert summary["totals"]["requests"] == 30
    # the table: the text bill's header and rows, cell for cell
    table = text.split("\n\n")[1].splitlines()
    assert page.rows[0] == table[0].split()
    assert page.rows[1:] == [[g["tenant"]] + line.split()[-10:]  # a tenant has spaces
                             for g, line in zip(summary["groups"], table[1:])]
    assert page.findings == summary["findings"] and page.findings
    assert "priority requests" in page.findings[0]
    assert page.keyed["ledger"] == target
    assert page.keyed["machine_price"].startswith("about $")
    # one self-contained page: nothing fetched, no script, the plot inline
    assert "svg" in page.tags and "script" not in page.tags and "link" not in page.tags
    assert not [v for k, v in page.attrs if k in ("src", "href", "xlink:href")
                and v and re.match(r"\s*(https?:)?//", v)]


@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
@pytest.mark.parametrize("by,keys", [
    ("tenant", sorted(TENANTS)), ("tier", ["default", "priority"]), ("model", ["m"]),
    ("size", ["<64 out", ">=256 out"]), ("tag:app", ["a0", "a1"])])
def test_every_by_is_the_pages_grouping(target, tmp_path, capsys, by, keys):
    page, _ = bill_page(target, tmp_path, capsys, "--by", by)
    assert page.rows[0][0] == by
    assert [r[0] for r in page.rows[1:]] == keys
    assert sum(int(r[1]) for r in page.rows[1:]) == 30


@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_without_matplotlib_the_page_says_so_and_plot_fails_in_one_line(
        target, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    page, _ = bill_page(target, tmp_path, capsys)
    assert "svg" not in page.tags and page.keyed["machine_cost"]
    assert main(["bill", "--ledger", target, "--plot", str(tmp_path / "b.png")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
def test_plot_titles_are_plain_text_not_mathtext(target, tmp_path, capsys, monkeypatch):
    figures, draw = [], bill.figure

    def keep(summary):
        figures.append(draw(summary))
        return figures[-1]
    monkeypatch.setattr(bill, "figure", keep)
    assert main(["bill", "--ledger", target, "--by", "tenant",
                 "--plot", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    texts = [ax.title for ax in fig.axes] + [t for ax in fig.axes
                                             for t in ax.get_xticklabels()]
    for t in texts:  # two unescaped `$` would make matplotlib set the text as math
        assert not cbook.is_math_text(t.get_text()), t.get_text()
    shown = [t.get_text().replace(r"\$", "$") for t in texts]  # what matplotlib draws
    assert any(re.fullmatch(r"machine cost \$\d+\.\d{4}, charged \$\d+\.\d{4}", s)
               for s in shown)
    assert "$bob" in shown


@pytest.mark.parametrize("dialect", ["sqlite"], indirect=True)
@pytest.mark.parametrize("by", ["tenant", "size"])
def test_plot_draws_the_by_grouping(target, capsys, by):
    assert main(["bill", "--ledger", target, "--by", by, "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    fig = bill.figure(summary)
    ax = fig.axes[0]
    labels = [t.get_text().replace(r"\$", "$") for t in ax.get_xticklabels()]
    assert labels == [g[by] for g in summary["groups"]]
    assert [p.get_height() for p in ax.patches] == pytest.approx(
        [g["cost_per_1k_output"] for g in summary["groups"]])
    assert ax.get_title().endswith(f"by {by}")

