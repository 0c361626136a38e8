"""Inter-token latency data that must not depend on how the events reached the ledger.

* ``steps.interval_s`` (end of the source's previous step -> end of this one) is the same whatever the
  order in which the exporter's batches arrive, across a ledger restart and between two replicas;
* a request's own gaps count the step in which its recompute after a preemption sampled a token.

Both storage backends (DuckDB file, real PostgreSQL).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.analytics import queries as q
from ledger.app import create_app
from ledger.config import Settings
from ledger.records import as_json
from ledger.store import open_store
from ledger.store.step_memory import _STEPS_MAX
from tests.support.factories import batch, numbered

T0 = 1_700_000_000.0


def _source(name: str) -> ev.Source:
    return ev.Source(id=name, kind="engine", model="tiny-llama")


def _engine_run(
    n: int,
    *,
    t0: float = T0,
    first_seq: int = 1,
    skip: tuple[int, ...] = (40,),
    seed: int = 0,
    prefix: str = "",
) -> list[Any]:
    """``n`` steps of one engine (numbers in ``skip`` were empty schedules: no event), each followed by a
    tokens event; the next step is scheduled after the previous one ended or, as with async
    scheduling, before it ended. Its requests' ids start with ``prefix`` (a request is one engine's)."""
    rng = random.Random(seed)
    out: list[Any] = []
    t = t0
    for k in range(n):
        if k in skip:
            t += 0.004
            continue
        d = rng.uniform(0.008, 0.03)
        decode = 4 if k else 0
        out.append(
            ev.Step(
                seq=0,
                ts=t,
                step=k,
                duration_s=d,
                prefill_tokens=0 if k else 512,
                decode_tokens=decode,
                num_prefill_reqs=0 if k else 1,
                num_decode_reqs=decode,
                running=4,
                request_ids=[f"{prefix}r{j}" for j in range(4)],
            )
        )
        out.append(ev.Tokens(seq=0, ts=t + d, request_id=f"{prefix}r{k % 4}", count=1, total=k // 4 + 1))
        t += d * rng.choice((1.0, 0.7))
    return numbered(out, first_seq)


def _expected(events: list[Any]) -> dict[int, float | None]:
    """Step -> interval_s as an in-order ingest computes it."""
    steps = {e.step: e for e in events if isinstance(e, ev.Step)}
    out: dict[int, float | None] = {}
    for k, e in steps.items():
        p = steps.get(k - 1)
        out[k] = None if p is None else (e.ts + e.duration_s) - (p.ts + p.duration_s)
    return out


def _cut(events: list[Any], rng: random.Random) -> list[list[Any]]:
    """Exporter-sized batches of 3..15 events, in order."""
    out, i = [], 0
    while i < len(events):
        n = rng.randint(3, 15)
        out.append(events[i : i + n])
        i += n
    return out


def _intervals(store: Any, source_id: str) -> dict[int, float | None]:
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT step, interval_s FROM steps WHERE source_id = '{source_id}' ORDER BY step"
        ).all()
    return {int(step): interval for step, interval in rows}


def _write_in_groups(store: Any, src: ev.Source, batches: list[list[Any]], rng: random.Random) -> None:
    """One write per batch, or two or three batches in one group commit (as the ingest writer does)."""
    i = 0
    while i < len(batches):
        n = rng.choice((1, 1, 2, 3))
        store.write([batch(src, b) for b in batches[i : i + n]])
        i += n


def test_steps_get_the_in_order_interval_whatever_order_their_batches_arrive_in(store):
    want = _expected(_engine_run(160))
    assert want[0] is None and want[41] is None and sum(v is not None for v in want.values()) == 157
    rng = random.Random(3)
    for trial in range(4):
        src = _source(f"engine-{trial}")
        evs = _engine_run(160, prefix=f"{src.id}-")
        batches = _cut(evs, rng)
        if trial:
            rng.shuffle(batches)
        _write_in_groups(store, src, batches, rng)
        assert _intervals(store, src.id) == want, trial


def test_a_late_batch_links_both_its_own_first_step_and_the_stored_step_after_it(store):
    src = _source("engine-0")
    evs = _engine_run(30, skip=())
    steps = [e for e in evs if isinstance(e, ev.Step)]
    # batches of 5 steps (and their tokens events); the second arrives after the third
    b = [evs[i : i + 10] for i in range(0, len(evs), 10)]
    for part in (b[0], b[2], b[1], *b[3:]):
        store.write([batch(src, part)])
    got = _intervals(store, src.id)
    assert got == _expected(evs)
    assert got[steps[5].step] is not None and got[steps[10].step] is not None  # both ends of the late one


def test_late_batches_of_several_sources_in_one_group_commit_link_every_stored_successor(store):
    runs = {f"engine-{k}": _engine_run(60, skip=(), seed=k, prefix=f"engine-{k}-") for k in range(3)}
    parts = {sid: [evs[i : i + 20] for i in range(0, len(evs), 20)] for sid, evs in runs.items()}
    for sid, b in parts.items():  # every source's second batch is overtaken by its third
        store.write([batch(_source(sid), p) for p in (b[0], b[2])])
    store.write([batch(_source(sid), b[1]) for sid, b in parts.items()])  # all three late, one group
    for sid, b in parts.items():
        store.write([batch(_source(sid), p) for p in b[3:]])
        assert _intervals(store, sid) == _expected(runs[sid]), sid


class _Spy:
    """Counts the step-linking statements (lookups, updates) a store runs; passes everything through."""

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lookups = self.updates = 0
        connect = store._connect
        spy = self

        class Conn:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def execute(self, sql: str, params: Any = None) -> Any:
                if sql == store._PREDECESSOR_SQL:
                    spy.lookups += 1
                elif sql == store._LINK_SUCCESSOR_SQL:
                    spy.updates += 1
                return self.inner.execute(sql, params)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        monkeypatch.setattr(store, "_connect", lambda: Conn(connect()))


def test_in_order_ingest_runs_no_statement_to_link_steps_and_a_late_batch_one(store, monkeypatch):
    src = _source("engine-0")
    evs = _engine_run(120, skip=())
    b = [evs[i : i + 40] for i in range(0, len(evs), 40)]  # 6 batches of 20 steps
    assert len(b) == 6
    spy = _Spy(store, monkeypatch)
    for part in b[:3]:
        store.write([batch(src, part)])
    assert (spy.lookups, spy.updates) == (0, 0)
    store.write([batch(src, b[4])])  # overtakes b[3]
    assert (spy.lookups, spy.updates) == (0, 0)
    store.write([batch(src, b[3])])  # late: its successor (b[4]'s first step) is stored
    assert (spy.lookups, spy.updates) == (0, 1)
    store.write([batch(src, b[5])])
    assert (spy.lookups, spy.updates) == (0, 1)
    assert _intervals(store, src.id) == _expected(evs)


@pytest.mark.parametrize("order", ["scripted", "shuffled"])
def test_steps_link_across_a_ledger_restart_in_any_arrival_order(db_url, order, monkeypatch):
    src = _source("engine-0")
    evs = _engine_run(120, seed=1)
    want = _expected(evs)
    size = -(-len(evs) // 10)
    b = [evs[i : i + size] for i in range(0, len(evs), size)]  # 10 batches of ~12 steps
    assert len(b) == 10
    if order == "scripted":
        # Before the restart: 0 1 3 5. After it: 4 (its predecessor and successor stored before the
        # restart), 6 (in order, its predecessor stored before), 2 (between two stored ones), 7 9 8.
        before, after = [b[i] for i in (0, 1, 3, 5)], [b[i] for i in (4, 6, 2, 7, 9, 8)]
    else:
        rng = random.Random(11)
        rng.shuffle(b)
        before, after = b[:5], b[5:]
    s = open_store(db_url)
    try:
        for part in before:
            s.write([batch(src, part)])
    finally:
        s.close()
    s = open_store(db_url)
    try:
        spy = _Spy(s, monkeypatch)
        for part in after:
            s.write([batch(src, part)])
        assert _intervals(s, src.id) == want
        if order == "scripted":
            # Looked up: the predecessors of 4, 6 and 2 (stored before the restart). Updated: the first
            # steps of 5 and 3 (stored before the restart) and of 9 (stored after it, remembered).
            assert (spy.lookups, spy.updates) == (3, 3)
    finally:
        s.close()


def test_two_replicas_writing_one_source_out_of_order_link_every_step(db_url):
    if db_url.startswith("duckdb"):
        pytest.skip("one writer process per DuckDB file; replicas are PostgreSQL's")
    src = _source("engine-0")
    evs = _engine_run(100, seed=2)
    batches = _cut(evs, random.Random(5))
    random.Random(6).shuffle(batches)
    a, b = open_store(db_url), open_store(db_url)
    try:
        for i, part in enumerate(batches):
            (a if i % 3 else b).write([batch(src, part)])
        assert _intervals(a, src.id) == _expected(evs)
    finally:
        a.close()
        b.close()


def test_a_replica_that_stored_only_other_events_since_another_stored_steps_still_links(db_url):
    if db_url.startswith("duckdb"):
        pytest.skip("one writer process per DuckDB file; replicas are PostgreSQL's")
    src = _source("engine-0")
    evs = _engine_run(15, skip=())  # seqs 1..30: 15 steps, each followed by a tokens event
    no_steps = [ev.Tokens(seq=21, ts=T0 + 0.2, request_id="r0", count=1, total=9)]
    later = [msgspec.structs.replace(e, seq=e.seq + 1) for e in evs[20:]]  # seqs 22..31
    steps = evs[:20] + later
    a, b = open_store(db_url), open_store(db_url)
    try:
        a.write([batch(src, evs[:10])])
        b.write([batch(src, evs[10:20])])  # steps 5..9, by the other replica
        a.write([batch(src, no_steps)])
        a.write([batch(src, later)])  # step 10 follows the other replica's step 9
        assert _intervals(a, src.id) == _expected(steps)
    finally:
        a.close()
        b.close()


def test_a_batch_overtaken_by_more_steps_than_the_store_remembers_still_links(store):
    src = _source("engine-0")
    n = _STEPS_MAX * 2 + 300
    evs = _engine_run(n, skip=(), seed=3)
    b = [evs[i : i + 40] for i in range(0, len(evs), 40)]
    for part in (*b[:3], *b[4:], b[3]):  # the fourth batch arrives last, after every later step
        store.write([batch(src, part)])
    assert _intervals(store, src.id) == _expected(evs)


def test_a_restarted_engine_numbering_its_steps_from_zero_again_links_its_own_steps(store):
    src = _source("engine-0")
    run1 = _engine_run(30, skip=())
    run2 = _engine_run(20, t0=T0 + 3600.0, first_seq=10_000, skip=(), seed=9)
    for evs in (run1, run2):
        for part in (evs[i : i + 8] for i in range(0, len(evs), 8)):
            store.write([batch(src, part)])
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT seq, step, interval_s FROM steps WHERE source_id = 'engine-0' ORDER BY seq"
        ).all()
    second = {int(step): interval for seq, step, interval in rows if seq >= 10_000}
    assert second == _expected(run2)  # step 0 of the new run follows nothing; 1..19 follow the new run's


def test_itl_counts_every_decode_token_when_batches_arrive_out_of_order(store):
    src = _source("engine-0")
    evs = _engine_run(200, skip=(), seed=4)
    decode_tokens = sum(e.num_decode_reqs for e in evs if isinstance(e, ev.Step))
    rng = random.Random(8)
    batches = _cut(evs, rng)
    rng.shuffle(batches)
    _write_in_groups(store, src, batches, rng)
    app = create_app(Settings(db_url="duckdb:///:memory:", read_token="r", ingest_token="i"), store=store)
    with TestClient(app) as c:
        itl = c.get("/v1/itl", headers={"Authorization": "Bearer r"}).json()["itl"]
    assert decode_tokens == 4 * 199
    assert itl[0]["n"] == decode_tokens


# -- a request's own gaps after a preemption --------------------------------------------------------


class _OneRequest:
    """One request on one engine, step by step, with the events vLLM's hooks emit for it.

    Steps start every 10 ms and last ``duration_s``: above 10 ms the next step is scheduled before the
    previous one's outputs are processed (async scheduling), so a request preempted at a schedule still
    gets the token of the step in flight, after the preemption. Tokens are flushed every 8 tokens, at a
    preemption and at the end; each event gets its seq in emission order.
    """

    def __init__(self, rid: str, prompt: int, *, duration_s: float) -> None:
        self.rid, self.prompt, self.d = rid, prompt, duration_s
        self.k = 0
        self.out: list[tuple[float, Any]] = []  # (emitted at, event)
        self.delivered: list[float] = []  # when each output token reached the scheduler
        self.flushed = 0
        self.preemptions = 0
        self.token_steps_ends: list[float] = []
        self.emit(T0 - 0.001, ev.Queued(seq=0, ts=T0 - 0.001, request_id=rid, prompt_tokens=prompt))

    def emit(self, at: float, e: Any) -> None:
        self.out.append((at, e))

    @property
    def ts(self) -> float:
        return T0 + 0.01 * self.k

    def _flush(self, at: float, *, final: bool = False) -> None:
        """Send the tokens delivered by ``at`` not sent yet (all of them when ``final``)."""
        ready = [t for t in self.delivered[self.flushed :] if final or t <= at]
        if ready:
            self.flushed += len(ready)
            self.emit(
                at,
                ev.Tokens(
                    seq=0, ts=at, request_id=self.rid, count=len(ready), total=self.flushed, first_ts=ready[0]
                ),
            )

    def run(self, *, chunk: tuple[int, int, int] | None = None, token: bool = True) -> None:
        """One step the request takes part in: a chunk (computed_before, tokens, recomputed) or a decode."""
        ts, end = self.ts, self.ts + self.d
        if chunk is not None:
            before, n, recomputed = chunk
            self.emit(
                ts,
                ev.Chunk(
                    seq=0,
                    ts=ts,
                    request_id=self.rid,
                    step=self.k,
                    tokens=n,
                    computed_before=before,
                    recomputed_tokens=recomputed,
                    preemptions=self.preemptions,
                ),
            )
        self._step(ts, [self.rid], decode=chunk is None)
        if token:
            self.delivered.append(end)
            self.token_steps_ends.append(end)
            if len(self.delivered) - self.flushed >= 8:
                self._flush(end)
        self.k += 1

    def _step(self, ts: float, ids: list[str], *, decode: bool) -> None:
        self.emit(
            ts + self.d,
            ev.Step(
                seq=0,
                ts=ts,
                step=self.k,
                duration_s=self.d,
                num_decode_reqs=1 if decode and ids else 0,
                decode_tokens=1 if decode and ids else 0,
                num_prefill_reqs=1 if ids and not decode else 0,
                request_ids=ids,
            ),
        )

    def idle(self) -> None:
        self._step(self.ts, [], decode=False)
        self.k += 1

    def preempt(self, computed: int) -> int:
        """Preempted at this step's schedule; returns the output tokens it holds then."""
        self._flush(self.ts)
        held = sum(1 for t in self.delivered if t <= self.ts)
        self.emit(self.ts, ev.Preempted(seq=0, ts=self.ts, request_id=self.rid, computed_tokens=computed))
        self.preemptions += 1
        return held

    def resume(self, held: int) -> None:
        self.emit(
            self.ts, ev.Resumed(seq=0, ts=self.ts, request_id=self.rid, wait_s=0.02, output_tokens=held)
        )

    def events(self) -> list[Any]:
        end = self.ts
        self._flush(end, final=True)
        self.emit(
            end,
            ev.Finished(
                seq=0, ts=end, request_id=self.rid, reason="length", output_tokens=len(self.delivered)
            ),
        )
        ordered = [e for _, e in sorted(self.out, key=lambda x: x[0])]  # stable: same-time events in order
        return [msgspec.structs.replace(e, seq=i + 1) for i, e in enumerate(ordered)]


def _gaps(store: Any, rid: str) -> dict[str, Any]:
    with store.engine.connect() as conn:
        out = q.request_itl(conn, rid)
    assert out is not None
    return as_json(out)  # type: ignore[no-any-return]


def test_a_request_resumed_with_a_one_token_recompute_gets_a_gap_per_token_after_the_first(store):
    """The recompute chunk (2 positions, 1 of them recomputed) completes the request's positions, so
    its step samples a token: 64 output tokens, 63 gaps."""
    r = _OneRequest("p", 32, duration_s=0.009)  # synchronous scheduling
    r.run(chunk=(0, 32, 0))  # prefill: first token
    for _ in range(29):
        r.run()  # 30 tokens: 61 positions computed
    held = r.preempt(computed=61)
    assert held == 30
    r.idle()
    r.idle()
    r.resume(held)
    r.run(chunk=(60, 2, 1))  # 60 positions cached; computes 60 and 61 (the last token): samples one
    for _ in range(33):
        r.run()
    store.write([batch(_source("engine-0"), r.events())])
    itl = _gaps(store, "p")
    assert store.get_request("p")["output_tokens"] == 64
    assert itl["n"] == 63
    assert itl["gaps"] == pytest.approx([b - a for a, b in itertools.pairwise(r.token_steps_ends)])


def test_gaps_after_async_preemptions_count_the_completing_chunk_and_not_a_partial_one(store):
    """Async scheduling: the step in flight at each preemption delivers its token after it, so the
    recompute covers one more position than ``resumed.output_tokens`` says. The first recompute stops
    one position short of that (a partial chunk: no token; the last position runs as a decode); the
    second completes in its chunk (a token)."""
    r = _OneRequest("q", 32, duration_s=0.012)
    r.run(chunk=(0, 32, 0))
    for _ in range(20):
        r.run()  # step 20's token is in flight at the next schedule
    held = r.preempt(computed=32 + 20)
    assert held == 20  # 21 tokens in the end: the one in flight arrives after the preemption
    r.idle()
    r.idle()
    r.resume(held)
    r.run(chunk=(48, 4, 4), token=False)  # positions 48..51 of 53: partial
    r.run()  # position 52, as a decode: token 22
    for _ in range(17):
        r.run()  # token 39 in flight at the next schedule
    held = r.preempt(computed=32 + 38)
    assert held == 38
    r.idle()
    r.idle()
    r.resume(held)
    r.run(chunk=(69, 2, 1))  # positions 69, 70 of 71: completes, token 40
    for _ in range(24):
        r.run()
    store.write([batch(_source("engine-0"), r.events())])
    itl = _gaps(store, "q")
    assert store.get_request("q")["output_tokens"] == 64
    assert itl["n"] == 63
    assert itl["gaps"] == pytest.approx([b - a for a, b in itertools.pairwise(r.token_steps_ends)])
