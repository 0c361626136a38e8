"""Webhook signatures: ``X-Chunkledger-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256>``.

The MAC is HMAC-SHA256 keyed with the subscription's secret over ``f"{t}.".encode() + body`` (the raw
request body bytes, exactly as received). To verify, a receiver recomputes it, compares in constant time,
and rejects a ``t`` too far from its own clock (replays)::

    from ledger.webhooks.signing import verify
    verify(secret, request.headers["X-Chunkledger-Signature"], raw_body)   # raises BadSignature

The module needs only the standard library, so a receiver can copy it.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "X-Chunkledger-Signature"


class BadSignature(ValueError):
    pass


def _mac(secret: str, t: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, t: int | None = None) -> str:
    """The header value for ``body`` signed at ``t`` (now by default)."""
    t = int(time.time()) if t is None else t
    return f"t={t},v1={_mac(secret, t, body)}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0, now: float | None = None
) -> int:
    """Check a signature header; returns its timestamp or raises ``BadSignature`` saying why."""
    parts: dict[str, list[str]] = {}
    for item in header.split(","):
        k, sep, v = item.strip().partition("=")
        if sep:
            parts.setdefault(k, []).append(v)
    try:
        t = int(parts["t"][0])
    except (KeyError, ValueError):
        raise BadSignature("no t=<unix seconds> in the signature header") from None
    macs = parts.get("v1")
    if not macs:
        raise BadSignature("no v1=<hex> in the signature header")
    now = time.time() if now is None else now
    if abs(now - t) > tolerance_s:
        raise BadSignature(f"timestamp {t} is {abs(now - t):.0f} s from now (tolerance {tolerance_s:g} s)")
    expected = _mac(secret, t, body)
    if not any(hmac.compare_digest(expected, m) for m in macs):
        raise BadSignature("signature does not match the body")
    return t
