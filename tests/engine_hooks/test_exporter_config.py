"""Exporter settings from the environment and from keywords, and their error messages."""

from __future__ import annotations

from typing import get_type_hints

import pytest

from engine_hooks.config import ConfigError, ExporterConfig, ExporterSettings, parse_size
from engine_hooks.exporter import Exporter

BASE = {"CHUNKLEDGER_URL": "http://127.0.0.1:8321", "CHUNKLEDGER_SOURCE_ID": "vllm-0"}


def test_from_env_reads_every_documented_variable():
    env = {
        **BASE,
        "CHUNKLEDGER_INGEST_TOKEN": "tok",
        "CHUNKLEDGER_SOURCE_KIND": "gateway",
        "CHUNKLEDGER_MODEL": "llama",
        "CHUNKLEDGER_SPOOL_DIR": "/var/spool/cl",
        "CHUNKLEDGER_SPOOL_MAX_BYTES": "64MiB",
        "CHUNKLEDGER_SPOOL_SEGMENT_BYTES": "1m",
        "CHUNKLEDGER_SPOOL_FSYNC": "off",
        "CHUNKLEDGER_QUEUE_SIZE": "1000",
        "CHUNKLEDGER_BATCH_SIZE": "100",
        "CHUNKLEDGER_FLUSH_INTERVAL_S": "0.2",
        "CHUNKLEDGER_TIMEOUT_S": "3",
        "CHUNKLEDGER_CONNECT_TIMEOUT_S": "0.5",
        "CHUNKLEDGER_MAX_ATTEMPTS": "5",
        "CHUNKLEDGER_BACKOFF_INITIAL_S": "0.1",
        "CHUNKLEDGER_BACKOFF_MAX_S": "4",
        "CHUNKLEDGER_SEQ_START": "1000",
        "CHUNKLEDGER_SHUTDOWN_TIMEOUT_S": "9",
        "CHUNKLEDGER_COMMAND_POLL_WAIT_S": "7",
        "CHUNKLEDGER_MAX_IN_FLIGHT": "2",
    }
    config = ExporterConfig.from_env(env)
    assert config.ingest_token == "tok" and config.source_kind == "gateway" and config.model == "llama"
    assert config.spool_dir == "/var/spool/cl" and config.spool_max_bytes == 64 << 20
    assert config.spool_segment_bytes == 1 << 20 and config.spool_fsync is False
    assert (config.queue_size, config.batch_size, config.max_attempts) == (1000, 100, 5)
    assert (config.flush_interval_s, config.timeout_s, config.connect_timeout_s) == (0.2, 3.0, 0.5)
    assert (config.backoff_initial_s, config.backoff_max_s) == (0.1, 4.0)
    assert (config.seq_start, config.shutdown_timeout_s) == (1000, 9.0)
    assert (config.command_poll_wait_s, config.max_in_flight) == (7.0, 2)
    assert config.events_url == "http://127.0.0.1:8321/v1/events"


def test_defaults_spool_to_a_local_folder_and_flush_every_50ms():
    config = ExporterConfig.from_env(BASE)
    assert config.spool_enabled and config.spool_dir == ".chunkledger/spool"
    assert config.flush_interval_s == 0.05 and config.ingest_token is None


def test_keyword_overrides_win_over_the_environment():
    config = ExporterConfig.from_env({**BASE, "CHUNKLEDGER_BATCH_SIZE": "100"}, batch_size=7)
    assert config.batch_size == 7


@pytest.mark.parametrize("missing", ["CHUNKLEDGER_URL", "CHUNKLEDGER_SOURCE_ID"])
def test_missing_required_variable_is_named(missing):
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=f"{missing} is not set"):
        ExporterConfig.from_env(env)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("CHUNKLEDGER_BATCH_SIZE", "abc", "CHUNKLEDGER_BATCH_SIZE: Expected `int`"),
        ("CHUNKLEDGER_BATCH_SIZE", "0", "CHUNKLEDGER_BATCH_SIZE: Expected `int` >= 1"),
        ("CHUNKLEDGER_FLUSH_INTERVAL_S", "-1", "CHUNKLEDGER_FLUSH_INTERVAL_S"),
        ("CHUNKLEDGER_SPOOL_MAX_BYTES", "lots", "CHUNKLEDGER_SPOOL_MAX_BYTES must be a byte size"),
        ("CHUNKLEDGER_SPOOL_FSYNC", "maybe", "CHUNKLEDGER_SPOOL_FSYNC must be a boolean"),
        ("CHUNKLEDGER_SOURCE_KIND", "router", "CHUNKLEDGER_SOURCE_KIND"),
        ("CHUNKLEDGER_URL", "ftp://x", "CHUNKLEDGER_URL must start with http:// or https://"),
        ("CHUNKLEDGER_SOURCE_ID", "has space", "CHUNKLEDGER_SOURCE_ID must be 1-128 characters"),
        ("CHUNKLEDGER_BATCH_SIZE", "100000", r"CHUNKLEDGER_BATCH_SIZE \(100000\) must not exceed queue_size"),
    ],
)
def test_invalid_values_name_the_variable_and_the_expectation(var, value, message):
    with pytest.raises(ConfigError, match=message):
        ExporterConfig.from_env({**BASE, var: value})


def test_cross_field_checks_name_both_settings():
    with pytest.raises(ConfigError, match=r"batch_size .* must not exceed queue_size"):
        ExporterConfig.create(url="http://x", source_id="a", batch_size=10, queue_size=5)
    with pytest.raises(ConfigError, match="backoff_initial_s"):
        ExporterConfig.create(url="http://x", source_id="a", backoff_initial_s=5, backoff_max_s=1)


def test_the_keyword_settings_are_the_configs_fields_by_name_and_type_all_optional():
    """ExporterSettings (create's and from_env's keywords, the overrides) mirrors ExporterConfig."""
    fields = get_type_hints(ExporterConfig, include_extras=True)
    assert get_type_hints(ExporterSettings, include_extras=True) == fields
    assert list(ExporterSettings.__annotations__) == list(ExporterConfig.__struct_fields__)
    assert ExporterSettings.__required_keys__ == frozenset()


def test_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match="unknown exporter setting"):
        ExporterConfig.create(url="http://x", source_id="a", batchsize=10)


def test_zero_spool_bytes_disables_spooling():
    config = ExporterConfig.from_env({**BASE, "CHUNKLEDGER_SPOOL_MAX_BYTES": "0"})
    assert not config.spool_enabled


@pytest.mark.parametrize(
    ("text", "expected"), [("1048576", 1 << 20), ("64KiB", 64 << 10), ("256MiB", 256 << 20), ("1G", 1 << 30)]
)
def test_byte_sizes_accept_binary_units(text, expected):
    assert parse_size(text) == expected


def test_exporter_from_env_uses_the_environment(monkeypatch, tmp_path, fake_ledger):
    monkeypatch.setenv("CHUNKLEDGER_URL", fake_ledger.url)
    monkeypatch.setenv("CHUNKLEDGER_SOURCE_ID", "from-env")
    monkeypatch.setenv("CHUNKLEDGER_SPOOL_DIR", str(tmp_path))
    exporter = Exporter.from_env(spool_fsync=False)
    try:
        assert exporter.source.id == "from-env" and exporter.config.spool_dir == str(tmp_path)
    finally:
        exporter.shutdown(2)
