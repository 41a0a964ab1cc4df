// areal view: curves (uPlot, vendored in vendor/), two runs side by side, the sample table, one
// sample's tokens and, for Core runs, the MFC timeline of a step. No CDN: the page works offline.
"use strict";

// `kind`: the runs a chart is about ("rl", "supervised", "any"). An empty chart shows as "not
// logged" (with `why`) only when a shown run is of its kind; one without a kind (Core, RM, DPO)
// is left out when empty. `lag`: its series are version lags, in the tokens' lag colours; `name`:
// a series' label from its key less the chart's prefix.
const CHARTS = [
  { title: "mean reward (training rollouts)", keys: ["reward/mean"], kind: "rl" },
  { title: "held-out accuracy", keys: ["eval/accuracy"], kind: "rl",
    why: "logged by runs with a held-out set (valid_dataset)" },
  { title: "loss (train, held-out)", keys: ["loss/loss", "eval/loss"], kind: "supervised" },
  { title: "pair accuracy (reward model, DPO)",
    keys: ["loss/pair_acc", "eval/pair_acc", "loss/reward_acc", "eval/reward_acc"] },
  { title: "chosen - rejected margin (reward model, DPO)", keys: ["loss/margin", "eval/margin"] },
  { title: "staleness: trained tokens per version lag", prefix: "staleness/hist/", kind: "rl", lag: true,
    name: lag => "lag " + lag },
  { title: "train/rollout mismatch KL (k3) per staleness bucket", prefix: "loss/mismatch_k3", kind: "rl",
    lag: true, name: s => s.startsWith("_stale") ? "lag " + s.slice(6) : "every lag" },
  { title: "masked fraction (rollout correction)", keys: ["loss/rc_masked_frac"], kind: "rl",
    why: "logged with a rollout correction (actor.rollout_correction.mode)" },
  { title: "seconds per stage", prefix: "timing/", kind: "any" },
  { title: "samples / s", keys: ["perf/samples_per_second"], kind: "rl",
    why: "needs recorded samples (stats_logger.samples) and perf/step_seconds" },
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

// a number with `digits` decimals; anything else (the API sends a non-finite value as "NaN",
// "Infinity" or "-Infinity", a missing one as null) as written
function fmt(x, digits) {
  return typeof x === "number" ? x.toFixed(digits) : String(x);
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

const LAG_COLOURS = ["#66bb6a", "#fdd835", "#fb8c00", "#e53935"];  // lag 0, 1, 2, 3+: charts and tokens
const UNSAMPLED = "#e0e0e0";  // an injected token (version -1): not sampled
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
const RUN_DASH = [[], [6, 3], [2, 3], [8, 3, 2, 3]];  // lag charts: one dash pattern per run
const plots = new Map();  // "<view>/<chart>/<runs>" -> its box: kept while its data is unchanged

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
    const order = chart.keys ? (a, b) => chart.keys.indexOf(a) - chart.keys.indexOf(b) : undefined;
    for (const key of [...keys].sort(order)) {
      const pts = rows.filter(r => typeof r[key] === "number").map(r => [r.step, r[key]]);  // "NaN": no point
      let short = chart.prefix ? key.slice(chart.prefix.length) || key : key;
      if (chart.suffix) short = short.slice(0, -chart.suffix.length);
      const label = (shown.length > 1 ? run.name + ": " : "") + (chart.name ? chart.name(short) : short);
      out.push({ run: run.id, key, label, pts });
    }
  }
  return out;
}

// "rl" (rollouts: rewards or staleness logged), "supervised" (SFT, RM, DPO: a loss without
// rollouts) and "any": the chart kinds a run's stats are about
function kindsOf(shown) {
  const out = new Set(["any"]);
  for (const run of shown) {
    const keys = new Set((stats[run.id] || []).flatMap(r => Object.keys(r)));
    const has = p => [...keys].some(k => k.startsWith(p));
    if (has("reward/") || has("staleness/")) out.add("rl");
    else if (has("loss/") || has("eval/loss")) out.add("supervised");
  }
  return out;
}

function smoothingWeight() {
  return Number(document.getElementById("smoothing").value);
}

// exponential moving average with weight w (0: the raw values), debiased as TensorBoard does so
// that the first points are not pulled towards 0
function ema(pts, w) {
  let acc = 0;
  return pts.map(([x, y], n) => { acc = acc * w + (1 - w) * y; return [x, acc / (1 - w ** (n + 1))]; });
}

// the colour of the lag a lag chart's series is about: 2 of staleness/hist/2, 3+ of
// loss/mismatch_k3_stale3+; dark grey for one over every lag (loss/mismatch_k3)
function lagColour(key) {
  const m = /(?:hist\/|_stale)(\d+)\+?$/.exec(key);
  return m ? LAG_COLOURS[Math.min(Number(m[1]), LAG_COLOURS.length - 1)] : "#555555";
}

function tickLabel(v, digits = 6) {
  return v == null ? "" : String(Number(v.toPrecision(digits)));  // 0.2, 1500, 1.5e-8
}

// uPlot's columns: steps, then per series its raw values (drawn faint when smoothed) and its
// smoothed ones; null where a series has no point at a step
function columns(series, w) {
  const xs = [...new Set(series.flatMap(s => s.pts.map(p => p[0])))].sort((a, b) => a - b);
  const at = new Map(xs.map((x, i) => [x, i]));
  const column = pts => { const y = new Array(xs.length).fill(null); for (const [x, v] of pts) y[at.get(x)] = v; return y; };
  return [xs, ...series.flatMap(s => [column(s.pts), column(ema(s.pts, w))])];
}

// [x0, x1, y0, y1] over every drawn value (raw and smoothed) of `data` columns (a loop: a long
// run's values are too many for Math.min's arguments)
function extent(data) {
  let [y0, y1] = [Infinity, -Infinity];
  for (const col of data.slice(1)) for (const v of col) if (v != null) { y0 = Math.min(y0, v); y1 = Math.max(y1, v); }
  return [data[0][0], data[0][data[0].length - 1], y0, y1];  // steps are sorted
}

function plotOptions(chart, series, range, w) {
  const line = (s, i) => {
    const colour = chart.lag ? lagColour(s.key) : PALETTE[i % PALETTE.length];
    const dash = chart.lag ? RUN_DASH[runs.findIndex(r => r.id === s.run) % RUN_DASH.length] : [];
    const raw = { label: s.label + " (raw)", stroke: colour + "55", width: 1, dash, spanGaps: true,
                  points: { show: false }, show: w > 0 };
    const value = (u, v, si, idx) => {  // the legend's read-out at the cursor: smoothed (raw)
      const rawValue = u.data[si - 1][idx];
      return v == null ? "-" : tickLabel(v, 4) + (w > 0 && rawValue != null ? ` (raw ${tickLabel(rawValue, 4)})` : "");
    };
    const smooth = { label: s.label, stroke: colour, width: 2, dash, spanGaps: true, value };
    return [raw, smooth];
  };
  const scales = { x: { time: false } };
  if (range) {  // side by side: both charts on the same axes
    scales.x.range = () => [range[0], range[1] > range[0] ? range[1] : range[0] + 1];
    scales.y = { range: () => uPlot.rangeNum(range[2], range[3], 0.1, true) };
  }
  const ticks = name => (u, splits) => {  // also kept on the box, for tests and for reading
    const labels = splits.map(v => tickLabel(v));
    if (u.root.parentElement) u.root.parentElement.dataset[name] = labels.join(" ");
    return labels;
  };
  return {
    width: 440, height: 220, scales, legend: { live: true },
    cursor: { drag: { x: true, y: false } },  // drag: zoom in on steps; double-click: all steps
    axes: [
      { label: "step", labelSize: 18, size: 34, incrs: STEP_INCRS, values: ticks("xTicks") },
      { values: ticks("yTicks"), size: (u, values) => Math.max(40, 14 + 7 * Math.max(0, ...(values || []).map(v => v.length))) },
    ],
    series: [{ label: "step", value: (u, v) => v == null ? "-" : String(v) }, ...series.flatMap(line)],
  };
}

// the box of one chart of the runs `shown`, drawn by uPlot once it is in the page (`box.draw`);
// the same box when its data did not change. `range` ([x0, x1, y0, y1]) shares the axes of
// side-by-side charts. null: an empty chart this page leaves out.
function drawChart(view, chart, shown = runs, range = null) {
  const series = seriesOf(chart, shown).filter(s => s.pts.length);
  const id = `${view}/${chart.title}/${shown.map(r => r.id)}`;
  const w = smoothingWeight();
  const shape = JSON.stringify([series.map(s => s.label), w, range]);  // what the plot is built for
  const sig = JSON.stringify(series.map(s => [s.pts.length, s.pts[s.pts.length - 1]]));  // its data
  const kept = plots.get(id);
  if (kept && kept.dataset.shape === shape) {  // same plot: new points (a running run), or none
    if (kept.dataset.sig !== sig && kept.uplot) kept.uplot.setData(columns(series, w));
    kept.dataset.sig = sig;
    return kept;
  }
  if (kept && kept.uplot) kept.uplot.destroy();
  plots.delete(id);
  if (!series.length && !kindsOf(shown).has(chart.kind)) return null;
  const box = el("div", { class: "chart", "data-title": chart.title, "data-shape": shape, "data-sig": sig });
  box.append(el("h3", {}, chart.title + (range && shown.length === 1 ? " \u2014 " + shown[0].name : "")));
  if (!series.length) {
    box.append(el("p", { class: "empty" }, "not logged" + (chart.why ? ": " + chart.why : "")));
    return box;
  }
  plots.set(id, box);
  const data = columns(series, w);
  box.draw = () => {
    box.uplot = new uPlot(plotOptions(chart, series, range, w), data, box);
    box.querySelectorAll(".u-legend .u-series").forEach((row, i) => {  // raw series: no legend row
      if (i % 2) row.style.display = "none";
    });
  };
  return box;
}

function place(container, boxes) {
  const shown = boxes.filter(Boolean);
  if (shown.length !== container.children.length || shown.some((b, i) => container.children[i] !== b)) {
    container.replaceChildren(...shown);
  }
  for (const box of shown) if (box.draw && !box.uplot) box.draw();
}

async function refreshCurves() {
  try {
    for (const run of runs) stats[run.id] = await getJSON("/api/stats/" + run.id);
  } catch (e) { showError(String(e)); return; }
  const boxes = CHARTS.map(c => drawChart("curves", c));
  const charts = document.getElementById("charts");
  if (!boxes.some(Boolean)) {
    charts.replaceChildren(el("p", { class: "empty" }, "no step logged yet (stats.jsonl)"));
    return;
  }
  place(charts, boxes);
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
  const rows = document.getElementById("compare-rows");
  const pairs = CHARTS.map(chart => {
    const both = seriesOf(chart, pair).filter(s => s.pts.length);
    const range = both.length ? extent(columns(both, smoothingWeight())) : null;
    const boxes = pair.map(run => drawChart("compare", chart, [run], range));
    if (!boxes.some(Boolean)) return null;
    const row = [...rows.children].find(r => r.dataset.title === chart.title) ||
      el("div", { class: "pair", "data-title": chart.title });
    row.replaceChildren(...boxes.map((b, i) => b || el("div", { class: "chart empty" },
      `${chart.title} \u2014 ${pair[i].name}: not logged by this run`)));
    return row;
  });
  place(rows, pairs);
  for (const box of rows.querySelectorAll(".chart")) if (box.draw && !box.uplot) box.draw();
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
    const cells = [r.step, r.rank, r.index, r.group, fmt(r.reward, 3), fmt(r.advantage, 3),
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

// each token's [background, text colour]; LAG_COLOURS (above) are the staleness charts' colours
const PROB_STOPS = ["#3b0f70", "#8c2981", "#de4968", "#fe9f6d", "#fcfdbf"];  // p = 0, .25, .5, .75, 1 (magma)
const UP_STOPS = ["#ffffff", "#f4a582", "#b2182b"], DOWN_STOPS = ["#ffffff", "#92c5de", "#2166ac"];

// the colour at t in [0, 1] of evenly spaced hex stops
function ramp(stops, t) {
  const at = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(at), stops.length - 2);
  const [a, b] = [stops[i], stops[i + 1]].map(h => [1, 3, 5].map(k => parseInt(h.slice(k, k + 2), 16)));
  return "#" + a.map((v, k) => Math.round(v + (b[k] - v) * (at - i)).toString(16).padStart(2, "0")).join("");
}

function versionColour(s, i) {
  const v = s.versions[i];
  return [v < 0 ? UNSAMPLED : LAG_COLOURS[Math.min(s.trainer_version - v, LAG_COLOURS.length - 1)], "#222"];
}

// the server's probability of the token: dark = unlikely, pale = likely
function probColour(p) {
  return Number.isFinite(p) ? [ramp(PROB_STOPS, p), p < 0.5 ? "#fff" : "#222"] : [UNSAMPLED, "#222"];
}

// trainer - server logprob d: red = the trainer finds the token more likely, blue = less; the
// depth is log-scaled (|d| 1e-4: white, 1e-2: half, >= 1: full) so small mismatches show
function diffColour(d) {
  if (!Number.isFinite(d)) return [UNSAMPLED, "#222"];  // not recorded, or a non-finite logprob
  const a = Math.min(Math.max((Math.log10(Math.abs(d)) + 4) / 4, 0), 1);
  return [ramp(d >= 0 ? UP_STOPS : DOWN_STOPS, a), a > 0.8 ? "#fff" : "#222"];
}

const COLOURINGS = {
  version: {
    colour: versionColour,
    legend: () => [...["lag 0", "lag 1", "lag 2", "lag 3+"].map((t, i) => [t, [LAG_COLOURS[i], "#222"]]),
                   ["not sampled", [UNSAMPLED, "#222"]]],
  },
  prob: {
    colour: (s, i) => probColour(Math.exp(s.behav_logp[i])),
    legend: () => [0, 0.25, 0.5, 0.75, 1].map(p => ["p " + p, probColour(p)]),
  },
  logp: {
    colour: (s, i) => diffColour(s.trainer_logp ? s.trainer_logp[i] - s.behav_logp[i] : NaN),
    legend: s => s.trainer_logp ? [-1, -0.01, -0.0001, 0.0001, 0.01, 1].map(d => [(d > 0 ? "+" : "") + d, diffColour(d)])
      : [["the trainer's logprob was not recorded for this sample (a run recorded before it was)", [UNSAMPLED, "#222"]]],
  },
};

function renderTokens(s) {
  const mode = COLOURINGS[document.querySelector("input[name=colour]:checked").value];
  document.getElementById("legend").replaceChildren(...mode.legend(s).map(([text, [bg, fg]]) =>
    el("span", { style: `background:${bg};color:${fg}` }, text)));
  const starts = s.turn_starts || [];  // multi-turn / agent samples: where each model turn starts
  document.getElementById("tokens").replaceChildren(...s.completion_tokens.flatMap((t, i) => {
    const tip = `version ${s.versions[i]}, behaviour logp ${fmt(s.behav_logp[i], 4)}` +
      (s.trainer_logp ? `, trainer logp ${fmt(s.trainer_logp[i], 4)}` : "") + `, advantage ${fmt(s.advantages[i], 4)}`;
    const [bg, fg] = mode.colour(s, i);
    const cls = "tok" + (i % 2 ? " alt" : "") + (s.loss_mask[i] ? "" : " untrained");  // alt: token edges
    const tok = el("span", { class: cls, title: tip, style: `background:${bg};color:${fg}`, "data-version": s.versions[i] }, t);
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
    `reward ${s.reward}, advantage ${fmt(s.advantage, 4)}, trained on version ${s.trainer_version}, ` +
    `staleness ${s.staleness}, ${s.length} completion tokens, status ${s.status}` +
    `, server ${s.server || "?"}, rollout worker ${s.worker || "?"}` +
    ((s.turn_starts || []).length > 1 ? `, ${s.turn_starts.length} model turns` : "");
  document.getElementById("sample-prompt").textContent = s.prompt_text;
  document.getElementById("sample-reference").textContent = s.reference ||
    "not recorded (a run recorded before references were, or a workflow without one)";
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
  note.textContent = `steps ${steps[0].step}..${last}; step ${rec.step} took ${fmt(rec.seconds, 2)} s`;
  chart.replaceChildren(drawTimeline(rec));
}

function drawTimeline(rec) {
  const lanes = [...new Set(rec.spans.map(s => s.worker))].sort((a, b) => a - b);
  const names = [...new Set(rec.spans.map(s => s.name))];
  const W = 1100, L = 80, R = 10, T = 6, LANE = 28, B = 22, H = T + LANE * lanes.length + B;
  const span = Math.max(...[rec.seconds, ...rec.spans.map(s => s.end)].filter(Number.isFinite), 1e-3);
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
    bar.append(el("svg:title", {}, `${s.name} on worker ${s.worker}: ${fmt(s.end - s.start, 3)} s ` +
                                   `(queued at ${fmt(s.queued, 3)} s, ran ${fmt(s.start, 3)}..${fmt(s.end, 3)} s)`));
    svg.append(bar);
  }
  svg.append(el("svg:line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999" }));
  const unit = 10 ** Math.floor(Math.log10(span / 8));
  const tick = unit * [1, 2, 5, 10].find(m => unit * m >= span / 8);
  for (let t = 0; t <= span + 1e-9; t += tick) {  // round seconds: 1 2 5 x 10^k apart, ~8 of them
    svg.append(el("svg:line", { x1: sx(t), y1: H - B, x2: sx(t), y2: H - B + 4, stroke: "#999" }));
    svg.append(el("svg:text", { x: sx(t), y: H - 6, "text-anchor": "middle" }, tickLabel(t) + " s"));
  }
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
  const smoothing = document.getElementById("smoothing");
  smoothing.value = localStorage.getItem("areal-view-smoothing") ?? smoothing.value;
  const smoothed = () => {
    document.getElementById("smoothing-value").textContent = smoothing.value;
    localStorage.setItem("areal-view-smoothing", smoothing.value);
    if (!document.getElementById("view-curves").hidden) refreshCurves();
    if (!document.getElementById("view-compare").hidden) refreshCompare();
  };
  document.getElementById("smoothing-value").textContent = smoothing.value;
  smoothing.addEventListener("input", smoothed);
  window.addEventListener("hashchange", route);
  setInterval(() => {  // a running run: new points (and the newest step's timeline) come in
    if (!document.getElementById("view-curves").hidden) refreshCurves();
    if (!document.getElementById("view-compare").hidden) refreshCompare();
  }, REFRESH_MS);
  route();
}

start();
