// The AstraFlow page: polls /astraflow/api/status.json and metrics.json every 2 s and renders
// tables and inline-SVG charts. Plain JavaScript, nothing loaded from the network.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

const $ = (id) => document.getElementById(id);
const fmt = (x, d = 2) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(0) + "%");

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function duration(s) {
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function row(cells, attrs = {}) {
  const tr = el("tr", attrs);
  for (const c of cells) {
    if (c instanceof Node) { const td = el("td"); td.appendChild(c); tr.appendChild(td); }
    else if (Array.isArray(c)) tr.appendChild(el("td", c[1], c[0]));
    else tr.appendChild(el("td", {}, c));
  }
  return tr;
}

// ---------------------------------------------------------------- charts (inline SVG)
const W = 320, H = 170, PAD = { l: 42, r: 10, t: 8, b: 26 };

function niceRange(vals, fixed) {
  if (fixed) return fixed;
  let lo = Math.min(...vals), hi = Math.max(...vals);
  if (!Number.isFinite(lo)) return [0, 1];
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

function axes(svg, [x0, x1], [y0, y1], xlabel) {
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0 || 1)) * (W - PAD.l - PAD.r);
  const sy = (y) => H - PAD.b - ((y - y0) / (y1 - y0 || 1)) * (H - PAD.t - PAD.b);
  svg.appendChild(svgEl("rect", { x: PAD.l, y: PAD.t, width: W - PAD.l - PAD.r, height: H - PAD.t - PAD.b, fill: "#fcfcfc", stroke: "#ddd" }));
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg.appendChild(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: sy(y), y2: sy(y), stroke: "#eee" }));
    svg.appendChild(svgEl("text", { x: PAD.l - 4, y: sy(y) + 3, "text-anchor": "end" }, +y.toPrecision(3)));
  }
  for (let i = 0; i <= 4; i++) {
    const x = x0 + ((x1 - x0) * i) / 4;
    svg.appendChild(svgEl("text", { x: sx(x), y: H - PAD.b + 12, "text-anchor": "middle" }, +x.toPrecision(3)));
  }
  svg.appendChild(svgEl("text", { x: (PAD.l + W - PAD.r) / 2, y: H - 2, "text-anchor": "middle" }, xlabel));
  return [sx, sy];
}

// series: [{name, xs, ys}]; points with y === null are skipped
function lineChart(id, title, xlabel, series, yfixed) {
  const box = el("div", { class: "chart", id });
  box.appendChild(el("h3", {}, title));
  const svg = svgEl("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const pts = series.map((s) => s.xs.map((x, i) => [x, s.ys[i]]).filter(([, y]) => y !== null && y !== undefined));
  const all = pts.flat();
  if (!all.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  } else {
    const [sx, sy] = axes(svg, niceRange(all.map((p) => p[0])), niceRange(all.map((p) => p[1]), yfixed), xlabel);
    pts.forEach((p, k) => {
      const color = COLORS[k % COLORS.length];
      svg.appendChild(svgEl("polyline", { points: p.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "), fill: "none", stroke: color, "stroke-width": 1.8 }));
      if (p.length <= 60) for (const [x, y] of p) svg.appendChild(svgEl("circle", { cx: sx(x), cy: sy(y), r: 2.5, fill: color }));
    });
  }
  box.appendChild(svg);
  return box;
}

function barChart(id, title, xlabel, hist) {
  const box = el("div", { class: "chart", id });
  box.appendChild(el("h3", {}, title));
  const svg = svgEl("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const keys = Object.keys(hist).map(Number).sort((a, b) => a - b);
  if (!keys.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  } else {
    const lo = Math.min(0, ...keys), hi = Math.max(...keys);
    const ymax = Math.max(...Object.values(hist));
    const [sx, sy] = axes(svg, [lo - 0.5, hi + 0.5], [0, ymax * 1.1], xlabel);
    const bw = (sx(1) - sx(0)) * 0.8;
    for (const k of keys) {
      const v = hist[String(k)];
      svg.appendChild(svgEl("rect", { x: sx(k) - bw / 2, y: sy(v), width: bw, height: sy(0) - sy(v), fill: COLORS[0] }));
      svg.appendChild(svgEl("text", { x: sx(k), y: sy(v) - 2, "text-anchor": "middle" }, v));
    }
  }
  box.appendChild(svg);
  return box;
}

// ---------------------------------------------------------------- rendering
function renderStatus(st) {
  $("run-dir").textContent = st.run_dir;
  const badge = $("run-state");
  const state = st.running ? "running" : st.finished ? "finished" : "stopped";
  badge.textContent = state;
  badge.className = "badge " + state;
  $("elapsed").textContent = duration(st.elapsed_s);
  $("traj-s").textContent = fmt(st.trajectories_per_s, 1);
  $("tok-s").textContent = fmt(st.tokens_per_s, 0);

  const pb = $("policies").tBodies[0];
  pb.replaceChildren(...st.policies.map((p) => row([
    p.name,
    [`${p.step}${p.max_steps !== null ? " / " + p.max_steps : ""}`, { id: `policy-${p.name}-step`, "data-value": p.step }],
    [fmt(p.reward_mean, 3), { id: `policy-${p.name}-reward` }],
    [p.eval_accuracy === null ? "–" : `${fmt(p.eval_accuracy, 3)} (v${p.eval_step})`, { id: `policy-${p.name}-accuracy` }],
    [pct(p.wait_fraction), { id: `policy-${p.name}-wait` }],
    p.buffer, p.accepted, p.filtered, p.stale_dropped, p.replayed,
    [p.consumed, { id: `policy-${p.name}-consumed`, "data-value": p.consumed }],
  ])));

  const nb = $("nodes").tBodies[0];
  const rows = [];
  for (const part of st.partitions) {
    const tr = el("tr", { class: "partition" });
    tr.appendChild(el("td", { colspan: 12 },
      `${part.name} — ${part.scheduler}, role ${part.role}, ${part.hardware} in ${part.region}: ${part.live} live of ${part.desired} desired`));
    rows.push(tr);
    for (const n of part.nodes) {
      const versions = Object.entries(n.versions).map(([p, v]) => `${p}:v${v}`).join(" ") || "–";
      const isRollout = n.role === "rollout";
      rows.push(row([
        n.name, n.role, n.hardware, n.region, n.job_id, [n.state, { class: "state-" + n.state }],
        [versions, { id: `node-${n.name}-versions` }],
        isRollout ? n.leased_now : "–", isRollout ? n.leased_total : "–",
        isRollout ? fmt(n.trajectories_per_s, 2) : "–",
        [isRollout ? fmt(n.tokens_per_s, 1) : "–", { id: `node-${n.name}-tokens` }],
        n.last_seen_s === null ? "–" : fmt(n.last_seen_s, 1) + "s ago",
      ], { "data-node": n.name }));
    }
  }
  nb.replaceChildren(...rows);

  const L = st.ledger;
  const kv = (title, obj, id) => {
    const t = el("table", { id });
    t.appendChild(el("thead")).appendChild(el("tr")).append(el("th", { colspan: 2 }, title));
    const tb = t.appendChild(el("tbody"));
    const entries = Object.entries(obj);
    if (!entries.length) tb.appendChild(row(["none", ""]));
    for (const [k, v] of entries) tb.appendChild(row([k, [v, { "data-key": k }]]));
    return t;
  };
  const box = el("div", { class: "ledger" });
  box.append(
    kv(`events (${L.tasks} tasks, ${L.open} open)`, L.totals, "ledger-totals"),
    kv("tasks by state", L.states, "ledger-states"),
    kv("dropped by reason", L.dropped_by_reason, "ledger-dropped"),
    kv("failed by reason", L.failed_by_reason, "ledger-failed"),
  );
  $("ledger").replaceChildren(box);
}

function renderMetrics(mv, st) {
  const holder = $("charts");
  const parts = [];
  for (const [name, c] of Object.entries(mv.policies)) {
    const hist = (st && st.policies.find((p) => p.name === name) || {}).staleness_hist || c.staleness_hist;
    const charts = el("div", { class: "charts", id: `charts-${name}` });
    charts.append(
      lineChart(`chart-${name}-reward`, `${name}: mean reward`, "trainer step", [{ xs: c.step, ys: c.reward_mean }]),
      lineChart(`chart-${name}-accuracy`, `${name}: held-out accuracy`, "weight version", [{ xs: c.eval_step, ys: c.eval_accuracy }], [0, 1]),
      barChart(`chart-${name}-staleness`, `${name}: staleness of consumed trajectories`, "versions behind", hist),
      lineChart(`chart-${name}-wait`, `${name}: trainer wait fraction`, "trainer step", [{ xs: c.step, ys: c.trainer_wait_fraction }], [0, 1]),
      lineChart(`chart-${name}-throughput`, "trajectories/s (run average)", "seconds", [{ xs: c.time, ys: c.trajectories_per_s }]),
    );
    parts.push(charts);
  }
  holder.replaceChildren(...parts);
}

let lastStatus = null;

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || `${url}: HTTP ${r.status}`);
  return body;
}

async function refresh() {
  try {
    const [st, mv] = await Promise.all([getJSON("/astraflow/api/status.json"), getJSON("/astraflow/api/metrics.json")]);
    lastStatus = st;
    renderStatus(st);
    renderMetrics(mv, st);
    $("error").hidden = true;
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()} (snapshot ${fmt(st.age_s, 1)}s old)`;
  } catch (err) {
    $("error").hidden = false;
    $("error").textContent = String(err.message || err);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
