"""Ingest benchmark: output tokens/s and events/s followed durably over HTTP by the real server (every
rule of the default policy on), next to the ceiling.

Starts ``chunkledger serve`` for each backend in turn (``null://`` = the same server path with storage
disabled, i.e. the ceiling; a DuckDB file; a throwaway PostgreSQL database), drives it from a separate
process for a fixed time, then stops the server and counts what the store holds. Workloads:

* ``mix``: batches of 500 events, per 10 events 1 step (32 participants), 1 chunk, 1 queued and 7
  ``tokens`` events of 4 ids (the per-event unit of the first benchmarks);
* ``fleet-steps``: GPU-shaped engines (``bench.fleet_workload``: 256 running requests, 8 steps per
  batch), the output tokens on the step events, as the vLLM plugin sends them;
* ``fleet-columns``: ``fleet-steps`` sent as the columnar message (``engine_hooks/columnar.py``);
* ``fleet-tokens``: the same stream with a ``tokens`` event per request every 16 tokens (before);
* ``fleet-paced``: ``fleet-steps`` in real time, each engine a step every 30 ms, its exporter sending
  what was emitted since its last batch (at most 512 events, at most every 50 ms: the plugin's
  defaults), so a ledger that falls behind gets larger batches; reports how far behind the engines
  were at the end (``--clients`` engines; 118 offer about 1M output tokens a second).

Prints one table (tokens/s, steps/s, events/s, ack latency, the rule engine's intake p99, server CPU
per 1k output tokens, the load generator's CPU per 1k output tokens (``client``), the cores busy on
the whole machine over the load (``busy``), the share of the time the writer thread spent storing
groups (``writer``: near 1, storage is the bound) and the events a group held, peak RSS, and
whether the store holds exactly what was acknowledged); ``--json`` adds a JSON line per run. The
intake p99 is arrival -> observed by the rule engine, its counter rules decided (a cutoff a batch
calls for is decided by then): the bucket of ``chunkledger_rule_intake_seconds`` that holds it, an
upper bound.

    python -m bench.ingest --duration 10 --clients 16 --workloads fleet-steps,fleet-tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet_workload import STEP_S, Cycle, build_cycle, render
from bench.toolkit import free_port
from engine_hooks import columnar
from engine_hooks import events as ev
from engine_hooks.config import ExporterConfig

BATCH = 500
FLEET_STEPS = 2400  # one pass over a fleet engine's stream: 72 s of engine time, new ids every pass


@dataclass
class FleetOptions:
    loops: bool = False  # one request in 50 loops (bench.fleet_workload.LOOP_EVERY)
    steps_per_batch: int = 8  # a fleet engine's batch: 8 steps (240 ms) with their lifecycle events
    in_flight: int = 1  # fleet-steps/-columns/-tokens: batches an engine keeps in flight


PG_ADMIN = os.environ.get("CHUNKLEDGER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def batch_template(source: ev.Source) -> str:
    """One realistic 500-event batch as a %-template over (seq, request number) pairs.

    Mix per 10 events: 1 step (32 participants), 1 prefill chunk, 1 queued, 7 coalesced tokens groups
    of 4 token ids each. The ids are drawn from a Zipf-like distribution over a 32k vocabulary (seeded),
    like text: common tokens recur, but a request's output is not a loop. (Until stop 12 every tokens
    event carried the same ids [11, 12, 13, 14], so every request's output was a period-4 loop and the
    loop detector tracked a live candidate on every token, and cut every request.)
    """
    rnd = random.Random(0)
    vocab = list(range(32_000))
    weights = [1.0 / (rank + 10) for rank in range(len(vocab))]
    evs: list[ev.Event] = []
    for i in range(BATCH):
        seq, rid, t = 900_000_000 + i, f"REQ{i:04d}X", 1.7e9 + i * 1e-4
        k = i % 10
        if k == 0:
            evs.append(
                ev.Step(
                    seq=seq,
                    ts=t,
                    step=i,
                    duration_s=0.011,
                    prefill_tokens=256,
                    decode_tokens=31,
                    num_prefill_reqs=1,
                    num_decode_reqs=31,
                    running=32,
                    waiting=3,
                    kv_usage=0.41,
                    request_ids=[f"r-{j}" for j in range(32)],
                )
            )
        elif k == 1:
            evs.append(
                ev.Chunk(seq=seq, ts=t, request_id=rid, step=i, tokens=256, computed_before=512, kv_blocks=48)
            )
        elif k == 2:
            evs.append(ev.Queued(seq=seq, ts=t, request_id=rid, prompt_tokens=900, max_tokens=256))
        else:
            evs.append(
                ev.Tokens(
                    seq=seq,
                    ts=t,
                    request_id=rid,
                    count=4,
                    total=40 + i,
                    kv_blocks=48,
                    token_ids=rnd.choices(vocab, weights, k=4),
                )
            )
    raw = ev.encode_batch(source, evs).decode().replace("%", "%%")
    raw = re.sub(r'"seq":9000\d{5}', '"seq":%d', raw)
    raw = re.sub(r'"request_id":"REQ\d{4}X"', '"request_id":"%s"', raw)
    return raw


def _client_proc(
    urls: list[str],
    source_ids: list[str],
    duration: float,
    start_at: float,
    out: mp.Queue,
    workload: str,
    fleet: FleetOptions | None = None,
) -> None:
    """One client process running one thread per source (an engine's exporter),
    each sending to its ledger (``urls``, aligned with ``source_ids``: sources pinned to replicas)."""
    fleet = fleet or FleetOptions()
    if workload == "mix":
        threads = [
            threading.Thread(target=_client, args=(url, sid, duration, start_at, out))
            for url, sid in zip(urls, source_ids, strict=True)
        ]
    elif workload == "fleet-paced":
        steps = build_cycle("steps", steps=FLEET_STEPS, steps_per_batch=1, loops=fleet.loops)
        threads = [
            threading.Thread(target=_paced_client, args=(url, sid, steps, duration, start_at, out))
            for url, sid in zip(urls, source_ids, strict=True)
        ]
    else:
        columns = workload == "fleet-columns"
        cycle = build_cycle(
            "steps" if columns else workload.removeprefix("fleet-"),
            steps=FLEET_STEPS,
            steps_per_batch=fleet.steps_per_batch,
            loops=fleet.loops,
        )
        threads = [
            threading.Thread(
                target=_fleet_client,
                args=(url, sid, cycle, duration, start_at, out, columns, fleet.in_flight),
            )
            for url, sid in zip(urls, source_ids, strict=True)
        ]
    for t in threads:
        t.start()
    while time.time() < start_at:
        time.sleep(0.001)
    cpu0 = time.process_time()
    for t in threads:
        t.join()
    out.put({"client_cpu_s": time.process_time() - cpu0})  # this process, over the load


def _client(url: str, source_id: str, duration: float, start_at: float, out: mp.Queue) -> None:
    src = ev.Source(id=source_id, kind="engine", model="bench")
    tpl = batch_template(src)
    slots = [m.start() for m in re.finditer(r"%[ds]", tpl)]
    kinds = [tpl[p + 1] for p in slots]
    lat: list[float] = []
    acked = 0
    seq = 1
    b = 0
    with httpx.Client(base_url=url, timeout=30.0) as http:
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = time.perf_counter() + duration
        while time.perf_counter() < deadline:
            args: list[int | str] = []
            s = seq
            for k in kinds:
                if k == "d":
                    args.append(s)
                    s += 1
                else:  # requests live ~4 batches: half the ids continue, half are new
                    args.append(f"{source_id}-{(b * 40 + (s - seq) // 10) // 2}")
            acked += _send(http, (tpl % tuple(args)).encode(), lat)
            seq = s
            b += 1
    # 7 tokens events of 4 ids per 10 events
    out.put({"acked": acked, "lat": lat, "tokens": b * (BATCH // 10) * 7 * 4, "steps": b * (BATCH // 10)})


def _send(http: httpx.Client, body: bytes, lat: list[float], media: str = "application/json") -> int:
    """POST one batch; its latency into ``lat``; the events the ledger accepted (anything but 200 ends
    the run: a bench that retried would measure the retries)."""
    t0 = time.perf_counter()
    r = http.post("/v1/events", content=body, headers={"content-type": media})
    lat.append(time.perf_counter() - t0)
    if r.status_code != 200:
        raise SystemExit(f"{r.status_code}: {r.text[:300]}")
    return int(r.json()["accepted"])


def _fleet_client(
    url: str,
    source_id: str,
    cycle: Cycle,
    duration: float,
    start_at: float,
    out: mp.Queue,
    columns: bool = False,
    in_flight: int = 1,
) -> None:
    """One GPU-shaped engine (``bench.fleet_workload``), sending its batches back to back, ``in_flight``
    at a time (as the exporter's ``max_in_flight``: the ledger orders them by seq); ``columns``: as
    columnar messages, the first pass over its cycle encoded before the load starts (as the templates
    are rendered: the load generator's cost stays out of the ledger's share), later passes while it
    runs."""
    media = columnar.MEDIA_TYPE if columns else "application/json"
    n_batches = len(cycle.batches)
    first_seq = [1]
    for n in cycle.events:
        first_seq.append(first_seq[-1] + n)
    per_pass = first_seq[-1] - 1

    def seq_of(k: int) -> int:
        return (k // n_batches) * per_pass + first_seq[k % n_batches]

    def body_of(k: int) -> bytes:
        i = k % n_batches
        rid = f"{source_id}-c{k // n_batches}"
        body = render(cycle.batches[i], source_id, rid, seq_of(k), cycle.events[i])
        return columnar.encode_batch(ev.batch_decoder.decode(body)) if columns else body

    ready = [body_of(k) for k in range(n_batches)] if columns else []
    lock = threading.Lock()
    next_k = [0]
    lat: list[float] = []
    totals = {"acked": 0, "tokens": 0, "steps": 0, "loops": 0}

    def sender(deadline: float) -> None:
        mine = {"acked": 0, "tokens": 0, "steps": 0, "loops": 0}
        times: list[float] = []
        with httpx.Client(base_url=url, timeout=30.0) as http:
            while time.perf_counter() < deadline:
                with lock:
                    k = next_k[0]
                    next_k[0] += 1
                i = k % n_batches
                body = ready[k] if k < len(ready) else body_of(k)
                mine["acked"] += _send(http, body, times, media)
                mine["tokens"] += cycle.tokens[i]
                mine["loops"] += cycle.loops[i]
                mine["steps"] += cycle.steps // n_batches
        with lock:
            lat.extend(times)
            for key, v in mine.items():
                totals[key] += v

    while time.time() < start_at:
        time.sleep(0.001)
    deadline = time.perf_counter() + duration
    senders = [threading.Thread(target=sender, args=(deadline,)) for _ in range(in_flight)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    out.put({**totals, "lat": lat})


def _paced_client(
    url: str, source_id: str, steps: Cycle, duration: float, start_at: float, out: mp.Queue
) -> None:
    """One GPU-shaped engine in real time (a step every ``STEP_S``) with the plugin's exporter: one
    batch in flight; each sends the steps emitted since the last (their lifecycle events with them),
    at most ``batch_size`` events, at most every ``flush_interval_s``. A ledger that keeps up gets
    small batches; one that falls behind gets larger ones, as from real engines. ``steps``: the cycle
    with one step per template."""
    cfg = ExporterConfig(url=url, source_id="bench")  # the plugin's defaults
    head, _, _ = steps.batches[0].partition('"events":[')
    head = head.replace("@SRC@", source_id) + '"events":['
    parts = [t.partition('"events":[')[2].rpartition("]")[0] for t in steps.batches]
    tail = '],"schema_version":2}'
    n_steps = len(parts)
    lat: list[float] = []
    acked = tokens = sent = loops = batches = 0
    seq = 1
    with httpx.Client(base_url=url, timeout=30.0) as http:
        while time.time() < start_at:
            time.sleep(0.001)
        t0 = time.time()
        end = t0 + duration
        while True:
            now = time.time()
            if now >= end:
                break
            ready = int((now - t0) / STEP_S)
            if ready <= sent:
                time.sleep(min(STEP_S, end - now))
                continue
            events: list[str] = []
            n_events = 0
            k = sent
            while k < ready:
                i = k % n_steps
                n = steps.events[i]
                if events and n_events + n > cfg.batch_size:
                    break
                body = parts[i] % tuple(range(seq, seq + n))
                events.append(body.replace("@@", f"{source_id}-c{k // n_steps}"))
                seq += n
                n_events += n
                tokens += steps.tokens[i]
                loops += steps.loops[i]
                k += 1
            began = time.time()
            acked += _send(http, (head + ",".join(events) + tail).encode(), lat)
            batches += 1
            sent = k
            wait = cfg.flush_interval_s - (time.time() - began)
            if wait > 0 and int((time.time() - t0) / STEP_S) - sent < 4:  # the worker's timer
                time.sleep(wait)
        behind_s = (int((time.time() - t0) / STEP_S) - sent) * STEP_S
    out.put(
        {
            "acked": acked,
            "lat": lat,
            "tokens": tokens,
            "steps": sent,
            "loops": loops,
            "behind_s": behind_s,
            "batches": batches,
        }
    )


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _histogram_p99(fam: Metric | None) -> float:
    """The upper bound of the bucket holding the 99th percentile of a histogram family (inf if none)."""
    buckets = (
        sorted((float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket"))
        if fam is not None
        else []
    )
    total = buckets[-1][1] if buckets else 0
    return next((le for le, n in buckets if total and n >= 0.99 * total), float("inf"))


def _histogram_sum(fam: Metric | None) -> float:
    return sum(s.value for s in fam.samples if s.name.endswith("_sum")) if fam is not None else 0.0


def _histogram_count(fam: Metric | None) -> float:
    return sum(s.value for s in fam.samples if s.name.endswith("_count")) if fam is not None else 0.0


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_backend(
    name: str,
    db_url: str,
    duration: float,
    clients: int,
    workdir: Path,
    env: dict | None = None,
    server_root: str | None = None,
    workload: str = "mix",
    fleet: FleetOptions | None = None,
    replicas: int = 1,
) -> dict:
    # replicas: ledger processes on one PostgreSQL database, the sources pinned to them in turn.
    urls, servers = [], []
    try:
        # One after the other: each migrates the database at start.
        # server_root: run the server from another checkout (e.g. a git worktree of an older commit),
        # so old and new code are measured side by side in one run under the same load and workload.
        for i in range(replicas):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(workdir / f"{name.replace('/', '_')}-{i}.log", "wb")  # noqa: SIM115
            servers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "chunkledger", "serve", "--db", db_url, "--port", str(port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {}), **({"PYTHONPATH": server_root} if server_root else {})},
                    cwd=server_root,
                )
            )
            urls.append(url)
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            else:
                raise SystemExit(f"{name}: server did not get ready; see {workdir / f'{name}-{i}.log'}")
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        # fleet: clients build their cycle (fleet-columns: and encode its first pass)
        start_at = time.time() + {"mix": 3.0, "fleet-columns": 20.0}.get(workload, 8.0)
        n_procs = min(clients, 2)
        ids = [f"bench-{name}-{i}" for i in range(clients)]
        pinned = [urls[i % replicas] for i in range(clients)]
        procs = [
            ctx.Process(
                target=_client_proc,
                args=(pinned[k::n_procs], ids[k::n_procs], duration, start_at, q, workload, fleet),
            )
            for k in range(n_procs)
        ]
        for p in procs:
            p.start()
        while time.time() < start_at:
            time.sleep(0.01)
        cpu0, busy0 = sum(_cpu_s(s.pid) for s in servers), _machine_busy()
        got = [q.get(timeout=duration + 300) for _ in range(len(ids) + n_procs)]
        cpu, busy = sum(_cpu_s(s.pid) for s in servers) - cpu0, _machine_busy()
        results = [r for r in got if "client_cpu_s" not in r]
        client_cpu = sum(r["client_cpu_s"] for r in got if "client_cpu_s" in r)
        for p in procs:
            p.join()
        rss = max(_rss_peak_mb(s.pid) for s in servers)
        scraped = [
            {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)}
            for url in urls
        ]
        intake_p99 = max(_histogram_p99(m.get("chunkledger_rule_intake_seconds")) for m in scraped)
        # the writer thread: its share of the load's wall time in group commits, and events a group
        group_s = sum(_histogram_sum(m.get("chunkledger_ingest_group_seconds")) for m in scraped)
        groups = sum(_histogram_count(m.get("chunkledger_ingest_group_events")) for m in scraped)
        group_events = sum(_histogram_sum(m.get("chunkledger_ingest_group_events")) for m in scraped)
        by_rule: dict[str, int] = {}
        for m in scraped:
            for smp in m["chunkledger_cutoffs"].samples if "chunkledger_cutoffs" in m else ():
                if smp.name == "chunkledger_cutoffs_total":
                    by_rule[smp.labels["rule"]] = by_rule.get(smp.labels["rule"], 0) + int(smp.value)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            server.wait(60)
    acked = sum(r["acked"] for r in results)
    lat = sorted(x for r in results for x in r["lat"])
    stored = _count_stored(db_url) if not db_url.startswith("null") else acked
    tokens = sum(r.get("tokens", 0) for r in results)
    return {
        "backend": name,
        "workload": workload,
        "acked": acked,
        "stored": stored,
        "events_per_s": stored / duration,
        "tokens_per_s": tokens / duration,
        "steps_per_s": sum(r.get("steps", 0) for r in results) / duration,
        "server_cpu_s": cpu,
        "cpu_ms_per_1k_tokens": 1e3 * cpu / tokens * 1e3 if tokens else float("nan"),
        "client_cpu_ms_per_1k_tokens": 1e3 * client_cpu / tokens * 1e3 if tokens else float("nan"),
        # Cores busy on the whole machine over the load (server, clients, the database, the rest).
        "cores_busy": (busy[0] - busy0[0]) / max(busy[1] - busy0[1], 1) * (os.cpu_count() or 1),
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
        "batches": len(lat),
        "server_rss_peak_mb": rss,
        # Arrival -> observed by the rule engine (a cutoff a batch calls for is decided by then): the
        # histogram bucket that holds the 99th percentile, as an upper bound.
        "rule_intake_p99_ms": intake_p99 * 1e3,
        # the writer thread busy storing groups (per replica: over 1 it cannot keep up alone), and the
        # events of a group (since start: the warm-up sends nothing)
        "writer_busy": group_s / duration / replicas,
        "events_per_group": group_events / max(groups, 1),
        "loops_sent": sum(r.get("loops", 0) for r in results),  # fleet workloads with --loops
        # fleet-paced: how far the engine furthest behind was at the end (seconds of its steps not
        # sent yet: about 0 when the ledger keeps up), and the steps per batch its exporters sent
        "behind_s_max": max((r.get("behind_s", 0.0) for r in results), default=0.0),
        "steps_per_batch": sum(r.get("steps", 0) for r in results)
        / max(sum(r.get("batches", 0) for r in results), 1),
        "cutoffs": sum(by_rule.values()),
        "cutoffs_by_rule": dict(sorted(by_rule.items())),
    }


def _count_stored(db_url: str) -> int:
    import sqlalchemy as sa

    eng = sa.create_engine(db_url)
    with eng.connect() as conn:
        n = int(conn.exec_driver_sql("SELECT count(*) FROM events").scalar_one())
    eng.dispose()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of load per backend")
    ap.add_argument(
        "--clients",
        type=int,
        default=16,
        help="concurrent sources (engines), each with --in-flight batches in flight (2 processes)",
    )
    ap.add_argument(
        "--backends",
        default="null,duckdb,postgres",
        help="also: duckdb-gc-default (no GC tuning), duckdb-otlp (exporting finished requests as spans "
        "to an OTLP sink), postgres-x2 (two ledger processes on one database, "
        "the sources pinned to them in turn); NAME@DIR runs that server from the checkout in DIR "
        "(e.g. a git worktree of an older commit: null@/tmp/old,null compares old and new in one run)",
    )
    ap.add_argument(
        "--workloads",
        default="mix",
        help="comma list: mix (500-event batches of the old per-event mix), fleet-steps (GPU-shaped "
        "engines, output tokens on the step events), fleet-columns (fleet-steps as the columnar "
        "message), fleet-tokens (the same stream with tokens events), "
        "fleet-paced (fleet-steps in real time, 33 steps/s per engine, batched as the plugin's exporter "
        "does: --clients engines)",
    )
    ap.add_argument(
        "--steps-per-batch",
        type=int,
        default=8,
        help="fleet workloads: engine steps per batch (8: 240 ms of engine time; an exporter whose "
        "ledger answers slowly sends larger batches, up to its batch_size)",
    )
    ap.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="fleet-steps, fleet-columns, fleet-tokens: batches each engine keeps in flight (the "
        "exporter's max_in_flight is 4)",
    )
    ap.add_argument(
        "--loops",
        action="store_true",
        help="fleet workloads: one request in 50 falls into a loop (the rules cut it; the clients do not "
        "confirm, so the answers keep carrying the commands); prints the cutoffs decided",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunkledger-bench-") as tmp:
        workdir = Path(tmp)
        for workload in args.workloads.split(","):
            for spec in args.backends.split(","):
                rows.append(_run_spec(spec, workload, args, workdir))
    print(
        f"\ningest: {args.clients} clients, {args.duration:.0f} s per backend and workload, "
        f"{os.cpu_count()} cores (mix: batches of {BATCH} events; "
        f"fleet: {args.steps_per_batch} steps of 256 requests per batch, {args.in_flight} in flight)"
    )
    print(
        f"{'workload':<14}{'backend':<20}{'tokens/s':>11}{'steps/s':>9}{'durable ev/s':>14}{'p50 ms':>8}"
        f"{'p99 ms':>8}{'rules p99':>10}{'CPU ms/1k tok':>15}{'client':>8}{'busy':>6}{'writer':>7}"
        f"{'ev/group':>9}{'RSS MB':>8}{'stored=acked':>14}"
    )
    for r in rows:
        print(
            f"{r['workload']:<14}{r['backend']:<20}{r['tokens_per_s']:>11,.0f}{r['steps_per_s']:>9,.0f}"
            f"{r['events_per_s']:>14,.0f}{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}"
            f"{'<=' + format(r['rule_intake_p99_ms'], '.0f'):>10}"
            f"{r['cpu_ms_per_1k_tokens']:>15.2f}{r['client_cpu_ms_per_1k_tokens']:>8.2f}"
            f"{r['cores_busy']:>6.2f}{r['writer_busy']:>7.2f}{r['events_per_group']:>9,.0f}"
            f"{r['server_rss_peak_mb']:>8.0f}{r['stored'] == r['acked']!s:>14}"
        )
        if r["workload"] == "fleet-paced":
            offered = args.clients / STEP_S * r["tokens_per_s"] / max(r["steps_per_s"], 1e-9)
            print(
                f"{'':<14}{'':<20}{args.clients} engines in real time offer about {offered:,.0f} "
                f"tokens/s; their exporters sent {r['steps_per_batch']:.1f} steps per batch; the engine "
                f"furthest behind was {r['behind_s_max']:.1f} s behind at the end"
            )
        if args.loops:
            rules = ", ".join(f"{k} {v:,}" for k, v in r["cutoffs_by_rule"].items())
            print(f"{'':<14}{'':<20}loops sent: {r['loops_sent']:,}, cutoffs decided: {rules or 0}")
        if args.json:
            print(json.dumps(r))


def _build_extension(root: Path) -> None:
    """Build the compiled loop detector in another checkout (a git worktree has the source, not the
    built module): without it that ledger runs the Python detector and the comparison is not fair."""
    if any((root / "ledger" / "rules").glob("_loopc*.so")):
        return
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, capture_output=True, text=True
    )
    if built.returncode:
        raise SystemExit(f"building the loop detector in {root} failed:\n{built.stderr[-2000:]}")


class OtlpSink:
    """An OTLP/HTTP endpoint that accepts every export (an empty ``ExportTraceServiceResponse``) and
    counts requests and bytes without decoding them: the ledger's cost of exporting, not a backend's."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.requests = self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                sink.requests += 1
                sink.bytes += n
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def __enter__(self) -> OtlpSink:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _run_spec(spec: str, workload: str, args: argparse.Namespace, workdir: Path) -> dict:
    name, _, root = spec.partition("@")
    suffix = f"@{Path(root).name}" if root else ""
    label = ("ceiling(null)" if name == "null" else name) + suffix
    root_arg = str(Path(root).resolve()) if root else None
    if root_arg:
        _build_extension(Path(root_arg))
    run = functools.partial(
        run_backend,
        duration=args.duration,
        clients=args.clients,
        workdir=workdir,
        workload=workload,
        fleet=FleetOptions(loops=args.loops, steps_per_batch=args.steps_per_batch, in_flight=args.in_flight),
    )
    if name == "null":
        return run(label, "null://", server_root=root_arg)
    if name in ("duckdb", "duckdb-gc-default"):
        # duckdb-gc-default: CPython's default collector thresholds (CHUNKLEDGER_GC_TUNING=0)
        env = {"CHUNKLEDGER_GC_TUNING": "0"} if name != "duckdb" else None
        path = f"duckdb:///{workdir}/bench-{name}-{uuid.uuid4().hex[:6]}.duckdb"
        return run(label, path, env=env, server_root=root_arg)
    if name == "duckdb-otlp":
        # DuckDB exporting every finished request's spans to an OTLP/HTTP sink in this process
        path = f"duckdb:///{workdir}/bench-{name}-{uuid.uuid4().hex[:6]}.duckdb"
        with OtlpSink() as sink:
            env = {"CHUNKLEDGER_OTLP_TRACES_ENDPOINT": sink.url}
            result = run(label, path, env=env, server_root=root_arg)
        print(f"{label}: the OTLP sink took {sink.requests} exports, {sink.bytes:,} bytes", flush=True)
        result["otlp_requests"], result["otlp_bytes"] = sink.requests, sink.bytes
        return result
    if name not in ("postgres", "postgres-x2"):
        raise SystemExit(f"unknown backend {name!r}")
    import sqlalchemy as sa

    db = f"chunkledger_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{db}"')
    try:
        replicas = 2 if name == "postgres-x2" else 1
        return run(label, PG_ADMIN.rsplit("/", 1)[0] + f"/{db}", server_root=root_arg, replicas=replicas)
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.dispose()


if __name__ == "__main__":
    main()
