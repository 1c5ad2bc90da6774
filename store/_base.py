"""What every store shares: where its connection comes from, and how rows and errors map.

A store runs each call either on a pooled autocommit connection (one statement, one
transaction) or on the connection of an open `Database.transaction()`, where its writes
commit or roll back together with the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, LiteralString, Protocol

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row

from store.errors import AlreadyExists, InvariantViolation, NotFound, VersionMismatch

Row = dict[str, Any]


class ConnectionSource(Protocol):
    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[Any]]: ...


@asynccontextmanager
async def translate_integrity_errors(
    entity: str,
    key: Mapping[str, object],
    *,
    request_key: Mapping[str, object] | None = None,
) -> AsyncIterator[None]:
    """Turn the database's answers (constraint violations) into typed store errors.

    `request_key` names the request a new row refers to: the only foreign keys point at
    the request a build or fact belongs to, so a violated one means that request is gone.
    """
    try:
        yield
    except psycopg.errors.UniqueViolation as exc:
        raise AlreadyExists(entity, key) from exc
    except psycopg.errors.ForeignKeyViolation as exc:
        raise NotFound("request", request_key or key) from exc
    except psycopg.IntegrityError as exc:
        raise InvariantViolation(
            entity,
            key,
            exc.diag.message_primary or str(exc),
            constraint=exc.diag.constraint_name or "",
        ) from exc


class Store:
    """Base of the per-entity stores."""

    entity: str = ""

    def __init__(self, source: ConnectionSource) -> None:
        self._source = source

    async def _fetch_one(
        self,
        query: LiteralString,
        params: Mapping[str, object],
        *,
        key: Mapping[str, object],
        request_key: Mapping[str, object] | None = None,
    ) -> Row | None:
        async with (
            translate_integrity_errors(self.entity, key, request_key=request_key),
            self._source.connection() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            await cur.execute(query, params)
            return await cur.fetchone()

    async def _fetch_all(
        self, query: LiteralString, params: Mapping[str, object], *, key: Mapping[str, object]
    ) -> list[Row]:
        async with (
            translate_integrity_errors(self.entity, key),
            self._source.connection() as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            await cur.execute(query, params)
            return await cur.fetchall()

    async def _get_row(
        self, query: LiteralString, params: Mapping[str, object], *, key: Mapping[str, object]
    ) -> Row:
        row = await self._fetch_one(query, params, key=key)
        if row is None:
            raise NotFound(self.entity, key)
        return row

    async def _insert(
        self,
        query: LiteralString,
        params: Mapping[str, object],
        *,
        key: Mapping[str, object],
        request_key: Mapping[str, object] | None = None,
    ) -> Row:
        """Run an `INSERT … ON CONFLICT (<pk>) DO NOTHING RETURNING *`.

        A conflict returns no row and raises AlreadyExists without aborting an enclosing
        transaction (no database error is raised).
        """
        row = await self._fetch_one(query, params, key=key, request_key=request_key)
        if row is None:
            raise AlreadyExists(self.entity, key)
        return row

    async def _compare_and_set(
        self,
        update: LiteralString,
        params: Mapping[str, object],
        *,
        version_query: LiteralString,
        key: Mapping[str, object],
        expected_version: int,
    ) -> Row:
        """Run `UPDATE … SET …, version = version + 1 WHERE <pk> AND version = %(version)s
        RETURNING *`; when it matched nothing, say why (NotFound or VersionMismatch).

        Under READ COMMITTED a concurrent writer of the same row makes this UPDATE wait and
        then re-check `version` against the committed row, so exactly one of two racing
        compare-and-sets from the same version wins.
        """
        async with self._source.connection() as conn:
            async with (
                translate_integrity_errors(self.entity, key),
                conn.cursor(row_factory=dict_row) as cur,
            ):
                await cur.execute(update, {**params, "version": expected_version})
                row = await cur.fetchone()
            if row is not None:
                return row
            async with conn.cursor() as cur:
                await cur.execute(version_query, key)
                current = await cur.fetchone()
        if current is None:
            raise NotFound(self.entity, key)
        raise VersionMismatch(
            self.entity, key, expected_version=expected_version, actual_version=current[0]
        )
