"""Deploy-gate answers by commit sha (design §9), on the real broker and database: the CLI
on a fake repository with a red commit, a never-ingested one, another queue's, one the
repository does not have and an ambiguous prefix; the HTTP API on a real git repository,
with the promotion ref's target."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from tests.pipeline_support import Pipeline
from tests.web_support import WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

QUEUE = "gate/main"


def _fact(pipeline: Pipeline, commit: str,
          queue: str = QUEUE) -> tuple[int, dict[str, Any] | None, str]:
    result = pipeline.cli("fact", queue, commit, "--json", check=False)
    body = json.loads(result.stdout) if result.returncode in (0, 3) else None
    return result.returncode, body, result.stderr


def _validate(pipeline: Pipeline, ref: str, *shas: str) -> None:
    pipeline.repo.push(ref, *shas)
    pipeline.ingest(QUEUE)
    pipeline.wait_quiet()


def test_the_cli_answers_by_sha_with_the_nearest_green_commits(pipeline: Pipeline) -> None:
    ref = pipeline.add_queue(QUEUE)
    other = pipeline.add_queue("gate/other")
    pipeline.repo.push(other, "o1")
    pipeline.start_worker()
    _validate(pipeline, ref, "a1")  # request 1, green
    _validate(pipeline, ref, "b2-fail")  # request 2, red
    _validate(pipeline, ref, "c3")  # request 3, green
    _validate(pipeline, ref, "d4", "e5-fail")  # request 4 (red); d4 is never a head
    _validate(pipeline, ref, "f6")  # request 5, green
    pipeline.repo.push(ref, "g70", "g71")  # pushed, not validated yet

    def uri(sha: str) -> str:
        return f"fake://r/{ref}/{sha}"

    code, green, _ = _fact(pipeline, "a1")
    assert code == 0 and green is not None
    assert (green["uri"], green["green"], green["prior_green"], green["next_green"]) == (
        uri("a1"), True, None, None)
    assert green["fact"]["request_id"] == f"request/{QUEUE}/1"
    assert green["known"] is True

    code, red, _ = _fact(pipeline, "b2")  # a unique prefix
    assert code == 3 and red is not None
    assert (red["uri"], red["green"], red["fact"]["degree"]) == (uri("b2-fail"), False, 1)
    assert red["prior_green"]["uri"] == uri("a1")
    assert red["next_green"]["uri"] == uri("c3")
    assert red["complete"] is True

    code, between, _ = _fact(pipeline, "d4")  # never a head: no fact of its own
    assert code == 3 and between is not None
    assert (between["fact"], between["prior_green"]["uri"], between["next_green"]["uri"]) \
        == (None, uri("c3"), uri("f6"))

    code, newest, _ = _fact(pipeline, "g71")  # newer than every green commit
    assert code == 3 and newest is not None
    assert (newest["prior_green"]["uri"], newest["next_green"]) == (uri("f6"), None)

    assert _fact(pipeline, uri("c3"))[0] == 0  # the URI itself still answers

    text = pipeline.cli("fact", QUEUE, "e5", check=False)
    assert text.returncode == 3
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"{uri('e5-fail')}: degree 1 (red), by request/{QUEUE}/4 at ")
    assert lines[1:] == [f"  newest green ancestor   {uri('c3')}  (request/{QUEUE}/3)",
                         f"  oldest green descendant {uri('f6')}  (request/{QUEUE}/5)"]

    # every commit a gate can name gets an answer it can read, green or not
    code, ambiguous, _ = _fact(pipeline, "g7")
    assert code == 3 and ambiguous is not None
    assert (ambiguous["uri"], ambiguous["green"], ambiguous["fact"], ambiguous["known"]) == (
        None, False, None, False)
    assert "names 2 commits" in ambiguous["reason"]
    assert "give more digits" in ambiguous["reason"]
    code, missing, _ = _fact(pipeline, "zz")
    assert code == 3 and missing is not None
    assert (missing["uri"], missing["green"], missing["known"]) == (None, False, False)
    assert "has no commit 'zz'" in missing["reason"]
    code, gone, _ = _fact(pipeline, "fake://r/gone/0ff")  # a URI of no commit
    assert code == 3 and gone is not None
    assert (gone["uri"], gone["green"], gone["known"]) == ("fake://r/gone/0ff", False, False)
    text = pipeline.cli("fact", QUEUE, "zz", check=False)
    assert text.returncode == 3
    assert text.stdout.startswith("zz: not green — ") and "has no commit 'zz'" in text.stdout
    pipeline.ingest("gate/other")
    pipeline.wait_quiet()
    assert _fact(pipeline, uri("a1"), "gate/other")[0] == 3  # validated on gate/main only
    code, elsewhere, _ = _fact(pipeline, f"fake://r/{other}/o1")  # green on gate/other
    assert code == 3 and elsewhere is not None
    assert (elsewhere["green"], elsewhere["fact"], elsewhere["known"]) == (False, None, True)

    for malformed in ("a b", "x/y"):  # not a sha: an error, not an answer
        code, _, error = _fact(pipeline, malformed)
        assert code == 1 and "not a fake sha" in error and "Traceback" not in error
    result = pipeline.cli("fact", "no/such", "a1", check=False)
    assert result.returncode == 1 and "no/such" in result.stderr
    assert "Traceback" not in result.stderr


# --- the HTTP API on a git repository ---------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(repo), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, verdict: str) -> str:
    (repo / "verdict").write_text(f"{verdict}\n")
    _git(repo, "add", "verdict")
    _git(repo, "commit", "-q", "-m", verdict)
    return _git(repo, "rev-parse", "HEAD")


def test_the_api_answers_by_sha_on_a_git_queue(web: WebPipeline) -> None:
    repo = web.root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    web.add_raw_queue(QUEUE, {
        "source_control": {"kind": "git", "repository": str(repo), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "work_dir": str(web.root / "builds"),
                         "command": "grep -qx green verdict"},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
    })
    web.start_web_worker()
    web.wait_healthy()

    shas = []
    for verdict in ("green", "red", "green"):
        shas.append(_commit(repo, verdict))
        assert web.post("/api/queues/gate/main/ingest", token=None).status == 201
        web.wait_quiet()
    one, two, three = shas
    identity = str(repo)

    def uri(sha: str) -> str:
        return f"git+{identity}#main@{sha}"

    by_prefix = web.get("/api/facts?" + urlencode({"queue": QUEUE, "sha": one[:7]}))
    assert by_prefix.status == 200
    assert (by_prefix.body["uri"], by_prefix.body["sha"], by_prefix.body["green"]) == (
        uri(one), one[:7], True)
    by_full = web.get("/api/facts?" + urlencode({"queue": QUEUE, "sha": two}))
    assert (by_full.body["uri"], by_full.body["green"], by_full.body["fact"]["degree"]) == (
        uri(two), False, 1)

    answer = web.get(f"/api/queues/{quote(QUEUE, safe='')}/green?sha={two[:10]}")
    assert answer.status == 200, answer.text
    assert (answer.body["green"], answer.body["uri"]) == (False, uri(two))
    assert answer.body["prior_green"]["uri"] == uri(one)
    assert answer.body["next_green"]["uri"] == uri(three)
    assert answer.body["complete"] is True and answer.body["committed_at"]
    green = web.get(f"/api/queues/gate/main/green?sha={three}").body
    assert (green["green"], green["prior_green"], green["next_green"]) == (True, None, None)

    # the promotion ref's target, read from the repository
    queue = web.get("/api/queues/gate/main").body
    assert queue["promotion_ref"] == {"name": "verified-main", "target": uri(three),
                                      "target_known": True, "pinned": None,
                                      "wanted": uri(three), "differs": False, "problem": None}
    assert _git(repo, "rev-parse", "verified-main") == three

    assert (by_prefix.body["known"], by_full.body["known"], answer.body["known"]) == (
        True, True, True)
    unknown = "0" * 40  # a gate reads `.green` whatever the commit
    missing = web.get(f"/api/queues/gate/main/green?sha={unknown}")
    assert missing.status == 200, missing.text
    assert (missing.body["green"], missing.body["fact"], missing.body["known"],
            missing.body["uri"], missing.body["sha"]) == (False, None, False, uri(unknown),
                                                          unknown)
    assert unknown in missing.body["reason"]
    by_uri = web.get("/api/queues/gate/main/green?" + urlencode({"uri": uri(unknown)}))
    assert (by_uri.status, by_uri.body["green"], by_uri.body["known"]) == (200, False, False)
    assert_error(web.get("/api/queues/gate/main/green?sha=xyz"), 400, "hex digits")
    assert_error(web.get("/api/queues/gate/main/green"), 400, "exactly one")
    assert_error(web.get("/api/queues/gate/main/green?" + urlencode(
        {"sha": one, "uri": uri(one)})), 400, "exactly one")
    assert_error(web.get("/api/queues/no/such/green?sha=" + one), 404, "no/such")
    prefix = web.get("/api/facts?" + urlencode({"queue": QUEUE, "sha": "ffff"}))
    assert prefix.status == 200, prefix.text
    assert (prefix.body["green"], prefix.body["fact"], prefix.body["known"],
            prefix.body["uri"]) == (False, None, False, None)
    assert "no commit" in prefix.body["reason"]
    assert_error(web.get("/api/facts?" + urlencode({"queue": QUEUE, "sha": "xyz"})), 400,
                 "hex digits")
