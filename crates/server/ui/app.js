// roost dashboard: sign-in, the sandboxes list, one sandbox, admin.
//
// Rules this file keeps (README "Dashboard"):
// - The token lives in sessionStorage only and leaves only as the
//   `Authorization` header of `fetch` calls to this server's /v1 API: never
//   in a URL (routes are `#/…` fragments), never logged.
// - Record text (labels, reasons, messages, command output) is attacker-
//   controlled: it reaches the page only as text nodes or `textContent`,
//   never as HTML. `el()` below is the only way this file builds elements.
// - Live views long-poll (`events?after=&timeout=`, the list's
//   `If-None-Match` + `timeout`, output `offset` + `timeout`); leaving a view
//   aborts its requests.

const TOKEN_KEY = "roost.token";
const PAGE_SIZE = 50;
const POLL_S = 20;
// The sandbox states, as `api::lifecycle::SandboxState` spells them (a
// server test checks this list against the OpenAPI document).
export const SANDBOX_STATES = ["pending", "starting", "running", "stopping", "securing",
  "stopped", "recovering", "failed", "terminated", "deleting", "deleted"];

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
const signoutButton = document.getElementById("signout");

let session = null; // { token, kind: "org" | "admin", orgId }
let view = null; // { controller: AbortController, timers: [] }
const listState = { stateFilter: "", labelFilter: "", cursors: [""], page: 0 };

// ---- elements, never from HTML -------------------------------------------

/** An element with attributes and children (strings become text nodes). */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "onclick" || name === "onsubmit" || name === "onchange") {
      node.addEventListener(name.slice(2), value);
    } else {
      node.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function replace(node, ...children) {
  node.replaceChildren();
  append(node, children);
}

function badge(text) {
  const value = text || "—";
  return el("span", { class: "state " + String(value).replace(/[^a-z_]/g, "") }, value);
}

/** A table whose cells carry their column's name (the phone layout shows it). */
function table(caption, columns, cards = true) {
  const body = el("tbody");
  const node = el("table", { class: cards ? "cards" : null },
    el("caption", {}, caption),
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", { scope: "col" }, c)))),
    body);
  return { node, body, columns };
}

function row(t, cells, attrs) {
  return el("tr", attrs || {}, cells.map((cell, i) =>
    el("td", { "data-label": t.columns[i] }, cell)));
}

// ---- time ----------------------------------------------------------------

function ago(iso) {
  if (!iso) return "—";
  return duration((Date.now() - Date.parse(iso)) / 1000);
}

function duration(seconds) {
  if (!Number.isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function when(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  return el("time", { datetime: iso, title: iso }, date.toLocaleString());
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return (unit === 0 ? value : value.toFixed(1)) + " " + units[unit];
}

/** How far behind a durable home's last completed save is (live homes only). */
function saveLag(sandbox) {
  if (!sandbox.save) return "—";
  if (!sandbox.save.at_risk_s && sandbox.state !== "running") return "0 s";
  const since = sandbox.save.last_completed_at || sandbox.created_at;
  return ago(since);
}

// ---- the API -------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** A call to this server's /v1 API with the session's token. */
async function call(method, path, { body, signal, headers } = {}) {
  const init = { method, signal, headers: { Authorization: "Bearer " + session.token, ...headers } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (response.status === 401) {
    signOut("The server no longer accepts this token; sign in again.");
    throw new ApiError(401, "unauthenticated", "signed out");
  }
  if (!response.ok && response.status !== 304) {
    let code = "http_" + response.status;
    let message = response.statusText;
    try {
      const envelope = await response.json();
      code = envelope.error.code;
      message = envelope.error.message;
    } catch (_) { /* not our envelope */ }
    throw new ApiError(response.status, code, message);
  }
  return response;
}

async function getJson(path, signal) {
  return (await call("GET", path, { signal })).json();
}

function aborted(error) {
  return error && (error.name === "AbortError" || (error instanceof ApiError && error.status === 401));
}

/** Sleeps `ms` unless the view is left first. */
function pause(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

/** Runs `step` again and again until the view is left; errors wait a second. */
async function loop(signal, status, step) {
  while (!signal.aborted) {
    try {
      await step();
    } catch (error) {
      if (aborted(error) || signal.aborted) return;
      if (status) status.textContent = "Connection problem (" + error.message + "); retrying…";
      await pause(1000, signal);
    }
  }
}

// ---- confirmation --------------------------------------------------------

const dialog = document.getElementById("confirm");

/** Asks before an action; resolves true only on "Confirm". */
function confirmAction(text, okLabel) {
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  dialog.returnValue = "cancel";
  dialog.showModal();
  document.getElementById("confirm-cancel").focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}

// ---- session and routing -------------------------------------------------

function startView() {
  if (view) {
    view.controller.abort();
    view.timers.forEach((t) => clearInterval(t));
  }
  view = { controller: new AbortController(), timers: [] };
  return view;
}

function every(ms, fn) {
  view.timers.push(setInterval(fn, ms));
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  session = null;
  renderSignIn(message);
}

signoutButton.addEventListener("click", () => signOut("Signed out."));

async function boot() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return renderSignIn();
  const answer = await whoami(token);
  if (!answer.ok) return signOut(answer.message);
  session = answer.session;
  route();
}

/** Who a token is; only org and admin tokens may sign in. */
async function whoami(token) {
  let response;
  try {
    response = await fetch("/v1/whoami", { headers: { Authorization: "Bearer " + token } });
  } catch (_) {
    return { ok: false, message: "The server cannot be reached." };
  }
  if (response.status === 401) return { ok: false, message: "That token was refused." };
  if (!response.ok) return { ok: false, message: "The server answered " + response.status + "." };
  const body = await response.json();
  if (body.kind !== "org" && body.kind !== "admin") {
    return { ok: false, message: "Runner tokens cannot sign in: use an org or the admin token." };
  }
  return { ok: true, session: { token, kind: body.kind, orgId: body.org_id } };
}

function renderSignIn(message) {
  startView();
  nav.replaceChildren();
  who.textContent = "";
  signoutButton.hidden = true;
  const input = el("input", { id: "token", name: "token", type: "password", autocomplete: "off",
    required: true, spellcheck: "false", "aria-describedby": "token-help signin-error" });
  const error = el("p", { id: "signin-error", role: "alert", class: "error" }, message && message !== "Signed out." ? message : "");
  const form = el("form", { id: "signin", class: "signin", onsubmit: async (event) => {
    event.preventDefault();
    const token = input.value.trim();
    input.value = "";
    error.textContent = "Checking…";
    const answer = await whoami(token);
    if (!answer.ok) {
      error.textContent = answer.message;
      input.focus();
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    session = answer.session;
    // Each kind of token has its own views: start at its home unless the
    // address already names one of them.
    const home = session.kind === "admin" ? "#/admin" : "#/sandboxes";
    if (!location.hash.startsWith(home)) history.replaceState(null, "", home);
    route();
  } },
  el("h1", {}, "Sign in"),
  el("label", { for: "token" }, "Token"),
  input,
  el("p", { id: "token-help", class: "muted" },
    "An org token or the admin token. It is kept for this browser tab only and sent only to this server."),
  el("button", { type: "submit", class: "primary" }, "Sign in"),
  message === "Signed out." ? el("p", { class: "muted" }, message) : null,
  error);
  replace(main, form);
  input.focus();
}

function route() {
  if (!session) return renderSignIn();
  signoutButton.hidden = false;
  who.textContent = session.kind === "admin" ? "Signed in: admin" : "Signed in: org " + session.orgId;
  const hash = location.hash || "";
  const links = session.kind === "admin"
    ? [["#/admin", "Admin"]]
    : [["#/sandboxes", "Sandboxes"]];
  replace(nav, links.map(([href, text]) =>
    el("a", { href, "aria-current": hash.startsWith(href) ? "page" : null }, text)));
  const match = hash.match(/^#\/sandboxes\/(sbx_[0-9a-f]+)$/);
  if (session.kind === "admin") return renderAdmin();
  if (match) return renderSandbox(match[1]);
  return renderList();
}

window.addEventListener("hashchange", () => {
  route();
  main.focus();
});

// ---- the sandboxes list --------------------------------------------------

function listColumns() {
  return ["Sandbox", "State", "Reason", "Storage", "Runner", "Age", "Save", "Save lag", "Labels"];
}

function labelsOf(record) {
  const entries = Object.entries(record.labels || {});
  if (!entries.length) return "—";
  return el("span", { class: "labels" }, entries.map(([k, v]) => el("span", {}, k + "=" + v)));
}

function renderList() {
  const { controller } = startView();
  const signal = controller.signal;
  const status = el("p", { id: "list-status", class: "status", role: "status" }, "Loading…");
  const stateSelect = el("select", { id: "filter-state", name: "state" },
    el("option", { value: "" }, "any state"),
    SANDBOX_STATES.map((s) => el("option", { value: s, selected: listState.stateFilter === s }, s)));
  const labelInput = el("input", { id: "filter-label", name: "label", placeholder: "key=value",
    value: listState.labelFilter, pattern: "[a-z0-9._/\\-]{1,63}=.*", title: "KEY=VALUE" });
  const filters = el("form", { class: "filters", role: "search", onsubmit: (event) => {
    event.preventDefault();
    listState.stateFilter = stateSelect.value;
    listState.labelFilter = labelInput.value.trim();
    listState.cursors = [""];
    listState.page = 0;
    renderList();
  } },
  el("div", {}, el("label", { for: "filter-state" }, "State"), stateSelect),
  el("div", {}, el("label", { for: "filter-label" }, "Label"), labelInput),
  el("button", { type: "submit" }, "Filter"));
  const t = table("Sandboxes of this org, oldest first, " + PAGE_SIZE + " a page", listColumns());
  t.node.id = "sandboxes";
  const prev = el("button", { type: "button", id: "prev", disabled: listState.page === 0, onclick: () => {
    listState.page -= 1;
    renderList();
  } }, "Previous page");
  const next = el("button", { type: "button", id: "next", disabled: true, onclick: () => {
    listState.page += 1;
    renderList();
  } }, "Next page");
  const pageLabel = el("span", { class: "muted" }, "Page " + (listState.page + 1));
  replace(main, el("h1", {}, "Sandboxes"), filters, status, el("div", { class: "scroll" }, t.node),
    el("div", { class: "pager" }, prev, pageLabel, next));

  let records = [];
  const draw = () => {
    const rows = records.map((s) => row(t, [
      el("a", { href: "#/sandboxes/" + s.id }, s.id),
      badge(s.state),
      s.state_reason || "—",
      s.storage_class,
      s.runner_id || "—",
      el("span", { "data-since": s.created_at }, ago(s.created_at)),
      s.save ? badge(s.save.state) : "—",
      saveLag(s),
      labelsOf(s),
    ], { "data-id": s.id, "data-state": s.state }));
    replace(t.body, rows.length ? rows
      : el("tr", {}, el("td", { colspan: t.columns.length, class: "muted" }, "No sandboxes match.")));
  };
  every(5000, draw); // ages and lags move without a change to the records

  const query = new URLSearchParams();
  if (listState.stateFilter) query.append("state", listState.stateFilter);
  if (listState.labelFilter) query.append("label", listState.labelFilter);
  query.set("limit", String(PAGE_SIZE));
  const cursor = listState.cursors[listState.page] || "";
  if (cursor) query.set("cursor", cursor);
  let etag = null;
  loop(signal, status, async () => {
    const headers = {};
    let path = "/v1/sandboxes?" + query;
    if (etag) {
      headers["If-None-Match"] = etag;
      path += "&timeout=" + POLL_S;
    }
    const response = await call("GET", path, { signal, headers });
    if (response.status === 304) return;
    etag = response.headers.get("ETag");
    const page = await response.json();
    records = page.sandboxes;
    listState.cursors[listState.page + 1] = page.next_cursor || "";
    next.disabled = !page.next_cursor;
    draw();
    status.textContent = records.length + " on this page · updated " + new Date().toLocaleTimeString() + " · live";
  });
}

// ---- one sandbox ---------------------------------------------------------

function field(list, name, value) {
  list.append(el("dt", {}, name), el("dd", {}, value === null || value === undefined || value === "" ? "—" : value));
}

function renderSandbox(id) {
  const { controller } = startView();
  const signal = controller.signal;
  const base = "/v1/sandboxes/" + id;
  const status = el("p", { id: "sandbox-status", class: "status", role: "status" }, "Loading…");
  const heading = el("h1", {}, "Sandbox ", el("span", { id: "sandbox-id" }, id), " ", el("span", { id: "sandbox-state" }));
  const record = el("dl", { class: "record", id: "record" });
  const save = el("dl", { class: "record", id: "save" });
  const saveSection = el("section", { "aria-labelledby": "h-save", hidden: true },
    el("h2", { id: "h-save" }, "Save status"), save);
  const timeline = table("State changes, oldest first (live)", ["#", "Time", "State", "Reason", "Epoch", "Runner", "Message"]);
  timeline.node.id = "timeline";
  const commands = table("Commands, oldest first", ["Command", "Argv", "State", "Exit", "Duration", "Output"]);
  commands.node.id = "commands";
  const snapshots = table("Snapshots of this sandbox", ["Snapshot", "Asked", "Durability", "Reason", "Files", "Size", "Created"]);
  snapshots.node.id = "snapshots";
  const actions = el("div", { class: "row", role: "group", "aria-label": "Actions" });
  replace(main,
    el("p", {}, el("a", { href: "#/sandboxes" }, "← All sandboxes")),
    heading, actions, status,
    el("div", { class: "grid2" },
      el("section", { "aria-labelledby": "h-record" }, el("h2", { id: "h-record" }, "Record"), record),
      saveSection),
    el("section", { "aria-labelledby": "h-timeline" }, el("h2", { id: "h-timeline" }, "Timeline"),
      el("div", { class: "scroll" }, timeline.node)),
    el("section", { "aria-labelledby": "h-commands" }, el("h2", { id: "h-commands" }, "Commands"),
      el("div", { class: "scroll" }, commands.node)),
    el("section", { "aria-labelledby": "h-snapshots" }, el("h2", { id: "h-snapshots" }, "Snapshots"),
      el("div", { class: "scroll" }, snapshots.node)));

  let sandbox = null;
  const act = (label, verb, method, path, body) => el("button", {
    type: "button", id: "action-" + verb, class: verb === "delete" ? "danger" : null,
    onclick: async () => {
      if (!(await confirmAction(label + " sandbox " + id + "?", label))) return;
      status.textContent = label + "…";
      try {
        await call(method, path, { body });
        status.textContent = label + ": asked.";
        refreshRecord();
        // The snapshots' own loop reads them again within 5 s; a failure
        // here must not become an unhandled rejection.
        refreshSnapshots().catch(() => {});
      } catch (error) {
        if (!aborted(error)) status.textContent = label + " refused: " + error.code + ": " + error.message;
      }
    } }, label);
  replace(actions,
    act("Stop", "stop", "POST", base + "/stop", {}),
    act("Start", "start", "POST", base + "/start", {}),
    act("Snapshot", "snapshot", "POST", base + "/snapshots", {}),
    act("Delete", "delete", "DELETE", base));

  const drawRecord = () => {
    if (!sandbox) return;
    const s = sandbox;
    replace(document.getElementById("sandbox-state"), badge(s.state));
    record.replaceChildren();
    field(record, "State", badge(s.state));
    field(record, "Reason", s.state_reason);
    field(record, "Message", s.state_message);
    field(record, "Desired", s.desired);
    field(record, "Storage", s.storage_class);
    field(record, "Runner", s.runner_id);
    field(record, "Epoch", String(s.epoch));
    field(record, "Image", s.image);
    field(record, "Network", s.network);
    field(record, "Placement", s.placement);
    field(record, "Labels", labelsOf(s));
    field(record, "Quarantined", s.quarantined ? "yes" : "no");
    field(record, "Created", when(s.created_at));
    field(record, "Age", ago(s.created_at));
    field(record, "Expires", when(s.expires_at));
    field(record, "From snapshot", s.from_snapshot);
    if (s.recovery) field(record, "Recovery", s.recovery.message);
    saveSection.hidden = !s.save;
    save.replaceChildren();
    if (s.save) {
      field(save, "State", badge(s.save.state));
      field(save, "Last completed", when(s.save.last_completed_at));
      field(save, "Lag", saveLag(s));
      field(save, "At risk", duration(s.save.at_risk_s));
      field(save, "Bytes pending", bytes(s.save.bytes_pending));
      field(save, "Last attempt", when(s.save.last_attempt_at));
      field(save, "Last error", s.save.last_error);
      field(save, "Interval", s.save.interval_s + " s");
    }
  };

  const refreshRecord = async () => {
    try {
      sandbox = await getJson(base, signal);
      drawRecord();
      status.textContent = "Updated " + new Date().toLocaleTimeString() + " · live";
    } catch (error) {
      if (aborted(error)) return;
      status.textContent = error.status === 404 ? "No such sandbox (or it has ended and is no longer kept)." : "Could not read the sandbox: " + error.message;
    }
  };

  // Saves change the record without an event: read it again now and then.
  every(5000, refreshRecord);

  // The timeline: every event once, then a long-poll for the next ones.
  let lastSeq = 0;
  loop(signal, status, async () => {
    const wait = lastSeq > 0 ? "&timeout=" + POLL_S : "";
    const page = await getJson(base + "/events?after=" + lastSeq + wait, signal);
    for (const e of page.events) {
      lastSeq = Math.max(lastSeq, e.seq);
      timeline.body.append(row(timeline, [String(e.seq), when(e.at), badge(e.state), e.reason || "—",
        String(e.epoch), e.runner_id || "—", e.message || "—"],
      { "data-seq": e.seq, "data-state": e.state, "data-at": e.at }));
    }
    if (page.events.length) await refreshRecord();
    else if (lastSeq === 0) { await refreshRecord(); await pause(1000, signal); }
  });

  // Commands: the list is read every 2 s; each command's output, once
  // shown, streams by offset long-polls until the command has ended.
  const shown = new Map(); // command id -> { tr, cells, output }
  const refreshCommands = async () => {
    const list = await getJson(base + "/commands?limit=200", signal);
    for (const c of list.commands) {
      let entry = shown.get(c.id);
      if (!entry) {
        const toggle = el("button", { type: "button", "aria-expanded": "false", "data-command": c.id }, "Show output");
        const tr = el("tr", { "data-command": c.id });
        entry = { tr, toggle, output: null };
        toggle.addEventListener("click", () => toggleOutput(c.id, entry));
        shown.set(c.id, entry);
        commands.body.append(tr);
      }
      const took = c.started_at ? duration(((c.ended_at ? Date.parse(c.ended_at) : Date.now()) - Date.parse(c.started_at)) / 1000) : "—";
      const exit = c.exit_code !== null && c.exit_code !== undefined ? String(c.exit_code) : (c.signal || "—");
      const cells = [c.id, c.argv.join(" "), el("span", {}, badge(c.state), c.state_reason ? " " + c.state_reason : ""), exit, took, entry.toggle];
      replace(entry.tr, cells.map((cell, i) => el("td", { "data-label": commands.columns[i] }, cell)));
      entry.tr.setAttribute("data-state", c.state);
    }
  };
  const toggleOutput = (commandId, entry) => {
    if (entry.output) {
      entry.output.controller.abort();
      entry.output.tr.remove();
      entry.output = null;
      entry.toggle.setAttribute("aria-expanded", "false");
      entry.toggle.textContent = "Show output";
      return;
    }
    const controller = new AbortController();
    signal.addEventListener("abort", () => controller.abort(), { once: true });
    const stdout = el("pre", { class: "output stdout", "data-command": commandId, "aria-label": "stdout of " + commandId });
    const stderr = el("pre", { class: "output stderr", "data-command": commandId, "aria-label": "stderr of " + commandId });
    const tr = el("tr", { class: "output-row" }, el("td", { colspan: commands.columns.length }, stdout, stderr));
    entry.tr.after(tr);
    entry.output = { controller, tr };
    entry.toggle.setAttribute("aria-expanded", "true");
    entry.toggle.textContent = "Hide output";
    for (const [stream, pre] of [["stdout", stdout], ["stderr", stderr]]) {
      streamOutput(base + "/commands/" + commandId + "/output?stream=" + stream, pre, controller.signal);
    }
  };
  loop(signal, null, async () => {
    await refreshCommands();
    await pause(2000, signal);
  });

  const refreshSnapshots = async () => {
    const list = await getJson("/v1/snapshots?sandbox_id=" + id + "&limit=200", signal);
    replace(snapshots.body, list.snapshots.length ? list.snapshots.map((s) => row(snapshots, [
      s.id, s.requested, badge(s.durability), s.reason || "—",
      s.files === null || s.files === undefined ? "—" : String(s.files), bytes(s.logical_bytes), when(s.created_at)]))
      : el("tr", {}, el("td", { colspan: snapshots.columns.length, class: "muted" }, "No snapshots.")));
  };
  loop(signal, null, async () => {
    await refreshSnapshots();
    await pause(5000, signal);
  });
}

/** Appends a command's stream to `pre` as it arrives, as text. */
async function streamOutput(path, pre, signal) {
  const decoder = new TextDecoder();
  let offset = 0;
  await loop(signal, null, async () => {
    const response = await call("GET", path + "&offset=" + offset + "&timeout=" + POLL_S, { signal });
    const chunk = new Uint8Array(await response.arrayBuffer());
    offset = Number(response.headers.get("x-roost-next-offset") || offset + chunk.length);
    const complete = response.headers.get("x-roost-complete") === "true";
    pre.append(document.createTextNode(decoder.decode(chunk, { stream: !complete })));
    if (complete) {
      pre.setAttribute("data-complete", "true");
      if (!pre.textContent) pre.textContent = "(no " + (pre.classList.contains("stderr") ? "stderr" : "stdout") + ")";
      throw Object.assign(new Error("complete"), { name: "AbortError" });
    }
  });
}

// ---- admin ---------------------------------------------------------------

function renderAdmin() {
  const { controller } = startView();
  const signal = controller.signal;
  const status = el("p", { id: "admin-status", class: "status", role: "status" }, "Loading…");
  const runners = table("Runners", ["Runner", "Class", "Lease", "Lease expires", "Drain", "Sandboxes", "Actions"]);
  runners.node.id = "runners";
  const orgs = table("Orgs and their quotas", ["Org", "Id", "Running / limit", "Held / limit", "Store limit", "Created"]);
  orgs.node.id = "orgs";
  const sandboxInput = el("input", { id: "q-sandbox", name: "sandbox", placeholder: "sbx_…", required: true,
    pattern: "sbx_[0-9a-f]+", title: "a sandbox id" });
  const reasonInput = el("input", { id: "q-reason", name: "reason", maxlength: 256, placeholder: "why (for quarantine)" });
  const quarantineStatus = el("p", { id: "q-status", class: "status", role: "status" });
  const quarantine = async (release) => {
    const id = sandboxInput.value.trim();
    if (!/^sbx_[0-9a-f]+$/.test(id)) {
      quarantineStatus.textContent = "Enter a sandbox id (sbx_…).";
      return;
    }
    if (!release && !reasonInput.value.trim()) {
      quarantineStatus.textContent = "Say why: the reason is kept on the record.";
      return;
    }
    const label = release ? "Release" : "Quarantine";
    if (!(await confirmAction(label + " sandbox " + id + "?", label))) return;
    try {
      const path = "/v1/admin/sandboxes/" + id + "/quarantine";
      const response = release ? await call("DELETE", path)
        : await call("POST", path, { body: { reason: reasonInput.value.trim() } });
      const record = await response.json();
      quarantineStatus.textContent = id + (record.quarantined ? " is quarantined." : " is released.");
    } catch (error) {
      if (!aborted(error)) quarantineStatus.textContent = label + " refused: " + error.code + ": " + error.message;
    }
  };
  const quarantineForm = el("form", { class: "filters", id: "quarantine", onsubmit: (event) => {
    event.preventDefault();
    quarantine(false);
  } },
  el("div", {}, el("label", { for: "q-sandbox" }, "Sandbox"), sandboxInput),
  el("div", {}, el("label", { for: "q-reason" }, "Reason"), reasonInput),
  el("button", { type: "submit", class: "danger" }, "Quarantine"),
  el("button", { type: "button", onclick: () => quarantine(true) }, "Release"));
  replace(main, el("h1", {}, "Admin"), status,
    el("section", { "aria-labelledby": "h-runners" }, el("h2", { id: "h-runners" }, "Runners"),
      el("div", { class: "scroll" }, runners.node)),
    el("section", { "aria-labelledby": "h-orgs" }, el("h2", { id: "h-orgs" }, "Orgs"),
      el("div", { class: "scroll" }, orgs.node)),
    el("section", { "aria-labelledby": "h-quarantine" }, el("h2", { id: "h-quarantine" }, "Quarantine"),
      el("p", { class: "muted" }, "A quarantined sandbox's record is frozen for forensics: stop, start, delete and new commands are refused until it is released."),
      quarantineForm, quarantineStatus));

  const runnerAction = (r, action, label) => el("button", { type: "button", "data-action": action,
    class: action === "preempt" ? "danger" : null,
    onclick: async () => {
      if (!(await confirmAction(label + " runner " + r.name + " (" + r.id + ")?", label))) return;
      try {
        await call("POST", "/v1/admin/runners/" + r.id + "/" + action, { body: {} });
        status.textContent = label + ": done for " + r.name + ".";
        // The admin loop reads the fleet again within 3 s; a failure here
        // must not become an unhandled rejection.
        refresh().catch(() => {});
      } catch (error) {
        if (!aborted(error)) status.textContent = label + " refused: " + error.code + ": " + error.message;
      }
    } }, label);
  const limit = (used, max) => String(used) + " / " + (max === null || max === undefined ? "no limit" : String(max));
  const refresh = async () => {
    const [fleet, tenants] = await Promise.all([
      getJson("/v1/admin/runners", signal), getJson("/v1/admin/orgs", signal)]);
    replace(runners.body, fleet.length ? fleet.map((r) => row(runners, [
      el("span", {}, r.name, el("br"), el("small", { class: "muted" }, r.id)),
      r.placement_class, badge(r.state), when(r.lease_expires_at), r.drain ? badge(r.drain) : "—",
      String(r.sandboxes),
      el("span", { class: "row" }, r.drain ? runnerAction(r, "undrain", "Undrain") : runnerAction(r, "drain", "Drain"),
        r.drain === "preempt" ? null : runnerAction(r, "preempt", "Preempt"))],
    { "data-runner": r.id, "data-state": r.state }))
      : el("tr", {}, el("td", { colspan: runners.columns.length, class: "muted" }, "No runners registered.")));
    replace(orgs.body, tenants.orgs.map((o) => row(orgs, [o.name, o.org_id,
      limit(o.running, o.max_running), limit(o.total, o.max_total),
      o.max_store_mib === null || o.max_store_mib === undefined ? "no limit" : String(o.max_store_mib) + " MiB",
      when(o.created_at)], { "data-org": o.org_id })));
    status.textContent = "Updated " + new Date().toLocaleTimeString();
  };
  loop(signal, status, async () => {
    await refresh();
    await pause(3000, signal);
  });
}

boot();
