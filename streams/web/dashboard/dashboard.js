// Stovepipe dashboard: polls the worker's JSON API every 2 s and redraws.
// Plain DOM, no framework; every value is set as text, never parsed as HTML.
"use strict";

const REFRESH_MS = 2000;
const RECENT = 10;
const HISTORY = 30; // cells in a queue's history strip
const GRID_ROWS = 15; // heads in a queue's grid of projects
const SVG_NS = "http://www.w3.org/2000/svg";
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
  for (const child of children.flat(Infinity)) {
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

function renderQueue(queue, recent, extra) {
  const slotsBusy = queue.in_flight > 0;
  const history = extra.history && extra.history.ok ? extra.history.body : null;
  const head = el("div", { class: "queue-head" },
    el("div", { class: "queue-title" }, el("h3", {}, queue.name), greennessBadge(history)),
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
          promo.target_known ? "not moved yet" : "unknown (the repository did not answer)"),
      promo.pinned ? el("div", { class: "pinned", "data-pinned": promo.pinned.uri },
        el("span", { class: "pill state-cancelled" }, "pinned"), " at ",
        el("span", { class: "mono" }, promo.pinned.uri),
        promo.pinned.by ? " by " + promo.pinned.by : "",
        promo.pinned.at ? el("span", { class: "muted", title: promo.pinned.at }, " " + ago(promo.pinned.at)) : null,
        promo.pinned.reason ? ": " + promo.pinned.reason : "") : null);
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
  return el("section", { class: "queue", "data-queue": queue.name }, head,
    renderCulprit(queue, history, extra.grid), facts,
    renderProjects(queue.name, extra.grid),
    renderHistory(queue.name, extra.history),
    el("div", { class: "panels" },
      renderStory(extra.explain),
      renderSignal(history, extra.health && extra.health.ok ? extra.health.body : queue.health)),
    el("details", { class: "requests", open: true },
      el("summary", {}, "Recent Requests"), body));
}

// --- a queue's projects: each project's answer at each head (GET …/grid) ---------------

function gridWord(cell) {
  const word = (GRID_STATES[cell.state] || { word: cell.state }).word;
  if (cell.inherited) return "unaffected: inherits " + word + " from " + shortSha(cell.source_sha);
  return word + (cell.flaky ? " (flaky)" : "");
}

function renderProjects(queueName, result) {
  if (!result) return null; // the worker has no grid endpoint
  if (!result.ok) {
    return el("div", { class: "projects" }, el("p", { class: "empty banner" }, "Projects unavailable: "
      + ((result.body && result.body.error) || "HTTP " + result.status)));
  }
  const grid = result.body;
  if (!grid || !(grid.projects || []).length) return null; // a queue without projects
  const columns = grid.projects.map((p) => p.project);
  const table = el("table", { class: "project-grid", "data-grid-of": queueName },
    el("thead", {}, el("tr", {},
      el("th", { scope: "col" }, "Head"), el("th", { scope: "col" }, "Whole repository"),
      grid.projects.map((p) => el("th", { scope: "col", "data-column": p.project }, p.project,
        p.blocking ? null : el("span", { class: "tag", title: "bring-up: never part of the whole repository's answer" }, "bring-up"))))),
    el("tbody", {}, grid.rows.map((row) => el("tr", { "data-grid-row": row.request_id },
      el("th", { scope: "row", class: "grid-head" },
        el("a", { href: requestLink(row.request_id) }, seqOf(row.request_id)), " ",
        commitLine(row.sha, row.subject, row.author),
        row.everything ? el("div", { class: "muted", title: "every project was built" }, "all built: " + row.everything) : null),
      el("td", { "data-whole": row.outcome }, outcomeBadge(row.outcome)),
      columns.map((project) => gridCell(row, project, row.cells[project]))))));
  return el("div", { class: "projects", "data-projects-of": queueName },
    el("div", { class: "history-head" }, el("h4", {}, "Projects"),
      el("span", { class: "muted" }, "each project's answer at each head, newest first"), gridLegend()),
    el("ul", { class: "project-cards" }, grid.projects.map(projectCard)),
    el("div", { class: "grid-scroll" }, table));
}

function gridCell(row, project, cell) {
  if (!cell) return el("td", {});
  const known = GRID_STATES[cell.state] || { symbol: "", word: cell.state };
  const label = project + " at " + shortSha(row.sha) + ": " + gridWord(cell) + (cell.reason ? " (" + cell.reason + ")" : "");
  let more = null;
  if (cell.inherited) {
    more = el("div", { class: "cell-source" }, "inherited from ",
      el("a", { href: requestLink(cell.request_id), class: "mono", "data-source": cell.source_uri }, shortSha(cell.source_sha)));
  } else if (cell.build) {
    more = el("div", { class: "cell-source" }, buildLink(cell.build));
  } else if (cell.request_id) {
    more = el("div", { class: "cell-source" }, el("a", { href: requestLink(cell.request_id) }, "request"));
  }
  return el("td", {
    class: "grid-cell state-" + cell.state + (cell.inherited ? " inherited" : ""), title: label,
    "aria-label": label, "data-cell": project, "data-state": cell.state,
    "data-inherited": cell.inherited ? "true" : "false",
  },
  el("span", { class: "symbol", "aria-hidden": "true" }, known.symbol), " ",
  el("span", { class: "cell-word" }, cell.inherited ? known.word : gridWord(cell)), more);
}

function projectCard(p) {
  const bookmark = p.bookmark;
  const culprit = p.culprit;
  let red = null;
  if (culprit) {
    red = el("div", { class: "project-culprit", "data-culprit": culprit.uri },
      culprit.confirmed === false ? "a break, not confirmed as the head's: " : "red since ",
      commitLine(culprit.sha || culprit.uri, culprit.subject, culprit.author),
      culprit.confirmed === false ? el("span", { class: "muted" }, " — " + (culprit.unconfirmed_reason || "not confirmed"))
        : el("span", { class: "muted" }, " — the culprit"),
      culprit.build && culprit.build.url ? [" · ", buildLink(culprit.build)] : null);
  } else if (p.search) {
    red = el("div", { class: "project-culprit searching" }, p.search.words);
  } else if (p.greenness === "red") {
    red = el("div", { class: "project-culprit" }, "red; no culprit named");
  }
  return el("li", { class: "project-card", "data-project": p.project },
    el("div", { class: "project-name" }, el("b", { class: "mono" }, p.project), " ",
      p.greenness ? outcomeBadge(p.greenness, p.greenness === "red" && p.red_streak_s !== null
        ? "red for " + duration(p.red_streak_s) : p.greenness)
        : el("span", { class: "pill outcome-unbuilt" }, "no verdict yet"),
      p.blocking ? null : el("span", { class: "tag" }, "bring-up")),
    el("div", { class: "project-bookmark" }, el("span", { class: "muted" }, "last green "),
      bookmark ? [el("a", { href: requestLink(bookmark.request_id), class: "mono", "data-bookmark": bookmark.uri }, shortSha(bookmark.sha)),
        bookmark.inherited ? el("span", { class: "muted" }, " (inherits from " + shortSha(bookmark.source_sha) + ")") : null,
        p.heads_since_green ? el("span", { class: "muted" }, " · " + plural(p.heads_since_green, "head") + " since") : null]
        : el("span", { class: "muted" }, "none yet")),
    red);
}

function gridLegend() {
  const items = [["green", false], ["green", true], ["red", false], ["red", true],
    ["pending", false], ["unvalidated", false], ["cancelled", false], ["waiting", false],
    ["superseded", false], ["none", false]];
  return el("ul", { class: "legend", "aria-label": "Legend of the projects' grid" },
    items.map(([state, inherited]) => el("li", {},
      el("span", { class: "legend-swatch grid-cell state-" + state + (inherited ? " inherited" : ""), "aria-hidden": "true" },
        GRID_STATES[state].symbol),
      " " + GRID_STATES[state].word + (inherited ? ", inherited" : ""))));
}

// --- a queue's history: the strip, the culprit, the story, time to signal --------------

// What each cell's colour means, in words and a symbol (never colour alone).
const OUTCOMES = {
  green: { symbol: "✓", word: "green" },
  red: { symbol: "✗", word: "red" },
  unvalidated: { symbol: "?", word: "could not validate" },
  superseded: { symbol: "»", word: "superseded" },
  running: { symbol: "▶", word: "running" },
  waiting: { symbol: "…", word: "waiting" },
  cancelled: { symbol: "⊘", word: "cancelled" },
};
// What a cell of the projects' grid says, in words and a symbol (never colour alone); an
// inherited answer (the head does not affect the project) is drawn pale, dashed and says so.
const GRID_STATES = {
  green: OUTCOMES.green, red: OUTCOMES.red, pending: { symbol: OUTCOMES.running.symbol, word: "pending" },
  unvalidated: OUTCOMES.unvalidated, cancelled: OUTCOMES.cancelled, waiting: OUTCOMES.waiting,
  superseded: OUTCOMES.superseded, none: { symbol: "·", word: "not planned" },
};
// the story also tells the commits of a culprit search's range that were never built
const STORY_ONLY = { unbuilt: { symbol: "·", word: "never built" } };
const KINDS = {
  head: "head of the branch",
  retry: "validated again",
  backfill: "backfill: built to find the culprit",
};

// Per queue, the history cell a person picked (by request id); it outlives the redraws.
const picked = new Map();
// Optional endpoints this worker does not have (404 "no such endpoint"): not asked again.
const missingEndpoints = new Set();

function shortSha(sha) {
  const text = String(sha || "");
  return /^[0-9a-f]{40,64}$/.test(text) ? text.slice(0, 7) : text.slice(0, 12);
}

function authorName(author) {
  return String(author || "").replace(/\s*<[^>]*>\s*$/, "") || author || "";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(Number(seconds))) return "—";
  const exact = Math.max(0, Number(seconds));
  if (exact < 10) return (Math.round(exact * 10) / 10) + " s";
  const s = Math.round(exact);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + (s % 60 ? (s % 60) + " s" : "");
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function outcomeWord(entry) {
  const word = (OUTCOMES[entry.outcome] || { word: entry.outcome }).word;
  return entry.outcome === "green" && entry.flaky ? "green (flaky)" : word;
}

function outcomeBadge(outcome, text) {
  const known = OUTCOMES[outcome] || STORY_ONLY[outcome] || { symbol: "", word: outcome };
  return el("span", { class: "pill outcome outcome-" + outcome },
    el("span", { class: "symbol", "aria-hidden": "true" }, known.symbol), " ", text || known.word);
}

// The outcome of a Request as the story names it (state and verdict).
function outcomeOfState(state, verdict) {
  if (state === "succeeded") return "green";
  if (state === "failed") return verdict === "red" ? "red" : "unvalidated";
  if (state === "processing") return "running";
  if (state === "accepted") return "waiting";
  return state; // superseded, cancelled, unbuilt (a commit of the search's range)
}

function greennessBadge(history) {
  if (!history || !history.greenness) return null;
  return outcomeBadge(history.greenness, history.greenness === "red" ? "red" : "green");
}

// Optional endpoints: null when the worker does not have them (and never asked again).
async function optionalJson(kind, path) {
  if (missingEndpoints.has(kind)) return null;
  const result = await getJson(path);
  if (result.status === 404 && result.body && /^no such endpoint/.test(result.body.error || "")) {
    missingEndpoints.add(kind);
    return null;
  }
  return result;
}

function buildLink(build, label) {
  if (!build) return null;
  if (!build.url) return el("span", { class: "mono muted", title: "no page for this build" }, build.id);
  const external = /^https?:/i.test(build.url); // the provider's page; else this worker's log
  return el("a", {
    href: build.url, class: "build-link", "data-build-link": build.id,
    target: external ? "_blank" : null, rel: external ? "noopener noreferrer" : null,
    title: build.id,
  }, label || (external ? "build page ↗" : "build log"));
}

function commitLine(sha, subject, author) {
  return [el("span", { class: "mono sha" }, shortSha(sha)), " ",
    subject ? el("span", { class: "subject" }, subject) : el("span", { class: "muted" }, "(not described yet)"),
    author ? [" by ", el("span", { class: "author", title: author }, authorName(author))] : null];
}

// "Red since C": the queue's culprit and search (GET /api/queues), else the history's view
// of them; without either, the first red build since the last green one.
function renderCulprit(queue, history, grid) {
  const projects = grid && grid.ok && grid.body ? grid.body.projects || [] : [];
  if (projects.length) return projectsRed(history, projects);
  const search = queue.search || null;
  const found = history && history.culprit_search;
  const culprit = queue.culprit || (found && found.state === "found" ? {
    uri: found.culprit_uri, sha: found.sha, subject: found.subject, author: found.author,
    build: found.build, confirmed: found.confirmed !== false,
    unconfirmed_reason: found.unconfirmed_reason } : null);
  const red = (history && history.greenness === "red") || Boolean(queue.culprit || search);
  if (!red) return null;
  const builds = search ? search.builds : found ? found.builds : null;
  if (culprit && culprit.confirmed === false) {
    // a break the search found, not confirmed as the one the head is red for
    return el("div", { class: "culprit unconfirmed", "data-culprit": culprit.uri, "data-confirmed": "false" },
      outcomeBadge("red", "red"), " a break, not confirmed as the head's: ",
      commitLine(culprit.sha || culprit.uri, culprit.subject, culprit.author),
      el("span", { class: "muted" }, " — " + (culprit.unconfirmed_reason || "not confirmed")
        + (builds === null ? "" : " (" + plural(builds, "backfill build") + ")")),
      culprit.build && culprit.build.url ? [" · ", buildLink(culprit.build)] : null);
  }
  if (culprit) {
    return el("div", { class: "culprit", "data-culprit": culprit.uri, "data-confirmed": "true" },
      outcomeBadge("red", "red since"), " ", commitLine(culprit.sha || culprit.uri, culprit.subject, culprit.author),
      el("span", { class: "muted", title: culprit.found_at || null }, " — the culprit"
        + (culprit.found_at ? ", found " + ago(culprit.found_at) : "")
        + (builds === null ? "" : builds === 0 ? " (its first parent is the last green commit)"
          : " with " + plural(builds, "backfill build"))),
      culprit.build && culprit.build.url ? [" · ", buildLink(culprit.build)] : null);
  }
  if (search || (found && found.state === "bisecting")) {
    const words = search ? search.words
      : "bisecting: the culprit is among " + plural(found.suspects, "commit") + "; " + plural(found.builds, "backfill build") + " so far";
    return el("div", { class: "culprit searching" }, outcomeBadge("red", "red"), " ", words);
  }
  let firstRed = null;
  for (const entry of (history && history.entries) || []) { // newest first, back to the last green
    if (entry.outcome === "green") break;
    if (entry.outcome === "red") firstRed = entry;
  }
  return el("div", { class: "culprit" }, outcomeBadge("red", "red"), " ",
    firstRed ? ["first red build since the last green one: ",
      commitLine(firstRed.sha, firstRed.subject, firstRed.author),
      el("span", { class: "muted" }, " (an earlier commit that was not built may have broken it)")] : null,
    found && found.detail ? el("span", { class: "muted" }, " — " + found.detail) : null);
}

// A queue with projects is red for its blocking projects' reds; each finds its own culprit.
function projectsRed(history, projects) {
  if (!history || history.greenness !== "red") return null;
  const red = projects.filter((p) => p.blocking && p.greenness === "red").map((p) => p.project);
  return el("div", { class: "culprit", "data-red-projects": red.join(" ") }, outcomeBadge("red", "red"), " ",
    red.length ? "red projects: " + red.join(", ") : "red",
    el("span", { class: "muted" }, " — each project's culprit is named in its card below"));
}

// What the commit a culprit search named is called: "culprit" when it is confirmed as the
// break the head is red for, else "a break, not confirmed as the head's".
function culpritTag(confirmed) {
  return confirmed === false ? "a break (not confirmed)" : "culprit";
}

function cellLabel(entry, confirmed) {
  return [shortSha(entry.sha), outcomeWord(entry), entry.subject || "", entry.author ? "by " + authorName(entry.author) : "",
    KINDS[entry.kind] || entry.kind,
    entry.culprit ? (confirmed === false ? "a break, not confirmed as the head's" : "the culprit") : "",
    entry.bookmark ? "last green (bookmark)" : ""]
    .filter(Boolean).join(", ");
}

function renderHistory(queueName, result) {
  const box = el("div", { class: "history", "data-history-of": queueName });
  const heading = el("div", { class: "history-head" },
    el("h4", { id: "history-" + queueName }, "History"),
    el("span", { class: "muted" }, "oldest on the left, newest on the right"), legend());
  if (!result || !result.ok) {
    box.append(heading, el("p", { class: "empty banner" }, "History unavailable: "
      + ((result && result.body && result.body.error) || "HTTP " + (result ? result.status : "?"))));
    return box;
  }
  const entries = result.body.entries || [];
  const confirmed = result.body.culprit_search ? result.body.culprit_search.confirmed : null;
  if (entries.length === 0) {
    box.append(heading, el("p", { class: "empty muted" }, "Nothing built yet."));
    return box;
  }
  const chosenId = picked.get(queueName);
  const chosen = entries.find((e) => e.request_id === chosenId)
    || entries.find((e) => e.culprit) || entries[0];
  const shown = entries.slice().reverse(); // newest on the right
  const cells = shown.map((entry) => {
    const selected = entry === chosen;
    const classes = ["cell", "outcome-" + entry.outcome, "kind-" + entry.kind];
    if (entry.culprit) classes.push("is-culprit");
    if (entry.bookmark) classes.push("is-bookmark");
    return el("li", {
      class: classes.join(" "), role: "option", tabindex: selected ? "0" : "-1",
      "aria-selected": selected ? "true" : "false", "aria-label": cellLabel(entry, confirmed),
      title: cellLabel(entry, confirmed), "data-history": entry.request_id, "data-outcome": entry.outcome,
    },
    el("span", { class: "cell-mark", "aria-hidden": "true" }, (OUTCOMES[entry.outcome] || {}).symbol || "·"),
    el("span", { class: "cell-sha", "aria-hidden": "true" }, shortSha(entry.sha)),
    entry.culprit ? el("span", { class: "cell-tag", "aria-hidden": "true" }, confirmed === false ? "a break" : "culprit") : null,
    entry.bookmark && !entry.culprit ? el("span", { class: "cell-tag", "aria-hidden": "true" }, "bookmark") : null);
  });
  const strip = el("ol", { class: "strip-cells", role: "listbox", "aria-labelledby": "history-" + queueName,
    "aria-orientation": "horizontal" }, cells);
  strip.addEventListener("click", (event) => {
    const cell = event.target.closest("[data-history]");
    if (cell) pick(queueName, cell);
  });
  strip.addEventListener("focusin", (event) => {
    const cell = event.target.closest("[data-history]");
    if (cell && cell.getAttribute("aria-selected") !== "true") pick(queueName, cell);
  });
  strip.addEventListener("keydown", (event) => {
    const all = Array.from(strip.querySelectorAll("[data-history]"));
    const at = all.indexOf(document.activeElement);
    const to = { ArrowLeft: at - 1, ArrowRight: at + 1, Home: 0, End: all.length - 1 }[event.key];
    if (to === undefined || at < 0) return;
    event.preventDefault();
    const next = all[Math.max(0, Math.min(all.length - 1, to))];
    next.focus();
  });
  box.append(heading, strip, el("div", { class: "cell-detail", "aria-live": "polite" }, cellDetail(chosen, confirmed)));
  box.entries = entries;
  box.culpritConfirmed = confirmed;
  return box;
}

// A cell picked by click, focus or arrow key: its details, without waiting for a redraw.
function pick(queueName, cell) {
  const box = cell.closest(".history");
  const entry = (box.entries || []).find((e) => e.request_id === cell.dataset.history);
  if (!entry) return;
  picked.set(queueName, entry.request_id);
  for (const other of box.querySelectorAll("[data-history]")) {
    const selected = other === cell;
    other.setAttribute("aria-selected", selected ? "true" : "false");
    other.tabIndex = selected ? 0 : -1;
  }
  box.querySelector(".cell-detail").replaceChildren(cellDetail(entry, box.culpritConfirmed));
}

function cellDetail(entry, confirmed) {
  const signal = entry.time_to_signal_s !== null && entry.time_to_signal_s !== undefined
    ? "signal after " + duration(entry.time_to_signal_s) : null;
  return el("div", { "data-detail": entry.request_id },
    el("div", { class: "detail-title" }, outcomeBadge(entry.outcome, outcomeWord(entry)), " ",
      commitLine(entry.sha, entry.subject, entry.author),
      entry.culprit ? el("span", { class: "tag culprit-tag" }, culpritTag(confirmed)) : null,
      entry.bookmark ? el("span", { class: "tag" }, "last green") : null),
    el("div", { class: "detail-meta muted" },
      el("a", { href: requestLink(entry.request_id) }, entry.request_id), " · ",
      KINDS[entry.kind] || entry.kind,
      entry.attempts > 1 ? " · " + plural(entry.attempts, "attempt") : null,
      " · ingested ", el("span", { title: entry.ingested_at }, ago(entry.ingested_at)),
      signal ? " · " + signal : null,
      entry.build ? [" · ", buildLink(entry.build)] : null),
    entry.reason ? el("div", { class: "detail-reason" }, entry.reason) : null);
}

function legend() {
  return el("ul", { class: "legend", "aria-label": "Legend" },
    Object.entries(OUTCOMES).map(([outcome, known]) => el("li", {},
      el("span", { class: "legend-swatch outcome-" + outcome, "aria-hidden": "true" }, known.symbol),
      " " + known.word)));
}

// The branch's story since its last green commit (GET /api/queues/{queue}/explain).
function renderStory(result) {
  if (!result) return null; // the worker has no explain endpoint
  const box = el("div", { class: "story panel" }, el("h4", {}, "Why the bookmark is where it is"));
  if (!result.ok) {
    box.append(el("p", { class: "muted" }, "Story unavailable: "
      + ((result.body && result.body.error) || "HTTP " + result.status)));
    return box;
  }
  const explain = result.body;
  const confirmed = explain.culprit ? explain.culprit.confirmed : null;
  if (explain.summary) box.append(el("p", { class: "story-summary" }, explain.summary));
  const items = (explain.story || []).map((step) => {
    const build = step.build;
    return el("li", { "data-story": step.request_id || step.uri },
      outcomeBadge(outcomeOfState(step.state, step.verdict)), " ",
      commitLine(step.sha || step.uri, step.subject, step.author),
      step.culprit ? el("span", { class: "tag culprit-tag" }, culpritTag(confirmed)) : null,
      step.bookmark ? el("span", { class: "tag" }, "last green") : null,
      el("div", { class: "story-words" }, step.words || "",
        build && build.url ? [" · ", buildLink(build)] : null));
  });
  box.append(items.length ? el("ol", { class: "story-list" }, items)
    : el("p", { class: "muted" }, "Nothing since the last green commit."));
  return box;
}

function percentile(values, p) {
  if (!values.length) return null;
  const sorted = values.slice().sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)];
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Time to signal (ingest → fact) of each built commit in the strip, oldest on the left.
function renderSignal(history, health) {
  const box = el("div", { class: "signal panel" }, el("h4", {}, "Time to signal"));
  const points = ((history && history.entries) || []).slice().reverse()
    .filter((e) => e.time_to_signal_s !== null && e.time_to_signal_s !== undefined);
  const values = points.map((e) => e.time_to_signal_s);
  const p50 = percentile(values, 50);
  const p90 = percentile(values, 90);
  box.append(el("p", { class: "signal-summary" }, values.length
    ? "The strip's " + plural(values.length, "built commit") + ", ingest to fact: median " + duration(p50)
      + ", p90 " + duration(p90) + ", slowest " + duration(Math.max(...values))
    : "No signal yet."));
  if (health) box.append(healthFigures(health));
  if (!values.length) return box;
  // the plot lies between `left` and `right`; the margins carry the labels
  const width = 440;
  const height = 130;
  const left = 52;
  const right = width - 72;
  const bottom = 18;
  const top = 10;
  const max = Math.max(...values, 1);
  const band = (right - left) / Math.max(points.length, 10);
  const y = (v) => top + (height - top - bottom) * (1 - v / max);
  const bars = points.map((e, i) => svg("rect", {
    class: "bar outcome-" + e.outcome, x: (left + i * band + band * 0.15).toFixed(1),
    y: y(e.time_to_signal_s).toFixed(1), width: Math.max(1, band * 0.7).toFixed(1),
    height: Math.max(1, height - bottom - y(e.time_to_signal_s)).toFixed(1),
    "data-signal": e.request_id,
  }, svg("title", {}, shortSha(e.sha) + " " + outcomeWord(e) + ": " + duration(e.time_to_signal_s))));
  // p50 and p90 are labelled right of the plot, p90 above p50 when they are close
  const mark = (v, label, labelY) => svg("g", { class: "mark" },
    svg("line", { x1: left, x2: right, y1: y(v).toFixed(1), y2: y(v).toFixed(1) }),
    svg("text", { x: right + 4, y: (labelY + 3).toFixed(1) }, label + " " + duration(v)));
  const p90Y = Math.min(y(p90), y(p50) - 11);
  box.append(svg("svg", {
    class: "signal-chart", viewBox: "0 0 " + width + " " + height, width, height, role: "img",
    "aria-label": "Time to signal of the strip's " + plural(values.length, "built commit")
      + ", oldest first: median " + duration(p50) + ", p90 " + duration(p90),
  },
  svg("line", { class: "axis", x1: left, x2: right, y1: height - bottom, y2: height - bottom }),
  svg("text", { class: "axis-label", x: left - 4, y: height - bottom + 3, "text-anchor": "end" }, "0"),
  svg("text", { class: "axis-label", x: left - 4, y: top + 3, "text-anchor": "end" }, duration(max)),
  bars, mark(p50, "p50", y(p50)), mark(p90, "p90", p90Y),
  svg("text", { class: "axis-label", x: right, y: height - 3, "text-anchor": "end" }, "newest →")));
  return box;
}

// The queue's health figures (GET /api/queues/{queue}/health, or the queue's overview).
function healthFigures(health) {
  const chips = [];
  const add = (label, value, title) => {
    if (value !== null && value !== undefined && value !== "") {
      chips.push(el("span", { class: "chip", title: title || null }, label + " ", el("b", {}, value)));
    }
  };
  const days = (seconds) => seconds >= 86400 * 2 ? Math.round(seconds / 86400) + " days"
    : Math.round(seconds / 3600) + " h";
  const tts = health.time_to_signal;
  if (tts && tts.p50_s !== null && tts.p50_s !== undefined) {
    const over = "heads and commits validated again, last " + days(tts.window_s) + " (" + plural(tts.facts, "fact") + ")";
    add("p50", duration(tts.p50_s), over);
    add("p90", duration(tts.p90_s), over);
  }
  const red = health.red;
  if (red && red.share !== null && red.share !== undefined) {
    add("red, last " + days(red.window_s), Math.round(red.share * 100) + "%", "share of the time the branch was red");
  }
  if (red && red.streak_s !== null && red.streak_s !== undefined) add("red for", duration(red.streak_s), red.red_since);
  const lag = health.bookmark_lag;
  if (lag && lag.commits !== null && lag.commits !== undefined) {
    add("bookmark behind", (lag.commits_more_than ? "more than " : "") + plural(lag.commits, "commit")
      + (lag.seconds ? ", " + duration(lag.seconds) : ""));
  } else if (lag && lag.seconds) {
    add("bookmark behind", duration(lag.seconds), lag.commits_note);
  }
  const flakes = health.flakes;
  if (flakes && typeof flakes.in_window === "number") {
    add("flakes, last " + days(flakes.window_s), flakes.in_window, flakes.total + " in all");
  }
  return chips.length ? el("div", { class: "chips health-figures" }, chips) : null;
}

// Keyboard focus on a history cell survives the redraw that replaces it.
function focusedCell() {
  const active = document.activeElement;
  const cell = active && active.closest ? active.closest("[data-history]") : null;
  return cell ? cell.dataset.history : null;
}

function restoreFocus(requestId) {
  if (!requestId) return;
  const cell = document.querySelector('[data-history="' + CSS.escape(requestId) + '"]');
  if (cell) cell.focus({ preventScroll: true });
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
      const per = await Promise.all(list.map((q) => {
        const base = "/api/queues/" + encodeURIComponent(q.name);
        return Promise.all([getJson(base + "/requests?limit=" + RECENT),
          getJson(base + "/history?limit=" + HISTORY), optionalJson("explain", base + "/explain"),
          optionalJson("health", base + "/health"),
          optionalJson("grid", base + "/grid?limit=" + GRID_ROWS)]);
      }));
      const cards = list.map((q, i) => renderQueue(q, per[i][0],
        { history: per[i][1], explain: per[i][2], health: per[i][3], grid: per[i][4] }));
      const focused = focusedCell();
      document.getElementById("queues").replaceChildren(
        ...(cards.length ? cards : [el("p", { class: "muted" }, "No queues configured.")]));
      restoreFocus(focused);
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
