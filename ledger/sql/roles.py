"""PostgreSQL: the read-only role ``/v1/sql`` runs as (``chunkledger sql-reader``)."""

from __future__ import annotations

import logging
import re
from typing import Any

import sqlalchemy as sa

from ledger.sql.guard import HIDDEN_TABLES, first_line

log = logging.getLogger(__name__)

# -- the PostgreSQL reader role ------------------------------------------------------------------


def grant_reader_role(
    engine: sa.Engine, role: str = "chunkledger_reader", password: str | None = None
) -> None:
    """Create (or update) a login role that may only SELECT the ledger's tables and views.

    Run it as the role that owns the ledger tables (the one the service connects with), so that
    tables and views later migrations create are readable too (ALTER DEFAULT PRIVILEGES).
    """
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role):
        raise ValueError(f"role: {role!r} is not a plain lower-case PostgreSQL name")
    with engine.begin() as conn:
        exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first()
        verb = "ALTER" if exists else "CREATE"
        attrs = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
        stmt = f"{verb} ROLE {role} {attrs}"
        if password is not None:
            stmt += " PASSWORD " + conn.exec_driver_sql("SELECT quote_literal(%s)", (password,)).scalar_one()
        conn.exec_driver_sql(stmt)
        db = conn.exec_driver_sql("SELECT current_database()").scalar_one()
        conn.exec_driver_sql(f'GRANT CONNECT ON DATABASE "{db}" TO {role}')
        conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        conn.exec_driver_sql(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {role}")
        _revoke_hidden(conn, role)


def _revoke_hidden(conn: Any, role: str) -> None:
    for table in sorted(HIDDEN_TABLES):
        if conn.exec_driver_sql("SELECT to_regclass(%s)", (f"public.{table}",)).scalar_one() is not None:
            conn.exec_driver_sql(f"REVOKE ALL ON public.{table} FROM {role}")


def sync_reader_grants(engine: sa.Engine, reader: str) -> None:
    """At service start (PostgreSQL, reader configured): SELECT on every ledger table and view for the
    reader role, none on ``HIDDEN_TABLES``; so tables and views a migration (re)created are readable.
    Best effort: a role that may not grant only logs why."""
    role = sa.engine.make_url(reader).username or ""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role):
        log.warning("sql reader role %r is not a plain name; grants not synced", role)
        return
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
            _revoke_hidden(conn, role)
    except sa.exc.SQLAlchemyError as exc:
        log.warning(
            "could not sync the SQL reader's grants: %s", first_line(getattr(exc, "orig", None) or exc)
        )


def reader_url(url: str, role: str, password: str | None = None) -> str:
    """``url`` with the reader role's name (and password) in place of the owner's."""
    parsed = sa.engine.make_url(url).set(username=role, password=password)
    return parsed.render_as_string(hide_password=False)
