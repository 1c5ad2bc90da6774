"""`stovepipe prune --older-than 180d [--dry-run]`: delete history older than the
retention, except what a gate or a person still needs (`streams.stages.retention`;
docs/operating.md, "Retention"), and print per table what went (or would go).

Exit codes: 0 done; 1 the database unreachable, or a retention round already running (a
worker's, or another prune); 2 bad input.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import psycopg

from streams.cli.common import json_option, open_db, queues_option, run_async
from streams.config.queues import load_queues
from streams.config.retention import (
    DEFAULT_BATCH_ROWS,
    DEFAULT_DUTY_CYCLE,
    DEFAULT_KEEP_NEWEST,
    RetentionConfig,
    check_duty_cycle,
    check_older_than,
)
from streams.schema.durations import format_duration, parse_duration
from streams.stages.retention import LOCK, TABLES, Pace, PruneReport, prune
from streams.stages.retention_rules import Policy


def _older_than(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    try:
        duration = parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc}; history is usually kept for months, e.g. "
                                 f"180d") from None
    try:
        return check_older_than(duration)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _duty_cycle(ctx: click.Context, param: click.Parameter,
                value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return check_duty_cycle(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("prune")
@click.option("--older-than", "older_than", required=True, callback=_older_than,
              metavar="DURATION",
              help="Delete history older than this, e.g. 180d (at least 1d).")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--keep-newest", type=click.IntRange(min=1), default=None,
              help="Facts kept per queue and per project however old [default: "
                   f"retention.keep_newest in queues.yaml, else {DEFAULT_KEEP_NEWEST}].")
@click.option("--max-rows", type=click.IntRange(min=1), default=None,
              help="Stop once this many rows are deleted (run again for the rest).")
@click.option("--duty-cycle", type=float, default=None, callback=_duty_cycle,
              metavar="SHARE",
              help="Share of the time spent deleting, resting the rest between batches so "
                   "the pipeline keeps its pace; 1: no rest [default: retention.duty_cycle "
                   f"in queues.yaml, else {DEFAULT_DUTY_CYCLE}].")
@click.option("--batch-rows", type=click.IntRange(min=1), default=None,
              help="Rows one batch (one short transaction) deletes, about [default: "
                   f"retention.batch_rows in queues.yaml, else {DEFAULT_BATCH_ROWS}].")
@queues_option
@json_option
def prune_command(older_than: timedelta, dry_run: bool, keep_newest: int | None,
                  max_rows: int | None, duty_cycle: float | None, batch_rows: int | None,
                  queues_file: Path | None, as_json: bool) -> None:
    """Delete facts, Requests and the rest of the history older than --older-than, in
    small batches, keeping whatever a gate or a person still needs: bookmarks, pins and
    promotion targets, the newest facts of each queue and project, anything not
    terminal, culprit searches, undecided project plans, unsent notifications."""
    # what the options leave out comes from queues.yaml's retention (its defaults when off)
    config = RetentionConfig()
    if keep_newest is None or duty_cycle is None or batch_rows is None:
        config = load_queues(queues_file).retention or config
    policy = Policy(older_than, config.keep_newest if keep_newest is None else keep_newest)
    pace = Pace(config.duty_cycle if duty_cycle is None else duty_cycle)
    if batch_rows is None:
        batch_rows = config.batch_rows

    async def run() -> PruneReport:
        db = await open_db(pool_size=3)
        try:
            if dry_run:
                return await prune(db, policy, dry_run=True, pace=pace, batch=batch_rows)
            async with db.try_exclusive(LOCK) as mine:
                if not mine:
                    raise click.ClickException(
                        "a retention round is running (a worker's, or another prune); "
                        "try again when it has ended")
                return await prune(db, policy, max_rows=max_rows, pace=pace,
                                   batch=batch_rows)
        except psycopg.errors.UndefinedTable:
            raise click.ClickException(
                "the database has no Stovepipe schema in its search_path, or an older one: "
                "run `stovepipe db migrate` first") from None
        finally:
            await db.close()

    report = run_async(run)
    if as_json:
        click.echo(_json(report, policy))
        return
    for line in _lines(report, policy):
        click.echo(line)


def _lines(report: PruneReport, policy: Policy) -> list[str]:
    verb = "would delete" if report.dry_run else "deleted"
    lines = [f"History older than {format_duration(policy.older_than)} (before "
             f"{report.cutoff.isoformat(timespec='seconds')}), keeping the newest "
             f"{policy.keep_newest} facts of each queue and project"
             + (" (dry run: nothing deleted)" if report.dry_run else "") + ":",
             f"  {'table':<18} {verb:>14}"]
    lines += [f"  {table:<18} {report.deleted.get(table, 0):>14,}" for table in TABLES]
    lines.append(f"  {'total':<18} {report.total:>14,}")
    kept = sum(report.kept.values())
    if kept:
        why = ", ".join(f"{n:,} {reason.value}" for reason, n in report.kept.most_common())
        lines.append(f"Kept although older: {kept:,} Requests ({why}).")
    if not report.dry_run:
        rate = report.total / report.seconds if report.seconds > 0 else 0.0
        lines.append(f"{report.total:,} rows in {report.seconds:.1f} s ({rate:,.0f} rows/s),"
                     f" {report.batches:,} batches, {report.rested:.1f} s of it resting")
    if report.skipped:
        lines.append(f"{report.skipped} batch(es) met a lock and were left for the next "
                     f"prune.")
    if not report.finished:
        lines.append("Stopped at --max-rows: more is past retention; run again for the "
                     "rest.")
    return lines


def _json(report: PruneReport, policy: Policy) -> str:
    body: dict[str, Any] = {
        "older_than": format_duration(policy.older_than), "keep_newest": policy.keep_newest,
        "cutoff": report.cutoff.isoformat(), "dry_run": report.dry_run,
        "deleted": {table: report.deleted.get(table, 0) for table in TABLES},
        "total": report.total,
        "kept": {reason.name.lower(): n for reason, n in report.kept.items()},
        "finished": report.finished, "skipped_batches": report.skipped,
        "seconds": round(report.seconds, 3), "rested_seconds": round(report.rested, 3)}
    return json.dumps(body, indent=2, sort_keys=True)
