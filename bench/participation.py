"""What storing a step's participants costs DuckDB, by how they are stored (ns per participant).

Appends steps of 256 participants in groups of 128 steps (one transaction each, as the ingest writer
does) to a DuckDB file, with the participants as: nothing (the rest of the row), ``BIGINT[]`` keys
(what ``steps.request_keys`` stores), ``VARCHAR[]`` ids of vLLM's length (what ``steps.request_ids``
stored before migration 0007), and one comma-joined ``VARCHAR``. Insert and commit are timed apart:
DuckDB writes the rows to its WAL at the commit. The variants alternate, ``--rounds`` times each;
the best round is printed.

    python -m bench.participation [--groups 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import duckdb
import pyarrow as pa

RUNNERS = 256
STEPS = 128  # steps per group commit

_TYPES = {
    "none": "VARCHAR",
    "keys BIGINT[]": "BIGINT[]",
    "ids VARCHAR[]": "VARCHAR[]",
    "ids joined": "VARCHAR",
}


def _column(kind: str, group: int) -> pa.Array:
    ids = [
        [f"e{group}-c0-{(s * 7 + j) % 4000:07d}-{j * 2654435761 % 2**32:08x}" for j in range(RUNNERS)]
        for s in range(STEPS)
    ]
    if kind == "keys BIGINT[]":
        return pa.array(
            [[group * 100_000 + s * 7 + j for j in range(RUNNERS)] for s in range(STEPS)],
            pa.list_(pa.int64()),
        )
    if kind == "ids VARCHAR[]":
        return pa.array(ids, pa.list_(pa.string()))
    if kind == "ids joined":
        return pa.array([",".join(x) for x in ids], pa.string())
    return pa.array([None] * STEPS, pa.string())


def run(kind: str, groups: int, workdir: str) -> tuple[float, float]:
    """ns per participant: (insert, commit)."""
    con = duckdb.connect(f"{workdir}/{kind.replace(' ', '_')}-{time.monotonic_ns()}.duckdb")
    con.execute(
        "CREATE TABLE steps (source_id VARCHAR, seq BIGINT, step BIGINT, ts DOUBLE, "
        f"participants {_TYPES[kind]})"
    )
    insert = commit = 0.0
    for g in range(groups):
        table = pa.table(
            {
                "source_id": ["e0"] * STEPS,
                "seq": list(range(g * STEPS, (g + 1) * STEPS)),
                "step": list(range(STEPS)),
                "ts": [1.0] * STEPS,
                "participants": _column(kind, g),
            }
        )
        t0 = time.perf_counter()
        con.execute("BEGIN TRANSACTION")
        con.register("_stage", table)
        con.execute("INSERT INTO steps SELECT * FROM _stage")
        con.unregister("_stage")
        t1 = time.perf_counter()
        con.execute("COMMIT")
        t2 = time.perf_counter()
        insert += t1 - t0
        commit += t2 - t1
    con.close()
    n = groups * STEPS * RUNNERS
    return insert / n * 1e9, commit / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    best: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="chunkledger-participation-") as tmp:
        for _ in range(args.rounds):
            for kind in _TYPES:
                got = run(kind, args.groups, tmp)
                if kind not in best or sum(got) < sum(best[kind]):
                    best[kind] = got
    print(
        f"DuckDB {duckdb.__version__}: steps of {RUNNERS} participants, {STEPS} steps per commit, "
        f"best of {args.rounds}"
    )
    print(f"{'participants stored as':<24}{'insert':>8}{'commit':>8}{'total':>8}  ns per participant")
    for kind, (ins, com) in best.items():
        print(f"{kind:<24}{ins:>8.0f}{com:>8.0f}{ins + com:>8.0f}")


if __name__ == "__main__":
    main()
