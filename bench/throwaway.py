"""A throwaway Stovepipe deployment on the local stack for a benchmark run: its own schema
(migrated), topics (its own prefix), root directory and `tests.pipeline_support.Pipeline`
with the shipped sweep interval; on leaving, its workers and the command builds they
launched are stopped, and its consumer groups, topics, schema and directory removed."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from store.migrations import migrate
from tests.pipeline_support import Pipeline

SHIPPED_SWEEP_INTERVAL = 5.0


@contextlib.contextmanager
def throwaway_pipeline(bootstrap: str, admin_dsn: str, tag: str) -> Iterator[Pipeline]:
    """``tag`` (a few letters) names the schema ``<tag>_<hex>`` and prefix ``<tag><hex>.``."""
    unique = uuid.uuid4().hex[:8]
    schema, prefix = f"{tag}_{unique}", f"{tag}{unique}."
    root = Path(tempfile.mkdtemp(prefix=f"{tag}-bench-"))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    pipeline: Pipeline | None = None
    try:
        dsn = make_conninfo(admin_dsn, options=f"-c search_path={schema}")
        migrate(dsn)
        pipeline = Pipeline(bootstrap=bootstrap, dsn=dsn, prefix=prefix, root=root)
        pipeline.sweep_interval = SHIPPED_SWEEP_INTERVAL
        yield pipeline
    finally:
        if pipeline is not None:
            pipeline.close()
            delete_kafka_state(bootstrap, prefix, pipeline.app_id)
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        shutil.rmtree(root, ignore_errors=True)


def delete_kafka_state(bootstrap: str, prefix: str, app_id: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with contextlib.suppress(Exception):
        for fut in admin.delete_consumer_groups([app_id, f"{app_id}-delay"],
                                                request_timeout=15).values():
            with contextlib.suppress(Exception):
                fut.result(timeout=15)
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    if names:
        for fut in admin.delete_topics(names, operation_timeout=30).values():
            with contextlib.suppress(Exception):
                fut.result(timeout=30)
