"""Commands: decisions stored in ``cutoffs`` and delivered to sources until they confirm.

A decision becomes one command (one id) with up to two targets: the engine source that runs the request
(it aborts it, or moves it to the slow pool) and the gateway source streaming it, if any (it cuts the
stream). The command is returned to a target in every ingest response from that source and by
``GET /v1/commands`` (long-poll) until that target confirms with a ``cutoff_applied`` event (a gateway
may confirm with ``stream_cut`` carrying the command id). A target that finishes the request without
confirming (it ended on its own first) is moot: nothing left to apply. A command still unconfirmed
``ttl_s`` after its decision expires. Sources apply commands idempotently (the contract says so), so
re-sending is safe.

The store is the truth (``cutoffs`` rows, one per (request, rule): a decision made twice, by a restart
or another replica, is stored once and delivered once); the pending set is kept in memory for the
ingest path and reloaded from the store at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from engine_hooks import events as ev
from ledger.rows import CutoffRow
from ledger.rules.cutoff_rows import INSERT_ONE, insert_many, values_update
from ledger.rules.engine import Decision

log = logging.getLogger(__name__)

MAX_PER_RESPONSE = 256  # commands in one ingest response or poll answer (the rest follow in later ones)


def home_source(engine_source_id: str | None, gateway_source_id: str | None) -> str:
    """The source a command belongs to: the engine that runs the request, else the gateway streaming
    it. A stream worker keeps the commands whose home source is in its partitions."""
    return engine_source_id or gateway_source_id or ""


@dataclass(eq=False)
class Pending:
    command: ev.Command
    model: str | None
    decided_ts: float
    targets: dict[str, str]  # source id -> "engine" | "gateway", still to confirm
    gateway: str | None = None  # the gateway target it has (or had: confirmed, moot), if any
    engine: str | None = None  # the engine target it has (or had)
    delivered: set[str] = field(default_factory=set)
    sends: int = 0  # deliveries so far (ingest responses and polls, re-sends included)
    stored_sends: int = 0  # what ``cutoffs.deliveries`` holds


class CommandBook:
    """The pending commands per source, backed by the ``cutoffs`` table."""

    def __init__(
        self,
        engine: sa.Engine | None,
        *,
        ttl_s: Callable[[], float] = lambda: 600.0,
        clock: Callable[[], float] = time.time,
        on_delivered: Callable[[int, str], None] | None = None,
        on_applied: Callable[[Pending, str, float], None] | None = None,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine  # None: memory only (a null store)
        self._ttl_s = ttl_s
        self._clock = clock
        self._on_delivered = on_delivered
        self._on_applied = on_applied
        self._on_refused = on_refused  # called for a confirmation from a source that is not a target
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()
        self.by_id: dict[str, Pending] = {}
        self.by_source: dict[str, dict[str, Pending]] = {}
        self.by_request: dict[str, list[Pending]] = {}
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._closing = False  # the server is shutting down: long-polls answer at once
        # request id -> the gateway that joined it after a decision (``add_gateway``), for a decision
        # recorded just after the join (decided on the ticker while the join was observed)
        self._joined: OrderedDict[str, str] = OrderedDict()
        # Called when commands are queued for sources (from the thread that queued them): a stream
        # worker's publisher wakes on it (``ledger.jetstream.worker``).
        self.on_new: Callable[[], None] | None = None

    # -- storage helpers ---------------------------------------------------------------------------
    def _exec(self, sql: str | Any, params: Any = None) -> Any:
        if self.engine is None:
            return None
        stmt = sa.text(sql) if isinstance(sql, str) else sql
        # One writer at a time in this process: DuckDB fails concurrent updates of one row instead of
        # waiting (PostgreSQL would wait on the row lock; other replicas still do).
        with self._db_lock, self.engine.begin() as conn:
            return conn.execute(stmt, params or {})

    def load(self, home: Callable[[str], bool] | None = None) -> int:
        """Reload the pending commands (after a restart); expire the ones past their ttl. ``home``: only
        the commands whose home source it accepts (``home_source``: a stream worker takes those of the
        partitions it holds), and none of those already held."""
        if self.engine is None:
            return 0
        now = self._clock()
        cutoff = now - self._ttl_s()
        self._exec(
            "UPDATE cutoffs SET state = 'expired', closed_ts = :now WHERE state = 'pending' AND "
            "decided_ts < :c",
            {"now": now, "c": cutoff},
        )
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT command_id, request_id, rule, action, detail, model, source_id, "
                    "gateway_source_id, "
                    "decided_ts, applied_ts, gateway_applied_ts, delivered_ts, gateway_delivered_ts, "
                    "deliveries "
                    "FROM cutoffs WHERE state = 'pending'"
                )
            ).all()
        with self._lock:
            for r in rows:
                if home is not None and (
                    r.command_id in self.by_id or not home(home_source(r.source_id, r.gateway_source_id))
                ):
                    continue
                targets = {}
                if r.source_id and r.applied_ts is None:
                    targets[r.source_id] = "engine"
                if r.gateway_source_id and r.gateway_applied_ts is None:
                    targets[r.gateway_source_id] = "gateway"
                if not targets:
                    continue
                cmd = ev.Command(
                    id=r.command_id, request_id=r.request_id, action=r.action, rule=r.rule, detail=r.detail
                )
                p = Pending(
                    command=cmd,
                    model=r.model,
                    decided_ts=r.decided_ts,
                    targets=targets,
                    gateway=r.gateway_source_id,
                    engine=r.source_id,
                )
                p.sends = p.stored_sends = int(r.deliveries)
                if r.delivered_ts is not None and r.source_id:
                    p.delivered.add(r.source_id)
                if r.gateway_delivered_ts is not None and r.gateway_source_id:
                    p.delivered.add(r.gateway_source_id)
                self._index(p)
        return len(rows)

    def forget(self, home: Callable[[str], bool]) -> int:
        """Drop from memory the pending commands whose home source ``home`` no longer accepts (a stream
        worker handed the partition on: its next owner loads them); they stay pending in the store."""
        with self._lock:
            gone = [p for p in self.by_id.values() if not home(home_source(p.engine, p.gateway))]
            for p in gone:
                for sid in list(p.targets):
                    self._unindex_target(p, sid)
        return len(gone)

    def refresh(self) -> int:
        """Catch up with what other processes stored: targets that confirmed to another ledger worker
        (a gateway's partition held by another worker) stop being re-sent, and commands closed in the
        store leave memory. Commands it closes by that are marked applied. Returns those closed."""
        if self.engine is None:
            return 0
        with self._lock:
            ids = list(self.by_id)
        if not ids:
            return 0
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT command_id, state, source_id, applied_ts, gateway_source_id, gateway_applied_ts "
                    "FROM cutoffs WHERE command_id IN :ids"
                ).bindparams(sa.bindparam("ids", expanding=True)),
                {"ids": ids},
            ).all()
        closed: list[Pending] = []
        with self._lock:
            for r in rows:
                p = self.by_id.get(r.command_id)
                if p is None:
                    continue
                done = [sid for sid in list(p.targets) if r.state != "pending"]
                if r.applied_ts is not None and r.source_id in p.targets:
                    done.append(r.source_id)
                if r.gateway_applied_ts is not None and r.gateway_source_id in p.targets:
                    done.append(r.gateway_source_id)
                ends = [self._unindex_target(p, sid) for sid in dict.fromkeys(done)]
                if any(ends) and r.state == "pending":
                    closed.append(p)
        if closed:
            now = self._clock()
            self._exec(
                "UPDATE cutoffs SET state = 'applied', closed_ts = :now, deliveries = :n "
                "WHERE command_id = :id AND state = 'pending'",
                [{"now": now, "id": p.command.id, "n": p.sends} for p in closed],
            )
        return len(closed)

    def sources(self) -> list[str]:
        """The sources with commands to deliver."""
        with self._lock:
            return list(self.by_source)

    def _index(self, p: Pending) -> None:
        self.by_id[p.command.id] = p
        for sid in p.targets:
            self.by_source.setdefault(sid, {})[p.command.id] = p
        self.by_request.setdefault(p.command.request_id, []).append(p)

    def _unindex_target(self, p: Pending, sid: str) -> bool:
        """Drop one target; True when the command has none left."""
        p.targets.pop(sid, None)
        per = self.by_source.get(sid)
        if per is not None:
            per.pop(p.command.id, None)
            if not per:
                del self.by_source[sid]
        if p.targets:
            return False
        self.by_id.pop(p.command.id, None)
        lst = self.by_request.get(p.command.request_id)
        if lst is not None:
            if p in lst:
                lst.remove(p)
            if not lst:
                del self.by_request[p.command.request_id]
        return True

    # -- decisions ---------------------------------------------------------------------------------
    def record(self, decisions: Sequence[Decision]) -> list[tuple[Decision, Pending]]:
        """Store new decisions (one transaction) and queue their commands.

        A decision already stored for the same request and rule (before a restart, or by another
        replica) is skipped: it is stored and delivered once."""
        if not decisions:
            return []
        with self._lock:
            joined = self._joined
            if joined:
                decisions = [
                    replace(d, gateway_source_id=joined[d.request_id])
                    if d.gateway_source_id is None and d.request_id in joined
                    else d
                    for d in decisions
                ]
        ids = [uuid.uuid4().hex for _ in decisions]
        if self.engine is not None:
            rows = [
                {
                    "command_id": cid,
                    "request_id": d.request_id,
                    "rule": d.rule,
                    "action": d.action,
                    "detail": d.detail,
                    "model": d.model,
                    "source_id": d.engine_source_id,
                    "gateway_source_id": d.gateway_source_id,
                    "decided_ts": d.decided_ts,
                }
                for cid, d in zip(ids, decisions, strict=True)
            ]
            with self._db_lock, self.engine.begin() as conn:
                if len(rows) == 1:
                    conn.execute(INSERT_ONE, rows[0])
                else:
                    insert_many(conn, rows)
                stored = {
                    (r.request_id, r.rule): r.command_id
                    for r in conn.execute(
                        sa.text(
                            "SELECT request_id, rule, command_id FROM cutoffs WHERE command_id IN :ids"
                        ).bindparams(sa.bindparam("ids", expanding=True)),
                        {"ids": ids},
                    )
                }
        else:
            stored = {(d.request_id, d.rule): cid for cid, d in zip(ids, decisions, strict=True)}
        out = []
        woken: set[str] = set()
        for cid, d in zip(ids, decisions, strict=True):
            if stored.get((d.request_id, d.rule)) != cid:
                continue  # decided before (a restart, another replica): stored and delivered once
            targets = {}
            if d.engine_source_id:
                targets[d.engine_source_id] = "engine"
            if d.gateway_source_id:
                targets[d.gateway_source_id] = "gateway"
            cmd = ev.Command(id=cid, request_id=d.request_id, action=d.action, rule=d.rule, detail=d.detail)  # type: ignore[arg-type]
            p = Pending(
                command=cmd,
                model=d.model,
                decided_ts=d.decided_ts,
                targets=targets,
                gateway=d.gateway_source_id,
                engine=d.engine_source_id,
            )
            if targets:
                with self._lock:
                    self._index(p)
                woken.update(targets)
            out.append((d, p))
        if woken:
            self._wake(sorted(woken))
        return out

    def add_gateway(self, request_id: str, source_id: str) -> None:
        """A gateway began streaming ``request_id`` after commands were decided on it (its events
        reached the ledger after the engine's): it becomes a target of those still pending, as it would
        have been had its events come first, and of a decision recorded just after this call."""
        with self._lock:
            self._joined[request_id] = source_id
            while len(self._joined) > 4096:
                self._joined.popitem(last=False)
            added = []
            for p in self.by_request.get(request_id, ()):
                if p.gateway is None:
                    p.gateway = source_id
                    p.targets[source_id] = "gateway"
                    self.by_source.setdefault(source_id, {})[p.command.id] = p
                    added.append(p.command.id)
        if not added:
            return
        log.info("gateway %s joined request %s after its cutoff: also a target", source_id, request_id)
        if self.engine is not None:
            with self._db_lock, self.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "UPDATE cutoffs SET gateway_source_id = :gw WHERE command_id = :id AND "
                        "gateway_source_id IS NULL"
                    ),
                    [{"gw": source_id, "id": cid} for cid in added],
                )
        self._wake([source_id])

    # -- delivery ----------------------------------------------------------------------------------
    def for_source(self, source_id: str) -> list[ev.Command]:
        """The source's unconfirmed commands, oldest first, at most ``MAX_PER_RESPONSE``."""
        with self._lock:
            per = self.by_source.get(source_id)
            if not per:
                return []
            return [p.command for p in itertools.islice(per.values(), MAX_PER_RESPONSE)]

    def has_pending(self, source_id: str) -> bool:
        return source_id in self.by_source

    def mark_delivered(self, source_id: str, commands: Sequence[ev.Command], channel: str) -> None:
        """Count a delivery. Only the first one to each target is written at once (its delivered
        timestamp); re-send counts reach ``cutoffs.deliveries`` on the ticker (``flush``) and at close."""
        now = self._clock()
        first: list[tuple[str, int, bool]] = []  # (command id, sends, to the request's gateway)
        with self._lock:
            for c in commands:
                p = self.by_id.get(c.id)
                if p is None:
                    continue
                p.sends += 1
                if source_id not in p.delivered:
                    p.delivered.add(source_id)
                    first.append((c.id, p.sends, p.targets.get(source_id) == "gateway"))
                    p.stored_sends = p.sends
        if first and self.engine is not None:
            with self._db_lock, self.engine.begin() as conn:
                for gw in (False, True):
                    rows = [{"now": now, "id": cid, "n": n} for cid, n, to_gw in first if to_gw is gw]
                    if rows:
                        col = "gateway_delivered_ts" if gw else "delivered_ts"
                        values_update(
                            conn,
                            f"{col} = COALESCE(cutoffs.{col}, v.now), deliveries = v.n",
                            rows,
                            {"id": "TEXT", "n": "BIGINT", "now": "DOUBLE PRECISION"},
                        )
        if self._on_delivered is not None:
            self._on_delivered(len(commands), channel)

    def flush(self) -> None:
        """Write re-send counts that changed since they were last stored (one transaction)."""
        with self._lock:
            rows = [
                {"n": p.sends, "id": p.command.id} for p in self.by_id.values() if p.sends != p.stored_sends
            ]
            for p in self.by_id.values():
                p.stored_sends = p.sends
        if rows and self.engine is not None:
            with self._db_lock, self.engine.begin() as conn:
                values_update(conn, "deliveries = v.n", rows, {"id": "TEXT", "n": "BIGINT"})

    async def wait(self, source_id: str, timeout_s: float) -> list[ev.Command]:
        """The source's pending commands; when there are none, wait up to ``timeout_s`` for one."""
        cmds = self.for_source(source_id)
        if cmds or timeout_s <= 0 or self._closing:
            return cmds
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        key = (loop, event)
        with self._lock:
            self._waiters.setdefault(source_id, set()).add(key)
        try:
            cmds = self.for_source(source_id)
            if not cmds and not self._closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout_s)
                cmds = self.for_source(source_id)
        finally:
            with self._lock:
                ws = self._waiters.get(source_id)
                if ws is not None:
                    ws.discard(key)
                    if not ws:
                        del self._waiters[source_id]
        return cmds

    def release_waiters(self) -> None:
        """The server is shutting down: answer every held long-poll now (with what is pending) and every
        later one at once, so open connections close instead of holding the shutdown for their wait."""
        self._closing = True
        with self._lock:
            sources = list(self._waiters)
        self._wake(sources)

    def _wake(self, source_ids: list[str]) -> None:
        if self.on_new is not None:
            self.on_new()
        with self._lock:
            keys = [k for sid in source_ids for k in self._waiters.get(sid, ())]
        for loop, event in keys:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(event.set)

    # -- confirmations -----------------------------------------------------------------------------
    def confirm(self, source_id: str, command_id: str, ts: float) -> Pending | None:
        """A source applied the command: no more re-sending to it."""
        now = self._clock()
        with self._lock:
            p = self.by_id.get(command_id)
            role = p.targets.get(source_id) if p is not None else None
            if p is not None and role is None:
                # Not a target of this command (nor a target that confirmed already): only the sources it
                # was sent to can apply it, so another source's confirmation is not one.
                closed = False
            else:
                closed = self._unindex_target(p, source_id) if p is not None else False
        if p is not None and role is None:
            if source_id in p.delivered:  # a target that confirmed already (a second confirmation)
                return None
            log.warning(
                "source %s confirmed command %s, which was not sent to it: ignored", source_id, command_id
            )
            if self._on_refused is not None:
                self._on_refused()
            return None
        if p is None:
            # Not pending here: already confirmed, or decided by another replica. Record it anyway, as
            # the target it was sent to (another source's word does not count).
            params = {"now": now, "sid": source_id, "id": command_id}
            self._exec(
                "UPDATE cutoffs SET applied_ts = COALESCE(applied_ts, :now), "
                "applied_source_id = COALESCE(applied_source_id, :sid) "
                "WHERE command_id = :id AND source_id = :sid",
                params,
            )
            self._exec(
                "UPDATE cutoffs SET gateway_applied_ts = COALESCE(gateway_applied_ts, :now) "
                "WHERE command_id = :id AND gateway_source_id = :sid",
                params,
            )
            return None
        if role == "gateway":
            sets = "gateway_applied_ts = COALESCE(gateway_applied_ts, :now)"
        else:
            sets = (
                "applied_ts = COALESCE(applied_ts, :now), "
                "applied_source_id = COALESCE(applied_source_id, :sid)"
            )
        if closed:
            sets += ", state = 'applied', closed_ts = :now, deliveries = :n"
        self._exec(
            f"UPDATE cutoffs SET {sets} WHERE command_id = :id",
            {"now": now, "sid": source_id, "id": command_id, "n": p.sends},
        )
        if self._on_applied is not None:
            self._on_applied(p, role or "engine", now - p.decided_ts)
        return p

    def request_done(self, request_id: str, source_id: str) -> None:
        """The source finished the request: whatever it has not confirmed is moot there."""
        with self._lock:
            self._joined.pop(request_id, None)  # no decision on it follows
            lst = list(self.by_request.get(request_id, ()))
            closed = [p for p in lst if source_id in p.targets and self._unindex_target(p, source_id)]
        if closed and self.engine is not None:
            now = self._clock()
            with self._db_lock, self.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "UPDATE cutoffs SET state = CASE WHEN applied_ts IS NULL AND "
                        "gateway_applied_ts IS NULL THEN 'moot' ELSE 'applied' END, closed_ts = :now, "
                        "deliveries = :n "
                        "WHERE command_id = :id AND state = 'pending'"
                    ),
                    [{"now": now, "id": p.command.id, "n": p.sends} for p in closed],
                )

    def expire(self, now: float | None = None) -> int:
        now = self._clock() if now is None else now
        limit = now - self._ttl_s()
        with self._lock:
            old = [p for p in self.by_id.values() if p.decided_ts < limit]
            for p in old:
                for sid in list(p.targets):
                    self._unindex_target(p, sid)
        if old:
            log.warning(
                "%d commands expired unconfirmed, e.g. %s (%s on %s)",
                len(old),
                old[0].command.id,
                old[0].command.rule,
                old[0].command.request_id,
            )
            if self.engine is not None:
                with self._db_lock, self.engine.begin() as conn:
                    conn.execute(
                        sa.text(
                            "UPDATE cutoffs SET state = 'expired', closed_ts = :now, deliveries = :n "
                            "WHERE command_id = :id AND state = 'pending'"
                        ),
                        [{"now": now, "id": p.command.id, "n": p.sends} for p in old],
                    )
        return len(old)

    # -- reads -------------------------------------------------------------------------------------
    def rows(
        self, *, request_id: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[CutoffRow]:
        """Stored decisions, newest first."""
        if self.engine is None:
            return []
        where, params = [], {"limit": limit}
        if request_id:
            where.append("request_id = :rid")
            params["rid"] = request_id  # type: ignore[assignment]
        if state:
            where.append("state = :state")
            params["state"] = state  # type: ignore[assignment]
        sql = "SELECT * FROM cutoffs" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY decided_ts DESC LIMIT :limit"
        with self.engine.connect() as conn:
            return [CutoffRow(**r._mapping) for r in conn.execute(sa.text(sql), params)]
