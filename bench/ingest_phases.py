"""Where the ledger's CPU goes per output token, in process (no HTTP), for a GPU-shaped engine's stream.

Takes ``bench.fleet_workload``'s stream in its forms (output tokens on the steps, as JSON and as the
columnar message; ``tokens`` events) and times, per output token: decoding and validating the batches
(``decode_batch``; ``decode_columns`` and ``Columns.batch()``), the rule engine (``RuleEngine.observe``
with the default policy: token cap, loop detector on every id, timeouts), folding the batches into
partial rows (``fold_into``), and storing them in DuckDB in groups of 4 batches (``Store.write``, which
folds again, a message's steps from its columns, and appends). Best of ``--rounds`` (the least
disturbed by the machine's other work); the forms are measured alternately in one run.

    python -m bench.ingest_phases [--steps 800] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.fleet_workload import build_cycle, render
from engine_hooks import events as ev
from engine_hooks.columnar import encode_batch
from ledger.columnar import Columns, decode_columns
from ledger.fold import fold_into
from ledger.rules.engine import RuleEngine
from ledger.rules.policy import parse_policy
from ledger.store import open_store
from ledger.validation import decode_batch


class _Hooks:
    def decided(self, ds: Any) -> None: ...
    def confirmed(self, *a: Any) -> None: ...
    def request_done(self, *a: Any) -> None: ...
    def gateway_joined(self, *a: Any) -> None: ...
    def dropped(self, *a: Any) -> None: ...
    def starving(self, *a: Any) -> None: ...


FORMS = {"steps": "tokens on steps", "columns": "columnar message", "tokens": "tokens events"}


def _phases(form: str, steps: int, workdir: str) -> dict[str, float]:
    """Seconds per phase for one pass over ``steps`` steps of the stream, and the tokens it holds.
    ``columns``: the ``steps`` stream sent as the columnar message (decoded and checked, then turned
    into the contract's batch: ``Columns.batch()``)."""
    cycle = build_cycle("tokens" if form == "tokens" else "steps", steps=steps, steps_per_batch=8)
    bodies, seq = [], 1
    for tpl, n in zip(cycle.batches, cycle.events, strict=True):
        bodies.append(render(tpl, "e0", "e0-c0", seq, n))
        seq += n
    if form == "columns":
        bodies = [encode_batch(decode_batch(b, max_events=1_000_000)) for b in bodies]
    out: dict[str, float] = {"tokens": float(sum(cycle.tokens))}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        out[name] = time.perf_counter() - t0
        return result

    columns: list[Columns | None] = [None] * len(bodies)
    if form == "columns":

        def decode_all() -> list[ev.Batch]:
            columns[:] = [decode_columns(b, max_events=1_000_000) for b in bodies]
            return [c.batch() for c in columns if c is not None]

        batches = timed("decode", decode_all)
    else:
        batches = timed("decode", lambda: [decode_batch(b, max_events=1_000_000) for b in bodies])
    policy = parse_policy({})
    rules = RuleEngine(lambda: policy, _Hooks())
    timed("rules", lambda: [rules.observe(b.source, b.events) for b in batches])

    def fold_all() -> None:
        for b in batches:
            fold_into({}, b.source, b.events)

    timed("fold", fold_all)
    store = open_store(f"duckdb:///{workdir}/{form}-{time.monotonic_ns()}.duckdb")
    groups = range(0, len(batches), 4)
    timed("store", lambda: [store.write(batches[i : i + 4], None, columns[i : i + 4]) for i in groups])
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800, help="engine steps per pass (256 requests each)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="chunkledger-phases-") as tmp:
        for _ in range(args.rounds):
            for form in FORMS:
                got = _phases(form, args.steps, tmp)
                mine = best.setdefault(form, got)
                for k, v in got.items():
                    mine[k] = min(mine[k], v)
    names = {
        "decode": "decode + validate",
        "rules": "rules (default policy)",
        "fold": "fold into partial rows",
        "store": "DuckDB write (fold + append + commit)",
    }
    print(f"ns per output token, best of {args.rounds} ({args.steps} steps of 256 requests per pass)")
    print(f"  {'phase':40s}" + "".join(f"{title:>18}" for title in FORMS.values()))
    for key, label in names.items():
        cells = (best[form][key] / best[form]["tokens"] * 1e9 for form in FORMS)
        print(f"  {label:40s}" + "".join(f"{c:>18.0f}" for c in cells))


if __name__ == "__main__":
    main()
