"""Transport: one POST of a batch to ``/v1/events`` and what its answer means (the status rules).

=============================================  ==================  ======================================
answer                                         ``Outcome``         the worker then
=============================================  ==================  ======================================
2xx                                            ``ACKED``           releases it (its commands are handed
                                                                   over by the sender)
connection error, timeout, 5xx, 408, 429,      ``RETRY``           retries a fresh batch, then spools it;
401/403/404 (the ledger or our config is                           ``retry_after`` carries the ledger's
wrong, not the batch: keep it), 409                                ``Retry-After`` hint
``fenced`` (another producer holds the id)
another 4xx, a merged replay of several        ``SPLIT``           sends its records again one per POST
spool records
415 to a columnar message                      the JSON answer's   sends it again as JSON at once, and
                                                                   JSON from then on
another 4xx, one batch                         ``REJECTED``        drops it (counted, marker)
=============================================  ==================  ======================================
"""

from __future__ import annotations

import enum
import logging
import random
import threading
from typing import NamedTuple

import httpx

from engine_hooks.columnar import MEDIA_TYPE, as_json, is_message
from engine_hooks.config import ExporterConfig
from engine_hooks.events import PRODUCER_HEADER
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.stats import Counters

_COLUMNS = {"content-type": MEDIA_TYPE}
_RETRY_STATUSES = frozenset({401, 403, 404, 408, 429})  # 401/403/404: the ledger or our config is wrong,
# not the batch: keep it (spool) so that it is delivered once that is fixed, instead of dropping it.


class Outcome(enum.Enum):
    ACKED = "acked"  # the ledger stored the batch (now or before)
    RETRY = "retry"  # not taken, try again later (error status, timeout, refused connection)
    REJECTED = "rejected"  # refused for good (4xx): the batch is dropped
    SPLIT = "split"  # a merged replay was refused: its records are sent again one per POST


class SendResult(NamedTuple):
    """What became of a POST: the outcome, the ledger's retry hint (s) and, when acked, its answer."""

    outcome: Outcome
    retry_after: float | None = None
    content: bytes = b""


FAILED = SendResult(Outcome.RETRY)


def backoff(config: ExporterConfig, attempt: int, hint: float | None) -> float:
    """Exponential backoff with equal jitter: half the delay fixed, half random; at least ``hint``."""
    delay = min(config.backoff_max_s, config.backoff_initial_s * (2**attempt))
    delay = delay / 2 + random.uniform(0, delay / 2)
    return min(config.backoff_max_s, max(delay, hint or 0.0))


def request_headers(token: str | None, producer_key: str | None) -> dict[str, str]:
    """The ingest token and the producer key (``engine_hooks.events.PRODUCER_HEADER``) as headers."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if producer_key:
        headers[PRODUCER_HEADER] = producer_key
    return headers


def _reason(response: httpx.Response) -> str | None:
    """The ``reason`` of the ledger's error body, if it has one."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("reason") if isinstance(body, dict) else None


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class Sender:
    """What the senders need of a transport: ``send`` with retries (here), ``post`` once, ``close``."""

    _config: ExporterConfig
    _counters: Counters
    columns_refused = False  # the ledger does not read the columnar message: JSON from now on

    def send(self, body: bytes, *, attempts: int, records: int, stop: threading.Event) -> SendResult:
        """Send ``body`` up to ``attempts`` times while it fails, with backoff; stops early on ``stop``."""
        result = FAILED
        for attempt in range(attempts):
            result = self.post(body, records)
            if result.outcome is not Outcome.RETRY or attempt + 1 == attempts:
                break
            with self._counters.lock:
                self._counters.retried += 1
            if stop.wait(backoff(self._config, attempt, result.retry_after)):
                break  # shutting down: the worker spools it
        return result

    def post(self, body: bytes, records: int = 1) -> SendResult:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Transport(Sender):
    """POSTs encoded batches to the ledger over one pooled client (``max_in_flight`` connections)."""

    def __init__(
        self, config: ExporterConfig, counters: Counters, log: LogOnce, *, producer_key: str | None = None
    ):
        self._config = config
        self._counters = counters
        self._log = log
        self.columns_refused = False  # the ledger answered a columnar message with 415
        headers = {"content-type": "application/json", **request_headers(config.ingest_token, producer_key)}
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_in_flight,  # one per sender (the poller has its own client)
                max_keepalive_connections=config.max_in_flight,
                keepalive_expiry=30.0,
            ),
            trust_env=False,
        )

    def post(self, body: bytes, records: int = 1) -> SendResult:
        """One POST; ``records`` > 1: a merged replay, which a 4xx splits instead of rejecting."""
        counters = self._counters
        with counters.lock:
            counters.attempts += 1
        columns = is_message(body)
        try:
            response = self._client.post(
                self._config.events_url, content=body, headers=_COLUMNS if columns else None
            )
        except httpx.HTTPError as exc:
            with counters.lock:
                counters.send_failures += 1
            self._log(
                logging.WARNING,
                f"send:{type(exc).__name__}",
                "chunkledger exporter: ledger at %s unreachable (%s: %s); retrying, then spooling",
                self._config.url,
                type(exc).__name__,
                exc,
            )
            return FAILED
        status = response.status_code
        if 200 <= status < 300:
            return SendResult(Outcome.ACKED, None, response.content)
        if columns and status == 415:  # a ledger that does not read columns: JSON from now on
            self.columns_refused = True
            self._log(
                logging.WARNING,
                "columns_refused",
                "chunkledger exporter: ledger at %s does not read the columnar message (HTTP 415); "
                "sending JSON",
                self._config.url,
            )
            return self.post(as_json(body), records)
        with counters.lock:
            counters.send_failures += 1
        if status >= 500 or status in _RETRY_STATUSES or (status == 409 and _reason(response) == "fenced"):
            self._log(
                logging.ERROR if status in (401, 403, 404) else logging.WARNING,
                f"status:{status}",
                "chunkledger exporter: ledger answered HTTP %d (%s); retrying, then spooling",
                status,
                response.text[:200],
            )
            return SendResult(Outcome.RETRY, retry_after(response))
        if records > 1:  # merged spool records: find the one it refuses, drop only that
            self._log(
                logging.WARNING,
                f"split:{status}",
                "chunkledger exporter: ledger refused a merged replay with HTTP %d (%s); sending its "
                "%d batches one by one",
                status,
                response.text[:200],
                records,
            )
            return SendResult(Outcome.SPLIT)
        self._log(
            logging.ERROR,
            f"rejected:{status}",
            "chunkledger exporter: ledger rejected a batch with HTTP %d (%s); dropping it",
            status,
            response.text[:200],
        )
        return SendResult(Outcome.REJECTED)

    def close(self) -> None:
        self._client.close()
