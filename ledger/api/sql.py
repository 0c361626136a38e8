"""Read-only SQL (``POST /v1/sql``) and Parquet export (``GET /v1/export/{table}.parquet``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, status
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ledger import export
from ledger.api import errors
from ledger.api.answers import documents
from ledger.api.deps import ReadsDep, SettingsDep, require
from ledger.api.models import PARQUET
from ledger.api.streams import ThreadedStream
from ledger.reads import read_priority
from ledger.sql.base import SqlError, SqlResult
from ledger.sql.runners import SqlRunner
from ledger.sql.values import dumps, to_csv

router = APIRouter(prefix="/v1", tags=["sql"], dependencies=[require("read")])


class SqlRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sql: str = Field(min_length=1, max_length=100_000, description="one SELECT (or EXPLAIN) statement")
    params: dict[str, Any] | None = Field(None, description="values for $name placeholders")
    max_rows: int | None = Field(None, ge=1, description="row cap (at most the ledger's sql_max_rows)")


def _runner(request: Request) -> SqlRunner:
    return request.app.state.sql  # type: ignore[no-any-return]


def _error(exc: SqlError) -> JSONResponse:
    retry = {"Retry-After": "1"} if exc.status == 429 else None
    return errors.error_response(exc.status, exc.message, reason=exc.reason, headers=retry)


@router.post(
    "/sql",
    **documents(
        SqlResult,
        400,
        408,
        422,
        429,
        503,
        description="the result as JSON, or as CSV (format=csv or Accept: text/csv)",
        media={"text/csv": {"schema": {"type": "string"}}},
    ),
)
def run_sql(
    body: SqlRequest,
    request: Request,
    settings: SettingsDep,
    format: Literal["json", "csv"] | None = Query(None, description="csv, or send Accept: text/csv"),
) -> Response:
    """Run one read-only statement; columns, portable types, rows, whether the cap cut them, time."""
    limit = settings.sql_max_rows
    max_rows = body.max_rows or limit
    if max_rows > limit:
        return _error(
            SqlError("max_rows", f"max_rows: {max_rows} is above this ledger's limit {limit} (sql_max_rows)")
        )
    read_priority(settings.read_nice)
    try:
        result = _runner(request).run(
            body.sql,
            body.params,
            max_rows=max_rows,
            timeout_s=settings.sql_timeout_s,
            max_bytes=settings.sql_max_bytes,
        )
    except SqlError as exc:
        return _error(exc)
    wants_csv = format == "csv" or (format is None and "text/csv" in request.headers.get("accept", ""))
    if wants_csv:
        return Response(
            to_csv(result.columns, result.rows),
            media_type="text/csv; charset=utf-8",
            headers={
                "X-Chunkledger-Types": ",".join(result.types),
                "X-Chunkledger-Truncated": "true" if result.truncated else "false",
                "X-Chunkledger-Truncated-By": result.truncated_by or "",
                "X-Chunkledger-Elapsed-S": f"{result.elapsed_s:.6f}",
            },
        )
    return Response(dumps(result.as_dict()), media_type="application/json")


@router.get(
    "/export/{table}.parquet",
    response_model=None,
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {PARQUET: {"schema": {"type": "string", "format": "binary"}}},
            "description": "a Parquet file (Content-Disposition: attachment), streamed a row group at a time",
        },
        **errors.responses(400, *errors.AUTH, 404, 422, 503),
    },
)
def export_table(
    table: str,
    reads: ReadsDep,
    since: str | None = Query(None, description="ISO 8601, unix seconds, or an age such as 1h"),
    until: str | None = Query(None, description="ISO 8601, unix seconds, or an age; open when absent"),
) -> Response:
    """One table's rows for a window as a Parquet file, streamed one row group per batch. A client that
    stops reading for ``send_timeout_s`` is abandoned and the export's connection released."""
    if table not in export.TABLES:
        return errors.error_response(
            status.HTTP_404_NOT_FOUND, f"table: no export for {table!r}; one of {', '.join(export.TABLES)}"
        )
    try:
        window = export.Window(
            since=None if since is None else export.parse_time(since, field="since"),
            until=None if until is None else export.parse_time(until, field="until"),
        )
    except ValueError as exc:
        return errors.error_response(status.HTTP_400_BAD_REQUEST, str(exc), reason="bad_time")
    if reads.dialect not in ("duckdb", "postgresql"):
        return errors.error_response(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "this ledger's store keeps no tables to export",
            reason="no_database",
        )
    stack = contextlib.ExitStack()
    try:
        conn = stack.enter_context(reads.snapshot())
        schema, batches = export.table_batches(conn, reads.dialect, table, window)
    except Exception as exc:  # the database refused the fixed export query: say so, not a bare 500
        stack.close()
        return errors.error_response(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"export of {table} failed: {str(exc).splitlines()[0] if str(exc) else exc!r}",
            reason="unavailable",
        )

    def body() -> Iterator[bytes]:
        with stack:
            yield from export.parquet_stream(schema, batches)

    return ThreadedStream(
        body(),  # type: ignore[arg-type]
        media_type="application/vnd.apache.parquet",
        headers={"Content-Disposition": f'attachment; filename="{table}.parquet"'},
        nice=reads.settings.read_nice,
    )
