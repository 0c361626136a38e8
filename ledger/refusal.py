"""A computed answer the ledger declines to give (advice, what-if): why, in a short ``reason``, the
HTTP status the API answers with, and the figures behind it (``details``, merged into the error body).
"""

from __future__ import annotations

from typing import Any


class Refusal(ValueError):
    def __init__(self, reason: str, message: str, *, status: int = 409, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.details = details
