"""A normal source's acknowledgements while callers with valid tokens attack the ledger (issue 35).

Starts a real ``chunkledger serve`` per backend with read and ingest tokens, preloads 100,000 events
(so exports and the rule engine have something to chew on), then for each attack measures a normal
source posting a 4-event batch every 0.2 s, beside it in the same run, and prints its ack p50 / p90 /
p99 / max, its statuses and the ledger's peak RSS:

* ``quiet``: no attack (the baseline of the same run);
* ``flood``: 4 sources posting 80,000-event (16 MB) batches as fast as they are let in;
* ``sql``: bursts of 100 concurrent ``/v1/sql`` queries that run until their time limit;
* ``export``: 4 clients asking for the events' Parquet export and never reading it.

The attackers run in processes of their own (in one process with the normal source they starve its
client of the interpreter, which is not the ledger's doing). On a 2-core host they share the CPU with
the ledger, as an attacker on the same host would.

    python -m bench.attacks [--backend duckdb|postgres|both] [--seconds 20] [--attacks quiet,flood,sql,export]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from bench.toolkit import free_port, percentile, rss
from engine_hooks import events as ev

ING = {"Authorization": "Bearer ing"}
RD = {"Authorization": "Bearer rd"}
PG_ADMIN = os.environ.get("CHUNKLEDGER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SQL = {
    "duckdb": "SELECT count(*) FROM generate_series(1, 3000000000) t(x)",
    "postgresql": "SELECT sum(x) FROM (SELECT generate_series(1, 3000000000) AS x) s",
}


def _batch(sid: str, seq: int, n: int, *, pad: str = "") -> bytes:
    t = time.time()
    events: list[ev.Event] = [
        ev.Queued(seq=seq + i, ts=t, request_id=f"{uuid.uuid4().hex}{pad}", prompt_tokens=3) for i in range(n)
    ]
    return ev.encode_batch(ev.Source(id=sid, kind="engine", model="m"), events)


def _flood(url: str, i: int) -> None:
    seq = 1
    with httpx.Client(base_url=url, headers=ING, timeout=60) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                http.post("/v1/events", content=_batch(f"flood-{i}", seq, 80_000, pad="x" * 100))
            seq += 80_000


def _sql(url: str, dialect: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/sql", json={"sql": SQL[dialect]}, headers=RD, timeout=30)

    with ThreadPoolExecutor(100) as pool:
        while True:
            list(pool.map(one, range(100)))


def _export(port: int) -> None:
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /v1/export/events.parquet HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer rd\r\n\r\n")
        time.sleep(3)  # never reads
        s.close()


class _Normal(threading.Thread):
    def __init__(self, url: str, pid: int) -> None:
        super().__init__(daemon=True)
        self.url, self.pid = url, pid
        self.acks: list[tuple[float, int]] = []
        self.peak_rss = 0
        self.halt = threading.Event()

    def run(self) -> None:
        sid, seq = f"normal-{uuid.uuid4().hex[:6]}", 1
        with httpx.Client(base_url=self.url, headers=ING, timeout=30) as http:
            while not self.halt.is_set():
                t0 = time.monotonic()
                try:
                    status = http.post("/v1/events", content=_batch(sid, seq, 4)).status_code
                except httpx.HTTPError:
                    status = 599
                seq += 4
                self.acks.append((time.monotonic() - t0, status))
                self.peak_rss = max(self.peak_rss, rss(self.pid))
                self.halt.wait(max(0.0, 0.2 - (time.monotonic() - t0)))


def _measure(url: str, port: int, pid: int, dialect: str, attack: str, seconds: float) -> str:
    ctx = mp.get_context("spawn")
    procs = []
    if attack == "flood":
        procs = [ctx.Process(target=_flood, args=(url, i), daemon=True) for i in range(4)]
    elif attack == "sql":
        procs = [ctx.Process(target=_sql, args=(url, dialect), daemon=True)]
    elif attack == "export":
        procs = [ctx.Process(target=_export, args=(port,), daemon=True) for _ in range(4)]
    for p in procs:
        p.start()
    time.sleep(1.0 if procs else 0.0)  # the attack under way
    normal = _Normal(url, pid)
    normal.start()
    time.sleep(seconds)
    normal.halt.set()
    normal.join(30)
    for p in procs:
        p.kill()
        p.join()
    time.sleep(3)  # recovery before the next attack
    times = sorted(t for t, _ in normal.acks)
    statuses = sorted({s for _, s in normal.acks})
    ms = [f"{percentile(times, q) * 1e3:.0f}" for q in (0.5, 0.9, 0.99)] + [f"{times[-1] * 1e3:.0f}"]
    rss = f"{normal.peak_rss / 2**20:.0f}"
    return f"| {dialect} | {attack} | {len(times)} | {' | '.join(ms)} | {statuses} | {rss} |"


def _serve(db: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    port = free_port()
    env = {
        **os.environ,
        "CHUNKLEDGER_INGEST_TOKEN": "ing",
        "CHUNKLEDGER_READ_TOKEN": "rd",
        "CHUNKLEDGER_ADMIN_TOKEN": "adm",
        "CHUNKLEDGER_SQL_TIMEOUT_S": "2",
        "CHUNKLEDGER_READ_TIMEOUT_S": "3",
        "CHUNKLEDGER_SEND_TIMEOUT_S": "1",
    }
    log = open(workdir / "ledger.log", "ab")  # noqa: SIM115 - the subprocess's
    proc = subprocess.Popen(
        [sys.executable, "-m", "chunkledger", "serve", "--db", db, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise SystemExit(f"ledger not ready: {(workdir / 'ledger.log').read_text()[-2000:]}")
    with httpx.Client(base_url=url, headers=ING, timeout=60) as http:
        src = ev.Source(id="bulk", kind="engine", model="m")
        for b in range(20):
            events: list[ev.Event] = [
                ev.Queued(seq=1 + b * 5000 + i, ts=1e9 + i, request_id=secrets.token_hex(48), prompt_tokens=3)
                for i in range(5000)
            ]
            http.post("/v1/events", content=ev.encode_batch(src, events)).raise_for_status()
    return proc, url, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["duckdb", "postgres", "both"], default="both")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--attacks", default="quiet,flood,sql,export")
    args = ap.parse_args()
    backends = ["duckdb", "postgres"] if args.backend == "both" else [args.backend]
    print("| backend | attack | acks | p50 ms | p90 ms | p99 ms | max ms | statuses | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            name = None
            if backend == "duckdb":
                db, dialect = f"duckdb:///{workdir / 'ledger.duckdb'}", "duckdb"
            else:
                import sqlalchemy as sa

                name = f"chunkledger_attacks_{uuid.uuid4().hex[:8]}"
                admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
                db, dialect = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", "postgresql"
            proc, url, port = _serve(db, workdir)
            try:
                for attack in args.attacks.split(","):
                    print(_measure(url, port, proc.pid, dialect, attack, args.seconds), flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
                if name is not None:
                    with admin.connect() as conn:
                        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                    admin.dispose()


if __name__ == "__main__":
    main()
