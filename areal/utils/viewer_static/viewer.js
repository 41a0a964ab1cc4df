// areal view: curves (plain SVG), the sample table and one sample's tokens. No dependencies.
"use strict";

const CHARTS = [
  { title: "mean reward (training rollouts)", keys: ["reward/mean"] },
  { title: "held-out accuracy", keys: ["eval/accuracy"] },
  { title: "staleness: trained tokens per version lag", prefix: "staleness/hist/" },
  { title: "train/rollout mismatch KL (k3) per staleness bucket", prefix: "loss/mismatch_k3" },
  { title: "masked fraction (rollout correction)", keys: ["loss/rc_masked_frac"] },
  { title: "seconds per stage", prefix: "timing/" },
  { title: "samples / s", keys: ["perf/samples_per_second"] },
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

function seriesOf(chart) {
  const out = [];
  for (const run of runs) {
    const rows = stats[run.id] || [];
    const keys = new Set();
    for (const row of rows) for (const k of Object.keys(row)) {
      if (chart.keys ? chart.keys.includes(k) : k.startsWith(chart.prefix)) keys.add(k);
    }
    for (const key of [...keys].sort()) {
      const pts = rows.filter(r => typeof r[key] === "number").map(r => [r.step, r[key]]);
      const label = (runs.length > 1 ? run.name + ": " : "") + (chart.prefix ? key.slice(chart.prefix.length) || key : key);
      out.push({ run: run.id, key, label, pts });
    }
  }
  return out;
}

function drawChart(chart) {
  const W = 420, H = 190, L = 44, R = 8, T = 8, B = 22;
  const box = el("div", { class: "chart", "data-title": chart.title });
  box.append(el("h3", {}, chart.title));
  const series = seriesOf(chart).filter(s => s.pts.length);
  if (!series.length) { box.append(el("p", { class: "empty" }, "not logged")); return box; }
  const all = series.flatMap(s => s.pts);
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
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
  document.getElementById("charts").replaceChildren(...CHARTS.map(drawChart));
}

// -- sample table -----------------------------------------------------------------------------

async function loadTable() {
  const form = new FormData(document.getElementById("filters"));
  const run = form.get("run") || "0";
  const query = new URLSearchParams();
  for (const [k, v] of form.entries()) if (k !== "run" && v) query.set(k, v);
  let data;
  try { data = await getJSON(`/api/samples/${run}?${query}`); } catch (e) { showError(String(e)); return; }
  const body = document.querySelector("#samples-table tbody");
  body.replaceChildren(...data.rows.map(r => {
    const tr = el("tr", { "data-href": `#sample/${run}/${r.step}/${r.rank}/${r.index}` });
    const cells = [r.step, r.rank, r.index, r.group, r.reward.toFixed(3), r.advantage.toFixed(3),
                   r.staleness, r.length, r.status];
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
      : "the trainer's logprob was not recorded at this step (actor.recompute_prox_logp=true records it): "
        + "colour = the server's -logprob, up to 5";
  }
  document.getElementById("tokens").replaceChildren(...s.completion_tokens.map((t, i) => {
    const tip = `version ${s.versions[i]}, behaviour logp ${s.behav_logp[i].toFixed(4)}` +
      (s.trainer_logp ? `, trainer logp ${s.trainer_logp[i].toFixed(4)}` : "") + `, advantage ${s.advantages[i].toFixed(4)}`;
    return el("span", { class: "tok" + (s.loss_mask[i] ? "" : " untrained"), title: tip,
                        style: "background:" + colour(s, i), "data-version": s.versions[i] }, t);
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
    `staleness ${s.staleness}, ${s.length} completion tokens, status ${s.status}`;
  document.getElementById("sample-prompt").textContent = s.prompt_text;
  renderTokens(s);
}

// -- routing ----------------------------------------------------------------------------------

function route() {
  const parts = (location.hash || "#curves").slice(1).split("/");
  const view = parts[0] === "sample" ? "sample" : parts[0] === "samples" ? "samples" : "curves";
  for (const v of ["curves", "samples", "sample"]) document.getElementById("view-" + v).hidden = v !== view;
  if (view === "curves") refreshCurves();
  if (view === "samples") loadTable();
  if (view === "sample") showSample(...parts.slice(1, 5));
}

async function start() {
  try { runs = await getJSON("/api/runs"); } catch (e) { showError(String(e)); return; }
  document.getElementById("runs").textContent = runs.map(r => r.path).join("  |  ");
  document.getElementById("filter-run").replaceChildren(...runs.map(r => el("option", { value: r.id }, r.name + " (" + r.id + ")")));
  document.getElementById("filters").addEventListener("submit", e => { e.preventDefault(); loadTable(); });
  for (const radio of document.querySelectorAll("input[name=colour]")) {
    radio.addEventListener("change", () => { if (currentSample) renderTokens(currentSample); });
  }
  window.addEventListener("hashchange", route);
  setInterval(() => { if (!document.getElementById("view-curves").hidden) refreshCurves(); }, REFRESH_MS);
  route();
}

start();
