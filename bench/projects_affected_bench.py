"""What a head costs the affected computation of a queue with 200 projects (issue 24,
item 7), on a real git repository with a long history. Prints figures; asserts nothing.

    .venv/bin/python bench/projects_affected_bench.py [--commits 200000] [--projects 200]
        [--push 100] [--runs 5]

The repository is made with `git fast-import`: ``--commits`` commits on `main`, each
changing one file of one project (`services/pNNN/`), one in 50 changing the shared
`libs/common/` that every project's rules include. The analyze stage's own code then
plans heads against it — `streams.stages.analyze`'s changes from each distinct base to
the head, through the real `GitSourceControl` (its cache, `git merge-base
--is-ancestor`, `git diff --name-only`), and `plan_projects` over every project's rules:

1. one head touching one project, every project last validated at its parent: how many
   diffs and builds, and the time;
2. a push of ``--push`` commits at once, every project validated at the commit before the
   push: the diffs made (one per distinct base) against diffing every commit of the push
   (what a per-commit computation would do), and both times;
3. the same push with the projects' bases spread over 20 commits of the history (projects
   validated at different heads, as after unaffected and red heads): 20 diffs.

A queue without projects computes nothing here: one build per head, of everything.
Reported: medians over ``--runs`` (the machine is shared: other tenants move every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streams.extensions.sourcecontrol.git import GitSourceControl
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.stages.affected import Base, PathRules, plan_projects
from streams.stages.analyze import _changes  # the stage's own diff step

MAX_CHANGED_PATHS = 100_000


def make_history(repo: Path, commits: int, projects: int, seed: int = 7) -> list[str]:
    """`main` with ``commits`` commits; returns their shas, oldest first."""
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    rng = random.Random(seed)
    chunks: list[bytes] = []
    for n in range(1, commits + 1):
        path = ("libs/common/c.txt" if n % 50 == 0
                else f"services/p{rng.randrange(projects):03d}/f.txt")
        content = f"{n}\n".encode()
        message = f"change {n}\n".encode()
        chunks.append(b"commit refs/heads/main\nmark :%d\n" % n)
        chunks.append(b"committer Bench <bench@example.invalid> %d +0000\n" % (10**9 + n))
        chunks.append(b"data %d\n%s" % (len(message), message))
        if n > 1:
            chunks.append(b"from :%d\n" % (n - 1))
        chunks.append(b"M 100644 inline %s\ndata %d\n%s\n" % (path.encode(), len(content),
                                                             content))
    chunks.append(b"done\n")
    subprocess.run(["git", "-C", str(repo), "fast-import", "--quiet", "--done",
                    "--export-marks=" + str(repo / ".git" / "marks")],
                   input=b"".join(chunks), check=True)
    marks = dict(line.split() for line in (repo / ".git" / "marks").read_text().splitlines())
    return [marks[f":{n}"] for n in range(1, commits + 1)]


class CountingGit(GitSourceControl):
    diffs = 0

    async def changed_paths(self, base_uri: str, head_uri: str, *, limit: int) -> list[str]:
        CountingGit.diffs += 1
        return await super().changed_paths(base_uri, head_uri, limit=limit)


async def plan_head(sc: CountingGit, rules: dict[str, PathRules], bases: dict[str, str],
                    head: str, repo: str) -> tuple[int, int, float]:
    """As the analyze stage plans a head: one diff per distinct base. Returns (diffs,
    projects to build, seconds)."""
    CountingGit.diffs = 0
    started = time.perf_counter()
    head_uri = git_uri(repo, "main", head)
    changes = {}
    for sha in sorted(set(bases.values())):
        uri = git_uri(repo, "main", sha)
        changes[uri] = await _changes(sc, uri, head_uri, MAX_CHANGED_PATHS)
    plan = plan_projects(
        rules, {p: Base(git_uri(repo, "main", sha), f"request/q#{p}/1", 1.0)
                for p, sha in bases.items()}, changes)
    return CountingGit.diffs, len(plan.affected), time.perf_counter() - started


async def per_commit(sc: CountingGit, shas: list[str], repo: str) -> tuple[int, float]:
    """Diffing every commit of the push against its parent (what the stage avoids)."""
    CountingGit.diffs = 0
    started = time.perf_counter()
    for parent, child in itertools.pairwise(shas):
        await _changes(sc, git_uri(repo, "main", parent), git_uri(repo, "main", child),
                       MAX_CHANGED_PATHS)
    return CountingGit.diffs, time.perf_counter() - started


async def run(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="projects-bench-"))
    repo = root / "mono"
    started = time.perf_counter()
    shas = make_history(repo, args.commits + args.push + 1, args.projects)
    print(f"history: {len(shas)} commits, {args.projects} projects, made in "
          f"{time.perf_counter() - started:.1f} s")
    sc = CountingGit(str(repo), "main", cache_dir=root / "cache")
    await sc.head()  # the cache's first fetch is not a head's cost
    rules = {f"p{i:03d}": PathRules((f"services/p{i:03d}/**", "libs/common/**"))
             for i in range(args.projects)}
    identity = str(repo)
    rng = random.Random(11)

    one, push, spread, naive = [], [], [], []
    for _ in range(args.runs):
        # 1. one head on top of a history every project was validated at
        i = rng.randrange(args.commits // 2, args.commits)
        while i % 50 == 49:  # a head changing libs/common affects everything
            i += 1
        one.append(await plan_head(sc, rules, dict.fromkeys(rules, shas[i - 1]), shas[i],
                                   identity))
        # 2. a push of args.push commits on top of the history
        before = shas[args.commits]
        head = shas[args.commits + args.push]
        push.append(await plan_head(sc, rules, dict.fromkeys(rules, before), head, identity))
        naive.append(await per_commit(sc, shas[args.commits:args.commits + args.push + 1],
                                      identity))
        # 3. the same push, the projects' bases spread over 20 older commits
        olds = rng.sample(range(args.commits - 2000, args.commits), 20)
        bases = {p: shas[olds[n % 20]] for n, p in enumerate(rules)}
        spread.append(await plan_head(sc, rules, bases, head, identity))

    def med(rows: list[tuple[float, ...]], k: int) -> float:
        return statistics.median(row[k] for row in rows)

    print(f"runs: {args.runs}; medians")
    print(f"{'case':<58}{'diffs':>7}{'builds':>8}{'time':>10}")
    print(f"{'one head touching one project (projects queue)':<58}{med(one, 0):>7.0f}"
          f"{med(one, 1):>8.0f}{med(one, 2) * 1000:>8.1f}ms")
    print(f"{'one head (queue without projects)':<58}{0:>7}{1:>8}{'-':>10}")
    print(f"{f'push of {args.push} commits, bases at the commit before':<58}"
          f"{med(push, 0):>7.0f}{med(push, 1):>8.0f}{med(push, 2) * 1000:>8.1f}ms")
    print(f"{f'push of {args.push} commits, diffing every commit':<58}"
          f"{med(naive, 0):>7.0f}{'-':>8}{med(naive, 1) * 1000:>8.1f}ms")
    print(f"{f'push of {args.push} commits, bases spread over 20 commits':<58}"
          f"{med(spread, 0):>7.0f}{med(spread, 1):>8.0f}{med(spread, 2) * 1000:>8.1f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=200_000)
    parser.add_argument("--projects", type=int, default=200)
    parser.add_argument("--push", type=int, default=100)
    parser.add_argument("--runs", type=int, default=5)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
