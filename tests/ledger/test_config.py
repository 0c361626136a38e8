"""Settings: env prefix, URL check, and the refusal to serve a public address without tokens."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ledger.config import Settings, UnsafeConfig, is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("127.0.0.5", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("ledger.internal", False),
    ],
)
def test_loopback_detection(host, loopback):
    assert is_loopback(host) is loopback


def test_public_bind_needs_every_token():
    with pytest.raises(UnsafeConfig, match="CHUNKLEDGER_READ_TOKEN"):
        Settings(host="0.0.0.0", ingest_token="a", admin_token="c").check_safe_to_bind()
    Settings(host="0.0.0.0", ingest_token="a", read_token="b", admin_token="c").check_safe_to_bind()
    Settings(host="127.0.0.1").check_safe_to_bind()


def test_settings_come_from_prefixed_environment(monkeypatch):
    monkeypatch.setenv("CHUNKLEDGER_DB_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("CHUNKLEDGER_MAX_BODY_BYTES", "2048")
    s = Settings()
    assert s.db_url == "postgresql+psycopg://u@h/db" and s.max_body_bytes == 2048


def test_unknown_database_scheme_names_the_field():
    with pytest.raises(ValidationError, match="db_url"):
        Settings(db_url="sqlite:///x.db")
