"""Helpers shared by the gateway tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from tests.support.fake_ledger import FakeLedger


def events_of(ledger: FakeLedger, request_id: str) -> list[Any]:
    return [e for e in ledger.store.events if getattr(e, "request_id", None) == request_id]


def kinds_of(ledger: FakeLedger, request_id: str) -> list[str]:
    return [type(e).__struct_config__.tag for e in events_of(ledger, request_id)]


@contextlib.contextmanager
def hold_slot(gateway_url: str, rid: str = "holder") -> Iterator[None]:
    """Hold an upstream slot with a long stream until the block ends (the client then disconnects)."""
    with (
        httpx.Client(timeout=20) as client,
        client.stream(
            "POST",
            gateway_url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 1000},
            headers={"x-request-id": rid, "x-fake-delay-ms": "20"},
        ) as response,
    ):
        chunks = response.iter_raw()  # kept: a dropped iterator would close the stream
        next(chunks)
        yield
