// kvproxy dashboard: polls /kvproxy/dashboard/data and draws SVG charts.
// No dependencies and no build step. Everything from the server is inserted as
// text (never as HTML).
"use strict";

const DATA_URL = "/kvproxy/dashboard/data";
const SVG_NS = "http://www.w3.org/2000/svg";
const WIDTH = 600;
const HEIGHT = 190;
const PAD = { left: 52, right: 12, top: 10, bottom: 22 };
const MIN_SPAN_S = 60;
const PALETTE = ["#2563eb", "#dc6b19", "#16a34a", "#9333ea", "#db2777", "#0891b2",
                 "#ca8a04", "#64748b", "#b91c1c", "#4f46e5"];

// Each chart: the series it plots (a path into a sample), the feature it depends
// on, and reference lines computed from the latest data document.
const CHARTS = [
  {
    id: "queue", feature: "admission", title: "Admission queue", unit: "requests", unitLabel: "requests",
    series: [
      { key: "gauges.waiting_new", label: "new sessions waiting" },
      { key: "gauges.waiting_continuing", label: "continuing turns waiting" },
    ],
  },
  {
    id: "wait", feature: "admission", title: "Wait time", unit: "s", unitLabel: "seconds",
    series: [
      { key: "gauges.oldest_wait_s", label: "oldest waiter" },
      { key: "rates.wait_mean_s", label: "mean wait of admitted" },
    ],
    refs: (doc) => [{ value: doc.config.admission.max_wait_s, label: "max_wait_s" }],
  },
  {
    id: "budget", feature: "admission", title: "KV budget", unit: "tokens", unitLabel: "tokens",
    series: [
      { key: "gauges.committed", label: "committed" },
      { key: "gauges.reserved", label: "reserved (in flight)" },
      { key: "gauges.resident", label: "resident (between turns)" },
    ],
    refs: (doc) => doc.health.admission.ceiling > 0
      ? [{ value: doc.health.admission.ceiling, label: "ceiling" }] : [],
  },
  {
    id: "engines", feature: "admission", title: "Engine KV token usage", unit: "fraction",
    unitLabel: "% of KV pool", enginesChart: true,
    refs: (doc) => [{ value: doc.config.admission.pressure_threshold, label: "pressure_threshold" }],
  },
  {
    id: "decisions", feature: "admission", title: "Admission decisions", unit: "per s",
    unitLabel: "requests / s",
    series: [
      { key: "rates.admit", label: "admit" },
      { key: "rates.wait", label: "wait" },
      { key: "rates.bypass_aged", label: "bypass: aged" },
      { key: "rates.bypass_degraded", label: "bypass: degraded" },
      { key: "rates.bypass_oversized", label: "bypass: oversized" },
      { key: "rates.bypass_queue_full", label: "bypass: queue full" },
      { key: "rates.bypass_protected", label: "bypass: protected" },
      { key: "rates.bypass_disabled", label: "bypass: disabled" },
      { key: "rates.cancelled", label: "cancelled" },
    ],
  },
  {
    id: "sessions", feature: "session_lifecycle", title: "Sessions", unit: "sessions", unitLabel: "sessions",
    series: [
      { key: "gauges.sessions_open", label: "open" },
      { key: "gauges.sessions_closing", label: "closing" },
    ],
  },
  {
    id: "closes", feature: "session_lifecycle", title: "Session closes", unit: "per s",
    unitLabel: "events / s",
    series: [
      { key: "rates.sessions_started", label: "started" },
      { key: "rates.sessions_closed", label: "closed" },
      { key: "rates.close_failures", label: "close failures" },
      { key: "rates.aborted_requests", label: "requests aborted" },
    ],
  },
  {
    id: "traffic", title: "Proxy traffic", unit: "per s", unitLabel: "requests / s",
    series: [
      { key: "rates.requests", label: "requests answered" },
      { key: "rates.upstream_errors", label: "upstream errors" },
      { key: "rates.scrape_failures", label: "engine /metrics failures" },
    ],
  },
];

const state = { samples: [], lastSeq: 0, timeline: null, doc: null, failures: 0 };

// ----------------------------------------------------------------- helpers
function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    // Styles go through the CSSOM: the page's CSP forbids style attributes.
    if (k === "style") Object.assign(node.style, v);
    else node.setAttribute(k, String(v));
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

function pick(sample, path) {
  let v = sample;
  for (const part of path.split(".")) v = v == null ? undefined : v[part];
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function fmt(v, unit) {
  if (v === null || v === undefined) return "–";
  if (unit === "fraction") return `${(v * 100).toFixed(1)}%`;
  if (unit === "per s") return `${fmt(v)}/s`;
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toFixed(2)}M`;
  if (a >= 1e4) return `${(v / 1e3).toFixed(1)}k`;
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

// Text baselines in the plot: a new label moves down until it clears the others.
const LABEL_H = 12;
function placeLabel(taken, want) {
  let yPos = Math.max(PAD.top + LABEL_H - 2, want);
  for (let i = 0; i < 20 && taken.some((t) => Math.abs(t - yPos) < LABEL_H); i += 1) yPos += LABEL_H;
  taken.push(yPos);
  return yPos;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// ------------------------------------------------------------------- charts
function buildCharts() {
  const main = document.getElementById("charts");
  for (const chart of CHARTS) {
    chart.svg = el("svg:svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", "aria-label": chart.title });
    chart.legend = el("div", { class: "legend" });
    chart.note = el("span", { class: "note" });
    chart.at = el("span", { class: "at" });
    const unit = el("span", { class: "unit" }, chart.unitLabel);
    chart.figure = el("figure", { class: "chart", "data-chart": chart.id, "data-points": 0 },
      el("figcaption", {}, chart.title, unit, chart.note, chart.at), chart.svg, chart.legend);
    main.append(chart.figure);
    // Hovering reads the values at one moment; leaving shows the latest again.
    chart.svg.addEventListener("mousemove", (event) => {
      if (!chart.timeAt || !state.doc) return;
      const box = chart.svg.getBoundingClientRect();
      chart.hoverT = chart.timeAt(((event.clientX - box.left) * (chart.width || WIDTH)) / box.width);
      drawChart(chart, state.doc);
    });
    chart.svg.addEventListener("mouseleave", () => {
      chart.hoverT = null;
      if (state.doc) drawChart(chart, state.doc);
    });
  }
}

function nearestSample(t) {
  const samples = state.samples;
  let lo = 0;
  let hi = samples.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (samples[mid].t < t) lo = mid + 1; else hi = mid;
  }
  if (lo > 0 && t - samples[lo - 1].t < samples[lo].t - t) lo -= 1;
  return samples[lo] || null;
}

function chartSeries(chart) {
  if (!chart.enginesChart) return chart.series;
  const urls = new Set();
  for (const s of state.samples) for (const url of Object.keys(s.engines || {})) urls.add(url);
  return [...urls].sort().map((url) => ({ key: url, label: url, engine: true }));
}

function valueOf(sample, series) {
  if (!series.engine) return pick(sample, series.key);
  const v = (sample.engines || {})[series.key];
  return typeof v === "number" ? v : null;
}

function drawChart(chart, doc) {
  const samples = state.samples;
  const series = chartSeries(chart);
  const refs = chart.refs ? chart.refs(doc).filter((r) => typeof r.value === "number") : [];
  const svg = chart.svg;
  // A chart stretched over several grid cells (fillGrid) is wider, not taller.
  const W = chart.width || WIDTH;
  svg.replaceChildren();
  chart.legend.replaceChildren();
  chart.figure.setAttribute("data-points", String(samples.length));

  const tEnd = samples.length ? samples[samples.length - 1].t : 0;
  const span = Math.max(MIN_SPAN_S, samples.length ? tEnd - samples[0].t : 0);
  let dataMax = 0;
  for (const s of series) for (const p of samples) dataMax = Math.max(dataMax, valueOf(p, s) ?? 0);
  // A reference line far above the data would flatten it: such a line is only named.
  const onScale = (r) => chart.unit === "fraction" || dataMax === 0 || r.value <= 4 * dataMax;
  let yMax = dataMax;
  for (const r of refs) if (onScale(r)) yMax = Math.max(yMax, r.value);
  yMax = chart.unit === "fraction" ? Math.max(1, yMax) : niceMax(yMax * 1.05);

  const plotW = W - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + plotW * (1 - (tEnd - t) / span);
  const y = (v) => PAD.top + plotH * (1 - v / yMax);
  chart.timeAt = (px) => tEnd - span * (1 - (px - PAD.left) / plotW);

  for (const frac of [0, 0.5, 1]) {
    const v = yMax * frac;
    svg.append(el("svg:line", { class: "axis", x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v) }));
    svg.append(el("svg:text", { class: "tick", x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" },
      fmt(v, chart.unit)));
  }
  const minutes = Math.round(span / 60);
  svg.append(el("svg:text", { class: "tick", x: PAD.left, y: HEIGHT - 6 },
    minutes >= 1 ? `−${minutes} min` : `−${Math.round(span)} s`));
  svg.append(el("svg:text", { class: "tick", x: W - PAD.right, y: HEIGHT - 6, "text-anchor": "end" }, "now"));

  const labelYs = [];
  for (const r of refs) {
    const label = `${r.label} ${fmt(r.value, chart.unit)}`;
    if (!onScale(r)) {
      svg.append(el("svg:text", { class: "ref-label", x: W - PAD.right - 4,
        y: placeLabel(labelYs, PAD.top + 10), "text-anchor": "end" }, `${label} (above)`));
      continue;
    }
    svg.append(el("svg:line", { class: "ref", x1: PAD.left, x2: W - PAD.right, y1: y(r.value), y2: y(r.value) }));
    // Above its line, or below it when the line is at the top of the plot.
    const want = y(r.value) - 4 < PAD.top + LABEL_H ? y(r.value) + LABEL_H : y(r.value) - 4;
    svg.append(el("svg:text", { class: "ref-label", x: W - PAD.right - 4,
      y: placeLabel(labelYs, want), "text-anchor": "end" }, label));
  }

  if (!samples.length) {
    svg.append(el("svg:text", { class: "empty", x: W / 2, y: HEIGHT / 2, "text-anchor": "middle" }, "waiting for data"));
  }
  const hovered = chart.hoverT != null && samples.length ? nearestSample(chart.hoverT) : null;
  const shown = hovered || samples[samples.length - 1] || null;
  if (hovered) {
    svg.append(el("svg:line", { class: "cursor", x1: x(hovered.t), x2: x(hovered.t), y1: PAD.top, y2: HEIGHT - PAD.bottom }));
  }
  chart.at.textContent = hovered ? `at ${new Date(hovered.t * 1000).toLocaleTimeString()}` : "";
  series.forEach((s, i) => {
    const color = PALETTE[i % PALETTE.length];
    let d = "";
    let pen = "M";
    let drawn = 0;
    for (const p of samples) {
      const v = valueOf(p, s);
      if (v === null) { pen = "M"; continue; }
      d += `${pen}${x(p.t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = "L";
      drawn += 1;
    }
    if (d) {
      svg.append(el("svg:path", { class: "line", d, stroke: color, "data-series": s.key, "data-points": drawn }));
    }
    // data-value is always the latest value; the text follows the hovered moment.
    const latest = samples.length ? valueOf(samples[samples.length - 1], s) : null;
    chart.legend.append(el("span", { "data-series": s.key, "data-value": latest ?? "" },
      el("span", { class: "swatch", style: { background: color } }), s.label,
      el("span", { class: "value" }, fmt(shown ? valueOf(shown, s) : null, chart.unit))));
  });
  chart.note.textContent = chartNote(chart, series, doc);
}

function chartNote(chart, series, doc) {
  if (chart.feature && !doc.health.features[chart.feature]) {
    return `(${chart.feature.replace("_", " ")} is off)`;
  }
  if (chart.enginesChart && !series.length) return "(no engine metrics yet)";
  return "";
}

// --------------------------------------------------------------- the panels
function renderHeader(doc) {
  const h = doc.health;
  const status = document.getElementById("status");
  status.textContent = h.status.replace("_", " ");
  status.className = `pill ${h.status === "ok" ? "ok" : "error"}`;
  const features = document.getElementById("features");
  features.replaceChildren(
    ...[["session lifecycle", h.features.session_lifecycle], ["admission", h.features.admission]].map(
      ([name, on]) => el("span", { class: `feature ${on ? "on" : "off"}`, "data-feature": name },
        `${name}: ${on ? "on" : "off"}`)));
  document.getElementById("updated").textContent =
    `v${doc.version} · updated ${new Date().toLocaleTimeString()}`;
}

function renderBanners(doc) {
  const box = document.getElementById("banners");
  box.replaceChildren(...doc.banners.map((b) =>
    el("div", { class: `banner ${b.level}`, "data-banner-id": b.id, role: "alert" }, b.text)));
}

function tile(label, value, sub, id) {
  return el("div", { class: "tile", "data-tile": id },
    el("div", { class: "label" }, label), el("div", { class: "value" }, value),
    sub ? el("div", { class: "sub" }, sub) : null);
}

function renderTiles(doc) {
  const last = state.samples[state.samples.length - 1] || { gauges: {}, rates: {}, engines: {} };
  const a = doc.health.admission;
  const usages = (a.engines || []).filter((e) => e.fresh && typeof e.token_usage === "number")
    .map((e) => e.token_usage);
  const hottest = usages.length ? Math.max(...usages) : null;
  const sessions = doc.health.sessions;
  // No tile is left blank: a value that is not there says why.
  const admissionOff = !a.enabled ? "admission is off" : null;
  const lifecycleOff = !sessions.enabled ? "session lifecycle is off" : null;
  document.getElementById("tiles").replaceChildren(
    tile("Requests / s", fmt(pick(last, "rates.requests")), "answered by kvproxy", "requests"),
    tile("Waiting", admissionOff ? "off" : fmt(a.waiting),
      admissionOff || `oldest ${fmt(pick(last, "gauges.oldest_wait_s"))} s`, "waiting"),
    tile("Budget committed", admissionOff ? "off" : a.ceiling > 0 ? fmt(a.committed / a.ceiling, "fraction") : "no ceiling",
      admissionOff || (a.ceiling > 0 ? `${fmt(a.committed)} of ${fmt(a.ceiling)} tokens` : "no engine has fresh metrics"),
      "budget"),
    tile("Hottest engine KV", admissionOff ? "not read" : hottest === null ? "no reading" : fmt(hottest, "fraction"),
      admissionOff || `threshold ${fmt(doc.config.admission.pressure_threshold, "fraction")}`, "hottest"),
    tile("Sessions open", lifecycleOff ? "off" : fmt(sessions.open ?? null),
      lifecycleOff || `${fmt(sessions.closing ?? null)} closing`, "sessions"),
    tile("Close failures / s", lifecycleOff ? "off" : fmt(pick(last, "rates.close_failures")),
      lifecycleOff || "engines that refused /close_session", "close-failures"),
    tile("Engines healthy", `${doc.health.engines_healthy} / ${doc.health.engines_known}`,
      a.enabled ? `${a.engines_fresh} fresh, ${a.engines_stale} stale metrics` : "in the router", "engines"),
  );
}

function flag(text, kind) { return el("span", { class: `flag ${kind}` }, text); }

function meter(usage, threshold, missing = "no reading") {
  if (typeof usage !== "number") return flag(missing, "none");
  const pct = Math.max(0, Math.min(1, usage)) * 100;
  return el("span", {},
    el("span", { class: "meter" },
      el("span", { class: `fill${usage >= threshold ? " hot" : ""}`, style: { width: `${pct.toFixed(1)}%` } }),
      el("span", { class: "threshold", style: { left: `${(threshold * 100).toFixed(1)}%` } })),
    fmt(usage, "fraction"));
}

function renderEngines(doc) {
  const h = doc.health;
  const threshold = doc.config.admission.pressure_threshold;
  const byUrl = new Map();
  const row = (url) => {
    if (!byUrl.has(url)) byUrl.set(url, { url });
    return byUrl.get(url);
  };
  for (const url of h.fleet.engines.healthy) row(url).router = "healthy";
  for (const url of h.fleet.engines.unhealthy) row(url).router = "unhealthy";
  for (const e of h.admission.engines || []) Object.assign(row(e.url), { ledger: e });
  for (const [url, info] of Object.entries(h.sessions.engines || {})) row(url).mode = info.mode;

  const rows = [...byUrl.values()].sort((p, q) => p.url.localeCompare(q.url)).map((r) => {
    const e = r.ledger;
    const metrics = !h.features.admission ? flag("not read", "none")
      : !e ? flag("none yet", "none") : e.fresh ? flag("fresh", "ok") : flag("stale", "bad");
    // Cells never stay blank: what is not known says why.
    const unread = !h.features.admission ? "admission off" : "no reading";
    const mode = r.mode || (h.features.session_lifecycle ? "unchecked" : "lifecycle off");
    return el("tr", { "data-engine": r.url },
      el("td", {}, el("code", {}, r.url)),
      el("td", {}, r.router ? flag(r.router, r.router === "healthy" ? "ok" : "bad") : flag("static", "none")),
      el("td", {}, metrics),
      el("td", {}, meter(e ? e.token_usage : null, threshold, unread)),
      el("td", { class: "num" }, e && typeof e.max_total_num_tokens === "number"
        ? fmt(e.max_total_num_tokens) : flag(unread, "none")),
      el("td", { class: "num" }, e && e.age_s !== null ? `${e.age_s.toFixed(1)} s` : flag(unread, "none")),
      el("td", {}, mode));
  });
  document.querySelector("#engines tbody").replaceChildren(...rows);
  document.getElementById("engines-note").textContent = rows.length ? ""
    : "No engines known yet: kvproxy reads them from the router's /workers.";
}

function renderProgram(doc) {
  const a = doc.health.admission || {};
  const rows = (a.program_engines || []).map((e) => {
    const usage = e.capacity > 0 ? e.footprint / e.capacity : null;
    return el("tr", { "data-engine": e.url },
      el("td", {}, el("code", {}, e.url)),
      el("td", {}, meter(usage, doc.config.admission.pause_high || 0.95)),
      el("td", { class: "num" }, fmt(e.committed)),
      el("td", { class: "num" }, fmt(e.target, "fraction")),
      el("td", { class: "num" }, fmt(e.active_sessions)),
      el("td", { class: "num" }, fmt(e.paused_sessions)),
      el("td", { class: "num" }, fmt(e.waiting_new)),
      el("td", { class: "num" }, fmt(e.waiting_paused)));
  });
  document.querySelector("#program tbody").replaceChildren(...rows);
  let note = "";
  if (!doc.health.features.admission) note = "(admission is off)";
  else if (a.fallback) note = `Fleet-wide accounting: ${a.fallback}`;
  else if (a.held) note = `Oldest waiter held: ${a.held.reason} on ${a.held.engine} for ${a.held.wait_s.toFixed(1)} s`;
  else if (!rows.length) note = "No sessions attributed yet.";
  document.getElementById("program-note").textContent = note;
}

function sessionLine(row) {
  const busy = row.in_flight ? `${row.in_flight} in flight` : `idle ${fmt(row.idle_s)} s`;
  return el("span", {}, el("code", {}, row.session_id), ` ${row.state}, ${busy}`);
}

function renderSessionTree(doc) {
  const tree = doc.session_tree || [];
  const items = tree.map((lead) => {
    const kids = (lead.child_rows || []).map((c) => el("li", { "data-session": c.session_id }, sessionLine(c)));
    const more = (lead.children_count || 0) > kids.length
      ? [el("li", { class: "muted" }, `${lead.children_count - kids.length} more (see /kvproxy/sessions)`)] : [];
    return el("li", { "data-session": lead.session_id },
      lead.state === "closed" ? el("span", {}, el("code", {}, lead.session_id), " (closed)") : sessionLine(lead),
      el("ul", {}, ...kids, ...more));
  });
  document.getElementById("session-tree").replaceChildren(...items);
  document.getElementById("session-tree-note").textContent = items.length ? ""
    : (doc.health.features.session_lifecycle === false ? "(session lifecycle is off)"
      : "No session names a parent yet (docs/sessions.md, \"Parent sessions\").");
}

function renderConfig(doc) {
  const c = doc.config;
  const lc = c.session_lifecycle;
  const ad = c.admission;
  document.getElementById("config-summary").replaceChildren(
    tile("Session lifecycle", lc.enabled ? "on" : "off",
      lc.enabled ? `on_close ${lc.on_close}${lc.sticky_routing ? ", sticky" : ""}` : "session_lifecycle.enabled",
      "cfg-lifecycle"),
    tile("Admission", ad.enabled ? "on" : "off",
      ad.enabled ? `mode ${ad.mode}, scope ${ad.scope}${ad.mode === "program" && ad.session_residency ? ", session residency" : ""}` : "admission.enabled",
      "cfg-admission"),
    tile("Headroom", fmt(ad.headroom, "fraction"), "of the fleet's KV pool", "cfg-headroom"),
    tile("Pressure threshold", fmt(ad.pressure_threshold, "fraction"), "per engine", "cfg-pressure"),
    tile("Max wait", `${fmt(ad.max_wait_s)} s`, `queue bound ${fmt(ad.max_queue)}`, "cfg-max-wait"),
  );
  const rows = [];
  for (const section of ["server", "router", "session_lifecycle", "admission"]) {
    for (const [key, value] of Object.entries(c[section])) {
      rows.push(el("tr", {}, el("td", {}, `${section}.${key}`), el("td", {}, JSON.stringify(value))));
    }
  }
  rows.push(el("tr", {}, el("td", {}, "source"), el("td", {}, c.source || "(defaults and flags)")));
  document.querySelector("#config tbody").replaceChildren(...rows);
}

function render(doc) {
  renderHeader(doc);
  renderBanners(doc);
  renderTiles(doc);
  for (const chart of CHARTS) drawChart(chart, doc);
  renderEngines(doc);
  renderProgram(doc);
  renderSessionTree(doc);
  renderConfig(doc);
  document.body.dataset.lastSeq = String(state.lastSeq);
}

// ------------------------------------------------------------------ polling
async function poll() {
  try {
    const response = await fetch(`${DATA_URL}?since=${state.lastSeq}`, { cache: "no-store" });
    if (response.status === 401) { window.location.reload(); return; }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const doc = await response.json();
    if (doc.timeline !== state.timeline) {
      // A new kvproxy process: its samples are numbered afresh. Start over.
      const first = state.timeline === null;
      Object.assign(state, { samples: [], lastSeq: 0, timeline: doc.timeline });
      if (!first) { setTimeout(poll, 0); return; }
    }
    state.samples.push(...doc.samples);
    if (state.samples.length > doc.history) state.samples.splice(0, state.samples.length - doc.history);
    state.lastSeq = doc.last_seq;
    state.doc = doc;
    state.failures = 0;
    render(doc);
    setTimeout(poll, doc.tick_s * 1000);
  } catch (err) {
    state.failures += 1;
    const status = document.getElementById("status");
    status.textContent = "kvproxy unreachable";
    status.className = "pill error";
    document.getElementById("updated").textContent = `retrying (${err.message})`;
    setTimeout(poll, Math.min(10, state.failures) * 1000);
  }
}

// The last chart stretches over the cells its row would leave empty.
function fillGrid() {
  const main = document.getElementById("charts");
  const columns = getComputedStyle(main).gridTemplateColumns.split(" ").filter(Boolean).length || 1;
  const left = CHARTS.length % columns;
  CHARTS.forEach((chart, i) => {
    const wide = left && i === CHARTS.length - 1;
    chart.figure.style.gridColumn = wide ? `span ${columns - left + 1}` : "";
    const ratio = wide ? chart.figure.clientWidth / Math.max(1, CHARTS[0].figure.clientWidth) : 1;
    chart.width = Math.round(WIDTH * ratio);
    chart.svg.setAttribute("viewBox", `0 0 ${chart.width} ${HEIGHT}`);
    if (state.doc) drawChart(chart, state.doc);
  });
}

buildCharts();
fillGrid();
window.addEventListener("resize", fillGrid);
poll();
