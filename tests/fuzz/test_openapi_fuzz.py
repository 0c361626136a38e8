"""Schemathesis against the real service: every operation of the OpenAPI document, bodies included
(the events batch and the policy from their request schemas), with bounded examples. No input may get
a 5xx. The service runs as users run it (``chunkledger serve`` on DuckDB, all tokens set) and each case
is sent with the admin token, so it reaches the handler behind the auth check.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests.support.servers import LedgerServer

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer adm"}
TOKENS = {"CHUNKLEDGER_INGEST_TOKEN": "ing", "CHUNKLEDGER_READ_TOKEN": "rd", "CHUNKLEDGER_ADMIN_TOKEN": "adm"}


@pytest.fixture(scope="module")
def fuzzed_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    tmp = tmp_path_factory.mktemp("fuzz")
    # Long-polls answer at once (wait_s is clamped by the server's cap): fuzzing must not sit in them.
    server = LedgerServer(
        f"duckdb:///{tmp / 'ledger.duckdb'}",
        tmp / "ledger.log",
        env={**TOKENS, "CHUNKLEDGER_SQL_TIMEOUT_S": "2", "CHUNKLEDGER_BODY_TIMEOUT_S": "2"},
    )
    server.start()
    yield server
    server.stop()
    log = (tmp / "ledger.log").read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]


def test_no_generated_request_gets_a_server_error(fuzzed_ledger: LedgerServer) -> None:
    api = schemathesis.openapi.from_url(f"{fuzzed_ledger.url}/openapi.json")
    failures: list[str] = []
    calls = {"n": 0}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 20 and any(op.path == "/v1/events" for op in operations)

    cases = [(op, mode) for op in operations for mode in schemathesis.GenerationMode]
    for operation, mode in cases:  # valid inputs from the schema, and inputs that break it

        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            if case.path == "/v1/commands" and case.query is not None:
                case.query["wait_s"] = 0  # the long-poll would hold each case for its whole wait
            response = case.call(base_url=fuzzed_ledger.url, headers=ADMIN, timeout=30)
            calls["n"] += 1
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: "
                    f"{response.text[:300]}\n{case.as_curl_command()}"
                )

        try:
            check()
        except Unsatisfiable:  # nothing of this operation can be made invalid (no parameters, no body)
            assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    print(f"{calls['n']} requests over {len(operations)} operations, valid and invalid inputs")
    assert not failures, "\n\n".join(failures[:10])
