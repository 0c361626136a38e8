"""Helpers shared by the gateway tests."""

from __future__ import annotations

from typing import Any

from fake_ledger import FakeLedger


def events_of(ledger: FakeLedger, request_id: str) -> list[Any]:
    return [e for e in ledger.store.events if getattr(e, "request_id", None) == request_id]


def kinds_of(ledger: FakeLedger, request_id: str) -> list[str]:
    return [type(e).__struct_config__.tag for e in events_of(ledger, request_id)]
