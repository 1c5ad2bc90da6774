"""The queues' lag gauges, refreshed by every worker every sweep interval (issue 11):
`stovepipe_bookmark_age_seconds{queue}` and `stovepipe_commits_since_green{queue}`, from
one query over the configured queues' rows (primary-key joins only)."""

from __future__ import annotations

import contextlib

from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps


async def refresh_gauges(deps: Deps, publish: Publisher) -> None:
    names = deps.queues.names()
    for lag in await deps.db.notifications.lags(names):
        if lag.bookmark_age is None:  # never green: no age to show
            with contextlib.suppress(KeyError):
                metrics.BOOKMARK_AGE.remove(lag.queue)
        else:
            metrics.BOOKMARK_AGE.labels(queue=lag.queue).set(lag.bookmark_age)
        metrics.COMMITS_SINCE_GREEN.labels(queue=lag.queue).set(lag.heads_since_green)
