// The AstraFlow page: polls astraflow/api/status.json and metrics.json every 2 s and renders
// tables and inline-SVG charts. Plain JavaScript, nothing loaded from the network.
"use strict";

// every URL is relative to the page (<prefix>/astraflow): a site proxy may serve the dashboard under a prefix
const API = "./astraflow/api/";
const MAX_POINTS = 400;  // points per curve asked of metrics.json: the whole history would grow without bound

// ?refresh=MS on the page address changes the interval (tests use a short one)
const REFRESH_MS = Math.max(200, Number(new URLSearchParams(location.search).get("refresh")) || 2000);
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

const $ = (id) => document.getElementById(id);
const fmt = (x, d = 2) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(0) + "%");
// a configured threshold as set (0.305: 30.5%), as the autoscaler's reasons give it
const setting = (x) => (x === null || x === undefined ? "–" : +(100 * x).toPrecision(6) + "%");

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

// ticks at 1, 2 or 5 times a power of ten covering [lo, hi]; integer ticks when `integer`
function niceTicks(lo, hi, integer, n = 4) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) { lo = 0; hi = 1; }
  if (lo === hi) { lo -= integer ? 1 : Math.abs(lo) * 0.1 || 0.5; hi += integer ? 1 : Math.abs(hi) * 0.1 || 0.5; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  if (integer) step = Math.max(1, Math.round(step));
  const t0 = Math.floor(lo / step) * step, t1 = Math.ceil(hi / step) * step;
  const ticks = [];
  for (let t = t0; t <= t1 + step / 2; t += step) ticks.push(+t.toPrecision(10));
  return ticks;
}

function label(t) {
  const a = Math.abs(t);
  if (a >= 1e4) return (t / 1e3).toFixed(0) + "k";
  return String(+t.toPrecision(4));
}

// xt, yt: tick lists (the axes span their first to last tick, or `xspan` when given)
function axes(svg, xt, yt, xlabel, xspan) {
  const [x0, x1] = xspan || [xt[0], xt[xt.length - 1]];
  const [y0, y1] = [yt[0], yt[yt.length - 1]];
  const sx = (x) => PAD.l + ((x - x0) / (x1 - x0 || 1)) * (W - PAD.l - PAD.r);
  const sy = (y) => H - PAD.b - ((y - y0) / (y1 - y0 || 1)) * (H - PAD.t - PAD.b);
  svg.appendChild(svgEl("rect", { x: PAD.l, y: PAD.t, width: W - PAD.l - PAD.r, height: H - PAD.t - PAD.b, fill: "#fcfcfc", stroke: "#ddd" }));
  for (const y of yt) {
    svg.appendChild(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: sy(y), y2: sy(y), stroke: "#eee" }));
    svg.appendChild(svgEl("text", { x: PAD.l - 4, y: sy(y) + 3, "text-anchor": "end" }, label(y)));
  }
  for (const x of xt) {
    svg.appendChild(svgEl("text", { x: sx(x), y: H - PAD.b + 12, "text-anchor": "middle" }, label(x)));
  }
  svg.appendChild(svgEl("text", { x: (PAD.l + W - PAD.r) / 2, y: H - 2, "text-anchor": "middle" }, xlabel));
  return [sx, sy];
}

// series: [{name, xs, ys}]; points with y === null are skipped
function lineChart(id, title, xlabel, series, yfixed, xint) {
  const box = el("div", { class: "chart", id });
  box.appendChild(el("h3", {}, title));
  const svg = svgEl("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const pts = series.map((s) => s.xs.map((x, i) => [x, s.ys[i]]).filter(([, y]) => y !== null && y !== undefined));
  const all = pts.flat();
  if (!all.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  } else {
    const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
    const yt = yfixed ? [0, 0.25, 0.5, 0.75, 1] : niceTicks(Math.min(...ys), Math.max(...ys), false);
    const [sx, sy] = axes(svg, niceTicks(Math.min(...xs), Math.max(...xs), xint), yt, xlabel);
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
    const xt = [];
    for (let k = lo; k <= hi; k++) xt.push(k);
    const [sx, sy] = axes(svg, xt, niceTicks(0, ymax * 1.08, true), xlabel, [lo - 0.6, hi + 0.6]);
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
  // neither running nor finished while this page is served: its `astraflow run` writes no status
  // (busy, hung, suspended, or gone while the scheduler lives): said as that, not as a stop
  const state = st.running ? "running" : st.finished ? "finished" : "stopped";
  const silent = state !== "stopped" ? "" : st.age_s === null ? "no dated status"
    : `no status for ${duration(st.age_s)}`;
  badge.textContent = st.running && st.waiting ? "running: " + st.waiting : silent || state;
  badge.className = "badge " + state;
  badge.title = silent && "its `astraflow run` is busy, hung, suspended or gone: "
    + `\`astraflow status ${st.run_dir}\` tells which`;
  $("elapsed").textContent = duration(st.elapsed_s);
  $("traj-s").textContent = fmt(st.episodes_per_s, 1);
  $("tok-s").textContent = fmt(st.generated_tokens_per_s, 0);
  // a trainer that took its last step wants no rollout: the balance is the others'
  const training = st.policies.filter((p) => !p.done);
  const waits = (training.length ? training : st.policies).map((p) => p.wait_fraction);
  $("trainer-wait").textContent = waits.length ? pct(Math.max(...waits)) : "–";
  $("rollout-idle").textContent = st.rollout_idle_fraction === null ? "–" : pct(st.rollout_idle_fraction);

  const pb = $("policies").tBodies[0];
  pb.replaceChildren(...st.policies.map((p) => row([
    p.name,
    [`${p.step}${p.max_steps !== null ? " / " + p.max_steps : ""}`, { id: `policy-${p.name}-step`, "data-value": p.step }],
    [fmt(p.reward_mean, 3), { id: `policy-${p.name}-reward` }],
    [p.eval_accuracy === null ? "–" : `${fmt(p.eval_accuracy, 3)} (v${p.eval_step})`, { id: `policy-${p.name}-accuracy` }],
    // a wait for the next batch over 10 s: said, with how long (the fraction rises too slowly to tell)
    [pct(p.wait_fraction) + (p.batch_wait_s > 10 ? ` (waiting ${Math.round(p.batch_wait_s)}s)` : ""),
      { id: `policy-${p.name}-wait` }],
    p.buffer, p.accepted, p.filtered, p.stale_dropped, p.replayed,
    [p.consumed, { id: `policy-${p.name}-consumed`, "data-value": p.consumed }],
  ])));

  const nb = $("nodes").tBodies[0];
  const rows = [];
  for (const part of st.partitions) {
    const tr = el("tr", { class: "partition" });
    tr.appendChild(el("td", { colspan: 13 },
      `${part.name} — ${part.scheduler}, role ${part.role}, ${part.hardware} in ${part.region}: ${part.live} live of ${part.desired} desired`
      + (part.state !== "active" && part.state !== "?" ? `, ${part.state}` : "")
      + (part.failures ? `, ${part.failures} failed` : "")
      + (part.refill_in_s ? `, refilling in ${Math.round(part.refill_in_s)}s` : "")
      + (part.error ? ` — ${part.error}` : "")
      + (part.role === "rollout" ? partitionStats(part) : "")));
    tr.firstChild.id = `partition-${part.name}`;
    rows.push(tr);
    for (const n of part.nodes) {
      const versions = Object.entries(n.versions).map(([p, v]) => `${p}:v${v}`).join(" ") || "–";
      const isRollout = n.role === "rollout";
      rows.push(row([
        n.name, n.role, n.hardware, n.region, n.job_id + (n.host ? ` on ${n.host}` : ""),
        [n.state + (n.reason ? ` (${n.reason})` : ""), { class: "state-" + n.state }],
        [versions, { id: `node-${n.name}-versions` }],
        isRollout ? n.leased_now : "–", isRollout ? n.leased_total : "–",
        isRollout ? fmt(n.episodes_per_s, 2) : "–",
        [isRollout ? fmt(n.generated_tokens_per_s, 1) : "–", { id: `node-${n.name}-tokens` }],
        isRollout && n.idle_fraction !== null ? pct(n.idle_fraction) : "–",
        n.last_seen_s === null ? "–" : fmt(n.last_seen_s, 1) + "s ago",
      ], { "data-node": n.name }));
    }
  }
  nb.replaceChildren(...rows);

  renderAutoscale(st.autoscale);
  renderDisk(st.disk || []);
  renderRestarts(st);

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

// a rollout partition's throughput, staleness of what it generated, versions served, capacity, bounds
function partitionStats(part) {
  const served = Object.entries(part.versions)
    .map(([p, vs]) => `${p}:v${vs[0]}` + (vs.length > 1 ? `-v${vs[vs.length - 1]}` : "")).join(" ") || "–";
  const stale = part.staleness_mean === null ? "–" : `mean ${fmt(part.staleness_mean, 2)}, max ${part.staleness_max}`;
  const b = part.autoscale, c = part.capacity;
  return ` · ${fmt(part.trajectories_per_s, 1)} traj/s, ${fmt(part.tokens_per_s, 0)} tok/s · staleness ${stale}`
    + ` · serving ${served}`
    + (c ? ` · capacity ${c.node_capacity}/node, ${c.engines_per_node} engine(s) × batch ${c.engine_max_batch}` : "")
    + (b ? ` · autoscale ${b.min_nodes}–${b.max_nodes} nodes, cooldown ${b.cooldown_s}s` : "");
}

// components re-placed after their worker was lost (cluster.trainer_restarts, cluster.data_layer_restarts)
function renderRestarts(st) {
  const parts = st.policies.filter((p) => p.restarts).map((p) => `trainer ${p.name} ${p.restarts}`);
  if (st.data_layer_restarts) parts.push(`data layer ${st.data_layer_restarts}`);
  $("restarts").textContent = parts.join(" · ") || "–";
  $("restarts-box").hidden = !parts.length;
}

// free space per filesystem the run writes to, and when it fills at the current rate
function renderDisk(disks) {
  const gib = (n) => `${fmt(n / 2 ** 30, n < 100 * 2 ** 30 ? 1 : 0)} GiB`;
  const span = (s) => (s < 7200 ? `${Math.round(s / 60)} min` : s < 172800 ? `${fmt(s / 3600, 1)} h` : `${fmt(s / 86400, 1)} days`);
  $("disk").textContent = disks.map((d) => `${d.places.join(", ")}: ${gib(d.free_bytes)} free`
    + (d.full_in_s !== null ? ` (full in ~${span(d.full_in_s)})` : "")).join(" · ") || "–";
  $("disk").classList.toggle("warn", disks.some((d) => d.full_in_s !== null && d.full_in_s < 6 * 3600));
}

function renderAutoscale(a) {
  $("autoscale-section").hidden = !a;
  if (!a) return;
  const last = a.last;
  $("autoscale-now").textContent = `band ${setting(a.low_wait)}–${setting(a.high_wait)}`
    + ` of the trainer wait over the last ${a.window_s}s`
    + (a.max_stale_fraction !== null ? `, stale drops above ${setting(a.max_stale_fraction)} drain` : "")
    + (last ? ` · now: ${last.action} — ${last.reason}` : "");
  const time = (t) => new Date(1000 * t).toLocaleTimeString();
  $("autoscale").tBodies[0].replaceChildren(...a.changes.slice().reverse().map((d) => row([
    time(d.t), [d.action, { class: "action-" + d.action }], d.partition, `${d.desired} → ${d.target}`,
    pct(d.signals.trainer_wait), pct(d.signals.stale_fraction), d.reason,
  ])));
}

function renderMetrics(mv, st) {
  const holder = $("charts");
  const parts = [];
  for (const [name, c] of Object.entries(mv.policies)) {
    const hist = (st && st.policies.find((p) => p.name === name) || {}).staleness_hist || c.staleness_hist;
    const charts = el("div", { class: "charts", id: `charts-${name}` });
    charts.append(
      lineChart(`chart-${name}-reward`, `${name}: mean reward`, "trainer step", [{ xs: c.step, ys: c.reward_mean }], null, true),
      lineChart(`chart-${name}-accuracy`, `${name}: held-out accuracy`, "weight version", [{ xs: c.eval_step, ys: c.eval_accuracy }], [0, 1], true),
      barChart(`chart-${name}-staleness`, `${name}: staleness of consumed trajectories`, "versions behind", hist),
      lineChart(`chart-${name}-wait`, `${name}: trainer wait fraction`, "trainer step", [{ xs: c.step, ys: c.trainer_wait_fraction }], [0, 1], true),
      lineChart(`chart-${name}-throughput`, "episodes/s (run average)", "seconds", [{ xs: c.time, ys: c.episodes_per_s }]),
    );
    parts.push(charts);
  }
  holder.replaceChildren(...parts);
}

let lastStatus = null;

// the dashboard did not answer at all: the run ended (its scheduler stops with it) or the connection dropped
class NoAnswer extends Error {}

// the JSON answer of `url`; an answer that is not JSON (a 403 or 503 text) raises its text
async function getJSON(url) {
  let r, text;
  try {
    r = await fetch(url, { cache: "no-store" });
    text = await r.text();
  } catch (err) {
    throw new NoAnswer(String(err.message || err));
  }
  let body = null;
  try { body = JSON.parse(text); } catch (_) { /* not JSON: shown as the text it is */ }
  if (r.ok && body !== null) return body;
  const why = (body && body.error) || text.trim().slice(0, 500) || `HTTP ${r.status}`;
  throw new Error(r.ok ? `${url}: not JSON: ${why}` : why);
}

function noAnswer() {
  const dir = lastStatus ? lastStatus.run_dir : "RUN_DIR";
  $("run-state").textContent = "no answer";
  $("run-state").className = "badge no-answer";
  return "no answer from the run: it ended, or the connection (tunnel) dropped; "
    + `\`astraflow status ${dir}\` tells which`;
}

async function refresh() {
  try {
    const [st, mv] = await Promise.all([getJSON("./astraflow/api/status.json"),
      getJSON(`./astraflow/api/metrics.json?max_points=${MAX_POINTS}`)]);
    lastStatus = st;
    renderStatus(st);
    renderMetrics(mv, st);
    $("error").hidden = true;
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()} (snapshot ${fmt(st.age_s, 1)}s old)`;
  } catch (err) {
    $("error").hidden = false;
    $("error").textContent = err instanceof NoAnswer ? noAnswer() : String(err.message || err);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
