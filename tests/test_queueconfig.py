"""queues.yaml: loading, defaults, every validation error, queue names, the extensions."""

from __future__ import annotations

import copy
import os
import socket
import string
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from streams.config import settings as settings_mod
from streams.config.queues import (
    DEFAULT_QUEUES_FILE,
    ENV_QUEUES_FILE,
    BackfillSpec,
    Extensions,
    InvalidQueueName,
    QueueConfig,
    QueueConfigError,
    QueuesConfig,
    UnknownQueue,
    load_queues,
    make_build_runner,
    make_source_control,
    queues_file,
    validate_queue_name,
)
from streams.config.retention import RetentionConfig
from streams.config.webhooks import WebhooksConfig
from streams.extensions.buildrunner.command import CommandBuildRunner, CommandBuildRunnerSpec
from streams.extensions.buildrunner.fake import FakeBuildRunner, FakeBuildRunnerSpec
from streams.extensions.sourcecontrol.fake import FakeRepo, FakeSourceControl, FakeSourceControlSpec
from streams.extensions.sourcecontrol.git import GitSourceControl, GitSourceControlSpec

SHIPPED = settings_mod.REPO_ROOT / "queues.yaml"
FAKE_SC = {"kind": "fake", "path": "repo.json", "repo": "demo", "ref": "main"}
FAKE_BR = {"kind": "fake"}
GIT_SC = {"kind": "git", "repository": "monorepo", "ref": "main"}
COMMAND_BR = {"kind": "command", "command": "make test"}

async def _promote(sc: Any, uri: str) -> None:
    """Promote ``uri`` from wherever the promotion ref is now (the compare-and-set's
    expected value read first, as the record stage does)."""
    await sc.promote(uri, expected=await sc.promotion_target())



def _write(tmp_path: Path, doc: Any, name: str = "queues.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def _doc(**queue: Any) -> dict[str, Any]:
    return {"queues": {"q": {"source_control": dict(FAKE_SC), "build_runner": dict(FAKE_BR),
                             **queue}}}


def _problems(tmp_path: Path, doc: Any) -> list[str]:
    with pytest.raises(QueueConfigError) as info:
        load_queues(_write(tmp_path, doc))
    assert str(tmp_path / "queues.yaml") in str(info.value)
    return info.value.problems


# --- the shipped file and the defaults ---------------------------------------------------


def test_the_shipped_file_declares_the_demo_queue() -> None:
    config = load_queues(SHIPPED)
    assert config.names() == ("demo/main",)
    demo = config.get("demo/main")
    assert demo.source_control == FakeSourceControlSpec(
        path=settings_mod.REPO_ROOT / ".stovepipe-demo" / "repo.json", repo="demo",
        ref="main", promotion_ref="verified-main")
    assert demo.build_runner == FakeBuildRunnerSpec(
        state_dir=settings_mod.REPO_ROOT / ".stovepipe-demo" / "builds")
    assert (demo.max_concurrent, demo.gate_delay, demo.poll_delay_queued,
            demo.poll_delay_running, demo.poll_deadline) == (
        1, timedelta(seconds=1), timedelta(seconds=5), timedelta(seconds=2),
        timedelta(hours=1))


def test_the_file_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_QUEUES_FILE, raising=False)
    assert queues_file() == DEFAULT_QUEUES_FILE == SHIPPED
    path = _write(tmp_path, _doc(), name="elsewhere.yaml")
    monkeypatch.setenv(ENV_QUEUES_FILE, str(path))
    assert queues_file() == path
    assert load_queues().names() == ("q",)
    assert load_queues().path == path


def test_built_in_defaults_apply(tmp_path: Path) -> None:
    queue = load_queues(_write(tmp_path, _doc())).get("q")
    assert queue == QueueConfig(
        name="q",
        source_control=FakeSourceControlSpec(tmp_path.resolve() / "repo.json", "demo", "main"),
        build_runner=FakeBuildRunnerSpec(None),
    )
    assert (queue.max_concurrent, queue.gate_delay, queue.poll_delay_queued,
            queue.poll_delay_running, queue.poll_deadline) == (
        1, timedelta(seconds=1), timedelta(seconds=5), timedelta(seconds=2),
        timedelta(hours=1))


def test_defaults_section_then_queue_entries_override(tmp_path: Path) -> None:
    doc = {
        "defaults": {"max_concurrent": 3, "gate_delay": "250ms", "poll_deadline": "10m",
                     "source_control": dict(FAKE_SC), "build_runner": {"kind": "fake",
                                                                       "state_dir": "b"}},
        "queues": {
            "plain": None,
            "own": {"max_concurrent": 1, "poll_delay_running": "1m30s",
                    "source_control": {**FAKE_SC, "ref": "dev", "path": "/abs/r.json",
                                       "promotion_ref": "verified-dev"},
                    "build_runner": {"kind": "fake"}},
        },
    }
    config = load_queues(_write(tmp_path, doc))
    assert config.names() == ("plain", "own")
    plain, own = config.get("plain"), config.get("own")
    assert (plain.max_concurrent, plain.gate_delay, plain.poll_deadline,
            plain.poll_delay_running) == (3, timedelta(milliseconds=250),
                                          timedelta(minutes=10), timedelta(seconds=2))
    assert plain.source_control.path == tmp_path.resolve() / "repo.json"
    assert plain.build_runner.state_dir == tmp_path.resolve() / "b"
    assert (own.max_concurrent, own.gate_delay, own.poll_delay_running) == (
        1, timedelta(milliseconds=250), timedelta(seconds=90))
    # an extension spec is replaced whole, never merged key by key
    assert own.source_control == FakeSourceControlSpec(Path("/abs/r.json"), "demo", "dev",
                                                       "verified-dev")
    assert own.build_runner == FakeBuildRunnerSpec(None)


def test_relative_paths_do_not_depend_on_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    _write(tmp_path / "conf", _doc())
    monkeypatch.chdir(tmp_path)
    queue = load_queues("conf/queues.yaml").get("q")
    assert queue.source_control.path == tmp_path.resolve() / "conf" / "repo.json"
    assert queue.source_control.path.is_absolute()


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(("doc", "expected"), [
    ("- a list", "expected a mapping with 'queues'"),
    ("", "expected a mapping with 'queues'"),
    ({"queues": {}}, "queues: declare at least one queue"),
    ({"defaults": {}}, "queues: declare at least one queue"),
    ({"queues": ["q"]}, "queues: expected a mapping, got list"),
    ({**_doc(), "extra": 1}, "(top level): unknown field 'extra'"),
    ({**_doc(), "defaults": {"max_concurent": 2}}, "defaults: unknown field 'max_concurent'"),
    ({**_doc(), "defaults": "x"}, "defaults: expected a mapping, got str"),
    (_doc(colour="red"), "queues.q: unknown field 'colour'"),
    ({"queues": {"q": "x"}}, "queues.q: expected a mapping, got str"),
    ({"queues": {"bad name": {}}}, "queues.bad name: invalid queue name 'bad name'"),
    ({"queues": {"a//b": {}}}, "queues.a//b: invalid queue name 'a//b': it contains '//'"),
    ({"queues": {7: {}}}, "queues.7: a queue name is a string, got 7"),
    (_doc(max_concurrent=0), "queues.q.max_concurrent: must be a positive integer, got 0"),
    (_doc(max_concurrent=-1), "queues.q.max_concurrent: must be a positive integer"),
    (_doc(max_concurrent="2"), "queues.q.max_concurrent: must be a positive integer"),
    (_doc(max_concurrent=True), "queues.q.max_concurrent: must be a positive integer"),
    (_doc(max_concurrent=1.5), "queues.q.max_concurrent: must be a positive integer"),
    (_doc(gate_delay=5), "queues.q.gate_delay: expected a duration such as 1s or 2m, got 5"),
    (_doc(poll_delay_queued="fast"), "queues.q.poll_delay_queued: expected a duration"),
    (_doc(poll_delay_running="0s"), "queues.q.poll_delay_running: must be longer than zero"),
    (_doc(poll_deadline="1w"), "queues.q.poll_deadline: expected a duration"),
    ({**_doc(), "defaults": {"gate_delay": "x"}}, "defaults.gate_delay: expected a duration"),
    ({"queues": {"q": {"build_runner": FAKE_BR}}}, "queues.q: missing 'source_control'"),
    ({"queues": {"q": {"source_control": FAKE_SC}}}, "queues.q: missing 'build_runner'"),
    (_doc(source_control="git"), "queues.q.source_control: expected a source_control mapping"),
    (_doc(source_control={"path": "r.json"}), "queues.q.source_control: missing 'kind'"),
    (_doc(source_control={**FAKE_SC, "kind": "svn"}),
     "queues.q.source_control.kind: unknown source_control kind 'svn'; expected one of "
     "['fake', 'git']"),
    (_doc(source_control={**FAKE_SC, "remote": "x"}),
     "queues.q.source_control: unknown field 'remote'"),
    (_doc(source_control={"kind": "fake"}), "queues.q.source_control: missing 'path'"),
    (_doc(source_control={"kind": "fake", "path": "p", "ref": "main"}),
     "queues.q.source_control: missing 'repo'"),
    (_doc(source_control={"kind": "fake", "path": "p", "repo": "r"}),
     "queues.q.source_control: missing 'ref'"),
    (_doc(source_control={**FAKE_SC, "path": ""}),
     "queues.q.source_control.path: expected a non-empty string"),
    (_doc(source_control={**FAKE_SC, "ref": 3}),
     "queues.q.source_control.ref: expected a non-empty string"),
    (_doc(source_control={**FAKE_SC, "ref": " main"}),
     "queues.q.source_control.ref: expected a non-empty string without surrounding spaces"),
    (_doc(source_control={**FAKE_SC, "repo": "a/b"}),
     "queues.q.source_control.repo: must be letters, digits"),
    (_doc(source_control={**FAKE_SC, "promotion_ref": "main"}),
     "queues.q.source_control.promotion_ref: must differ from ref 'main'"),
    (_doc(build_runner={"kind": "jenkins"}),
     "queues.q.build_runner.kind: unknown build_runner kind 'jenkins'; expected one of "
     "['fake', 'command', 'buildkite', 'github_actions']"),
    (_doc(build_runner={}), "queues.q.build_runner: missing 'kind'"),
    (_doc(build_runner=None), "queues.q.build_runner: expected a build_runner mapping"),
    (_doc(build_runner={"kind": "fake", "state_dir": ["x"]}),
     "queues.q.build_runner.state_dir: expected a non-empty string"),
    (_doc(build_runner={"kind": "fake", "script": "x"}),
     "queues.q.build_runner: unknown field 'script'"),
    ("queues: [unclosed", "not valid YAML"),
])
def test_each_problem_is_reported_with_its_yaml_path(tmp_path: Path, doc: Any,
                                                     expected: str) -> None:
    problems = _problems(tmp_path, doc)
    assert any(expected in p for p in problems), problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    doc = {
        "defaults": {"gate_delay": "soon"},
        "queues": {
            "a": {"max_concurrent": 0, "source_control": {"kind": "svn"},
                  "build_runner": FAKE_BR},
            "b/": {},
            "c": {"poll_deadline": "-1s", "source_control": FAKE_SC,
                  "build_runner": {"kind": "jenkins"}},
        },
    }
    problems = _problems(tmp_path, doc)
    wheres = [p.partition(": ")[0] for p in problems]
    assert sorted(wheres) == [
        "defaults.gate_delay",  # once, not once per queue
        "queues.a.max_concurrent",
        "queues.a.source_control.kind",
        "queues.b/",
        "queues.c.build_runner.kind",
        "queues.c.poll_deadline",
    ]


def test_a_bad_default_is_reported_even_where_every_queue_overrides_it(tmp_path: Path) -> None:
    doc = _doc(gate_delay="1s", build_runner=FAKE_BR)
    doc["defaults"] = {"gate_delay": "later", "build_runner": {"kind": "jenkins"}}
    assert sorted(p.partition(": ")[0] for p in _problems(tmp_path, doc)) == [
        "defaults.build_runner.kind", "defaults.gate_delay"]


def test_an_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(QueueConfigError, match="cannot read") as info:
        load_queues(missing)
    assert info.value.path == missing
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(QueueConfigError, match="not UTF-8"):
        load_queues(tmp_path / "bin.yaml")


# --- unknown queues and the extensions -----------------------------------------------------


def test_an_unknown_queue_names_itself_the_file_and_the_known_queues(tmp_path: Path) -> None:
    path = _write(tmp_path, {"queues": {n: _doc()["queues"]["q"] for n in ("a/main", "b")}})
    config = load_queues(path)
    with pytest.raises(UnknownQueue) as info:
        config.get("c/main")
    message = str(info.value)
    assert "'c/main'" in message and str(path) in message
    assert "a/main, b" in message and ENV_QUEUES_FILE in message
    assert (info.value.queue, info.value.path, info.value.known) == ("c/main", path,
                                                                     ("a/main", "b"))
    assert not info.value.retryable


def test_an_unknown_queue_among_many_does_not_list_them_all() -> None:
    known = tuple(f"q{n}" for n in range(50))
    message = str(UnknownQueue("x", Path("/etc/queues.yaml"), known))
    assert "declares 50 others" in message and "q17" not in message


def test_extensions_are_built_once_per_queue(tmp_path: Path) -> None:
    doc = _doc(build_runner={"kind": "fake", "state_dir": "builds"})
    doc["queues"]["r"] = copy.deepcopy(doc["queues"]["q"])
    doc["queues"]["r"]["source_control"]["promotion_ref"] = "verified"
    extensions = Extensions(load_queues(_write(tmp_path, doc)), None)
    sc = extensions.source_control("q")
    assert isinstance(sc, FakeSourceControl)
    assert extensions.source_control("q") is sc
    assert extensions.source_control("r") is not sc
    runner = extensions.build_runner("q")
    assert isinstance(runner, FakeBuildRunner)
    assert runner.state_dir == tmp_path.resolve() / "builds"
    assert extensions.build_runner("q") is runner
    with pytest.raises(UnknownQueue):
        extensions.source_control("zzz")
    with pytest.raises(UnknownQueue):
        extensions.build_runner("zzz")


def test_the_made_source_control_reads_the_configured_file(tmp_path: Path) -> None:
    import asyncio

    doc = _doc(source_control={**FAKE_SC, "promotion_ref": "verified"})
    queue = load_queues(_write(tmp_path, doc)).get("q")
    repo = FakeRepo(tmp_path / "repo.json")
    repo.push("main", "a1")
    sc = make_source_control(queue)
    head = asyncio.run(sc.head())
    assert head == FakeRepo.uri("demo", "main", "a1")
    asyncio.run(_promote(sc, head))
    assert repo.promoted("verified") == "a1"
    assert isinstance(make_build_runner(queue), FakeBuildRunner)


def test_a_config_built_by_hand() -> None:
    queue = QueueConfig("q", FakeSourceControlSpec(Path("r.json"), "demo", "main"),
                        FakeBuildRunnerSpec())
    config = QueuesConfig(Path("inline"), {"q": queue})
    assert config.get("q") is queue and config.names() == ("q",)


# --- git and command --------------------------------------------------------------------------


def test_the_shipped_file_s_commented_git_example_is_valid(tmp_path: Path) -> None:
    lines = SHIPPED.read_text().splitlines()
    start = lines.index("  # monorepo/main:")
    example = [line.replace("# ", "", 1) for line in lines[start:] if line.startswith("  # ")]
    path = tmp_path / "queues.yaml"
    path.write_text("queues:\n" + "\n".join(example) + "\n")
    queue = load_queues(path).get("monorepo/main")
    assert queue.source_control == GitSourceControlSpec(
        repository="git@github.com:acme/monorepo.git", ref="main",
        promotion_ref="verified-main", push=True,
        cache_dir=Path("/var/cache/stovepipe/git"))
    assert queue.build_runner == CommandBuildRunnerSpec(
        command="make ci", repository="/srv/mirrors/monorepo.git",
        work_dir=Path("/var/lib/stovepipe/builds/monorepo"), max_parallel=2,
        timeout=timedelta(minutes=45), host_timeout=timedelta(seconds=60))


def test_a_git_source_control_and_a_command_runner_with_their_defaults(tmp_path: Path) -> None:
    queue = load_queues(_write(tmp_path, _doc(source_control=GIT_SC,
                                              build_runner=COMMAND_BR))).get("q")
    local = str(tmp_path.resolve() / "monorepo")  # relative to the file's directory
    assert queue.source_control == GitSourceControlSpec(repository=local, ref="main")
    assert queue.source_control.push is None and queue.source_control.cache_dir is None
    # the runner builds the queue's repository unless told otherwise
    assert queue.build_runner == CommandBuildRunnerSpec(command="make test", repository=local)
    assert (queue.build_runner.work_dir, queue.build_runner.max_parallel,
            queue.build_runner.timeout) == (None, 2, None)


def test_git_and_command_settings(tmp_path: Path) -> None:
    doc = _doc(source_control={**GIT_SC, "repository": "git@github.com:acme/mono.git",
                               "promotion_ref": "verified-main", "push": False,
                               "cache_dir": "cache"},
               build_runner={**COMMAND_BR, "command": "make test\nmake lint\n",
                             "repository": "https://mirror.example/mono.git",
                             "work_dir": "~/builds", "max_parallel": 4, "timeout": "20m"})
    queue = load_queues(_write(tmp_path, doc)).get("q")
    assert queue.source_control == GitSourceControlSpec(
        repository="git@github.com:acme/mono.git", ref="main", promotion_ref="verified-main",
        push=False, cache_dir=tmp_path.resolve() / "cache")
    assert queue.build_runner == CommandBuildRunnerSpec(
        command="make test\nmake lint\n", repository="https://mirror.example/mono.git",
        work_dir=Path("~/builds").expanduser(), max_parallel=4,
        timeout=timedelta(minutes=20))


def test_a_command_runner_in_defaults_takes_each_queue_s_repository(tmp_path: Path) -> None:
    doc = {"defaults": {"build_runner": COMMAND_BR},
           "queues": {"a": {"source_control": {**GIT_SC, "repository": "/srv/a"}},
                      "b": {"source_control": {**GIT_SC, "repository": "file:///srv/b.git"}}}}
    config = load_queues(_write(tmp_path, doc))
    assert config.get("a").build_runner == CommandBuildRunnerSpec("make test", "/srv/a")
    assert config.get("b").build_runner == CommandBuildRunnerSpec("make test",
                                                                  "file:///srv/b.git")


@pytest.mark.parametrize(("doc", "expected"), [
    (_doc(source_control={"kind": "git", "ref": "main"}),
     "queues.q.source_control: missing 'repository'"),
    (_doc(source_control={"kind": "git", "repository": "r"}),
     "queues.q.source_control: missing 'ref'"),
    (_doc(source_control={**GIT_SC, "repository": ""}),
     "queues.q.source_control.repository: expected a non-empty string"),
    (_doc(source_control={**GIT_SC, "ref": "refs/heads/main"}),
     "queues.q.source_control.ref: invalid branch name 'refs/heads/main': give the branch "
     "name without 'refs/"),
    (_doc(source_control={**GIT_SC, "ref": "a..b"}),
     "queues.q.source_control.ref: invalid branch name 'a..b'"),
    (_doc(source_control={**GIT_SC, "ref": "my branch"}),
     "queues.q.source_control.ref: invalid branch name 'my branch': it contains ' '"),
    (_doc(source_control={**GIT_SC, "promotion_ref": "v#1"}),
     "queues.q.source_control.promotion_ref: invalid branch name 'v#1': it contains '#'"),
    (_doc(source_control={**GIT_SC, "promotion_ref": "main"}),
     "queues.q.source_control.promotion_ref: must differ from ref 'main'"),
    (_doc(source_control={**GIT_SC, "push": "yes"}),
     "queues.q.source_control.push: expected true or false, got 'yes'"),
    (_doc(source_control={**GIT_SC, "cache_dir": 3}),
     "queues.q.source_control.cache_dir: expected a non-empty string"),
    (_doc(source_control={**GIT_SC, "path": "repo.json"}),
     "queues.q.source_control: unknown field 'path'"),
    (_doc(source_control=GIT_SC, build_runner={"kind": "command"}),
     "queues.q.build_runner: missing 'command'"),
    (_doc(source_control=GIT_SC, build_runner={"kind": "command", "command": "  "}),
     "queues.q.build_runner.command: expected a non-empty shell command"),
    (_doc(source_control=GIT_SC, build_runner={"kind": "command", "command": ["make"]}),
     "queues.q.build_runner.command: expected a non-empty shell command"),
    (_doc(source_control=GIT_SC, build_runner={**COMMAND_BR, "max_parallel": 0}),
     "queues.q.build_runner.max_parallel: must be a positive integer, got 0"),
    (_doc(source_control=GIT_SC, build_runner={**COMMAND_BR, "timeout": "soon"}),
     "queues.q.build_runner.timeout: expected a duration"),
    (_doc(source_control=GIT_SC, build_runner={**COMMAND_BR, "timeout": "0s"}),
     "queues.q.build_runner.timeout: must be longer than zero"),
    (_doc(source_control=GIT_SC, build_runner={**COMMAND_BR, "work_dir": ""}),
     "queues.q.build_runner.work_dir: expected a non-empty string"),
    (_doc(source_control=GIT_SC, build_runner={**COMMAND_BR, "state_dir": "x"}),
     "queues.q.build_runner: unknown field 'state_dir'"),
    (_doc(build_runner=COMMAND_BR),
     "queues.q.build_runner: the command build_runner has no 'repository' and the queue's "
     "source_control is kind 'fake', not git: set its repository"),
    ({"defaults": {"build_runner": COMMAND_BR}, "queues": {"q": {"source_control": FAKE_SC}}},
     "queues.q: the command build_runner (from defaults) has no 'repository'"),
])
def test_each_git_and_command_problem_is_reported(tmp_path: Path, doc: Any,
                                                  expected: str) -> None:
    problems = _problems(tmp_path, doc)
    assert any(expected in p for p in problems), problems


def test_a_command_runner_beside_a_fake_source_control_names_its_repository(
        tmp_path: Path) -> None:
    doc = _doc(build_runner={**COMMAND_BR, "repository": "https://example.com/r.git"})
    queue = load_queues(_write(tmp_path, doc)).get("q")
    assert queue.build_runner == CommandBuildRunnerSpec("make test",
                                                        "https://example.com/r.git")


def test_the_made_git_source_control_and_command_runner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings_mod.ENV_HOME, str(tmp_path / "home"))
    monkeypatch.delenv(settings_mod.ENV_HOST_ID, raising=False)
    doc = _doc(source_control={**GIT_SC, "repository": "https://example.com/mono.git",
                               "promotion_ref": "verified", "cache_dir": "cache"},
               build_runner={**COMMAND_BR, "timeout": "90s"})
    doc["queues"]["mono/main"] = {"source_control": {**GIT_SC, "repository": "/srv/mono"},
                                  "build_runner": {**COMMAND_BR, "max_parallel": 3,
                                                   "work_dir": "/var/builds",
                                                   "host_timeout": "15s"}}
    extensions = Extensions(load_queues(_write(tmp_path, doc)), None)

    remote = extensions.source_control("q")
    assert isinstance(remote, GitSourceControl)
    assert (remote.repository, remote.ref, remote.promotion_ref, remote.push) == (
        "https://example.com/mono.git", "main", "verified", True)  # remote: pushed
    assert remote.repo.cache_path is not None
    assert remote.repo.cache_path.parent == tmp_path.resolve() / "cache"
    runner = extensions.build_runner("q")
    assert isinstance(runner, CommandBuildRunner)
    assert (runner.command, runner.repo.repository, runner.queue, runner.max_parallel,
            runner.timeout) == ("make test", "https://example.com/mono.git", "q", 2, 90.0)
    assert runner.work_dir == tmp_path / "home" / "builds" / "q"
    assert runner.repo.cache_path == remote.repo.cache_path  # one cache, fetched once
    # the host: this machine and this home, unless STOVEPIPE_HOST_ID says otherwise
    assert (runner.host, runner.host_timeout, runner.database) == (
        f"{socket.gethostname()}:{(tmp_path / 'home').resolve()}", 60.0, None)

    local = extensions.source_control("mono/main")
    assert isinstance(local, GitSourceControl) and local.push is False  # updated in place
    runner = extensions.build_runner("mono/main")
    assert isinstance(runner, CommandBuildRunner)
    assert (runner.repo.repository, runner.work_dir, runner.max_parallel, runner.timeout,
            runner.host_timeout) == ("/srv/mono", Path("/var/builds"), 3, None, 15.0)
    monkeypatch.setenv(settings_mod.ENV_HOST_ID, "  builder-7 ")
    explicit = Extensions(load_queues(_write(tmp_path, doc)), None).build_runner("q")
    assert isinstance(explicit, CommandBuildRunner) and explicit.host == "builder-7"


def test_a_command_runner_without_a_database_says_so(tmp_path: Path) -> None:
    import asyncio

    from streams.extensions.buildrunner import BuildRunnerError

    runner = CommandBuildRunner("true", str(tmp_path), tmp_path / "work", database=None,
                                host="")
    for call in (runner.trigger(None, "git+file:///r#main@" + "a" * 40, {}),
                 runner.status("cmd-" + "0" * 32), runner.cancel("cmd-" + "0" * 32),
                 runner.tend()):
        with pytest.raises(BuildRunnerError, match="without a database") as info:
            asyncio.run(call)
        assert not info.value.retryable


@pytest.mark.postgres
def test_a_git_queue_validates_a_real_commit(tmp_path: Path, migrated_dsn: str) -> None:
    import asyncio
    import subprocess

    from store import Database
    from store.entities import BuildStatus
    from tests.waiting import wait_until_async

    def git(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                               "-C", str(tmp_path / "mono"), *args], env=env, check=True,
                              capture_output=True, text=True).stdout.strip()

    (tmp_path / "mono").mkdir()
    git("init", "-q", "-b", "main")
    git("commit", "-q", "--allow-empty", "-m", "c1")
    doc = _doc(source_control={**GIT_SC, "repository": "mono",
                               "promotion_ref": "verified-main"},
               build_runner={**COMMAND_BR, "command": 'test "$(git rev-parse HEAD)" = '
                                                     '"$STOVEPIPE_HEAD_SHA"',
                             "work_dir": "builds"})

    async def validate() -> BuildStatus:
        async with await Database.open(migrated_dsn, max_size=2) as db:
            extensions = Extensions(load_queues(_write(tmp_path, doc)), db)
            source_control, runner = extensions.source_control("q"), extensions.build_runner("q")
            head = await source_control.head()
            build_id = await runner.trigger(None, head, {"queue": "q"})

            async def over() -> bool:
                return (await runner.status(build_id)).status.is_terminal

            await wait_until_async(over, within=30, what="the build")
            await _promote(source_control, head)
            return (await runner.status(build_id)).status

    assert asyncio.run(validate()) is BuildStatus.SUCCEEDED
    assert git("rev-parse", "verified-main") == git("rev-parse", "main")


def test_the_default_work_dir_is_per_queue(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings_mod.ENV_HOME, str(tmp_path))
    config = QueuesConfig(Path("inline"), {
        name: QueueConfig(name, GitSourceControlSpec("/srv/r", "main"),
                          CommandBuildRunnerSpec("true"))
        for name in ("mono/main", "x/../y")})
    made = [make_build_runner(config.get(name)) for name in config.names()]
    assert [r.work_dir for r in made if isinstance(r, CommandBuildRunner)] == [
        tmp_path / "builds" / "mono" / "main", tmp_path / "builds" / "x" / "_.." / "y"]


def test_a_hand_built_command_runner_without_a_repository_is_refused() -> None:
    queue = QueueConfig("q", FakeSourceControlSpec(Path("r.json"), "demo", "main"),
                        CommandBuildRunnerSpec("true"))
    with pytest.raises(ValueError, match="needs 'repository'"):
        make_build_runner(queue)


# --- queue names -----------------------------------------------------------------------------

_FIRST = string.ascii_letters + string.digits
_REST = _FIRST + "._-/"


@st.composite
def valid_names(draw: st.DrawFn) -> str:
    first = draw(st.sampled_from(_FIRST))
    rest = draw(st.text(alphabet=_REST, max_size=199))
    name = first + rest
    while "//" in name:
        name = name.replace("//", "/")
    return name.rstrip("/")


@given(valid_names())
def test_valid_names_are_accepted(name: str) -> None:
    assert validate_queue_name(name) == name


@given(valid_names(), st.characters().filter(lambda c: c not in _REST), st.data())
def test_a_forbidden_character_anywhere_is_rejected(name: str, bad: str,
                                                    data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(name)))
    spoiled = name[:at] + bad + name[at:]
    with pytest.raises(InvalidQueueName, match="invalid queue name"):
        validate_queue_name(spoiled)


@given(valid_names(), st.data())
def test_a_double_slash_anywhere_is_rejected(name: str, data: st.DataObject) -> None:
    at = data.draw(st.integers(1, len(name)))
    with pytest.raises(InvalidQueueName):
        validate_queue_name(name[:at] + "//" + name[at:])


@given(valid_names(), st.sampled_from("._-/"))
def test_names_start_with_a_letter_or_digit_and_do_not_end_in_a_slash(name: str,
                                                                       lead: str) -> None:
    with pytest.raises(InvalidQueueName, match="not a letter or digit"):
        validate_queue_name(lead + name)
    with pytest.raises(InvalidQueueName, match="ends in '/'"):
        validate_queue_name(name + "/")


@pytest.mark.parametrize(("name", "reason"), [
    ("", "it is empty"),
    ("a" * 201, "it is 201 characters long"),
    ("a b", "it contains ' '"),
    ("mono\u00e9/main", "it contains '\u00e9'"),
    ("mono/main\n", "it contains '\\n'"),
    ("/main", "it starts with '/'"),
    ("a//b", "it contains '//'"),
    ("a/", "it ends in '/'"),
])
def test_the_message_says_why(name: str, reason: str) -> None:
    with pytest.raises(InvalidQueueName) as info:
        validate_queue_name(name)
    assert reason in str(info.value)
    assert "1-200 characters" in str(info.value)


def test_limits_and_non_strings() -> None:
    assert validate_queue_name("a" * 200) == "a" * 200
    assert validate_queue_name("monorepo/main") == "monorepo/main"
    assert validate_queue_name("a.b_c-d/0/.x") == "a.b_c-d/0/.x"
    with pytest.raises(InvalidQueueName, match="is a string"):
        validate_queue_name(None)
    with pytest.raises(InvalidQueueName, match=r"'bbbb*'\.\.\. \(500 chars\)"):
        validate_queue_name("b" * 500)


# --- push webhooks: the webhooks section and which queues a push moves ----------------------


def test_the_shipped_file_s_commented_webhooks_section_is_valid(tmp_path: Path) -> None:
    lines = SHIPPED.read_text().splitlines()
    start = lines.index("# webhooks:")
    section = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        section.append(line[2:])
    doc = yaml.safe_load("\n".join(section))
    config = load_queues(_write(tmp_path, {**doc, **_doc()}))
    assert config.webhooks == WebhooksConfig(
        github_secret_env="STOVEPIPE_GITHUB_WEBHOOK_SECRET",
        gitlab_token_env="STOVEPIPE_GITLAB_WEBHOOK_TOKEN")
    assert load_queues(SHIPPED).webhooks == WebhooksConfig()  # off until uncommented


def test_webhook_secrets_come_from_the_variables_the_file_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = {"webhooks": {"github": {"secret_env": "HOOK_SECRET"}}, **_doc()}
    webhooks = load_queues(_write(tmp_path, doc)).webhooks
    assert (webhooks.secret_env("github"), webhooks.secret_env("gitlab")) == (
        "HOOK_SECRET", None)
    monkeypatch.delenv("HOOK_SECRET", raising=False)
    assert webhooks.secret("github") is None
    monkeypatch.setenv("HOOK_SECRET", "  ")
    assert webhooks.secret("github") is None
    monkeypatch.setenv("HOOK_SECRET", "s3cret")
    assert webhooks.secret("github") == "s3cret"
    assert webhooks.secret("gitlab") is None
    assert "s3cret" not in repr(webhooks)


@pytest.mark.parametrize(("webhooks", "expected"), [
    ("x", "webhooks: expected a mapping, got str"),
    ({"bitbucket": {}}, "webhooks: unknown field 'bitbucket'"),
    ({"github": {}}, "webhooks.github: missing 'secret_env', e.g. "
                     "STOVEPIPE_GITHUB_WEBHOOK_SECRET"),
    ({"gitlab": {"secret_env": "X"}}, "webhooks.gitlab: unknown field 'secret_env'; "
                                      "expected one of ['token_env']"),
    ({"github": {"secret_env": "1ABC"}}, "webhooks.github.secret_env: expected the NAME of an "
                                          "environment variable"),
    ({"gitlab": {"token_env": 7}}, "webhooks.gitlab.token_env: expected the NAME"),
])
def test_each_webhooks_problem_is_reported(tmp_path: Path, webhooks: Any,
                                           expected: str) -> None:
    problems = _problems(tmp_path, {"webhooks": webhooks, **_doc()})
    assert any(expected in p for p in problems), problems


def test_a_secret_written_in_place_of_its_variable_is_not_repeated(tmp_path: Path) -> None:
    secret = "hunter2 is my-secret"
    problems = _problems(tmp_path, {"webhooks": {"github": {"secret_env": secret}},
                                    **_doc()})
    assert problems and all(secret not in p for p in problems), problems
    assert "the secret itself belongs in that variable" in problems[0]


@pytest.mark.parametrize(("value", "expected"), [
    ("monorepo", "queues.q.webhook_repository: expected the repository's path as GitHub or "
                 "GitLab names it"),
    ("acme/", "queues.q.webhook_repository: expected"),
    ("https://github.com/acme/monorepo", "queues.q.webhook_repository: expected"),
    (3, "queues.q.webhook_repository: expected"),
])
def test_a_bad_webhook_repository_is_reported(tmp_path: Path, value: Any,
                                              expected: str) -> None:
    problems = _problems(tmp_path, _doc(webhook_repository=value))
    assert any(expected in p for p in problems), problems


def test_which_queues_a_push_moves(tmp_path: Path) -> None:
    doc = {
        "defaults": {"build_runner": FAKE_BR},
        "queues": {
            "ssh/main": {"source_control": {**GIT_SC, "repository":
                                            "git@github.com:Acme/Monorepo.git"}},
            "https/main": {"source_control": {**GIT_SC, "repository":
                                              "https://tok@github.com/acme/monorepo.git"}},
            "https/release": {"source_control": {**GIT_SC, "ref": "release",
                                                 "repository":
                                                 "https://github.com/acme/monorepo"}},
            "mirror/main": {"source_control": {**GIT_SC, "repository": "/srv/mirror.git"},
                            "webhook_repository": "acme/monorepo"},
            "local/main": {"source_control": {**GIT_SC, "repository": "/srv/mirror.git"}},
            "fake/main": {"source_control": FAKE_SC, "webhook_repository": "acme/monorepo"},
            "fake/plain": {"source_control": FAKE_SC},
            "renamed/main": {"source_control": {**GIT_SC, "repository":
                                                "git@github.com:acme/old-name.git"},
                             "webhook_repository": "acme/new-name"},
            "gitlab/main": {"source_control": {**GIT_SC, "repository":
                                               "ssh://git@gitlab.example.com:2222/group/"
                                               "sub/project.git"}},
        },
    }
    config = load_queues(_write(tmp_path, doc))
    assert config.watching("acme/monorepo", "main") == (
        "ssh/main", "https/main", "mirror/main", "fake/main")
    assert config.watching("ACME/monorepo", "main") == config.watching("acme/monorepo", "main")
    assert config.watching("acme/monorepo", "release") == ("https/release",)
    assert config.watching("acme/monorepo", "Main") == ()  # branches are case-sensitive
    assert config.watching("acme/monorepo", "feature") == ()
    assert config.watching("acme/new-name", "main") == ("renamed/main",)
    assert config.watching("acme/old-name", "main") == ()  # the override replaces the URL
    assert config.watching("group/sub/project", "main") == ("gitlab/main",)
    assert config.watching("sub/project", "main") == ()
    assert config.get("local/main").hosted_repository() is None
    assert config.get("fake/plain").hosted_repository() is None
    assert config.get("https/main").hosted_repository() == "acme/monorepo"  # no token


def test_a_webhook_repository_in_defaults_is_inherited(tmp_path: Path) -> None:
    doc = _doc()
    doc["defaults"] = {"webhook_repository": "acme/demo"}
    doc["queues"]["own"] = {**doc["queues"]["q"], "webhook_repository": "acme/own"}
    config = load_queues(_write(tmp_path, doc))
    assert config.get("q").webhook_repository == "acme/demo"
    assert config.watching("acme/demo", "main") == ("q",)
    assert config.watching("acme/own", "main") == ("own",)


# --- backfill (culprit finding) -------------------------------------------------------------


def test_backfill_is_off_unless_asked_and_has_a_shorthand(tmp_path: Path) -> None:
    assert not load_queues(_write(tmp_path, _doc())).get("q").backfill.enabled
    written = ("defaults: {backfill: bisect}\nqueues:\n"
               "  a: {source_control: {kind: fake, path: r.json, repo: d, ref: main},"
               " build_runner: {kind: fake}}\n"
               "  b: {source_control: {kind: fake, path: r.json, repo: d, ref: main},"
               " build_runner: {kind: fake}, backfill: off}\n"
               "  c: {source_control: {kind: fake, path: r.json, repo: d, ref: main},"
               " build_runner: {kind: fake}, backfill: {mode: bisect, max_builds: 3}}\n")
    queues = load_queues(_write(tmp_path, written))
    assert queues.get("a").backfill == BackfillSpec(mode="bisect")
    assert queues.get("b").backfill == BackfillSpec(mode="off")  # YAML's bare off is false
    assert queues.get("c").backfill == BackfillSpec(mode="bisect", max_builds=3)
    assert queues.get("c").backfill.max_concurrent == 1
    # a commit whose probe could not validate is probed again after 5 min, doubling, and
    # passed by after 5 such probes
    assert (queues.get("c").backfill.unvalidated_probes,
            queues.get("c").backfill.probe_backoff) == (5, timedelta(minutes=5))


def test_backfill_mistakes_are_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, _doc(backfill="always"))
    assert problems == ["queues.q.backfill.mode: expected one of bisect, off, got 'always'"]
    problems = _problems(tmp_path, _doc(backfill={"mode": "bisect", "max_builds": 0,
                                                  "budget": 3}))
    assert any(p.startswith("queues.q.backfill.max_builds:") for p in problems), problems
    assert any("budget" in p for p in problems), problems
    problems = _problems(tmp_path, _doc(backfill={"mode": "bisect", "unvalidated_probes": 0,
                                                  "probe_backoff": "soon"}))
    assert any(p.startswith("queues.q.backfill.unvalidated_probes:") for p in problems)
    assert any(p.startswith("queues.q.backfill.probe_backoff:") for p in problems), problems


# --- retention (issue 25, item 6) ---------------------------------------------------------


@pytest.mark.parametrize(("section", "expected"), [
    (None, None),  # off unless asked for
    (False, None),  # `retention: off`
    ({"older_than": "90d", "keep_newest": 20, "every": "30m", "max_rows": 5000,
      "duty_cycle": 1, "batch_rows": 200},
     RetentionConfig(timedelta(days=90), 20, timedelta(minutes=30), 5000, 1.0, 200)),
    ({}, RetentionConfig()),
    (True, RetentionConfig(older_than=timedelta(days=180), keep_newest=100,
                           every=timedelta(hours=1), max_rows=100_000, duty_cycle=0.25)),
])
def test_retention_is_off_unless_configured(tmp_path: Path, section: Any,
                                            expected: RetentionConfig | None) -> None:
    doc = {**_doc(), **({"retention": section} if section is not None else {})}
    assert load_queues(_write(tmp_path, doc)).retention == expected


@pytest.mark.parametrize(("section", "expected"), [
    ({"older_than": "12h"}, "retention.older_than: must be at least 1d (1 day), got 12h"),
    ({"older_than": "5x"}, "retention.older_than: expected a duration"),
    ({"keep_newest": 0}, "retention.keep_newest: must be a positive integer, got 0"),
    ({"every": "0s"}, "retention.every: must be longer than zero"),
    ({"duty_cycle": 0}, "retention.duty_cycle: must be a positive number, got 0"),
    ({"batch_rows": 0}, "retention.batch_rows: must be a positive integer, got 0"),
    ({"duty_cycle": 1.5}, "retention.duty_cycle: must be a share of time above 0 and at "
                          "most 1 (e.g. 0.25), got 1.5"),
    ({"duty_cycle": "half"}, "retention.duty_cycle: must be a positive number, got 'half'"),
    ({"older": "180d"}, "retention: unknown field 'older'"),
])
def test_a_bad_retention_names_the_field(tmp_path: Path, section: Any, expected: str) -> None:
    problems = _problems(tmp_path, {**_doc(), "retention": section})
    assert any(expected in p for p in problems), problems
