// TRIO console: runs, their metrics and checkpoints, and a sampling playground.
// Plain JS over the service's REST API (no build step, nothing fetched from elsewhere).
// The API key lives in sessionStorage and goes out as "Authorization: Bearer <key>".
// Text from the server is always set as textContent, never parsed as HTML.
"use strict";

const KEY = "trio.apiKey";
const SVG = "http://www.w3.org/2000/svg";
// Service metrics not drawn (the loss is; so is every metric a client logged).
const NOT_CHARTED = new Set(["tokens", "grad_norm", "learning_rate"]);

const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// -- talking to the service -------------------------------------------------------------

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY) || ""}`, ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    throw new ApiError(response.status, await errorMessage(response));
  }
  return response;
}

async function json(path, options) {
  return (await api(path, options)).json();
}

// Both error shapes carry error.message: TRIO's {error: {category, message}} and
// OpenAI's {error: {message, type, param, code}}.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: show the text */ }
  return `${response.status} ${response.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
}

// -- small DOM helpers ------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "onclick") node.addEventListener("click", value);
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function showError(id, error) {
  const node = $(id);
  node.textContent = error ? error.message || String(error) : "";
  node.hidden = !error;
}

function show(view) {
  for (const id of ["login-view", "runs-view", "run-view", "playground-view"]) $(id).hidden = id !== view;
  $("nav").hidden = view === "login-view";
  $("nav-runs").setAttribute("aria-pressed", String(view === "runs-view" || view === "run-view"));
  $("nav-playground").setAttribute("aria-pressed", String(view === "playground-view"));
}

// A failed call: a rejected key sends the user back to the login, else it shows in place.
function failed(where, error) {
  if (error instanceof ApiError && error.status === 401) {
    logout();
    showError("login-error", error);
  } else {
    showError(where, error);
  }
}

function humanSize(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 1 : 0)} ${units[unit]}`;
}

function when(iso) {
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? iso : date.toLocaleString();
}

// -- login ------------------------------------------------------------------------------

async function login(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value.trim());
  showError("login-error", null);
  try {
    await loadRuns(); // the key is checked by the first call that needs it
    $("api-key").value = "";
  } catch (error) {
    sessionStorage.removeItem(KEY);
    show("login-view");
    showError("login-error", error);
  }
}

function logout() {
  sessionStorage.removeItem(KEY);
  $("runs").tBodies[0].replaceChildren();
  $("charts").replaceChildren();
  $("pg-results").replaceChildren();
  show("login-view");
}

// -- runs -------------------------------------------------------------------------------

// Throws: login shows the error itself.
async function loadRuns() {
  const runs = await json("/api/v1/runs");
  showError("runs-error", null);
  const rows = runs.slice().reverse().map((run) => el("tr", { "data-run-id": run.run_id },
    el("td", {}, el("button", { type: "button", class: "link", onclick: () => openRun(run.run_id) }, run.run_id)),
    el("td", {}, run.base_model),
    el("td", { class: "num" }, String(run.step)),
    el("td", {}, when(run.created_at))));
  $("runs").tBodies[0].replaceChildren(...rows);
  $("runs-empty").hidden = runs.length > 0;
  show("runs-view");
}

async function refreshRuns() {
  try {
    await loadRuns();
  } catch (error) {
    failed("runs-error", error);
  }
}

async function openRun(runId) {
  $("run-id").textContent = runId;
  $("run-view").dataset.runId = runId;
  showError("run-error", null);
  show("run-view");
  try {
    const path = `/api/v1/runs/${encodeURIComponent(runId)}`;
    const [run, steps] = await Promise.all([json(path), json(`${path}/metrics`)]);
    $("run-summary").textContent =
      `${run.base_model}, LoRA rank ${run.lora_rank}, step ${run.step}, created ${when(run.created_at)}`;
    drawCharts(steps);
    listCheckpoints(run.checkpoints);
    $("run-view").dataset.loaded = runId;
  } catch (error) {
    failed("run-error", error);
  }
}

// -- charts -----------------------------------------------------------------------------

function drawCharts(steps) {
  const series = new Map(); // metric -> [[step, value]], loss first
  series.set("loss", []);
  for (const { step, metrics } of steps) {
    for (const [name, value] of Object.entries(metrics)) {
      if (NOT_CHARTED.has(name) || name.endsWith(":mean")) continue;
      if (!series.has(name)) series.set(name, []);
      series.get(name).push([step, value]);
    }
  }
  const charts = [...series].filter(([, points]) => points.length).map(([name, points]) => lineChart(name, points));
  $("charts").replaceChildren(...charts);
  $("charts-empty").hidden = charts.length > 0;
}

// One metric over steps: a polyline through a <circle> per step (data-step, data-value).
function lineChart(name, points) {
  const W = 560, H = 220, left = 64, right = 16, top = 14, bottom = 34;
  const steps = points.map((p) => p[0]);
  const values = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...steps), Math.max(...steps)];
  let [y0, y1] = [Math.min(...values), Math.max(...values)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const x = (s) => left + ((s - x0) / (x1 - x0)) * (W - left - right);
  const y = (v) => H - bottom - ((v - y0) / (y1 - y0)) * (H - top - bottom);

  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-metric": name,
    "aria-label": `${name} over ${points.length} steps` });
  chart.append(svg("line", { class: "axis", x1: left, y1: H - bottom, x2: W - right, y2: H - bottom }));
  chart.append(svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: H - bottom }));
  const label = (text, attrs) => { const t = svg("text", attrs); t.textContent = text; chart.append(t); };
  for (const v of [y0, (y0 + y1) / 2, y1]) {
    chart.append(svg("line", { class: "grid", x1: left, y1: y(v), x2: W - right, y2: y(v) }));
    label(formatValue(v), { x: left - 6, y: y(v) + 4, "text-anchor": "end" });
  }
  const [first, last] = [Math.min(...steps), Math.max(...steps)];
  const ticks = last - first <= 10 ? steps : [first, Math.round((first + last) / 2), last];
  for (const s of new Set(ticks)) {
    label(String(s), { x: x(s), y: H - bottom + 18, "text-anchor": "middle" });
  }
  label("step", { x: W - right, y: H - 4, "text-anchor": "end", class: "axis-label" });
  chart.append(svg("polyline", { class: "line", points: points.map(([s, v]) => `${x(s)},${y(v)}`).join(" ") }));
  for (const [s, v] of points) {
    const dot = svg("circle", { class: "point", cx: x(s), cy: y(v), r: 3.5, "data-step": s, "data-value": v });
    const tip = svg("title");
    tip.textContent = `step ${s}: ${name} = ${formatValue(v)}`;
    dot.append(tip);
    chart.append(dot);
  }
  return el("figure", { class: "chart-box" }, el("figcaption", {}, name), chart);
}

function formatValue(v) {
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(Number(v.toPrecision(4)));
}

// -- checkpoints ------------------------------------------------------------------------

function listCheckpoints(checkpoints) {
  const rows = checkpoints.map((c) => el("tr", { "data-path": c.path },
    el("td", { title: c.path }, c.name),
    el("td", {}, c.kind),
    el("td", { class: "num", title: `${c.size_bytes} bytes` }, humanSize(c.size_bytes)),
    el("td", {}, when(c.created_at)),
    el("td", { class: "actions" },
      el("button", { type: "button", class: "download", onclick: (e) => download(c, e.currentTarget) }, "Download"),
      el("button", { type: "button", class: "delete", onclick: () => remove(c) }, "Delete"))));
  $("checkpoints").tBodies[0].replaceChildren(...rows);
  $("checkpoints-empty").hidden = checkpoints.length > 0;
}

// The archive needs the key, so a plain link cannot fetch it: fetch, then save the blob.
async function download(checkpoint, button) {
  button.disabled = true;
  try {
    const response = await api(`/api/v1/checkpoints/archive?path=${encodeURIComponent(checkpoint.path)}`);
    const url = URL.createObjectURL(await response.blob());
    const name = checkpoint.path.replace("trio://", "").replaceAll("/", "-") + ".tar";
    const link = el("a", { href: url, download: name, hidden: "" });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000); // after the browser has read it
  } catch (error) {
    failed("run-error", error);
  } finally {
    button.disabled = false;
  }
}

async function remove(checkpoint) {
  if (!window.confirm(`Delete checkpoint ${checkpoint.path}? This cannot be undone.`)) return;
  try {
    await api(`/api/v1/checkpoints?path=${encodeURIComponent(checkpoint.path)}`, { method: "DELETE" });
    await openRun($("run-view").dataset.runId);
  } catch (error) {
    failed("run-error", error);
  }
}

// -- playground (the OpenAI-compatible endpoints) ----------------------------------------

async function openPlayground() {
  show("playground-view");
  showError("pg-error", null);
  try {
    const models = (await json("/openai/v1/models")).data.map((m) => m.id);
    const select = $("pg-model");
    const chosen = select.value;
    const group = (label, ids) => el("optgroup", { label }, ...ids.map((id) => el("option", { value: id }, id)));
    const checkpoints = models.filter((id) => id.includes("://"));
    select.replaceChildren(group("Base models", models.filter((id) => !id.includes("://"))),
      ...(checkpoints.length ? [group("Your sampler checkpoints", checkpoints)] : []));
    if (models.includes(chosen)) select.value = chosen;
    select.dataset.loaded = "true";
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      error.message = "This server has no OpenAI-compatible endpoints (/openai/v1): the playground needs them.";
    }
    failed("pg-error", error);
  }
}

async function complete(event) {
  event.preventDefault();
  const button = $("pg-submit");
  button.disabled = true;
  showError("pg-error", null);
  $("pg-results").replaceChildren();
  $("pg-usage").textContent = "";
  const number = (id) => Number($(id).value);
  const body = {
    model: $("pg-model").value,
    prompt: $("pg-prompt").value,
    temperature: number("pg-temperature"),
    top_p: number("pg-top-p"),
    max_tokens: number("pg-max-tokens"),
    n: number("pg-n"),
  };
  try {
    const out = await json("/openai/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const items = out.choices.map((c) => el("li", { class: "completion", "data-index": c.index },
      el("pre", {}, el("span", { class: "prompt" }, body.prompt), c.text),
      el("small", { class: "muted" }, `finish_reason: ${c.finish_reason}`)));
    $("pg-results").replaceChildren(...items);
    if (out.usage) {
      $("pg-usage").textContent =
        `${out.usage.prompt_tokens} prompt tokens, ${out.usage.completion_tokens} completion tokens`;
    }
  } catch (error) {
    failed("pg-error", error);
  } finally {
    button.disabled = false;
  }
}

// -- start ------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("nav-runs").addEventListener("click", refreshRuns);
  $("refresh-runs").addEventListener("click", refreshRuns);
  $("back-to-runs").addEventListener("click", refreshRuns);
  $("refresh-run").addEventListener("click", () => openRun($("run-view").dataset.runId));
  $("nav-playground").addEventListener("click", openPlayground);
  $("playground-form").addEventListener("submit", complete);
  if (sessionStorage.getItem(KEY)) refreshRuns(); // a reload keeps the session
  else show("login-view");
});
