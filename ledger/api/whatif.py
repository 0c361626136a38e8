"""GET /v1/whatif: the window's traffic replayed under other engine settings (:mod:`ledger.whatif`).

The query is :class:`ledger.whatif.query.WhatIfQuery` (its fields are the parameters); the answer is
:class:`ledger.whatif.answer.WhatIf`, encoded by msgspec; its schema in the OpenAPI document is msgspec's
(:mod:`ledger.api.answers`)."""

from __future__ import annotations

import threading
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import ReadsDep, SettingsDep, StoreDep, require
from ledger.api.queries import query_dependency
from ledger.whatif.answer import WhatIf
from ledger.whatif.query import WhatIfQuery
from ledger.whatif.service import what_if

router = APIRouter(prefix="/v1", tags=["whatif"], dependencies=[require("read")])

# A replay holds a CPU for seconds (about 30 s for an hour of a 4-engine fleet), under the GIL that
# ingest shares: one at a time; another asked meanwhile is told to come back.
_BUSY = threading.Lock()
# the query's parameters: WhatIfQuery's fields (names, defaults, limits), checked by FastAPI
QueryDep = Annotated[WhatIfQuery, Depends(query_dependency(WhatIfQuery))]


@router.get(
    "/whatif",
    **documents(
        WhatIf,
        404,
        408,
        409,
        422,
        429,
        description="predicted tails under each asked setting, beside the recorded one",
    ),
)
def whatif(store: StoreDep, reads: ReadsDep, settings: SettingsDep, query: QueryDep) -> Response:
    if store.dialect == "null":
        return errors.error_response(
            409, "this ledger stores nothing (null://): no traffic to replay", reason="too_little_data"
        )
    if not _BUSY.acquire(blocking=False):
        return errors.error_response(
            429,
            "another what-if is running; retry when it is done",
            reason="busy",
            headers={"Retry-After": "5"},
        )
    assert reads.engine is not None
    try:  # a WhatIfError (a Refusal) is answered by ledger.api.errors
        with reads.budget_errors():
            answer = what_if(reads.engine, query, timeout_s=settings.whatif_timeout_s)
    finally:
        _BUSY.release()
    return encoded(answer)
