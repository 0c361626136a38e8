"""A ledger database holding a GPU-shaped fleet, made by DuckDB SQL straight into the migrated schema.

Ingesting an hour of 236 engines through the write path would take the ledger hours; this writes the
same rows in minutes, for the read benchmark (``bench.reads``) and the dashboard's fleet test. The
shapes are the real store's (``ledger.store``): ``events`` rows of steps carry only their identity,
``steps`` hold the fields with the requests they ran as integer ``request_keys``, ``request_keys`` maps
ids to keys, ``request_sources`` names each request's engine, ``request_rows`` holds each request
compacted (``request_parts`` empty, as after a compaction), ``sources`` one row per engine.

The fleet (``Fleet``): every engine runs ``slots`` requests at once, one per slot, back to back. Slot
``i`` (engine ``e``, slot ``s``: ``i = e * slots + s``) has a request length ``L_i`` steps and a phase
``phi_i`` drawn from an integer hash (``_h``); at step ``k`` it runs generation ``g = (k + phi_i) //
L_i``, whose key is ``g * n_slots + i + 1``. The first generation starts at a ramp step ``st0_i``
(< 128, < L_i / 2) instead of before the hour. A request is queued ``W`` seconds before its first step,
runs its prompt as one chunk in that step (which samples its first token) and decodes one token in every
later step; it finishes at the end of its last step unless the hour ends first (then it is live). Steps come
every ``1 / steps_per_s`` seconds per engine; their duration grows with the step's prefill tokens.

The same fleet is written as events (``events_for``: the contract's ``queued``, ``chunk``, ``step``
with the tokens on it, ``finished``) so that a test can ingest a small one through ``Store.write`` and
compare what the ledger stored with what ``build`` wrote (tests/bench/test_fleet_db.py). Every formula
is integer arithmetic or the same float expression in the same order on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine_hooks import events as ev
from ledger.fold import AGGREGATES

MODELS = ("llama-3.1-70b", "qwen2.5-72b", "mistral-large")
RAMP_STEPS = 128
MAX_TOKENS = 16_384
_MULT = 2_654_435_761  # Knuth's multiplicative hash
_SALT = 1_000_003


def _h(x: int, salt: int) -> int:
    """A 16-bit hash of ``x`` (>= 0), one stream per ``salt``: the SQL ``_H`` computes the same."""
    return (x + salt * _SALT) * _MULT % 4_294_967_296 // 65_536


def _H(x: str, salt: int) -> str:
    return f"((({x}) + {salt * _SALT}) * {_MULT} % 4294967296 // 65536)"


def _mix(x: int, salt: int) -> int:
    """A 16-bit hash of ``x`` (>= 0) that mixes its bits (two rounds of a 32-bit finaliser): the
    linear ``_h`` is enough for the slots' lengths and phases, but its streams for consecutive keys
    move together (a third of the requests prefix-cached turned into 8 % in one ten minutes and 80 %
    in another). The SQL ``_MIX`` computes the same."""
    a = (x + salt * _SALT) % 4_294_967_296
    a = ((a >> 16) ^ a) * 73_244_475 % 4_294_967_296
    a = ((a >> 16) ^ a) * 73_244_475 % 4_294_967_296
    return ((a >> 16) ^ a) >> 16


def _MIX(x: str, salt: int) -> str:
    a = f"((({x}) + {salt * _SALT}) % 4294967296)"
    for _ in range(2):
        a = f"(xor({a} >> 16, {a}) * 73244475 % 4294967296)"
    return f"(xor({a} >> 16, {a}) >> 16)"


def _D(x: float) -> str:
    """A float as a DOUBLE literal (DuckDB reads ``0.3`` as a DECIMAL: other arithmetic, other bits)."""
    return f"CAST({x!r} AS DOUBLE)"


@dataclass(frozen=True)
class Fleet:
    """The fleet's shape; the defaults are one hour of 236 GPU-shaped engines (about 14M steps, 500k
    requests)."""

    engines: int = 236
    slots: int = 256  # running requests per engine
    seconds: float = 3600.0
    steps_per_s: float = 16.5
    # Request length in steps, uniform in [min_steps, max_steps): about 8 requests per slot an hour.
    min_steps: int = 4_400
    max_steps: int = 12_800
    end_ts: float = field(default_factory=lambda: float(int(time.time())))
    models: tuple[str, ...] = MODELS

    @property
    def n_steps(self) -> int:
        return int(self.seconds * self.steps_per_s)

    @property
    def n_slots(self) -> int:
        return self.engines * self.slots

    @property
    def dt(self) -> float:
        return 1.0 / self.steps_per_s

    @property
    def t0(self) -> float:
        return self.end_ts - self.seconds

    def source_id(self, e: int) -> str:
        return f"engine-{e:03d}"

    def model(self, e: int) -> str:
        return self.models[e % len(self.models)]

    # -- the formulas, in Python (their SQL twins are in _sql_*) ------------------------------------
    def length(self, i: int) -> int:
        return self.min_steps + _h(i, 1) * (self.max_steps - self.min_steps) // 65536

    def phase(self, i: int) -> int:
        length = self.length(i)
        return _h(i, 2) * (length - length // 2) // 65536

    def ramp(self, i: int) -> int:
        return _h(i, 3) % min(RAMP_STEPS, self.length(i) // 2)

    def offset(self, e: int) -> float:
        return _mix(e, 9) / 65536.0 * self.dt

    def ts(self, e: int, k: int) -> float:
        return self.t0 + self.offset(e) + k * self.dt

    def base_s(self, e: int) -> float:
        return self.dt * (0.55 + 0.3 * _mix(e, 10) / 65536.0)

    def duration(self, e: int, k: int, prefill: int) -> float:
        return self.base_s(e) + prefill * 4e-06 + self.dt * 0.05 * _mix(e * self.n_steps + k, 11) / 65536.0

    def waiting(self, e: int, k: int) -> int:
        return _mix(e * self.n_steps + k // 165, 12) * (_mix(e, 13) % 48) // 65536

    def kv_usage(self, e: int, k: int) -> float:
        level = 0.35 + 0.6 * _mix(e, 15) / 65536.0
        return min(1.0, level + _mix(e * self.n_steps + k // 165, 14) * 0.1 / 65536.0)


def prompt(key: int) -> int:
    return 64 + _mix(key, 4) * _mix(key, 5) // 65536 * 8000 // 65536


def cached(key: int) -> int:
    return prompt(key) // 2 // 16 * 16 if _mix(key, 6) < 19661 else 0


def queue_wait(key: int) -> float:
    return 0.02 + _mix(key, 7) / 65536.0 * 0.4


def finish_reason(key: int) -> str:
    return "length" if _mix(key, 8) < 3277 else "stop"


def request_id(key: int) -> str:
    """A vLLM-like id (``cmpl-`` and 32 hex digits), the same as the SQL's ``md5``."""
    import hashlib

    return "cmpl-" + hashlib.md5(str(key).encode()).hexdigest()


# -- the events, for ingesting a small fleet through the real store ---------------------------------


@dataclass
class _Run:
    key: int
    start: int  # first step
    end: int  # last step + 1 had the hour not ended (may be > n_steps: live at the end)


def _runs(f: Fleet, i: int) -> list[_Run]:
    length, phi, ramp = f.length(i), f.phase(i), f.ramp(i)
    out: list[_Run] = []
    g = 0
    while True:
        start = ramp if g == 0 else g * length - phi
        if start >= f.n_steps:
            return out
        out.append(_Run(g * f.n_slots + i + 1, start, (g + 1) * length - phi))
        g += 1


def events_for(f: Fleet, e: int) -> Iterator[tuple[int, ev.Event]]:
    """Engine ``e``'s events in seq order, each with its step: what its exporter would send."""
    slots = [_runs(f, e * f.slots + s) for s in range(f.slots)]
    current = [0] * f.slots
    for k in range(f.n_steps):
        ts = f.ts(e, k)
        running: list[tuple[int, _Run]] = []
        for s in range(f.slots):
            runs = slots[s]
            while current[s] < len(runs) and runs[current[s]].end <= k:
                current[s] += 1
            if current[s] < len(runs) and runs[current[s]].start <= k:
                running.append((s, runs[current[s]]))
        starting = [(s, r) for s, r in running if r.start == k]
        for s, r in starting:
            yield (
                k,
                ev.Queued(
                    seq=k * 1024 + s,
                    ts=ts - queue_wait(r.key),
                    request_id=request_id(r.key),
                    prompt_tokens=prompt(r.key),
                    max_tokens=MAX_TOKENS,
                ),
            )
        for s, r in starting:
            c, p = cached(r.key), prompt(r.key)
            yield (
                k,
                ev.Chunk(
                    seq=k * 1024 + 256 + s,
                    ts=ts,
                    request_id=request_id(r.key),
                    step=k,
                    tokens=p - c,
                    computed_before=c,
                    cached_tokens=c,
                    kv_blocks=p // 16 + 1,
                    wait_s=queue_wait(r.key),
                ),
            )
        prefill = sum(prompt(r.key) - cached(r.key) for _, r in starting)
        dur = f.duration(e, k, prefill)
        yield (
            k,
            ev.Step(
                seq=k * 1024 + 512,
                ts=ts,
                step=k,
                duration_s=dur,
                prefill_tokens=prefill,
                decode_tokens=len(running) - len(starting),
                num_prefill_reqs=len(starting),
                num_decode_reqs=len(running) - len(starting),
                running=len(running),
                waiting=f.waiting(e, k),
                kv_usage=f.kv_usage(e, k),
                request_ids=[request_id(r.key) for _, r in running],
                prefill_depth_tokens=sum(
                    (prompt(r.key) - cached(r.key)) * cached(r.key) for _, r in starting
                ),
                max_prefill_depth=max((cached(r.key) for _, r in starting), default=0),
                token_counts=[1] * len(running),
                token_totals=[k - r.start + 1 for _, r in running],
            ),
        )
        for s, r in running:
            if r.end == k + 1:
                yield (
                    k,
                    ev.Finished(
                        seq=k * 1024 + 513 + s,
                        ts=ts + dur,
                        request_id=request_id(r.key),
                        reason=finish_reason(r.key),  # type: ignore[arg-type]
                        output_tokens=k + 1 - r.start,
                    ),
                )


def batches_for(f: Fleet, e: int, steps_per_batch: int = 8) -> Iterator[ev.Batch]:
    """Engine ``e``'s events as the exporter batches them, ``steps_per_batch`` steps a batch."""
    src = ev.Source(id=f.source_id(e), kind="engine", model=f.model(e))
    pending: list[ev.Event] = []
    last = -1
    for k, e_ in events_for(f, e):
        if k != last and k % steps_per_batch == 0 and pending:
            yield ev.Batch(source=src, events=pending, schema_version=2)
            pending = []
        last = k
        pending.append(e_)
    if pending:
        yield ev.Batch(source=src, events=pending, schema_version=2)


# -- the SQL ---------------------------------------------------------------------------------------


def _sql_params(f: Fleet) -> dict[str, str]:
    """The fleet's constants as SQL literals (floats by repr: the same double on both sides)."""
    return {
        "E": str(f.engines),
        "S": str(f.slots),
        "N": str(f.n_steps),
        "NS": str(f.n_slots),
        "LMIN": str(f.min_steps),
        "LSPAN": str(f.max_steps - f.min_steps),
        "DT": _D(f.dt),
        "T0": _D(f.t0),
    }


def _slots_sql(f: Fleet) -> str:
    """One row per slot: i, e, length, phase, ramp."""
    p = _sql_params(f)
    length = f"({p['LMIN']} + {_H('i', 1)} * {p['LSPAN']} // 65536)"
    return (
        f"SELECT i, i // {p['S']} AS e, {length} AS len, {_phase_sql('i', length)} AS phi, "
        f"{_ramp_sql('i', length)} AS ramp FROM range({p['NS']}) t(i)"
    )


def _phase_sql(i: str, length: str) -> str:
    return f"({_H(i, 2)} * ({length} - {length} // 2) // 65536)"


def _ramp_sql(i: str, length: str) -> str:
    return f"({_H(i, 3)} % least({RAMP_STEPS}, {length} // 2))"


def _engines_sql(f: Fleet) -> str:
    """One row per engine: e, source id, model, step offset, base duration, waiting scale, KV level."""
    models = ", ".join(f"'{m}'" for m in f.models)
    dt = _D(f.dt)
    return (
        f"SELECT e, 'engine-' || lpad(CAST(e AS VARCHAR), 3, '0') AS source_id, "
        f"[{models}][e % {len(f.models)} + 1] AS model, "
        f"CAST({_MIX('e', 9)} AS DOUBLE) / {_D(65536.0)} * {dt} AS off, "
        f"{dt} * ({_D(0.55)} + {_D(0.3)} * {_MIX('e', 10)} / {_D(65536.0)}) AS base, "
        f"{_MIX('e', 13)} % 48 AS wmax, {_D(0.35)} + {_D(0.6)} * {_MIX('e', 15)} / {_D(65536.0)} AS level "
        f"FROM range({f.engines}) t(e)"
    )


def _requests_sql(f: Fleet) -> str:
    """One row per request: key, engine, slot, first step a, end b (exclusive, unclipped), prompt,
    cached, queue wait, id."""
    p = _sql_params(f)
    gens = f"range(({p['N']} + phi) // len + 1)"
    key = f"(g * {p['NS']} + i + 1)"
    prompt_sql = f"(64 + {_MIX('key', 4)} * {_MIX('key', 5)} // 65536 * 8000 // 65536)"
    return (
        f"SELECT key, e, i % {p['S']} AS s, a, b, p, "
        f"CASE WHEN {_MIX('key', 6)} < 19661 THEN p // 2 // 16 * 16 ELSE 0 END AS c, "
        f"{_D(0.02)} + CAST({_MIX('key', 7)} AS DOUBLE) / {_D(65536.0)} * {_D(0.4)} AS w, "
        f"CASE WHEN {_MIX('key', 8)} < 3277 THEN 'length' ELSE 'stop' END AS reason, "
        "'cmpl-' || md5(CAST(key AS VARCHAR)) AS request_id FROM ("
        f"SELECT *, {prompt_sql} AS p FROM ("
        f"SELECT i, e, {key} AS key, CASE WHEN g = 0 THEN ramp ELSE g * len - phi END AS a, "
        f"(g + 1) * len - phi AS b FROM (SELECT *, unnest({gens}) AS g FROM slots)) "
        f"WHERE a < {p['N']})"
    )


def _h_step(col: str, salt: int, f: Fleet) -> str:
    return _MIX(f"e * {f.n_steps} + {col}", salt)


def build(path: str, f: Fleet, *, slice_s: float = 60.0, log: bool = False) -> dict[str, float]:
    """Write ``f`` into the DuckDB file ``path`` (migrated first; it must hold no fleet yet), in time
    order as the ledger appends; returns the rows written per table and the seconds taken."""
    import duckdb

    from ledger import migrate
    from ledger.store import make_engine

    started = time.perf_counter()
    engine = make_engine(f"duckdb:///{path}")
    migrate.upgrade(engine)
    engine.dispose()
    con = duckdb.connect(path)
    con.execute("SET enable_progress_bar = false")
    try:
        _build(con, f, slice_s, log)
        counts = {
            t: float(con.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # type: ignore[index]
            for t in ("steps", "events", "request_rows", "request_keys", "sources")
        }
        con.execute("CHECKPOINT")
    finally:
        con.close()
    counts["seconds"] = time.perf_counter() - started
    return counts


def _say(log: bool, msg: str) -> None:
    if log:
        import sys

        print(f"[fleet_db] {msg}", file=sys.stderr, flush=True)


def _build(con: Any, f: Fleet, slice_s: float, log: bool) -> None:
    sql = con.execute
    p = _sql_params(f)
    sql(f"CREATE TEMP TABLE slots AS {_slots_sql(f)}")
    sql(f"CREATE TEMP TABLE eng AS {_engines_sql(f)}")
    sql(f"CREATE TEMP TABLE req AS {_requests_sql(f)}")
    # Per (engine, step) with a chunk: its prefill tokens, depth work, deepest chunk, chunks.
    sql(
        "CREATE TEMP TABLE pre AS SELECT e AS pe, a AS pk, sum(p - c) AS tokens, sum((p - c) * c) AS depth, "
        "max(c) AS deepest, count(*) AS n FROM req GROUP BY e, a"
    )
    n_req = sql("SELECT count(*) FROM req").fetchone()[0]
    _say(log, f"{f.engines} engines, {f.n_steps * f.engines:,} steps, {n_req:,} requests")
    # Step rows in time order, one slice of steps at a time (ts rises through the table, as the
    # ledger appends it: zone maps prune by ts).
    noise = f"{p['DT']} * {_D(0.05)} * {{h}} / {_D(65536.0)}"
    dur = f"eng.base + coalesce({{pre}}.tokens, 0) * {_D(4e-06)} + {noise}"
    cur = dur.replace("{pre}", "pc").replace("{h}", _h_step("k", 11, f))
    prev = dur.replace("{pre}", "pp").replace("{h}", _h_step("k - 1", 11, f))
    ts = f"{p['T0']} + eng.off + k * {p['DT']}"
    pts = f"{p['T0']} + eng.off + (k - 1) * {p['DT']}"
    slot = f"e * {p['S']} + s"
    length = f"({p['LMIN']} + {_H(slot, 1)} * {p['LSPAN']} // 65536)"
    active = f"list_filter(range({p['S']}), lambda s: k >= {_ramp_sql(slot, length)})"
    phi = _phase_sql(slot, length)
    keys = (
        f"list_transform(CASE WHEN k < {RAMP_STEPS} THEN {active} ELSE range({p['S']}) END, "
        f"lambda s: (k + {phi}) // {length} * {p['NS']} + {slot} + 1)"
    )
    waiting = f"{_h_step('k // 165', 12, f)} * eng.wmax // 65536"
    kv = f"least({_D(1.0)}, eng.level + {_h_step('k // 165', 14, f)} * {_D(0.1)} / {_D(65536.0)})"
    per_slice = max(1, int(slice_s * f.steps_per_s))
    for lo in range(0, f.n_steps, per_slice):
        hi = min(f.n_steps, lo + per_slice)
        t = time.perf_counter()
        sql(
            "INSERT INTO steps (source_id, seq, step, ts, duration_s, prefill_tokens, decode_tokens, "
            "num_prefill_reqs, num_decode_reqs, running, waiting, kv_usage, prefill_depth_tokens, "
            "max_prefill_depth, stalled_request_ids, interval_s, request_keys) "
            "SELECT source_id, seq, k, ts, dur, prefill, n - np, np, n - np, n, waiting, kv, depth, deepest, "
            "[]::VARCHAR[], CASE WHEN k > 0 THEN (ts + dur) - (pts + pdur) END, keys FROM ("
            f"SELECT eng.source_id, k * 1024 + 512 AS seq, k, {ts} AS ts, {pts} AS pts, {cur} AS dur, "
            f"{prev} AS pdur, coalesce(pc.tokens, 0) AS prefill, coalesce(pc.n, 0) AS np, "
            f"len(keys) AS n, {waiting} AS waiting, {kv} AS kv, coalesce(pc.depth, 0) AS depth, "
            "coalesce(pc.deepest, 0) AS deepest, keys FROM ("
            f"SELECT e, k, {keys} AS keys FROM range({f.engines}) t1(e), range({lo}, {hi}) t2(k)) x "
            "JOIN eng USING (e) LEFT JOIN pre pc ON pc.pe = x.e AND pc.pk = x.k "
            "LEFT JOIN pre pp ON pp.pe = x.e AND pp.pk = x.k - 1) ORDER BY ts"
        )
        _say(log, f"steps {lo:,}..{hi:,} of {f.n_steps:,} per engine: {time.perf_counter() - t:.1f} s")
    _lifecycle(sql, f)


def _lifecycle(run: Callable[[str], Any], f: Fleet) -> None:
    """The request tables and the events (steps' identities and each request's lifecycle)."""
    n = f.n_steps
    # Each request's first and last step (their times and durations from the stored steps).
    run(
        "CREATE TEMP TABLE life AS SELECT r.*, eng.source_id, eng.model, sa.ts AS a_ts, "
        "sb.ts + sb.duration_s AS last_end, least(r.b, "
        f"{n}) - r.a AS ran, r.b <= {n} AS done "
        "FROM req r JOIN eng USING (e) JOIN steps sa ON sa.source_id = eng.source_id AND sa.step = r.a "
        f"JOIN steps sb ON sb.source_id = eng.source_id AND sb.step = least(r.b, {n}) - 1"
    )
    # The summed duration of each request's steps: a running sum per engine, differenced.
    run(
        "CREATE TEMP TABLE cum AS SELECT source_id, step, sum(duration_s) OVER "
        "(PARTITION BY source_id ORDER BY step) AS upto FROM steps"
    )
    run(
        "CREATE TEMP TABLE life2 AS SELECT l.*, cb.upto - coalesce(ca.upto, 0) AS active_s FROM life l "
        "JOIN cum cb ON cb.source_id = l.source_id AND cb.step = l.a + l.ran - 1 "
        "LEFT JOIN cum ca ON ca.source_id = l.source_id AND ca.step = l.a - 1"
    )
    run("DROP TABLE cum")
    run("INSERT INTO request_keys (request_id, request_key) SELECT request_id, key FROM life2 ORDER BY key")
    run(
        "INSERT INTO request_sources (request_id, engine_source_id, gateway_source_id) "
        "SELECT request_id, source_id, NULL FROM life2 ORDER BY a_ts"
    )
    values = {
        "model": "model",
        "engine_source_id": "source_id",
        "engine_arrival_ts": "a_ts - w",
        "queued_ts": "a_ts - w",
        "first_scheduled_ts": "a_ts",
        "first_token_ts": "a_ts + first_dur",
        "last_token_ts": "last_end",
        "finished_ts": "CASE WHEN done THEN last_end END",
        "last_event_ts": "last_end",
        "backend_wait_measured_s": "w",
        "prompt_tokens": "p",
        "max_tokens": str(MAX_TOKENS),
        "cached_tokens": "c",
        "prefill_computed_tokens": "p - c",
        "output_tokens": "ran",
        "chunks": "1",
        "kv_blocks_max": "p // 16 + 1",
        "events": "CASE WHEN done THEN 3 ELSE 2 END",
        "finish_reason": "CASE WHEN done THEN reason END",
        "step_count": "ran",
        "active_s": "active_s",
        "last_step_ts": "last_end",
        "first_wait_s": "w",
    }
    cols = ["request_id", *AGGREGATES]
    select = ["request_id"] + [
        values.get(c, "0" if AGGREGATES[c].op == "sum" else "NULL") + f" AS {c}" for c in AGGREGATES
    ]
    run(
        f"INSERT INTO request_rows ({', '.join(cols)}) SELECT {', '.join(select)} FROM ("
        "SELECT l.*, s.duration_s AS first_dur FROM life2 l JOIN steps s "
        "ON s.source_id = l.source_id AND s.step = l.a) ORDER BY a_ts"
    )
    # The events: each step's identity, and each request's queued, chunk and finished, by time.
    run(
        "CREATE TEMP TABLE ev AS "
        "SELECT source_id, seq, ts, 'step' AS kind, NULL AS request_id, NULL AS data FROM steps "
        "UNION ALL SELECT source_id, a * 1024 + s, a_ts - w, 'queued', request_id, "
        '\'{"kind":"queued","seq":\' || (a * 1024 + s) || \',"ts":\' || CAST(a_ts - w AS VARCHAR) || '
        '\',"request_id":"\' || request_id || \'","prompt_tokens":\' || p || '
        f"',\"max_tokens\":{MAX_TOKENS}}}' FROM life2 "
        "UNION ALL SELECT source_id, a * 1024 + 256 + s, a_ts, 'chunk', request_id, "
        '\'{"kind":"chunk","seq":\' || (a * 1024 + 256 + s) || \',"ts":\' || CAST(a_ts AS VARCHAR) || '
        '\',"request_id":"\' || request_id || \'","step":\' || a || \',"tokens":\' || (p - c) || '
        "',\"computed_before\":' || c || CASE WHEN c > 0 THEN ',\"cached_tokens\":' || c ELSE '' END || "
        "',\"kv_blocks\":' || (p // 16 + 1) || ',\"wait_s\":' || CAST(w AS VARCHAR) || '}' FROM life2 "
        "UNION ALL SELECT source_id, (b - 1) * 1024 + 513 + s, last_end, 'finished', request_id, "
        '\'{"kind":"finished","seq":\' || ((b - 1) * 1024 + 513 + s) || \',"ts":\' || '
        'CAST(last_end AS VARCHAR) || \',"request_id":"\' || request_id || \'","reason":"\' || reason || '
        "'\",\"output_tokens\":' || ran || '}' FROM life2 WHERE done"
    )
    run(
        "INSERT INTO events (source_id, seq, ts, kind, request_id, data, ingested_ts) "
        "SELECT source_id, seq, ts, kind, request_id, data, ts + 0.05 FROM ev ORDER BY ts"
    )
    run(
        "INSERT INTO sources (source_id, kind, model, last_seq, events_total, dropped_total, first_seen_ts, "
        "last_seen_ts, producer) SELECT ev.source_id, 'engine', eng.model, max(seq), count(*), 0, "
        "min(ts) + 0.05, max(ts) + 0.05, NULL FROM ev JOIN eng USING (source_id) "
        "GROUP BY ev.source_id, eng.model ORDER BY ev.source_id"
    )
    run("DROP TABLE ev")
