"""How long chunk-size advice takes: reading the window's steps and fitting them, per backend.

Stores N synthetic steps (the issue's measured CPU model plus noise) through the real write path,
then times ``chunk_size_advice`` (the read of the newest ``max_steps`` steps, the term selection, the
robust fit and the advice) and its parts, side by side for each backend in one run.

    python -m bench.advice --steps 200000 --max-steps 100000 [--pg postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid

import sqlalchemy as sa

from engine_hooks import events as ev
from ledger.advice.advisor import Advisor
from ledger.advice.answer import AdviceQuery
from ledger.advice.query import read_steps
from ledger.advice.service import chunk_size_advice
from ledger.store import open_store
from tools.synthetic_steps import MEASURED_CPU, synthetic_steps

SOURCE = ev.Source(id="bench-engine", kind="engine", model="bench-model")


def _pg_url(admin: str) -> tuple[str, sa.Engine]:
    name = f"chunkledger_bench_{uuid.uuid4().hex[:8]}"
    eng = sa.create_engine(admin, isolation_level="AUTOCOMMIT")
    with eng.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    return admin.rsplit("/", 1)[0] + f"/{name}", eng


def bench(url: str, steps: list[ev.Step], max_steps: int, target: float) -> dict[str, float]:
    store = open_store(url)
    try:
        t0 = time.perf_counter()
        for i in range(0, len(steps), 5000):
            store.write([ev.Batch(source=SOURCE, events=list[ev.Event](steps[i : i + 5000]))])
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        window = read_steps(store.engine, max_steps=max_steps)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        Advisor(window.data).advise(AdviceQuery(itl_target_ms=target, depth=0))
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        chunk_size_advice(store.engine, AdviceQuery(itl_target_ms=target, depth=0, max_steps=max_steps))
        total_s = time.perf_counter() - t0
    finally:
        store.close()
    return {"write_s": write_s, "read_s": read_s, "fit_s": fit_s, "total_s": total_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200_000, help="steps stored")
    ap.add_argument("--max-steps", type=int, default=100_000, help="newest steps the advice reads")
    ap.add_argument("--target-ms", type=float, default=150.0)
    ap.add_argument(
        "--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/test", help="admin URL; '' skips"
    )
    args = ap.parse_args()
    steps = synthetic_steps(
        MEASURED_CPU,
        n=args.steps,
        chunk_sizes=(256, 512, 1024, 2048),
        max_depth=16384,
        decode_batches=(1, 8, 32, 64, 128),
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("duckdb", bench(f"duckdb:///{tmp}/bench.duckdb", steps, args.max_steps, args.target_ms)))
    if args.pg:
        url, admin = _pg_url(args.pg)
        try:
            rows.append(("postgres", bench(url, steps, args.max_steps, args.target_ms)))
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
            admin.dispose()
    print(f"chunk-size advice: {args.steps:,} steps stored, newest {args.max_steps:,} read")
    print(f"{'backend':<10} {'store s':>8} {'read ms':>8} {'fit+advice ms':>14} {'advice total ms':>16}")
    for name, r in rows:
        print(
            f"{name:<10} {r['write_s']:>8.1f} {r['read_s'] * 1e3:>8.0f} {r['fit_s'] * 1e3:>14.0f} "
            f"{r['total_s'] * 1e3:>16.0f}"
        )


if __name__ == "__main__":
    main()
