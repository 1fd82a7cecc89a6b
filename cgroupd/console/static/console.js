// cgroupd console: polls the console's JSON API every refresh interval and draws the group.
// Plain JS, no outside asset. Everything shown goes through textContent (never innerHTML):
// instance answers and advisories can be published by anyone allowed to publish.
"use strict";

const PALETTE = ["#2f6fde", "#1f9d8a", "#8e44ad", "#d9822b", "#3d8b37", "#c2185b",
  "#5c6bc0", "#00897b", "#6d4c41", "#7b8794", "#ad1457", "#0277bd"];
const TOKEN = document.querySelector('meta[name="cgroupd-token"]').content;
const S = { groups: [], current: null, interval: 2, actions: false, lastSeq: 0,
  timer: null, colors: new Map(), data: null, plan: null, entries: [] };

function $(id) { return document.getElementById(id); }
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}
function ranges(ps) {
  const p = [...new Set(ps || [])].sort((a, b) => a - b); const out = [];
  for (let i = 0; i < p.length;) { let j = i; while (j + 1 < p.length && p[j + 1] === p[j] + 1) j++;
    out.push(i === j ? `${p[i]}` : `${p[i]}-${p[j]}`); i = j + 1; }
  return out.join(",") || "-";
}
function dur(s) {
  if (!s) return "0s";
  if (s < 10) return `${s.toFixed(1)}s`;
  if (s < 90) return `${Math.round(s)}s`;
  if (s < 5400) return `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, "0")}s`;
  if (s < 172800) return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d`;
}
function num(n) { return (n || 0).toLocaleString("en-US"); }
function clock(iso) {
  const d = new Date(iso); if (isNaN(d)) return iso || "-";
  return d.toLocaleTimeString("en-GB", { hour12: false });
}
function ago(iso) {
  const d = new Date(iso); if (isNaN(d)) return iso || "-";
  const s = Math.max(0, (Date.now() - d) / 1000);
  return s < 60 ? `${Math.round(s)}s ago` : s < 3600 ? `${Math.round(s / 60)}m ago`
    : s < 86400 ? `${Math.round(s / 3600)}h ago` : `${Math.round(s / 86400)}d ago`;
}
function colorOf(member) {
  if (!S.colors.has(member)) S.colors.set(member, PALETTE[S.colors.size % PALETTE.length]);
  return S.colors.get(member);
}
async function api(path, opts) {
  const r = await fetch(path, Object.assign({ cache: "no-store", credentials: "same-origin" }, opts || {}));
  let body = null; try { body = await r.json(); } catch (e) { body = { error: `HTTP ${r.status}` }; }
  if (!r.ok) throw Object.assign(new Error(body && body.error || `HTTP ${r.status}`), { status: r.status });
  return body;
}

// -- groups -------------------------------------------------------------------------------
async function loadGroups() {
  try {
    const g = await api("/api/groups");
    S.groups = g.groups; S.interval = g.interval; S.actions = g.actions;
    $("server").textContent = g.server;
    $("mode").textContent = g.actions ? "actions enabled" : "read-only";
    $("mode").className = "badge" + (g.actions ? " rw" : "");
    drawGroups();
    if (!S.current && S.groups.length) choose(fromHash() || S.groups[0]);
  } catch (e) { $("live").className = "dot off"; $("server").textContent = e.message; }
}
function fromHash() {
  const m = location.hash.match(/^#\/([^/]+)\/([^/]+)$/); if (!m) return null;
  const [stream, group] = [decodeURIComponent(m[1]), decodeURIComponent(m[2])];
  return S.groups.find(g => g.stream === stream && g.group === group) || null;
}
function drawGroups() {
  const ul = $("groups"); ul.replaceChildren();
  $("groups-empty").classList.toggle("hidden", S.groups.length > 0);
  for (const g of S.groups) {
    const a = el("a", { href: `#/${encodeURIComponent(g.stream)}/${encodeURIComponent(g.group)}`,
      class: S.current && S.current.stream === g.stream && S.current.group === g.group ? "current" : "",
      "data-group": `${g.stream}/${g.group}` },
      el("span", {}, el("span", { class: "s" }, `${g.stream} / `), g.group), el("span", { class: "s small" }, g.type));
    a.addEventListener("click", ev => { ev.preventDefault(); choose(g); });
    ul.append(el("li", {}, a));
  }
}
function choose(g) {
  S.current = g; S.lastSeq = 0; S.data = null; S.colors = new Map(); S.entries = []; S.plan = null;
  history.replaceState(null, "", `#/${encodeURIComponent(g.stream)}/${encodeURIComponent(g.group)}`);
  $("timeline").replaceChildren(); $("plan").classList.add("hidden"); $("result").classList.add("hidden");
  $("placeholder").classList.add("hidden"); $("group").classList.remove("hidden");
  drawGroups(); clearTimeout(S.timer); poll();
}

// -- polling ------------------------------------------------------------------------------
async function poll() {
  const g = S.current; if (!g) return;
  try {
    const d = await api(`/api/groups/${encodeURIComponent(g.stream)}/${encodeURIComponent(g.group)}?after=${S.lastSeq}`);
    if (g !== S.current) return;
    draw(d); $("live").className = "dot on";
    $("refreshed").textContent = `read ${clock(d.read_at || d.now)}`;
  } catch (e) {
    $("live").className = "dot off"; showError(e.message);
  } finally {
    if (g === S.current) { clearTimeout(S.timer); S.timer = setTimeout(poll, S.interval * 1000); }
  }
}
function showError(msg) { const b = $("g-error"); b.textContent = msg; b.classList.toggle("hidden", !msg); }

function draw(d) {
  S.data = d;
  $("g-stream").textContent = d.stream; $("g-name").textContent = d.group;
  showError(d.error ? (d.stale ? `showing the last good read: ${d.error}` : d.error) : "");
  addEvents(d.events || []);
  if (!d.status) return;
  const st = d.status, rec = d.record;
  $("g-kind").textContent = `${st.type}, ${rec.partitions} partitions`;
  for (const m of [...rec.members, ...Object.keys(rec.assignment_ranges)].sort()) colorOf(m);
  const unowned = st.unowned_partitions.length;
  const health = $("g-health");
  health.textContent = st.idle ? "IDLE: nothing consumed" : unowned ? `${unowned} unowned` : "every partition owned";
  health.className = "badge " + (st.idle || unowned ? "bad" : "ok");
  const instances = (d.members || []).reduce((n, m) => n + m.instances.length, 0);
  $("t-partitions").textContent = rec.partitions;
  $("t-pending").textContent = num(st.pending);
  $("t-lag").textContent = num(st.max_lag_messages);
  $("t-lagtime").textContent = dur(st.max_lag_seconds);
  $("t-inflight").textContent = num(st.in_flight);
  $("t-unowned").textContent = unowned; $("t-unowned").className = "v" + (unowned ? " bad" : "");
  $("t-instances").textContent = instances;
  drawGrid(st); drawMembers(d.members || [], st); drawActions(rec);
  $("record").textContent = JSON.stringify(rec, null, 2);
}

function drawGrid(st) {
  const max = Math.max(1, ...st.partitions.map(p => p.lag_messages));
  const cells = st.partitions.map(p => {
    const unassigned = !p.member, unowned = p.member && !p.instance;
    const cls = "cell" + (unassigned ? " unassigned" : unowned ? " unowned" : "");
    const style = unassigned || unowned ? "" : `background:${colorOf(p.member)}`;
    const lag = p.lag_messages ? `${num(p.lag_messages)} msgs · ${dur(p.lag_seconds)}` : "no lag";
    return el("div", { class: cls, style, "data-partition": p.partition, "data-member": p.member || "",
        "data-instance": p.instance || "", title: `partition ${p.partition}: ${p.member || "no member"}` +
        `${p.instance ? ", instance " + p.instance : ""}${p.host ? " on " + p.host : ""}; ${lag}` },
      el("div", { class: "p" }, `P${p.partition}`),
      unowned ? el("span", { class: "flag" }, "UNOWNED") : unassigned ? el("span", { class: "flag" }, "NO MEMBER") : null,
      el("div", { class: "m" }, p.member || "-"),
      el("div", { class: "i" }, p.instance ? `${p.instance}${p.host ? " @ " + p.host : ""}` : unassigned ? "" : "no active instance"),
      el("div", { class: "l" }, lag),
      el("div", { class: "bar", style: `width:${Math.round(100 * p.lag_messages / max)}%` }));
  });
  $("grid").replaceChildren(...cells);
  const legend = [...S.colors.entries()].map(([m, c]) =>
    el("span", {}, el("i", { style: `background:${c}` }), m));
  legend.push(el("span", {}, el("i", { class: "unowned" }), "unowned"));
  $("legend").replaceChildren(...legend);
}

function drawMembers(members, st) {
  const rows = [];
  for (const m of members) {
    const chip = el("td", { class: "chip" }, el("i", { style: `background:${colorOf(m.member)}` }),
      m.member + (m.listed ? "" : " (not a member)"));
    const lag = m.pending ? ` · ${num(m.pending)} pending` : "";
    const parts = el("td", {}, ranges(m.partitions), el("span", { class: "muted small" }, lag));
    const insts = m.instances.length ? m.instances : [{ instance: m.active_instance, state: m.active_instance ? "active" : (m.partitions.length ? "none" : "-") }];
    insts.forEach((i, n) => {
      rows.push(el("tr", { class: n === 0 ? "member" : "", "data-member": m.member, "data-instance": i.instance || "",
          "data-state": i.state || "" },
        n === 0 ? chip : el("td"), n === 0 ? parts : el("td"),
        el("td", { class: "mono" }, i.instance || "-"),
        el("td", { class: `state ${i.state || ""}`, title: i.holder ? "a Spark query holds this member: a step-down ends the query" : "" },
          (i.state === "none" ? "NONE (not consumed)" : i.state || "-") +
          (i.holder ? ` (${i.holder === "spark" ? "Spark" : i.holder}${i.application ? " " + i.application : ""})` : "")),
        el("td", {}, i.host || "-"), el("td", {}, i.pid || "-"),
        el("td", { title: i.since || "" }, i.since ? ago(i.since) : "-")));
    });
  }
  $("members").tBodies[0].replaceChildren(...rows);
}

function addEvents(list) {
  if (!list.length) return;
  S.lastSeq = Math.max(S.lastSeq, ...list.map(e => e.seq));
  const ol = $("timeline"), g = S.current;
  const head = `${g.stream}/${g.group} `;
  for (const e of list) {
    // The line as `cgroupd events` prints it, less what the row already shows.
    let text = e.text.replace(/^\[[^\]]*\]\s*/, "");
    if (text.startsWith(head)) text = text.slice(head.length);
    const kind = e.kind.toUpperCase() + " ";
    if (text.startsWith(kind)) text = text.slice(kind.length);
    const top = ol.firstElementChild;
    if (top && top.dataset.kind === e.kind && top.dataset.text === text) {
      // A repeated advisory (the timed `unowned` one): counted, not listed again.
      const n = +top.dataset.repeat + 1; top.dataset.repeat = n;
      top.querySelector(".when").textContent = clock(e.time);
      top.querySelector(".times").textContent = ` ×${n}`;
      continue;
    }
    ol.prepend(el("li", { "data-kind": e.kind, "data-instance": e.instance || "", "data-member": e.member || "",
        "data-text": text, "data-repeat": 1 },
      el("span", { class: "when", title: e.time }, clock(e.time)),
      el("span", { class: `kind ${e.kind}` }, e.kind.replace("_", " ")),
      el("span", { class: "what" }, text, el("span", { class: "times" }))));
  }
  while (ol.children.length > 300) ol.lastChild.remove();
  $("timeline-empty").classList.toggle("hidden", ol.children.length > 0);
}

// -- actions ------------------------------------------------------------------------------
function drawActions(rec) {
  $("actions").classList.toggle("hidden", !S.actions);
  if (!S.actions) return;
  const sel = $("a-stepdown-member"), names = [...new Set([...rec.members, ...Object.keys(rec.assignment_ranges)])].sort();
  if ([...sel.options].map(o => o.value).join() !== names.join()) {
    const keep = sel.value;
    sel.replaceChildren(...names.map(n => el("option", { value: n }, n)));
    if (names.includes(keep)) sel.value = keep;
  }
}
function confirmModal(text) {
  return new Promise(resolve => {
    $("confirm-text").textContent = text; $("confirm").classList.remove("hidden");
    const done = ok => { $("confirm").classList.add("hidden"); $("confirm-ok").onclick = $("confirm-cancel").onclick = null; resolve(ok); };
    $("confirm-ok").onclick = () => done(true); $("confirm-cancel").onclick = () => done(false);
    $("confirm-ok").focus();
  });
}
function words(v) { return (v || "").split(/[\s,]+/).filter(Boolean); }
function showResult(ok, text) { const r = $("result"); r.textContent = text; r.className = "result " + (ok ? "ok" : "bad"); }
async function act(action, body, question) {
  const g = S.current;
  if (question && !(await confirmModal(question))) return null;
  try {
    const out = await api(`/api/groups/${encodeURIComponent(g.stream)}/${encodeURIComponent(g.group)}/actions/${action}`,
      { method: "POST", headers: { "Content-Type": "application/json", "X-Cgroupd-Token": TOKEN }, body: JSON.stringify(body) });
    if (action !== "replay-plan") showResult(true, out.message);
    clearTimeout(S.timer); poll();
    return out;
  } catch (e) { showResult(false, e.message); return null; }
}
function replayBody(f) {
  return { from: f.elements.from.value, value: f.elements.value.value, members: words(f.elements.members.value) };
}
function wire() {
  const where = () => `${S.current.stream}/${S.current.group}`;
  const on = (id, fn) => $(id).addEventListener("submit", ev => { ev.preventDefault(); fn(ev.target); });
  on("f-step-down", f => act("step-down", { member: f.elements.member.value },
    `Ask the active instance of ${f.elements.member.value} (${where()}) to hand over to a standby?`));
  on("f-member-add", f => act("member-add", { members: words(f.elements.members.value) },
    `Add ${words(f.elements.members.value).join(", ") || "(no member)"} to ${where()}? Partitions will be redistributed.`));
  on("f-member-drop", f => act("member-drop", { members: words(f.elements.members.value) },
    `Drop ${words(f.elements.members.value).join(", ") || "(no member)"} from ${where()}? Their partitions move to the others.`));
  on("f-mapping-set", f => act("mapping-set", { mappings: f.elements.mappings.value },
    `Replace the membership of ${where()} with the mappings ${f.elements.mappings.value}?`));
  on("f-mapping-clear", () => act("mapping-clear", {}, `Clear the mappings of ${where()}?`));
  on("f-replay", async f => {
    const body = replayBody(f); const out = await act("replay-plan", body, null);
    $("plan").classList.toggle("hidden", !out);
    if (out) { S.plan = body; $("plan-text").textContent = out.message; $("result").classList.add("hidden"); }
  });
  $("replay-execute").addEventListener("click", async () => {
    if (!S.plan) return;
    const out = await act("replay-execute", S.plan, `Execute the replay of ${where()} shown above? Messages will be processed again.`);
    if (out) { $("plan").classList.add("hidden"); S.plan = null; }
  });
  window.addEventListener("hashchange", () => { const g = fromHash(); if (g) choose(g); });
}

wire(); loadGroups(); setInterval(loadGroups, 30000);
