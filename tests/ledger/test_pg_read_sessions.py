"""PostgreSQL read connections run on the read budgets and without JIT: compiling the ledger's short
reads (whose estimates through the ``requests`` view are large) took 2.7 of a 2.8 s attribution."""

from __future__ import annotations

from ledger.config import Settings
from ledger.reads import Reads
from ledger.store import open_store


def test_a_postgres_read_connection_has_jit_off_and_the_read_budgets(pg_database):
    store = open_store(pg_database)
    reads = Reads(store, Settings(read_timeout_s=3, read_work_mem="8MB"))
    try:
        assert reads.engine is not None
        with reads.engine.connect() as conn:
            shown = {
                k: conn.exec_driver_sql(f"SHOW {k}").scalar()
                for k in ("jit", "statement_timeout", "work_mem")
            }
        assert shown == {"jit": "off", "statement_timeout": "3s", "work_mem": "8MB"}
        with store.engine.connect() as conn:  # the writer's merges keep JIT (7-11 % faster with it)
            assert conn.exec_driver_sql("SHOW jit").scalar() == "on"
    finally:
        reads.close()
        store.close()
