"""Which projects a head affects (design §11, "Affected"): pure, so every case is cheap to
enumerate and Hypothesis tests it (the I/O — git, the ``affected`` command — is in
`streams.stages.analyze`).

At a head H, project P is **affected** when a file matching P's paths differs between P's
nearest validated ancestor (its newest verdict, green or red: its *base*) and H, or P has
no verdict yet. An unaffected project **inherits** its base's answer. When the affected
set cannot be computed soundly — a base that is not an ancestor of H (a history rewrite),
a base the repository no longer has, the ``affected`` command failing or timing out, a
diff too large — every project is affected, and the reason is recorded. A backstop run
affects every project too.

Path rules are git pathspec globs with ``:(glob)`` magic, as ``git ls-files`` reads them
(tested against git itself): ``*`` and ``?`` never cross ``/``; ``**/`` matches any
leading directories, ``/**`` everything inside, ``/**/`` zero or more directories; a rule
without wildcards also matches everything below it as a directory (``docs`` is
``docs/**`` too); a rule starting with ``!`` excludes what it matches, whatever the order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

_WILDCARDS = re.compile(r"[*?\[]")


def _glob_regex(pattern: str) -> str:
    """The regular expression of one ``:(glob)`` pattern (without its ``!``)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                leading = i == 0 or pattern[i - 1] == "/"
                trailing = i + 2 == n or pattern[i + 2] == "/"
                if leading and trailing:
                    if i + 2 == n:  # "/**" at the end (or the whole pattern): anything
                        out.append(".*")
                        i += 2
                    else:  # "**/": zero or more directories
                        out.append("(?:.*/)?")
                        i += 3
                    continue
                i += 2  # other consecutive asterisks are a plain asterisk
                out.append("[^/]*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append(f"(?!/)[{body}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class PathRules:
    """A project's path rules, compiled once."""

    rules: tuple[str, ...]

    @cached_property
    def _compiled(self) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
        include: list[str] = []
        exclude: list[str] = []
        for rule in self.rules:
            negated = rule.startswith("!")
            pattern = rule.removeprefix("!").rstrip("/")
            if _WILDCARDS.search(pattern):
                expression = _glob_regex(pattern)
            else:  # a literal path matches itself and everything below it
                expression = re.escape(pattern) + "(?:/.*)?"
            (exclude if negated else include).append(expression)

        def joined(expressions: list[str]) -> re.Pattern[str] | None:
            return re.compile("|".join(f"(?:{e})" for e in expressions), re.DOTALL) \
                if expressions else None

        return joined(include), joined(exclude)

    def matches(self, path: str) -> bool:
        """Whether ``path`` (relative to the repository's root) belongs to the project."""
        include, exclude = self._compiled
        if include is None or not include.fullmatch(path):
            return False
        return exclude is None or not exclude.fullmatch(path)

    def touched_by(self, paths: Iterable[str]) -> bool:
        return any(self.matches(path) for path in paths)


@dataclass(frozen=True)
class Base:
    """A project's nearest validated ancestor: the commit of its newest verdict, and the
    Request (in the project's scope) whose fact it is."""

    uri: str
    request_id: str
    degree: float


@dataclass(frozen=True)
class Changes:
    """What differs between a base and the head: the changed paths, or why they cannot be
    known soundly (then ``paths`` is None)."""

    paths: frozenset[str] | None
    problem: str = ""

    def __post_init__(self) -> None:
        if (self.paths is None) == (not self.problem):
            raise ValueError("changes are either known paths or a problem, not both")


@dataclass(frozen=True)
class Plan:
    """Per project: affected (to build, with why) or inherited (from its base); and, when
    every project is affected for a reason of the whole head, that reason."""

    affected: Mapping[str, str]
    inherited: Mapping[str, Base] = field(default_factory=dict)
    everything: str = ""

    def __post_init__(self) -> None:
        if set(self.affected) & set(self.inherited):
            raise ValueError("a project is either affected or inherited")


def plan_projects(rules: Mapping[str, PathRules], bases: Mapping[str, Base | None],
                  changes: Mapping[str, Changes], *,
                  named: Mapping[str, frozenset[str]] | None = None,
                  everything: str = "",
                  diffed_from: Mapping[str, str] | None = None) -> Plan:
    """The plan of a head: ``rules`` by project; ``bases`` by project (None: no verdict
    yet); ``changes`` by the URI they were diffed from (every one used must be there);
    ``named`` likewise, when an ``affected`` command names the projects instead of the
    path rules; ``everything`` a reason that makes every project affected (a backstop, a
    history rewrite found before any diff); ``diffed_from`` by project, the URI whose
    changes decide it when not its base's.

    That is sound for a project whose answer at an earlier head H' already came from its
    base B (inherited from B, or built at H' = B), H' an ancestor of the head H: no file
    of it differs between B and H', so one that differs between B and H differs between
    H' and H — and H'..H is one diff for every such project (`streams.stages.analyze`)."""
    via = diffed_from or {}

    def source(project: str, base: Base) -> str:
        return via.get(project, base.uri)

    used = {source(p, b) for p, b in bases.items() if b is not None}
    problems = sorted({c.problem for uri, c in changes.items() if c.paths is None
                       and uri in used})
    if not everything and problems:
        everything = problems[0]
    if everything:
        return Plan({project: everything for project in rules}, {}, everything)
    affected: dict[str, str] = {}
    inherited: dict[str, Base] = {}
    for project, project_rules in rules.items():
        base = bases.get(project)
        if base is None:
            affected[project] = "no verdict yet"
            continue
        if named is not None:
            touched = project in named[source(project, base)]
            why = "named by the affected command"
        else:
            paths = changes[source(project, base)].paths
            assert paths is not None
            touched = project_rules.touched_by(paths)
            why = "its files changed"
        if touched:
            affected[project] = why
        else:
            inherited[project] = base
    return Plan(affected, inherited)
