"""The read-only SQL the pages send through ``POST /v1/sql`` where no named read answers (the bench
times the same text: ``bench.reads``)."""

from __future__ import annotations

from typing import Any


def sql_literal(value: Any) -> str:
    """A SQL string literal (for ids the dashboard puts in read-only queries)."""
    return "'" + str(value).replace("'", "''") + "'"


def step_bars_sql(request: dict[str, Any]) -> str | None:
    """The engine steps a request ran in or sat out, from its first scheduling to its last step (None:
    it never ran). The ``ts`` range lets DuckDB skip the other row groups; ``array_position`` finds its
    key in a step's list in one pass (``= ANY`` took 4x as long on DuckDB: ``ledger.analytics.common
    .ran_in_step``), on PostgreSQL too."""
    src, lo = request.get("engine_source_id"), request.get("first_scheduled_ts")
    hi = request.get("last_step_ts") or request.get("end_ts") or request.get("last_event_ts")
    if not src or lo is None or hi is None:
        return None
    rid = sql_literal(request["request_id"])
    key = f"(SELECT request_key FROM request_keys WHERE request_id = {rid})"
    ran = f"coalesce(array_position(request_keys, {key}) IS NOT NULL, false)"
    return (
        "SELECT step, ts, duration_s, prefill_tokens, num_decode_reqs, "
        f"{ran} AS ran FROM steps WHERE source_id = {sql_literal(src)} "
        f"AND ts >= {lo - 1e-6!r} AND ts <= {hi!r} "
        f"AND ({ran} OR {rid} = ANY(stalled_request_ids)) ORDER BY step"
    )
