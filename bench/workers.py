"""Ledger workers behind NATS JetStream: scale and failover under a paced GPU-shaped fleet.

Each run starts ``N`` workers (``chunkledger serve`` with ``CHUNKLEDGER_NATS_URL``) on a throwaway
PostgreSQL database and stream, then ``--engines`` engines of ``bench.fleet_workload`` in real time (a
step every 30 ms; one request in 50 loops), published to the stream as the exporter would (up to 512
events a message, at most every 50 ms), from two load processes. After the load it waits until the
store holds every event published (the drain), and prints per run: output tokens/s offered, how long
the drain took, events stored against published (0 lost, 0 doubled means equal), the workers' CPU per
1k output tokens, and the loop cutoffs decided.

``--kill`` kills one of the workers with SIGKILL ``--kill-at`` seconds into the load, and prints how
long until the survivors held every partition, and the loop cutoffs decided after the kill for the
sources whose partitions the killed worker held.

    python -m bench.workers --engines 16 --duration 20 --workers 1,2,3
    python -m bench.workers --engines 16 --duration 20 --workers 3 --kill
    python -m bench.workers --engines-per-worker 6 --duration 20 --workers 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.fleet_workload import STEP_S, Cycle, build_cycle
from bench.ingest import _cpu_s
from bench.toolkit import free_port
from engine_hooks import streams
from engine_hooks.config import ExporterConfig
from ledger.jetstream.leases import holders as _holders
from ledger.store import open_store

PG_ADMIN = os.environ.get("CHUNKLEDGER_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
NATS = os.environ.get("CHUNKLEDGER_BENCH_NATS", "nats://127.0.0.1:4222")


async def _engine(
    js: Any, stream: str, partitions: int, sid: str, steps: Cycle, t0: float, end: float
) -> dict:
    """One engine in real time, as ``bench.ingest``'s paced client, published to the stream."""
    cfg = ExporterConfig(url="http://x", source_id="bench")  # the plugin's defaults
    head, _, _ = steps.batches[0].partition('"events":[')
    head = head.replace("@SRC@", sid) + '"events":['
    parts = [t.partition('"events":[')[2].rpartition("]")[0] for t in steps.batches]
    tail = '],"schema_version":2}'
    subject = streams.events_subject(stream, sid, partitions)
    n_steps, seq, sent = len(parts), 1, 0
    out = {"events": 0, "tokens": 0, "loops": 0, "published": 0}
    while (now := time.time()) < end:
        ready = int((now - t0) / STEP_S)
        if ready <= sent:
            await asyncio.sleep(min(STEP_S, end - now))
            continue
        events: list[str] = []
        n_events, k = 0, sent
        while k < ready:
            i = k % n_steps
            n = steps.events[i]
            if events and n_events + n > cfg.batch_size:
                break
            events.append((parts[i] % tuple(range(seq, seq + n))).replace("@@", f"{sid}-c{k // n_steps}"))
            seq, n_events, k = seq + n, n_events + n, k + 1
            out["tokens"] += steps.tokens[i]
            out["loops"] += steps.loops[i]
        body = (head + ",".join(events) + tail).encode()
        while True:  # as the exporter: retried until the stream has it
            try:
                await js.publish(subject, body, headers={streams.MSG_ID: streams.message_id(sid, body)})
                break
            except Exception:
                await asyncio.sleep(0.05)
        out["events"] += n_events
        out["published"] += 1
        sent = k
        await asyncio.sleep(cfg.flush_interval_s)
    return out


def _load_proc(
    sources: list[str], stream: str, partitions: int, duration: float, start_at: float, q: mp.Queue
) -> None:
    steps = build_cycle("steps", steps=2000, steps_per_batch=1, seed=1, loops=True)

    async def run() -> list[dict]:
        import nats

        nc = await nats.connect(NATS)
        js = nc.jetstream(timeout=10)
        while time.time() < start_at:
            await asyncio.sleep(0.005)
        t0 = time.time()
        outs = await asyncio.gather(
            *(_engine(js, stream, partitions, s, steps, t0, t0 + duration) for s in sources)
        )
        await nc.drain()
        return list(outs)

    for s, o in zip(sources, asyncio.run(run()), strict=True):
        q.put({"source": s, **o})


def _scalar(db: str, sql: str) -> Any:
    eng = sa.create_engine(db)
    try:
        with eng.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()
    finally:
        eng.dispose()


def run(
    n_workers: int, engines: int, duration: float, partitions: int, kill_at: float | None, workdir: Path
) -> dict:
    name = f"bench_workers_{uuid.uuid4().hex[:8]}"
    stream = f"BENCH{uuid.uuid4().hex[:8].upper()}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    db = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        open_store(db).close()  # migrated once, before the workers start
        for i in range(n_workers):
            port = free_port()
            log = open(workdir / f"{stream}-{i}.log", "wb")  # noqa: SIM115
            env = {
                **os.environ,
                "CHUNKLEDGER_NATS_URL": NATS,
                "CHUNKLEDGER_NATS_STREAM": stream,
                "CHUNKLEDGER_NATS_PARTITIONS": str(partitions),
                "CHUNKLEDGER_NATS_BALANCE_S": "0.5",
            }
            cmd = [sys.executable, "-m", "chunkledger", "serve", "--db", db, "--port", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            urls.append(f"http://127.0.0.1:{port}")
            for _ in range(300):
                try:
                    if httpx.get(f"{urls[-1]}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
        deadline = time.time() + 30
        while len(set(_holders(db, stream).values())) < n_workers or len(_holders(db, stream)) < partitions:
            if time.time() > deadline:
                raise SystemExit("the workers did not share the partitions")
            time.sleep(0.2)
        sources = [f"engine-{i}" for i in range(engines)]
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        start_at = time.time() + 8.0
        loaders = [
            ctx.Process(target=_load_proc, args=(sources[k::2], stream, partitions, duration, start_at, q))
            for k in range(2)
        ]
        for loader in loaders:
            loader.start()
        while time.time() < start_at:
            time.sleep(0.01)
        cpu0 = {p.pid: _cpu_s(p.pid) for p in procs}
        killed: dict[str, Any] = {}
        if kill_at is not None:
            time.sleep(kill_at)
            before = _holders(db, stream)
            victim = procs[0]
            victim_cpu = _cpu_s(victim.pid)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            t_kill = time.time()
            while True:  # until the survivors hold every partition
                now = _holders(db, stream)
                if len(now) == partitions and len(set(now.values())) == n_workers - 1:
                    break
                time.sleep(0.05)
            # the victim's partitions: those held before by a backend that holds none now
            gone = {p for p, pid in before.items() if pid not in set(now.values())}
            killed = {
                "retaken_s": time.time() - t_kill,
                "partitions": sorted(gone),
                "t_kill": t_kill,
                "victim_cpu": victim_cpu - cpu0[victim.pid],
            }
        outs = [q.get(timeout=duration + 300) for _ in sources]
        for loader in loaders:
            loader.join()
        load_end = time.time()
        published = sum(o["events"] for o in outs)
        tokens = sum(o["tokens"] for o in outs)
        while (stored := int(_scalar(db, "SELECT count(*) FROM events"))) < published:
            if time.time() - load_end > 120:
                break
            time.sleep(0.1)
        drain_s = time.time() - load_end
        alive = [p for p in procs if p.poll() is None]
        cpu = sum(_cpu_s(p.pid) - cpu0[p.pid] for p in alive) + killed.get("victim_cpu", 0.0)
        cutoffs = int(_scalar(db, "SELECT count(*) FROM cutoffs WHERE rule = 'loop'"))
        result = {
            "workers": n_workers,
            "engines": engines,
            "offered_tokens_s": tokens / duration,
            "published": published,
            "stored": stored,
            "drain_s": drain_s,
            "cpu_ms_per_1k": cpu * 1000 / (tokens / 1000),
            "loop_cutoffs": cutoffs,
            "loops_published": sum(o["loops"] for o in outs),
        }
        if killed:
            victims = [s for s in sources if streams.partition_of(s, partitions) in set(killed["partitions"])]
            after = int(
                _scalar(
                    db,
                    "SELECT count(*) FROM cutoffs WHERE rule = 'loop' AND decided_ts > "
                    f"{killed['t_kill']} AND source_id IN ({', '.join(repr(v) for v in victims) or 'NULL'})",
                )
            )
            result.update(
                retaken_s=killed["retaken_s"],
                killed_partitions=len(killed["partitions"]),
                victim_sources=len(victims),
                victim_loop_cutoffs_after_kill=after,
            )
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

        async def drop() -> None:
            import nats

            nc = await nats.connect(NATS)
            try:
                await nc.jetstream().delete_stream(stream)
            finally:
                await nc.close()

        asyncio.run(drop())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument(
        "--engines-per-worker",
        type=int,
        default=0,
        help="instead of --engines: this many engines a worker (each run offers its workers the same load)",
    )
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--workers", default="1,2,3", help="comma-separated worker counts, one run each")
    ap.add_argument("--partitions", type=int, default=12)
    ap.add_argument("--kill", action="store_true", help="kill one worker with SIGKILL during the load")
    ap.add_argument("--kill-at", type=float, default=6.0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.workers.split(",")):
            r = run(
                n,
                n * args.engines_per_worker if args.engines_per_worker else args.engines,
                args.duration,
                args.partitions,
                args.kill_at if args.kill else None,
                Path(tmp),
            )
            rows.append(r)
            print(r, flush=True)
    print()
    print(
        "workers  engines  offered tok/s  published   stored  drain s  CPU ms/1k tok  loop cutoffs"
        + ("  retaken s  victim cutoffs after kill" if args.kill else "")
    )
    for r in rows:
        line = (
            f"{r['workers']:>7}  {r['engines']:>7}  {r['offered_tokens_s']:>13,.0f}  {r['published']:>9,}  "
            f"{r['stored']:>7,}  {r['drain_s']:>7.1f}  {r['cpu_ms_per_1k']:>13.2f}  {r['loop_cutoffs']:>12,}"
        )
        if "retaken_s" in r:
            after, of = r["victim_loop_cutoffs_after_kill"], r["victim_sources"]
            line += f"  {r['retaken_s']:>9.2f}  {after:>5} of {of} sources"
        print(line)


if __name__ == "__main__":
    main()
