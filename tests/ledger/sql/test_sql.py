"""Read-only SQL: POST /v1/sql on both backends, the guards each database enforces, and the CLI."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator

import duckdb
import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from engine_hooks import events as ev
from ledger import sql
from ledger.app import create_app
from ledger.config import Settings
from ledger.schema import step_request_ids_sql
from ledger.store import open_store
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered
from tests.support.servers import LedgerServer

RD = {"Authorization": "Bearer rd"}
ING = {"Authorization": "Bearer ing", "content-type": "application/json"}
TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
T0 = 1_700_000_000.0


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def reader_role(pg_database: str) -> Iterator[str]:
    """A per-run read-only role name; dropped (with its grants) at the end."""
    role = f"chunkledger_reader_{uuid.uuid4().hex[:8]}"
    yield role
    eng = sa.create_engine(pg_database, isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        if conn.exec_driver_sql("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).first():
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
    eng.dispose()


def sql_settings(db_url: str, request: pytest.FixtureRequest, **kw) -> Settings:
    """Settings for ``db_url``; on PostgreSQL the schema is migrated and the reader role granted."""
    extra = {}
    if db_url.startswith("postgresql"):
        role = request.getfixturevalue("reader_role")
        open_store(db_url).close()
        eng = sa.create_engine(db_url)
        sql.grant_reader_role(eng, role)
        eng.dispose()
        extra["sql_reader_url"] = sql.reader_url(db_url, role)
    return Settings(db_url=db_url, **TOKENS, **{**extra, **kw})


@pytest.fixture
def client(db_url: str, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    """A ledger holding one request, on a fresh database (for tests that write or reconfigure)."""
    with TestClient(create_app(sql_settings(db_url, request, sql_timeout_s=1.0))) as c:
        _ingest(c, "r1")
        yield c


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def ro(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One ledger per backend shared by the tests that only read (and check that nothing changed)."""
    if request.param == "duckdb":
        url = f"duckdb:///{tmp_path_factory.mktemp('sql') / 'ledger.duckdb'}"
        admin = None
    else:
        base = request.getfixturevalue("pg_database")
        name = f"chunkledger_sql_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        url = base.rsplit("/", 1)[0] + f"/{name}"
    try:
        with TestClient(create_app(sql_settings(url, request, sql_timeout_s=1.0))) as c:
            _ingest(c, "r1")
            c.db_url = url  # type: ignore[attr-defined]
            yield c
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()


def _ingest(c: TestClient, rid: str, t0: float = T0, start: int = 1) -> int:
    gw, en = lifecycle(rid, t0)
    steps = [ev.Step(seq=0, ts=t0 + 0.2, step=1, duration_s=0.01, prefill_tokens=128, request_ids=[rid])]
    total = 0
    for source, evs in ((ENGINE, en + steps), (GATEWAY, gw)):
        r = c.post("/v1/events", content=body(source, numbered(evs, start)), headers=ING)
        assert r.status_code == 200, r.text
        total += r.json()["accepted"]
    return total


def _sql(c, query: str, **kw):
    return c.post("/v1/sql", json={"sql": query, **kw}, headers=RD)


def _count(c, table: str) -> int:
    r = _sql(c, f"SELECT count(*) AS n FROM {table}")
    assert r.status_code == 200, r.text
    return r.json()["rows"][0][0]


def _dialect(db_url: str) -> str:
    return "duckdb" if db_url.startswith("duckdb") else "postgresql"


# -- results -------------------------------------------------------------------------------------


def test_select_on_the_requests_view_returns_columns_portable_types_and_rows(ro):
    r = _sql(ro, "SELECT request_id, prompt_tokens, e2e_s, ttft_s, finish_reason FROM requests")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["columns"] == ["request_id", "prompt_tokens", "e2e_s", "ttft_s", "finish_reason"]
    assert out["types"] == ["string", "integer", "float", "float", "string"]
    ((rid, prompt, e2e, ttft, reason),) = out["rows"]
    assert (rid, prompt, reason) == ("r1", 300, "stop")
    assert e2e == pytest.approx(2.0, abs=1e-6)  # gateway arrived -> completed
    assert 0 < ttft < e2e
    assert out["truncated"] is False and 0 <= out["elapsed_s"] < 5


def test_list_columns_come_back_as_json_lists(ro):
    out = _sql(ro, f"SELECT step, {step_request_ids_sql()} AS request_ids, request_keys FROM steps").json()
    assert out["types"] == ["integer", "list<string>", "list<integer>"]
    assert out["rows"] == [[1, ["r1"], [1]]]


def test_values_are_json_safe_nan_infinity_timestamps_decimals(ro):
    out = _sql(
        ro,
        "SELECT CAST('NaN' AS DOUBLE PRECISION) AS nan, CAST('Infinity' AS DOUBLE PRECISION) AS inf, "
        "to_timestamp(0) AS t, CAST(1.25 AS DECIMAL(6,2)) AS d, CAST(7 AS DECIMAL(10,0)) AS whole, "
        "CAST(NULL AS TEXT) AS nothing",
    ).json()
    assert out["types"] == ["float", "float", "timestamp", "decimal", "decimal", "string"]
    nan, inf, t, d, whole, nothing = out["rows"][0]
    assert nan is None and inf is None and nothing is None
    assert dt.datetime.fromisoformat(t) == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert d == 1.25 and whole == 7 and isinstance(whole, int)


def test_named_params_bind_on_both_backends_and_percent_signs_survive(ro):
    r = _sql(
        ro,
        "SELECT request_id, '100%' AS pct FROM requests WHERE request_id = $rid AND prompt_tokens > $min",
        params={"rid": "r1", "min": 10},
    )
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [["r1", "100%"]]
    assert (
        _sql(ro, "SELECT request_id FROM requests WHERE request_id = $rid", params={"rid": "x"}).json()[
            "rows"
        ]
        == []
    )


def test_bad_params_are_a_400_naming_the_parameter(ro):
    r = _sql(ro, "SELECT $x AS v", params={"x": {"nested": 1}})
    assert r.status_code == 400 and r.json()["reason"] == "params" and "params.x" in r.json()["detail"]


def test_csv_by_query_parameter_or_accept_header(ro):
    q = {"sql": "SELECT request_id, prompt_tokens, e2e_s IS NOT NULL AS done FROM requests"}
    by_param = ro.post("/v1/sql?format=csv", json=q, headers=RD)
    by_accept = ro.post("/v1/sql", json=q, headers={**RD, "Accept": "text/csv"})
    for r in (by_param, by_accept):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/csv")
        assert r.text == "request_id,prompt_tokens,done\nr1,300,true\n"
        assert r.headers["x-chunkledger-types"] == "string,integer,boolean"
        assert r.headers["x-chunkledger-truncated"] == "false"


# -- row cap and time limit -----------------------------------------------------------------------


def test_row_cap_truncates_and_says_so(ro):
    n = _count(ro, "events")
    capped = _sql(ro, "SELECT seq FROM events", max_rows=2).json()
    assert len(capped["rows"]) == 2 and capped["truncated"] is True
    whole = _sql(ro, "SELECT seq FROM events", max_rows=n).json()
    assert len(whole["rows"]) == n and whole["truncated"] is False


def test_row_cap_streams_instead_of_computing_a_huge_result(ro):
    big = (
        "SELECT * FROM range(1000000000000) AS t(i)"
        if _dialect(ro.db_url) == "duckdb"
        else "SELECT generate_series(1, 1000000000000) AS i"  # in FROM it would be materialised first
    )
    t = time.perf_counter()
    out = _sql(ro, big, max_rows=10).json()
    assert len(out["rows"]) == 10 and out["truncated"] is True
    assert time.perf_counter() - t < 1.0  # well inside the 1 s time limit: nothing materialised


def test_an_answer_is_cut_at_the_byte_cap_before_it_is_built_and_says_so(db_url, request):
    # 10,000 rows of 50 KB strings was a 500 MB answer under the row cap alone
    with TestClient(create_app(sql_settings(db_url, request, sql_max_bytes=1 << 20))) as c:
        big = (
            "SELECT i, repeat('x', 50000) AS s FROM range(10000) AS t(i)"
            if _dialect(db_url) == "duckdb"
            else "SELECT i, repeat('x', 50000) AS s FROM generate_series(1, 10000) AS i"
        )
        r = _sql(c, big)
        out = r.json()
        assert r.status_code == 200 and out["truncated"] is True and out["truncated_by"] == "bytes"
        assert 15 <= len(out["rows"]) <= 21 and len(r.content) < 1.1 * (1 << 20)  # ~1 MiB of 50 KB rows
        small = _sql(c, "SELECT 1 AS one").json()
        assert small["truncated"] is False and small["truncated_by"] is None
        capped = _sql(c, big.replace("50000", "1"), max_rows=5).json()
        assert capped["truncated_by"] == "rows"


def test_max_rows_above_the_ledger_limit_is_a_400_naming_max_rows(db_url, request):
    with TestClient(create_app(sql_settings(db_url, request, sql_max_rows=50))) as c:
        r = _sql(c, "SELECT 1", max_rows=51)
        assert r.status_code == 400
        assert r.json() == {
            "reason": "max_rows",
            "detail": "max_rows: 51 is above this ledger's limit 50 (sql_max_rows)",
        }
        assert _sql(c, "SELECT 1", max_rows=0).status_code == 422  # validation names the field
        assert len(_sql(c, "SELECT * FROM (VALUES (1),(2),(3)) AS v(x)").json()["rows"]) == 3


def test_a_slow_query_stops_at_the_time_limit_with_a_408_and_ingest_goes_on(client, db_url):
    slow = (
        "SELECT count(*) FROM range(1000000000000) AS a(i), range(1000) AS b(j)"
        if _dialect(db_url) == "duckdb"
        else "SELECT pg_sleep(30)"
    )
    t = time.perf_counter()
    r = _sql(client, slow)
    assert time.perf_counter() - t < 5
    assert r.status_code == 408
    assert r.json() == {"reason": "timeout", "detail": "query stopped at the 1 s time limit (sql_timeout_s)"}
    before = _count(client, "events")
    accepted = _ingest(client, "r2", T0 + 10, start=100)  # new seqs: r1's are stored (a replay is a 409)
    assert accepted and _count(client, "events") == before + accepted


# -- refusals ------------------------------------------------------------------------------------

REFUSED = [
    ("DELETE FROM events", "not_read_only", "DELETE refused: DML"),
    ("INSERT INTO sources VALUES ('x', 'engine', NULL, 0, 0, 0, 0, 0)", "not_read_only", "INSERT refused"),
    ("UPDATE request_rows SET prompt_tokens = 0", "not_read_only", "UPDATE refused"),
    ("DROP TABLE events", "not_read_only", "DROP refused: DDL"),
    ("CREATE TABLE x (a INTEGER)", "not_read_only", "CREATE refused: DDL"),
    ("ALTER TABLE events ADD COLUMN x INTEGER", "not_read_only", "ALTER refused: DDL"),
    ("COPY events TO '/tmp/chunkledger_leak.csv'", "not_read_only", "COPY refused"),
    ("ATTACH '/tmp/other.db' AS other", "not_read_only", "ATTACH refused"),
    ("SET threads = 1", "not_read_only", "SET refused: changing settings"),
    ("RESET threads", "not_read_only", "SET refused"),
    ("PRAGMA version", "not_read_only", "PRAGMA refused"),
    ("BEGIN", "not_read_only", "TRANSACTION refused"),
    ("LOAD httpfs", "not_read_only", "LOAD refused"),
    ("SELECT 1; DELETE FROM events", "multiple_statements", "2 statements sent"),
    ("   ", "empty", "sql is empty"),
    ("-- only a comment", "empty", "no statement"),
]


@pytest.mark.parametrize(("query", "reason", "detail"), REFUSED)
def test_writes_files_settings_and_multiple_statements_are_refused_with_a_400(ro, query, reason, detail):
    before = _count(ro, "events")
    r = _sql(ro, query)
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == reason
    assert detail in r.json()["detail"]
    assert _count(ro, "events") == before


def test_a_write_hidden_inside_a_select_is_refused_by_the_database(ro):
    before = _count(ro, "events")
    r = _sql(ro, "WITH d AS (DELETE FROM events RETURNING *) SELECT count(*) FROM d")
    assert r.status_code == 400 and r.json()["reason"] == "not_read_only", r.text
    assert "read-only transaction" in r.json()["detail"]
    assert _count(ro, "events") == before


@pytest.mark.parametrize(
    "query", ["EXPLAIN ANALYZE DELETE FROM events", "EXPLAIN (FORMAT json) DROP TABLE steps"]
)
def test_explain_of_a_write_is_refused(ro, query):
    before = _count(ro, "events")
    r = _sql(ro, query)
    assert r.status_code == 400 and r.json()["reason"] in ("not_read_only", "syntax"), r.text
    assert _count(ro, "events") == before and _count(ro, "steps") >= 0


FILE_READS = {
    "duckdb": [
        ("SELECT * FROM read_csv('/etc/passwd')", "permission_denied"),  # table function not allowed
        ("SELECT * FROM read_parquet('https://example.com/x.parquet')", "permission_denied"),
        ("SELECT * FROM 'https://example.com/x.parquet'", "external_access"),  # refused by DuckDB itself
        ("SELECT * FROM '/etc/passwd'", "query_error"),  # no replacement scan of paths: an unknown table
    ],
    "postgresql": [
        ("SELECT pg_read_file('/etc/passwd')", "permission_denied"),
        ("SELECT * FROM pg_ls_dir('.')", "permission_denied"),
        ("SELECT lo_import('/etc/passwd')", "permission_denied"),
        ("SELECT pg_read_binary_file('/etc/hostname')", "permission_denied"),
    ],
}


@pytest.mark.parametrize("index", range(4))
def test_reading_files_or_urls_is_refused_by_the_database(ro, index):
    cases = FILE_READS[_dialect(ro.db_url)]
    if index >= len(cases):
        pytest.skip("fewer file functions on this backend")
    query, reason = cases[index]
    r = _sql(ro, query)
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == reason
    assert "root:" not in r.text


CREDENTIALS = {
    "duckdb": [
        ("SELECT secret FROM webhook_subscriptions", "webhook_subscriptions is not readable"),
        ("SELECT * FROM main.webhook_subscriptions WHERE id = $x", "webhook_subscriptions is not readable"),
        ("SUMMARIZE webhook_subscriptions", "webhook_subscriptions is not readable"),
        ("SELECT * FROM query_table('webhook_subscriptions')", "table function query_table is not allowed"),
        ("SELECT * FROM query('SELECT * FROM webhook_' || 'subscriptions')", "table function query is not"),
        ("SELECT * FROM pragma_storage_info('webhook_subscriptions')", "pragma_storage_info is not allowed"),
    ],
    "postgresql": [
        ("SELECT secret FROM webhook_subscriptions", "permission denied for table webhook_subscriptions"),
        ("SELECT * FROM public.webhook_subscriptions WHERE id = $x", "permission denied for table"),
        (
            "SELECT query_to_xml('SELECT * FROM webhook_' || 'subscriptions', true, false, '')",
            "permission denied",
        ),
    ],
}


@pytest.mark.parametrize("index", range(6))
def test_tables_holding_credentials_are_not_readable(ro, index):
    cases = CREDENTIALS[_dialect(ro.db_url)]
    if index >= len(cases):
        pytest.skip("fewer cases on this backend")
    query, detail = cases[index]
    r = _sql(ro, query, params={"x": "w1"} if "$x" in query else None)
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == "permission_denied"
    assert detail in r.json()["detail"]


def test_everyday_duckdb_sql_passes_the_syntax_tree_check(ro):
    if _dialect(ro.db_url) != "duckdb":
        pytest.skip("DuckDB syntax")
    for query in [
        "SELECT kind, count(*) FILTER (WHERE seq > 1), quantile_cont(ts, [0.5, 0.99]) FROM events "
        "GROUP BY ALL",
        "SELECT r.request_id FROM requests r JOIN request_keys k USING (request_id) "
        "JOIN steps s ON list_contains(s.request_keys, k.request_key) "
        "QUALIFY row_number() OVER (PARTITION BY r.request_id ORDER BY s.ts) = 1",
        "SELECT [x FOR x IN [1, 2, 3] IF x > 1] AS l, {'a': 1}.a AS a",
        "SELECT * FROM range(3)",
        "SELECT unnest(request_keys) FROM steps",
        "SELECT table_name FROM duckdb_tables() ORDER BY 1",
        "SELECT * FROM information_schema.columns WHERE table_name = 'requests'",
        "DESCRIBE requests",
        "SHOW TABLES",
    ]:
        r = _sql(ro, query)
        assert r.status_code == 200, (query, r.text)


def test_duckdb_sql_connections_cannot_touch_files_even_past_the_syntax_check(tmp_path):
    from ledger.store import open_store

    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    runner = sql.open_runner(store)
    try:
        with runner.read_transaction() as cur:  # type: ignore[attr-defined]
            for query in ("SELECT * FROM read_csv('/etc/passwd')", "SELECT * FROM glob('/etc/*')"):
                with pytest.raises(duckdb.PermissionException):
                    cur.execute(query)
        with (
            runner.read_transaction() as cur,  # type: ignore[attr-defined]
            pytest.raises(duckdb.TransactionException, match="read-only"),
        ):
            cur.execute("DELETE FROM events")
        with runner.read_transaction() as cur:  # type: ignore[attr-defined]
            assert cur.execute("SELECT current_setting('enable_external_access')").fetchone() == (False,)
            with pytest.raises(duckdb.Error):
                cur.execute("SET enable_external_access = true")
        _gw, en = lifecycle("r1")
        assert store.write([ev.Batch(source=ENGINE, events=numbered(en))])[0].accepted == len(en)
    finally:
        runner.close()
        store.close()


def test_a_select_cannot_switch_the_transaction_or_external_access_back_on(ro):
    if _dialect(ro.db_url) == "postgresql":
        r = _sql(ro, "SELECT set_config('transaction_read_only', 'off', true)")
        assert r.status_code == 400 and r.json()["reason"] == "not_read_only"
        assert _sql(ro, "SHOW transaction_read_only").status_code == 400  # not a SELECT: refused
    else:
        out = _sql(ro, "SELECT current_setting('enable_external_access') AS v").json()
        assert out["rows"] == [[False]]
    r = _sql(
        ro, "SELECT * FROM query('DELETE FROM events')" if _dialect(ro.db_url) == "duckdb" else "SELECT 1"
    )
    assert r.status_code in (200, 400)
    assert _count(ro, "events") > 0


def test_syntax_errors_and_unknown_tables_are_400s_with_the_database_message(ro):
    r = _sql(ro, "SELEC 1")
    assert r.status_code == 400 and r.json()["reason"] == "syntax" and "SELEC" in r.json()["detail"]
    r = _sql(ro, "SELECT * FROM no_such_table")
    assert r.status_code == 400 and r.json()["reason"] == "query_error"
    assert "no_such_table" in r.json()["detail"]


def test_explain_is_allowed(ro):
    r = _sql(ro, "EXPLAIN SELECT * FROM events WHERE seq > 3")
    assert r.status_code == 200, r.text
    assert r.json()["rows"]
    assert _sql(ro, "EXPLAIN ANALYZE SELECT count(*) FROM steps").status_code == 200


def test_explain_cannot_reach_hidden_tables_or_banned_functions_on_duckdb(ro):
    if _dialect(ro.db_url) != "duckdb":
        pytest.skip("PostgreSQL's grants cover EXPLAIN")
    for query in (
        "EXPLAIN ANALYZE SELECT * FROM webhook_subscriptions",
        "EXPLAIN SELECT * FROM checkpoint()",
    ):
        r = _sql(ro, query)
        assert r.status_code == 400 and r.json()["reason"] == "permission_denied", r.text


def test_sql_needs_the_read_token(ro):
    assert ro.post("/v1/sql", json={"sql": "SELECT 1"}).status_code == 401
    bad = ro.post("/v1/sql", json={"sql": "SELECT 1"}, headers={"Authorization": "Bearer ing"})
    assert bad.status_code == 403
    assert (
        ro.post("/v1/sql", json={"sql": "SELECT 1"}, headers={"Authorization": "Bearer adm"}).status_code
        == 200
    )


def test_unknown_body_fields_are_a_422(ro):
    r = ro.post("/v1/sql", json={"sql": "SELECT 1", "timeout": 5}, headers=RD)
    assert r.status_code == 422 and "timeout" in r.text


# -- PostgreSQL roles ----------------------------------------------------------------------------


def test_postgres_refuses_sql_as_a_role_that_can_read_server_files(pg_database):
    # The test database's owner is a superuser: without a reader URL /v1/sql must not run as it.
    with TestClient(create_app(Settings(db_url=pg_database, **TOKENS))) as c:
        r = _sql(c, "SELECT 1")
    assert r.status_code == 503
    assert r.json()["reason"] == "unavailable"
    assert "is a superuser" in r.json()["detail"] and "CHUNKLEDGER_SQL_READER_URL" in r.json()["detail"]


def test_reader_grants_are_synced_at_start_and_a_reader_that_can_read_secrets_is_refused(
    pg_database, request
):
    settings = sql_settings(pg_database, request)
    role = sa.engine.make_url(settings.sql_reader_url).username
    owner = sa.create_engine(pg_database)
    with owner.begin() as conn:
        conn.exec_driver_sql(f"GRANT SELECT ON webhook_subscriptions TO {role}")
    with TestClient(create_app(settings)) as c:  # the service revokes it at start
        assert _sql(c, "SELECT count(*) FROM events").status_code == 200
        with owner.begin() as conn:
            conn.exec_driver_sql(f"GRANT SELECT ON webhook_subscriptions TO {role}")
        r = _sql(c, "SELECT count(*) FROM events")
        assert r.status_code == 503
        assert "can read webhook_subscriptions" in r.json()["detail"]
        with owner.begin() as conn:
            conn.exec_driver_sql(f"REVOKE ALL ON webhook_subscriptions FROM {role}")
        assert _sql(c, "SELECT count(*) FROM events").status_code == 200
    owner.dispose()


def test_sql_reader_command_makes_a_role_that_can_select_but_not_write(pg_database, reader_role):
    open_store(pg_database).close()
    res = CliRunner().invoke(cli_app, ["sql-reader", "--db", pg_database, "--role", reader_role])
    assert res.exit_code == 0, res.output
    assert "CHUNKLEDGER_SQL_READER_URL=" in res.output
    eng = sa.create_engine(sql.reader_url(pg_database, reader_role), poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        conn.exec_driver_sql("SELECT count(*) FROM requests").scalar_one()
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
            conn.exec_driver_sql("INSERT INTO sources VALUES ('x', 'engine', NULL, 0, 0, 0, 0, 0)")
    eng.dispose()


def test_sql_reader_command_refuses_duckdb():
    res = CliRunner().invoke(cli_app, ["sql-reader", "--db", "duckdb:///x.duckdb"])
    assert res.exit_code == 2 and "postgresql URL" in res.output


# -- the real server and the CLI -----------------------------------------------------------------


def test_real_server_keeps_ingesting_during_and_after_bad_queries_and_loses_nothing(tmp_path):
    server = LedgerServer(
        f"duckdb:///{tmp_path / 'ledger.duckdb'}",
        tmp_path / "ledger.log",
        env={"CHUNKLEDGER_SQL_TIMEOUT_S": "1.5"},
    )
    server.start()
    try:
        url = server.url
        slow = "SELECT count(*) FROM range(1000000000000) AS a(i), range(1000) AS b(j)"
        answers: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{url}/v1/sql", json={"sql": slow}))
        )
        worker.start()
        accepted = 0
        seq = 1
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline or worker.is_alive():  # ingest while the slow query runs
            _gw, en = lifecycle(f"live-{seq}", T0 + seq)
            r = httpx.post(f"{url}/v1/events", content=body(ENGINE, numbered(en, seq)), timeout=10)
            assert r.status_code == 200
            accepted += r.json()["accepted"]
            seq += len(en)
        worker.join()
        assert answers[0].status_code == 408 and answers[0].json()["reason"] == "timeout"
        for bad in (
            "DROP TABLE events",
            "SELECT * FROM read_csv('/etc/passwd')",
            "SELECT 1; SELECT 2",
            "SELEC",
        ):
            assert httpx.post(f"{url}/v1/sql", json={"sql": bad}).status_code == 400
        _gw, en = lifecycle("after", T0 + 10_000)
        r = httpx.post(f"{url}/v1/events", content=body(ENGINE, numbered(en, seq)), timeout=10)
        accepted += r.json()["accepted"]
        count = httpx.post(f"{url}/v1/sql", json={"sql": "SELECT count(*) FROM events"}).json()
        assert count["rows"] == [[accepted]]

        # chunkledger query against the same server
        cli = CliRunner()
        res = cli.invoke(
            cli_app,
            ["query", "SELECT request_id, prompt_tokens FROM requests ORDER BY 1 LIMIT 2", "--ledger", url],
        )
        assert res.exit_code == 0, res.output
        lines = res.stdout.splitlines()
        assert lines[0].split("|")[0].strip() == "request_id" and lines[1].startswith("-")
        assert lines[2].split("|")[1].strip() == "300"  # numbers right-aligned in their column
        assert lines[-1].startswith("(2 rows")
        res = cli.invoke(cli_app, ["query", "SELECT 1 AS a, 'x,y' AS b", "--ledger", url, "--format", "csv"])
        assert res.stdout == 'a,b\n1,"x,y"\n'
        res = cli.invoke(cli_app, ["query", "SELECT $n AS n", "-p", "n=5", "--ledger", url, "-f", "json"])
        assert '"rows": [[5]]' in res.stdout
        res = cli.invoke(cli_app, ["query", "DELETE FROM events", "--ledger", url])
        assert res.exit_code == 1
        assert "error (400 not_read_only): DELETE refused" in res.output
        res = cli.invoke(cli_app, ["query", "SELECT 1", "--ledger", url, "--max-rows", "5000000"])
        assert res.exit_code == 1 and "max_rows: 5000000 is above this ledger's limit" in res.output
        res = cli.invoke(cli_app, ["query", "", "--ledger", url])
        assert (
            res.exit_code == 1
            and "error (422 invalid): sql: String should have at least 1 character" in res.output
        )
    finally:
        server.stop()
    res = CliRunner().invoke(cli_app, ["query", "SELECT 1", "--ledger", url])
    assert res.exit_code == 2 and "cannot reach the ledger" in res.output


# -- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "kind"),
    [
        ("SELECT 1", "SELECT"),
        ("WITH x AS (SELECT 1) SELECT * FROM x", "SELECT"),
        ("FROM events", "SELECT"),
        ("DESCRIBE events", "SELECT"),
        ("VALUES (1)", "SELECT"),
        ("EXPLAIN SELECT 1", "EXPLAIN"),
        ("select 1 -- ; drop table events", "SELECT"),
    ],
)
def test_classify_accepts_read_statements(query, kind):
    assert sql.classify(query) == kind


def test_classify_passes_sql_duckdb_cannot_parse_to_postgres_when_not_strict():
    pg_only = "SELECT x FROM events TABLESAMPLE SYSTEM (10) REPEATABLE (1) FOR SHARE OF events NOWAIT"
    with pytest.raises(sql.SqlError):
        sql.classify(pg_only)
    assert sql.classify(pg_only, strict=False) == "SELECT"


def test_dollar_params_become_psycopg_placeholders_outside_strings_and_comments():
    out = sql._pg_placeholders("SELECT $a, '$b %' -- $c\nFROM t WHERE x LIKE 'a%' AND y = $long_name")
    assert out == "SELECT %(a)s, '$b %%' -- $c\nFROM t WHERE x LIKE 'a%%' AND y = %(long_name)s"


@pytest.mark.parametrize(
    ("native", "portable"),
    [
        ("BIGINT", "integer"),
        ("HUGEINT", "integer"),
        ("int8", "integer"),
        ("DOUBLE", "float"),
        ("float8", "float"),
        ("DECIMAL(18,3)", "decimal"),
        ("numeric", "decimal"),
        ("VARCHAR", "string"),
        ("text", "string"),
        ("VARCHAR[]", "list<string>"),
        ("text[]", "list<string>"),
        ("TIMESTAMP WITH TIME ZONE", "timestamp"),
        ("timestamptz", "timestamp"),
        ("STRUCT(x INTEGER)", "struct"),
        ("MAP(VARCHAR, INTEGER)", "map"),
        ("BOOLEAN", "boolean"),
        ("jsonb", "json"),
    ],
)
def test_type_names_are_portable(native, portable):
    assert sql.type_name(native) == portable


def test_table_format_aligns_columns_and_trims_floats():
    text = sql.to_table(
        ["name", "n", "x", "tags"],
        ["string", "integer", "float", "list<string>"],
        [["a", 5, 1.5, ["p"]], ["bb", 12, None, []]],
    )
    assert text.splitlines() == [
        "name |  n |    x | tags",
        "-----+----+------+------",
        'a    |  5 |  1.5 | ["p"]',
        "bb   | 12 | NULL | []",
    ]


def test_param_option_reads_json_values_else_strings():
    assert sql.parse_param("n=5") == ("n", 5)
    assert sql.parse_param("s=abc") == ("s", "abc")
    assert sql.parse_param("f=1.5") == ("f", 1.5)
    with pytest.raises(ValueError, match="name=value"):
        sql.parse_param("nothing")


def test_more_concurrent_queries_than_the_limit_get_a_429_busy_at_once():
    release = threading.Event()

    class Blocking(sql.SqlRunner):
        max_concurrent = 2

        def _run(self, query, params, *, max_rows, timeout_s, max_bytes=None):
            release.wait(10)
            return sql.SqlResult(["x"], ["integer"], [[1]], False, 0.0)

    runner = Blocking()
    workers = [
        threading.Thread(target=runner.run, args=("SELECT 1",), kwargs={"max_rows": 1, "timeout_s": 1})
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(sql.SqlError) as err:
        runner.run("SELECT 1", max_rows=1, timeout_s=1)
    assert (err.value.reason, err.value.status) == ("busy", 429)
    assert time.monotonic() - t0 < 0.5  # no worker thread waits for a slot
    release.set()
    for w in workers:
        w.join()
    assert runner.run("SELECT 1", max_rows=1, timeout_s=1).rows == [[1]]  # slots come back
