// The dashboard's client: polls /dashboard/data and redraws. Charts are uPlot (vendored);
// tables are plain DOM. Each table cell keeps its raw number in data-value so a test can
// compare the page with /metrics without parsing formatted text.
"use strict";

const POLL_MS = 2000;
const TIER_COLOURS = {priority: "#d9472b", default: "#3b7ddd", flex: "#2e9e5b", batch: "#8a6fbf"};
const charts = {};

function colour(tier, i) {
  return TIER_COLOURS[tier] || ["#555", "#c58b00", "#00838f"][i % 3];
}

function panel(name) { return document.querySelector(`[data-panel="${name}"]`); }

function chartSize(el) { return {width: Math.max(300, el.clientWidth - 4), height: 200}; }

// (Re)build a chart when its series change (a tier appears), else just set its data.
function draw(name, series, data, opts = {}) {
  const el = panel(name).querySelector(".chart");
  const key = JSON.stringify(series.map(s => s.label));
  let c = charts[name];
  if (!c || c.key !== key) {
    if (c) c.plot.destroy();
    const plot = new uPlot({
      ...chartSize(el), series: [{}, ...series],
      scales: opts.scales || {x: {time: true}},
      axes: opts.axes || [{}, {size: 60}],
      legend: {live: false},
    }, data, el);
    c = charts[name] = {plot, key};
  } else {
    c.plot.setData(data);
  }
  const has = data.slice(1).some(col => col.some(v => v !== null && v !== undefined));
  panel(name).dataset.ready = has ? "1" : "0";
}

function line(label, stroke, dash) {
  return {label, stroke, width: 1.5, dash: dash ? [6, 4] : undefined, spanGaps: true};
}

function latency(name, s, key) {
  const series = [], data = [s.t];
  s.tiers.forEach((tier, i) => {
    for (const q of ["p50", "p99"]) {
      const col = s[`${key}_${q}`][tier];
      if (!col || col.every(v => v === null)) continue;
      series.push(line(`${tier} ${q}`, colour(tier, i), q === "p99"));
      data.push(col);
    }
  });
  draw(name, series, data);
}

function fmt(v, digits = 2) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
  return Number(v.toPrecision(Math.max(1, digits + 1))).toString();
}

function usd(v) {
  if (v === null || v === undefined) return "–";
  return "$" + (Math.abs(v) < 0.01 ? v.toExponential(2) : v.toFixed(4));
}

function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }

// A table from rows: columns are [header, field, formatter]; `id` names each row.
function table(name, columns, rows, id) {
  const t = panel(name).querySelector("table");
  t.replaceChildren();
  const head = t.insertRow();
  for (const [h] of columns) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  for (const row of rows) {
    const tr = t.insertRow();
    tr.dataset.row = row[id];
    for (const [, field, format] of columns) {
      const td = tr.insertCell();
      const v = row[field];
      td.dataset.field = field;
      if (typeof v === "number") td.dataset.value = String(v);
      const shown = format ? format(v, row) : (v === null || v === undefined ? "–" : String(v));
      if (shown instanceof Node) td.appendChild(shown); else td.textContent = shown;
    }
  }
  if (!rows.length) {
    const td = t.insertRow().insertCell();
    td.colSpan = columns.length; td.className = "empty"; td.textContent = "none yet";
  }
  panel(name).dataset.ready = rows.length ? "1" : "0";
}

function bar(fraction, text) {
  const span = document.createElement("span");
  const b = document.createElement("span"); b.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = (100 * Math.max(0, Math.min(1, fraction || 0))).toFixed(1) + "%";
  b.appendChild(fill); span.appendChild(b);
  span.appendChild(document.createTextNode(text));
  return span;
}

function render(d) {
  const s = d.series;
  document.getElementById("model").textContent = d.model;
  document.getElementById("deployment").textContent = d.deployment + " deployment";
  latency("ttft", s, "ttft");
  latency("itl", s, "itl");
  draw("tokens", [line("prompt tok/s", "#8a6fbf"), line("output tok/s", "#3b7ddd")],
       [s.t, s.prompt_tps, s.output_tps]);
  const qs = [line("running", "#1d2330"), line("waiting", "#999", true)];
  const qd = [s.t, s.running, s.waiting];
  s.tiers.forEach((tier, i) => { qs.push(line(`waiting ${tier}`, colour(tier, i))); qd.push(s.waiting_by_tier[tier]); });
  draw("queue", qs, qd);
  const sizes = Object.keys(s.batch_sizes).map(Number);
  draw("batch", [{label: "steps", stroke: "#3b7ddd", fill: "#3b7ddd88",
                  paths: uPlot.paths.bars({size: [0.8, 40]}), points: {show: false}}],
       [sizes, sizes.map(k => s.batch_sizes[k])],
       {scales: {x: {time: false}}, axes: [{label: "sequences per step"}, {size: 60}]});
  const shares = s.prefill_share.filter(v => v !== null);
  const last = shares.length ? shares[shares.length - 1] : null;
  panel("phase").querySelector(".figure").textContent =
    last === null ? "no finished requests yet" :
    `prefill ${pct(last)}, decode ${pct(1 - last)} of attributed machine time (last 10 s)`;
  draw("phase", [line("prefill share", "#d9472b")], [s.t, s.prefill_share]);
  draw("kv", [line("KV blocks in use", "#2e9e5b")], [s.t, s.kv_usage]);

  table("cost", [["tier", "tier"], ["requests", "requests", v => fmt(v)],
                 ["output tokens", "output_tokens", v => fmt(v)],
                 ["machine cost", "machine_cost_usd", usd], ["charged", "charge_usd", usd],
                 ["cost per 1K output tokens", "cost_per_1k_output_usd", usd],
                 ["SLO met", "slo_attainment", pct]], d.tiers.rows, "tier");
  const idle = panel("cost").querySelector(".figure");
  idle.dataset.value = d.tiers.idle_share === null ? "" : String(d.tiers.idle_share);
  idle.textContent = `idle: ${usd(d.tiers.idle_cost_usd)}, ${pct(d.tiers.idle_share)} of all machine cost`;

  table("tenants", [["tenant", "tenant"], ["spent (all time)", "spent_total_usd", usd],
                    ["spent today", "spent_today_usd", usd], ["held by running requests", "reserved_usd", usd],
                    ["budget", "budget_usd", (v, r) => v === null ? "none" : `${usd(v)} / ${r.budget_period}`],
                    ["budget left", "remaining_usd", (v, r) => v === null ? "–" : bar(v / r.budget_usd, usd(v))]],
        d.tenants, "tenant");
  table("batches", [["batch", "id"], ["tenant", "tenant"], ["status", "status"],
                    ["progress", "completed", (v, r) => bar((r.completed + r.failed) / Math.max(1, r.total),
                                                           `${r.completed + r.failed} / ${r.total}`)],
                    ["failed", "failed"], ["charged", "charge_usd", usd]], d.batches, "id");
  table("units", [["name", "name"], ["model", "model"], ["kind", "kind"],
                  ["health", "healthy", v => { const e = document.createElement("span");
                    e.className = v ? "up" : "down"; e.textContent = v ? "healthy" : "down"; return e; }],
                  ["running", "running", (v, r) => bar(v / Math.max(1, r.max_num_seqs), `${v} / ${r.max_num_seqs}`)],
                  ["waiting", "waiting"], ["KV use", "kv_usage", pct]], d.units, "name");
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/dashboard/data", {credentials: "same-origin", cache: "no-store"});
    if (!r.ok) throw new Error(`${r.status} ${(await r.json()).error?.message || ""}`);
    render(await r.json());
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    status.textContent = "error: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => {
  for (const name in charts) charts[name].plot.setSize(chartSize(panel(name).querySelector(".chart")));
});
poll();
