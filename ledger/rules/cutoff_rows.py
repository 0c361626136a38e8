"""Batched writes to the ``cutoffs`` table: one statement per 500 rows on both backends."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

INSERT_ONE = sa.text(
    "INSERT INTO cutoffs (command_id, request_id, rule, action, detail, model, source_id, gateway_source_id, "
    "decided_ts, deliveries, state) VALUES (:command_id, :request_id, :rule, :action, :detail, :model, "
    ":source_id, :gateway_source_id, :decided_ts, 0, 'pending') ON CONFLICT DO NOTHING"
)


_INSERT_COLUMNS = (
    "command_id",
    "request_id",
    "rule",
    "action",
    "detail",
    "model",
    "source_id",
    "gateway_source_id",
    "decided_ts",
)


def insert_many(conn: Any, rows: list[dict[str, Any]]) -> None:
    """Multi-row ``INSERT ... ON CONFLICT DO NOTHING``, 500 rows per statement."""
    for start in range(0, len(rows), 500):
        chunk = rows[start : start + 500]
        params: dict[str, Any] = {}
        tuples = []
        for i, row in enumerate(chunk):
            for c in _INSERT_COLUMNS:
                params[f"{c}{i}"] = row[c]
            tuples.append("(" + ", ".join(f":{c}{i}" for c in _INSERT_COLUMNS) + ", 0, 'pending')")
        conn.execute(
            sa.text(
                f"INSERT INTO cutoffs ({', '.join(_INSERT_COLUMNS)}, deliveries, state) VALUES "
                f"{', '.join(tuples)} ON CONFLICT DO NOTHING"
            ),
            params,
        )


def values_update(conn: Any, sets: str, rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """One ``UPDATE cutoffs ... FROM (VALUES ...)`` per 500 rows: DuckDB runs an executemany as one
    statement per row (about a millisecond each); this is one statement on both backends.

    ``columns`` maps each value column to its SQL type; ``id`` (the command id) joins the rows."""
    names = list(columns)
    for start in range(0, len(rows), 500):
        chunk = rows[start : start + 500]
        params: dict[str, Any] = {}
        tuples = []
        for i, row in enumerate(chunk):
            cells = []
            for name in names:
                params[f"{name}{i}"] = row[name]
                cells.append(f"CAST(:{name}{i} AS {columns[name]})")
            tuples.append(f"({', '.join(cells)})")
        conn.execute(
            sa.text(
                f"UPDATE cutoffs SET {sets} FROM (VALUES {', '.join(tuples)}) AS v({', '.join(names)}) "
                "WHERE cutoffs.command_id = v.id"
            ),
            params,
        )
