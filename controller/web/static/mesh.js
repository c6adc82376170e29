// The mesh page: polls the controller's REST API and redraws. No framework, no build step;
// the charts are uPlot (vendor/uplot/, loaded before this file as the global `uPlot`).
// Data is put into the page with textContent only (job names and messages are user input).
// Styles go through the CSSOM, never a style attribute: the page's CSP allows no inline style.
"use strict";

const params = new URLSearchParams(location.search);
const INTERVAL_MS = Number(params.get("interval")) || 1000;
const HISTORY_POINTS = 1000; // a chart's points: the controller downsamples the history to it
// The history is read again at most every HISTORY_MS, and less often the longer it is (each
// read walks the whole stored history on the controller): 10 s at 100,000 points.
const HISTORY_MS = Math.max(INTERVAL_MS, 2000);
const historyEvery = (hist) => Math.max(HISTORY_MS, hist.total_points / 10);
const STATES = ["healthy", "straggler", "dead", "recovering", "spare", "starting", "done", "stopped"];
// the goodput ledger's parts (GET /v1/jobs/{id}: goodput.parts, each `<part>_s`), in its order
const PARTS = ["productive", "redone", "recovery", "checkpoint", "snapshot", "eval", "waiting", "suspended"];

// hist: the history document the charts show (GET /v1/jobs/{id}/history); histKey: what the
// job looked like when it was read (a new step, checkpoint or recovery calls for a new read)
const view = { job: null, events: [], lastEvent: "-", hist: null, histKey: "", histAt: 0, charts: {} };
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
  const f = job.straggler; // a straggler reported rather than replaced, in this generation
  if (s === "straggler" || (f && s === "running" && f.rank === rank.rank && f.generation === job.generation)) {
    return "straggler";
  }
  if (s === "failed" || s === "lost") return "dead";
  if (job.phase === "Recovering") return "recovering";
  if (s === "running") return "healthy";
  if (s === "succeeded") return "done";
  if (s === "stopped" || s === "suspended") return "stopped"; // suspended: committed, off
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
  view.hist = null;
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

// Each replica's dp index in the submitted layout, by its dp coordinate now: a shrink
// renumbers the replicas it keeps, and the page still names each where it was submitted.
function labelsOf(labels, dp) {
  return labels && labels.length === dp ? labels : [...Array(dp).keys()];
}

// The recovery from a fault that is still open: until its new generation trains (the job is
// Running again) the page draws the layout the fault struck, not the new one.
function openFault(job) {
  const rec = (job.recoveries || []).at(-1);
  return job.phase === "Recovering" && rec && rec.faults.length && rec.completed_at == null &&
    rec.from_shape ? rec : null;
}

// The cells to draw, as replicas: [{d, label, cells: [{coord, rank, worker, state, text, title}]}]
function currentLayout(job) {
  const { dp, pp, tp } = job.mesh.shape;
  const labels = labelsOf(job.mesh.dp_labels, dp);
  const byCoord = new Map(job.mesh.ranks.map((r) => [`${r.coord.dp},${r.coord.pp},${r.coord.tp}`, r]));
  return { pp, tp, replicas: labels.map((label, d) => ({ d, label, cells: cellsOf(pp, tp, d, (p, t) => {
    const r = byCoord.get(`${d},${p},${t}`);
    if (!r) return { state: "starting", title: "unassigned" };
    return rankCell(r, displayState(r, job), r.state, `dp ${label}`);
  }) })) };
}

// The fault's generation, each faulted rank red at its old coordinate with its cause; a
// replica the new generation kept shows its rank there (recovering), a dropped one stopped.
function faultedLayout(job, rec) {
  const [dp, pp, tp] = rec.from_shape;
  const labels = labelsOf(rec.from_dp_labels, dp);
  const faults = new Map(rec.faults.map((f) => [`${f.coord.dp},${f.coord.pp},${f.coord.tp}`, f]));
  const now = labelsOf(job.mesh.dp_labels, job.mesh.shape.dp);
  const same = job.mesh.shape.pp === pp && job.mesh.shape.tp === tp;
  const kept = new Map(same ? job.mesh.ranks.map((r) => [`${now[r.coord.dp]},${r.coord.pp},${r.coord.tp}`, r]) : []);
  return { pp, tp, replicas: labels.map((label, d) => ({ d, label, cells: cellsOf(pp, tp, d, (p, t) => {
    const rank = (d * pp + p) * tp + t;
    const f = faults.get(`${d},${p},${t}`);
    if (f) {
      return { rank, worker: f.worker, state: "dead", cause: f.cause, text: f.cause,
        title: `rank ${rank} (dp ${label} pp=${p} tp=${t}) on ${f.worker}: ${f.cause}\n${f.detail}` };
    }
    const r = kept.get(`${label},${p},${t}`);
    if (r) return rankCell(r, displayState(r, job), r.state, `dp ${label}`);
    return { rank, state: "stopped", text: "dropped",
      title: `rank ${rank} (dp ${label}): its replica left the mesh with rank ${rec.faults[0].rank}` };
  }) })) };
}

function cellsOf(pp, tp, d, make) {
  const cells = [];
  for (let p = 0; p < pp; p++) for (let t = 0; t < tp; t++) cells.push({ coord: `${d},${p},${t}`, ...make(p, t) });
  return cells;
}

function rankCell(r, state, text, where) {
  return { rank: r.rank, worker: r.worker, state, text,
    title: `rank ${r.rank} (${where} pp=${r.coord.pp} tp=${r.coord.tp}${r.coord.ep != null ? ` ep=${r.coord.ep}` : ""})` +
      ` on ${r.worker}: ${r.state}` + (r.step != null ? `, step ${r.step}` : "") + (r.error ? `\n${r.error}` : "") };
}

function renderMesh(job) {
  const rec = openFault(job);
  const { pp, tp, replicas } = rec ? faultedLayout(job, rec) : currentLayout(job);
  const ep = job.mesh.shape.ep;
  // with experts split over ep, each replica holds one expert shard of ep
  const shard = (d) => (ep ? ` · experts ${d % ep + 1}/${ep}` : "");
  const blocks = replicas.sort((a, b) => a.label - b.label).map(({ d, label, cells }) => {
    const grid = el("div", { class: "grid", style: { gridTemplateColumns: `repeat(${tp}, auto)` } },
      ...cells.map((c) => el("div", {
        class: `cell state-${c.state}`,
        data: { rank: c.rank ?? "", state: c.state, coord: c.coord, worker: c.worker || "", cause: c.cause || "" },
        title: c.title,
      }, el("b", {}, c.rank != null ? `r${c.rank}` : "?"), el("div", { class: "sub" }, c.worker || ""),
        el("div", { class: "sub" }, c.text || ""))));
    return el("div", { class: "replica", data: { dp: label } },
      el("h4", {}, `dp ${label} · pp×tp ${pp}×${tp}${shard(d)}`), grid);
  });
  const spares = job.mesh.spares || [];
  if (spares.length) {
    const grid = el("div", { class: "grid", style: { gridTemplateColumns: `repeat(${spares.length}, auto)` } },
      ...spares.map((w) => el("div", { class: "cell state-spare", data: { state: "spare", worker: w },
        title: `spare worker ${w}` }, el("b", {}, "spare"), el("div", { class: "sub" }, w))));
    blocks.push(el("div", { class: "replica spares" }, el("h4", {}, "spares"), grid));
  }
  document.getElementById("mesh").replaceChildren(...blocks);
}

function renderMeta(job) {
  document.getElementById("job-title").textContent = `${job.name} (${job.id})`;
  const ck = job.last_checkpoint ? `checkpoint step ${job.last_checkpoint.step}` : "no checkpoint yet";
  const parts = [job.phase, `generation ${job.generation}`, `restarts ${job.restarts}`,
    `step ${job.step}/${job.steps}`, job.loss != null ? `loss ${job.loss.toFixed(4)}` : null,
    job.eval_loss != null ? `eval loss ${job.eval_loss.toFixed(4)}` +
      (job.eval_perplexity != null ? ` (perplexity ${job.eval_perplexity.toFixed(2)})` : "") +
      ` at step ${job.eval_step}` : null,
    job.epoch != null ? `epoch ${job.epoch}` : null,
    job.tokens_per_s != null ? `${Math.round(job.tokens_per_s).toLocaleString()} tok/s` : null, ck];
  const meta = document.getElementById("job-meta");
  meta.textContent = parts.filter(Boolean).join(" · ");
  meta.dataset.phase = job.phase;
}

// The goodput ledger as one stacked bar: each part as wide as its share of the job's wall time
// since admission, the ETTR before it and each part's share after it; hover tells the seconds.
function renderGoodput(job) {
  const g = job.goodput;
  const shown = g && g.wall_s > 0 ? PARTS.filter((p) => g.parts[`${p}_s`] > 0) : [];
  const share = (p) => `${(100 * g.parts[`${p}_s`] / g.wall_s).toFixed(1)}%`;
  document.getElementById("goodput").replaceChildren(...(shown.length ? [
    el("span", { class: "ettr" }, `ETTR ${g.ettr != null ? g.ettr.toFixed(2) : "-"}`),
    el("span", { class: "bar" }, ...shown.map((p) => el("span", {
      class: `seg part-${p}`, data: { part: p, seconds: String(g.parts[`${p}_s`]) },
      title: `${p}: ${g.parts[`${p}_s`].toFixed(1)} s, ${share(p)} of ${g.wall_s.toFixed(0)} s`,
      style: { flexGrow: String(g.parts[`${p}_s`]) } }))),
    ...shown.map((p) => el("span", { class: `key part-${p}` }, `${p} ${share(p)}`)),
  ] : []));
}

// The whole history, not what this page happened to poll: it is read from the controller, so
// a page opened at step 90 shows steps 1..90. Read again only when the job moved on.
async function pullHistory(job) {
  const ck = job.last_checkpoint ? job.last_checkpoint.step : "";
  const key = `${job.step}/${job.generation}/${ck}/${(job.recoveries || []).length}/${job.phase}`;
  const fresh = view.hist && view.hist.id === job.id;
  if (fresh && (key === view.histKey || Date.now() - view.histAt < historyEvery(view.hist))) return;
  const hist = await get(`/v1/jobs/${job.id}/history?max_points=${HISTORY_POINTS}`);
  if (job.id !== view.job) return;
  Object.assign(view, { hist, histKey: key, histAt: Date.now() });
  renderCharts(hist);
}

// x must ascend for uPlot. A step redone after a restore appears twice in the history; the
// later generation's point stands (the earlier one's work was lost with its generation).
// Every point carries the job's latest eval then, measured at its eval_step: the eval series is
// keyed by eval_step (the same eval on many points is one), on the steps' x axis.
function seriesOf(points) {
  const byStep = new Map(), evals = new Map();
  for (const p of points) {
    byStep.set(p.step, p);
    if (p.eval_step != null) evals.set(p.eval_step, p.eval_loss);
  }
  const steps = [...new Set([...byStep.keys(), ...evals.keys()])].sort((a, b) => a - b);
  const pick = (field) => steps.map((s) => byStep.get(s)?.[field] ?? null);
  return { steps, loss: pick("loss"), tps: pick("tokens_per_s"),
    evalLoss: steps.map((s) => evals.get(s) ?? null) };
}

// A recovery is marked where its fault struck (the furthest step completed then), a checkpoint
// at the step it saved. A recovery's mark names its cause and action; a planned grow is not a
// fault and is drawn in another colour and shape (mesh.css).
function marksOf(hist) {
  return [
    ...hist.recoveries.map((r) => ({ step: r.last_step, kind: r.action === "grow" ? "grow" : "recovery",
      text: `${r.cause} → ${r.action || "deciding"}`,
      label: `recovery ${r.n}: ${r.cause}` + (r.action ? `, ${r.action}` : "") +
        (r.resumed_step != null ? `, resumed at step ${r.resumed_step}` : "") })),
    ...hist.checkpoints.map((c) => ({ step: c.step, kind: "checkpoint",
      label: `checkpoint at step ${c.step} (generation ${c.generation})` })),
  ];
}

// The marks are elements over the plot (hover shows what happened), moved on every redraw.
function placeMarks(u) {
  for (const { step, node } of u.marks || []) {
    const x = u.valToPos(step, "x");
    node.hidden = !(x >= -1 && x <= u.over.clientWidth + 1); // NaN (no data yet) hides it too
    node.style.left = `${x}px`;
  }
}

function setMarks(u, marks) {
  for (const { node } of u.marks || []) node.remove();
  u.marks = marks.map((m) => {
    const node = el("div", { class: `mark mark-${m.kind}`, title: m.label,
      data: { step: String(m.step), kind: m.kind } }, ...(m.text ? [el("span", { class: "mark-label" }, m.text)] : []));
    u.over.append(node);
    return { step: m.step, node };
  });
  placeMarks(u);
}

function chartWidth(box) {
  return Math.max(240, box.clientWidth);
}

// The x range covers the marks too: a fault at the newest step is marked before the steps
// after it arrive.
function xRange(u, lo, hi) {
  const steps = (u.marks || []).map((m) => m.step).concat([lo, hi].filter((v) => v != null));
  if (!steps.length) return [0, 1];
  const [a, b] = [Math.min(...steps), Math.max(...steps)];
  return a === b ? [a - 1, b + 1] : [a, b];
}

// lines: [label, stroke] of each y series. spanGaps: a series has no value at the other
// series' steps (nor at a step the controller's passes skipped).
function makeChart(boxId, ...lines) {
  const box = document.getElementById(boxId);
  return new uPlot({
    width: chartWidth(box), height: 180,
    scales: { x: { time: false, range: xRange } },
    axes: [{ label: "step" }, { size: 64 }],
    series: [{ label: "step" },
      ...lines.map(([label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: true }))],
    hooks: { draw: [placeMarks] },
  }, [[], ...lines.map(() => [])], box);
}

function renderCharts(hist) {
  if (!view.charts.loss) {
    view.charts.loss = makeChart("loss-chart", ["loss", "#1565c0"], ["eval loss", "#ef6c00"]);
    view.charts.tps = makeChart("tps-chart", ["tokens/s", "#6a1b9a"]);
  }
  const { steps, loss, tps, evalLoss } = seriesOf(hist.points);
  const marks = marksOf(hist);
  for (const [u, ...ys] of [[view.charts.loss, loss, evalLoss], [view.charts.tps, tps]]) {
    setMarks(u, marks); // first: the new data's x range takes them in
    u.setData([steps, ...ys]);
  }
  const shown = hist.points.length < hist.total_points
    ? `${hist.points.length.toLocaleString()} shown (each the last of its run of steps)` : "all shown";
  document.getElementById("chart-note").textContent = hist.total_points
    ? `${hist.total_points.toLocaleString()} points recorded, ${shown}; ` +
      `${hist.recoveries.filter((r) => r.action !== "grow").length} fault recoveries (red), ` +
      `${hist.recoveries.filter((r) => r.action === "grow").length} grows (blue), ` +
      `${hist.checkpoints.length} checkpoints (green)`
    : "waiting for steps…";
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
  list.replaceChildren(...timelineOf(view.events).reverse().map((e) =>
    el("li", { class: [e.type === "Warning" ? "warning" : "", e.folded ? "folded" : ""].join(" ").trim(),
      data: { reason: e.reason || "", id: e.id, generation: e.generation ?? "", folded: e.folded || "" } },
      el("span", { class: "time" }, new Date(e.time * 1000).toLocaleTimeString()),
      el("span", { class: "reason" }, e.reason || ""),
      el("span", { class: "message" }, e.message || ""))));
}

// The agents' per-worker and per-rank start and stop events (a clean exit among them) fold
// into one line per generation and kind, where the first of them was: otherwise they bury
// the few that tell what happened. Warnings (a rank that died) and the controller's events
// stay one line each.
const FOLDED = {
  TrainerStarted: "started", TrainerKept: "kept", TrainerStopped: "stopped", TrainerExited: "exited",
};
function timelineOf(events) {
  const out = [], groups = new Map();
  for (const e of events) {
    const verb = e.type !== "Warning" && FOLDED[e.reason];
    if (!verb) { out.push(e); continue; }
    const key = `${e.reason}/${e.generation}`;
    if (!groups.has(key)) {
      const g = { ...e, verb, ranks: new Set(), workers: new Set(), folded: 0 };
      groups.set(key, g);
      out.push(g);
    }
    const g = groups.get(key);
    g.folded += 1;
    g.workers.add(e.source);
    ranksIn(e.message).forEach((r) => g.ranks.add(r));
    const n = g.ranks.size || g.folded, w = g.workers.size;
    g.message = `generation ${e.generation}: ${n} rank${n === 1 ? "" : "s"} ${verb}` +
      ` on ${w} worker${w === 1 ? "" : "s"}` + (verb === "exited" ? " (code 0)" : "");
  }
  return out;
}

// "... started ranks [0, 1] (pids ...)", "... stopped ranks [2]", "rank 3 on worker ..."
function ranksIn(message) {
  const list = /ranks \[([\d, ]*)\]/.exec(message || "");
  if (list) return list[1].split(",").filter((x) => x.trim()).map(Number);
  const one = /^rank (\d+) /.exec(message || "");
  return one ? [Number(one[1])] : [];
}

async function tick() {
  const status = document.getElementById("status");
  try {
    const { jobs } = await get("/v1/jobs?limit=50");
    // the token works: no form (a tick that began before the token came may have shown it)
    document.getElementById("login").hidden = true;
    const wanted = selectedFromHash();
    if (wanted) select(wanted);
    else if (!view.job && jobs.length) {
      const open = jobs.filter((j) => ["Pending", "Running", "Recovering", "Suspended"].includes(j.phase));
      select((open.length ? open : jobs)[(open.length ? open : jobs).length - 1].id);
    }
    renderJobs(jobs);
    if (view.job) {
      const id = view.job;
      const job = await get(`/v1/jobs/${id}`);
      if (id === view.job) {
        renderMeta(job);
        renderGoodput(job);
        renderMesh(job);
        await pullHistory(job);
        await pullEvents(id);
      }
    }
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
window.addEventListener("resize", () => {
  for (const u of Object.values(view.charts)) {
    u.setSize({ width: chartWidth(u.root.parentElement), height: 180 });
  }
});
takeTokenFromFragment();
renderLegend();
refresh();
setInterval(refresh, INTERVAL_MS);
