"""Push webhooks over real HTTP: a real `stovepipe worker` process on the real broker and
database, deliveries shaped as GitHub and GitLab send them (signed or carrying their
token), urllib as the provider."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml

from tests.waiting import wait_until
from tests.web_support import (
    TOKEN,
    Reply,
    SlowSenders,
    WebPipeline,
    assert_error,
    raw_answer,
)

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

GITHUB_SECRET = "gh-hook-s3cret-7d41f0"
GITLAB_TOKEN = "gl-hook-t0ken-2b9e55"
GITHUB_ENV = "STOVEPIPE_GITHUB_WEBHOOK_SECRET"
GITLAB_ENV = "STOVEPIPE_GITLAB_WEBHOOK_TOKEN"
UNSET_ENV = "STOVEPIPE_TEST_WEBHOOK_SECRET_NEVER_SET"
SHA = "9" * 40


class HookPipeline(WebPipeline):
    """A WebPipeline with a `webhooks` section, that keeps every webhook answer."""

    webhooks: dict[str, Any]
    replies: list[Reply]

    def configure_webhooks(self, webhooks: dict[str, Any]) -> None:
        self.webhooks = webhooks
        self.queues_file.write_text(yaml.safe_dump({"webhooks": webhooks,
                                                    "queues": self.queues}))

    def send(self, path: str, body: bytes | Iterable[bytes],
             headers: dict[str, str]) -> Reply:
        request = urllib.request.Request(self.url(path), data=body, method="POST",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, raw, got = response.status, response.read(), response.headers
        except urllib.error.HTTPError as err:
            status, raw, got = err.code, err.read(), err.headers
        text = raw.decode()
        reply = Reply(status, json.loads(text) if "json" in got.get("Content-Type", "")
                      else None, dict(got), text)
        self.replies.append(reply)
        return reply

    def github(self, payload: Any, *, event: str = "push", delivery: str | None = None,
               secret: str | None = GITHUB_SECRET, signature: str | None = None,
               body: bytes | None = None, form: bool = False) -> Reply:
        if body is None:
            text = json.dumps(payload)
            body = urlencode({"payload": text}).encode() if form else text.encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded" if form
                   else "application/json", "X-GitHub-Event": event,
                   "X-GitHub-Delivery": delivery or str(uuid.uuid4())}
        if signature is None and secret is not None:
            signature = sign(secret, body)
        if signature is not None:
            headers["X-Hub-Signature-256"] = signature
        return self.send("/webhooks/github", body, headers)

    def gitlab(self, payload: Any, *, event: str = "Push Hook", token: str | None =
               GITLAB_TOKEN, **ids: str) -> Reply:
        """``ids``: idempotency_key and/or event_uuid headers (none: GitLab < 17.4)."""
        headers = {"Content-Type": "application/json", "X-Gitlab-Event": event}
        if token is not None:
            headers["X-Gitlab-Token"] = token
        if "idempotency_key" in ids:
            headers["Idempotency-Key"] = ids["idempotency_key"]
        if "event_uuid" in ids:
            headers["X-Gitlab-Event-UUID"] = ids["event_uuid"]
        return self.send("/webhooks/gitlab", json.dumps(payload).encode(), headers)

    def assert_secrets_never_shown(self) -> None:
        logs = self.full_logs()
        for secret in (GITHUB_SECRET, GITLAB_TOKEN):
            assert secret not in logs
            for reply in self.replies:
                assert secret not in reply.text, reply.text
                assert all(secret not in v for v in reply.headers.values())


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def github_push(branch: str = "main", repository: str = "acme/monorepo",
                **extra: Any) -> dict[str, Any]:
    ref = branch if branch.startswith("refs/") else f"refs/heads/{branch}"
    return {"ref": ref, "before": "0" * 40, "after": SHA, "created": False,
            "deleted": False, "forced": False, "commits": [],
            "repository": {"full_name": repository, "name": repository.split("/")[-1]},
            **extra}


def big_github_push(commits: int = 2048) -> dict[str, Any]:
    """A push of ``commits`` commits as GitHub's "Webhook events and payloads" describes
    it (https://docs.github.com/webhooks/webhook-events-and-payloads#push: ``commits``
    holds at most 2,048 commit objects — id, tree_id, distinct, message, timestamp, url,
    author, committer, added, removed, modified — and a payload is capped at 25 MB). Our
    own commits, each about 3 KB like a commit of a large monorepo change: 2,048 of them
    make about 6.4 MB."""
    def sha(n: int, kind: int) -> str:
        return hashlib.sha1(f"{kind}:{n}".encode()).hexdigest()

    person = {"name": "Ada Lovelace", "email": "ada@example.com", "username": "ada"}
    web = {"name": "GitHub", "email": "noreply@github.com", "username": "web-flow"}
    listed = [{
        "id": sha(n, 0), "tree_id": sha(n, 1), "distinct": True,
        "message": f"payments: step {n} of the ledger migration\n\n" + "Moves one more "
                   "table of the ledger to the new schema, keeps the old reader working "
                   "behind the flag, and adds the backfill job for the rows written "
                   "before the switch. " * 9,
        "timestamp": "2026-01-05T10:00:00+01:00",
        "url": f"https://github.com/acme/monorepo/commit/{sha(n, 0)}",
        "author": person, "committer": web,
        "added": [f"services/payments/ledger/migrations/{n:04d}_step.sql"],
        "removed": [],
        "modified": [f"services/payments/ledger/tables/table_{k:02d}/reader.py"
                     for k in range(20)],
    } for n in range(commits)]
    return github_push(before=sha(-1, 0), after=SHA, commits=listed,
                       head_commit=listed[-1], compare="https://github.com/acme/monorepo/"
                       f"compare/{sha(-1, 0)[:12]}...{SHA[:12]}",
                       pusher={"name": "ada", "email": "ada@example.com"},
                       sender={"login": "ada", "id": 1, "type": "User"})


def gitlab_push(branch: str = "main", project: str = "group/sub/project",
                after: str = SHA, project_id: int = 41, **extra: Any) -> dict[str, Any]:
    """A push hook's payload as GitLab's "Webhook events" documentation describes it
    (https://docs.gitlab.com/user/project/integrations/webhook_events/#push-events), with
    our own values."""
    base = "https://gitlab.example.com"
    ssh = f"git@gitlab.example.com:{project}.git"
    return {"object_kind": "push", "event_name": "push", "before": "0" * 40,
            "after": after, "ref": f"refs/heads/{branch}", "ref_protected": True,
            "checkout_sha": after, "user_id": 7, "user_name": "Ada Lovelace",
            "user_username": "ada", "user_email": "", "user_avatar": None,
            "project_id": project_id,
            "project": {"id": project_id, "name": project.rsplit("/", 1)[-1],
                        "description": "", "web_url": f"{base}/{project}",
                        "avatar_url": None, "git_ssh_url": ssh,
                        "git_http_url": f"{base}/{project}.git",
                        "namespace": project.split("/")[0], "visibility_level": 0,
                        "path_with_namespace": project, "default_branch": "main",
                        "homepage": f"{base}/{project}", "url": ssh, "ssh_url": ssh,
                        "http_url": f"{base}/{project}.git"},
            "repository": {"name": project.rsplit("/", 1)[-1], "url": ssh,
                           "description": "", "homepage": f"{base}/{project}",
                           "git_http_url": f"{base}/{project}.git", "git_ssh_url": ssh,
                           "visibility_level": 0},
            "commits": [], "total_commits_count": 0, **extra}


def assert_ignored(reply: Reply, *fragments: str) -> None:
    assert reply.status == 202, (reply.status, reply.text)
    for fragment in fragments:
        assert fragment in reply.body["ignored"], reply.body


def webhook_counts(p: HookPipeline) -> dict[tuple[str, str], float]:
    counts = {}
    for labels, value in re.findall(r"^stovepipe_webhook_deliveries_total\{(.*)\} (\S+)$",
                                    p.get("/metrics").text, re.MULTILINE):
        named = dict(re.findall(r'(\w+)="(\w*)"', labels))
        counts[(named["provider"], named["outcome"])] = float(value)
    return counts


@pytest.fixture
def web(kafka_bootstrap: str, migrated_dsn: str, topic_prefix: str,
        tmp_path: Path) -> Iterator[HookPipeline]:
    p = HookPipeline(bootstrap=kafka_bootstrap, dsn=migrated_dsn, prefix=topic_prefix,
                     root=tmp_path)
    p.replies = []
    try:
        yield p
    finally:
        p.close()


def test_a_signed_github_push_ingests_every_queue_watching_its_branch(
        web: HookPipeline) -> None:
    web.add_queue("team/main", ref="main", webhook_repository="Acme/Monorepo")
    web.add_queue("team/lint", ref="main", webhook_repository="acme/monorepo")
    web.add_queue("team/develop", ref="develop", webhook_repository="acme/monorepo")
    web.add_queue("else/main", ref="main", webhook_repository="acme/elsewhere")
    web.configure_webhooks({"github": {"secret_env": GITHUB_ENV}})
    web.repo.push("develop", "d1")
    web.start_web_worker(env={GITHUB_ENV: GITHUB_SECRET, "STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()

    ping = web.github({"zen": "Design for failure.", "hook_id": 1}, event="ping",
                      delivery="ping-1")
    assert (ping.status, ping.body["delivery"]) == (200, "ping-1")
    assert ping.body["ping"].startswith("pong")

    # a push the worker cannot ingest yet (the ref is missing here): an error, nothing
    # remembered, so the provider's redelivery of the same delivery ingests it
    assert_error(web.github(github_push(), delivery="d-1"), 422, "has no ref")
    assert web.states() == {}
    web.repo.push("main", "a1")
    first = web.github(github_push(), delivery="d-1")  # no bearer token: signed instead
    assert first.status == 201, first.text
    assert first.body == {  # the queues in file order (yaml.safe_dump sorts them)
        "provider": "github", "delivery": "d-1", "repository": "acme/monorepo",
        "branch": "main", "already_ingested": False, "ingested": [
            {"queue": "team/lint", "request_id": "request/team/lint/1", "new": True},
            {"queue": "team/main", "request_id": "request/team/main/1", "new": True}]}
    web.wait_quiet()
    assert web.states() == {"request/team/main/1": "succeeded",
                            "request/team/lint/1": "succeeded"}

    # the branch moves; the old delivery sent again is already ingested: nothing new
    web.repo.push("main", "b2-fail")
    replay = web.github(github_push(), delivery="d-1")
    assert replay.status == 200, replay.text
    assert replay.body["already_ingested"] is True
    assert replay.body["ingested"] == [
        {"queue": "team/lint", "request_id": "request/team/lint/1"},
        {"queue": "team/main", "request_id": "request/team/main/1"}]
    assert sorted(web.states()) == ["request/team/lint/1", "request/team/main/1"]

    # what must ingest nothing while main's new head waits to be ingested
    nothing = web.states()
    unsigned = web.github(github_push(), secret=None)
    assert_error(unsigned, 401, "missing the X-Hub-Signature-256 header")
    assert "WWW-Authenticate" not in unsigned.headers
    assert_error(web.github(github_push(), secret="wrong"), 401, "does not match")
    assert_error(web.github(github_push(), signature=sign(GITHUB_SECRET, b"{}")), 401,
                 "does not match")
    assert_error(web.github(github_push(), signature="sha256=" + "0" * 64), 401)
    sha1 = "sha1=" + hmac.new(GITHUB_SECRET.encode(), b"", hashlib.sha1).hexdigest()
    assert_error(web.github(github_push(), secret=None, signature=sha1), 401)
    assert_ignored(web.github(github_push(), event="issues"), "event 'issues' is not a push")
    assert_ignored(web.github(github_push("refs/tags/v1.0")), "refs/tags/v1.0 is not a branch")
    assert_ignored(web.github(github_push(deleted=True)), "branch 'main' was deleted")
    assert_ignored(web.github(github_push("feature")),
                   "no queue watches branch 'feature' of acme/monorepo")
    assert_ignored(web.github(github_push(repository="acme/other")), "acme/other")
    assert_error(web.github(None, body=b"{not json"), 400, "the body is not JSON")
    assert_error(web.github(None, body=b"[]"), 400, "not an object")
    assert_error(web.github({"ref": "refs/heads/main"}), 400, "no 'repository' object")
    assert_error(web.github(github_push(), event=""), 400, "missing the X-GitHub-Event")
    assert_error(web.github(github_push(), delivery="has space"), 400, "delivery id")
    # over GitHub's 25 MB cap: refused by its Content-Length, or while read (chunked)
    big = b" " * (25 * 1024 * 1024 + 1)
    assert_error(web.github(None, body=big), 413, "larger than 26214400 bytes")
    assert_error(web.send("/webhooks/github", iter([big[:65536]] * 401), {
        "Content-Type": "application/json", "X-GitHub-Event": "push"}), 413)
    del big
    assert_error(web.call("GET", "/webhooks/github"), 405)
    assert_error(web.post("/api/queues/team/main/ingest", token=None), 401)  # API: token
    assert web.states() == nothing

    # the push of the new head is a delivery of its own (form-encoded this time)
    moved = web.github(github_push(), delivery="d-2", form=True)
    assert moved.status == 201, moved.text
    assert [i["request_id"] for i in moved.body["ingested"]] == [
        "request/team/lint/2", "request/team/main/2"]
    web.wait_quiet()
    assert web.states() == {**nothing, "request/team/main/2": "failed",
                            "request/team/lint/2": "failed"}
    # the same head pushed again (a new delivery): its existing Requests, nothing new
    same = web.github(github_push(), delivery="d-3")
    assert (same.status, [i["new"] for i in same.body["ingested"]]) == (200, [False, False])

    # a push of 2,048 commits, GitHub's most (about 6.4 MB; the old 5 MB cap refused it)
    web.repo.push("main", "c3")
    payload = json.dumps(big_github_push()).encode()
    assert 6_000_000 < len(payload) < 7_000_000, len(payload)
    large = web.github(None, body=payload, delivery="d-4")
    assert large.status == 201, large.text
    assert [i["request_id"] for i in large.body["ingested"]] == [
        "request/team/lint/3", "request/team/main/3"]
    web.wait_quiet()
    assert web.states() == {**nothing, "request/team/main/2": "failed",
                            "request/team/lint/2": "failed",
                            "request/team/main/3": "succeeded",
                            "request/team/lint/3": "succeeded"}
    assert web.exact_outcome_problems() == []

    counts = webhook_counts(web)
    assert counts[("github", "ingested")] == 4
    assert counts[("github", "duplicate")] == 1
    assert counts[("github", "rejected")] == 5
    assert counts[("github", "ping")] == 1
    web.assert_secrets_never_shown()


def test_gitlab_push_hooks_by_token_and_github_not_set_up(web: HookPipeline) -> None:
    web.add_queue("group/main", ref="main", webhook_repository="group/sub/project")
    web.configure_webhooks({"gitlab": {"token_env": GITLAB_ENV}})
    web.repo.push("main", "a1")
    web.start_web_worker(env={GITLAB_ENV: GITLAB_TOKEN, GITHUB_ENV: GITHUB_SECRET})
    web.wait_healthy()

    # GitHub is not in queues.yaml: even a correctly signed push is refused
    assert_error(web.github(github_push(repository="group/sub/project")), 503,
                 "queues.yaml has no webhooks.github.secret_env",
                 "nothing is accepted unverified")
    assert_error(web.gitlab(gitlab_push(), token=None), 401, "missing the X-Gitlab-Token")
    assert_error(web.gitlab(gitlab_push(), token="wrong"), 401, "not the configured")
    assert_error(web.gitlab(gitlab_push(), token=GITLAB_TOKEN[:-1]), 401)
    assert web.states() == {}

    key = str(uuid.uuid4())
    pushed = web.gitlab(gitlab_push(), idempotency_key=key, event_uuid="event-1")
    assert pushed.status == 201, pushed.text
    assert pushed.body == {
        "provider": "gitlab", "delivery": key, "repository": "group/sub/project",
        "branch": "main", "already_ingested": False, "ingested": [
            {"queue": "group/main", "request_id": "request/group/main/1", "new": True}]}
    web.wait_quiet()
    web.repo.push("main", "b2")
    resent = web.gitlab(gitlab_push(), idempotency_key=key, event_uuid="event-1")
    assert (resent.status, resent.body["already_ingested"]) == (200, True)
    assert_ignored(web.gitlab(gitlab_push(), event="Tag Push Hook"), "not a push")
    assert_ignored(web.gitlab(gitlab_push(after="0" * 40)), "branch 'main' was deleted")
    assert_ignored(web.gitlab(gitlab_push("develop")), "no queue watches branch 'develop'")
    assert_error(web.gitlab({**gitlab_push(), "project": {}}), 400,
                 "no 'project.path_with_namespace' string")
    assert web.states() == {"request/group/main/1": "succeeded"}

    # older GitLab: the event's UUID, with what the push is about, is the delivery id
    by_uuid = web.gitlab(gitlab_push(after="b2" * 20), event_uuid="event-2")
    assert by_uuid.status == 201 and by_uuid.body["delivery"].startswith("event-2/")
    assert by_uuid.body["ingested"][0]["request_id"] == "request/group/main/2"
    web.wait_quiet()
    # a system hook without any id: the same body twice is the same delivery
    web.repo.push("main", "c3")
    system = {**gitlab_push(after="c3" * 20), "object_kind": None}
    hooked = web.gitlab(system, event="System Hook")
    assert hooked.status == 201, hooked.text
    assert hooked.body["delivery"].startswith("sha256:")
    again = web.gitlab(system, event="System Hook")
    assert (again.status, again.body["already_ingested"], again.body["delivery"]) == (
        200, True, hooked.body["delivery"])
    web.wait_quiet()
    assert web.states() == {"request/group/main/1": "succeeded",
                            "request/group/main/2": "succeeded",
                            "request/group/main/3": "succeeded"}
    assert web.exact_outcome_problems() == []
    web.assert_secrets_never_shown()


def test_identical_deliveries_at_once_ingest_once(web: HookPipeline) -> None:
    # resolving the head takes a second, so the deliveries overlap the first one's ingest
    web.add_queue("team/main", ref="main", webhook_repository="group/sub/project",
                  source_latency={"head": "1s"})
    web.configure_webhooks({"github": {"secret_env": UNSET_ENV},
                            "gitlab": {"token_env": GITLAB_ENV}})
    web.repo.push("main", "a1")
    web.start_web_worker(env={GITLAB_ENV: GITLAB_TOKEN})
    web.wait_healthy()

    # GitHub's variable is unset: refused, naming the variable (never a value)
    assert_error(web.github(github_push(repository="group/sub/project")), 503,
                 f"its secret variable {UNSET_ENV} is unset or empty")

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(
            lambda _: web.gitlab(gitlab_push(), idempotency_key="same-delivery"), range(6)))
    assert sorted(r.status for r in replies) == [200] * 5 + [201], [r.text for r in replies]
    assert sorted(r.body["already_ingested"] for r in replies) == [False] + [True] * 5
    assert {r.body["ingested"][0]["request_id"] for r in replies} == {"request/team/main/1"}
    web.wait_quiet()
    assert web.states() == {"request/team/main/1": "succeeded"}
    assert web.query("SELECT state, request_ids FROM webhook_delivery") == [
        ("ingested", ["request/team/main/1"])]
    web.assert_secrets_never_shown()


def test_gitlab_pushes_sharing_an_event_uuid_are_deliveries_of_their_own(
        web: HookPipeline) -> None:
    """GitLab gives every hook one request fires the same X-Gitlab-Event-UUID (so its
    "Webhooks" page; Idempotency-Key, from 17.4, is the delivery's own): two projects'
    pushes under one UUID are two deliveries, the same push sent again is one."""
    # both validate `main` of the one test repository: each promotes a ref of its own
    web.add_queue("one/main", ref="main", webhook_repository="group/one",
                  promotion_ref="verified-one")
    web.add_queue("two/main", ref="main", webhook_repository="group/two",
                  promotion_ref="verified-two")
    web.configure_webhooks({"gitlab": {"token_env": GITLAB_ENV}})
    web.repo.push("main", "a1")
    web.start_web_worker(env={GITLAB_ENV: GITLAB_TOKEN})
    web.wait_healthy()

    shared = str(uuid.uuid4())
    one = gitlab_push(project="group/one", project_id=1, after="a1" * 20)
    two = gitlab_push(project="group/two", project_id=2, after="a1" * 20)
    first = web.gitlab(one, event_uuid=shared)
    second = web.gitlab(two, event_uuid=shared)
    assert (first.status, second.status) == (201, 201), (first.text, second.text)
    assert first.body["ingested"] == [
        {"queue": "one/main", "request_id": "request/one/main/1", "new": True}]
    assert second.body["ingested"] == [
        {"queue": "two/main", "request_id": "request/two/main/1", "new": True}]
    assert first.body["delivery"] != second.body["delivery"]
    web.wait_quiet()

    # the branch moves; GitLab retries the first project's hook: already ingested
    web.repo.push("main", "b2")
    again = web.gitlab(one, event_uuid=shared)
    assert (again.status, again.body["already_ingested"]) == (200, True), again.text
    assert again.body["delivery"] == first.body["delivery"]
    assert again.body["ingested"] == [{"queue": "one/main",
                                       "request_id": "request/one/main/1"}]

    # with Idempotency-Key the key decides: a new key is a new delivery (it ingests the
    # branch's head now), the same key again is that delivery, whatever the UUID says
    keyed = web.gitlab(two, idempotency_key="key-1", event_uuid=shared)
    assert (keyed.status, keyed.body["delivery"]) == (201, "key-1"), keyed.text
    assert keyed.body["ingested"][0]["request_id"] == "request/two/main/2"
    resent = web.gitlab(two, idempotency_key="key-1", event_uuid=str(uuid.uuid4()))
    assert (resent.status, resent.body["already_ingested"]) == (200, True), resent.text
    web.wait_quiet()
    assert web.states() == {"request/one/main/1": "succeeded",
                            "request/two/main/1": "succeeded",
                            "request/two/main/2": "succeeded"}
    assert sorted(d for (d,) in web.query("SELECT delivery_id FROM webhook_delivery")) \
        == sorted([first.body["delivery"], second.body["delivery"], "key-1"])
    assert web.exact_outcome_problems() == []
    web.assert_secrets_never_shown()


MIB = 1024 * 1024
SLOW_READ_TIMEOUT = 15.0  # the worker's webhook read timeout in the slow-sender test


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak RSS) of process ``pid``, in bytes."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


class PeakMemory:
    """The highest VmRSS of a process, looked at every 20 ms in a thread of its own."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, memory(pid)["VmRSS"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, memory(self.pid)["VmRSS"])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.peak


def validate_and_time(web: HookPipeline, queue: str, ref: str, head: str) -> float:
    """Push ``head`` to ``ref``, ingest ``queue`` over HTTP, wait for its fact: the
    seconds from asking for the ingest to the fact's creation (the database's clock: the
    same machine's)."""
    web.repo.push(ref, head)
    asked = time.time()
    reply = web.post(f"/api/queues/{queue}/ingest", token=None)
    assert reply.status == 201, reply.text
    request_id = reply.body["request_id"]
    timed: list[tuple[Any, ...]] = []

    def fact_recorded() -> bool:
        timed[:] = web.query(
            "SELECT extract(epoch FROM f.created_at), f.degree "
            "FROM validation_fact f JOIN request r ON r.queue = f.queue AND "
            "r.id = f.request_id WHERE r.queue = %s AND r.id = %s", queue, request_id)
        return bool(timed)

    wait_until(fact_recorded, timeout=60, what=f"the fact of {request_id}", interval=0.05)
    assert timed[0][1] == 0, timed
    return float(timed[0][0]) - asked


def test_slow_unauthenticated_deliveries_hold_no_memory_and_delay_no_queue(
        web: HookPipeline) -> None:
    """100 unauthenticated GitHub deliveries declaring 25 MiB and sending 4 KiB/s, and 20
    GitLab ones with a wrong token sending nothing: the worker allocates nothing for them
    (no buffer sized by Content-Length; GitLab's token is checked before the body is
    read), reads at most 4 GitHub bodies at once (the rest: 503 with Retry-After), cuts
    the slow ones off with a 408 at the read timeout, and another queue validates as fast
    as when idle."""
    web.add_queue("team/main", ref="main", webhook_repository="acme/monorepo")
    other = web.add_queue("other/main")
    web.configure_webhooks({"github": {"secret_env": GITHUB_ENV},
                            "gitlab": {"token_env": GITLAB_ENV}})
    web.repo.push("main", "a1")
    worker = web.start_web_worker(env={
        GITHUB_ENV: GITHUB_SECRET, GITLAB_ENV: GITLAB_TOKEN,
        "STOVEPIPE_WEBHOOK_READ_TIMEOUT": f"{SLOW_READ_TIMEOUT:g}"})
    web.wait_healthy()
    assert web.port is not None
    validate_and_time(web, "other/main", other, "w1")  # warm: the first one pays imports
    idle = [validate_and_time(web, "other/main", other, f"i{n}") for n in range(3)]

    before = memory(worker.pid)
    unsigned = SlowSenders(web.port, "/webhooks/github", {
        "Content-Type": "application/json", "X-GitHub-Event": "push",
        "X-Hub-Signature-256": "sha256=" + "0" * 64}, count=100, declared=25 * MIB,
        chunk=1024, every=0.25)
    untokened = SlowSenders(web.port, "/webhooks/gitlab", {
        "Content-Type": "application/json", "X-Gitlab-Event": "Push Hook",
        "X-Gitlab-Token": "wrong"}, count=20, declared=25 * MIB, chunk=0)
    peak = PeakMemory(worker.pid)
    unsigned.start()
    untokened.start()
    try:
        wait_until(lambda: unsigned.connected == 100 and untokened.connected == 20
                   and min(a.sent for a in unsigned.answers) >= 4096, timeout=30,
                   what="every slow sender connected and sending")
        loaded = [validate_and_time(web, "other/main", other, f"l{n}") for n in range(3)]
        # while GitHub's slots are held: a signed delivery is turned away for now, and
        # GitLab's deliveries (authenticated before their body is read) are not
        busy = web.github(github_push(), delivery="d-busy")
        by_token = web.gitlab(gitlab_push(project="acme/monorepo"), idempotency_key="k-1")
        grown = peak.peak - before["VmRSS"]
        print(f"\nworker memory: {before['VmRSS'] / MIB:.1f} MiB before, "
              f"{peak.peak / MIB:.1f} MiB at most under load (+{grown / MIB:.1f} MiB); "
              f"VmHWM {before['VmHWM'] / MIB:.1f} -> "
              f"{memory(worker.pid)['VmHWM'] / MIB:.1f} MiB")
        print(f"other queue ingest -> fact: idle {[f'{s:.2f}' for s in idle]} s, "
              f"under load {[f'{s:.2f}' for s in loaded]} s; medians "
              f"{statistics.median(idle):.2f} s -> {statistics.median(loaded):.2f} s")
        assert grown < 50 * MIB, f"the worker grew by {grown / MIB:.0f} MiB"
        assert memory(worker.pid)["VmHWM"] <= max(before["VmHWM"],
                                                  before["VmRSS"] + 50 * MIB)
        assert statistics.median(loaded) - statistics.median(idle) < 1.0, (idle, loaded)

        assert_error(busy, 503, "4 GitHub webhook bodies are being read already")
        assert busy.headers["Retry-After"] == f"{SLOW_READ_TIMEOUT:g}"
        assert by_token.status == 201, by_token.text
        assert by_token.body["ingested"] == [
            {"queue": "team/main", "request_id": "request/team/main/1", "new": True}]
        wait_until(lambda: all(a.closed_after is not None for a in unsigned.answers)
                   and all(a.status is not None for a in untokened.answers),
                   timeout=SLOW_READ_TIMEOUT + 30, what="every slow sender cut off")
    finally:
        unsigned.stop()
        untokened.stop()
        peak.stop()

    assert sorted(unsigned.statuses()) == [408] * 4 + [503] * 96, unsigned.statuses()
    for status in (503, 408):
        times = [(a.answered_after or 0, a.closed_after or 0) for a in unsigned.answers
                 if a.status == status]
        print(f"{status}: answered after {max(t[0] for t in times):.2f} s at most, closed "
              f"after {max(t[1] for t in times):.2f} s at most")
    for answer in unsigned.answers:
        assert answer.answered_after is not None and answer.closed_after is not None
        if answer.status == 503:  # at once; aiohttp reads what is still sent (and drops
            # it) for its lingering time, 10 s, so that a sender can read the answer
            assert answer.body == busy.body, answer.text
            assert answer.headers["retry-after"] == f"{SLOW_READ_TIMEOUT:g}"
            assert answer.answered_after < 5, answer
            assert answer.closed_after - answer.answered_after < 10 + 5, answer
        else:  # read until the timeout, then cut off at once
            assert set(answer.body) == {"error"}, answer.text
            assert f"not sent within {SLOW_READ_TIMEOUT:g} s" in answer.body["error"]
            assert SLOW_READ_TIMEOUT - 1 < answer.answered_after < SLOW_READ_TIMEOUT + 5
            assert answer.closed_after - answer.answered_after < 1, answer
            assert answer.headers["connection"] == "close"
    for answer in untokened.answers:
        assert (answer.status, answer.sent) == (401, 0), answer
        assert "X-Gitlab-Token is not the configured" in answer.body["error"]
        assert answer.answered_after is not None and answer.answered_after < 5

    # a request's head is bounded too: 64 headers at most, 8190 bytes each
    head = ("POST /webhooks/github HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            "Content-Length: 2\r\n")
    many = (head + "".join(f"X-Filler-{n}: {n}\r\n" for n in range(62)) + "\r\n{}").encode()
    assert raw_answer(web.port, many).startswith(b"HTTP/1.0 400 Bad Request")
    assert b"Too many headers" in raw_answer(web.port, many)
    assert b"HTTP/1.1 401" in raw_answer(web.port, many.replace(b"X-Filler-0: 0\r\n", b""))
    long = (head + "X-Filler: " + "a" * 8200 + "\r\n\r\n{}").encode()
    assert b"Got more than 8190 bytes" in raw_answer(web.port, long)

    # the slots are free again: the delivery turned away is ingested when sent again
    again = web.github(github_push(), delivery="d-busy")
    assert again.status == 200, again.text  # the head GitLab's delivery ingested
    assert again.body["ingested"] == [
        {"queue": "team/main", "request_id": "request/team/main/1", "new": False}]
    web.wait_quiet()
    assert web.exact_outcome_problems() == []
    counts = webhook_counts(web)
    assert counts[("github", "busy")] == 97
    assert counts[("github", "timed_out")] == 4
    assert counts[("gitlab", "rejected")] == 20
    web.assert_secrets_never_shown()
