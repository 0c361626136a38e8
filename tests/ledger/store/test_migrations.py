"""Alembic owns the schema: migrations produce exactly the tables the code defines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from ledger import migrate, schema
from ledger.store import make_engine
from tests.support import ROOT


def _columns(engine: sa.Engine) -> dict[str, set[str]]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema IN ('main', 'public') AND table_name <> 'alembic_version' "
            "AND table_name NOT IN (SELECT table_name FROM information_schema.views "
            "WHERE table_schema IN ('main', 'public'))"
        ).all()
    out: dict[str, set[str]] = {}
    for table, col in rows:
        out.setdefault(table, set()).add(col)
    return out


def test_migrations_create_what_the_models_define(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _columns(engine) == {t.name: {c.name for c in t.columns} for t in schema.metadata.sorted_tables}
    if engine.dialect.name == "postgresql":  # full comparison (types, nullability, indexes) where reflectable
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, schema.metadata) == []
    engine.dispose()


def test_upgrade_is_idempotent_and_downgrade_round_trips(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    migrate.upgrade(engine)
    migrate.downgrade(engine, "base")
    assert _columns(engine) == {}
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert "request_rows" in _columns(engine)


def test_requests_view_has_every_row_column_and_the_attribution(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    with engine.connect() as conn:
        cols = [c[0] for c in conn.exec_driver_sql("SELECT * FROM requests LIMIT 0").cursor.description]
    assert cols == [c.name for c in schema.requests.columns]
    engine.dispose()
    engine.dispose()


def test_the_ledger_runs_its_own_revisions_where_a_users_migrations_package_is_importable(tmp_path):
    """Alembic projects have a top-level ``migrations`` package of their own; the ledger never imports
    one by that name, so from such a project's folder it still upgrades with its own revisions."""
    project = tmp_path / "project"
    (project / "migrations").mkdir(parents=True)
    (project / "migrations" / "__init__.py").write_text("raise SystemExit('the user package ran')\n")
    code = (
        "import sqlalchemy as sa; from ledger import migrate; "
        f"e = sa.create_engine('duckdb:///{tmp_path / 'ledger.duckdb'}'); migrate.upgrade(e); "
        "print(migrate.current_revision(e) == migrate.head_revision(), migrate.MIGRATIONS_DIR)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    current, folder = r.stdout.split()
    assert current == "True" and Path(folder) == ROOT / "migrations"
