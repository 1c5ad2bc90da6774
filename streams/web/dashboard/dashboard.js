// Stovepipe dashboard: polls the worker's JSON API every 2 s and redraws.
// Plain DOM, no framework; every value is set as text, never parsed as HTML.
"use strict";

const REFRESH_MS = 2000;
const RECENT = 10;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store", headers: { Accept: "application/json" } });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  return { ok: response.ok, status: response.status, body };
}

function seqOf(requestId) {
  const n = String(requestId || "").split("/").pop();
  return /^\d+$/.test(n) ? "#" + n : requestId;
}

function ago(iso) {
  if (!iso) return "";
  const seconds = Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000));
  if (seconds < 60) return seconds + "s ago";
  if (seconds < 3600) return Math.floor(seconds / 60) + "m ago";
  if (seconds < 86400) return Math.floor(seconds / 3600) + "h ago";
  return Math.floor(seconds / 86400) + "d ago";
}

function stateBadge(state) {
  return el("span", { class: "pill state-" + state }, state);
}

function factBadge(fact) {
  if (!fact) return el("span", { class: "pill fact-none", title: "no fact: not green" }, "no fact");
  const green = fact.degree === 0;
  return el("span", {
    class: "pill " + (green ? "fact-green" : "fact-red"),
    title: "degree " + fact.degree + ", recorded by " + fact.request_id,
  }, green ? "green" : "red");
}

function renderDlq(result) {
  const box = document.getElementById("dlq");
  const report = result && result.body;
  if (!report || report.error || !Array.isArray(report.topics)) {
    const why = report && report.error ? report.error : "no answer (HTTP " + (result ? result.status : "?") + ")";
    box.replaceChildren(el("span", { class: "chip bad" }, "depth unknown: " + why));
    return;
  }
  const chips = report.topics.map((t) =>
    el("span", { class: "chip" + (t.depth > 0 ? " bad" : ""), title: t.topic },
      t.stage + "_dlq ", el("b", {}, t.depth)));
  box.replaceChildren(
    el("span", { class: "chip" + (report.total > 0 ? " bad" : "") }, "total ", el("b", {}, report.total)),
    ...chips,
    el("span", { class: "muted" }, "not yet reconciled by group " + report.group));
}

function renderQueue(queue, recent) {
  const slotsBusy = queue.in_flight > 0;
  const head = el("div", { class: "queue-head" },
    el("h3", {}, queue.name),
    el("span", { class: "slots" + (slotsBusy ? " busy" : "") },
      "in flight " + queue.in_flight + " / " + queue.max_concurrent));

  const promo = queue.promotion_ref;
  let promotion = el("span", { class: "muted" }, "none configured");
  if (promo) {
    promotion = el("span", {},
      el("span", { class: "mono" }, promo.name), " → ",
      promo.target
        ? el("span", { class: "mono" }, promo.target)
        : el("span", { class: "muted" },
          promo.target_known ? "not moved yet" : "unknown (the repository did not answer)"));
  }
  const latest = queue.latest_request;
  const facts = el("dl", { class: "facts" },
    el("div", {},
      el("dt", {}, "Last green (bookmark)"),
      el("dd", {}, queue.last_green_uri
        ? [el("span", { class: "mono" }, queue.last_green_uri), " ",
          el("span", { class: "muted" }, seqOf(queue.last_green_request_id))]
        : el("span", { class: "muted" }, "no green commit yet"))),
    el("div", {}, el("dt", {}, "Promotion ref"), el("dd", {}, promotion)),
    el("div", {},
      el("dt", {}, "Latest request"),
      el("dd", {}, latest
        ? [el("span", { class: "mono" }, latest.id), " ", stateBadge(latest.state)]
        : el("span", { class: "muted" }, "none"))));

  let body;
  if (!recent.ok) {
    body = el("p", { class: "empty banner" },
      "Requests unavailable: " + ((recent.body && recent.body.error) || "HTTP " + recent.status));
  } else if (recent.body.requests.length === 0) {
    body = el("p", { class: "empty muted" },
      "No Requests yet. Ingest with `stovepipe ingest " + queue.name + "` or POST /api/queues/" + queue.name + "/ingest.");
  } else {
    const rows = recent.body.requests.map((r) => el("tr", { "data-request": r.request.id },
      el("td", { class: "num", title: r.request.id },
        el("a", { href: requestLink(r.request.id) }, seqOf(r.request.id))),
      el("td", {}, stateBadge(r.request.state)),
      el("td", { class: "mono" }, r.request.uri),
      el("td", {}, factBadge(r.fact)),
      el("td", {}, r.request.build_strategy || el("span", { class: "muted" }, "—")),
      el("td", { class: "num muted", title: r.request.updated_at }, ago(r.request.updated_at))));
    body = el("table", {},
      el("thead", {}, el("tr", {},
        ["Request", "State", "Commit", "Fact", "Build", "Updated"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows));
  }
  return el("section", { class: "queue", "data-queue": queue.name }, head, facts, body);
}

// One Request in detail at /#request=<id> (the link commit statuses and alerts carry).
function requestLink(requestId) {
  return "#request=" + encodeURIComponent(requestId);
}

function wantedRequest() {
  const match = /^#request=(.+)$/.exec(window.location.hash);
  if (!match) return null;
  try {
    return decodeURIComponent(match[1]);
  } catch (_) {
    return match[1];
  }
}

function renderRequest(requestId, result) {
  const box = document.getElementById("request");
  if (!requestId) {
    box.hidden = true;
    box.replaceChildren();
    return;
  }
  const close = el("a", { href: "#", class: "muted" }, "all queues");
  const heading = el("div", { class: "queue-head" }, el("h3", {}, requestId), close);
  box.hidden = false;
  if (!result || !result.ok) {
    const why = result && result.body && result.body.error ? result.body.error
      : "HTTP " + (result ? result.status : "?");
    box.replaceChildren(heading, el("p", { class: "empty banner" }, "Request unavailable: " + why));
    return;
  }
  const r = result.body.request;
  const detail = el("dl", { class: "facts" },
    el("div", {}, el("dt", {}, "State"), el("dd", {}, stateBadge(r.state), " ",
      el("span", { class: "muted", title: r.updated_at }, ago(r.updated_at)))),
    el("div", {}, el("dt", {}, "Commit"), el("dd", { class: "mono" }, r.uri)),
    el("div", {}, el("dt", {}, "Fact"), el("dd", {}, factBadge(result.body.fact))),
    el("div", {}, el("dt", {}, "Build"), el("dd", {}, r.build_strategy
      ? [r.build_strategy, r.base_uri ? el("span", { class: "mono muted" }, " from " + r.base_uri) : null]
      : el("span", { class: "muted" }, "—"))));
  const builds = result.body.builds.length === 0
    ? el("p", { class: "empty muted" }, "No build yet.")
    : el("table", {},
      el("thead", {}, el("tr", {}, ["Build", "Status", "Updated"].map((h) => el("th", {}, h)))),
      el("tbody", {}, result.body.builds.map((b) => el("tr", { "data-build": b.id },
        el("td", { class: "mono" }, b.id),
        el("td", {}, stateBadge(b.status)),
        el("td", { class: "num muted", title: b.updated_at }, ago(b.updated_at))))));
  box.replaceChildren(heading, detail, builds);
}

function showProblem(message) {
  const banner = document.getElementById("problem");
  banner.textContent = message || "";
  banner.hidden = !message;
}

function renderHealth(result) {
  const pill = document.getElementById("health");
  const body = result && result.body;
  const ok = result && result.ok && body && body.status === "ok";
  pill.className = "pill " + (ok ? "pill-ok" : "pill-bad");
  pill.textContent = ok ? "worker healthy" : "worker unhealthy";
  pill.title = body ? "runtime " + body.runtime + ", database " + body.database : "";
}

async function refresh() {
  try {
    const requestId = wantedRequest();
    const [queues, dlq, health, request] = await Promise.all(
      [getJson("/api/queues"), getJson("/api/dlq"), getJson("/health"),
        requestId ? getJson("/api/requests/" + encodeURIComponent(requestId)) : null]);
    renderHealth(health);
    renderDlq(dlq);
    renderRequest(requestId, request);
    if (!queues.ok) {
      showProblem("Queues unavailable: " + ((queues.body && queues.body.error) || "HTTP " + queues.status));
    } else {
      const list = queues.body.queues;
      const recents = await Promise.all(list.map((q) =>
        getJson("/api/queues/" + encodeURIComponent(q.name) + "/requests?limit=" + RECENT)));
      const cards = list.map((q, i) => renderQueue(q, recents[i]));
      document.getElementById("queues").replaceChildren(
        ...(cards.length ? cards : [el("p", { class: "muted" }, "No queues configured.")]));
      showProblem("");
    }
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    showProblem("Cannot reach the worker: " + error);
    renderHealth(null);
  } finally {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refresh, REFRESH_MS);
  }
}

let refreshTimer = null;
window.addEventListener("hashchange", () => refresh());
refresh();
