"""Analytics benchmark: load ~10M events (~200k requests) through the store's write path, then time
every named query the API, CLI and dashboard use.

The load comes from a small continuous-batching engine model (several engines and one gateway): each
step runs at most one prefill chunk within a token budget (other partial prefills sit the step out,
holding KV), every decoding request gets a token, tokens are coalesced a few at a time, and now and
then a request is preempted and resumed. Events go through ``Store.write`` in group commits, exactly
as the ingest writer stores them (the HTTP decode is left out: bench/ingest.py measures that).

    python -m bench.analytics                      # DuckDB file, 200k requests
    python -m bench.analytics --requests 20000     # quicker
    python -m bench.analytics --db postgresql+psycopg://postgres@127.0.0.1:5432/bench

Goal (issue 5): every dashboard query < 1 s at 10M events on DuckDB.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine_hooks import events as ev
from ledger.analytics import queries as q
from ledger.analytics.window import Window
from ledger.store import open_store

BUDGET = 512  # prefill tokens per step
SLOTS = 48  # running requests per engine
FLUSH = 3  # output tokens per tokens event


@dataclass(eq=False)
class Req:
    id: str
    prompt: int
    target: int
    arrival: float
    computed: int = 0
    output: int = 0
    pending: int = 0
    first_pending_ts: float | None = None
    chunks: int = 0
    preempted_at: float | None = None
    preempted_out: int = 0


@dataclass
class Sink:
    """Collects events per source and hands out full batches."""

    source: ev.Source
    batch_events: int
    seq: int = 0
    events: list[Any] = field(default_factory=list)

    def add(self, e: Any) -> None:
        self.seq += 1
        self.events.append(e)

    def take(self, force: bool = False) -> ev.Batch | None:
        if not self.events or (len(self.events) < self.batch_events and not force):
            return None
        out, self.events = self.events, []
        return ev.Batch(source=self.source, events=out)


def generate(n_requests: int, engines: int, seed: int, batch_events: int) -> Iterator[ev.Batch]:
    rng = random.Random(seed)
    t_start = time.time() - 3 * 3600
    gw = Sink(ev.Source(id="bench-gw", kind="gateway"), batch_events)
    per_engine = math.ceil(n_requests / engines)
    for k in range(engines):
        en = Sink(ev.Source(id=f"bench-engine-{k}", kind="engine", model=f"model-{k % 2}"), batch_events)
        t = t_start
        # Arrivals at ~90 % of what the engine can serve, so queues form and drain.
        arrivals: deque[Req] = deque()
        at = t
        for i in range(per_engine):
            at += rng.expovariate(1 / 0.045)
            prompt = min(int(rng.lognormvariate(6.5, 1.0)) + 8, 16_000)
            target = min(int(rng.lognormvariate(4.6, 0.8)) + 1, 2000)
            arrivals.append(Req(f"bench-{k}-{i:07d}", prompt, target, at))
        waiting: deque[Req] = deque()
        running: list[Req] = []
        step = 0
        while arrivals or waiting or running:
            while arrivals and arrivals[0].arrival <= t:
                r = arrivals.popleft()
                gw.add(ev.Arrived(seq=gw.seq, ts=r.arrival - 0.002, request_id=r.id, stream=True))
                gw.add(
                    ev.AdmissionEnqueued(seq=gw.seq, ts=r.arrival - 0.0015, request_id=r.id, entry_s=0.0005)
                )
                gw.add(ev.Admitted(seq=gw.seq, ts=r.arrival - 0.001, request_id=r.id, wait_s=0.0005))
                en.add(
                    ev.Queued(
                        seq=en.seq, ts=r.arrival, request_id=r.id, prompt_tokens=r.prompt, max_tokens=4096
                    )
                )
                waiting.append(r)
            while waiting and len(running) < SLOTS:
                r = waiting.popleft()
                if r.preempted_at is not None:
                    en.add(
                        ev.Resumed(
                            seq=en.seq,
                            ts=t,
                            request_id=r.id,
                            wait_s=t - r.preempted_at,
                            output_tokens=r.preempted_out,
                        )
                    )
                    r.preempted_at = None
                running.append(r)
            if not running:
                t = arrivals[0].arrival if arrivals else t
                continue
            budget = BUDGET
            ran, stalled, stalled_blocks = [], [], []
            prefill_tokens = depth_tokens = max_depth = decodes = 0
            chunks = []
            for r in running:
                if r.computed < r.prompt:
                    if budget <= 0:
                        stalled.append(r.id)
                        stalled_blocks.append(r.computed // 16 + 1)
                        continue
                    n = min(r.prompt - r.computed, budget)
                    budget -= n
                    chunks.append((r, n, r.computed))
                    prefill_tokens += n
                    depth_tokens += n * r.computed
                    max_depth = max(max_depth, r.computed)
                    ran.append(r.id)
                else:
                    decodes += 1
                    ran.append(r.id)
            dur = 0.002 + 2e-5 * prefill_tokens + 6e-10 * depth_tokens + 6e-5 * decodes
            for r, n, before in chunks:
                en.add(
                    ev.Chunk(
                        seq=en.seq,
                        ts=t,
                        request_id=r.id,
                        step=step,
                        tokens=n,
                        computed_before=before,
                        kv_blocks=(before + n) // 16 + 1,
                        wait_s=(t - r.arrival) if r.chunks == 0 else None,
                    )
                )
                r.chunks += 1
            end = t + dur
            done = []
            for r in running:
                if r.id not in ran:
                    continue
                if r.computed < r.prompt:
                    r.computed += next(n for c, n, _ in chunks if c is r)
                    if r.computed < r.prompt:
                        continue
                r.output += 1
                r.pending += 1
                if r.first_pending_ts is None:
                    r.first_pending_ts = end
                finished = r.output >= r.target
                if r.pending >= FLUSH or finished:
                    en.add(
                        ev.Tokens(
                            seq=en.seq,
                            ts=end,
                            request_id=r.id,
                            count=r.pending,
                            total=r.output,
                            first_ts=r.first_pending_ts,
                            kv_blocks=(r.prompt + r.output) // 16 + 1,
                        )
                    )
                    if r.output == r.pending:
                        gw.add(ev.FirstByte(seq=gw.seq, ts=r.first_pending_ts + 0.0005, request_id=r.id))
                    r.pending, r.first_pending_ts = 0, None
                if finished:
                    en.add(
                        ev.Finished(
                            seq=en.seq, ts=end, request_id=r.id, reason="stop", output_tokens=r.output
                        )
                    )
                    gw.add(ev.Completed(seq=gw.seq, ts=end + 0.001, request_id=r.id, status_code=200))
                    done.append(r)
            en.add(
                ev.Step(
                    seq=en.seq,
                    ts=t,
                    step=step,
                    duration_s=dur,
                    prefill_tokens=prefill_tokens,
                    decode_tokens=decodes,
                    num_prefill_reqs=len(chunks),
                    num_decode_reqs=decodes,
                    running=len(running),
                    waiting=len(waiting),
                    kv_usage=min(1.0, len(running) / SLOTS),
                    request_ids=ran,
                    prefill_depth_tokens=depth_tokens,
                    max_prefill_depth=max_depth,
                    stalled_request_ids=stalled,
                    stalled_kv_blocks=stalled_blocks,
                )
            )
            for r in done:
                running.remove(r)
            if running and rng.random() < 0.002:  # a preemption: KV pressure frees the newest
                victim = running.pop()
                en.add(
                    ev.Preempted(
                        seq=en.seq,
                        ts=end,
                        request_id=victim.id,
                        kv_blocks_freed=victim.computed // 16 + 1,
                        computed_tokens=victim.computed + victim.output,
                    )
                )
                victim.preempted_at, victim.preempted_out = end, victim.output
                victim.computed = 0
                waiting.appendleft(victim)
            step += 1
            t = end
            for sink in (en, gw):
                b = sink.take()
                if b is not None:
                    yield b
        for sink in (en, gw):
            b = sink.take(force=True)
            if b is not None:
                yield b


def _timed(fn: Callable[[], Any], runs: int) -> tuple[float, float, Any]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times), out


def _size(out: Any) -> int:
    if isinstance(out, dict):
        for k in ("rows", "items", "gaps"):
            if k in out:
                return len(out[k])
        return 1
    return len(out) if isinstance(out, list) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--db", default=None, help="database URL (default: a DuckDB file in a temp dir)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="chunkledger-bench-")
    url = args.db or f"duckdb:///{tmp}/ledger.duckdb"
    store = open_store(url)
    t0 = time.perf_counter()
    events = 0
    group: list[ev.Batch] = []
    for b in generate(args.requests, args.engines, args.seed, batch_events=2500):
        group.append(b)
        events += len(b.events)
        if sum(len(x.events) for x in group) >= 10_000:
            store.write(group)
            group = []
        if events and events % 1_000_000 < len(b.events):
            print(f"  loaded {events / 1e6:.1f}M events, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if group:
        store.write(group)
    load_s = time.perf_counter() - t0
    n_req = store.count("requests")
    n_steps = store.count("steps")
    print(
        f"loaded {events:,} events ({n_req:,} requests, {n_steps:,} steps) into {store.dialect} "
        f"in {load_s:.0f} s ({events / load_s:,.0f} events/s through Store.write)"
    )

    with store.engine.connect() as conn:
        a_slow = q.list_requests(conn, sort="e2e_s", limit=1).rows[0].request_id
        mid = q.list_requests(conn, sort="start_ts", limit=1, offset=n_req // 2).rows[0]
        now = (mid.start_ts or time.time()) + 1
        hour = Window(since=now - 3600, until=now)
        named: list[tuple[str, Callable[[], Any]]] = [
            ("attribution, all time", lambda: q.attribution(conn)),
            ("attribution, last hour by model", lambda: q.attribution(conn, hour, group_by=["model"])),
            ("attribution, 1-min buckets, all time", lambda: q.attribution(conn, bucket_s=60)),
            (
                "attribution, by model + finish reason",
                lambda: q.attribution(conn, group_by=["model", "finish_reason"]),
            ),
            ("decode ITL, all time by model", lambda: q.decode_itl(conn, group_by_model=True)),
            ("decode ITL, last hour", lambda: q.decode_itl(conn, hour)),
            ("requests, slowest e2e page", lambda: q.list_requests(conn, sort="e2e_s", limit=50)),
            ("requests, last hour by ttft", lambda: q.list_requests(conn, hour, sort="ttft_s", limit=50)),
            ("request ITL (one request)", lambda: q.request_itl(conn, a_slow)),
            ("why (slowest request)", lambda: q.why(conn, a_slow)),
            ("KV stalls (mid-run 'now')", lambda: q.kv_stalls(conn, now)),
        ]
        print(f"\n{'query':42} {'median ms':>10} {'max ms':>9} {'rows':>6}")
        worst = 0.0
        for name, fn in named:
            med, mx, out = _timed(fn, args.runs)
            worst = max(worst, med)
            print(f"{name:42} {med * 1e3:10.1f} {mx * 1e3:9.1f} {_size(out):6d}")
    print(f"\nslowest query median: {worst * 1e3:.0f} ms (goal < 1000 ms at 10M events on DuckDB)")
    store.close()


if __name__ == "__main__":
    main()
