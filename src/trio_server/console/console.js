// TRIO console: runs, their metrics and checkpoints, and a sampling playground.
// Plain JS over the service's REST API (no build step, nothing fetched from elsewhere).
// The API key lives in sessionStorage and goes out as "Authorization: Bearer <key>".
// Text from the server is always set as textContent, never parsed as HTML.
"use strict";

const KEY = "trio.apiKey";
const SVG = "http://www.w3.org/2000/svg";

// Bumped at every login and logout: an answer that arrives after it is dropped, so no
// view ever shows what one key read once another key (or none) is in use.
let session = 0;

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
  const key = $("api-key").value.trim();
  if (!/^[\x21-\x7e]+$/.test(key)) { // a header cannot carry it, and no key has such characters
    showError("login-error", new Error("invalid API key"));
    return;
  }
  clearUserViews();
  sessionStorage.setItem(KEY, key);
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
  clearUserViews();
  show("login-view");
}

// Everything a key's calls filled in, and a new session: answers still on their way are dropped.
function clearUserViews() {
  session += 1;
  $("runs").tBodies[0].replaceChildren();
  clearRunView();
  $("pg-results").replaceChildren();
  $("pg-usage").textContent = "";
  $("pg-prompt").value = "";
  $("pg-model").replaceChildren();
  delete $("pg-model").dataset.loaded;
  for (const id of ["runs-error", "run-error", "pg-error"]) showError(id, null);
}

function clearRunView() {
  $("run-summary").textContent = "";
  $("charts").replaceChildren();
  $("checkpoints").tBodies[0].replaceChildren();
  $("charts-empty").hidden = true;
  $("checkpoints-empty").hidden = true;
  delete $("run-view").dataset.loaded;
}

// -- runs -------------------------------------------------------------------------------

// Throws: login shows the error itself.
async function loadRuns() {
  const asked = session;
  const runs = await json("/api/v1/runs");
  if (asked !== session) return; // logged out (or in as someone else) meanwhile
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
  const asked = session;
  if ($("run-view").dataset.runId !== runId) clearRunView(); // never another run's data under this id
  $("run-id").textContent = runId;
  $("run-view").dataset.runId = runId;
  showError("run-error", null);
  show("run-view");
  try {
    const path = `/api/v1/runs/${encodeURIComponent(runId)}`;
    const [run, steps] = await Promise.all([json(path), json(`${path}/metrics`)]);
    if (asked !== session || $("run-view").dataset.runId !== runId) return; // another run or key since
    $("run-summary").textContent =
      `${run.base_model}, LoRA rank ${run.lora_rank}, step ${run.step}, created ${when(run.created_at)}`;
    drawCharts(steps);
    listCheckpoints(run.checkpoints);
    $("run-view").dataset.loaded = runId;
  } catch (error) {
    if (asked === session) failed("run-error", error);
  }
}

// -- charts -----------------------------------------------------------------------------

// Every metric, the loss first: the service's own (tokens, grad_norm, learning_rate, the
// loss function's ":mean" metrics) and the client's (which replace a service value of the same name).
function drawCharts(steps) {
  const series = new Map(); // metric -> [[step, value]]
  series.set("loss", []);
  for (const { step, metrics } of steps) {
    for (const [name, value] of Object.entries(metrics)) {
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
  let [x0, x1] = range(steps);
  let [y0, y1] = range(values);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 = y0 - pad; y1 = y1 + pad; }
  // Halves, so that values near the largest double (1.7e308) do not overflow their difference.
  const x = (s) => left + ((s / 2 - x0 / 2) / (x1 / 2 - x0 / 2)) * (W - left - right);
  const y = (v) => H - bottom - ((v / 2 - y0 / 2) / (y1 / 2 - y0 / 2)) * (H - top - bottom);

  const chart = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "data-metric": name,
    "aria-label": `${name} over ${points.length} steps` });
  chart.append(svg("line", { class: "axis", x1: left, y1: H - bottom, x2: W - right, y2: H - bottom }));
  chart.append(svg("line", { class: "axis", x1: left, y1: top, x2: left, y2: H - bottom }));
  const label = (text, attrs) => { const t = svg("text", attrs); t.textContent = text; chart.append(t); };
  for (const v of [y0, y0 / 2 + y1 / 2, y1]) {
    chart.append(svg("line", { class: "grid", x1: left, y1: y(v), x2: W - right, y2: y(v) }));
    label(formatValue(v), { x: left - 6, y: y(v) + 4, "text-anchor": "end" });
  }
  const [first, last] = range(steps);
  const ticks = last - first <= 10 ? steps : [first, Math.round(first / 2 + last / 2), last];
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

// [min, max] by a loop: Math.min(...xs) overflows the call stack past ~125k values.
function range(xs) {
  let low = Infinity, high = -Infinity;
  for (const v of xs) { if (v < low) low = v; if (v > high) high = v; }
  return [low, high];
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
    if (error instanceof ApiError && error.status === 404) await relist(); // gone already: its row too
  }
}

// The run's checkpoints again, keeping the error shown.
async function relist() {
  const asked = session, runId = $("run-view").dataset.runId;
  try {
    const run = await json(`/api/v1/runs/${encodeURIComponent(runId)}`);
    if (asked === session && $("run-view").dataset.runId === runId) listCheckpoints(run.checkpoints);
  } catch (_) { /* the error already shown says enough */ }
}

// -- playground (the OpenAI-compatible endpoints) ----------------------------------------

async function openPlayground() {
  const asked = session;
  show("playground-view");
  showError("pg-error", null);
  try {
    const models = (await json("/openai/v1/models")).data.map((m) => m.id);
    if (asked !== session) return;
    const select = $("pg-model");
    const chosen = select.value;
    const group = (label, ids) => el("optgroup", { label }, ...ids.map((id) => el("option", { value: id }, id)));
    const checkpoints = models.filter((id) => id.includes("://"));
    select.replaceChildren(group("Base models", models.filter((id) => !id.includes("://"))),
      ...(checkpoints.length ? [group("Your sampler checkpoints", checkpoints)] : []));
    if (models.includes(chosen)) select.value = chosen;
    select.dataset.loaded = "true";
  } catch (error) {
    if (asked !== session) return;
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
  const asked = session;
  const body = { model: $("pg-model").value, prompt: $("pg-prompt").value };
  const fields = { temperature: "pg-temperature", top_p: "pg-top-p", max_tokens: "pg-max-tokens", n: "pg-n" };
  for (const [name, id] of Object.entries(fields)) { // an empty field: the server's default, not 0
    if ($(id).value.trim() !== "") body[name] = Number($(id).value);
  }
  try {
    const out = await json("/openai/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (asked !== session) return;
    const items = out.choices.map((c) => el("li", { class: "completion", "data-index": c.index },
      el("pre", {}, el("span", { class: "prompt" }, body.prompt), c.text),
      el("small", { class: "muted" }, `finish_reason: ${c.finish_reason}`)));
    $("pg-results").replaceChildren(...items);
    if (out.usage) {
      $("pg-usage").textContent =
        `${out.usage.prompt_tokens} prompt tokens, ${out.usage.completion_tokens} completion tokens`;
    }
  } catch (error) {
    if (asked === session) failed("pg-error", error);
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
