"""Reads run nicer than ingest: the threads that run them, and DuckDB's helper threads, get a lower
CPU priority once, and ingest's threads keep the process's."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx

from ledger.reads import read_priority
from tests.support.servers import LedgerServer


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_a_read_thread_runs_nicer_once_and_other_threads_keep_their_priority():
    seen: list[tuple[int, int, int]] = []

    def read() -> None:
        tid = threading.get_native_id()
        before = _nice(tid)
        read_priority(5)
        once = _nice(tid)
        read_priority(5)  # the same thread again: not lowered twice
        seen.append((before, once, _nice(tid)))

    t = threading.Thread(target=read)
    t.start()
    t.join()
    main = _nice(threading.get_native_id())
    ((before, once, twice),) = seen
    assert once == min(19, before + 5) and twice == once
    assert _nice(threading.get_native_id()) == main  # the caller's thread is not touched


def _thread_nices(pid: int) -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[16])  # the 19th field of stat: nice
    return out


def test_a_served_ledgers_reads_and_duckdb_helpers_run_nicer_and_its_ingest_does_not(tmp_path):
    server = LedgerServer(
        f"duckdb:///{tmp_path / 'l.duckdb'}",
        tmp_path / "log",
        env={"CHUNKLEDGER_READ_NICE": "7", "CHUNKLEDGER_DUCKDB_THREADS": "2"},
    )
    server.start()
    try:
        assert server.proc is not None
        pid = server.proc.pid
        base = _thread_nices(pid)[pid]
        r = httpx.post(f"{server.url}/v1/sql", json={"sql": "SELECT count(*) FROM range(10)"}, timeout=30)
        assert r.status_code == 200, r.text
        nices = _thread_nices(pid)
        assert nices[pid] == base  # the event loop (ingest's requests are answered there)
        niced = [tid for tid, n in nices.items() if n == min(19, base + 7)]
        # DuckDB's helper (threads - 1) and the thread that ran the query
        assert len(niced) >= 2, nices
        # ingest's threads (the writer, its pool, the rule engine's) keep the process's priority
        assert sum(n == base for n in nices.values()) >= 4, nices
    finally:
        server.stop()
