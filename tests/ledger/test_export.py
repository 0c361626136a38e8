"""Parquet export: windows, both backends, through the service and straight from the database."""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from engine_hooks import events as ev
from ledger import export, schema
from ledger.app import create_app
from ledger.config import Settings
from ledger.records import as_json
from ledger.store import open_store
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered
from tests.support.servers import LedgerServer

T0 = 1_700_000_000.0
RD = {"Authorization": "Bearer rd"}
ING = {"Authorization": "Bearer ing", "content-type": "application/json"}
TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
LIST = pa.list_(pa.string())


def _events(rid: str, t0: float) -> tuple[list, list]:
    gw, en = lifecycle(rid, t0)
    en = [*en, ev.Step(seq=0, ts=t0 + 0.2, step=int(t0) % 1000, duration_s=0.01, request_ids=[rid])]
    return gw, en


def _fill(post) -> dict[str, int]:
    """Two requests 1000 s apart; the events each window should hold."""
    counts = {}
    seq = {ENGINE.id: 1, GATEWAY.id: 1}
    for rid, t0 in (("early", T0), ("late", T0 + 1000)):
        gw, en = _events(rid, t0)
        for source, evs in ((ENGINE, en), (GATEWAY, gw)):
            post(source, numbered(evs, seq[source.id]))
            seq[source.id] += len(evs)
        counts[rid] = len(gw) + len(en)
    return counts


def _check_late_window(tables: dict[str, pa.Table], counts: dict[str, int]) -> None:
    """What a window holding only the second request must contain."""
    req = tables["requests"]
    assert req.column("request_id").to_pylist() == ["late"]
    for col in ("e2e_s", "ttft_s", "prefill_s", "decode_s", "start_ts", "prompt_tokens", "model"):
        assert col in req.column_names  # the view's attribution columns travel with the rows
    assert req.column("prompt_tokens").to_pylist() == [300]
    assert req.schema.field("e2e_s").type == pa.float64()
    assert req.schema.field("prompt_tokens").type == pa.int64()
    events = tables["events"]
    assert events.num_rows == counts["late"]
    assert set(events.column("request_id").drop_null().to_pylist()) == {"late"}
    steps = tables["steps"]
    assert steps.num_rows == 1
    assert pa.types.is_list(steps.schema.field("request_ids").type)
    assert steps.column("request_ids").to_pylist() == [["late"]]
    assert sorted(tables["sources"].column("source_id").to_pylist()) == ["engine-0", "gw-0"]


def _read_dir(out: Path) -> dict[str, pa.Table]:
    return {t: pq.read_table(out / f"{t}.parquet") for t in export.TABLES}


def test_export_dir_writes_each_table_for_the_window_straight_from_the_database(db_url, tmp_path):
    store = open_store(db_url)
    counts = _fill(lambda source, evs: store.write([ev.Batch(source=source, events=evs)]))
    store.close()  # DuckDB: the service is not running, so the file is free
    with export.direct_connection(db_url) as (conn, dialect):
        manifest = as_json(export.export_dir(conn, dialect, export.Window(since=T0 + 500), tmp_path / "out"))
    tables = _read_dir(tmp_path / "out")
    _check_late_window(tables, counts)
    assert manifest["tables"]["events"]["rows"] == counts["late"]
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk["window"]["since"] == T0 + 500 and on_disk["window"]["until"] is None
    assert not list((tmp_path / "out").glob("*.part"))


def test_window_end_is_exclusive_and_both_backends_give_the_same_schema(db_url, tmp_path):
    store = open_store(db_url)
    counts = _fill(lambda source, evs: store.write([ev.Batch(source=source, events=evs)]))
    store.close()
    with export.direct_connection(db_url) as (conn, dialect):
        export.export_dir(conn, dialect, export.Window(since=T0 - 1, until=T0 + 1000), tmp_path / "o")
    tables = _read_dir(tmp_path / "o")
    assert tables["requests"].column("request_id").to_pylist() == ["early"]
    assert tables["events"].num_rows == counts["early"]
    for name, table in tables.items():  # the database's column types, the same from both backends
        assert [(f.name, f.type) for f in table.schema] == _expected_schema(name)


def _expected_schema(table: str) -> list[tuple[str, pa.DataType]]:
    arrow = {"BigInteger": pa.int64(), "Double": pa.float64(), "Text": pa.string(), "ARRAY": LIST}
    cols = getattr(schema, table).columns
    out = [(c.name, arrow[type(c.type).__name__]) for c in cols]
    # steps go out with their requests' ids, not the ledger's keys for them
    return [("request_ids", LIST) if name == "request_keys" else (name, t) for name, t in out]


def test_export_through_the_service_streams_parquet_for_the_window(db_url, tmp_path):
    with TestClient(create_app(Settings(db_url=db_url, **TOKENS))) as c:
        counts = _fill(
            lambda source, evs: c.post(
                "/v1/events", content=body(source, evs), headers=ING
            ).raise_for_status()
        )
        tables = {}
        for t in export.TABLES:
            r = c.get(f"/v1/export/{t}.parquet", params={"since": str(T0 + 500)}, headers=RD)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/vnd.apache.parquet"
            tables[t] = pq.read_table(io.BytesIO(r.content))
        _check_late_window(tables, counts)
        iso = dt.datetime.fromtimestamp(T0 + 500, dt.UTC).isoformat()
        r = c.get("/v1/export/events.parquet", params={"since": iso, "until": str(T0 + 5000)}, headers=RD)
        assert pq.read_table(io.BytesIO(r.content)).num_rows == counts["late"]


def test_export_endpoint_errors_name_the_field(db_url):
    with TestClient(create_app(Settings(db_url=db_url, **TOKENS))) as c:
        r = c.get("/v1/export/users.parquet", headers=RD)
        assert r.status_code == 404 and "one of requests, steps, events, sources" in r.json()["detail"]
        r = c.get("/v1/export/events.parquet", params={"since": "yesterday-ish"}, headers=RD)
        assert r.status_code == 400 and r.json()["detail"].startswith("since: 'yesterday-ish' is not a time")
        r = c.get("/v1/export/events.parquet", params={"since": "2000", "until": "1000"}, headers=RD)
        assert r.status_code == 400 and "until" in r.json()["detail"]
        assert c.get("/v1/export/events.parquet").status_code == 401


def test_export_command_through_a_running_ledger_then_with_db_once_it_stopped(tmp_path):
    server = LedgerServer(f"duckdb:///{tmp_path / 'ledger.duckdb'}", tmp_path / "ledger.log")
    server.start()
    import httpx

    try:
        counts = _fill(
            lambda source, evs: httpx.post(
                f"{server.url}/v1/events",
                content=body(source, evs),
                headers={"content-type": "application/json"},
            ).raise_for_status()
        )
        cli = CliRunner()
        via = tmp_path / "via_ledger"
        args = ["export", "--since", str(T0 + 500), "--format", "parquet", "--out", str(via)]
        res = cli.invoke(cli_app, [*args, "--ledger", server.url])
        assert res.exit_code == 0, res.output
        assert "events" in res.stdout and f"{counts['late']} rows" in res.stdout
        _check_late_window(_read_dir(via), counts)
        manifest = json.loads((via / "manifest.json").read_text())
        assert manifest["tables"]["events"]["rows"] == counts["late"]
        locked = cli.invoke(cli_app, [*args[:-1], str(tmp_path / "x"), "--db", server.db_url])
        assert locked.exit_code == 1 and "export through it (--ledger URL)" in locked.output
    finally:
        server.stop()
    direct = tmp_path / "direct"
    res = CliRunner().invoke(
        cli_app, ["export", "--since", str(T0 + 500), "--out", str(direct), "--db", server.db_url]
    )
    assert res.exit_code == 0, res.output
    for t in export.TABLES:
        assert pq.read_table(direct / f"{t}.parquet").equals(pq.read_table(via / f"{t}.parquet"))


def test_export_command_refuses_a_bad_window_or_table(tmp_path):
    cli = CliRunner()
    res = cli.invoke(cli_app, ["export", "--since", "soon", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--since: 'soon' is not a time" in res.output
    res = cli.invoke(cli_app, ["export", "--since", "1h", "--out", str(tmp_path), "--tables", "events,users"])
    assert res.exit_code == 2 and "--tables: users" in res.output
    res = cli.invoke(
        cli_app, ["export", "--since", "1h", "--out", str(tmp_path), "--db", "duckdb:////nope/x.duckdb"]
    )
    assert res.exit_code == 1 and "no ledger database at /nope/x.duckdb" in res.output


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2023-11-14T22:13:20Z", T0),
        ("2023-11-14T22:13:20", T0),  # naive: UTC
        ("2023-11-14T23:13:20+01:00", T0),
        ("1700000000", T0),
        ("1700000000.5", T0 + 0.5),
        ("90s", T0 + 10_000 - 90),
        ("15m", T0 + 10_000 - 900),
        ("1h", T0 + 10_000 - 3600),
        ("2d", T0 + 10_000 - 2 * 86400),
        ("1w", T0 + 10_000 - 7 * 86400),
        ("now", T0 + 10_000),
    ],
)
def test_times_parse_from_iso_unix_or_an_age(text, expected):
    assert export.parse_time(text, now=T0 + 10_000) == pytest.approx(expected)


def test_a_bad_time_names_its_field():
    with pytest.raises(ValueError, match=r"^--until: 'tomorrow' is not a time"):
        export.parse_time("tomorrow", field="--until")
    with pytest.raises(ValueError, match="must be after since"):
        export.Window(since=10, until=10)


def test_parquet_stream_writes_one_row_group_per_batch_and_a_valid_footer():
    schema = pa.schema([("a", pa.int64()), ("tags", LIST)])
    batches = [pa.record_batch([[i, i + 1], [["x"], []]], schema=schema) for i in range(3)]
    chunks = list(export.parquet_stream(schema, iter(batches)))
    assert len(chunks) >= 3  # bytes leave as each row group is written, not at the end
    f = pq.ParquetFile(io.BytesIO(b"".join(chunks)))
    assert f.metadata.num_row_groups == 3
    assert f.read().to_pylist()[-1] == {"a": 3, "tags": []}
