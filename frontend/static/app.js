// The playground (OpenAI chat / completions, streamed) and the live batch view (engine step records over
// server-sent events from /v1/batch/stream). Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_STEPS = 40; // columns kept in the batch view

// ------------------------------------------------------------------------------------------- playground

const controllers = new Set();
let requestCounter = 0;

function mode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function showMode() {
  const chat = mode() === "chat";
  $("system-label").hidden = !chat;
  $("prompt-caption").textContent = chat ? "User message" : "Prompt";
}

// With an API key set on the server, every call carries it (the batch stream too: it is read with fetch,
// since EventSource cannot send headers).
function headers(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function loadModels() {
  try {
    const resp = await fetch("v1/models", { headers: headers() });
    const body = await resp.json();
    if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
    const select = $("model");
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    selectWatchedModel();
    $("model-status").textContent = `${body.data.length} model(s) served`;
  } catch (err) {
    $("model-status").textContent = `could not list models: ${err}`;
  }
}

// The playground starts on the model whose batch the view shows.
function selectWatchedModel() {
  const select = $("model");
  if (batch.summary && !select.dataset.touched && [...select.options].some((o) => o.value === batch.summary.model)) {
    select.value = batch.summary.model;
  }
}

function numberParam(body, name, parse) {
  const text = $(name).value.trim();
  if (text !== "") body[name] = parse(text);
}

function parseStop(text) {
  if (text.startsWith("[")) return JSON.parse(text);
  return text.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
}

function requestBody() {
  const body = { model: $("model").value, stream: true, stream_options: { include_usage: true } };
  const prompt = $("prompt").value;
  if (mode() === "chat") {
    const system = $("system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat([{ role: "user", content: prompt }]);
  } else {
    body.prompt = prompt;
  }
  numberParam(body, "temperature", parseFloat);
  numberParam(body, "top_p", parseFloat);
  numberParam(body, "top_k", (t) => parseInt(t, 10));
  numberParam(body, "max_tokens", (t) => parseInt(t, 10));
  numberParam(body, "seed", (t) => parseInt(t, 10));
  const stop = $("stop").value;
  if (stop !== "") body.stop = parseStop(stop);
  return body;
}

function outputCard(number) {
  const card = document.createElement("article");
  card.className = "output";
  card.dataset.state = "waiting";
  card.dataset.chunks = "0";
  card.innerHTML = `<header><b>#${number}</b><span class="state">waiting</span><span class="usage muted"></span></header>
    <pre class="text"></pre>`;
  $("outputs").prepend(card);
  return card;
}

function setState(card, state, note) {
  card.dataset.state = state;
  card.querySelector(".state").textContent = note || state;
}

// Reads an OpenAI server-sent event stream, calling onChunk with each parsed `data:` object until [DONE].
async function readEvents(resp, onChunk) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

async function runRequest(body) {
  const card = outputCard(++requestCounter);
  const text = card.querySelector(".text");
  const controller = new AbortController();
  controllers.add(controller);
  const started = performance.now();
  let firstTokenMs = null;
  try {
    const path = body.messages ? "v1/chat/completions" : "v1/completions";
    const resp = await fetch(path, {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error(`${resp.status}: ${(err.error && err.error.message) || resp.statusText}`);
    }
    setState(card, "streaming");
    let finish = null;
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta ? choice.delta.content || "" : choice.text || "";
        if (delta) {
          if (firstTokenMs === null) firstTokenMs = performance.now() - started;
          text.textContent += delta;
          card.dataset.chunks = String(Number(card.dataset.chunks) + 1);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) {
        const u = chunk.usage;
        card.querySelector(".usage").textContent =
          `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens` +
          (firstTokenMs === null ? "" : `, first token after ${firstTokenMs.toFixed(0)} ms`);
      }
    });
    setState(card, "done", `done (${finish || "?"})`);
  } catch (err) {
    setState(card, controller.signal.aborted ? "stopped" : "error", controller.signal.aborted ? "stopped" : String(err));
  } finally {
    controllers.delete(controller);
  }
}

function send(event) {
  event.preventDefault();
  let body;
  try {
    body = requestBody();
  } catch (err) {
    alert(`Bad parameter: ${err}`);
    return;
  }
  const copies = Math.max(1, Math.min(32, parseInt($("copies").value, 10) || 1));
  for (let i = 0; i < copies; i++) runRequest(structuredClone(body));
}

// ------------------------------------------------------------------------------------------- batch view

const batch = { summary: null, steps: [], requests: new Map(), dropped: { engine: 0, viewer: 0 }, dirty: false };

function seqKey(entry) {
  return `${entry.request_id}#${entry.sample}`;
}

function seqLabel(entry) {
  if (!batch.requests.has(entry.request_id)) batch.requests.set(entry.request_id, batch.requests.size + 1);
  return `req ${batch.requests.get(entry.request_id)}` + (entry.sample ? `.${entry.sample}` : "");
}

function describeEntry(entry) {
  if (entry.kind === "prefill") return `prefill tokens ${entry.start}:${entry.end} of a ${entry.prompt_tokens}-token prompt`;
  if (entry.kind === "verify") return `speculative verification: ${entry.accepted} of ${entry.drafted} drafts accepted`;
  return "decode";
}

function cellText(entry) {
  if (entry.kind === "prefill") return `${entry.start}:${entry.end}`;
  if (entry.kind === "verify") return `${entry.accepted}/${entry.drafted}`;
  return "D";
}

function onRecords(payload) {
  batch.dropped = payload.dropped;
  for (const record of payload.records) {
    if (record.type === "config") {
      batch.summary = record;
      $("batch-model").textContent = `of model ${record.model}`;
      selectWatchedModel();
    } else if (record.type === "error") {
      setBatchStatus("error", record.message);
    } else if (record.type === "step") {
      batch.steps.push(record);
      setBatchStatus("live", "live");
    }
  }
  if (batch.steps.length > MAX_STEPS) batch.steps.splice(0, batch.steps.length - MAX_STEPS);
  batch.dirty = true;
}

function setBatchStatus(state, text) {
  const status = $("batch-status");
  status.dataset.state = state;
  status.textContent = text;
}

function td(text, className, title) {
  const cell = document.createElement("td");
  cell.textContent = text;
  if (className) cell.className = className;
  if (title) cell.title = title;
  return cell;
}

function renderBatch() {
  if (!batch.dirty || $("pause").checked) return;
  batch.dirty = false;
  const steps = batch.steps;
  const grid = $("batch-grid");
  $("batch-empty").hidden = steps.length > 0;

  const head = document.createElement("tr");
  head.append(td("step", "label"));
  for (const s of steps) head.append(td(String(s.step)));
  grid.tHead.replaceChildren(head);

  const rows = new Map(); // seq key -> (step index -> entry), in order of first appearance
  steps.forEach((s, i) => {
    for (const entry of s.seqs) {
      const key = seqKey(entry);
      if (!rows.has(key)) rows.set(key, { label: seqLabel(entry), cells: new Map() });
      rows.get(key).cells.set(i, entry);
    }
  });
  const body = [];
  for (const [key, row] of rows) {
    const tr = document.createElement("tr");
    tr.dataset.seq = key;
    tr.append(td(row.label, "label", key));
    steps.forEach((_, i) => {
      const entry = row.cells.get(i);
      if (!entry) {
        tr.append(td(""));
        return;
      }
      const cell = td(cellText(entry), `cell ${entry.kind}${entry.finished ? " finished" : ""}`, describeEntry(entry));
      cell.dataset.kind = entry.kind;
      if (entry.kind === "prefill") Object.assign(cell.dataset, { start: entry.start, end: entry.end });
      if (entry.kind === "verify") Object.assign(cell.dataset, { drafted: entry.drafted, accepted: entry.accepted });
      tr.append(cell);
    });
    body.push(tr);
  }
  grid.tBodies[0].replaceChildren(...body);

  const foot = [
    ["tokens", (s) => `${s.num_tokens}`, (s) => `${s.num_tokens} of a ${s.token_budget}-token budget`],
    ["KV blocks", (s) => `${s.kv_blocks_used}`, (s) => `${s.kv_blocks_used} of ${s.kv_blocks_total} KV blocks used`],
    ["run/wait", (s) => `${s.running}/${s.waiting}`, (s) => `${s.running} running, ${s.waiting} waiting`],
    ["ms", (s) => s.step_ms.toFixed(0), (s) => `step took ${s.step_ms.toFixed(1)} ms`],
  ].map(([name, text, title]) => {
    const tr = document.createElement("tr");
    tr.dataset.stat = name;
    tr.append(td(name, "label"));
    for (const s of steps) tr.append(td(text(s), "", title(s)));
    return tr;
  });
  grid.tFoot.replaceChildren(...foot);
  $("grid-wrap").scrollLeft = $("grid-wrap").scrollWidth; // the newest step in view (Pause to look around)

  const last = steps[steps.length - 1];
  if (last) {
    $("stat-tokens").value = last.num_tokens / last.token_budget;
    $("stat-tokens-text").textContent = `${last.num_tokens} / ${last.token_budget}`;
    $("stat-kv").value = last.kv_blocks_used / last.kv_blocks_total;
    $("stat-kv-text").textContent = `${last.kv_blocks_used} / ${last.kv_blocks_total}`;
    $("stat-queue").textContent = `${last.running} running, ${last.waiting} waiting`;
    $("stat-step").textContent = `#${last.step}, ${last.step_ms.toFixed(1)} ms`;
  }
  $("stat-dropped").textContent = `${batch.dropped.engine} by the engine, ${batch.dropped.viewer} by this page`;
}

let batchWatch = null; // the AbortController of the open batch stream

async function watchBatch() {
  if (batchWatch) batchWatch.abort();
  const controller = (batchWatch = new AbortController());
  try {
    const resp = await fetch("v1/batch/stream", { headers: headers(), signal: controller.signal });
    if (!resp.ok) throw new Error(resp.status === 401 ? "needs the API key" : resp.statusText);
    setBatchStatus("live", "live (idle)");
    await readEvents(resp, onRecords);
  } catch (err) {
    if (controller.signal.aborted) return;
    setBatchStatus("error", `disconnected (${err.message}), retrying...`);
  }
  if (!controller.signal.aborted) setTimeout(watchBatch, 2000);
}

// ------------------------------------------------------------------------------------------------ start

document.querySelectorAll("input[name=mode]").forEach((r) => r.addEventListener("change", showMode));
$("request-form").addEventListener("submit", send);
$("model").addEventListener("change", () => { $("model").dataset.touched = "1"; });
$("stop-all").addEventListener("click", () => controllers.forEach((c) => c.abort()));
$("api-key").addEventListener("change", () => { loadModels(); watchBatch(); });
$("clear").addEventListener("click", () => $("outputs").replaceChildren());
showMode();
loadModels();
watchBatch();
setInterval(renderBatch, 150);
