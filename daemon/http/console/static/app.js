// edgellm console. No framework, no build step, nothing from off the box. Every element is
// made with createElement and filled with textContent: no string ever becomes HTML (the
// page's CSP enforces Trusted Types, so innerHTML would throw).
"use strict";

(() => {
  const state = {
    session: null, // {key_id, name, scopes, csrf, ...}: the CSRF token lives here, in memory only
    source: null, // the one EventSource of this page
    moved: false, // another page of this session took the stream (its "replaced" end)
    samples: [],
    interval: 2,
    history: 600, // seconds of samples kept: the daemon's console.history_s, from its history event
    tickAt: 0, // when the last overview arrived (performance.now())
    overview: null,
    conversation: [],
    models: {}, // name -> what it reads ("text", "image", "audio"), from /ui/api/models
    media: null, // the bounds on images and clips the page checks before sending
    attachments: [], // images and clips to go with the next user turn
    reading: null, // files being read into `attachments`, until they are
    abort: null,
    keys: null,
  };
  const VIEWS = ["overview", "actions", "keys", "usage", "playground"];
  const $ = (id) => document.getElementById(id);
  // A key's name as text beside other text: isolated (FSI ... PDI), so a right-to-left name
  // cannot reorder the key id or words after it.
  const iso = (text) => `\u2068${text}\u2069`;

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") el.textContent = String(value);
      else if (name === "on") for (const [ev, fn] of Object.entries(value)) el.addEventListener(ev, fn);
      else el.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }
  const SVG = "http://www.w3.org/2000/svg";
  function s(tag, attrs) {
    const el = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, String(value));
    return el;
  }
  const clear = (el) => { while (el.firstChild) el.firstChild.remove(); return el; };

  // ---- formatting -------------------------------------------------------------------------
  const dash = "–";
  function bytes(n) {
    if (n === null || n === undefined) return dash;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
  }
  function duration(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 120) return `${s} s`;
    if (s < 7200) return `${Math.floor(s / 60)} min`;
    if (s < 172800) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} days`;
  }

  // Every time on the page in one format, in the browser's own time zone, the zone named:
  // "2026-12-04 20:05:12 UTC+01:00" (or "… UTC" where the offset is nought).
  const pad = (n) => String(n).padStart(2, "0");
  function zone(d) {
    const offset = -d.getTimezoneOffset();
    if (offset === 0) return "UTC";
    const a = Math.abs(offset);
    return `UTC${offset < 0 ? "-" : "+"}${pad(Math.floor(a / 60))}:${pad(a % 60)}`;
  }
  function clock(d, seconds = true) {
    return `${pad(d.getHours())}:${pad(d.getMinutes())}${seconds ? `:${pad(d.getSeconds())}` : ""}`;
  }
  function when(seconds) {
    if (seconds === null || seconds === undefined) return dash;
    const d = new Date(seconds * 1000);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(d)} ${zone(d)}`;
  }
  // A time the server sends as ISO 8601 text (the keys file's, the lockfile's), shown as `when` shows times.
  function isoWhen(text) {
    const ms = Date.parse(text);
    return Number.isNaN(ms) ? text : when(ms / 1000);
  }
  const num = (v, digits = 1) => (v === null || v === undefined ? dash : Number(v).toFixed(digits));
  const shortHash = (hash) => (hash ? hash.slice(0, 12) : dash);

  // ---- the server -------------------------------------------------------------------------
  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET" && state.session) headers["X-CSRF-Token"] = state.session.csrf;
    const res = await fetch(path, {
      method, headers, credentials: "same-origin", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    try { data = await res.json(); } catch (_) { data = null; }
    if (!res.ok) {
      const message = data && data.error ? data.error.message : `HTTP ${res.status}`;
      const err = new Error(message);
      err.status = res.status;
      err.data = data;
      if (data && data.error && data.error.code === "session_required") signedOut("Your session ended.", true);
      throw err;
    }
    return data;
  }

  function notice(text) {
    const el = $("notice");
    el.textContent = text || "";
    el.hidden = !text;
  }

  // ---- confirmation -----------------------------------------------------------------------
  function confirmAction(text, okLabel) {
    const dialog = $("confirm");
    $("confirm-text").textContent = text;
    $("confirm-ok").textContent = okLabel;
    return new Promise((resolve) => {
      const done = (answer) => {
        $("confirm-ok").removeEventListener("click", ok);
        $("confirm-cancel").removeEventListener("click", cancel);
        dialog.removeEventListener("cancel", cancel);
        if (dialog.open) dialog.close();
        resolve(answer);
      };
      const ok = () => done(true);
      const cancel = () => done(false);
      $("confirm-ok").addEventListener("click", ok);
      $("confirm-cancel").addEventListener("click", cancel);
      dialog.addEventListener("cancel", cancel);
      dialog.showModal();
      $("confirm-cancel").focus();
    });
  }

  // ---- sign-in and views ------------------------------------------------------------------
  const can = (scope) => Boolean(state.session && state.session.scopes.includes(scope));

  // The scope each view needs: a key without it never sees the view, whatever the address says.
  const needsScope = (view) => (view === "playground" ? "inference" : "admin");

  function show(view) {
    const signedIn = Boolean(state.session);
    if (!signedIn) view = "signin";
    else if (!VIEWS.includes(view) || !can(needsScope(view))) view = can("admin") ? "overview" : "playground";
    for (const name of ["signin", ...VIEWS]) $(`view-${name}`).hidden = name !== view;
    for (const link of document.querySelectorAll("#nav a")) {
      if (link.dataset.view === view) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
      link.parentElement.hidden = !can(needsScope(link.dataset.view));
    }
    $("nav").hidden = !signedIn;
    $("who").hidden = !signedIn;
    if (view === "keys") loadKeys();
    if (view === "usage") loadUsage();
    if (view === "playground") loadModels();
    if (view === "signin") $("signin-key").focus();
  }
  const route = () => show(location.hash.replace("#", ""));

  function signedIn(session) {
    state.session = session;
    restoreTranscript(session.key_id);
    $("who-name").textContent = `${iso(session.name)} (${session.key_id})`;
    $("admin-only-overview").hidden = can("admin");
    $("overview-body").hidden = !can("admin");
    $("playground-denied").hidden = can("inference");
    $("chat-form").hidden = !can("inference");
    notice("");
    if (can("admin")) connect();
    else setBadge("signed in: no overview for this key", "");
    route();
  }

  // Everything a signed-in key was shown: gone with its session, before anyone else signs in.
  const SHOWN = ["models-table", "reload-history", "actions-table", "keys-table", "usage-table"];
  const FILLED = ["lockfile", "host", "gpus", "action-outcome", "keys-outcome", "usage-outcome", "usage-svg",
    "usage-legend", "transcript", "charts", "chat-attach-error"];

  function forget() {
    for (const id of SHOWN) clear($(id).tBodies[0]);
    for (const id of FILLED) clear($(id));
    state.overview = null;
    state.samples = [];
    state.keys = null;
    state.conversation = [];
    state.attachments = [];
    renderAttach();
    $("who-name").textContent = "";
    $("daemon-info").textContent = "";
    $("chat-figures").textContent = "";
    drawCharts();
  }

  // A session that ends by itself (it expired, the daemon restarted, its stream said so) keeps
  // the playground's conversation off the page until the same key signs in again: the reply
  // half-streamed when it ended stays too. Signing out, or another key signing in, drops it.
  function keepTranscript() {
    const nodes = [...$("transcript").childNodes];
    const attachments = state.attachments;
    state.kept = (nodes.length || attachments.length) && state.session
      ? { keyId: state.session.key_id, nodes, conversation: state.conversation, attachments } : null;
  }

  function restoreTranscript(keyId) {
    const kept = state.kept;
    state.kept = null;
    if (!kept || kept.keyId !== keyId) return;
    $("transcript").append(...kept.nodes);
    state.conversation = kept.conversation;
    state.attachments = kept.attachments;
    renderAttach();
  }

  function signedOut(reason, keep = false) {
    if (state.source) { state.source.close(); state.source = null; }
    if (state.abort) state.abort.abort();
    if (keep) keepTranscript();
    else state.kept = null;
    state.session = null;
    state.lostAt = null;
    state.moved = false;
    $("overview-body").classList.remove("stale");
    forget();
    $("new-key").hidden = true;
    $("new-key-token").value = "";
    setBadge("signed out", "");
    if (reason) $("signin-error").textContent = reason + (state.kept ? " Your playground conversation comes back when you sign in again with the same key." : "");
    show("signin");
  }

  async function signIn(event) {
    event.preventDefault();
    const input = $("signin-key");
    const key = input.value.trim();
    input.value = ""; // the key leaves the page with this request and is kept nowhere
    $("signin-error").textContent = "";
    try {
      const session = await api("POST", "/ui/api/session", { key });
      signedIn(session);
    } catch (err) {
      $("signin-error").textContent = err.message;
      input.focus();
    }
  }

  async function signOut() {
    try { await api("POST", "/ui/api/session/end", {}); } catch (_) { /* ended already */ }
    signedOut("Signed out.");
  }

  // ---- live overview ----------------------------------------------------------------------
  function connect() {
    if (state.source) state.source.close();
    const source = new EventSource("/ui/api/events");
    state.source = source;
    source.addEventListener("history", (e) => {
      const data = JSON.parse(e.data);
      state.interval = data.interval_s;
      state.history = data.history_s || state.history;
      state.samples = data.samples;
      drawCharts();
    });
    source.addEventListener("overview", (e) => {
      state.tickAt = performance.now();
      found();
      const data = JSON.parse(e.data);
      state.overview = data;
      if (data.sample && (!state.samples.length || state.samples[state.samples.length - 1].t < data.sample.t)) {
        state.samples.push(data.sample);
        // As many as the daemon keeps (console.history_s): a page opened later sees as much.
        const keep = Math.max(2, Math.round(state.history / state.interval));
        if (state.samples.length > keep) state.samples.splice(0, state.samples.length - keep);
      }
      renderOverview(data);
    });
    source.addEventListener("end", (e) => {
      source.close();
      if (state.source === source) state.source = null;
      const reason = JSON.parse(e.data).reason;
      if (reason.startsWith("replaced")) moved();
      else signedOut(`Your session ended: ${reason}.`, true);
    });
    source.addEventListener("error", () => {
      if (state.source !== source) return;
      lost();
      if (source.readyState === EventSource.CLOSED) {
        // Refused on reconnecting (the daemon restarted: sessions live in its memory), or gone.
        setBadge("disconnected", "bad");
        source.close();
        state.source = null;
        setTimeout(recover, RECOVER_MS);
      } else setBadge("reconnecting…", "warn");
    });
  }

  const RECOVER_MS = 2000;

  // A stream can stall without breaking (the daemon stopped, a network that drops packets
  // without a reset): neither "error" nor "end" comes, and a wall display showed "ready" for
  // ever. No overview for STALE_TICKS intervals is a lost connection, said over the figures;
  // the next overview clears it.
  const STALE_TICKS = 3;
  setInterval(() => {
    if (!state.source || state.moved || state.lostAt || !state.tickAt) return;
    if (performance.now() - state.tickAt > STALE_TICKS * state.interval * 1000) {
      lost();
      setBadge("no figures", "warn");
    }
  }, 1000);

  // The figures on screen are as they were when the stream broke: say so, over them.
  function lost() {
    if (state.lostAt) return;
    state.lostAt = new Date();
    $("overview-body").classList.add("stale");
    $("readiness").className = "readiness bad";
    $("readiness").textContent = `Lost the connection to the daemon at ${clock(state.lostAt)} ${zone(state.lostAt)}: the figures below are from then.`;
    notice(`Lost the connection to the daemon at ${clock(state.lostAt)} ${zone(state.lostAt)}; trying again.`);
  }

  // A session has one live stream: another tab or window of it took the figures. Say so over
  // them (never a frozen "ready"), and take them back when this page is looked at again: a
  // focus or a return to the tab, so two open tabs never take turns by themselves.
  function moved() {
    state.moved = true;
    state.lostAt = state.lostAt || new Date();
    $("overview-body").classList.add("stale");
    $("readiness").className = "readiness bad";
    $("readiness").textContent = `The live figures went to another tab or window of this session at ${clock(state.lostAt)} ${zone(state.lostAt)}: the figures below are from then. Come back to this page to take them back.`;
    setBadge("paused", "warn");
  }

  function resume() {
    if (!state.moved || !state.session || state.source) return;
    state.moved = false;
    recover();
  }
  document.addEventListener("visibilitychange", () => { if (document.visibilityState === "visible") resume(); });
  window.addEventListener("focus", resume);

  function found() {
    state.moved = false;
    if (!state.lostAt) return;
    state.lostAt = null;
    $("overview-body").classList.remove("stale");
    notice("");
  }

  // After a refused stream: signed in still (connect again), signed out (the daemon restarted,
  // or the session ended: ask for a sign-in), or unreachable (try again in a moment).
  async function recover() {
    if (!state.session || state.source) return;
    try {
      const session = await api("GET", "/ui/api/session");
      if (!session.signed_in) {
        signedOut("The daemon restarted or your session ended: sign in again.", true);
        return;
      }
      connect();
    } catch (_) {
      setTimeout(recover, RECOVER_MS);
    }
  }

  function setBadge(text, kind) {
    const badge = $("ready-badge");
    badge.textContent = text;
    badge.className = `badge ${kind}`;
  }

  function renderOverview(data) {
    const ready = data.ready;
    const reasons = Object.entries(ready.models)
      .filter(([, m]) => m.state !== "ready")
      .map(([name, m]) => `${name} is ${m.state}${m.reason ? `: ${m.reason}` : ""}`);
    const isReady = ready.status === "ready";
    // The banner and the badge show the worst of what is wrong now, not readiness alone.
    const found = problems(data);
    const worst = !isReady || found.some((p) => p.level === "bad") ? "bad" : found.length ? "warn" : "ok";
    const told = found.map((p) => p.text).join("; ");
    setBadge(!isReady ? `not ready: ${ready.status}` : worst === "ok" ? "ready" : `ready, ${found.length} problem${found.length > 1 ? "s" : ""}`,
      worst === "warn" ? "warn" : worst);
    const readiness = $("readiness");
    readiness.textContent = ready.status === "draining" ? "Draining: the daemon is stopping. Running requests may finish; it takes no new connections."
      : ready.status === "ledger_failing" ? `Not ready: ${ready.reason}${data.status.ledger && data.status.ledger.error ? ` (${data.status.ledger.error})` : ""}. Usage and audit records are kept and tried again every few seconds.`
      : !isReady ? `Not ready (${ready.status}). ${[...reasons, ...found.map((p) => p.text)].join("; ")}`
      : worst === "ok" ? "Ready: every model is loaded and warmed." : `Ready, but: ${told}.`;
    readiness.className = `readiness ${worst}`;
    readiness.dataset.status = ready.status;
    readiness.dataset.worst = worst;
    const d = data.daemon;
    if (d) $("daemon-info").textContent = `edgellmd ${d.version} on ${d.address}, up ${duration(d.uptime_s)} (since ${when(d.started_at)})`;
    renderModels(data.status.models);
    renderActions(data.status.models);
    renderLock(data.lockfile, data.status.lock);
    renderHost(data.host);
    renderGpus(data.gpu, data.build);
    renderReloads(data.reloads);
    drawCharts();
  }

  const RECENT_STOP_S = 600; // an engine stop this recent is still news

  // What is wrong besides readiness: the lockfile, a failed reload, GPU verdicts, engine stops.
  function problems(data) {
    const out = [];
    const lock = data.lockfile || {};
    if (lock.problem) out.push({ level: "bad", text: `lockfile: ${lock.problem}` });
    else if (lock.expires_in_s !== undefined && lock.expires_in_s <= 0) out.push({ level: "bad", text: "the lockfile has expired" });
    else if (lock.expiry_warning) out.push({ level: "warn", text: "the lockfile expires soon" });
    for (const m of data.status.models) {
      if (m.last_reload && m.last_reload.result === "failed" && m.state === "ready") {
        out.push({ level: "warn", text: `the last reload of ${m.name} failed (the previous version serves)` });
      }
      const stop = m.last_engine_stop;
      if (stop && Date.now() / 1000 - stop.at < RECENT_STOP_S) {
        out.push({ level: "warn", text: `${m.name}'s engine stopped at ${when(stop.at)} (${stop.fault})` });
      }
    }
    for (const v of (data.gpu && data.gpu.verdicts) || []) {
      if (v.level === "error" || v.level === "warning") out.push({ level: v.level === "error" ? "bad" : "warn", text: v.message });
    }
    return out;
  }

  function lastReload(last) {
    if (!last) return dash;
    const text = `${last.result} (${last.trigger}, ${when(last.at)})`;
    return last.reason ? `${text}: ${last.reason}` : text;
  }

  function engineText(m) {
    // Where the model's llama.cpp runs: its own process (pid, resident memory) or the daemon.
    const p = m.engine_process;
    const stop = m.last_engine_stop ? `; last stop ${when(m.last_engine_stop.at)}: ${m.last_engine_stop.fault}` : "";
    const group = p && p.memory_group ? `, its memory group ${bytes(p.memory_group.usage_bytes)} of ${bytes(p.memory_group.limit_bytes)}` : "";
    if (p) return `process ${p.pid}, ${bytes(p.rss_bytes)} resident${group}${p.unconfined.length ? ` (not confined: ${p.unconfined.join(", ")})` : ""}${stop}`;
    return m.state === "ready" ? `in the daemon${stop}` : `${dash}${stop}`;
  }

  // A table body brought up to date in place: rows by their model, a cell replaced only when its
  // markup changed, so that keyboard focus, a click half-way and a text selection survive the
  // refresh every few seconds (a rebuilt row loses all three).
  // Each body cell carries its column's name, which a phone shows before it (the tables are
  // stacked cards there: app.css). New rows are labelled before patchRows compares them.
  function labelRow(table, tr) {
    const heads = table.tHead ? [...table.tHead.rows[0].cells].map((c) => c.textContent.trim()) : [];
    [...tr.cells].forEach((cell, i) => {
      if (cell.tagName === "TD" && heads[i] && cell.dataset.label !== heads[i]) cell.dataset.label = heads[i];
    });
  }
  new MutationObserver((changes) => {
    for (const change of changes) {
      for (const node of change.addedNodes) {
        if (node.nodeName === "TR" && node.closest("table")) labelRow(node.closest("table"), node);
      }
    }
  }).observe(document.getElementById("main"), { childList: true, subtree: true });

  function patchRows(body, rows) {
    const old = new Map([...body.rows].map((r) => [r.dataset.model, r]));
    let at = 0;
    for (const row of rows) {
      labelRow(body.parentElement, row);
      let tr = old.get(row.dataset.model);
      if (tr === undefined) tr = row;
      else {
        old.delete(row.dataset.model);
        const cells = [...row.cells];
        cells.forEach((cell, i) => {
          const mine = tr.cells[i];
          if (!mine) tr.append(cell);
          else if (mine.outerHTML !== cell.outerHTML) mine.replaceWith(cell);
        });
        while (tr.cells.length > cells.length) tr.cells[tr.cells.length - 1].remove();
      }
      if (body.rows[at] !== tr) body.insertBefore(tr, body.rows[at] || null);
      at += 1;
    }
    for (const tr of old.values()) tr.remove();
  }

  function renderModels(models) {
    const body = $("models-table").tBodies[0];
    const rows = [];
    for (const m of models) {
      const cell = (field, text, cls) => h("td", { "data-field": field, class: cls }, text);
      rows.push(h("tr", { "data-model": m.name },
        h("th", { scope: "row", "data-field": "name" }, m.name),
        cell("state", m.reason && m.state !== "ready" ? `${m.state}: ${m.reason}` : m.state + (m.reloading ? " (reloading)" : ""), `state-${m.state}`),
        cell("version", m.version === undefined || m.version === null ? dash : m.version),
        cell("sha256", shortHash(m.sha256), "mono"),
        cell("slots", `${m.slots_busy ?? 0} / ${m.slots_total}`),
        queueCell(m),
        cell("waits", waitsText(m)),
        cell("tenants", tenantsText(m)),
        cell("loaded_at", m.loaded_at ? when(m.loaded_at) : dash),
        cell("last_reload", lastReload(m.last_reload)),
        cell("engine", engineText(m)),
      ));
    }
    patchRows(body, rows);
  }

  // The queue: how many wait of how many may, and (engine.fairness.queue) when the next one and
  // the last one may expect a slot; each waiting request, in the order it would be taken, on hover.
  function queueCell(m) {
    const f = m.performance && m.performance.fairness;
    const queue = (f && f.queue) || [];
    let text = `${m.queue_depth ?? 0} / ${m.queue_size}`;
    const guess = (q) => (q.estimated_wait_ms === null || q.estimated_wait_ms === undefined ? "?" : `${num(q.estimated_wait_ms / 1000, 1)} s`);
    if (queue.length) {
      text += ` (next in ≈${guess(queue[0])}` + (queue.length > 1 ? `, last ≈${guess(queue[queue.length - 1])})` : ")");
    }
    const td = h("td", { "data-field": "queue" }, text);
    if (queue.length) {
      td.title = queue.map((q) => `${q.position}. ${q.tenant || "open"} (${q.class}): waited ${num(q.waited_ms / 1000, 1)} s, ≈${guess(q)} more`).join("\n");
    }
    return td;
  }

  // Fair share (engine.fairness): the recent waits for a slot, and who has work now.
  function waitsText(m) {
    const f = m.performance && m.performance.fairness;
    if (!f) return dash;
    const paused = f.paused ? `, ${f.paused} paused` : "";
    return `${num(f.queue_wait_ms.p50, 0)} / ${num(f.queue_wait_ms.p95, 0)} ms${paused}`;
  }

  function tenantsText(m) {
    const f = m.performance && m.performance.fairness;
    const tenants = f ? Object.entries(f.tenants) : [];
    if (!tenants.length) return dash;
    return tenants.map(([id, t]) => `${id || "open"}: ${t.running} running, ${t.waiting} waiting`).join("; ");
  }

  function renderLock(lock, status) {
    const dl = clear($("lockfile"));
    const add = (term, value, cls, field) => dl.append(h("dt", {}, term), h("dd", { class: cls, "data-field": field }, value));
    if (lock.unsigned) {
      add("Mode", "unsigned (development): models load unverified", "warning", "mode");
      return;
    }
    add("File", lock.file, "mono", "file");
    add("Version in force", status.version ?? dash, null, "version");
    if (lock.problem) add("Problem", lock.problem, "bad", "problem");
    if (lock.version !== undefined) add("Version on disk", lock.version, null, "disk_version");
    if (lock.signers) {
      const list = h("ul", {});
      for (const signer of lock.signers) {
        const mark = signer.verified ? "verified" : signer.trusted ? "trusted" : "not trusted";
        list.append(h("li", { class: signer.verified ? "ok" : signer.trusted ? "" : "bad" },
          h("span", { class: "mono" }, signer.key_id.slice(0, 16)), ` (${mark})`));
      }
      add("Signed by", list, null, "signers");
    }
    if (lock.expires) {
      const days = lock.expires_in_s / 86400;
      const left = lock.expires_in_s <= 0 ? "expired" : days < 2 ? `${Math.round(lock.expires_in_s / 3600)} h left` : `${Math.floor(days)} days left`;
      add("Expires", `${lock.expires_at ? when(lock.expires_at) : isoWhen(lock.expires)} (${left})${lock.expiry_warning ? ": sign a new lockfile soon" : ""}`,
        lock.expiry_warning ? "warning" : null, "expires");
    }
  }

  function renderHost(host) {
    const dl = clear($("host"));
    const add = (term, value, field) => dl.append(h("dt", {}, term), h("dd", { "data-field": field }, value));
    add("CPU", `${host.cpu_count} CPUs, ${num(host.cpu_usage_ratio * 100, 0)} % busy`, "cpu");
    add("Load (1 min)", num(host.load1, 2), "load1");
    add("Memory", `${bytes(host.memory_used_bytes)} of ${bytes(host.memory_total_bytes)}`, "memory");
    const pin = host.pinning;
    add("Pinning", pin.pinned ? `pinned to CPUs ${pin.cpus}` : `not pinned (CPUs ${pin.cpus})${pin.note ? `: ${pin.note}` : ""}`, "pinning");
    add("/dev/shm", host.shm ? `${bytes(host.shm.used_bytes)} used, ${bytes(host.shm.free_bytes)} free` : "no preload area", "shm");
    add("Daemon", `${bytes(host.process.rss_bytes)} resident, ${host.process.threads} threads`, "process");
  }

  function renderGpus(gpu, build) {
    const box = clear($("gpus"));
    if (build && build.error) {
      box.append(h("p", { class: "help", "data-field": "build-error" }, `The llama.cpp build could not be read: ${build.error}`));
    } else if (build) {
      // What the loaded llama.cpp can run on: its backends and the CUDA architectures it has code for.
      const dl = h("dl", {});
      const add = (term, value, field) => dl.append(h("dt", {}, term), h("dd", { "data-field": field }, value));
      add("Backends", build.backends.length ? build.backends.join(", ") : dash, "backends");
      const archs = build.cuda_archs;
      add("CUDA architectures", archs === null ? "not listed by this build" : archs.length
        ? archs.map((a) => `sm_${a}`).join(", ") : "none (no CUDA backend)", "cuda-archs");
      add("GPU offload", build.gpu_offload ? "supported" : "not supported: every layer runs on the CPU", "offload");
      box.append(h("div", { class: "card", "data-build": "" }, h("h3", {}, "llama.cpp build"), dl));
    }
    if (!gpu.available || !gpu.devices.length) {
      box.append(h("p", { class: "help", "data-field": "gpu-none" }, `No GPU in use: ${gpu.reason || "none found"}.`));
    }
    for (const d of gpu.devices || []) {
      const dl = h("dl", {});
      const add = (term, value, field) => dl.append(h("dt", {}, term), h("dd", { "data-field": field }, value));
      if (d.lost) add("State", "lost: fell off the bus or stopped answering", "state");
      add("Compute capability", d.compute_capability ? d.compute_capability.join(".") : dash, "cc");
      add("Memory", `${bytes(d.memory_used)} of ${bytes(d.memory_total)}`, "memory");
      add("Utilisation", d.utilization_gpu === null ? dash : `${d.utilization_gpu} %`, "util");
      add("Temperature", d.temperature_c === null ? dash : `${d.temperature_c} °C`, "temperature");
      add("Power", d.power_w === null ? dash : `${num(d.power_w, 0)} W of ${num(d.power_limit_w, 0)} W`, "power");
      add("Throttle reasons", d.throttle_reasons.length ? d.throttle_reasons.join(", ") : "none", "throttle");
      box.append(h("div", { class: "card", "data-gpu": d.index }, h("h3", {}, `GPU ${d.index}: ${d.name || "unknown"}`), dl));
    }
    const verdicts = gpu.verdicts || [];
    if (verdicts.length) {
      const list = h("ul", { "data-field": "verdicts" });
      for (const v of verdicts) {
        list.append(h("li", { class: v.level === "error" ? "bad" : v.level === "warning" ? "warning" : "" },
          v.message));
      }
      box.append(h("div", { class: "card" }, h("h3", {}, "Verdicts"), list));
    }
  }

  function renderReloads(reloads) {
    const body = clear($("reload-history").tBodies[0]);
    for (const r of reloads) {
      body.append(h("tr", { "data-model": r.model, "data-trigger": r.trigger },
        h("td", {}, when(r.at)), h("td", {}, r.model), h("td", { class: r.result === "failed" ? "bad" : "" }, r.result),
        h("td", {}, r.trigger), h("td", {}, r.version ?? dash), h("td", {}, r.reason || "")));
    }
  }

  // ---- charts -----------------------------------------------------------------------------
  function series() {
    const out = [
      { id: "tokens", title: "Tokens/s", unit: "", axis: " tokens/s", pick: (p) => p.tokens_per_s, digits: 1, total: " tokens" },
      { id: "ttft", title: "Time to first token", unit: " s", pick: (p) => p.ttft_s, digits: 3 },
      { id: "queue", title: "Queue depth", unit: "", axis: " waiting", pick: (p) => p.queue, digits: 0 },
      { id: "busy", title: "Busy slots", unit: "", axis: " busy", pick: (p) => p.busy, digits: 0 },
    ];
    const gpus = new Set();
    for (const p of state.samples) for (const g of p.gpus) gpus.add(g.index);
    for (const i of gpus) {
      const of = (p) => p.gpus.find((g) => g.index === i);
      out.push({ id: `gpu${i}-util`, title: `GPU ${i} utilisation`, unit: " %", pick: (p) => of(p)?.util ?? null, digits: 0, top: 100 });
      out.push({ id: `gpu${i}-mem`, title: `GPU ${i} memory`, unit: " GiB", pick: (p) => (of(p)?.memory_used ?? null) === null ? null : of(p).memory_used / 2 ** 30, digits: 1 });
      out.push({ id: `gpu${i}-temp`, title: `GPU ${i} temperature`, unit: " °C", pick: (p) => of(p)?.temperature ?? null, digits: 0 });
      out.push({ id: `gpu${i}-power`, title: `GPU ${i} power`, unit: " W", pick: (p) => of(p)?.power ?? null, digits: 0 });
    }
    return out;
  }

  // The y axis's top: the smallest of 1, 2, 2.5 or 5 times a power of ten at or above the
  // highest value, so that its label reads as a round figure.
  function niceTop(max, digits) {
    if (!(max > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(max));
    const top = [1, 2, 2.5, 5, 10].map((m) => m * p).find((v) => v >= max * (1 - 1e-9)) ?? 10 * p;
    return digits === 0 ? Math.max(1, Math.ceil(top)) : top;
  }

  const W = 300, H = 60; // the chart's drawing box (viewBox units)

  function chartFigure(box, sr) {
    let fig = box.querySelector(`[data-chart="${sr.id}"]`);
    if (fig) return fig;
    const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
    fig = h("figure", { class: "chart", "data-chart": sr.id },
      h("figcaption", {}, h("span", {}, sr.title), h("span", { class: "now" })),
      h("div", { class: "plot" },
        h("div", { class: "y", "aria-hidden": "true" }, h("span", { class: "y-top" }), h("span", { class: "y-zero" }, "0")),
        svg,
        h("span", {}),
        h("div", { class: "x", "aria-hidden": "true" }, h("span", { class: "x-start" }), h("span", { class: "x-end" }))),
      h("p", { class: "readout", "aria-live": "off" }));
    // Hover (or touch) reads one sample out: its time and value, with a guide line.
    svg.addEventListener("pointermove", (e) => {
      const rect = svg.getBoundingClientRect();
      fig.dataset.hover = String(Math.max(0, Math.min(1, (e.clientX - rect.left) / Math.max(1, rect.width))));
      drawReadout(fig, sr);
    });
    svg.addEventListener("pointerleave", () => {
      delete fig.dataset.hover;
      drawReadout(fig, sr);
    });
    box.append(fig);
    return fig;
  }

  // A per-second figure summed over the samples: each one's rate times the time it covers.
  function windowTotal(sr) {
    const samples = state.samples;
    let total = 0;
    samples.forEach((p, i) => {
      const v = sr.pick(p);
      if (v === null || v === undefined) return;
      total += v * (i ? p.t - samples[i - 1].t : state.interval);
    });
    return total;
  }

  function drawReadout(fig, sr) {
    const svg = fig.querySelector("svg");
    svg.querySelector(".guide")?.remove();
    const readout = fig.querySelector(".readout");
    const samples = state.samples;
    if (fig.dataset.hover === undefined || samples.length < 2) {
      // A rate's chart says what it adds up to over the window: the count /metrics has too.
      readout.textContent = sr.total && samples.length ? `${Math.round(windowTotal(sr)).toLocaleString("en")}${sr.total} in the last ${duration(samples.length * state.interval)}` : "";
      return;
    }
    const i = Math.round(Number(fig.dataset.hover) * (samples.length - 1));
    const x = (i * W) / (samples.length - 1);
    svg.append(s("line", { class: "guide", x1: x, y1: 0, x2: x, y2: H }));
    const v = sr.pick(samples[i]);
    const value = v === null || v === undefined ? "no figure" : `${num(v, sr.digits)}${sr.axis ?? sr.unit}`;
    readout.textContent = `${clock(new Date(samples[i].t * 1000))}: ${value}`;
  }

  function drawCharts() {
    const box = $("charts");
    const samples = state.samples;
    const minutes = Math.max(1, Math.round((samples.length * state.interval) / 60));
    for (const sr of series()) {
      const fig = chartFigure(box, sr);
      const values = samples.map(sr.pick);
      const known = values.filter((v) => v !== null && v !== undefined);
      const last = known.length ? known[known.length - 1] : null;
      const max = Math.max(1e-9, ...known);
      const top = sr.top ?? niceTop(known.length ? Math.max(...known) : 0, sr.digits);
      // "Now" is the latest sample's value: an interval without one (no request started) says
      // so, with the last value and its age, instead of showing an old figure as current.
      const latest = values.length ? values[values.length - 1] : null;
      let now = latest === null || latest === undefined ? dash : `${num(latest, sr.digits)}${sr.unit}`;
      if ((latest === null || latest === undefined) && last !== null) {
        let at = values.length - 1;
        while (at >= 0 && (values[at] === null || values[at] === undefined)) at -= 1;
        const ago = Math.round((values.length - 1 - at) * state.interval);
        now = `${dash} (${num(last, sr.digits)}${sr.unit} ${ago} s ago)`;
      }
      fig.querySelector(".now").textContent = now;
      fig.querySelector(".y-top").textContent = `${num(top, sr.digits === 0 ? 0 : top < 10 ? sr.digits : 0)}${sr.axis ?? sr.unit}`;
      fig.querySelector(".x-start").textContent = samples.length ? clock(new Date(samples[0].t * 1000), false) : "";
      fig.querySelector(".x-end").textContent = samples.length ? `${clock(new Date(samples[samples.length - 1].t * 1000))} ${zone(new Date())}` : "";
      const svg = fig.querySelector("svg");
      svg.setAttribute("aria-label", `${sr.title} over the last ${minutes} min: now ${last === null ? "no data" : num(last, sr.digits) + sr.unit}, highest ${known.length ? num(max, sr.digits) + sr.unit : "none"}`);
      while (svg.firstChild) svg.firstChild.remove();
      svg.append(s("line", { class: "base", x1: 0, y1: H - 1, x2: W, y2: H - 1 }));
      svg.append(s("line", { class: "grid", x1: 0, y1: 1, x2: W, y2: 1 }));
      if (values.length >= 2) {
        const step = W / (values.length - 1);
        const points = [];
        values.forEach((v, i) => {
          if (v === null || v === undefined) return;
          points.push(`${(i * step).toFixed(1)},${(H - 1 - (Math.min(v, top) / top) * (H - 2)).toFixed(1)}`);
        });
        if (points.length >= 2) {
          const first = points[0].split(",")[0];
          const lastX = points[points.length - 1].split(",")[0];
          svg.append(s("polygon", { class: "area", points: `${first},${H - 1} ${points.join(" ")} ${lastX},${H - 1}` }));
          svg.append(s("polyline", { class: "line", points: points.join(" ") }));
        }
      }
      drawReadout(fig, sr);
    }
  }

  // ---- actions ----------------------------------------------------------------------------
  function showOutcome(title, data) {
    const box = clear($("action-outcome"));
    box.append(h("p", { class: data.ok ? "ok" : "bad" }, `${title}: ${data.ok ? "done" : "failed"}`));
    const list = h("ul", {});
    for (const r of data.results) {
      list.append(h("li", { "data-model": r.model, "data-result": r.result },
        `${r.model}: ${r.result}${r.version !== null && r.version !== undefined ? ` (lock version ${r.version})` : ""}${r.reason ? ` – ${r.reason}` : ""}`));
    }
    if (!data.results.length) list.append(h("li", {}, "nothing to do"));
    box.append(list);
  }

  // One action at a time: every action button is disabled while one runs (a second click would
  // start another, and its answer would replace the first's).
  const ACTION_BUTTONS = "#actions-table button, #reload-all, #reload-force";

  function setActing(on) {
    state.acting = on;
    for (const button of document.querySelectorAll(ACTION_BUTTONS)) button.disabled = on;
  }

  async function act(title, path, body, confirmText, okLabel) {
    if (state.acting) return;
    if (confirmText && !(await confirmAction(confirmText, okLabel))) return;
    setActing(true);
    const box = clear($("action-outcome"));
    box.append(h("p", {}, `${title}: running…`));
    try {
      showOutcome(title, await api("POST", path, body));
    } catch (err) {
      if (err.data && err.data.results) showOutcome(title, err.data);
      else clear(box).append(h("p", { class: "bad" }, `${title}: ${err.message}`));
    } finally {
      setActing(false);
    }
  }

  function renderActions(models) {
    const body = $("actions-table").tBodies[0];
    const rows = [];
    for (const m of models) {
      const name = m.name;
      const buttons = [];
      if (m.state === "ready") {
        buttons.push(h("button", { type: "button", "data-action": "reload", on: { click: () => act(`Reload ${name}`, "/ui/api/reload", { model: name }) } }, "Reload"));
        buttons.push(h("button", { type: "button", class: "secondary", "data-action": "force", on: { click: () => act(`Force reload ${name}`, "/ui/api/reload", { model: name, force: true }, `Load ${name} again from its file even if it did not change? Requests in flight finish on the running copy.`, "Force reload") } }, "Force reload"));
        buttons.push(h("button", { type: "button", class: "danger", "data-action": "unload", on: { click: () => act(`Unload ${name}`, `/ui/api/models/${encodeURIComponent(name)}/unload`, {}, `Stop serving ${name}? Its clients get errors until it is loaded again.`, "Unload") } }, "Unload"));
      } else if (m.state !== "loading") {
        buttons.push(h("button", { type: "button", "data-action": "load", on: { click: () => act(`Load ${name}`, `/ui/api/models/${encodeURIComponent(name)}/load`, {}) } }, "Load"));
      }
      for (const button of buttons) {
        button.setAttribute("aria-label", `${button.textContent} ${name}`); // the row's model, for a screen reader
        button.disabled = Boolean(state.acting);
      }
      rows.push(h("tr", { "data-model": name }, h("th", { scope: "row" }, name), h("td", { class: `state-${m.state}` }, m.state), h("td", {}, buttons)));
    }
    patchRows(body, rows);
  }

  // ---- keys -------------------------------------------------------------------------------
  async function loadKeys() {
    if (!can("admin")) return;
    try {
      const data = await api("GET", "/ui/api/keys");
      state.keys = data;
      renderKeys(data);
    } catch (err) {
      keysOutcome(err.message, "bad");
    }
  }

  function keysOutcome(text, cls) {
    clear($("keys-outcome")).append(h("p", { class: cls }, text));
  }

  function renderKeys(data) {
    const readonly = $("keys-readonly");
    readonly.hidden = data.writable;
    readonly.textContent = data.writable ? "" : `The daemon cannot write its keys file (${data.file}): keys can be listed here, not changed. See the README's Console section for what to allow.`;
    const body = clear($("keys-table").tBodies[0]);
    for (const k of data.keys) {
      const limits = Object.entries(k.limits).map(([n, v]) => `${n}=${v}`).join(" ") || dash;
      const buttons = [];
      if (k.state === "disabled") {
        buttons.push(h("button", { type: "button", "data-action": "enable", on: { click: () => keyAction(k, "enable") } }, "Enable"));
      } else {
        buttons.push(h("button", { type: "button", class: "secondary", "data-action": "disable", on: { click: () => keyAction(k, "disable") } }, "Disable"));
      }
      buttons.push(h("button", { type: "button", class: "danger", "data-action": "revoke", on: { click: () => keyAction(k, "revoke") } }, "Revoke"));
      body.append(h("tr", { "data-key": k.id },
        h("td", { class: "mono" }, k.id), h("th", { scope: "row" }, k.name), h("td", {}, k.scopes.join(", ")),
        h("td", { "data-field": "state", class: k.state === "active" ? "ok" : "bad" }, k.state),
        h("td", {}, k.created ? isoWhen(k.created) : dash), h("td", {}, k.expires ? isoWhen(k.expires) : "never"), h("td", {}, limits), h("td", {}, buttons)));
    }
  }

  // ---- usage ------------------------------------------------------------------------------
  const USAGE_COLOURS = 8; // .k0 to .k7 in app.css, then they repeat

  function isoDay(date) {
    return `${date.getFullYear()}-${String(date.getMonth() + 1).padStart(2, "0")}-${String(date.getDate()).padStart(2, "0")}`;
  }

  async function loadUsage() {
    if (!can("admin")) return;
    const days = Number.parseInt($("usage-days").value, 10) || 30;
    const since = new Date(Date.now() - (days - 1) * 86400000);
    try {
      const [usage, keys] = await Promise.all([
        api("GET", `/ui/api/usage?group=day&since=${isoDay(since)}`),
        api("GET", "/ui/api/keys").catch(() => ({ keys: [] })), // names, as the keys file has them now
      ]);
      renderUsage(usage, keys.keys || [], days);
      clear($("usage-outcome"));
    } catch (err) {
      clear($("usage-outcome")).append(h("p", { class: "bad" }, `Usage: ${err.message}`));
    }
  }

  function renderUsage(usage, keys, days) {
    const names = new Map(keys.map((k) => [k.id, k.name]));
    const label = (id) => (id ? `${iso(names.get(id) || "removed key")} (${id})` : "no key (auth off)");
    // Per day and key: the rows come per model and endpoint too.
    const perDay = new Map();
    const perKey = new Map();
    for (const r of usage.data) {
      const day = perDay.get(r.period) || new Map();
      const cell = day.get(r.key_id) || { requests: 0, prompt: 0, completion: 0, total: 0 };
      cell.requests += r.requests; cell.prompt += r.prompt_tokens; cell.completion += r.completion_tokens; cell.total += r.total_tokens;
      day.set(r.key_id, cell);
      perDay.set(r.period, day);
      perKey.set(r.key_id, (perKey.get(r.key_id) || 0) + r.total_tokens);
    }
    const order = [...perKey.keys()].sort((a, b) => perKey.get(b) - perKey.get(a) || a.localeCompare(b));
    const colour = new Map(order.map((id, i) => [id, `k${i % USAGE_COLOURS}`]));
    const dayList = [];
    const start = new Date(Date.now() - (days - 1) * 86400000);
    for (let i = 0; i < days; i += 1) dayList.push(isoDay(new Date(start.getTime() + i * 86400000)));
    const svg = clear($("usage-svg"));
    const max = Math.max(1, ...dayList.map((d) => [...(perDay.get(d) || new Map()).values()].reduce((a, c) => a + c.total, 0)));
    const width = 600 / dayList.length;
    svg.append(s("line", { class: "base", x1: 0, y1: 199, x2: 600, y2: 199 }));
    dayList.forEach((d, i) => {
      let y = 199;
      for (const id of order) {
        const cell = (perDay.get(d) || new Map()).get(id);
        if (!cell || !cell.total) continue;
        const height = (cell.total / max) * 190;
        y -= height;
        const bar = s("rect", { class: `bar ${colour.get(id)}`, x: (i * width + width * 0.1).toFixed(2), y: y.toFixed(2), width: (width * 0.8).toFixed(2), height: height.toFixed(2), "data-day": d, "data-key": id, "data-total": cell.total });
        const title = s("title", {});
        title.textContent = `${d}, ${label(id)}: ${cell.total} tokens in ${cell.requests} requests`;
        bar.append(title);
        svg.append(bar);
      }
    });
    const total = usage.totals.total_tokens;
    svg.setAttribute("aria-label", `Tokens per key and day over the last ${days} days: ${total} in all, at most ${max === 1 && !total ? 0 : max} in one day`);
    $("usage-caption").textContent = `Tokens per day, last ${days} days (${usage.time_zone}): ${total} in all`;
    const legend = clear($("usage-legend"));
    for (const id of order) legend.append(h("li", { "data-key": id }, h("span", { class: `swatch ${colour.get(id)}` }), `${label(id)}: ${perKey.get(id)}`));
    if (!order.length) legend.append(h("li", {}, "No usage in this period."));
    const body = clear($("usage-table").tBodies[0]);
    for (const d of [...perDay.keys()].sort().reverse()) {
      for (const id of order) {
        const cell = perDay.get(d).get(id);
        if (!cell) continue;
        body.append(h("tr", { "data-day": d, "data-key": id },
          h("td", {}, d), h("th", { scope: "row" }, label(id)), h("td", {}, cell.requests),
          h("td", {}, cell.prompt), h("td", {}, cell.completion), h("td", {}, cell.total)));
      }
    }
  }

  async function keyAction(key, verb) {
    const own = state.session && key.id === state.session.key_id ? " This is the key of your own session: you will be signed out." : "";
    const texts = {
      disable: [`Disable key ${key.id} (${iso(key.name)})? Its clients are refused, and its running requests end, until it is enabled again.${own}`, "Disable"],
      revoke: [`Revoke key ${key.id} (${iso(key.name)}) for good? It leaves the keys file; its clients are refused at once.${own}`, "Revoke"],
    };
    if (texts[verb] && !(await confirmAction(...texts[verb]))) return;
    try {
      await api("POST", `/ui/api/keys/${key.id}/${verb}`, {});
      keysOutcome(`Key ${key.id} (${iso(key.name)}): ${verb}d.`, "ok");
      await loadKeys();
    } catch (err) {
      keysOutcome(`Key ${key.id}: ${err.message}`, "bad");
    }
  }

  async function createKey(event) {
    event.preventDefault();
    const intOf = (id) => { const v = $(id).value.trim(); return v ? Number.parseInt(v, 10) : null; };
    const limits = {};
    for (const [name, id] of [["rpm", "key-rpm"], ["tpm", "key-tpm"], ["concurrent", "key-concurrent"], ["max_tokens", "key-max-tokens"]]) {
      const v = intOf(id);
      if (v !== null) limits[name] = v;
    }
    const scopes = [...document.querySelectorAll('#key-form input[name="scope"]:checked')].map((i) => i.value);
    try {
      const data = await api("POST", "/ui/api/keys", { name: $("key-name").value.trim(), scopes, expires_days: intOf("key-expires"), limits });
      $("new-key").hidden = false;
      $("new-key-token").value = data.token;
      $("new-key-token").focus();
      $("new-key-token").select();
      keysOutcome(`Key ${data.key.id} (${iso(data.key.name)}) created.`, "ok");
      $("key-form").reset();
      await loadKeys();
    } catch (err) {
      keysOutcome(`Not created: ${err.message}`, "bad");
    }
  }

  // ---- playground -------------------------------------------------------------------------
  async function loadModels() {
    if (!can("inference")) return;
    try {
      const data = await api("GET", "/ui/api/models");
      const select = $("chat-model");
      const chosen = select.value;
      clear(select);
      for (const name of data.models) select.append(h("option", { value: name }, name));
      if (data.models.includes(chosen)) select.value = chosen;
      state.models = {};
      for (const name of data.models) state.models[name] = (data.reads && data.reads[name]) || ["text"];
      state.media = data.media || null;
      fitAttachments();
    } catch (err) {
      $("chat-figures").textContent = err.message;
    }
  }

  function turn(role, text, attached = []) {
    const body = h("div", { class: "text" }, text);
    const el = h("div", { class: `turn ${role}`, "data-role": role }, h("span", { class: "role" }, role === "user" ? "You" : "Model"), body,
      // Each file's item in its turn, to mark it once it is no longer sent (see `fitted`).
      attached.length ? h("ul", { class: "attachments", "aria-label": "Sent with this message" }, attached.map((a) => (a.shown = attachmentItem(a)))) : null);
    $("transcript").append(el);
    return body;
  }

  // ---- attachments ------------------------------------------------------------------------
  // Images and audio clips for a model with a projector, sent as the user turn's content parts
  // (image_url data: URLs, input_audio base64). The page checks the bounds /ui/api/models gives
  // before anything is sent, so that a file the server would refuse costs no request; the
  // server checks them all again. A file's kind comes from its name or type (what the picker
  // offered); its format from its first bytes where they say one (a JPEG saved as .png goes as
  // the JPEG it is), else from its name, and then the server's answer says what is wrong.
  // Coupled to the formats the server reads (engine/media.py IMAGE_FORMATS, AUDIO_FORMATS and
  // its aliases; /ui/api/models lists them): a format added there is added here.
  const KINDS = {
    png: ["image", "png"], jpg: ["image", "jpeg"], jpeg: ["image", "jpeg"], webp: ["image", "webp"], gif: ["image", "gif"],
    wav: ["audio", "wav"], mp3: ["audio", "mp3"], flac: ["audio", "flac"], ogg: ["audio", "ogg"], oga: ["audio", "ogg"],
    "image/png": ["image", "png"], "image/jpeg": ["image", "jpeg"], "image/webp": ["image", "webp"], "image/gif": ["image", "gif"],
    "audio/wav": ["audio", "wav"], "audio/x-wav": ["audio", "wav"], "audio/wave": ["audio", "wav"], "audio/vnd.wave": ["audio", "wav"],
    "audio/mpeg": ["audio", "mp3"], "audio/mp3": ["audio", "mp3"], "audio/flac": ["audio", "flac"], "audio/x-flac": ["audio", "flac"],
    "audio/ogg": ["audio", "ogg"], "application/ogg": ["audio", "ogg"],
  };
  const ACCEPT = {
    image: ".png,.jpg,.jpeg,.webp,.gif,image/png,image/jpeg,image/webp,image/gif",
    audio: ".wav,.mp3,.flac,.ogg,.oga,audio/wav,audio/x-wav,audio/mpeg,audio/flac,audio/ogg",
  };
  const IMAGE_TYPES = { png: "image/png", jpeg: "image/jpeg", webp: "image/webp", gif: "image/gif" };
  const FORMAT_NAMES = { png: "PNG", jpeg: "JPEG", webp: "WebP", gif: "GIF", wav: "WAV", mp3: "MP3", flac: "FLAC", ogg: "Ogg" };
  const KIND_WORDS = { image: ["image", "images", "media.max_images", "media.max_image_bytes"], audio: ["audio clip", "audio clips", "media.max_clips", "media.max_audio_bytes"] };
  const THUMB_PX = 160; // the longer side of a thumbnail: the page keeps these, not the pictures
  const ENVELOPE = 1024; // room in a request for everything but the base64 of its files

  const chosenModel = () => $("chat-model").value;
  const readsOf = (model) => state.models[model] || ["text"];
  const mostOf = (kind) => (state.media ? (kind === "image" ? state.media.max_images : state.media.max_clips) : 0);
  const bytesOf = (kind) => (kind === "image" ? state.media.max_image_bytes : state.media.max_audio_bytes);
  const base64Length = (size) => 4 * Math.ceil(size / 3);
  // What may be attached now: the kinds the chosen model reads that the server takes at all.
  function offered() {
    if ($("chat-mode").value !== "chat") return [];
    return ["image", "audio"].filter((kind) => readsOf(chosenModel()).includes(kind) && mostOf(kind) > 0);
  }

  function sniff(head) {
    const at = (i, text) => [...text].every((c, j) => head[i + j] === c.charCodeAt(0));
    if (head[0] === 0x89 && at(1, "PNG")) return ["image", "png"];
    if (head[0] === 0xff && head[1] === 0xd8 && head[2] === 0xff) return ["image", "jpeg"];
    if (at(0, "RIFF") && at(8, "WEBP")) return ["image", "webp"];
    if (at(0, "GIF87a") || at(0, "GIF89a")) return ["image", "gif"];
    if (at(0, "RIFF") && at(8, "WAVE")) return ["audio", "wav"];
    if (at(0, "fLaC")) return ["audio", "flac"];
    if (at(0, "OggS")) return ["audio", "ogg"];
    if (at(0, "ID3") || (head[0] === 0xff && (head[1] & 0xe0) === 0xe0)) return ["audio", "mp3"];
    return null;
  }

  function readBase64(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result).slice(String(reader.result).indexOf(",") + 1));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  // A small copy of a picture to show (null where the browser cannot draw it: the server says why).
  async function thumbnail(file) {
    try {
      const bitmap = await createImageBitmap(file);
      const scale = Math.min(1, THUMB_PX / Math.max(bitmap.width, bitmap.height));
      const canvas = h("canvas", { width: Math.max(1, Math.round(bitmap.width * scale)), height: Math.max(1, Math.round(bitmap.height * scale)) });
      canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
      bitmap.close();
      return canvas.toDataURL("image/png");
    } catch (_) {
      return null;
    }
  }

  // Why `file` may not go with the message, or null; `more`: what is attached already.
  function refusal(file, kind, more) {
    const [one, many, countSetting, bytesSetting] = KIND_WORDS[kind];
    const name = `"${file.name}"`;
    if (file.size === 0) return `${name} is empty.`;
    const exact = (n) => n.toLocaleString("en");
    if (file.size > bytesOf(kind)) return `${name} is ${bytes(file.size)} (${exact(file.size)} bytes): an ${one} may be at most ${exact(bytesOf(kind))} bytes (${bytesSetting}).`;
    if (more.filter((a) => a.kind === kind).length >= mostOf(kind)) return `${name} is one ${one} too many: a message may hold at most ${mostOf(kind)} ${many} (${countSetting}).`;
    const sent = more.reduce((sum, a) => sum + base64Length(a.size), 0) + base64Length(file.size) + ENVELOPE;
    if (sent > state.media.max_body_bytes) {
      return `${name} is ${bytes(file.size)}: sent as base64 with ${more.length ? "the other files" : "the message"}, it would take ${bytes(sent)}, more than the ${bytes(state.media.max_body_bytes)} a request may hold (server.max_body_bytes).`;
    }
    return null;
  }

  // Files picked are read before a message goes: a send meanwhile waits for them (`state.reading`).
  function attachFiles(input) {
    const reading = readFiles(input).finally(() => { if (state.reading === reading) state.reading = null; });
    state.reading = reading;
  }

  async function readFiles(input) {
    const files = [...input.files];
    input.value = ""; // the same file may be picked again after it is removed
    if (state.reading) await state.reading; // one pick after another, in order
    const refused = [];
    const kinds = offered();
    for (const file of files) {
      const ext = file.name.includes(".") ? file.name.split(".").pop().toLowerCase() : "";
      const [kind] = KINDS[ext] || KINDS[file.type] || [null];
      if (!kind || !kinds.includes(kind)) {
        const what = kinds.map((k) => (k === "image" ? "images (PNG, JPEG, WebP, GIF)" : "audio (WAV, MP3, FLAC, Ogg)")).join(" or ");
        refused.push(`"${file.name}" is not a file this model reads: it takes ${what}.`);
        continue;
      }
      const why = refusal(file, kind, state.attachments);
      if (why) { refused.push(why); continue; }
      const found = sniff(new Uint8Array(await file.slice(0, 12).arrayBuffer()));
      const format = found && found[0] === kind ? found[1] : (KINDS[ext] || KINDS[file.type])[1];
      let data;
      try { data = await readBase64(file); } catch (_) { refused.push(`"${file.name}" could not be read.`); continue; }
      const thumb = kind === "image" ? await thumbnail(file) : null;
      // Checked again: the model or mode may have changed while the file was read.
      const late = offered().includes(kind) ? refusal(file, kind, state.attachments) : `"${file.name}": the model changed while it was read.`;
      if (late) { refused.push(late); continue; }
      state.attachments.push({ kind, name: file.name, size: file.size, format, data, thumb });
    }
    $("chat-attach-error").textContent = refused.join(" ");
    renderAttach();
  }

  function attachmentItem(a, remove) {
    const label = `${a.name} (${a.kind === "image" ? FORMAT_NAMES[a.format] + " image" : FORMAT_NAMES[a.format] + " audio"}, ${bytes(a.size)})`;
    const item = h("li", { class: `attachment ${a.kind}`, "data-kind": a.kind },
      a.kind === "image" && a.thumb ? h("img", { src: a.thumb, alt: a.name, class: "thumb" }) : a.kind === "image" ? h("span", { class: "icon" }, "no preview") : h("span", { class: "icon", "aria-hidden": "true" }, "♪"),
      h("span", { class: "name" }, label));
    if (remove) {
      item.append(h("button", { type: "button", class: "secondary small", "aria-label": `Remove ${a.name}`, on: { click: remove } }, "Remove"));
    }
    return item;
  }

  // The control, its hint and the attached files as the chosen model and mode allow them.
  function renderAttach() {
    const kinds = offered();
    const input = $("chat-attach");
    input.hidden = !kinds.length;
    input.disabled = !kinds.length;
    input.accept = kinds.map((k) => ACCEPT[k]).join(",");
    const model = chosenModel();
    let help;
    if ($("chat-mode").value !== "chat") help = "Files go with chat mode only: a completion continues text.";
    else if (!model) help = "Pick a model to see what it reads.";
    else if (!kinds.length) {
      const reads = readsOf(model).filter((k) => k !== "text");
      help = reads.length
        ? `This server takes no ${reads.join(" or ")} (media.max_images, media.max_clips), so nothing can be attached.`
        : `The model ${model} reads text only (it has no multimodal projector), so nothing can be attached.`;
    } else {
      const room = Math.floor((state.media.max_body_bytes - ENVELOPE) / 4) * 3; // one file's bytes in a request
      help = kinds.map((k) => {
        const formats = state.media[k === "image" ? "image_formats" : "audio_formats"].map((f) => FORMAT_NAMES[f] || f).join(", ");
        return `${k === "image" ? "Images" : "Audio clips"} (${formats}): up to ${bytes(Math.min(bytesOf(k), room))} each, ${mostOf(k)} a message.`;
      }).join(" ");
    }
    $("chat-attach-help").textContent = help;
    const list = clear($("chat-attachments"));
    state.attachments.forEach((a) => list.append(attachmentItem(a, () => {
      state.attachments = state.attachments.filter((b) => b !== a);
      $("chat-attach-error").textContent = "";
      renderAttach();
      if ($("chat-attach").hidden) $("chat-message").focus();
      else $("chat-attach").focus();
    })));
    list.hidden = !state.attachments.length || $("chat-mode").value !== "chat";
    $("chat-message").required = !state.attachments.length; // a picture alone may be the question
  }

  // After the model or mode changed: files the chosen model cannot read are dropped, and said so.
  function fitAttachments() {
    const kinds = offered();
    const dropped = $("chat-mode").value === "chat" ? state.attachments.filter((a) => !kinds.includes(a.kind)) : [];
    if (dropped.length) {
      state.attachments = state.attachments.filter((a) => kinds.includes(a.kind));
      const model = chosenModel();
      $("chat-attach-error").textContent = `Removed ${dropped.map((a) => `"${a.name}"`).join(", ")}: the model ${model} reads no ${[...new Set(dropped.map((a) => (a.kind === "image" ? "images" : "audio")))].join(" or ")}.`;
    }
    renderAttach();
  }

  // A turn as the API takes it: text alone stays a string; with files, content parts. Files of
  // a kind the chosen model does not read, or dropped from the history, go as a note in words.
  function wire(entry, reads, gone) {
    if (!entry.attachments || !entry.attachments.length) return { role: entry.role, content: entry.content };
    const parts = entry.content ? [{ type: "text", text: entry.content }] : [];
    for (const a of entry.attachments) {
      if (a.data === null || gone.has(a) || !reads.includes(a.kind)) parts.push({ type: "text", text: `[${a.kind === "image" ? "an image" : "an audio clip"}, ${a.name}, was attached here]` });
      else if (a.kind === "image") parts.push({ type: "image_url", image_url: { url: `data:${IMAGE_TYPES[a.format]};base64,${a.data}` } });
      else parts.push({ type: "input_audio", input_audio: { data: a.data, format: a.format } });
    }
    return { role: entry.role, content: parts };
  }

  // Files in the history go again with every turn, so that the model can be asked more about
  // them: the page keeps their bytes in memory (never in storage) while they fit. When the
  // next request would go past a bound (media.max_images, media.max_clips or
  // server.max_body_bytes), the oldest are dropped for good (their bytes freed, a note in
  // words sent in their place, the thumbnail stays on the page), so what the page holds stays
  // within about one request. Returns the body to send, or why it cannot be sent (then nothing
  // is dropped).
  function fitted(body, system, current, reads) {
    const gone = new Set();
    for (;;) {
      body.messages = [...system, ...state.conversation.map((m) => wire(m, reads, gone)), wire(current, reads, gone)];
      const json = JSON.stringify(body);
      const count = (kind) => body.messages.reduce((n, m) => n + (Array.isArray(m.content)
        ? m.content.filter((p) => p.type === (kind === "image" ? "image_url" : "input_audio")).length : 0), 0);
      const over = count("image") > mostOf("image") ? "image" : count("audio") > mostOf("audio") ? "audio" : null;
      const big = new Blob([json]).size > (state.media ? state.media.max_body_bytes : Infinity);
      if (!over && !big) {
        for (const a of gone) a.data = null; // for good: its bytes are freed
        return { json, dropped: [...gone] };
      }
      const old = state.conversation.flatMap((m) => m.attachments || [])
        .find((a) => a.data !== null && !gone.has(a) && reads.includes(a.kind) && (!over || a.kind === over));
      if (!old) {
        return {
          refused: over
            ? `This message holds more ${KIND_WORDS[over][1]} than a request may (${mostOf(over)}, ${KIND_WORDS[over][2]}).`
            : `This message and its files take more than the ${bytes(state.media.max_body_bytes)} a request may hold (server.max_body_bytes): remove a file or start a new conversation.`,
        };
      }
      gone.add(old);
    }
  }

  // ---- markdown, safely -------------------------------------------------------------------
  // A model's reply as the markdown it is written in: paragraphs, headings, lists, quotes, code
  // blocks and spans, bold and italics. Built from DOM nodes whose text is the model's text:
  // nothing it writes ever becomes markup (no HTML parsing of it anywhere), and a link stays its text
  // and address, never a link to follow from an operator's console.
  // Underscores emphasise whole words only (CommonMark's rule): `__init__` and `a_b_c` stay text.
  const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|((?<![\p{L}\p{N}_])__[^_\n]+__(?![\p{L}\p{N}_]))|(\*[^*\s][^*\n]*\*)|((?<![\p{L}\p{N}_])_[^_\s][^_\n]*_(?![\p{L}\p{N}_]))|(\[[^\]\n]+\]\([^)\s]+\))/gu;

  function inline(text) {
    const out = [];
    let at = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > at) out.push(document.createTextNode(text.slice(at, m.index)));
      const t = m[0];
      if (m[1]) out.push(h("code", {}, t.slice(1, -1)));
      else if (m[2] || m[3]) out.push(h("strong", {}, t.slice(2, -2)));
      else if (m[4] || m[5]) out.push(h("em", {}, t.slice(1, -1)));
      else {
        const cut = t.indexOf("](");
        out.push(document.createTextNode(`${t.slice(1, cut)} (${t.slice(cut + 2, -1)})`));
      }
      at = m.index + t.length;
    }
    if (at < text.length) out.push(document.createTextNode(text.slice(at)));
    return out;
  }

  function withBreaks(lines) {
    const out = [];
    lines.forEach((line, i) => {
      if (i) out.push(h("br", {}));
      out.push(...inline(line));
    });
    return out;
  }

  function markdown(text) {
    const frag = document.createDocumentFragment();
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    const para = [];
    const flush = () => {
      if (para.length) frag.append(h("p", {}, ...withBreaks(para.splice(0))));
    };
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)\s*$/);
      if (fence) { // a code block, to its closing fence (or the end of a reply still streaming)
        flush();
        const code = [];
        i += 1;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
        i += 1;
        frag.append(h("pre", {}, h("code", fence[2] ? { "data-lang": fence[2] } : {}, code.join("\n"))));
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flush();
        frag.append(h("p", { class: `md-h md-h${heading[1].length}` }, ...inline(heading[2])));
        i += 1;
        continue;
      }
      const item = (l) => l.match(/^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/);
      if (item(line)) {
        flush();
        const ordered = /\d/.test(item(line)[1]);
        const list = h(ordered ? "ol" : "ul", {});
        while (i < lines.length && item(lines[i]) && /\d/.test(item(lines[i])[1]) === ordered) {
          list.append(h("li", {}, ...inline(item(lines[i])[2])));
          i += 1;
        }
        frag.append(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        flush();
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
        frag.append(h("blockquote", {}, ...withBreaks(quoted)));
        continue;
      }
      if (!line.trim()) flush();
      else para.push(line);
      i += 1;
    }
    flush();
    return frag;
  }

  // The reply's text as the model wrote it (for copy), shown as markdown in chat mode and as
  // plain text in completion mode (a base model's continuation is prose, not markup).
  // While it streams, drawn at most once a frame: a long reply is not parsed again per token.
  function showReply(out, text, completion, now = false) {
    out.raw = text;
    const draw = () => {
      out.pending = false;
      if (completion) out.textContent = out.raw;
      else out.replaceChildren(markdown(out.raw));
    };
    if (now) draw();
    else if (!out.pending) {
      out.pending = true;
      requestAnimationFrame(draw);
    }
  }

  async function copyReply(out, button) {
    try {
      await navigator.clipboard.writeText(out.raw ?? out.textContent);
      button.textContent = "Copied";
    } catch (_) {
      // No clipboard here (a page over plain HTTP from another host): select it to copy by hand.
      const range = document.createRange();
      range.selectNodeContents(out);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      button.textContent = "Selected: copy it";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }

  // Copy on every reply; Regenerate on the last one: it goes, and its question is asked again.
  function replyTools(out, message, completion, attached = []) {
    for (const old of $("transcript").querySelectorAll(".regenerate")) old.remove();
    const copy = h("button", { type: "button", class: "secondary small copy", "aria-label": "Copy this reply" }, "Copy");
    copy.addEventListener("click", () => copyReply(out, copy));
    const again = h("button", { type: "button", class: "secondary small regenerate", "aria-label": "Regenerate this reply" }, "Regenerate");
    again.addEventListener("click", () => {
      if ($("chat-send").disabled) return;
      const mine = out.parentElement;
      const asked = mine.previousElementSibling;
      if (!completion && state.conversation.length >= 2) state.conversation.splice(-2, 2);
      mine.remove();
      if (asked && asked.dataset.role === "user") asked.remove();
      $("chat-message").value = message;
      state.attachments = attached.filter((a) => a.data !== null);
      renderAttach();
      $("chat-form").requestSubmit();
    });
    out.parentElement.append(h("div", { class: "tools" }, copy, again));
  }

  async function send(event) {
    event.preventDefault();
    if (state.reading) { // files picked just before Enter go with this message, once read
      $("chat-send").disabled = true;
      try { await state.reading; } finally { $("chat-send").disabled = false; }
    }
    const figures = $("chat-figures");
    const message = $("chat-message").value;
    const completion = $("chat-mode").value === "completion"; // a base model continues the text itself
    const attached = completion ? [] : state.attachments.slice();
    if (!message.trim() && !attached.length) return;
    const system = $("chat-system").value.trim();
    const body = completion
      ? { model: $("chat-model").value, prompt: message, stream: true, stream_options: { include_usage: true } }
      : { model: $("chat-model").value, messages: [], stream: true, stream_options: { include_usage: true } };
    const current = attached.length ? { role: "user", content: message.trim() ? message : "", attachments: attached } : { role: "user", content: message };
    const temperature = $("chat-temperature").value.trim();
    if (temperature) body.temperature = Number(temperature);
    const maxTokens = $("chat-max-tokens").value.trim();
    if (maxTokens) body.max_tokens = Number.parseInt(maxTokens, 10);
    const schemaText = $("chat-schema").value.trim();
    if (schemaText) {
      try {
        body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schemaText) } };
      } catch (err) {
        figures.textContent = `The JSON schema is not valid JSON: ${err.message}`;
        figures.className = "figures bad";
        return;
      }
    }
    let sending = null;
    if (!completion) {
      sending = fitted(body, system ? [{ role: "system", content: system }] : [], current, readsOf(body.model));
      if (sending.refused) { // nothing sent: the message and its files stay to be changed
        figures.textContent = sending.refused;
        figures.className = "figures bad";
        return;
      }
    }
    $("chat-attach-error").textContent = "";
    if (sending && sending.dropped.length) {
      $("chat-attach-error").textContent = `No longer sent with the conversation, to keep within this server's bounds: ${sending.dropped.map((a) => `"${a.name}"`).join(", ")}.`;
      for (const a of sending.dropped) {
        if (!a.shown || a.shown.classList.contains("dropped")) continue;
        a.shown.classList.add("dropped");
        a.shown.append(h("span", { class: "note" }, " no longer sent"));
      }
    }
    figures.className = "figures";
    figures.textContent = "Generating…";
    const asked = turn("user", message, attached);
    $("chat-message").value = "";
    state.attachments = [];
    renderAttach();
    const out = turn("assistant", "");
    const transcript = $("transcript");
    transcript.setAttribute("aria-busy", "true");
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    state.abort = new AbortController();
    const started = performance.now();
    let first = null;
    let usage = null;
    let text = "";
    let pieces = 0; // streamed deltas: about one token each, for the figures when no usage comes
    let failure = null;
    try {
      const res = await fetch(completion ? "/ui/api/complete" : "/ui/api/chat", {
        method: "POST", credentials: "same-origin", signal: state.abort.signal,
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", "X-CSRF-Token": state.session.csrf },
        body: sending ? sending.json : JSON.stringify(body),
      });
      if (!res.ok) {
        let data = null;
        try { data = await res.json(); } catch (_) { data = null; }
        throw new Error(data && data.error ? data.error.message : `HTTP ${res.status}`);
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const chunk = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of chunk.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const payload = line.slice(6);
            if (payload === "[DONE]") continue;
            const data = JSON.parse(payload);
            if (data.error) { failure = data.error.message; continue; }
            if (data.usage) usage = data.usage;
            for (const choice of data.choices || []) {
              const piece = completion ? choice.text : choice.delta && choice.delta.content;
              if (piece) {
                if (first === null) first = performance.now();
                text += piece;
                pieces += 1;
                showReply(out, text, completion);
                out.parentElement.scrollIntoView({ block: "nearest" }); // the view follows the reply
              }
            }
          }
        }
      }
    } catch (err) {
      failure = err.name === "AbortError" ? "stopped" : err.message;
    } finally {
      transcript.setAttribute("aria-busy", "false");
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
      state.abort = null;
    }
    const end = performance.now();
    const ttft = first === null ? null : (first - started) / 1000;
    // Stopped or cut before the usage chunk: the deltas seen stand in for the token count.
    const tokens = usage ? usage.completion_tokens : pieces || null;
    const about = usage ? "" : "≈";
    const rate = tokens && first !== null && end > first ? tokens / ((end - first) / 1000) : null;
    // A reply that ended well is a turn even when it is empty (a model may stop at once): the
    // message and its files stay in the history, as the transcript shows them.
    if (!completion && (text || !failure)) state.conversation.push(current, { role: "assistant", content: text });
    if (text) {
      showReply(out, text, completion, true); // the whole reply, drawn now
      replyTools(out, message, completion, attached);
    }
    else if (!failure && !completion) {
      out.replaceChildren(h("em", { class: "help" }, "The model stopped without a word."));
      out.raw = ""; // Copy copies the reply, which is empty
      replyTools(out, message, completion, attached); // Regenerate asks again, with the files
    }
    else if (failure && failure !== "stopped") {
      // Nothing came back: no empty bubble, and the message is there to send again.
      asked.parentElement.remove();
      out.parentElement.remove();
      if (!$("chat-message").value) $("chat-message").value = message;
      if (!state.attachments.length && attached.length) { // the files too, to send again once fixed
        state.attachments = attached;
        fitAttachments();
      }
    }
    const parts = [`TTFT ${ttft === null ? dash : `${ttft.toFixed(3)} s`}`, `${rate === null ? dash : about + rate.toFixed(1)} tokens/s`, `${tokens === null ? dash : about + tokens} tokens`];
    figures.dataset.ttft = ttft === null ? "" : String(ttft);
    figures.dataset.tokens = tokens === null ? "" : String(tokens);
    figures.dataset.promptTokens = usage ? String(usage.prompt_tokens) : "";
    figures.textContent = failure ? `${parts.join(" · ")} · ended: ${failure}` : parts.join(" · ");
    figures.className = failure ? "figures bad" : "figures";
  }

  // ---- start ------------------------------------------------------------------------------
  async function start() {
    $("signin-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", signOut);
    $("reload-all").addEventListener("click", () => act("Reload", "/ui/api/reload", {}));
    $("reload-force").addEventListener("click", () => act("Force reload", "/ui/api/reload", { force: true },
      "Load every model again from its file, changed or not? Requests in flight finish on the running copies.", "Force reload"));
    $("key-form").addEventListener("submit", createKey);
    $("usage-form").addEventListener("submit", (event) => { event.preventDefault(); loadUsage(); });
    $("new-key-done").addEventListener("click", () => { $("new-key-token").value = ""; $("new-key").hidden = true; });
    $("chat-form").addEventListener("submit", send);
    $("chat-message").addEventListener("keydown", (event) => {
      // Enter sends, as in chat apps; Shift+Enter (or an input method composing) types on.
      if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
      event.preventDefault();
      if (!$("chat-send").disabled) $("chat-form").requestSubmit();
    });
    $("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
    $("chat-attach").addEventListener("change", (event) => attachFiles(event.target));
    $("chat-model").addEventListener("change", fitAttachments);
    $("chat-mode").addEventListener("change", fitAttachments);
    $("chat-clear").addEventListener("click", () => { state.conversation = []; clear($("transcript")); $("chat-figures").textContent = ""; });
    window.addEventListener("hashchange", route);
    try {
      const session = await api("GET", "/ui/api/session");
      if (session.signed_in) signedIn(session);
      else signedOut("");
    } catch (err) {
      notice(`The console cannot reach the daemon: ${err.message}`);
      signedOut("");
    }
  }
  start();
})();
