// The episode viewer of the AstraFlow page: fetches astraflow/api/episodes.json with the
// filters of the form (on "apply", and every few seconds while "follow" is checked) and renders
// each episode turn by turn. Model output and tool results are untrusted: every text goes in
// through textContent (el() of astraflow.js), never through innerHTML.
"use strict";

const EPISODES_MS = Math.max(500, 3 * REFRESH_MS);
const epOpen = new Set();  // ids of the episodes the reader expanded, kept across refreshes
let epShown = "";          // what is on the page, to skip re-rendering an unchanged answer

function epQuery() {
  const q = new URLSearchParams();
  for (const [key, id] of [["workload", "ep-workload"], ["policy", "ep-policy"], ["kind", "ep-kind"],
    ["min_reward", "ep-min"], ["max_reward", "ep-max"], ["limit", "ep-limit"], ["sample", "ep-sample"]]) {
    const v = $(id).value.trim();
    if (v !== "") q.set(key, v);
  }
  return q.toString();
}

// keep the options in step with the answer, without losing the current choice
function epOptions(id, names) {
  const sel = $(id), cur = sel.value;
  const want = ["", ...names.filter((n) => n !== "")];
  if (cur && !want.includes(cur)) want.push(cur);
  const have = Array.from(sel.options).map((o) => o.value);
  if (have.join("\n") === want.join("\n")) return;
  sel.replaceChildren(...want.map((n) => el("option", { value: n }, n === "" ? "all" : n)));
  sel.value = cur;
}

function pre(text, cls) {
  return el("pre", cls ? { class: cls } : {}, text);
}

function callLine(c) {
  if (c.error !== null && c.error !== undefined) return el("div", { class: "call invalid" }, `invalid call: ${c.error}`);
  const box = el("div", { class: c.valid === false ? "call invalid" : "call" });
  box.append(el("b", {}, `${c.name}(${JSON.stringify(c.arguments)})`), el("span", {}, c.valid === false ? " ✗ " : " → "));
  box.append(pre(c.result === null ? "" : String(c.result)));
  return box;
}

function turnBox(t) {
  const box = el("div", { class: `turn turn-${t.kind}`, "data-kind": t.kind });
  const head = [t.kind, `tokens ${t.start}–${t.end}`];
  if (t.kind === "model") {
    if (t.versions.length) head.push(t.versions[0] === t.versions[1] ? `v${t.versions[0]}` : `v${t.versions[0]}–v${t.versions[1]}`);
    if (t.finish) head.push(`finish ${t.finish}`);
  }
  if (t.reward !== null && t.reward !== undefined) head.push(`reward ${fmt(t.reward, 3)}`);
  if (t.done) head.push("done");
  box.appendChild(el("div", { class: "head" }, head.join(" · ")));
  if (t.text !== null && t.text !== undefined) box.appendChild(pre(t.text, "text"));
  for (const c of t.calls) box.appendChild(callLine(c));
  // a tool turn's messages repeat its calls' results: show them only when there are no calls
  if (!t.calls.length) for (const m of t.messages) box.appendChild(pre(`${m.role}: ${m.content}`, "message"));
  if (Object.keys(t.info).length) box.appendChild(el("div", { class: "muted" }, `info ${JSON.stringify(t.info)}`));
  return box;
}

function episodeBox(e, sampled) {
  const box = el("details", { class: sampled ? "episode sampled" : "episode", "data-id": e.id, "data-task": e.task_id });
  if (epOpen.has(e.id)) box.open = true;
  box.addEventListener("toggle", () => (box.open ? epOpen.add(e.id) : epOpen.delete(e.id)));
  const sum = el("summary");
  const parts = Object.entries(e.rewards).map(([k, v]) => `${k} ${fmt(v, 3)}`).join(", ");
  sum.append(
    el("b", {}, e.task_id),
    el("span", { class: "reward" }, `reward ${fmt(e.reward, 3)}${parts ? ` (${parts})` : ""}`),
    el("span", {}, `${e.workload} · ${e.kind} · ${e.policies.join("+")} · ${e.workflow}`),
    el("span", {}, e.turns.length ? `${e.turns.filter((t) => t.kind === "model").length} model turns` : `${e.num_tokens} tokens`),
  );
  if (e.truncated) sum.appendChild(el("span", { class: "tag truncated" }, `truncated: ${e.truncated}`));
  if (sampled) sum.appendChild(el("span", { class: "tag" }, "sampled"));
  sum.appendChild(el("span", { class: "muted" }, `${e.node || "?"} · ${duration(Date.now() / 1000 - e.written_at)} ago`));
  box.appendChild(sum);
  if (e.task) box.appendChild(el("div", { class: "task" }, `task ${JSON.stringify(e.task)}`));
  if (!e.turns.length) {
    box.appendChild(el("div", { class: "muted" },
      `no turn log (workflow ${e.workflow}): ${e.num_tokens} tokens, finish ${e.finish_reason}, score ${fmt(e.score, 3)}`));
  }
  for (const t of e.turns) box.appendChild(turnBox(t));
  if (e.final_reward !== null) box.appendChild(el("div", { class: "final" }, `final reward ${fmt(e.final_reward, 3)}`));
  return box;
}

function renderEpisodes(v) {
  epOptions("ep-workload", v.workloads);
  epOptions("ep-policy", v.policies);
  const n = v.recent.length + v.sampled.length;
  $("ep-summary").textContent = v.note || `${v.recent.length} newest + ${v.sampled.length} sampled of ${v.batches} stored batches${v.partial ? " (more at the next refresh)" : ""}`;
  const key = JSON.stringify([v.recent.map((e) => e.id), v.sampled.map((e) => e.id)]);
  if (key === epShown) return;
  epShown = key;
  const boxes = [...v.recent.map((e) => episodeBox(e, false)), ...v.sampled.map((e) => episodeBox(e, true))];
  if (!n && !v.note) boxes.push(el("div", { class: "muted" }, "no episode matches the filters"));
  $("episodes").replaceChildren(...boxes);
}

let epTimer = null;

async function loadEpisodes() {
  clearTimeout(epTimer);
  try {
    renderEpisodes(await getJSON(`${API}episodes.json?${epQuery()}`));
    $("ep-error").hidden = true;
  } catch (err) {
    $("ep-error").hidden = false;
    $("ep-error").textContent = err instanceof NoAnswer ? noAnswer() : String(err.message || err);
  } finally {
    if ($("ep-follow").checked) epTimer = setTimeout(loadEpisodes, EPISODES_MS);
  }
}

$("episode-filters").addEventListener("submit", (ev) => {
  ev.preventDefault();
  epShown = "";
  loadEpisodes();
});
$("ep-follow").addEventListener("change", () => { if ($("ep-follow").checked) loadEpisodes(); });
loadEpisodes();
