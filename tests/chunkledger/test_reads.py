"""``chunkledger.reads``: the read commands' answer, decoded once into the ledger's record, printed as
the API gives it (``--format json``) or rendered, and a refusal or another ledger's answer told apart."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from ledger.client import LedgerClient, LedgerError
from ledger.store import open_store
from tests.ledger.advice.test_advice import MEASURED_SOURCE, measured_steps, write_steps

runner = CliRunner()
ADVISE = ["advise", "--itl-target-ms", "150"]


@pytest.fixture
def measured_db(tmp_path) -> str:
    url = f"duckdb:///{tmp_path / 'ledger.duckdb'}"
    store = open_store(url)
    write_steps(store, MEASURED_SOURCE, measured_steps())
    store.close()
    return url


def _ledger_answers(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[dict[str, Any]]:
    """Every ``GET`` of the CLI's ledger client answers ``answer`` (raised when an exception); the
    parameters asked are recorded."""
    asked: list[dict[str, Any]] = []

    def get(self: LedgerClient, path: str, **params: Any) -> Any:
        asked.append({"path": path, **params})
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(LedgerClient, "get", get)
    return asked


def test_json_over_http_is_the_ledgers_answer_unchanged(measured_db, monkeypatch) -> None:
    computed = runner.invoke(cli_app, [*ADVISE, "--db", measured_db, "--format", "json"])
    assert computed.exit_code == 0, computed.output
    asked = _ledger_answers(monkeypatch, json.loads(computed.output))
    got = runner.invoke(cli_app, [*ADVISE, "--ledger", "http://ledger.test", "--format", "json"])
    assert got.exit_code == 0, got.output
    assert got.output == computed.output
    assert asked[0]["path"] == "/v1/advice/chunk-size" and asked[0]["itl_target_ms"] == 150.0


def test_the_table_over_http_is_the_one_computed_from_the_database(measured_db, monkeypatch) -> None:
    computed = runner.invoke(cli_app, [*ADVISE, "--db", measured_db, "--format", "json"])
    _ledger_answers(monkeypatch, json.loads(computed.output))
    table = runner.invoke(cli_app, [*ADVISE, "--ledger", "http://ledger.test"])
    assert table.exit_code == 0, table.output
    assert table.output == runner.invoke(cli_app, [*ADVISE, "--db", measured_db]).output


def test_an_answer_of_another_shape_exits_2_naming_the_record(monkeypatch) -> None:
    _ledger_answers(monkeypatch, {"advice": "from another version"})
    got = runner.invoke(cli_app, [*ADVISE, "--ledger", "http://ledger.test"])
    assert got.exit_code == 2
    assert "answered something other than the ChunkSizeAdvice record" in got.output


def test_a_refusal_prints_the_error_body_and_exits_1(monkeypatch) -> None:
    body = {"reason": "too_little_data", "detail": "no steps in the window"}
    _ledger_answers(monkeypatch, LedgerError("409: no steps", 409, detail=body["detail"], body=body))
    table = runner.invoke(cli_app, [*ADVISE, "--ledger", "http://ledger.test"])
    assert table.exit_code == 1 and table.output.startswith("no advice (too_little_data): no steps")
    js = runner.invoke(cli_app, [*ADVISE, "--ledger", "http://ledger.test", "--format", "json"])
    assert js.exit_code == 1 and json.loads(js.output) == body
