"""An open ledger (a role without a token, allowed only on a loopback bind) answers this machine only.

A web page the operator visits can make the browser send requests to ``127.0.0.1``: by a name that
resolves there (DNS rebinding: the ``Host`` header is then the attacker's name) or by a cross-site
"simple" POST (the ``Origin`` header is then the page's). So a request to a route whose role is open
must name a loopback host (``localhost``, ``127.0.0.0/8``, ``[::1]``, any port) in ``Host``, and, if it
has an ``Origin``, a loopback one. (The JSON-only content type of bodies is checked for every route in
``ledger.api.gate``; a browser sends an ``Origin`` with every cross-site POST.)
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ledger.config import is_loopback


def _host_name(host: str) -> str:
    """The name of a ``Host`` value without its port (``[::1]:8080`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def loopback_host(host: str) -> bool:
    return bool(host) and is_loopback(_host_name(host))


def foreign(host: str | None, origin: str | None) -> str | None:
    """Why a request to an open route is refused (the header, what it said), or None when it may pass."""
    if not loopback_host(host or ""):
        return f"Host: {host!r} is not this machine's loopback name"
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not loopback_host(parts.netloc):
            return f"Origin: {origin!r} is not a loopback origin"
    return None
