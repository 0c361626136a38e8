"""A ledger outage under a simulated fleet: how big the backlog grows and how fast it drains.

The scene of the delivery tests (``tests/engine_hooks/test_delivery_real_ledger.py``): 4 engines and a
gateway at 40 requests/s send to a real ``chunkledger serve``; the ledger is stopped for ``--outage``
seconds and started again while the fleet keeps emitting. Printed, from one run: the backlog (events
spooled while it was down), the seconds until every exporter's spool was empty again, the replay rate
(backlog / drain seconds) beside the rate the fleet emits (backlog / outage seconds), and whether every
event was stored exactly once. The goal: a 60 s outage drained within 10 s.

Run: ``python -m bench.outage`` (``--json`` for one line of figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb

from bench.toolkit import Proc, free_port, say
from engine_hooks import exporter as exporter_module
from engine_hooks.exporter import Exporter
from engine_hooks.simulator import SimulationSummary, run_simulation


def _ledger(db: Path, port: int, log: Path) -> Proc:
    cmd = [sys.executable, "-m", "chunkledger", "serve", "--db", f"duckdb:///{db}", "--port", str(port)]
    proc = Proc("ledger", cmd, log, dict(os.environ))
    proc.wait_ready(f"http://127.0.0.1:{port}/readyz", 60)
    return proc


def _stored(db: Path) -> dict[str, list[int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT source_id, seq FROM events").fetchall()
    out: dict[str, list[int]] = {}
    for source_id, seq in rows:
        out.setdefault(source_id, []).append(seq)
    return out


def exactly_once(stored: list[int], exporter: Exporter) -> bool:
    """Every seq the exporter numbered is stored, once."""
    stats = exporter.stats()
    if stats.last_seq is None:
        return not stored
    expected = range(stats.last_seq - stats.numbered + 1, stats.last_seq + 1)
    return len(stored) == len(set(stored)) and sorted(stored) == list(expected)


def run(args: argparse.Namespace, work: Path) -> dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db, log, spool = work / "ledger.duckdb", work / "ledger.log", work / "spool"
    ledger = _ledger(db, port, log)
    result: dict[str, SimulationSummary] = {}

    def simulate() -> None:
        result["summary"] = run_simulation(
            engines=args.engines,
            rps=args.rps,
            duration_s=args.before + args.outage + args.after,
            ledger_url=url,
            spool_dir=str(spool),
            overrides={"backoff_max_s": 1.0, "wire": args.wire},
            drain_timeout_s=60,
        )

    sim = threading.Thread(target=simulate)
    sim.start()
    try:
        time.sleep(args.before)
        live = list(exporter_module._live)
        exporters = [e for e in live if (e.config.spool_dir or "").startswith(str(spool))]
        say(f"{len(exporters)} sources sending; stopping the ledger for {args.outage:g} s")
        ledger.stop()
        time.sleep(args.outage)
        backlog = sum(e.stats().spool_pending for e in exporters)
        ledger = _ledger(db, port, log)
        up = time.monotonic()
        drained_s = None
        while sim.is_alive() and time.monotonic() - up < 120:
            if sum(e.stats().spool_pending for e in exporters) == 0:
                drained_s = time.monotonic() - up
                break
            time.sleep(0.02)
        sim.join()
    finally:
        ledger.stop()
    stored = _stored(db)
    summary = result["summary"]
    once = all(exactly_once(stored.get(e.stats().source_id, []), e) for e in exporters)
    return {
        "wire": args.wire,
        "sources": len(exporters),
        "outage_s": args.outage,
        "backlog_events": backlog,
        "drained_s": None if drained_s is None else round(drained_s, 2),
        "emit_events_per_s": round(backlog / args.outage),
        "replay_events_per_s": None if not drained_s else round(backlog / drained_s),
        "replay_over_emit": None if not drained_s else round(args.outage / drained_s, 1),
        "dropped": summary["exporter"]["dropped"],
        "exactly_once": once,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rps", type=float, default=40)
    ap.add_argument("--before", type=float, default=5.0, help="seconds of traffic before the outage")
    ap.add_argument("--outage", type=float, default=60.0, help="seconds the ledger is down")
    ap.add_argument("--after", type=float, default=25.0, help="seconds of traffic after it is back")
    ap.add_argument("--wire", choices=["json", "columns"], default="json", help="what the exporters send")
    ap.add_argument("--json", action="store_true", help="one line of JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as tmp:
        figures = run(args, Path(tmp))
    if args.json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
