"""Engine-thread cost of the exporter, next to the raw cost of appending to a deque (same run).

A simulated decode step with 256 running requests records one ``tokens`` event per request and one
``step`` event. Measured per step, best of several rounds (minimum = least disturbed by the machine):

* raw:        ``deque.append((rid, ts, 1, total))`` x 256 -- the floor any in-process hook pays;
* many:       the hook builds 256 rows and hands them over with ``tokens.many(rows)``, plus ``step(...)``;
* single:     ``tokens(ts, rid, 1, total)`` x 256 plus ``step(...)``: one call per event;
* keyword:    ``exporter.emit(Tokens, ts=..., request_id=..., ...)`` x 256: the convenience path;
* coalesced:  what the vLLM plugin does per step by default (``step_tokens`` off): each new token id
              appended to its pending list, and every 16th step ``tokens.many`` with the 256 groups
              of 16 ids, plus the step (with its request ids);
* columnar:   what it does with ``step_tokens``: the 256 counts, totals and ids gathered into three
              lists that ride on the step event (schema 2), one event per step;
* worker:     what the worker thread later spends per event (numbering, building the Struct,
              encoding, validating) -- off the engine thread, but it shares the GIL; per output
              token for the plugin's forms, the columnar one also sent as the columnar message
              (``wire = "columns"``).

The worker is kept out of the engine-thread figures (the queue is emptied between steps, as the raw
deque is), so they measure only what the engine thread pays. Run: ``python -m bench.exporter``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import deque
from collections.abc import Callable

from engine_hooks.config import ExporterConfig
from engine_hooks.events import Step, Tokens
from engine_hooks.exporter import Exporter

RUNNING = 256
DECODE_STEP_S = 0.010


def _best_us_per_step(fn: Callable[[], None], steps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter_ns()
        for _ in range(steps):
            fn()
        best = min(best, (time.perf_counter_ns() - started) / steps / 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    config = ExporterConfig.create(
        url="http://127.0.0.1:9",  # never reached: the worker does not run during the engine-side rounds
        source_id="bench",
        spool_max_bytes=0,
        queue_size=10_000_000,
        batch_size=10_000_000,
        flush_interval_s=3600.0,
        spool_dir=tempfile.mkdtemp(prefix="chunkledger-bench-"),
    )
    exporter = Exporter(config)
    queue = exporter._queue  # the worker's side of it (take, discard); the worker does not run here
    tokens = exporter.emitter(Tokens, "ts", "request_id", "count", "total")
    step = exporter.emitter(Step, "ts", "step", "duration_s", "running")
    groups = exporter.emitter(Tokens, "ts", "request_id", "count", "total", "token_ids")
    full_step = exporter.emitter(
        Step,
        "ts",
        "step",
        "duration_s",
        "running",
        "request_ids",
        "token_counts",
        "token_totals",
        "token_ids",
    )
    rids = [f"req-{i:05d}" for i in range(RUNNING)]
    pending: dict[str, list[int]] = {rid: [] for rid in rids}
    n_step = [0]
    raw: deque[tuple[str, float, int, int]] = deque()

    def reset() -> None:
        queue.discard()

    def raw_step() -> None:
        ts = time.time()
        append = raw.append
        for rid in rids:
            append((rid, ts, 1, 7))
        raw.clear()

    def many_step() -> None:
        ts = time.time()
        tokens.many([(ts, rid, 1, 7) for rid in rids])
        step(ts, 0, 0.01, RUNNING)
        reset()

    def single_step() -> None:
        ts = time.time()
        for rid in rids:
            tokens(ts, rid, 1, 7)
        step(ts, 0, 0.01, RUNNING)
        reset()

    def keyword_step() -> None:
        ts = time.time()
        emit = exporter.emit
        for rid in rids:
            emit(Tokens, ts=ts, request_id=rid, count=1, total=7)
        reset()

    def coalesced_step() -> None:
        ts = time.time()
        for rid in rids:
            pending[rid].append(1234)
        n_step[0] += 1
        if n_step[0] % 16 == 0:
            groups.many([(ts, rid, 16, n_step[0], pending[rid]) for rid in rids])
            for rid in rids:
                pending[rid] = []
        full_step(ts, 0, 0.01, RUNNING, list(rids), [], [], [])
        reset()

    one = [1234]

    def columnar_step() -> None:
        # as engine_hooks.vllm.reporter: a row and the new ids per output, in one pass, then the
        # columns by one transposition (every scheduled request got a token: no second pass)
        ts = time.time()
        rows = []
        ids: list[int] = []
        for rid in rids:
            rows.append((rid, rid, 1, 7))
            ids += one
        _, ext, counts, totals = zip(*rows, strict=True)
        full_step(ts, 0, 0.01, RUNNING, list(ext), list(counts), list(totals), ids)
        reset()

    results = {}
    for name, fn in (
        ("raw", raw_step),
        ("many", many_step),
        ("single", single_step),
        ("keyword", keyword_step),
        ("coalesced", coalesced_step),
        ("columnar", columnar_step),
    ):
        results[name] = _best_us_per_step(fn, args.steps, args.rounds)

    # Worker cost per event: take, number, build, encode and validate 50 steps' worth of events.
    worker_ns = float("inf")
    for _ in range(args.rounds):
        ts = time.time()
        for _ in range(50):
            tokens.many([(ts, rid, 1, 7) for rid in rids])
        started = time.perf_counter_ns()
        prepared = exporter._prepare(queue.take(50 * RUNNING))
        worker_ns = min(worker_ns, (time.perf_counter_ns() - started) / (50 * RUNNING))
        assert sum(p.events for p in prepared) == 50 * RUNNING
        reset()

    raw_us = results["raw"]
    print(
        f"engine-thread cost per step, {RUNNING} running requests "
        f"(best of {args.rounds} x {args.steps} steps)"
    )
    print(f"  {'raw deque append x256':34s} {raw_us:7.2f} us/step  {raw_us * 1000 / RUNNING:6.1f} ns/event")
    labels = {
        "many": "tokens.many(256 rows) + step()",
        "single": "tokens(...) x256 + step()",
        "keyword": "emit(Tokens, **fields) x256",
        "coalesced": "plugin, tokens events of 16",
        "columnar": "plugin, step_tokens (columns)",
    }
    per_step = {"keyword": RUNNING, "coalesced": 1 + RUNNING / 16, "columnar": 1}
    for name, label in labels.items():
        us = results[name]
        events = per_step.get(name, RUNNING + 1)
        print(
            f"  {label:34s} {us:7.2f} us/step  {us * 1000 / events:6.1f} ns/event  "
            f"{us / raw_us:4.2f}x raw  {us / (DECODE_STEP_S * 1e6) * 100:5.2f}% of a 10 ms step"
        )
    print(f"  {'worker thread (off the engine)':34s} {worker_ns:7.0f} ns/event")
    # The worker per output token, for the two plugin forms (50 steps each).
    worker_tok = {}
    for name in ("coalesced", "columnar", "columnar, columns wire"):
        exporter._encoder.columns = (lambda: True) if name.endswith("wire") else (lambda: False)
        best = float("inf")
        for _ in range(args.rounds):
            ts = time.time()
            n_step[0] = 0
            for rid in rids:
                pending[rid] = []
            for k in range(48):
                for rid in rids:
                    pending[rid].append(1234)
                if name == "coalesced" and (k + 1) % 16 == 0:
                    groups.many([(ts, rid, 16, k + 1, pending[rid]) for rid in rids])
                    for rid in rids:
                        pending[rid] = []
                cols = (
                    ([1] * RUNNING, [7] * RUNNING, [1234] * RUNNING)
                    if name.startswith("columnar")
                    else ([], [], [])
                )
                full_step(ts, k, 0.01, RUNNING, list(rids), *cols)
            taken = queue.take(10_000_000)
            started = time.perf_counter_ns()
            exporter._prepare(taken)
            best = min(best, (time.perf_counter_ns() - started) / (48 * RUNNING))
            reset()
        worker_tok[name] = best
        print(f"  {'worker, ' + name + ' form':34s} {best:7.0f} ns per output token")
    exporter.shutdown(1.0)
    print(
        json.dumps(
            {
                "running": RUNNING,
                "raw_us_per_step": round(raw_us, 2),
                "many_us_per_step": round(results["many"], 2),
                "single_us_per_step": round(results["single"], 2),
                "keyword_us_per_step": round(results["keyword"], 2),
                "single_ns_per_event": round(results["single"] * 1000 / (RUNNING + 1), 1),
                "many_ratio_to_raw": round(results["many"] / raw_us, 2),
                "single_ratio_to_raw": round(results["single"] / raw_us, 2),
                "worker_ns_per_event": round(worker_ns, 1),
                "coalesced_us_per_step": round(results["coalesced"], 2),
                "columnar_us_per_step": round(results["columnar"], 2),
                "worker_ns_per_token_coalesced": round(worker_tok["coalesced"], 1),
                "worker_ns_per_token_columnar": round(worker_tok["columnar"], 1),
                "worker_ns_per_token_columns_wire": round(worker_tok["columnar, columns wire"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
