// ds4's cache page: reads GET /ui/data every REFRESH_MS and draws it. Plain
// JavaScript, no library. With keys, the key typed in is kept in this
// page's memory only and sent as a bearer token; never in the URL, never stored.
"use strict";

const REFRESH_MS = 1000;
let apiKey = null;
let timer = null;

const $ = (id) => document.getElementById(id);

function text(tag, value, cls) {
  const el = document.createElement(tag);
  el.textContent = value;
  if (cls) el.className = cls;
  return el;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + " %"; }

function setStatus(msg, isError) {
  const s = $("status");
  s.textContent = msg;
  s.className = isError ? "error" : "";
}

async function load() {
  const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  let r;
  try {
    r = await fetch("/ui/data", { headers, cache: "no-store" });
  } catch (e) {
    setStatus("server unreachable", true);
    return;
  }
  if (r.status === 401) {
    stop();
    apiKey = null;
    $("main").hidden = true;
    $("key-form").hidden = false;
    $("key-error").textContent = "that key was refused";
    setStatus("a key is needed", true);
    return;
  }
  if (!r.ok) { setStatus("error " + r.status, true); return; }
  render(await r.json());
}

function render(d) {
  document.body.className = d.operator ? "operator" : "tenant";
  $("main").hidden = false;
  $("key-form").hidden = true;
  const who = d.operator ? "operator view" : "tenant " + d.tenant;
  setStatus(who + ", updated " + new Date(d.now * 1000).toLocaleTimeString(), false);
  tiles(d);
  chart(d.series, d.bin_s);
  turns(d.recent, d.operator);
  if (d.operator) {
    checkpoints(d.checkpoints);
    skips(d.save_skipped);
    tenants(d.tenants_bytes, d.budget_bytes);
    bars("models", d.models_bytes, d.budget_bytes, (name, u) => [u.label + " (" + name + ")", ", " + u.hits + " hits"]);
    sessions(d.sessions);
  }
}

function tiles(d) {
  const t = d.totals;
  $("t-turns").textContent = t.turns;
  $("t-hit").textContent = t.prompt ? pct(t.cached / t.prompt) : "-";
  const ttfts = d.recent.filter((x) => x.finish !== "cancelled").map((x) => x.ttft_ms).sort((a, b) => a - b);
  $("t-ttft").textContent = ttfts.length ? ttfts[Math.floor(ttfts.length / 2)].toFixed(1) + " ms" : "-";
  if (d.operator) {
    $("t-queued").textContent = d.queued + (d.busy ? " (busy)" : "");
    $("t-disk").textContent = d.kv ? bytes(d.kv.bytes) + " / " + bytes(d.budget_bytes) : "off";
    $("t-written").textContent = d.writes ? written(d.writes) : "-";
    $("t-written").title = d.writes ? Object.entries(d.writes.by_reason).map(([r, n]) => r + ": " + bytes(n)).join("\n") : "";
  }
}

// The saves' bytes since the start; the last 24 hours against a write budget; the blocks' dedup ratio.
function written(w) {
  const total = Object.values(w.by_reason).reduce((a, n) => a + n, 0);
  let out = bytes(total);
  if (w.write_budget_bytes) out += ", 24 h " + bytes(w.written_day_bytes) + " / " + bytes(w.write_budget_bytes);
  if (w.block_bytes) out += ", dedup " + w.dedup_ratio.toFixed(2) + "x";
  return out;
}

// The chart: hit rate (0-100 %, bars) and median TTFT (a line, its own scale) per bin.
function chart(series, binS) {
  const c = $("chart");
  const g = c.getContext("2d");
  const W = c.width, H = c.height, L = 44, R = 56, T = 12, B = 24;
  const w = W - L - R, h = H - T - B;
  g.clearRect(0, 0, W, H);
  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = "#dde1e6";
  g.fillStyle = "#5b6675";
  for (let i = 0; i <= 4; i += 1) {
    const y = T + h - (h * i) / 4;
    g.beginPath(); g.moveTo(L, y); g.lineTo(L + w, y); g.stroke();
    g.fillText(25 * i + "%", 6, y + 4);
  }
  const n = series.length;
  const bw = w / n;
  const maxT = Math.max(1, ...series.map((b) => b.ttft_ms || 0));
  let points = 0;
  g.fillStyle = "rgba(23, 92, 211, 0.55)";
  series.forEach((b, i) => {
    if (b.hit_rate === null) return;
    const bh = Math.max(1, h * b.hit_rate);
    g.fillRect(L + i * bw + 1, T + h - bh, bw - 2, bh);
    points += 1;
  });
  g.strokeStyle = "#b54708";
  g.fillStyle = "#b54708";
  g.lineWidth = 2;
  g.beginPath();
  let started = false;
  series.forEach((b, i) => {
    if (b.ttft_ms === null) return;
    const x = L + (i + 0.5) * bw, y = T + h - (h * b.ttft_ms) / maxT;
    if (started) g.lineTo(x, y); else g.moveTo(x, y);
    started = true;
    g.fillRect(x - 2, y - 2, 4, 4);
  });
  g.stroke();
  g.lineWidth = 1;
  g.fillText(maxT.toFixed(1) + " ms", L + w + 6, T + 8);
  g.fillText("0 ms", L + w + 6, T + h);
  g.fillStyle = "#5b6675";
  g.fillText("-" + Math.round((n * binS) / 60) + " min", L, H - 6);
  g.fillText("now", L + w - 20, H - 6);
  $("chart-legend").textContent = "bars: hit rate (cached / prompt tokens) per " + binS + " s; line: median TTFT";
  c.dataset.points = String(points);
  c.dataset.draws = String(Number(c.dataset.draws) + 1);
}

function turns(recent, operator) {
  const body = $("turns").tBodies[0];
  body.replaceChildren();
  for (const t of recent) {
    const tr = document.createElement("tr");
    tr.append(text("td", new Date(t.t * 1000).toLocaleTimeString()), text("td", t.protocol));
    if (operator) tr.append(text("td", t.tenant, "op"));
    const rung = t.snapshot == null ? t.rung : t.rung + " (snapshot " + t.snapshot + ")";
    tr.append(text("td", rung, "rung-" + t.rung), text("td", t.cached + " / " + t.prompt));
    // from the request's arrival; the part it waited before its turn began in brackets
    const q = t.queue_ms || 0;
    tr.append(text("td", t.ttft_ms.toFixed(1) + (q >= 1 ? " (queued " + q.toFixed(0) + ")" : "")));
    const dv = t.divergence;
    tr.append(text("td", dv ? "token " + dv.token + ", byte " + dv.byte + " (" + dv.against + ")" : "-"));
    const sk = t.save_skipped || [];
    const said = sk.map((s) => s.kind + " save skipped: " + s.code + " (" + s.detail + ")");
    tr.append(text("td", said.length ? said.join("; ") : "-", said.length ? "skipped" : ""));
    body.append(tr);
  }
}

// The saves the turns did not make, by code (then by kind), since the server started.
function skips(byCode) {
  const body = $("skips").tBodies[0];
  body.replaceChildren();
  const codes = Object.keys(byCode || {}).sort();
  if (!codes.length) {
    const tr = document.createElement("tr");
    const td = text("td", "none");
    td.colSpan = 3;
    tr.append(td);
    body.append(tr);
    return;
  }
  for (const code of codes) {
    const kinds = Object.entries(byCode[code]).sort();
    const n = kinds.reduce((sum, kc) => sum + kc[1], 0);
    const tr = document.createElement("tr");
    tr.append(text("td", code), text("td", n), text("td", kinds.map((kc) => kc[0] + " " + kc[1]).join(", ")));
    body.append(tr);
  }
}

function checkpoints(table) {
  const head = $("checkpoints").tHead, body = $("checkpoints").tBodies[0];
  head.replaceChildren();
  body.replaceChildren();
  if (!table) return;
  const edges = table.age_edges_s.map((s) => (s >= 3600 ? s / 3600 + " h" : s / 60 + " min"));
  const hr = document.createElement("tr");
  hr.append(text("th", "reason"), text("th", "checkpoints"), text("th", "bytes"));
  edges.forEach((e) => hr.append(text("th", "< " + e)));
  hr.append(text("th", ">= " + edges[edges.length - 1]));
  head.append(hr);
  for (const [reason, r] of Object.entries(table.by_reason)) {
    const tr = document.createElement("tr");
    tr.append(text("td", reason), text("td", r.checkpoints), text("td", bytes(r.bytes)));
    r.ages.forEach((n) => tr.append(text("td", n)));
    body.append(tr);
  }
}

function tenants(byTenant, budget) {
  $("budget").textContent = budget ? "of a " + bytes(budget) + " budget" : "";
  bars("tenants", byTenant, budget, (name) => [name, ""]);
}

// one bar per name: its bytes against the budget; label(name, u) gives the
// name shown and what follows the checkpoint count
function bars(id, byName, budget, label) {
  const box = $(id);
  box.replaceChildren();
  for (const [key, u] of Object.entries(byName || {})) {
    const [name, more] = label(key, u);
    const row = document.createElement("div");
    row.className = "bar";
    const track = document.createElement("div");
    track.className = "track";
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.width = budget ? Math.min(100, (100 * u.bytes) / budget).toFixed(2) + "%" : "0";
    track.append(fill);
    row.append(text("span", name, "name"), track, text("span", bytes(u.bytes) + ", " + u.checkpoints + " checkpoints" + more));
    box.append(row);
  }
}

function sessions(list) {
  $("sessions-section").hidden = !list;
  const body = $("sessions").tBodies[0];
  body.replaceChildren();
  for (const s of list || []) {
    const tr = document.createElement("tr");
    const last = s.last_used ? new Date(s.last_used * 1000).toLocaleTimeString() : "-";
    tr.append(text("td", s.index), text("td", s.tenant), text("td", s.valid ? "yes" : "no"));
    tr.append(text("td", s.tokens), text("td", s.served), text("td", last));
    body.append(tr);
  }
}

function start() {
  stop();
  load();
  timer = setInterval(load, REFRESH_MS);
}

function stop() {
  if (timer !== null) clearInterval(timer);
  timer = null;
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const k = $("key").value.trim();
    if (!k) { $("key-error").textContent = "enter a key"; return; }
    apiKey = k;
    $("key").value = "";
    $("key-error").textContent = "";
    start();
  });
  if (document.body.dataset.needsKey === "true") {
    $("key-form").hidden = false;
    setStatus("a key is needed", false);
  } else {
    start();
  }
});
