"""Run Alembic migrations programmatically (the service upgrades on start).

Alembic's folder is ``migrations/`` at the top of a checkout; an install holds it inside the ledger
(``ledger/migrations/``, mapped by setup.py), so installing chunkledger adds no top-level ``migrations``
package to collide with a user's own. Nothing imports it by a package name: Alembic loads its files
by path, and a revision that reuses an earlier one's SQL loads it with :func:`revision_module`.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory


def _migrations_dir() -> Path:
    installed = Path(__file__).with_name("migrations")  # ledger/migrations/ in an install
    return installed if installed.is_dir() else Path(__file__).resolve().parents[1] / "migrations"


MIGRATIONS_DIR = _migrations_dir()


@functools.cache
def revision_module(name: str) -> ModuleType:
    """The revision file ``versions/<name>.py`` as a module, loaded by path as Alembic loads it."""
    path = MIGRATIONS_DIR / "versions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"chunkledger_revision_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no revision {name!r} in {path.parent}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Upgrade the database behind ``engine`` to ``revision``."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"transactional_ddl": True}).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("duckdb://")).get_current_head()


def downgrade(engine: sa.Engine, revision: str) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
