"""Issue 24, item 2 as pure logic: which paths a project's rules match (checked against
git's own reading of the same pathspecs, `git ls-files -- ':(glob)…'`), and which
projects a head affects (`streams.stages.affected`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.stages.affected import Base, Changes, PathRules, plan_projects

DIRS = ["services", "services/api", "services/api/v1", "libs", "libs/common", "web",
        "web/docs", "docs", "docs/api"]
FILES = ["main.go", "README.md", "a.js", "b.py", "index.html", "x"]
TREE = sorted({f"{d}/{f}" for d in DIRS for f in FILES} | {f for f in FILES})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("tree")
    for path in TREE:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
    yield root


def _git_matches(repo: Path, rules: list[str]) -> set[str]:
    """What git matches: the files any rule includes, less those any '!' rule matches.
    (Asked as two lists: git 2.39's ls-files lists nothing at all for a literal directory
    such as `services/api` beside any exclude pathspec, a quirk of its prefix handling.)"""

    def listed(patterns: list[str]) -> set[str]:
        if not patterns:
            return set()
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "--",
                              *(f":(glob){p}" for p in patterns)],
                             check=True, capture_output=True, text=True).stdout
        return set(out.split())

    return (listed([r for r in rules if not r.startswith("!")])
            - listed([r[1:] for r in rules if r.startswith("!")]))


segment = st.sampled_from(["services", "api", "libs", "common", "web", "docs", "v1", "*",
                           "**", "?pi", "a*", "*.md", "*.go", "[ab]*", "[!a]*", "main.go"])
pattern = st.lists(segment, min_size=1, max_size=4).map("/".join)
rules_strategy = st.tuples(st.lists(pattern, min_size=1, max_size=3),
                           st.lists(pattern, max_size=2)).map(
    lambda t: t[0] + ["!" + p for p in t[1]])


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
@given(rules=rules_strategy)
def test_path_rules_match_what_git_matches(repo: Path, rules: list[str]) -> None:
    ours = {path for path in TREE if PathRules(tuple(rules)).matches(path)}
    assert ours == _git_matches(repo, rules), rules


@pytest.mark.parametrize(("rules", "path", "expected"), [
    (["services/api/**"], "services/api/v1/main.go", True),
    (["services/api/**"], "services/apiary/main.go", False),
    (["services/api"], "services/api/v1/main.go", True),  # a literal is a directory too
    (["services/*"], "services/api/main.go", False),  # '*' never crosses '/'
    (["**/*.md"], "README.md", True),
    (["web/**", "!web/docs/**"], "web/docs/a.md", False),
    (["!web/docs/**", "web/**"], "web/a.js", True),  # order does not matter
    (["libs/common/**"], "libs/commons/x", False),
])
def test_path_rules_by_example(rules: list[str], path: str, expected: bool) -> None:
    assert PathRules(tuple(rules)).matches(path) is expected


API = PathRules(("services/api/**", "libs/common/**"))
WEB = PathRules(("web/**", "libs/common/**"))
DOCS = PathRules(("docs/**",))
RULES = {"api": API, "web": WEB, "docs": DOCS}
B1 = Base("u1", "request/q#x/1", 0.0)
B2 = Base("u2", "request/q#x/2", 1.0)


def test_a_change_to_a_shared_library_affects_each_project_that_has_it() -> None:
    plan = plan_projects(RULES, {"api": B1, "web": B1, "docs": B1},
                         {"u1": Changes(frozenset({"libs/common/util.py"}))})
    assert set(plan.affected) == {"api", "web"} and plan.inherited == {"docs": B1}


def test_a_project_without_a_verdict_is_affected_and_each_diffs_from_its_own_base() -> None:
    plan = plan_projects(RULES, {"api": B1, "web": B2, "docs": None},
                         {"u1": Changes(frozenset({"web/a.js"})),
                          "u2": Changes(frozenset({"web/a.js"}))})
    assert plan.affected == {"web": "its files changed", "docs": "no verdict yet"}
    assert plan.inherited == {"api": B1}


@pytest.mark.parametrize("problem", [
    "the base u1 is not an ancestor of the head (a history rewrite)",
    "the repository no longer has the base u1",
    "the diff lists more than 20000 paths",
])
def test_when_changes_cannot_be_known_every_project_is_affected_with_the_reason(
        problem: str) -> None:
    plan = plan_projects(RULES, {"api": B1, "web": B2, "docs": B2},
                         {"u1": Changes(None, problem), "u2": Changes(frozenset())})
    assert plan.affected == dict.fromkeys(RULES, problem) and plan.everything == problem
    assert plan.inherited == {}


def test_a_backstop_affects_every_project() -> None:
    plan = plan_projects(RULES, dict.fromkeys(RULES, B1), {"u1": Changes(frozenset())},
                         everything="backstop (24h since the last)")
    assert set(plan.affected) == set(RULES) and not plan.inherited


def test_the_affected_command_names_the_projects_instead_of_the_rules() -> None:
    plan = plan_projects(RULES, dict.fromkeys(RULES, B1),
                         {"u1": Changes(frozenset({"web/a.js"}))},
                         named={"u1": frozenset({"docs"})})
    assert set(plan.affected) == {"docs"} and set(plan.inherited) == {"api", "web"}


@given(changed=st.sets(st.sampled_from(TREE), max_size=5),
       with_base=st.lists(st.booleans(), min_size=3, max_size=3))
def test_every_project_is_either_affected_or_inherits_and_only_untouched_ones_inherit(
        changed: set[str], with_base: list[bool]) -> None:
    bases = {p: (B1 if b else None) for p, b in zip(RULES, with_base, strict=True)}
    plan = plan_projects(RULES, bases, {"u1": Changes(frozenset(changed))})
    assert set(plan.affected) | set(plan.inherited) == set(RULES)
    for project, base in plan.inherited.items():
        assert base is bases[project] is not None
        assert not any(RULES[project].matches(p) for p in changed)


# --- deciding by the previous planned head (one diff a head) ------------------------------

CHAIN_PATHS = ("services/api/a.py", "web/a.js", "docs/a.md", "libs/common/util.py")


@given(history=st.lists(st.dictionaries(st.sampled_from(CHAIN_PATHS), st.integers(0, 2),
                                        max_size=3), min_size=2, max_size=12),
       building=st.lists(st.sets(st.sampled_from(sorted(RULES))), min_size=12, max_size=12))
def test_the_diff_from_the_previous_head_never_inherits_what_each_base_would_build(
        history: list[dict[str, int]], building: list[set[str]]) -> None:
    """A chain of heads on a linear history whose commits set files to small values (so a
    later commit may revert an earlier one): planning the projects whose answer at the
    previous head came from their base by that head's one diff builds every project that
    diffing from each base builds — and exactly those when nothing was reverted. A project
    in ``building`` at a head has no answer there yet (its build runs on)."""
    trees: list[dict[str, int]] = []
    for change in history:
        trees.append({**(trees[-1] if trees else dict.fromkeys(CHAIN_PATHS, 0)), **change})

    def diff(i: int, j: int) -> Changes:
        return Changes(frozenset(p for p in CHAIN_PATHS if trees[i][p] != trees[j][p]))

    def union(i: int, j: int) -> frozenset[str]:
        return frozenset(p for change in history[i + 1:j + 1] for p, v in change.items())

    built: dict[str, int] = {}  # project -> the head of its newest fact
    sources: dict[str, int] = {}  # at the previous head: project -> its answer's source
    for head in range(len(trees)):
        bases = {p: (Base(f"u{built[p]}", f"r{built[p]}", 0.0) if p in built else None)
                 for p in RULES}
        changes = {f"u{i}": diff(i, head) for i in set(built.values())}
        each = plan_projects(RULES, bases, changes)
        via = {p: f"u{head - 1}" for p in built if sources.get(p) == built[p]}
        if head:
            changes[f"u{head - 1}"] = diff(head - 1, head)
        previous = plan_projects(RULES, bases, changes, diffed_from=via)
        assert set(each.affected) <= set(previous.affected)
        if all(diff(i, head).paths == union(i, head) for i in set(built.values())):
            assert previous == each
        sources = {p: built[p] for p in previous.inherited}
        for project in previous.affected:
            if project not in building[head]:
                built[project] = head
                sources[project] = head
