"""A store that keeps nothing: the ingest ceiling for benchmarks (``--db null://``). Never for real use."""

from __future__ import annotations

from typing import Any

import numpy as np
import sqlalchemy as sa

from ledger.columnar import Columns
from ledger.store.base import Prepared, Store, WriteResult, _SourceState


class NullStore(Store):
    """Runs the whole server path (decode, validation, writer thread, fold) but stores nothing."""

    dialect = "null"

    def __init__(self) -> None:
        super().__init__(sa.create_engine("duckdb:///:memory:"))

    def write(self, batches: Any, producers: Any = None, columns: Any = None) -> list[WriteResult]:
        prepared = Prepared()
        out = []
        for i, b in enumerate(batches):
            state = _SourceState(b.source, -1, True)
            self._prepare(b.source, b.events, prepared, 0.0, state, columns[i] if columns else None)
            out.append(WriteResult(accepted=len(b.events), duplicates=0))
        # the fold, its messages' requests named as the real store names them (``keys_for``)
        parts = [p for p in prepared.step_ids if isinstance(p, Columns)]
        index = {rid: i for i, rid in enumerate(set().union(*(p.ids for p in parts)))}
        prepared.fold([np.fromiter(map(index.__getitem__, p.ids), np.int64, len(p.ids)) for p in parts])
        return out

    def _claim_owners(self, conn: Any, claims: dict[str, Any]) -> dict[str, Any]:
        return claims

    def get_request(self, request_id: str, conn: Any = None) -> dict[str, Any] | None:
        return None

    def request_events(self, request_id: str, conn: Any = None) -> list[dict[str, Any]]:
        return []

    def source_rows(self, conn: Any = None) -> list[dict[str, Any]]:
        return []

    def source_producer(self, source_id: str) -> tuple[str | None, float | None]:
        return None, None

    def release_producer(self, source_id: str, producer: str) -> None:
        pass
