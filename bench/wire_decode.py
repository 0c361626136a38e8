"""What the ledger pays to read a body on each wire, per row (one request in one step), side by side in
one run: JSON (``decode_batch``), the columnar message checked into columns (``decode_columns``), and
that turned into the contract's batch the rules and the store take today (``Columns.batch()``).

Traffic: ``bench.wire.generate`` (a GPU-shaped engine, 256 running requests), 16 steps a message.
Best of ``--rounds``. Run: ``python -m bench.wire_decode``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bench import wire
from engine_hooks import columnar
from engine_hooks import events as ev
from ledger.columnar import decode_columns
from ledger.validation import decode_batch

MAX = 10**6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--steps-per-message", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    traffic = wire.generate(steps=args.steps, seed=1)
    seq, as_json, as_columns, rows = traffic.seq_start, [], [], 0
    for entries in traffic.all_messages(args.steps_per_message):
        events, seq = wire.reference_events(entries, seq)
        batch = ev.Batch(source=traffic.source, events=events)
        as_json.append(ev.batch_encoder.encode(batch))
        as_columns.append(columnar.encode_batch(batch))
        rows += sum(len(e.request_ids) for e in events if type(e) is ev.Step)
    paths: list[tuple[str, Callable[[bytes], object], list[bytes]]] = [
        ("JSON: decode_batch", lambda b: decode_batch(b, max_events=MAX), as_json),
        ("columns: decode_columns", lambda b: decode_columns(b, max_events=MAX), as_columns),
        ("columns: + Columns.batch()", lambda b: decode_columns(b, max_events=MAX).batch(), as_columns),
    ]
    print(f"{rows} rows in {len(as_json)} messages")
    print(f"{'path':28s} {'ns/row':>8s} {'KiB/message':>12s}")
    for name, decode, bodies in paths:
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter_ns()
            for body in bodies:
                decode(body)
            best = min(best, (time.perf_counter_ns() - t0) / rows)
        print(f"{name:28s} {best:8.1f} {sum(map(len, bodies)) / len(bodies) / 1024:12.0f}")


if __name__ == "__main__":
    main()
