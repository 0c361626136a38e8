"""The disk spool: order, persistence of the read position, size cap, torn and damaged records."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_hooks.spool import HEADER_SIZE, Spool, SpoolError


def _open(path: Path, max_bytes: int = 1 << 20, segment_bytes: int = 1 << 16) -> Spool:
    return Spool(path, max_bytes=max_bytes, segment_bytes=segment_bytes, fsync=False)


def _drain(spool: Spool) -> list[bytes]:
    out = []
    while (record := spool.peek()) is not None:
        out.append(record.payload)
        spool.pop()
    return out


def _payloads(n: int, size: int = 100) -> list[bytes]:
    return [f"batch-{i:05d}-".encode().ljust(size, b"x") for i in range(n)]


def test_records_replay_in_append_order_across_segments(tmp_path):
    spool = _open(tmp_path, segment_bytes=1000)
    payloads = _payloads(50)
    for p in payloads:
        assert spool.append(p, 3)
    assert len(list(tmp_path.glob("*.seg"))) > 1
    assert spool.pending_records == 50 and spool.pending_events == 150
    assert _drain(spool) == payloads
    assert not spool


def test_delivered_records_are_not_replayed_after_reopening(tmp_path):
    spool = _open(tmp_path, segment_bytes=1000)
    payloads = _payloads(30)
    for p in payloads:
        spool.append(p, 1)
    for _ in range(12):
        assert spool.peek() is not None
        spool.pop()
    spool.close()
    reopened = _open(tmp_path, segment_bytes=1000)
    assert reopened.pending_records == 18
    assert _drain(reopened) == payloads[12:]


def test_peek_without_pop_replays_the_same_record(tmp_path):
    spool = _open(tmp_path)
    spool.append(b"one", 1)
    spool.append(b"two", 1)
    first = spool.peek()
    assert first is not None and spool.peek() == first
    spool.pop()
    second = spool.peek()
    assert second is not None and second.payload == b"two"


def test_consumed_segments_are_deleted_and_bytes_return_to_zero(tmp_path):
    spool = _open(tmp_path, segment_bytes=500)
    for p in _payloads(20):
        spool.append(p, 1)
    assert spool.size_bytes == 20 * (100 + HEADER_SIZE)
    _drain(spool)
    assert spool.size_bytes == 0
    assert list(tmp_path.glob("*.seg")) == []
    spool.append(b"after", 1)  # appending after a full drain starts a fresh segment
    assert _drain(spool) == [b"after"]


def test_full_spool_refuses_appends_and_accepts_again_after_draining(tmp_path):
    spool = _open(tmp_path, max_bytes=3 * (100 + HEADER_SIZE), segment_bytes=1000)
    payloads = _payloads(4)
    assert all(spool.append(p, 1) for p in payloads[:3])
    assert spool.append(payloads[3], 1) is False
    assert _drain(spool) == payloads[:3]
    assert spool.append(payloads[3], 1)


def test_torn_tail_is_skipped_counted_and_the_rest_replayed(tmp_path):
    spool = _open(tmp_path)
    payloads = _payloads(5)
    for p in payloads:
        spool.append(p, 7)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    os.truncate(segment, segment.stat().st_size - 30)
    reopened = _open(tmp_path)
    assert reopened.torn_records == 1 and reopened.torn_events == 7
    assert reopened.take_torn() == (1, 7)
    assert reopened.take_torn() == (0, 0)
    assert _drain(reopened) == payloads[:4]


def test_tail_cut_inside_a_header_is_skipped(tmp_path):
    spool = _open(tmp_path)
    spool.append(b"kept", 1)
    spool.append(b"lost", 1)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    os.truncate(segment, HEADER_SIZE + 4 + 5)  # 5 bytes of the second header survive
    reopened = _open(tmp_path)
    assert reopened.torn_records == 1
    assert _drain(reopened) == [b"kept"]


def test_appends_after_a_torn_tail_start_on_a_record_boundary(tmp_path):
    spool = _open(tmp_path)
    spool.append(b"a" * 50, 1)
    spool.append(b"b" * 50, 1)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    os.truncate(segment, segment.stat().st_size - 10)
    reopened = _open(tmp_path)
    reopened.append(b"c" * 50, 1)
    assert _drain(reopened) == [b"a" * 50, b"c" * 50]


def test_damaged_record_in_the_middle_is_skipped_by_resyncing(tmp_path):
    spool = _open(tmp_path)
    payloads = _payloads(4)
    for p in payloads:
        spool.append(p, 2)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[(100 + HEADER_SIZE) + HEADER_SIZE + 10] ^= 0xFF  # flip a payload byte of the second record
    segment.write_bytes(bytes(data))
    reopened = _open(tmp_path)
    assert _drain(reopened) == [payloads[0], payloads[2], payloads[3]]
    assert reopened.torn_records == 1 and reopened.torn_events == 2


def test_truncated_file_that_was_appended_to_again_is_resynced(tmp_path):
    spool = _open(tmp_path)
    spool.append(b"first" * 20, 1)
    spool.append(b"second" * 20, 1)
    segment = next(tmp_path.glob("*.seg"))
    os.truncate(segment, segment.stat().st_size - 15)  # torn while the spool is open
    spool._sizes[int(segment.stem)] = segment.stat().st_size
    spool.append(b"third" * 20, 1)
    assert _drain(spool) == [b"first" * 20, b"third" * 20]
    assert spool.torn_records == 1


def test_second_spool_on_the_same_folder_is_refused(tmp_path):
    _open(tmp_path)
    with pytest.raises(SpoolError, match="in use"):
        _open(tmp_path)


def test_unusable_folder_raises_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SpoolError, match="cannot use spool folder"):
        _open(blocker / "spool")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12),
    cut=st.floats(min_value=0, max_value=1),
)
def test_any_truncation_replays_a_prefix_of_whole_records_never_a_corrupt_one(tmp_path_factory, sizes, cut):
    folder = tmp_path_factory.mktemp("spool")
    spool = _open(folder, segment_bytes=1 << 20)
    payloads = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]
    for p in payloads:
        spool.append(p, 1)
    spool.close()
    segment = next(folder.glob("*.seg"))
    cut_at = int(segment.stat().st_size * cut)
    os.truncate(segment, cut_at)
    replayed = _drain(_open(folder, segment_bytes=1 << 20))
    assert replayed == payloads[: len(replayed)]
    boundaries = [sum(HEADER_SIZE + len(p) for p in payloads[:k]) for k in range(len(payloads) + 1)]
    assert len(replayed) == max(k for k, b in enumerate(boundaries) if b <= cut_at)
