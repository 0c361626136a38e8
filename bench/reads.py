"""Reads over an hour of a fleet: every dashboard and API read, timed against the real server.

Builds (``bench.fleet_db``, DuckDB SQL straight into the migrated schema) or reuses (``--db PATH``) a
DuckDB ledger holding one hour of 236 GPU-shaped engines (3 models, 16.5 steps/s, 256 running
requests each: about 14M steps and 500k requests), starts ``chunkledger serve`` on it, and times each
read the dashboard's pages and the API's users make, over the whole hour and over the dashboard's
windows (the last hour, the last 15 minutes of the data; "all" is no window). Prints one line per read:
p50 and max seconds of ``--repeat`` calls (the first call included), over 1 s marked.

    python -m bench.reads                                   # build in a temp dir, time, delete it
    python -m bench.reads --db /tmp/fleet/hour.duckdb       # build there once, reuse it after
    python -m bench.reads --db /tmp/fleet/hour.duckdb --only kv,requests

Goal (issue 37): every read under 1 s on DuckDB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fleet_db import Fleet, build
from bench.toolkit import ROOT, Proc, free_port, percentile, say
from dashboard import fleet as dash_fleet
from dashboard.queries import sql_literal, step_bars_sql

GOAL_S = 1.0


@dataclass
class Read:
    page: str  # the dashboard page that makes it, or "api"
    name: str
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: Any = None


def _data_span(path: str) -> tuple[float, float, int]:
    """(first, last) step time and the number of steps, read before the server owns the file."""
    import duckdb

    con = duckdb.connect(path, read_only=True)
    try:
        lo, hi, n = con.execute("SELECT min(ts), max(ts), count(*) FROM steps").fetchone()  # type: ignore[misc]
    finally:
        con.close()
    return float(lo), float(hi), int(n)


def old_kv_usage_sql(since: float | None) -> str:
    """What the KV page sent before the fleet views: a line per engine (and only the first 5,000
    points: at 236 engines, the window's first 100 s)."""
    where = f"WHERE ts >= {since:.3f} " if since is not None else ""
    return (
        "SELECT source_id, floor(ts / 5) * 5 AS t, max(kv_usage) AS kv_usage_max, max(running) AS running, "
        f"max(waiting) AS waiting FROM steps {where}GROUP BY 1, 2 ORDER BY 2 LIMIT 5000"
    )


SQL_DOC_EXAMPLES = (
    "SELECT model, count(*), quantile_cont(e2e_s, 0.99) AS e2e_p99 FROM requests GROUP BY 1",
    "SELECT * FROM requests WHERE request_id = $rid",
    "SELECT kind, count(*) FROM events GROUP BY 1",
)


def whatif_read(end: float, model: str) -> Read:
    """The What-if page's replay of the last 5 minutes of one model's engines (a replay, not a query:
    the dashboard gives it 180 s)."""
    return Read(
        "whatif",
        "replay 5 min of one model, 2 budgets",
        "GET",
        "/v1/whatif",
        {
            "model": model,
            "since": f"{end - 300:.3f}",
            "until": f"{end:.3f}",
            "sweep": "max_num_batched_tokens=4096,16384",
            "force": "true",
        },
    )


def reads_for(
    windows: dict[str, tuple[float | None, float | None]], finished: str, live: str, model: str
) -> list[Read]:
    """Every read, per window where it takes one (since/until as unix seconds)."""
    out: list[Read] = []
    for label, (since, until) in windows.items():
        w = {
            "since": None if since is None else f"{since:.3f}",
            "until": None if until is None else f"{until:.3f}",
        }
        span = (until or 0) - (since or 0) if since is not None else 3600.0
        bucket = 120.0 if span > 1800 else 30.0
        s_ = f"[{label}]"
        out += [
            Read(
                "overview",
                f"span: first end {s_}",
                "GET",
                "/v1/requests",
                {**w, "live": "false", "sort": "end_ts", "order": "asc", "limit": 1},
            ),
            Read(
                "overview",
                f"span: last end {s_}",
                "GET",
                "/v1/requests",
                {**w, "live": "false", "sort": "end_ts", "order": "desc", "limit": 1},
            ),
            Read("overview", f"attribution {s_}", "GET", "/v1/attribution", w),
            Read(
                "overview",
                f"attribution by {bucket:.0f} s {s_}",
                "GET",
                "/v1/attribution",
                {**w, "bucket_s": bucket},
            ),
            Read(
                "api",
                f"attribution by model, engine {s_}",
                "GET",
                "/v1/attribution",
                {**w, "group_by": "model,engine_source_id"},
            ),
            Read("api", f"itl by model {s_}", "GET", "/v1/itl", {**w, "by_model": "true"}),
            Read(
                "requests",
                f"slowest e2e, a page {s_}",
                "GET",
                "/v1/requests",
                {**w, "sort": "e2e_s", "order": "desc", "limit": 200},
            ),
            Read(
                "requests",
                f"one model, live, by start {s_}",
                "GET",
                "/v1/requests",
                {**w, "model": model, "live": "true", "sort": "start_ts", "limit": 200},
            ),
            Read(
                "requests",
                f"finish=length, by ttft, page 3 {s_}",
                "GET",
                "/v1/requests",
                {**w, "finish_reason": "length", "sort": "ttft_s", "limit": 200, "offset": 400},
            ),
            Read(
                "requests",
                f"min_e2e_s 200, 1000 rows {s_}",
                "GET",
                "/v1/requests",
                {**w, "min_e2e_s": 200, "live": "false", "sort": "end_ts", "limit": 1000},
            ),
            Read(
                "kv",
                f"KV idle block-s top 20 {s_}",
                "GET",
                "/v1/requests",
                {**w, "sort": "kv_idle_block_s", "order": "desc", "limit": 20},
            ),
            Read(
                "kv",
                f"most preempted 50 {s_}",
                "GET",
                "/v1/requests",
                {**w, "live": "false", "sort": "preemptions", "order": "desc", "limit": 50},
            ),
            Read(
                "kv",
                f"fleet by model and worst engines {s_}",
                "GET",
                "/v1/engines",
                {**w, "bucket_s": bucket, "top": dash_fleet.TOP},
            ),
            Read(
                "kv (old)",
                f"per-engine KV usage, the KV page's sql before {s_}",
                "POST",
                "/v1/sql",
                body={"sql": old_kv_usage_sql(since)},
            ),
            Read(
                "advice",
                f"chunk advice, one model {s_}",
                "GET",
                "/v1/advice/chunk-size",
                {**w, "itl_target_ms": 50, "model": model},
            ),
        ]
    end = windows["hour"][1] or time.time()
    out += [
        Read(
            "overview",
            "itl, one 300 s bucket",
            "GET",
            "/v1/itl",
            {"since": f"{end - 300:.3f}", "until": f"{end:.3f}"},
        ),
        Read("overview", "live queue (kv stalls 1000)", "GET", "/v1/kv/stalls", {"limit": 1000}),
        Read("overview", "cutoffs 5000", "GET", "/v1/cutoffs", {"limit": 5000}),
        Read("kv", "kv stalls 50", "GET", "/v1/kv/stalls", {"limit": 50}),
        Read(
            "kv",
            "escape valve (sql)",
            "POST",
            "/v1/sql",
            body={
                "sql": (
                    "SELECT decided_ts, request_id, rule, action, state, detail FROM cutoffs WHERE action IN "
                    "('slow_pool', 'non_preemptible', 'promote') ORDER BY decided_ts DESC LIMIT 200"
                )
            },
        ),
        Read(
            "cutoffs",
            "webhook deliveries (sql)",
            "POST",
            "/v1/sql",
            body={
                "sql": (
                    "SELECT o.created_ts, o.event_type, o.subscription_id, o.state FROM webhook_outbox o "
                    "ORDER BY o.created_ts DESC LIMIT 500"
                )
            },
        ),
        Read("cutoffs", "policy", "GET", "/v1/policy"),
        Read(
            "sql",
            "console example (sql)",
            "POST",
            "/v1/sql",
            body={
                "sql": (
                    "SELECT model, count(*) AS requests, quantile_cont(ttft_s, 0.99) AS ttft_p99_s, "
                    "avg(backend_wait_ttft_s / ttft_s) AS backend_wait_share FROM requests WHERE ttft_s > 0 "
                    "GROUP BY model ORDER BY requests DESC"
                )
            },
        ),
        # docs/sql.md's examples
        Read("sql", "e2e p99 by model (sql)", "POST", "/v1/sql", body={"sql": SQL_DOC_EXAMPLES[0]}),
        Read(
            "sql",
            "one request by id (sql)",
            "POST",
            "/v1/sql",
            body={"sql": SQL_DOC_EXAMPLES[1], "params": {"rid": finished}},
        ),
        Read("sql", "events by kind (sql)", "POST", "/v1/sql", body={"sql": SQL_DOC_EXAMPLES[2]}),
        Read("api", "sources", "GET", "/v1/sources"),
        Read("api", "metrics", "GET", "/metrics"),
        Read("api", "webhooks", "GET", "/v1/webhooks"),
        Read("api", "webhook deliveries", "GET", "/v1/webhooks/deliveries"),
    ]
    for kind, rid in (("finished", finished), ("live", live)):
        out += [
            Read("request", f"row and events ({kind})", "GET", f"/v1/requests/{rid}"),
            Read("request", f"why ({kind})", "GET", f"/v1/requests/{rid}/why"),
            Read("request", f"itl ({kind})", "GET", f"/v1/requests/{rid}/itl"),
        ]
    return out


def _call(http: httpx.Client, r: Read) -> tuple[float, int, int]:
    params = {k: v for k, v in r.params.items() if v is not None}
    t = time.perf_counter()
    resp = http.request(r.method, r.path, params=params, json=r.body)
    return time.perf_counter() - t, resp.status_code, len(resp.content)


def _step_bars(http: httpx.Client, rid: str) -> list[Read]:
    """The request page's steps query (``dashboard.queries.step_bars_sql``) for ``rid``, and the one it
    sent before (``key = ANY(request_keys)``)."""
    row = http.get(f"/v1/requests/{rid}").json()["request"]
    sql = step_bars_sql(row) or ""
    old = sql.replace("array_position(request_keys, (SELECT", "(SELECT").replace(
        f"request_id = {sql_literal(rid)})) IS NOT NULL",
        f"request_id = {sql_literal(rid)}) = ANY(request_keys)",
    )
    assert old != sql
    return [
        Read("request", "steps it ran (sql)", "POST", "/v1/sql", body={"sql": sql, "max_rows": 5000}),
        Read(
            "request (old)",
            "steps it ran, the page's sql before",
            "POST",
            "/v1/sql",
            body={"sql": old, "max_rows": 5000},
        ),
    ]


def run(
    path: str,
    repeat: int,
    only: set[str] | None,
    workdir: Path,
    server_root: str | None = None,
    whatif: bool = False,
) -> list[dict[str, Any]]:
    lo, hi, n_steps = _data_span(path)
    say(
        f"{path}: {n_steps:,} steps from {lo:.0f} to {hi:.0f} ({(time.time() - hi) / 60:.0f} min ago), "
        f"{os.path.getsize(path) / 1e9:.1f} GB"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "chunkledger", "serve", "--db", f"duckdb:///{path}", "--port", str(port)]
    env = dict(os.environ)
    if server_root:  # the server from another checkout (e.g. a git worktree of the code before)
        env["PYTHONPATH"] = server_root
    server = Proc("ledger", cmd, workdir / "ledger.log", env, cwd=server_root or ROOT)
    try:
        server.wait_ready(f"{url}/readyz", 300)
        with httpx.Client(base_url=url, timeout=600) as http:
            end = hi + 1
            finished = http.get("/v1/requests", params={"live": "false", "sort": "e2e_s", "limit": 1}).json()
            live = http.get(
                "/v1/requests", params={"live": "true", "sort": "start_ts", "order": "asc", "limit": 1}
            ).json()
            model = http.get("/v1/sources").json()["sources"][0]["model"]
            fin_id, live_id = finished["rows"][0]["request_id"], live["rows"][0]["request_id"]
            windows = {"all": (None, None), "hour": (end - 3600, end), "15 min": (end - 900, end)}
            todo = reads_for(windows, fin_id, live_id, model)
            todo += _step_bars(http, fin_id)
            if whatif:
                todo.append(whatif_read(end, model))
            out = []
            for r in todo:
                if only and r.page not in only:
                    continue
                times, status, size = [], 0, 0
                for _ in range(1 if r.page == "whatif" else repeat):  # a replay: once
                    dt, status, size = _call(http, r)
                    times.append(dt)
                row: dict[str, Any] = {
                    "page": r.page,
                    "read": r.name,
                    "path": r.path,
                    "status": status,
                    "bytes": size,
                    "p50_s": percentile(times, 0.5),
                    "max_s": max(times),
                }
                out.append(row)
                flag = "  OVER 1 s" if row["max_s"] > GOAL_S else ""
                print(
                    f"{r.page:<9} {r.name:<44} {r.path:<28} {status:>4} {row['p50_s']:>8.3f} "
                    f"{row['max_s']:>8.3f}{flag}",
                    flush=True,
                )
            return out
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", help="DuckDB file: built there when absent, reused when it holds a fleet")
    ap.add_argument("--engines", type=int, default=Fleet.engines)
    ap.add_argument("--seconds", type=float, default=Fleet.seconds)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--only", help="comma-separated pages (overview, requests, request, kv, cutoffs, advice, sql, api)"
    )
    ap.add_argument("--build-only", action="store_true", help="build the database and stop")
    ap.add_argument("--whatif", action="store_true", help="also time a what-if replay (minutes)")
    ap.add_argument("--server-root", help="run the server from the checkout in this folder (the code before)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="chunkledger-reads-"))
    path = args.db or str(tmp / "fleet.duckdb")
    try:
        if not Path(path).exists():
            fleet = Fleet(engines=args.engines, seconds=args.seconds)
            built = build(path, fleet, log=True)
            say(
                f"built {path} in {built['seconds']:.0f} s: {built['steps']:,.0f} steps, "
                f"{built['request_rows']:,.0f} requests, {built['events']:,.0f} events, "
                f"{os.path.getsize(path) / 1e9:.1f} GB"
            )
        if args.build_only:
            return
        only = set(args.only.split(",")) if args.only else None
        print(f"{'page':<9} {'read':<44} {'route':<28} {'code':>4} {'p50 s':>8} {'max s':>8}")
        rows = run(path, args.repeat, only, tmp, args.server_root, args.whatif)
        over = [r for r in rows if r["max_s"] > GOAL_S]
        print(
            f"{len(rows)} reads, {len(over)} over {GOAL_S:g} s; slowest "
            f"{max((r['max_s'] for r in rows), default=math.nan):.3f} s"
        )
        if args.json:
            print(json.dumps(rows))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
