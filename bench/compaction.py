"""What compacting DuckDB's partial request rows costs a fleet's ingest, by compaction policy.

Stores a fleet of GPU-shaped engines (``bench.fleet_workload``, 256 running requests each, 8 steps a
batch, sent as the columnar message) into a DuckDB store in process, in groups of ``--group`` batches,
and lets the store compact between groups as the ingest writer does. For each policy (rows that make
compaction due, and the rows of one slice) it prints the output tokens stored per second, the share of
the time spent compacting, how many calls compacted, and the longest one (the pause a group waits
behind). The policies run alternately, ``--rounds`` times each (best of), in one run.

    python -m bench.compaction [--engines 32] [--group 8] [--passes 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.fleet_workload import build_cycle, render
from engine_hooks.columnar import encode_batch
from ledger.columnar import Columns, decode_columns
from ledger.store import open_store
from ledger.store.duckdb import DuckDBStore
from ledger.validation import decode_batch

# (label, compact_rows): every 20k rows (the policy before 2026-12-07) and today's
POLICIES = [("every 20k rows", 20_000), ("every 5 s or 500k rows", 500_000)]


def _fleet(engines: int, passes: int, steps: int) -> tuple[list[list[bytes]], int]:
    """Rounds of one columnar message per engine, and the output tokens they hold."""
    cycle = build_cycle("steps", steps=steps, steps_per_batch=8)
    rounds: list[list[bytes]] = []
    seqs = [1] * engines
    for p in range(passes):
        per_engine = []
        for e in range(engines):
            bodies = []
            for tpl, n in zip(cycle.batches, cycle.events, strict=True):
                raw = render(tpl, f"e{e}", f"e{e}-p{p}", seqs[e], n)
                bodies.append(encode_batch(decode_batch(raw, max_events=1_000_000)))
                seqs[e] += n
            per_engine.append(bodies)
        rounds += [[per_engine[e][i] for e in range(engines)] for i in range(len(cycle.batches))]
    return rounds, sum(cycle.tokens) * engines * passes


def _run(rounds: list[list[bytes]], group: int, rows: int, workdir: Path) -> dict:
    store = open_store(f"duckdb:///{workdir}/c.duckdb")
    assert isinstance(store, DuckDBStore)
    store.compact_rows = rows
    messages: list[list[Columns]] = [[decode_columns(b, max_events=1_000_000) for b in r] for r in rounds]
    spent, calls, longest = 0.0, 0, 0.0
    t0 = time.perf_counter()
    for r in messages:
        for i in range(0, len(r), group):
            part = r[i : i + group]
            store.write([c.batch() for c in part], None, part)
            t1 = time.perf_counter()
            merged = store.compact()
            took = time.perf_counter() - t1
            spent += took
            if merged:
                calls += 1
                longest = max(longest, took)
    total = time.perf_counter() - t0
    store.close(compact=False)
    return {"seconds": total, "compacting": spent, "calls": calls, "longest": longest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="batches a group (one per engine)")
    ap.add_argument("--passes", type=int, default=2, help="passes over each engine's 400-step cycle")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rounds, tokens = _fleet(args.engines, args.passes, 400)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, rows in POLICIES:
            with tempfile.TemporaryDirectory(prefix="chunkledger-compaction-") as tmp:
                got = _run(rounds, args.group, rows, Path(tmp))
            if label not in best or got["seconds"] < best[label]["seconds"]:
                best[label] = got
    print(
        f"\ncompaction: {args.engines} engines x 256 requests, groups of {args.group} batches "
        f"(8 steps each), {tokens:,} output tokens, best of {args.rounds}"
    )
    print(f"{'policy':34} {'tokens/s':>10} {'compacting':>11} {'calls':>6} {'longest ms':>11}")
    for label, _ in POLICIES:
        b = best[label]
        print(
            f"{label:34} {tokens / b['seconds']:>10,.0f} {b['compacting'] / b['seconds']:>10.1%} "
            f"{b['calls']:>6} {1000 * b['longest']:>11.0f}"
        )


if __name__ == "__main__":
    main()
