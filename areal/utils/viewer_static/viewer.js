// areal view: curves (plain SVG), two runs side by side, the sample table, one sample's tokens and,
// for Core runs, the MFC timeline of a step. No dependencies.
"use strict";

const CHARTS = [
  { title: "mean reward (training rollouts)", keys: ["reward/mean"] },
  { title: "held-out accuracy", keys: ["eval/accuracy"] },
  { title: "staleness: trained tokens per version lag", prefix: "staleness/hist/" },
  { title: "train/rollout mismatch KL (k3) per staleness bucket", prefix: "loss/mismatch_k3" },
  { title: "masked fraction (rollout correction)", keys: ["loss/rc_masked_frac"] },
  { title: "seconds per stage", prefix: "timing/" },
  { title: "samples / s", keys: ["perf/samples_per_second"] },
  { title: "seconds per MFC (Core)", prefix: "mfc/", suffix: "/wall_time" },
];
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const REFRESH_MS = 5000;
const SVG = "http://www.w3.org/2000/svg";
let runs = [];
let stats = {};  // run id -> rows

async function getJSON(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(url + ": " + r.status + " " + (await r.text()));
  return r.json();
}

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function showError(message) {
  let box = document.getElementById("error");
  if (!box) { box = el("p", { id: "error" }); document.querySelector("main").prepend(box); }
  box.textContent = message;
}

// -- curves -----------------------------------------------------------------------------------

function matches(chart, k) {
  if (chart.keys) return chart.keys.includes(k);
  return k.startsWith(chart.prefix) && (!chart.suffix || k.endsWith(chart.suffix));
}

function seriesOf(chart, shown) {
  const out = [];
  for (const run of shown) {
    const rows = stats[run.id] || [];
    const keys = new Set();
    for (const row of rows) for (const k of Object.keys(row)) if (matches(chart, k)) keys.add(k);
    for (const key of [...keys].sort()) {
      const pts = rows.filter(r => typeof r[key] === "number").map(r => [r.step, r[key]]);
      let short = chart.prefix ? key.slice(chart.prefix.length) || key : key;
      if (chart.suffix) short = short.slice(0, -chart.suffix.length);
      const label = (shown.length > 1 ? run.name + ": " : "") + short;
      out.push({ run: run.id, key, label, pts });
    }
  }
  return out;
}

function extent(series) {
  const all = series.flatMap(s => s.pts);
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  return [x0, x1, y0, y1];
}

// one chart of the runs `shown`; `range` ([x0, x1, y0, y1]) shares the axes of side-by-side charts
function drawChart(chart, shown = runs, range = null) {
  const W = 420, H = 190, L = 44, R = 8, T = 8, B = 22;
  const box = el("div", { class: "chart", "data-title": chart.title });
  box.append(el("h3", {}, chart.title + (range && shown.length === 1 ? " \u2014 " + shown[0].name : "")));
  const series = seriesOf(chart, shown).filter(s => s.pts.length);
  if (!series.length) { box.append(el("p", { class: "empty" }, "not logged")); return box; }
  const [x0, x1, y0, y1] = range || extent(series);
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const svg = el("svg:svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  svg.append(el("svg:line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
  svg.append(el("svg:line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#999" }));
  svg.append(el("svg:text", { x: 2, y: T + 8 }, y1.toPrecision(3)));
  svg.append(el("svg:text", { x: 2, y: H - B }, y0.toPrecision(3)));
  svg.append(el("svg:text", { x: L, y: H - 6 }, "step " + x0));
  svg.append(el("svg:text", { x: W - R - 50, y: H - 6 }, "step " + x1));
  const legend = el("div", { class: "legend" });
  series.forEach((s, i) => {
    const colour = PALETTE[i % PALETTE.length];
    const line = s.pts.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
    svg.append(el("svg:polyline", { points: line, fill: "none", stroke: colour, "stroke-width": 1.5 }));
    for (const [x, y] of s.pts) {
      const dot = el("svg:circle", { class: "pt", cx: sx(x), cy: sy(y), r: 2.5, fill: colour,
                                     "data-run": s.run, "data-key": s.key, "data-step": x });
      dot.append(el("svg:title", {}, `${s.label} step ${x}: ${y}`));
      svg.append(dot);
    }
    legend.append(el("span", { style: "color:" + colour }, "\u25cf " + s.label));
  });
  box.append(svg, legend);
  return box;
}

async function refreshCurves() {
  try {
    for (const run of runs) stats[run.id] = await getJSON("/api/stats/" + run.id);
  } catch (e) { showError(String(e)); return; }
  document.getElementById("charts").replaceChildren(...CHARTS.map(c => drawChart(c)));
}

// -- two runs side by side ----------------------------------------------------------------------

async function refreshCompare() {
  const note = document.getElementById("compare-note");
  if (runs.length < 2) { note.textContent = "give areal view two run dirs to see them side by side"; return; }
  const pick = id => runs[Number(document.getElementById(id).value)];
  const pair = [pick("compare-a"), pick("compare-b")];
  try { for (const run of pair) stats[run.id] = await getJSON("/api/stats/" + run.id); }
  catch (e) { showError(String(e)); return; }
  note.textContent = "each chart's axes are shared by its two sides";
  document.getElementById("compare-rows").replaceChildren(...CHARTS.map(chart => {
    const both = seriesOf(chart, pair).filter(s => s.pts.length);
    const range = both.length ? extent(both) : null;
    const row = el("div", { class: "pair" });
    row.append(...pair.map(run => drawChart(chart, [run], range)));
    return row;
  }));
}

// -- sample table -----------------------------------------------------------------------------

async function loadTable() {
  const form = new FormData(document.getElementById("filters"));
  const run = form.get("run") || "0";
  const query = new URLSearchParams();
  for (const [k, v] of form.entries()) if (k !== "run" && v) query.set(k, v);
  let data;
  try { data = await getJSON(`/api/samples/${run}?${query}`); } catch (e) { showError(String(e)); return; }
  for (const col of ["server", "worker"]) {  // the run's servers and workers to choose from
    const select = document.getElementById("filter-" + col), keep = select.value;
    select.replaceChildren(el("option", { value: "" }, "any"),
                           ...data.choices[col].map(v => el("option", { value: v }, v)));
    select.value = data.choices[col].includes(keep) ? keep : "";
  }
  const body = document.querySelector("#samples-table tbody");
  body.replaceChildren(...data.rows.map(r => {
    const tr = el("tr", { "data-href": `#sample/${run}/${r.step}/${r.rank}/${r.index}` });
    const cells = [r.step, r.rank, r.index, r.group, r.reward.toFixed(3), r.advantage.toFixed(3),
                   r.staleness, r.length, r.status, r.server, r.worker];
    for (const c of cells) tr.append(el("td", {}, String(c)));
    tr.append(el("td", { class: "text" }, r.completion_text));
    tr.addEventListener("click", () => { location.hash = tr.dataset.href; });
    return tr;
  }));
  document.getElementById("matched").textContent =
    `${data.total} samples match` + (data.total > data.rows.length ? `, first ${data.rows.length} shown` : "");
}

// -- one sample -------------------------------------------------------------------------------

const LAG_COLOURS = ["#b7e4b0", "#ffe58a", "#ffb870", "#ff8a8a"];  // lag 0, 1, 2, 3+

function versionColour(s, i) {
  const v = s.versions[i];
  return v < 0 ? "#e0e0e0" : LAG_COLOURS[Math.min(s.trainer_version - v, LAG_COLOURS.length - 1)];
}

function logpColour(s, i) {
  // with the trainer's logprob: red = trainer more likely than the server, blue = less; without
  // it, the server's own surprise (-logp), grey to purple
  if (s.trainer_logp) {
    const d = s.trainer_logp[i] - s.behav_logp[i], a = Math.min(Math.abs(d), 1);
    return d >= 0 ? `rgba(214,39,40,${a})` : `rgba(31,119,180,${a})`;
  }
  return `rgba(148,103,189,${Math.min(-s.behav_logp[i] / 5, 1)})`;
}

function renderTokens(s) {
  const mode = document.querySelector("input[name=colour]:checked").value;
  const colour = mode === "version" ? versionColour : logpColour;
  const legend = document.getElementById("legend");
  if (mode === "version") {
    legend.replaceChildren(...["lag 0", "lag 1", "lag 2", "lag 3+"].map((t, i) =>
      el("span", { style: "background:" + LAG_COLOURS[i] }, t)), el("span", { style: "background:#e0e0e0" }, "not sampled"));
  } else {
    legend.textContent = s.trainer_logp ? "red: trainer logprob above the server's, blue: below (|diff| 1 = full colour)"
      : "the trainer's logprob was not recorded for this sample (a run recorded before it was): "
        + "colour = the server's -logprob, up to 5";
  }
  const starts = s.turn_starts || [];  // multi-turn / agent samples: where each model turn starts
  document.getElementById("tokens").replaceChildren(...s.completion_tokens.flatMap((t, i) => {
    const tip = `version ${s.versions[i]}, behaviour logp ${s.behav_logp[i].toFixed(4)}` +
      (s.trainer_logp ? `, trainer logp ${s.trainer_logp[i].toFixed(4)}` : "") + `, advantage ${s.advantages[i].toFixed(4)}`;
    const tok = el("span", { class: "tok" + (s.loss_mask[i] ? "" : " untrained"), title: tip,
                             style: "background:" + colour(s, i), "data-version": s.versions[i] }, t);
    const turn = starts.indexOf(i);
    return turn >= 0 && starts.length > 1 ? [el("span", { class: "turn" }, `turn ${turn + 1}`), tok] : [tok];
  }));
}

let currentSample = null;

async function showSample(run, step, rank, index) {
  try { currentSample = await getJSON(`/api/sample/${run}/${step}/${rank}/${index}`); }
  catch (e) { showError(String(e)); return; }
  const s = currentSample;
  document.getElementById("sample-title").textContent = `step ${step}, rank ${rank}, sample ${index} (${s.sample_id})`;
  document.getElementById("sample-meta").textContent =
    `reward ${s.reward}, advantage ${s.advantage.toFixed(4)}, trained on version ${s.trainer_version}, ` +
    `staleness ${s.staleness}, ${s.length} completion tokens, status ${s.status}` +
    `, server ${s.server || "?"}, rollout worker ${s.worker || "?"}` +
    ((s.turn_starts || []).length > 1 ? `, ${s.turn_starts.length} model turns` : "");
  document.getElementById("sample-prompt").textContent = s.prompt_text;
  renderTokens(s);
}

// -- Core: the MFCs of one step on each model worker ---------------------------------------------

let timelines = {};  // run id -> steps

async function refreshTimeline(pickLast) {
  const run = document.getElementById("timeline-run").value || "0";
  try { timelines[run] = await getJSON("/api/timeline/" + run); } catch (e) { showError(String(e)); return; }
  const steps = timelines[run], input = document.getElementById("timeline-step");
  const note = document.getElementById("timeline-note"), chart = document.getElementById("timeline-chart");
  if (!steps.length) {
    note.textContent = "no MFC timeline: a Core run (areal core async-ppo) records one";
    chart.replaceChildren();
    return;
  }
  const last = steps[steps.length - 1].step;
  if (pickLast || !input.value) input.value = last;
  const rec = steps.find(r => r.step === Number(input.value)) || steps[steps.length - 1];
  note.textContent = `steps ${steps[0].step}..${last}; step ${rec.step} took ${rec.seconds.toFixed(2)} s`;
  chart.replaceChildren(drawTimeline(rec));
}

function drawTimeline(rec) {
  const lanes = [...new Set(rec.spans.map(s => s.worker))].sort((a, b) => a - b);
  const names = [...new Set(rec.spans.map(s => s.name))];
  const W = 1100, L = 80, R = 10, T = 6, LANE = 28, B = 22, H = T + LANE * lanes.length + B;
  const span = Math.max(rec.seconds, ...rec.spans.map(s => s.end), 1e-3);
  const sx = t => L + t / span * (W - L - R);
  const svg = el("svg:svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, id: "timeline-svg" });
  lanes.forEach((w, i) => svg.append(el("svg:text", { x: 2, y: T + LANE * i + 18 }, "worker " + w)));
  for (const s of rec.spans) {
    const y = T + LANE * lanes.indexOf(s.worker) + 4, colour = PALETTE[names.indexOf(s.name) % PALETTE.length];
    if (s.start > s.queued) {  // queued behind earlier calls on the worker
      svg.append(el("svg:rect", { x: sx(s.queued), y: y + 8, width: Math.max(sx(s.start) - sx(s.queued), 0.5),
                                  height: 4, fill: "#ccc" }));
    }
    const bar = el("svg:rect", { class: "span", x: sx(s.start), y, width: Math.max(sx(s.end) - sx(s.start), 1),
                                 height: 20, fill: colour, "data-name": s.name, "data-worker": s.worker });
    bar.append(el("svg:title", {}, `${s.name} on worker ${s.worker}: ${(s.end - s.start).toFixed(3)} s ` +
                                   `(queued at ${s.queued.toFixed(3)} s, ran ${s.start.toFixed(3)}..${s.end.toFixed(3)} s)`));
    svg.append(bar);
  }
  svg.append(el("svg:line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
  svg.append(el("svg:text", { x: L, y: H - 6 }, "0 s"));
  svg.append(el("svg:text", { x: W - R - 60, y: H - 6 }, span.toFixed(2) + " s"));
  const legend = el("div", { class: "legend" });
  names.forEach((n, i) => legend.append(el("span", { style: "color:" + PALETTE[i % PALETTE.length] }, "\u25a0 " + n)));
  const box = el("div", { class: "chart" });
  box.append(svg, legend);
  return box;
}

// -- routing ----------------------------------------------------------------------------------

const VIEWS = ["curves", "compare", "samples", "sample", "timeline"];

function route() {
  const parts = (location.hash || "#curves").slice(1).split("/");
  const view = VIEWS.includes(parts[0]) ? parts[0] : "curves";
  for (const v of VIEWS) document.getElementById("view-" + v).hidden = v !== view;
  if (view === "curves") refreshCurves();
  if (view === "compare") refreshCompare();
  if (view === "samples") loadTable();
  if (view === "sample") showSample(...parts.slice(1, 5));
  if (view === "timeline") refreshTimeline(false);
}

function runOptions(id, selected) {
  const select = document.getElementById(id);
  select.replaceChildren(...runs.map(r => el("option", { value: r.id }, r.name + " (" + r.id + ")")));
  select.value = String(Math.min(selected, runs.length - 1));
}

async function start() {
  try { runs = await getJSON("/api/runs"); } catch (e) { showError(String(e)); return; }
  document.getElementById("runs").textContent = runs.map(r => r.path).join("  |  ");
  for (const [id, selected] of [["filter-run", 0], ["compare-a", 0], ["compare-b", 1], ["timeline-run", 0]]) {
    runOptions(id, selected);
  }
  document.getElementById("filters").addEventListener("submit", e => { e.preventDefault(); loadTable(); });
  document.getElementById("compare-runs").addEventListener("change", refreshCompare);
  document.getElementById("timeline-run").addEventListener("change", () => refreshTimeline(true));
  document.getElementById("timeline-step").addEventListener("change", () => refreshTimeline(false));
  document.getElementById("timeline-pick").addEventListener("submit", e => { e.preventDefault(); refreshTimeline(false); });
  for (const radio of document.querySelectorAll("input[name=colour]")) {
    radio.addEventListener("change", () => { if (currentSample) renderTokens(currentSample); });
  }
  window.addEventListener("hashchange", route);
  setInterval(() => {  // a running run: new points (and the newest step's timeline) come in
    if (!document.getElementById("view-curves").hidden) refreshCurves();
    if (!document.getElementById("view-compare").hidden) refreshCompare();
  }, REFRESH_MS);
  route();
}

start();
