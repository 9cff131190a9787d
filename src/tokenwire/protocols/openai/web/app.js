// tokenwire playground: sessions as a tree of branches, each a list of scored tokens.
import { ApiError, call, stream } from "./api.js";
import { divergingColour, probabilityColour, renderLegend } from "./colour.js";

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  concepts: [],
  layers: [],
  branches: new Map(), // session id -> branch
  current: null, // session id of the selected branch
  selected: null, // index of the selected token in the current branch
  focusIndex: 0,
  controller: null,
  counter: 0,
};

// A branch: { id (session), parent, forkAt, name, length (server tokens), tokens: [record] }
// A record: { pos, text, lp, top: [{token, lp}], prompt, id, readout }

// ------------------------------------------------------------------ errors and status
function showError(message) {
  const e = $("error");
  e.textContent = message;
  e.hidden = !message;
}
function status(message) { $("status").textContent = message; }

// ------------------------------------------------------------------ branches
function newBranch(sessionId, parent, forkAt, tokens) {
  state.counter += 1;
  const branch = {
    id: sessionId,
    parent,
    forkAt,
    name: parent ? `Branch ${state.counter} (fork at ${forkAt})` : `Branch ${state.counter}`,
    length: forkAt ?? 0,
    tokens,
  };
  state.branches.set(sessionId, branch);
  return branch;
}

async function ensureBranch() {
  if (state.current && state.branches.has(state.current)) return state.branches.get(state.current);
  const session = await call("POST", "/v1/sessions", {});
  const branch = newBranch(session.id, null, null, []);
  state.current = branch.id;
  renderTree();
  return branch;
}

function children(id) {
  return [...state.branches.values()].filter((b) => b.parent === id);
}

async function closeBranch(id) {
  showError("");
  const doomed = [];
  const walk = (bid) => { doomed.push(bid); for (const c of children(bid)) walk(c.id); };
  walk(id);
  const parent = state.branches.get(id)?.parent ?? null;
  for (const bid of doomed) {
    try {
      await call("DELETE", `/v1/sessions/${encodeURIComponent(bid)}`);
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) showError(err.message); // expired: already gone
    }
    state.branches.delete(bid);
  }
  if (!state.branches.has(state.current)) {
    state.current = parent && state.branches.has(parent) ? parent : ([...state.branches.keys()][0] ?? null);
    state.selected = null;
  }
  status(`Closed ${doomed.length} branch${doomed.length > 1 ? "es" : ""}; their sessions are freed on the server.`);
  renderTree();
  renderTokens();
}

function selectBranch(id) {
  state.current = id;
  state.selected = null;
  state.focusIndex = 0;
  renderTree();
  renderTokens();
}

function renderTree() {
  const tree = $("tree");
  tree.replaceChildren();
  const build = (branch) => {
    const li = document.createElement("li");
    li.dataset.session = branch.id;
    const row = document.createElement("div");
    row.className = "branch";
    const select = document.createElement("button");
    select.type = "button";
    select.className = "select";
    select.textContent = `${branch.name} · ${branch.tokens.length} tokens`;
    if (branch.id === state.current) select.setAttribute("aria-current", "true");
    select.addEventListener("click", () => selectBranch(branch.id));
    const close = document.createElement("button");
    close.type = "button";
    close.className = "close";
    close.textContent = "×";
    close.setAttribute("aria-label", `Close ${branch.name}`);
    close.title = "Close this branch (frees its session)";
    close.addEventListener("click", () => closeBranch(branch.id));
    row.append(select, close);
    li.append(row);
    const kids = children(branch.id);
    if (kids.length) {
      const ul = document.createElement("ul");
      for (const k of kids) ul.append(build(k));
      li.append(ul);
    }
    return li;
  };
  for (const b of state.branches.values()) if (b.parent === null || !state.branches.has(b.parent)) tree.append(build(b));
  if (!state.branches.size) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "No session yet: generate to start one.";
    tree.append(li);
  }
  const current = state.branches.get(state.current);
  $("branch-label").textContent = current ? `— ${current.name}` : "";
}

// ------------------------------------------------------------------ token view
function colourMode() {
  return $("colour-by").value === "readout" && state.concepts.length ? "readout" : "logprob";
}

function readoutValue(record) {
  if (!record.readout) return null;
  const layer = Number($("layer").value || 0);
  const concept = Number($("concept").value || 0);
  return record.readout[layer]?.[concept] ?? null;
}

function tokenColour(record, maxAbs) {
  if (colourMode() === "readout") {
    const v = readoutValue(record);
    return divergingColour(v === null ? null : v / (maxAbs || 1));
  }
  return probabilityColour(record.lp === null || record.lp === undefined ? null : Math.exp(record.lp));
}

function visible(text) {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "⇥") || "∅";
}

function describe(record) {
  const p = record.lp === null || record.lp === undefined ? "not scored" : `probability ${Math.exp(record.lp).toFixed(3)}`;
  return `${JSON.stringify(record.text)}, ${p}${record.prompt ? ", prompt" : ""}`;
}

function renderTokens() {
  const box = $("tokens");
  const branch = state.branches.get(state.current);
  const records = branch ? branch.tokens : [];
  let maxAbs = 0;
  if (colourMode() === "readout") for (const r of records) maxAbs = Math.max(maxAbs, Math.abs(readoutValue(r) ?? 0));
  renderLegend($("legend"), colourMode(), maxAbs || 1);
  const existing = box.children;
  // reuse boxes already there (streaming appends; a full re-render only when the branch changes)
  if (box.dataset.branch !== String(state.current)) {
    box.replaceChildren();
    box.dataset.branch = String(state.current);
    showDetailEmpty(); // the detail belonged to a token of the branch shown before
  }
  while (existing.length > records.length) box.lastChild.remove();
  state.focusIndex = Math.min(state.focusIndex, Math.max(0, records.length - 1));
  records.forEach((record, i) => {
    let el = existing[i];
    if (!el) {
      el = document.createElement("button");
      el.type = "button";
      el.className = "tok";
      el.setAttribute("role", "option");
      el.dataset.index = String(i);
      el.addEventListener("mouseenter", () => showDetail(Number(el.dataset.index), false));
      el.addEventListener("focus", () => { state.focusIndex = Number(el.dataset.index); showDetail(state.focusIndex, false); });
      el.addEventListener("click", () => selectToken(Number(el.dataset.index)));
      el.addEventListener("dblclick", () => forkAt(Number(el.dataset.index)));
      box.append(el);
    }
    el.textContent = visible(record.text);
    el.dataset.text = record.text;
    el.style.background = tokenColour(record, maxAbs);
    el.classList.toggle("prompt", !!record.prompt);
    el.classList.toggle("generated", !record.prompt);
    el.dataset.pos = String(record.pos ?? "");
    el.dataset.logprob = record.lp === null || record.lp === undefined ? "" : String(record.lp);
    el.setAttribute("aria-label", describe(record));
    el.setAttribute("aria-selected", String(i === state.selected));
    el.tabIndex = i === state.focusIndex ? 0 : -1;
  });
  box.setAttribute("aria-activedescendant", "");
  if (!records.length) showDetailEmpty();
}

function showDetailEmpty() {
  $("detail").innerHTML = '<p class="muted">Hover or focus a token to see what the model almost said. Select one (click or Enter) to fork there.</p>';
}

function cell(tag, text) {
  const c = document.createElement(tag);
  c.textContent = text;
  return c;
}

function showDetail(index, pinned) {
  const branch = state.branches.get(state.current);
  const record = branch?.tokens[index];
  if (!record) return;
  if (!pinned && state.selected !== null && state.selected !== index && document.activeElement?.id === "fork-here") return;
  const detail = $("detail");
  detail.replaceChildren();
  const head = document.createElement("p");
  const code = cell("code", record.text);
  head.append("Token ", code, ` · id ${record.id ?? "?"} · position ${record.pos ?? "?"}`);
  if (record.lp !== null && record.lp !== undefined) {
    head.append(` · p = ${Math.exp(record.lp).toFixed(4)} (logprob ${record.lp.toFixed(3)})`);
  } else {
    head.append(" · not scored (nothing predicts the first token)");
  }
  detail.append(head);
  if (record.top && record.top.length) {
    const table = document.createElement("table");
    table.className = "alternatives";
    const caption = cell("caption", "Top alternatives at this position");
    caption.className = "muted";
    table.append(caption);
    const hr = document.createElement("tr");
    hr.append(cell("th", "token"), cell("th", "probability"), cell("th", "logprob"));
    table.append(hr);
    for (const alt of record.top) {
      const tr = document.createElement("tr");
      const tc = document.createElement("td");
      tc.append(cell("code", alt.token));
      tr.append(tc, cell("td", Math.exp(alt.lp).toFixed(4)), cell("td", alt.lp.toFixed(3)));
      if (alt.token === record.text) tr.style.fontWeight = "600";
      table.append(tr);
    }
    detail.append(table);
  }
  if (record.readout && state.concepts.length) detail.append(readoutChart(record));
  if (index === state.selected && record.pos !== null && record.pos !== undefined) {
    const fork = document.createElement("button");
    fork.type = "button";
    fork.id = "fork-here";
    fork.textContent = `Fork here (keep ${record.pos} tokens) and generate`;
    fork.title = "Shortcuts: double-click a token, or press f on a focused token";
    fork.addEventListener("click", () => forkAt(index));
    const p = document.createElement("p");
    p.append(fork);
    detail.append(p);
  }
}

function selectToken(index) {
  state.selected = index;
  state.focusIndex = index;
  renderTokens();
  showDetail(index, true);
}

function readoutChart(record) {
  // the projection of the chosen concept at this token across layers, as a small line chart
  const concept = Number($("concept").value || 0);
  const values = record.readout.map((row) => row[concept]);
  const w = 260, h = 90, pad = 18;
  const max = Math.max(1e-6, ...values.map(Math.abs));
  const x = (i) => pad + (values.length > 1 ? (i * (w - 2 * pad)) / (values.length - 1) : 0);
  const y = (v) => h / 2 - (v / max) * (h / 2 - pad / 2);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("width", String(w));
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `${state.concepts[concept]} across layers: ${values.map((v, i) => `layer ${state.layers[i]} ${v.toFixed(2)}`).join(", ")}`);
  const axis = document.createElementNS(ns, "line");
  Object.entries({ x1: pad, x2: w - pad, y1: h / 2, y2: h / 2, stroke: "#777" }).forEach(([k, v]) => axis.setAttribute(k, v));
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", values.map((v, i) => `${x(i)},${y(v)}`).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#1d4ed8");
  line.setAttribute("stroke-width", "2");
  svg.append(axis, line);
  values.forEach((v, i) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x(i)); t.setAttribute("y", h - 2); t.setAttribute("font-size", "9"); t.setAttribute("text-anchor", "middle");
    t.textContent = state.layers[i];
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x(i)); label.setAttribute("y", Math.max(9, y(v) - 4)); label.setAttribute("font-size", "9");
    label.setAttribute("text-anchor", "middle");
    label.textContent = v.toFixed(2);
    svg.append(t, label);
  });
  const figure = document.createElement("figure");
  figure.className = "readout-chart";
  figure.append(svg, cell("figcaption", `${state.concepts[concept]}: projection by layer`));
  return figure;
}

function onTokensKey(event) {
  const branch = state.branches.get(state.current);
  if (!branch || !branch.tokens.length || !event.target.classList.contains("tok")) return;
  const last = branch.tokens.length - 1;
  let i = state.focusIndex;
  if (event.key === "ArrowRight" || event.key === "ArrowDown") i = Math.min(last, i + 1);
  else if (event.key === "ArrowLeft" || event.key === "ArrowUp") i = Math.max(0, i - 1);
  else if (event.key === "Home") i = 0;
  else if (event.key === "End") i = last;
  else if (event.key === "f" && !$("generate").disabled) { event.preventDefault(); forkAt(i); return; }
  else return;
  event.preventDefault();
  state.focusIndex = i;
  for (const el of $("tokens").children) el.tabIndex = Number(el.dataset.index) === i ? 0 : -1;
  $("tokens").children[i].focus();
}

// ------------------------------------------------------------------ generation
function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function samplingBody() {
  const body = { model: state.model, stream: true, stream_options: { include_usage: true } };
  const t = number("temperature"); if (t !== null) body.temperature = t;
  const p = number("top_p"); if (p !== null && p < 1) body.top_p = p;
  const k = number("top_k"); if (k) body.top_k = k;
  const seed = number("seed"); if (seed !== null) body.seed = seed;
  const m = number("max_tokens"); if (m !== null) body.max_tokens = m;
  const stop = $("stop").value;
  if (stop) body.stop = stop.replace(/\\n/g, "\n");
  if (state.concepts.length) body.readouts = true;
  return body;
}

function constrain(body, chat) {
  const kind = $("constraint-kind").value;
  const text = $("constraint").value;
  if (!kind || !text.trim()) return;
  if (kind === "regex") body.regex = text;
  else if (kind === "lark") body.grammar = text;
  else if (kind === "json") {
    let schema;
    try { schema = JSON.parse(text); } catch (err) { throw new ApiError(`the JSON schema does not parse: ${err.message}`, 400, "constraint"); }
    if (chat) body.response_format = { type: "json_schema", json_schema: { name: "schema", schema, strict: true } };
    else body.grammar = `start: %json ${JSON.stringify(schema)}`;
  }
}

function setBusy(busy) {
  $("generate").disabled = busy;
  $("stop-btn").disabled = !busy;
  $("tokens").setAttribute("aria-busy", String(busy));
}

async function generate({ mode, prompt }) {
  showError("");
  setBusy(true);
  const started = performance.now();
  let generated = 0;
  try {
    const branch = await ensureBranch();
    const k = number("top_logprobs") ?? 5;
    const chat = mode === "chat";
    const body = samplingBody();
    body.session = branch.id;
    constrain(body, chat);
    if (chat) {
      body.messages = [{ role: "user", content: prompt }];
      body.logprobs = true;
      body.top_logprobs = k;
    } else {
      body.prompt = prompt;
      body.echo = true;
      body.logprobs = k;
    }
    const fresh = []; // records of this request, positions fixed once usage says where they start
    let pos = branch.length;
    let usage = null;
    const readouts = new Map();
    const add = (record) => { fresh.push(record); branch.tokens.push(record); };
    state.controller = new AbortController();
    status("Generating…");
    await stream(chat ? "/v1/chat/completions" : "/v1/completions", body, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.readouts) for (const r of choice.readouts.tokens) readouts.set(r.position, r.values);
        const lps = choice.logprobs;
        if (!lps) continue;
        if (chat) {
          for (const e of lps.content || []) {
            add({ pos: null, text: e.token, lp: e.logprob, top: (e.top_logprobs || []).map((a) => ({ token: a.token, lp: a.logprob })), prompt: false, id: null, readout: null });
            generated += 1;
          }
        } else {
          lps.tokens.forEach((tok, i) => {
            const top = lps.top_logprobs[i] ? Object.entries(lps.top_logprobs[i]).map(([token, lp]) => ({ token, lp })) : [];
            top.sort((a, b) => b.lp - a.lp);
            add({ pos: pos++, text: tok, lp: lps.token_logprobs[i], top, prompt: null, id: null, readout: null });
          });
        }
      }
      renderTokens();
      renderTree();
    }, state.controller.signal);
    // where the request's tokens are: usage.prompt_tokens is the sequence before generation
    if (usage) {
      if (chat) fresh.forEach((r, i) => { r.pos = usage.prompt_tokens + i; });
      else for (const r of fresh) r.prompt = r.pos < usage.prompt_tokens;
      if (!chat) generated = fresh.filter((r) => !r.prompt).length;
    }
    await refreshIds(branch, readouts);
    const secs = (performance.now() - started) / 1000;
    status(`Generated ${generated} tokens in ${secs.toFixed(2)} s.`);
    $("tokens").dataset.generated = String(generated);
  } catch (err) {
    if (err.name === "AbortError") status("Stopped.");
    else showError(err.message);
    const branch = state.branches.get(state.current);
    if (branch) await refreshIds(branch, new Map()).catch(() => {});
  } finally {
    state.controller = null;
    setBusy(false);
    renderTokens();
    renderTree();
  }
}

async function refreshIds(branch, readouts) {
  // the session's tokens give each box its id; the records past the session's end (a cancelled
  // request's tail) are dropped so the view is what the server holds
  const session = await call("GET", `/v1/sessions/${encodeURIComponent(branch.id)}`);
  branch.length = session.length;
  branch.tokens = branch.tokens.filter((r) => r.pos === null || r.pos < session.length);
  for (const r of branch.tokens) {
    if (r.pos !== null && r.pos !== undefined) r.id = session.tokens[r.pos];
    if (readouts.has(r.pos)) r.readout = readouts.get(r.pos);
  }
}

async function forkAt(index) {
  const parent = state.branches.get(state.current);
  const record = parent?.tokens[index];
  if (!record || record.pos === null) return;
  showError("");
  try {
    const child = await call("POST", `/v1/sessions/${encodeURIComponent(parent.id)}/fork`, { at: record.pos });
    const kept = parent.tokens.filter((r) => r.pos !== null && r.pos < record.pos).map((r) => ({ ...r }));
    const branch = newBranch(child.id, parent.id, record.pos, kept);
    branch.length = child.length;
    state.current = branch.id;
    state.selected = null;
    renderTree();
    renderTokens();
  } catch (err) {
    showError(err.message);
    return;
  }
  await generate({ mode: "completion", prompt: "" });
}

// ------------------------------------------------------------------ engine panel
let last = null;
let polls = 0;
async function pollEngine() {
  try {
    const s = await fetch("/stats").then((r) => r.json());
    polls += 1;
    $("kv-meter").value = s.kv_usage;
    $("kv-usage").textContent = `${(100 * s.kv_usage).toFixed(1)}% (${s.kv_blocks_used}/${s.kv_blocks_total} blocks)`;
    $("running").textContent = s.running;
    $("queued").textContent = s.queued;
    $("sessions").textContent = s.sessions;
    if (last && s.time > last.time) {
      $("tps").textContent = ((s.computed_tokens - last.computed_tokens) / (s.time - last.time)).toFixed(1);
    }
    // prompt-lookup speculation: the share of guessed tokens kept, and tokens a guessing step made
    if (s.spec_proposed > 0) {
      const kept = (100 * s.spec_accepted) / s.spec_proposed;
      const per = (s.spec_accepted + s.spec_verifications) / s.spec_verifications;
      $("spec").textContent = `${kept.toFixed(1)}% (${s.spec_accepted}/${s.spec_proposed}), ${per.toFixed(2)} tokens a step`;
    }
    const apis = Object.entries(s.requests_by_protocol || {});
    if (apis.length) $("by-protocol").textContent = apis.map(([name, n]) => `${name} ${n}`).join(" · ");
    // sessions that outlive the process (--state-dir): persisted sessions, KV block files, reads
    if (s.persistence) {
      const p = s.persistence;
      $("on-disk").textContent = `${p.sessions_persisted} sessions · ${p.kv_disk_blocks} KV blocks (${(p.kv_disk_bytes / 2 ** 20).toFixed(1)} MiB) · ${p.kv_disk_reads} read`;
    } else {
      $("on-disk").textContent = "off (--no-persist)";
    }
    last = s;
    $("updated").textContent = new Date(s.time * 1000).toLocaleTimeString();
    $("engine").dataset.polls = String(polls);
  } catch (_) {
    $("updated").textContent = "server unreachable";
  }
}

async function init() {
  const s = await fetch("/stats").then((r) => r.json());
  state.model = s.model;
  state.concepts = s.concepts;
  state.layers = s.layers;
  $("model-name").textContent = s.model;
  if (matchMedia("(max-width: 700px)").matches) $("settings").open = false; // a phone: tokens sooner
  if (s.concepts.length) {
    const option = $("colour-by").querySelector('option[value="readout"]');
    option.disabled = false;
    $("readout-controls").hidden = false;
    s.concepts.forEach((c, i) => $("concept").append(new Option(c, String(i))));
    s.layers.forEach((l, i) => $("layer").append(new Option(`layer ${l}`, String(i))));
    $("layer").value = String(s.layers.length - 1);
  }
  for (const id of ["colour-by", "concept", "layer"]) {
    $(id).addEventListener("change", () => {
      renderTokens();
      if (state.selected !== null) showDetail(state.selected, true);
    });
  }
  $("form").addEventListener("submit", (event) => {
    event.preventDefault();
    const mode = document.querySelector('input[name="mode"]:checked').value;
    generate({ mode, prompt: $("prompt").value });
  });
  $("stop-btn").addEventListener("click", () => state.controller?.abort());
  $("new-session").addEventListener("click", () => { state.current = null; state.selected = null; renderTree(); renderTokens(); });
  $("tokens").addEventListener("keydown", onTokensKey);
  // hovering other tokens shows them for a moment; leaving the row brings back the selected one
  $("tokens").addEventListener("mouseleave", () => { if (state.selected !== null) showDetail(state.selected, true); });
  renderTree();
  renderTokens();
  pollEngine();
  setInterval(pollEngine, 1000);
  document.body.dataset.ready = "true";
}

init().catch((err) => showError(`could not start: ${err.message}`));
