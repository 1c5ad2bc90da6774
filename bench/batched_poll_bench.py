"""Batched polls and the rate budget (issue 17): API calls per minute, and how late each
build's end is seen, for many builds on one credential.

A local server implements Buildkite's builds API (tests/hosted_ci.py) with a latency per
request; the Buildkite runner polls it as the pipeline's poll loops do — each running
build's loop asks for its status, then holds for the runner's poll delay — in two modes:

- ``per-build``: one call per build per poll, every poll delay (the runner before batched
  polls and budgets);
- ``batched``: the shipped runner — one list call per pipeline per period, the period
  stretched to what the organization's budget (default 100 requests a minute) allows.

Builds end at random moments during the run; lateness is the time from the provider
reporting a build's end to its loop seeing it. Prints calls per minute while the builds
run, and lateness p50/p99 against the poll interval.

    python bench/batched_poll_bench.py [--builds 200] [--pipelines 20] [--latency 0.2]
        [--poll 10] [--minutes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streams.extensions import budget as budget_mod
from streams.extensions.buildrunner import snapshots
from streams.extensions.buildrunner.buildkite import (
    DEFAULT_REQUESTS_PER_MINUTE,
    BuildkiteBuildRunner,
)
from streams.extensions.sourcecontrol.gituri import git_uri
from tests.hosted_ci import FakeBuildkite

TOKEN = "bkua_bench"
TOKEN_ENV = "STOVEPIPE_BENCH_BUILDKITE_TOKEN"


async def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    budget_mod.forget_all()
    snapshots._SNAPSHOTS.clear()
    names = [f"p{n}" for n in range(args.pipelines)]
    fake = FakeBuildkite(TOKEN, pipeline=names[0], more_pipelines=tuple(names[1:]),
                         latency=args.latency)
    async with fake.serving():
        batched = mode == "batched"
        runners = {name: BuildkiteBuildRunner(
            "acme", name, TOKEN_ENV, api_url=fake.url, environ={TOKEN_ENV: TOKEN},
            requests_per_minute=DEFAULT_REQUESTS_PER_MINUTE if batched else None,
            batch_polls=batched) for name in names}
        ids = []
        for n in range(args.builds):
            name = names[n % len(names)]
            uri = git_uri("/r", "main", f"{n:040x}")
            # created straight on the server: the triggers are not what is measured
            number = fake.add_build(uri[-40:], pipeline=name, state="running")
            ids.append(f"bk-acme/{name}/{number}")
        window = args.minutes * 60
        rng = random.Random(7)
        ends = {b: rng.uniform(window * 0.25, window * 0.9) for b in ids}
        ended: dict[str, float] = {}
        seen: dict[str, float] = {}
        began = time.monotonic()

        async def finish() -> None:
            for build_id, at in sorted(ends.items(), key=lambda kv: kv[1]):
                await asyncio.sleep(max(0.0, began + at - time.monotonic()))
                fake.set_state(int(build_id.rsplit("/", 1)[1]), "passed")
                ended[build_id] = time.monotonic()

        async def loop(build_id: str) -> None:
            runner = runners[build_id.split("/")[1]]
            await asyncio.sleep(rng.uniform(0, args.poll))  # loops start spread out
            while True:
                report = await runner.status(build_id)
                if report.status.is_terminal:
                    seen[build_id] = time.monotonic()
                    return
                await asyncio.sleep(runner.poll_delay(build_id, args.poll))

        calls_before = len(fake.requests())
        wall = time.time()
        await asyncio.gather(finish(), *(loop(b) for b in ids))
        elapsed = time.monotonic() - began
        calls = len(fake.requests()) - calls_before
        # while every build still runs: from when the loops are all started to the first end
        quiet_from, quiet_to = wall + args.poll, wall + window * 0.25
        all_running = len([r for r in fake.requests() if quiet_from <= r.at < quiet_to])
        for runner in runners.values():
            await runner.aclose()
    lateness = sorted(seen[b] - ended[b] for b in ids)
    return {"calls_per_minute": calls / (elapsed / 60),
            "all_running_per_minute": all_running / ((quiet_to - quiet_from) / 60),
            "p50": statistics.median(lateness),
            "p99": lateness[int(len(lateness) * 0.99) - 1], "max": lateness[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", type=int, default=200)
    parser.add_argument("--pipelines", type=int, default=20)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--poll", type=float, default=10.0)
    parser.add_argument("--minutes", type=float, default=2.0)
    args = parser.parse_args()
    print(f"{args.builds} builds over {args.pipelines} pipelines on one organization, API "
          f"latency {args.latency * 1000:.0f} ms, configured poll delay {args.poll:g}s, "
          f"{args.minutes:g} min")
    results = {}
    for mode in ("per-build", "batched"):
        results[mode] = figures = asyncio.run(run(mode, args))
        print(f"  {mode:9}: {figures['all_running_per_minute']:7.1f} API calls/min while all "
              f"run, {figures['calls_per_minute']:7.1f} over the run; end seen "
              f"p50 {figures['p50']:.2f}s, p99 {figures['p99']:.2f}s, max "
              f"{figures['max']:.2f}s after the provider reported it", flush=True)
    budget = budget_mod.Budget("x", DEFAULT_REQUESTS_PER_MINUTE)
    interval = budget.poll_period(args.pipelines, floor=args.poll) + snapshots.MARGIN
    ratio = results["batched"]["calls_per_minute"] / results["per-build"]["calls_per_minute"]
    busy = (results["batched"]["all_running_per_minute"]
            / results["per-build"]["all_running_per_minute"])
    print(f"  batched/per-build calls: {busy:.3f} while all run, {ratio:.3f} over the run; "
          f"batched poll interval (the budget's "
          f"period for {args.pipelines} pipelines + margin): {interval:.2f}s")


if __name__ == "__main__":
    main()
