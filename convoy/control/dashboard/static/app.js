// The convoy dashboard's page: routes by the URL's hash (#/JOB/TAB), loads each page's JSON, and keeps it live from
// the server-sent stream. Every text goes in through textContent: nothing a job reports is parsed as HTML.
"use strict";

const TABS = ["overview", "nodes", "events", "metrics", "config", "rounds"];
const CHARTS = [["loss", "loss", "loss"], ["samples_per_s", "throughput", "samples/s"],
                ["step_time_s", "step time", "seconds"]];
const app = {csrf: "", jobs: [], single: false, key: "", tab: "overview", stream: null, data: {}, series: {},
             events: [], eventsMax: 0, filter: {kind: "", q: ""}, refetchAt: 0, ready: false};

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "on") for (const [name, fn] of Object.entries(value)) node.addEventListener(name, fn);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const clock = (ts) => ts ? new Date(ts * 1000).toLocaleTimeString() : "-";
const seconds = (s) => s === null || s === undefined ? "-" : s < 120 ? `${s.toFixed(1)} s` :
  `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
const bytes = (b) => b ? `${(b / 1048576).toFixed(1)} MiB` : "-";

async function getJSON(path) {
  const reply = await fetch(path, {credentials: "same-origin"});
  const body = await reply.json();
  if (!reply.ok) throw new Error(`${reply.status}: ${body.error}`);
  return body;
}

function table(headers, rows) {
  return h("table", {}, h("tr", {}, headers.map((name) => h("th", {}, name))),
           rows.map((cells) => h("tr", {}, cells.map((cell) =>
             cell instanceof Node ? h("td", {}, cell) : h("td", typeof cell === "number" ? {class: "num"} : {},
                                                           cell === null || cell === undefined ? "-" : cell)))));
}

function pairs(rows) {
  return h("table", {class: "pairs"}, rows.map(([name, value]) => h("tr", {}, h("th", {}, name),
    h("td", {id: `o-${name.replace(/ /g, "-")}`}, value === null || value === undefined ? "-" : value))));
}

const number = (v) => v === null || v === undefined ? "-" : Number(v.toPrecision(5));

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  let key = parts[0] || "", tab = TABS.includes(parts[1]) ? parts[1] : "overview";
  if (!key && app.single) key = app.jobs[0].key;
  if (key !== app.key) openJob(key);
  app.tab = tab;
  render();
}

function openJob(key) {
  if (app.stream) app.stream.close();
  Object.assign(app, {key, data: {}, series: {}, events: [], eventsMax: 0, stream: null});
  if (!key) return;
  const every = localStorage.getItem("convoy-refresh") || "0.25";
  const stream = new EventSource(`/ui/stream?job=${encodeURIComponent(key)}&every=${every}`);
  app.stream = stream;
  stream.addEventListener("hello", (message) => loadAll(JSON.parse(message.data)));
  stream.addEventListener("update", (message) => applyUpdate(JSON.parse(message.data)));
  stream.onopen = () => setLive(true);
  stream.onerror = () => setLive(false);
}

function setLive(on) {
  const live = document.getElementById("live");
  live.className = on ? "live on" : "live off";
  live.textContent = on ? "live" : "reconnecting";
}

async function loadAll(hello) {
  const base = `/ui/api/jobs/${encodeURIComponent(app.key)}`;
  const [metrics] = await Promise.all([getJSON(`${base}/metrics?upto=${hello.cursor[1]}`), loadEvents(),
                                      refetchState(true)]);
  app.series = metrics.series;
  render();
  if (!app.ready) {
    app.ready = true;
    performance.mark("convoy-ready");
    document.body.dataset.ready = "1";
  }
}

async function loadEvents() {
  const query = new URLSearchParams({limit: "500", kind: app.filter.kind, q: app.filter.q});
  const reply = await getJSON(`/ui/api/jobs/${encodeURIComponent(app.key)}/events?${query}`);
  app.events = reply.events;
  app.data.kinds = reply.kinds;
  app.data.eventsTotal = reply.total;
  app.eventsMax = Math.max(app.eventsMax, ...reply.events.map((e) => e.id), 0);
}

function matches(event) {
  return (!app.filter.kind || event.kind === app.filter.kind) &&
    (!app.filter.q || event.message.toLowerCase().includes(app.filter.q.toLowerCase()));
}

function applyUpdate(news) {
  if (app.data.overview) Object.assign(app.data.overview, {status: news.status, round_id: news.round_id});
  for (const [task, columns] of Object.entries(news.series || {})) {
    const have = app.series[task];
    if (!have) { app.series[task] = columns; continue; }
    for (const [name, values] of Object.entries(columns)) have[name].push(...values);
  }
  const fresh = (news.events || []).filter((e) => e.id > app.eventsMax);
  if (fresh.length) {
    app.eventsMax = Math.max(...fresh.map((e) => e.id));
    app.data.kinds = [...new Set([...(app.data.kinds || []), ...fresh.map((e) => e.kind)])].sort();
    app.events.push(...fresh.filter(matches));
    app.events = app.events.slice(-2000);
    app.data.eventsTotal = (app.data.eventsTotal || 0) + fresh.length;
  }
  if ((news.events || []).length) refetchState();  // even events the first load saw: its other pages may predate them
  render([news.series ? "series" : "", fresh.length ? "events" : ""]);
  if (window.convoyArrivals) {  // benchmarks/dashboard.py: when each reported point was drawn
    const drawn = Date.now() / 1000;
    for (const columns of Object.values(news.series || {})) for (const ts of columns.ts) convoyArrivals.push(drawn - ts);
  }
}

async function refetchState(quiet) {
  const base = `/ui/api/jobs/${encodeURIComponent(app.key)}`;
  const asked = app.stateAsked = (app.stateAsked || 0) + 1;
  let overview, nodes, rounds, config;
  try {
    [overview, nodes, rounds, config] = await Promise.all([getJSON(`${base}/overview`), getJSON(`${base}/nodes?offset=${app.nodesOffset || 0}`),
      getJSON(`${base}/rounds`), getJSON(`${base}/config`)]);
  } catch (error) {  // the master went away (its job ended): the page keeps what it showed last
    if (quiet) throw error;
    return setLive(false);
  }
  if (asked < (app.stateShown || 0)) return;  // an older answer that arrived late
  app.stateShown = asked;
  Object.assign(app.data, {overview, nodes, rounds, config});
  if (!quiet) render(["overview", "nodes", "rounds", "config"]);
}

async function act(path, body) {
  const box = document.getElementById("action-result");
  const reply = await fetch(`/ui/api/jobs/${encodeURIComponent(app.key)}/${path}`, {
    method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json", "X-Convoy-CSRF": app.csrf}, body: JSON.stringify(body || {})});
  const answer = await reply.json();
  if (box) {
    box.className = reply.ok ? "result" : "result error";
    box.textContent = reply.ok ? `${path}: done` : `${path} refused (${reply.status}): ${answer.error}`;
  }
  if (answer.overview) {
    app.data.overview = answer.overview;
    render(["overview"]);
  }
  refetchState();
}

const NEEDS = {overview: ["overview"], nodes: ["nodes"], events: ["events"], metrics: ["series"],
               config: ["config", "overview"], rounds: ["rounds"]};

function render(changed) {
  const overview = app.data.overview;
  document.getElementById("job-title").textContent = app.key ? `job ${app.key}` : "jobs";
  const status = document.getElementById("job-status");
  status.textContent = overview ? overview.status : "";
  status.dataset.status = overview ? overview.status : "";
  document.getElementById("job-round").textContent = overview ? overview.round_id : "-";
  const tabs = document.getElementById("tabs");
  tabs.replaceChildren(...(app.key ? TABS.map((tab) => h("a", {href: `#/${app.key}/${tab}`, id: `tab-${tab}`,
    class: tab === app.tab ? "active" : null}, tab)) : []));
  const main = document.getElementById("main");
  if (!app.key) return main.replaceChildren(renderIndex());
  if (!overview) return;
  const shown = document.getElementById(`page-${app.tab}`);
  if (shown && changed && !NEEDS[app.tab].some((name) => changed.includes(name))) return;
  if (shown && app.tab === "events") return updateEventRows();  // the filters keep their state and focus
  const page = {overview: renderOverview, nodes: renderNodes, events: renderEvents, metrics: renderMetrics,
                config: renderConfig, rounds: renderRounds}[app.tab];
  const result = document.getElementById("action-result") || h("div", {id: "action-result"});
  main.replaceChildren(h("div", {id: `page-${app.tab}`}, page()), result);
}

function renderIndex() {
  return h("div", {id: "page-index"}, h("h2", {}, "jobs"), table(
    ["job", "status", "round", "restarts", "nodes", "run time", "run dir"],
    app.jobs.map((job) => job.problem ? [job.key, h("span", {class: "problem"}, job.problem), "", "", "", "",
                                         job.run_dir] :
      [h("a", {href: `#/${job.key}/overview`}, job.overview.job_id), job.overview.status, job.overview.round_id,
       job.overview.restart_count, job.overview.nodes, seconds(job.overview.run_time_s), job.run_dir])));
}

function renderOverview() {
  const o = app.data.overview;
  const running = o.status === "running";
  const abort = h("button", {id: "abort", class: "danger", disabled: !running, on: {click: () => {
    if (confirm(`Abort job ${o.job_id}? Its workers are stopped and the job ends as failed.`)) {
      act("abort", {reason: "abort button"});
    }
  }}}, "abort job");
  const runTime = o.ended_at ? o.run_time_s : Date.now() / 1000 - o.created_at;
  return [pairs([
    ["status", o.status], ["outcome", o.outcome || "-"], ["round", o.round_id],
    ["restarts", `${o.restart_count} of ${o.max_restarts}`], ["regroups", o.regroup_count],
    ["nodes in round", `${o.nodes} (min ${o.min_nodes}, max ${o.max_nodes}); alive ${o.nodes_alive}`],
    ["world size", o.world_size], ["roles", o.roles.map((r) => `${r.name} x ${r.count}`).join(", ")],
    ["started", clock(o.created_at)], ["run time", seconds(runTime)], ["master", o.master_url]]),
    roleTable(o.roles), abort];
}

function roleTable(roles) {
  const counted = roles.filter((r) => r.wanted !== undefined);
  if (!counted.length) return null;
  return table(["role", "count", "wanted", "running", "pending", "group round", "on failure", "restarts",
                "replaced", "preempted"],
    counted.map((r) => [r.name + (r.service ? " (service)" : ""), r.count, r.wanted, r.running, r.pending,
                        r.group_round || "-", r.failure_policy, r.restarts, r.replacements, r.preempted]));
}

function nodesPage(offset) {
  app.nodesOffset = Math.max(0, offset);
  refetchState();
}

function renderNodes() {
  const n = app.data.nodes;
  const last = Math.min(n.total, n.offset + n.nodes.length);
  const pager = h("p", {id: "nodes-pager"}, `round ${n.round_id}; nodes ${n.total ? n.offset + 1 : 0}-${last} of ${n.total} `,
    h("button", {id: "nodes-previous", disabled: n.offset === 0, on: {click: () => nodesPage(n.offset - n.limit)}},
      "previous"),
    h("button", {id: "nodes-next", disabled: last >= n.total, on: {click: () => nodesPage(n.offset + n.limit)}}, "next"));
  return [pager, table(["node", "host", "state", "node rank", "last heartbeat", "workers"],
    n.nodes.map((node) => [node.node_id, node.host, node.state, node.node_rank,
      `${clock(node.last_heartbeat)} (${seconds(n.now - node.last_heartbeat)} ago)`,
      node.workers.length ? table(["rank", "step", "memory", "log tail"], node.workers.map((w) =>
        [w.rank, w.step, bytes(w.memory_bytes), h("pre", {class: "log"}, w.log_tail.join("\n"))])) : "-"]))];
}

function eventRows() {
  return table(["id", "time", "kind", "node", "round", "message"],
               app.events.slice().reverse().map((e) => [e.id, clock(e.ts), e.kind, e.node_id, e.round_id, e.message]));
}

function updateEventRows() {
  const box = document.getElementById("event-rows");
  if (box) box.replaceChildren(eventRows());
  const select = document.getElementById("event-kind");
  if (select) {
    const have = new Set([...select.options].map((option) => option.value));
    for (const kind of app.data.kinds || []) if (!have.has(kind)) select.appendChild(h("option", {value: kind}, kind));
  }
  const count = document.getElementById("event-count");
  if (count) count.textContent = `${app.events.length} shown of ${app.data.eventsTotal || 0}`;
}

function renderEvents() {
  const kinds = h("select", {id: "event-kind", on: {change: (e) => { app.filter.kind = e.target.value; refilter(); }}},
    h("option", {value: ""}, "all kinds"), (app.data.kinds || []).map((kind) =>
      h("option", {value: kind, selected: kind === app.filter.kind}, kind)));
  const text = h("input", {id: "event-text", type: "search", placeholder: "message contains", value: app.filter.q,
                           on: {change: (e) => { app.filter.q = e.target.value; refilter(); }}});
  return [h("div", {class: "filters"}, kinds, text,
            h("span", {id: "event-count"}, `${app.events.length} shown of ${app.data.eventsTotal || 0}`)),
          h("div", {id: "event-rows"}, eventRows())];
}

async function refilter() {
  await loadEvents();
  updateEventRows();
}

function renderMetrics() {
  const tasks = Object.keys(app.series).sort();
  const box = h("div", {class: "charts"});
  for (const [field, title, unit] of CHARTS) {
    const holder = h("div", {id: `chart-${field}`});
    box.appendChild(holder);
    ConvoyChart.line(holder, {title, xLabel: "step", yLabel: unit, series: tasks.map((task, index) => (
      {name: task, x: app.series[task].step, y: app.series[task][field], styleIndex: index}))});
  }
  const latest = tasks.map((task) => {
    const s = app.series[task], last = s.step.length - 1;
    return [task, s.step[last], number(s.loss[last]), number(s.samples_per_s[last]), number(s.step_time_s[last])];
  });
  return [box, table(["rank", "step", "loss", "samples/s", "step time (s)"], latest)];
}

function renderConfig() {
  const c = app.data.config;
  const current = c.versions[c.versions.length - 1];
  const proposals = c.proposals.map((p) => [p.id, p.rule, p.step, p.evidence, JSON.stringify(p.values), p.status,
    p.status === "open" ? h("span", {}, h("button", {class: "apply", "data-proposal": p.id,
      on: {click: () => act(`proposals/${p.id}/apply`)}}, "apply"),
      h("button", {on: {click: () => act(`proposals/${p.id}/dismiss`)}}, "dismiss")) : "-"]);
  const roles = (app.data.overview.roles || []).filter((r) => r.wanted !== undefined && r.minimum !== r.maximum);
  const scale = roles.length ? h("div", {class: "filters"}, h("b", {}, "scale a role"),
    h("select", {id: "scale-role"}, roles.map((r) => h("option", {value: r.name}, r.name))),
    h("input", {id: "scale-count", type: "number", min: 0, value: roles[0].wanted}),
    h("button", {id: "scale", on: {click: () => act("scale", {role: document.getElementById("scale-role").value,
      count: Number(document.getElementById("scale-count").value)})}}, "scale")) : null;
  return [h("h3", {}, `current version ${current ? current.number : "-"}`),
    current ? table(["field", "value"], Object.entries(current.values).map(([k, v]) => [k, JSON.stringify(v)])) :
      h("p", {}, "the script has not declared a training config"),
    h("h3", {}, "versions"), table(["version", "kind", "apply", "from step", "changed", "by", "reason", "at"],
      c.versions.slice().reverse().map((v) => [v.number, v.kind, v.apply, v.at_step, JSON.stringify(v.changed),
                                               v.author, v.reason, clock(v.created_at)])),
    h("h3", {}, "proposals"), proposals.length ?
      table(["id", "rule", "step", "evidence", "values", "status", ""], proposals) : h("p", {}, "none"), scale];
}

function renderRounds() {
  const r = app.data.rounds;
  const holder = h("div", {id: "timeline"});
  ConvoyChart.timeline(holder, r.rounds.map((round) => ({label: `round ${round.round_id}`, start: round.started_at,
    end: round.ended_at, note: round.why_ended || (round.ended_at ? "" : "running")})), r.now);
  return [holder, table(["round", "started", "ended", "world size", "nodes", "why it ended"],
    r.rounds.slice().reverse().map((round) => [round.round_id, clock(round.started_at), clock(round.ended_at),
                                               round.world_size, round.nodes.join(", "), round.why_ended || "-"]))];
}

async function start() {
  const refresh = document.getElementById("refresh");
  refresh.value = localStorage.getItem("convoy-refresh") || "0.25";
  refresh.addEventListener("change", () => {
    localStorage.setItem("convoy-refresh", refresh.value);
    const key = app.key;
    app.key = "";
    openJob(key);
  });
  const session = await getJSON("/ui/api/session");
  Object.assign(app, {csrf: session.csrf, jobs: session.jobs, single: session.single});
  document.getElementById("who").textContent = `signed in as ${session.who}`;
  window.addEventListener("hashchange", route);
  route();
  setInterval(async () => {  // the index of several jobs: their status, every few seconds
    if (app.key) return;
    app.jobs = (await getJSON("/ui/api/jobs")).jobs;
    render();
  }, 3000);
}

start().catch((error) => {
  document.getElementById("main").replaceChildren(h("p", {class: "problem"}, String(error)));
});
