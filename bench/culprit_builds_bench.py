"""Builds a culprit search spends, and how often its answer is confirmed (issue 23): the
pure search (`streams.stages.culprits.bisect_step`) driven over random ranges, every
probe answered at once, one probe at a time.

Two kinds of range after a green commit, n commits long with the red head last:

- ``one break``: green up to a random commit, red from there on;
- ``fixed, then broken``: a break, a fix, and a later break the head is red for.

For each ``max_builds``, prints the median and p90 of the builds that ran, the share of
searches naming the head's break confirmed, the share naming a break not confirmed, and
— for comparison — the share of ranges where plain bisection (the search before issue 23:
narrow from the newest known green, name the first break found) blames a break that was
already fixed.

    python bench/culprit_builds_bench.py [--ranges 2000] [--lengths 8 16 32 64]
        [--budgets 4 10 1000] [--seed 23]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.culprits import SearchState
from streams.stages.culprits import Budget, Known, bisect_step


def one_break(n: int, rng: random.Random) -> list[bool]:
    first_red = rng.randint(1, n)
    return [i < first_red for i in range(n + 1)]


def fixed_then_broken(n: int, rng: random.Random) -> list[bool]:
    """Green end, a break at a, a fix at b, a break at c (a < b < c <= n)."""
    a, b, c = sorted(rng.sample(range(1, n + 1), 3))
    return [not (a <= i < b or i >= c) for i in range(n + 1)]


def newest_break(verdicts: list[bool]) -> int:
    return max(i for i in range(1, len(verdicts)) if not verdicts[i] and verdicts[i - 1])


def search(verdicts: list[bool], max_builds: int) -> tuple[int, int | None, bool]:
    """(builds that ran, the break named or None, confirmed)."""
    known = [Known.UNKNOWN] * len(verdicts)
    known[0], known[-1] = Known.GREEN, Known.RED
    ran = 0
    while True:
        step = bisect_step(known, budget=Budget(max_builds, ran=ran))
        if step.state is not SearchState.BISECTING:
            named = step.culprit if step.state is SearchState.FOUND else None
            return ran, named, step.confirmed
        for index in step.probes:
            ran += 1
            known[index] = Known.GREEN if verdicts[index] else Known.RED


def plain_bisection(verdicts: list[bool]) -> int:
    """The break plain bisection names (the search before issue 23, unlimited builds)."""
    lo, hi = 0, len(verdicts) - 1
    while hi > lo + 1:
        middle = (lo + hi) // 2
        if verdicts[middle]:
            lo = middle
        else:
            hi = middle
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranges", type=int, default=2000)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 10, 1000])
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"{'range':<22}{'n':>4}{'max_builds':>12}{'builds p50':>12}{'p90':>6}"
          f"{'confirmed':>11}{'not conf.':>11}{'wrong if plain':>16}")
    for kind, make in (("one break", one_break), ("fixed, then broken", fixed_then_broken)):
        for n in args.lengths:
            ranges = [make(n, rng) for _ in range(args.ranges)]
            plain_wrong = sum(plain_bisection(v) != newest_break(v) for v in ranges)
            for max_builds in args.budgets:
                builds, confirmed, unconfirmed = [], 0, 0
                for verdicts in ranges:
                    ran, named, sure = search(verdicts, max_builds)
                    builds.append(ran)
                    if named is not None and sure:
                        assert named == newest_break(verdicts)
                        confirmed += 1
                    elif named is not None:
                        unconfirmed += 1
                p90 = statistics.quantiles(builds, n=10)[-1] if len(builds) > 1 else builds[0]
                print(f"{kind:<22}{n:>4}{max_builds:>12}{statistics.median(builds):>12g}"
                      f"{p90:>6g}{confirmed / len(ranges):>11.0%}"
                      f"{unconfirmed / len(ranges):>11.0%}"
                      f"{plain_wrong / len(ranges):>16.0%}")


if __name__ == "__main__":
    main()
