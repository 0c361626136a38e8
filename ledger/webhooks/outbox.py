"""Webhook subscriptions, the persistent outbox and its delivery worker.

``emit(alert)`` writes one outbox row per subscriber of the alert's event type (``ledger.alerts``),
with the body already rendered in the subscriber's format (``json``: ``{"id", "type", "ts", "data"}``;
``text``: a Slack-compatible ``{"text": ...}``). The worker thread claims due rows with a lease
(``UPDATE .. RETURNING``, so two replicas on one PostgreSQL never send the same row at once), POSTs them
signed (``ledger.webhooks.signing``), logs every attempt in ``webhook_attempts`` and either marks the row
delivered (2xx), schedules a retry with exponential backoff and jitter, or, after ``max_attempts``,
dead-letters it. Rows live in the database, so deliveries pending at a restart go out after it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
import sqlalchemy as sa

from ledger.alerts import (
    BODIES,
    EVENT_TYPES,
    Alert,
    CutoffAlert,
    DataLossAlert,
    SloBreachAlert,
    StarvationAlert,
    TextBody,
)
from ledger.rows import Delivery, DeliveryAttempt, Webhook
from ledger.webhooks.signing import HEADER, sign
from ledger.webhooks.targets import TargetPolicy, TargetRefused

log = logging.getLogger(__name__)

FORMATS = ("json", "text")


def render_text(alert: Alert) -> str:
    """One line for chat tools (Slack's ``text`` field)."""
    match alert:
        case CutoffAlert():
            return (
                f":scissors: chunkledger cut request `{alert.request_id}` "
                f"({alert.model or 'unknown model'}): "
                f"{alert.rule} -> {alert.action}, {alert.detail}"
            )
        case SloBreachAlert():
            verb = "breached" if alert.state == "firing" else "recovered"
            return (
                f":rotating_light: chunkledger SLO {verb} for {alert.model}: {alert.metric} p99 "
                f"{alert.p99_s:.3f} s vs target {alert.target_s:.3f} s over "
                f"{alert.samples} requests"
            )
        case StarvationAlert():
            return (
                f":hourglass: chunkledger: request `{alert.request_id}` "
                f"({alert.model or 'unknown model'}) "
                f"waiting {alert.waited_s:.1f} s (bound {alert.bound_s:g} s)"
            )
        case DataLossAlert():
            return (
                f":warning: chunkledger: source {alert.source_id} dropped {alert.count} events "
                f"({alert.reason})"
            )
    return f"chunkledger {alert.event_type}: {json.dumps(msgspec.to_builtins(alert), sort_keys=True)}"


def _posted_body(alert: Alert, format: str, event_id: str, ts: float) -> str:
    """The body posted for ``alert`` to a subscriber in ``format``: the json format's
    ``{"data", "id", "ts", "type"}`` (keys sorted) or the text format's ``{"text"}``."""
    if format == "text":
        return json.dumps(msgspec.to_builtins(TextBody(text=render_text(alert))))
    body = BODIES[type(alert)](id=event_id, ts=ts, data=alert)
    return json.dumps(msgspec.to_builtins(body), sort_keys=True)


class SubscriptionError(ValueError):
    """A bad subscription request; the message names the field."""


class Webhooks:
    def __init__(
        self,
        engine: sa.Engine,
        *,
        max_attempts: int = 8,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        timeout_s: float = 5.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_attempt: Callable[[str, int | None, str | None, bool], None] | None = None,
        targets: TargetPolicy | None = None,
    ) -> None:
        self.targets = targets or TargetPolicy()  # public addresses only, unless allow-listed
        self.engine = engine
        self.max_attempts = max_attempts
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._on_attempt = on_attempt  # (event_type, status, failure reason or None, dead)
        self._db_lock = threading.Lock()  # DuckDB fails concurrent updates of a row: one writer here
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: httpx.Client | None = None

    # -- subscriptions -----------------------------------------------------------------------------
    def create(self, *, url: str, secret: str, event_types: list[str], format: str = "json") -> Webhook:
        if len(secret) < 16:
            raise SubscriptionError("secret: at least 16 characters")
        if not event_types:
            raise SubscriptionError(f"event_types: name at least one of {', '.join(EVENT_TYPES)}")
        unknown = [t for t in event_types if t not in EVENT_TYPES]
        if unknown:
            raise SubscriptionError(f"event_types: unknown {unknown}; choose from {', '.join(EVENT_TYPES)}")
        if format not in FORMATS:
            raise SubscriptionError(f"format: {format!r}; choose json or text")
        try:  # last: it may resolve the host name
            self.targets.check_url(url)
        except TargetRefused as exc:
            raise SubscriptionError(f"url: {exc}") from None
        row = {
            "id": uuid.uuid4().hex,
            "url": url,
            "secret": secret,
            "event_types": ",".join(dict.fromkeys(event_types)),
            "format": format,
            "created_ts": self._clock(),
        }
        with self._db_lock, self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO webhook_subscriptions (id, url, secret, event_types, format, created_ts) "
                    "VALUES (:id, :url, :secret, :event_types, :format, :created_ts)"
                ),
                row,
            )
        return self._public(row)

    @staticmethod
    def _public(row: Any) -> Webhook:
        """The subscription as it is shown: without its secret."""
        shown = {k: v for k, v in row.items() if k not in ("secret", "deleted_ts", "event_types")}
        return Webhook(**shown, event_types=row["event_types"].split(","))

    def subscriptions(self, event_type: str | None = None) -> list[Webhook]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT * FROM webhook_subscriptions WHERE deleted_ts IS NULL ORDER BY created_ts")
            ).all()
        out = []
        for r in rows:
            m = dict(r._mapping)
            if event_type is not None and event_type not in m["event_types"].split(","):
                continue
            out.append(self._public(m))
        return out

    def delete(self, sub_id: str) -> bool:
        now = self._clock()
        with self._db_lock, self.engine.begin() as conn:
            found = conn.execute(
                sa.text("SELECT id FROM webhook_subscriptions WHERE id = :id AND deleted_ts IS NULL"),
                {"id": sub_id},
            ).first()
            if found is None:
                return False
            conn.execute(
                sa.text("UPDATE webhook_subscriptions SET deleted_ts = :now WHERE id = :id"),
                {"now": now, "id": sub_id},
            )
            conn.execute(
                sa.text(
                    "UPDATE webhook_outbox SET state = 'dead', last_error = 'subscription deleted' "
                    "WHERE subscription_id = :id AND state = 'pending'"
                ),
                {"id": sub_id},
            )
        return True

    # -- outbox ------------------------------------------------------------------------------------
    def emit(self, alert: Alert) -> int:
        """Queue ``alert`` for every subscriber of its event type; returns how many deliveries."""
        return self.emit_many([alert])

    def emit_many(self, alerts: Sequence[Alert]) -> int:
        """Queue several alerts in one transaction, each for every subscriber of its event type;
        returns how many deliveries."""
        types = {a.event_type for a in alerts}
        subs = [s for s in self.subscriptions() if types.intersection(s.event_types)]
        if not subs:
            return 0
        now = self._clock()
        rows = []
        for alert in alerts:
            event_id = uuid.uuid4().hex  # the same for every subscriber of this event
            for s in subs:
                if alert.event_type not in s.event_types:
                    continue
                rows.append(
                    {
                        "id": uuid.uuid4().hex,
                        "subscription_id": s.id,
                        "event_type": alert.event_type,
                        "event_id": event_id,
                        "body": _posted_body(alert, s.format, event_id, now),
                        "created_ts": now,
                        "next_attempt_ts": now,
                    }
                )
        with self._db_lock, self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO webhook_outbox (id, subscription_id, event_type, event_id, "
                    "body, created_ts, "
                    "next_attempt_ts, attempts, state) VALUES (:id, :subscription_id, "
                    ":event_type, :event_id, "
                    ":body, :created_ts, :next_attempt_ts, 0, 'pending')"
                ),
                rows,
            )
        self._wake.set()
        return len(rows)

    def backoff_s(self, attempts: int) -> float:
        """Delay before attempt ``attempts + 1``: exponential, capped, with +-50% jitter."""
        base = min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, attempts - 1))
        return base * (0.5 + self._rng.random())

    def _claim(self, now: float, limit: int = 20) -> list[Any]:
        lease = now + 2 * self.timeout_s + 5
        with self._db_lock, self.engine.begin() as conn:
            ids = [
                r[0]
                for r in conn.execute(
                    sa.text(
                        "UPDATE webhook_outbox SET lease_until = :lease WHERE id IN (SELECT id "
                        "FROM webhook_outbox "
                        "WHERE state = 'pending' AND next_attempt_ts <= :now AND (lease_until IS NULL OR "
                        "lease_until < :now) ORDER BY next_attempt_ts LIMIT :limit) AND state = "
                        "'pending' AND "
                        "(lease_until IS NULL OR lease_until < :now) RETURNING id"
                    ),
                    {"lease": lease, "now": now, "limit": limit},
                )
            ]
            if not ids:
                return []
            return list(
                conn.execute(
                    sa.text(
                        "SELECT o.id, o.event_type, o.body, o.attempts, s.url, s.secret FROM "
                        "webhook_outbox o "
                        "JOIN webhook_subscriptions s ON s.id = o.subscription_id WHERE o.id IN :ids "
                        "ORDER BY o.next_attempt_ts"
                    ).bindparams(sa.bindparam("ids", expanding=True)),
                    {"ids": ids},
                )
            )

    def run_once(self, now: float | None = None) -> int:
        """Send every due delivery once; returns the attempts made."""
        now = self._clock() if now is None else now
        rows = self._claim(now)
        if self._http is None:
            self._http = httpx.Client(timeout=self.timeout_s)
        for r in rows:
            self._attempt(r)
        return len(rows)

    def _attempt(self, r: Any) -> None:
        body = r.body.encode()
        attempt = r.attempts + 1
        started = time.monotonic()
        status: int | None = None
        error: str | None = None
        assert self._http is not None
        try:
            # Checked again now, on what the name resolves to now; the POST goes to that address.
            target = self.targets.target(r.url)
            resp = self._http.post(
                target.url,
                content=body,
                headers={
                    "Host": target.host_header,
                    "Content-Type": "application/json",
                    HEADER: sign(r.secret, body),
                    "X-Chunkledger-Event": r.event_type,
                    "X-Chunkledger-Delivery": r.id,
                    "User-Agent": "chunkledger-webhooks/1",
                },
                extensions={"sni_hostname": target.sni_hostname} if target.sni_hostname else None,
            )
            status = resp.status_code
            if not 200 <= status < 300:
                error = f"HTTP {status}"
        except TargetRefused as exc:
            error = f"target refused: {exc}"[:500]
        except httpx.TimeoutException:
            error = "timeout"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        took = time.monotonic() - started
        now = self._clock()
        dead = error is not None and attempt >= self.max_attempts
        with self._db_lock, self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO webhook_attempts (delivery_id, attempt, ts, status_code, error, duration_s) "
                    "VALUES (:id, :attempt, :ts, :status, :error, :took)"
                ),
                {"id": r.id, "attempt": attempt, "ts": now, "status": status, "error": error, "took": took},
            )
            if error is None:
                sql = (
                    "UPDATE webhook_outbox SET state = 'delivered', attempts = :attempt, "
                    "last_status = :status, "
                    "last_error = NULL, delivered_ts = :now, lease_until = NULL WHERE id = :id"
                )
                params: dict[str, Any] = {"attempt": attempt, "status": status, "now": now, "id": r.id}
            else:
                sql = (
                    "UPDATE webhook_outbox SET state = :state, attempts = :attempt, last_status = :status, "
                    "last_error = :error, next_attempt_ts = :next, lease_until = NULL WHERE id = :id"
                )
                params = {
                    "state": "dead" if dead else "pending",
                    "attempt": attempt,
                    "status": status,
                    "error": error,
                    "next": now + self.backoff_s(attempt),
                    "id": r.id,
                }
            conn.execute(sa.text(sql), params)
        if error is not None:
            log.info(
                "webhook %s attempt %d failed: %s%s", r.id, attempt, error, " (dead-lettered)" if dead else ""
            )
        if self._on_attempt is not None:
            reason = (
                None
                if error is None
                else ("status" if status is not None else ("timeout" if error == "timeout" else "connect"))
            )
            self._on_attempt(r.event_type, status, reason, dead)

    def pending_count(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM webhook_outbox WHERE state = 'pending'")
                ).scalar_one()
            )

    def deliveries(self, *, state: str | None = None, limit: int = 100) -> list[Delivery]:
        """Newest deliveries with their attempt log."""
        sql = "SELECT * FROM webhook_outbox" + (" WHERE state = :state" if state else "")
        sql += " ORDER BY created_ts DESC LIMIT :limit"
        with self.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(sa.text(sql), {"state": state, "limit": limit})]
            if not rows:
                return []
            attempts = conn.execute(
                sa.text(
                    "SELECT delivery_id, attempt, ts, status_code, error, duration_s FROM webhook_attempts "
                    "WHERE delivery_id IN :ids ORDER BY delivery_id, attempt"
                ).bindparams(sa.bindparam("ids", expanding=True)),
                {"ids": [r["id"] for r in rows]},
            ).all()
        log_by: dict[str, list[DeliveryAttempt]] = {}
        for a in attempts:
            m = dict(a._mapping)
            log_by.setdefault(m.pop("delivery_id"), []).append(DeliveryAttempt(**m))
        out = []
        for r in rows:
            r.pop("lease_until", None)
            r["body"] = json.loads(r["body"])
            out.append(Delivery(**r, log=log_by.get(r["id"], [])))
        return out

    # -- worker ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.engine.dialect.name == "duckdb":
            # One process owns a DuckDB file: leases left by a killed predecessor are stale.
            with self._db_lock, self.engine.begin() as conn:
                conn.execute(
                    sa.text("UPDATE webhook_outbox SET lease_until = NULL WHERE lease_until IS NOT NULL")
                )
        self._thread = threading.Thread(target=self._run, name="chunkledger-webhooks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                n = self.run_once()
            except Exception:
                log.exception("webhook worker pass failed")
                n = 0
            if n == 0:
                self._wake.wait(self.poll_s)
                self._wake.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._http is not None:
            self._http.close()
            self._http = None
