"""Rate budgets across worker processes (issue 23): calls a minute, 429s and how late each
outcome is, for builds started at once on one Buildkite organization and run by 1 and by
3 `stovepipe worker` processes sharing one machine and one STOVEPIPE_HOME.

For each worker count the script makes a deployment of its own (topics, schema, queues,
home) on the local stack, a local server answering like Buildkite's builds API and
enforcing its 200 calls a minute per organization (tests/hosted_ci.py), and runs
`tests.budget_support.run_builds_at_once`: N queues (default 20) on one pipeline with the
shipped defaults (2 s polls, a budget of 100 calls a minute), spread over 20 pipelines
(then the budget, not the poll delay, sets the poll period), their ingests produced at
once; once every build runs, a minute of running (the steady cost), then every build
passes at once. Prints, per worker count: calls a minute while the builds ran and in the
busiest 60 s of the run, the 429s the server answered, the lateness of the outcomes
(median, max) against one poll period, what the sweeper re-published, and the outcomes.

    .venv/bin/python bench/worker_budget_bench.py [--workers 1,3] [--builds 20]
        [--pipelines 20] [--running 60] [--runs 1]

Run it on code before issue 23 (which did not count worker processes) with
``--no-count-wait``: the workers are then given two tends to settle instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline_bench import endpoints
from bench.throwaway import throwaway_pipeline
from tests.budget_support import BudgetRun, fake_organization, run_builds_at_once


def one_run(bootstrap: str, admin_dsn: str, workers: int,
            args: argparse.Namespace) -> BudgetRun:
    with throwaway_pipeline(bootstrap, admin_dsn, "wb") as pipeline:
        fake = fake_organization(args.pipelines)
        with fake.in_thread():
            return run_builds_at_once(pipeline, pipeline.root, fake, workers=workers,
                                      builds=args.builds, running_seconds=args.running,
                                      require_count=not args.no_count_wait)


def describe(run: BudgetRun) -> str:
    outcomes: dict[str, int] = {}
    for state in run.states.values():
        outcomes[state] = outcomes.get(state, 0) + 1
    republished = ", ".join(f"{what} {n}" for what, n in sorted(run.republished.items()))
    lateness = list(run.lateness.values())
    ratios = sorted(late / run.periods[r] for r, late in run.lateness.items())
    return (f"{run.workers} worker(s): {run.calls_while_running:6.1f} calls/min while the "
            f"builds ran, busiest 60 s {run.busiest_minute:3d}; 429s {run.refused:3d}; "
            f"outcome after the build's end median {statistics.median(lateness):.2f}s, "
            f"max {max(lateness):.2f}s; in poll periods (their worker's) median "
            f"{statistics.median(ratios):.2f}, max {ratios[-1]:.2f}, later than a period "
            f"+ 1 s: {len(run.late)}; poll periods {sorted(set(run.periods.values()))}; "
            f"sweeper re-published: {republished or 'nothing'}; workers counted "
            f"{run.counted}; outcomes {outcomes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,3",
                        help="worker process counts to run, comma-separated")
    parser.add_argument("--builds", type=int, default=20)
    parser.add_argument("--pipelines", type=int, default=20,
                        help="pipelines the builds are spread over")
    parser.add_argument("--running", type=float, default=60.0,
                        help="seconds every build runs once all are running")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-count-wait", action="store_true",
                        help="do not wait for the workers to report their count")
    args = parser.parse_args()
    bootstrap, admin_dsn = endpoints()
    counts = [int(n) for n in args.workers.split(",")]
    print(f"{args.builds} builds on {args.pipelines} pipelines started at once on one "
          f"Buildkite organization (the server enforcing 200 calls/min), shipped defaults "
          f"(2 s polls, a share of 100 calls/min)", flush=True)
    for _ in range(args.runs):
        for workers in counts:
            print("  " + describe(one_run(bootstrap, admin_dsn, workers, args)), flush=True)


if __name__ == "__main__":
    main()
