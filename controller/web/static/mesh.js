// The mesh page: polls the controller's REST API and redraws. No framework, no build step.
// Data is put into the page with textContent only (job names and messages are user input).
// Styles go through the CSSOM, never a style attribute: the page's CSP allows no inline style.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Number(params.get("interval")) || 1000;
const HISTORY = 2000; // chart points kept per job
const STATES = ["healthy", "straggler", "dead", "recovering", "spare", "starting", "done", "stopped"];

const view = { job: null, history: new Map(), events: [], lastEvent: "-" };
const TOKEN_KEY = "meshkeeper-token";

// The API token (viewer is enough) comes once in the URL fragment, which browsers never send
// to a server: /ui/#token=T (also #/jobs/ID&token=T). It moves to sessionStorage (this tab
// only) and out of the address bar and history; or the user pastes it into the form.
function takeTokenFromFragment() {
  const parts = location.hash.slice(1).split("&");
  const given = parts.find((p) => p.startsWith("token="));
  if (given === undefined) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(given.slice("token=".length)));
  const rest = parts.filter((p) => p && !p.startsWith("token=")).join("&");
  history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
}

class Unauthorized extends Error {}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "data") Object.entries(v).forEach(([dk, dv]) => (e.dataset[dk] = dv));
    else if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

// Relative to the page (/ui/ -> ..), so the page also works behind a path-prefix proxy.
async function get(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const r = await fetch(new URL(`..${path}`, location.href), { cache: "no-store", headers });
  if (r.status === 401 || r.status === 403) {
    throw new Unauthorized(token ? "this token may not read jobs (it needs the viewer role)" : "an API token is needed");
  }
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function askForToken(reason) {
  const form = document.getElementById("login");
  document.getElementById("status").textContent = reason;
  if (!form.hidden) return;
  form.hidden = false;
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token");
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    form.hidden = true;
    refresh();
  };
}

// What a cell shows: the rank's reported state, read in the light of the job's phase.
function displayState(rank, job) {
  const s = rank.state;
  const f = job.flagged; // a straggler reported rather than replaced, in this generation
  if (s === "straggler" || (f && s === "running" && f.rank === rank.rank && f.generation === job.generation)) {
    return "straggler";
  }
  if (s === "failed" || s === "lost") return "dead";
  if (job.phase === "Recovering") return "recovering";
  if (s === "running") return "healthy";
  if (s === "succeeded") return "done";
  if (s === "stopped") return "stopped";
  return job.generation > 1 ? "recovering" : "starting"; // assigned / starting
}

function selectedFromHash() {
  const m = location.hash.match(/^#\/jobs\/([a-z0-9-]+)$/);
  return m ? m[1] : null;
}

function select(id) {
  if (id === view.job) return;
  view.job = id;
  view.events = [];
  view.lastEvent = "-";
  document.getElementById("timeline").replaceChildren();
  if (selectedFromHash() !== id) history.replaceState(null, "", `#/jobs/${id}`);
}

function renderJobs(jobs) {
  const list = document.getElementById("job-list");
  list.replaceChildren(...jobs.slice().reverse().map((j) =>
    el("li", { class: j.id === view.job ? "selected" : "", data: { job: j.id } },
      el("span", { class: "phase" }, j.phase),
      el("div", {}, j.name),
      el("div", { class: "muted" }, `${j.id} · step ${j.step}/${j.steps}`))));
  for (const li of list.children) li.onclick = () => { select(li.dataset.job); refresh(); };
}

function renderLegend() {
  document.getElementById("legend").replaceChildren(
    ...STATES.map((s) => el("span", { class: `state-${s}` }, s)));
}

function renderMesh(job) {
  const { dp, pp, tp } = job.mesh.shape;
  const byCoord = new Map(job.mesh.ranks.map((r) => [`${r.coord.dp},${r.coord.pp},${r.coord.tp}`, r]));
  const replicas = [];
  for (let d = 0; d < dp; d++) {
    const grid = el("div", { class: "grid", style: { gridTemplateColumns: `repeat(${tp}, auto)` } });
    for (let p = 0; p < pp; p++) {
      for (let t = 0; t < tp; t++) {
        const r = byCoord.get(`${d},${p},${t}`);
        const state = r ? displayState(r, job) : "starting";
        const cell = el("div", {
          class: `cell state-${state}`,
          data: { rank: r ? r.rank : "", state, coord: `${d},${p},${t}`, worker: r ? r.worker : "" },
          title: r ? `rank ${r.rank} (dp=${d} pp=${p} tp=${t}) on ${r.worker}: ${r.state}` +
            (r.step != null ? `, step ${r.step}` : "") + (r.error ? `\n${r.error}` : "") : "unassigned",
        }, el("b", {}, r ? `r${r.rank}` : "?"), el("div", { class: "sub" }, r ? r.worker : ""),
          el("div", { class: "sub" }, r ? r.state : ""));
        grid.append(cell);
      }
    }
    replicas.push(el("div", { class: "replica" }, el("h4", {}, `dp ${d} · pp×tp ${pp}×${tp}`), grid));
  }
  const spares = job.mesh.spares || [];
  if (spares.length) {
    const grid = el("div", { class: "grid", style: { gridTemplateColumns: `repeat(${spares.length}, auto)` } },
      ...spares.map((w) => el("div", { class: "cell state-spare", data: { state: "spare", worker: w },
        title: `spare worker ${w}` }, el("b", {}, "spare"), el("div", { class: "sub" }, w))));
    replicas.push(el("div", { class: "replica spares" }, el("h4", {}, "spares"), grid));
  }
  document.getElementById("mesh").replaceChildren(...replicas);
}

function renderMeta(job) {
  document.getElementById("job-title").textContent = `${job.name} (${job.id})`;
  const ck = job.last_checkpoint ? `checkpoint step ${job.last_checkpoint.step}` : "no checkpoint yet";
  const parts = [job.phase, `generation ${job.generation}`, `restarts ${job.restarts}`,
    `step ${job.step}/${job.steps}`, job.loss != null ? `loss ${job.loss.toFixed(4)}` : null,
    job.tokens_per_s != null ? `${Math.round(job.tokens_per_s).toLocaleString()} tok/s` : null, ck];
  document.getElementById("job-meta").textContent = parts.filter(Boolean).join(" · ");
}

function record(job) {
  if (!view.history.has(job.id)) view.history.set(job.id, new Map());
  const h = view.history.get(job.id);
  if (job.step > 0 && job.loss != null) h.set(job.step, { loss: job.loss, tps: job.tokens_per_s });
  while (h.size > HISTORY) h.delete(h.keys().next().value);
}

function chart(svgId, points) {
  const svg = document.getElementById(svgId);
  const W = 400, H = 160, L = 46, B = 18;
  const ns = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    Object.entries(attrs).forEach(([k, v]) => e.setAttribute(k, v));
    if (text != null) e.textContent = text;
    return e;
  };
  const kids = [mk("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }),
    mk("line", { class: "axis", x1: L, y1: 0, x2: L, y2: H - B })];
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = (x) => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - 4);
    const sy = (y) => 4 + (y1 > y0 ? (y1 - y) / (y1 - y0) : 0.5) * (H - B - 8);
    kids.push(mk("polyline", { class: "line", points: points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ") }),
      mk("text", { x: 2, y: 12 }, fmt(y1)), mk("text", { x: 2, y: H - B }, fmt(y0)),
      mk("text", { x: L, y: H - 4 }, `step ${x0}`), mk("text", { x: W - 60, y: H - 4 }, `step ${x1}`));
  } else {
    kids.push(mk("text", { x: L + 10, y: H / 2 }, "waiting for steps…"));
  }
  svg.replaceChildren(...kids);
}

function fmt(v) {
  return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString() : v.toPrecision(4);
}

function renderCharts(job) {
  const h = [...(view.history.get(job.id) || new Map()).entries()].sort((a, b) => a[0] - b[0]);
  chart("loss-chart", h.map(([s, p]) => [s, p.loss]));
  chart("tps-chart", h.filter(([, p]) => p.tps != null).map(([s, p]) => [s, p.tps]));
}

async function pullEvents(id) {
  for (;;) { // drain: a burst of events may exceed one page
    const body = await get(`/v1/jobs/${id}/events?after=${view.lastEvent}&limit=200`);
    if (id !== view.job) return;
    view.events.push(...body.events);
    if (body.events.length) view.lastEvent = body.events[body.events.length - 1].id;
    if (body.events.length < 200) break;
  }
  const list = document.getElementById("timeline");
  list.replaceChildren(...view.events.slice().reverse().map((e) =>
    el("li", { class: e.type === "Warning" ? "warning" : "", data: { reason: e.reason || "", id: e.id } },
      el("span", { class: "time" }, new Date(e.time * 1000).toLocaleTimeString()),
      el("span", { class: "reason" }, e.reason || ""),
      el("span", { class: "message" }, e.message || ""))));
}

async function tick() {
  const status = document.getElementById("status");
  try {
    const { jobs } = await get("/v1/jobs?limit=50");
    const wanted = selectedFromHash();
    if (wanted) select(wanted);
    else if (!view.job && jobs.length) {
      const open = jobs.filter((j) => ["Pending", "Running", "Recovering"].includes(j.phase));
      select((open.length ? open : jobs)[(open.length ? open : jobs).length - 1].id);
    }
    renderJobs(jobs);
    if (view.job) {
      const id = view.job;
      const job = await get(`/v1/jobs/${id}`);
      if (id === view.job) {
        record(job);
        renderMeta(job);
        renderMesh(job);
        renderCharts(job);
        await pullEvents(id);
      }
    }
    document.getElementById("login").hidden = true; // a tick that began before the token came may have shown it
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.updated = String(Date.now());
  } catch (err) {
    if (err instanceof Unauthorized) askForToken(err.message);
    else status.textContent = `controller unreachable (${err.message}); retrying`;
  }
}

// One tick at a time: a click during a slow tick asks for another one right after it.
let running = false, again = false;
async function refresh() {
  if (running) { again = true; return; }
  running = true;
  try { await tick(); } finally { running = false; }
  if (again) { again = false; refresh(); }
}

window.addEventListener("hashchange", () => {
  takeTokenFromFragment();
  const id = selectedFromHash();
  if (id) { select(id); refresh(); }
});
takeTokenFromFragment();
renderLegend();
refresh();
setInterval(refresh, INTERVAL_MS);
