// Stovepipe dashboard: polls the worker's JSON API every 2 s and redraws.
// Plain DOM, no framework; every value is set as text, never parsed as HTML.
"use strict";

const REFRESH_MS = 2000;
const RECENT = 10;
const TOKEN_KEY = "stovepipe.apiToken"; // sessionStorage: the API token, for this tab only
// a Request in one of these states left its commit unvalidated: it may be validated again
const RETRYABLE = ["failed", "cancelled", "superseded"];

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
  return /^\d+(\.\d+)?$/.test(n) ? "#" + n : requestId;
}

function plural(count, word) {
  return count + " " + word + (count === 1 ? "" : "s");
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

// Failed without a verdict: it could not be validated, which is not red.
function unvalidated(request) {
  return request.state === "failed" && !request.verdict;
}

// "could not be validated: <why>" (the pipeline's own reasons begin so already).
function whyUnvalidated(reason) {
  if (reason && reason.startsWith("could not be validated")) return reason;
  return "could not be validated: " + (reason || "no reason recorded");
}

// A Request's state, saying which kind of failure (the text, not only the colour).
function requestBadge(request) {
  if (unvalidated(request)) {
    return el("span", { class: "pill state-unvalidated", title: whyUnvalidated(request.reason) },
      "could not validate");
  }
  if (request.state === "cancelled" && request.reason) {
    return el("span", { class: "pill state-cancelled", title: request.reason }, "cancelled");
  }
  return stateBadge(request.state);
}

// Why a settled Request ended as it did, in words.
function outcomeText(request) {
  if (unvalidated(request)) return whyUnvalidated(request.reason);
  if (request.state === "failed") return "red verdict" + (request.reason ? ": " + request.reason : "");
  if (request.state === "succeeded") return "green verdict";
  return request.reason || "";
}

function attemptsNote(request) {
  return request.attempt > 1 ? el("span", { class: "muted attempts" }, " " + plural(request.attempt, "attempt")) : null;
}

function factBadge(fact) {
  if (!fact) return el("span", { class: "pill fact-none", title: "no fact: not green" }, "no fact");
  const green = fact.degree === 0;
  const attempts = fact.attempts > 1 ? ", after " + plural(fact.attempts, "attempt") : "";
  return el("span", {
    class: "pill " + (green ? "fact-green" : "fact-red"),
    title: "degree " + fact.degree + ", recorded by " + fact.request_id + attempts
      + (fact.flaky ? "; green on a re-run of a red build" : ""),
  }, green ? (fact.flaky ? "green (flaky)" : "green") : "red");
}

function requestCell(request) {
  return [el("a", { href: requestLink(request.id) }, seqOf(request.id)),
    request.kind === "retry" ? el("span", { class: "tag", title: "validates its commit again" }, "again") : null];
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
        ? [el("span", { class: "mono" }, latest.id), " ", requestBadge(latest),
          unvalidated(latest) ? el("div", { class: "muted" }, outcomeText(latest)) : null]
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
      el("td", { class: "num", title: r.request.id }, requestCell(r.request)),
      el("td", {}, requestBadge(r.request), attemptsNote(r.request)),
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
  const view = document.getElementById("request-view");
  if (!requestId) {
    box.hidden = true;
    view.replaceChildren();
    renderActions(null, null);
    return;
  }
  const close = el("a", { href: "#", class: "muted" }, "all queues");
  const heading = el("div", { class: "queue-head" }, el("h3", {}, requestId), close);
  box.hidden = false;
  if (!result || !result.ok) {
    const why = result && result.body && result.body.error ? result.body.error
      : "HTTP " + (result ? result.status : "?");
    view.replaceChildren(heading, el("p", { class: "empty banner" }, "Request unavailable: " + why));
    renderActions(requestId, null);
    return;
  }
  const body = result.body;
  const r = body.request;
  const answer = body.commit_fact;
  const own = body.fact;
  const newest = body.newest_for_commit;
  const outcome = outcomeText(r);
  const detail = el("dl", { class: "facts" },
    el("div", {}, el("dt", {}, "State"), el("dd", {}, requestBadge(r), " ",
      el("span", { class: "muted", title: r.updated_at }, ago(r.updated_at)),
      outcome ? el("div", { class: "outcome" }, outcome) : null)),
    el("div", {}, el("dt", {}, "Commit"), el("dd", { class: "mono" }, r.uri)),
    el("div", {}, el("dt", {}, "Kind"), el("dd", {},
      r.kind === "retry" ? "retry: validates the commit again" : "head of the branch")),
    el("div", {}, el("dt", {}, "Attempts"), el("dd", {},
      r.attempt > 0 ? plural(r.attempt, "attempt") : el("span", { class: "muted" }, "not admitted yet"))),
    el("div", {}, el("dt", {}, "Fact"), el("dd", {}, factBadge(own))),
    answer && (!own || answer.request_id !== own.request_id)
      ? el("div", {}, el("dt", {}, "Commit's answer"), el("dd", {}, factBadge(answer), " by ",
        el("a", { href: requestLink(answer.request_id) }, answer.request_id)))
      : null,
    newest && newest.id !== r.id
      ? el("div", {}, el("dt", {}, "Newest Request of the commit"), el("dd", {},
        el("a", { href: requestLink(newest.id) }, newest.id), " ", requestBadge(newest)))
      : null,
    el("div", {}, el("dt", {}, "Build"), el("dd", {}, r.build_strategy
      ? [r.build_strategy, r.base_uri ? el("span", { class: "mono muted" }, " from " + r.base_uri) : null]
      : el("span", { class: "muted" }, "—"))));
  const builds = body.builds.length === 0
    ? el("p", { class: "empty muted" }, "No build yet.")
    : el("table", {},
      el("thead", {}, el("tr", {}, ["Attempt", "Build", "Status", "Verdict", "Updated"].map((h) => el("th", {}, h)))),
      el("tbody", {}, body.builds.map((b) => el("tr", { "data-build": b.id },
        el("td", { class: "num" }, b.attempt),
        el("td", { class: "mono" }, b.id),
        el("td", {}, stateBadge(b.status)),
        el("td", {}, buildVerdict(b)),
        el("td", { class: "num muted", title: b.updated_at }, ago(b.updated_at))))));
  view.replaceChildren(heading, detail, builds);
  renderActions(requestId, body);
}

function buildVerdict(build) {
  if (build.verdict) {
    return [el("span", { class: "pill fact-" + build.verdict }, build.verdict),
      build.reason ? el("span", { class: "muted" }, " " + build.reason) : null];
  }
  if (build.status === "failed") return "could not validate: " + (build.reason || "no reason recorded");
  return build.reason || el("span", { class: "muted" }, "—");
}

// "Validate again": the elements live in index.html and outlast the redraws, so a token
// being typed or an answer being read is not wiped every 2 s.
const retry = { requestId: null, queue: null, uri: null, busy: false };

function renderActions(requestId, body) {
  const panel = document.getElementById("request-actions");
  const result = document.getElementById("retry-result");
  if (requestId !== retry.requestId) {  // another Request: forget the last answer
    retry.requestId = requestId;
    result.replaceChildren();
  }
  if (!body) {
    panel.hidden = true;
    return;
  }
  const newest = body.newest_for_commit || body.request;
  retry.queue = body.request.queue;
  retry.uri = body.request.uri;
  const eligible = !body.green && RETRYABLE.includes(newest.state);
  document.getElementById("retry-button").hidden = !eligible;
  panel.hidden = !eligible && !result.hasChildNodes();
  if (!eligible) document.getElementById("token-field").hidden = true;
}

function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch (_) {
    return "";
  }
}

function showRetryResult(...children) {
  document.getElementById("retry-result").replaceChildren(...children);
  document.getElementById("request-actions").hidden = false;
}

async function validateAgain() {
  if (retry.busy || !retry.queue) return;
  const button = document.getElementById("retry-button");
  const input = document.getElementById("api-token");
  const token = input.value.trim() || storedToken();
  const headers = { "Content-Type": "application/json", Accept: "application/json" };
  if (token) headers.Authorization = "Bearer " + token;
  retry.busy = true;
  button.disabled = true;
  showRetryResult(el("span", { class: "muted" }, "asking…"));
  try {
    const response = await fetch("/api/queues/" + encodeURIComponent(retry.queue) + "/retry", {
      method: "POST", cache: "no-store", headers, body: JSON.stringify({ commit: retry.uri }),
    });
    let answer = null;
    try {
      answer = await response.json();
    } catch (_) {
      answer = null;
    }
    if (response.ok && answer && answer.request_id) {
      showRetryResult(answer.new ? "Validating again: " : "Already being validated: ",
        el("a", { href: requestLink(answer.request_id), class: "mono", "data-retried": answer.request_id },
          answer.request_id));
    } else if (response.status === 401) {
      document.getElementById("token-field").hidden = false;
      input.focus();
      showRetryResult(el("span", { class: "error" },
        (token ? "The worker refused this API token" : "The worker needs its API token")
        + ": enter it and press Validate again."));
    } else {
      const why = answer && answer.error ? answer.error : "HTTP " + response.status;
      showRetryResult(el("span", { class: "error" }, "Not validated again: " + why));
    }
  } catch (error) {
    showRetryResult(el("span", { class: "error" }, "Cannot reach the worker: " + error));
  } finally {
    retry.busy = false;
    button.disabled = false;
  }
  refresh();
}

function setUpActions() {
  const input = document.getElementById("api-token");
  input.value = storedToken();
  document.getElementById("token-field").hidden = !input.value;
  input.addEventListener("input", () => {
    try {
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    } catch (_) {
      // storage refused (a private window): the token still works for this page
    }
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") validateAgain();
  });
  document.getElementById("retry-button").addEventListener("click", validateAgain);
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
setUpActions();
window.addEventListener("hashchange", () => refresh());
refresh();
