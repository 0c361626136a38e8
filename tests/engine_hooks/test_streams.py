"""The JetStream contract's names: partitions, subject tokens, message ids, the stream's description."""

from __future__ import annotations

import zlib

from engine_hooks import streams


def test_a_sources_partition_is_crc32_of_its_id_and_the_same_in_every_process():
    assert streams.partition_of("engine-7", 16) == zlib.crc32(b"engine-7") % 16
    spread = {streams.partition_of(f"engine-{i}", 16) for i in range(200)}
    assert spread == set(range(16))


def test_source_ids_with_dots_are_one_subject_token_and_distinct_ids_stay_distinct():
    assert streams.token("pod.a.b") == "pod~a~b"
    assert streams.events_subject("S", "pod.a", 4) == f"S.events.{streams.partition_of('pod.a', 4)}.pod~a"
    assert streams.token("pod.a") != streams.token("pod_a")
    assert streams.commands_subject("S", "gw.1") == "S.commands.gw~1"
    assert streams.partition_subjects("S", 3) == "S.events.3.>"


def test_a_message_id_names_the_source_and_the_body():
    a = streams.message_id("e", b"x")
    assert a == streams.message_id("e", b"x")
    assert a != streams.message_id("e", b"y") and a != streams.message_id("f", b"x")


def test_the_streams_description_carries_its_partitions_and_nothing_else_is_read_as_one():
    assert streams.partitions_of(streams.describe(24)) == 24
    assert streams.partitions_of("some other stream") is None
    assert streams.partitions_of(None) is None
    assert streams.partitions_of("partitions=0") is None
    assert streams.partitions_of(f"partitions={streams.MAX_PARTITIONS + 1}") is None


def test_an_exporter_set_to_a_stream_without_nats_py_installed_names_the_extra(monkeypatch):
    import importlib.util

    import pytest

    from engine_hooks.config import ConfigError, ExporterConfig
    from engine_hooks.exporter import Exporter

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nats" else real(name, *a)
    )
    config = ExporterConfig(
        url="http://127.0.0.1:9", source_id="e", nats_url="nats://127.0.0.1:1", spool_dir=None
    )
    with pytest.raises(ConfigError, match=r"chunkledger\[nats\]"):
        Exporter(config)
