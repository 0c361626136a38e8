"""GET /v1/whatif: the window's traffic replayed under other engine settings (:mod:`ledger.whatif`)."""

from __future__ import annotations

import threading
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ledger.api import errors
from ledger.api.deps import ReadsDep, SettingsDep, StoreDep, require
from ledger.api.models import WhatIf
from ledger.whatif.service import MAX_CALIBRATION_ERROR, MAX_CANDIDATES, what_if_request

router = APIRouter(prefix="/v1", tags=["whatif"], dependencies=[require("read")])

# A replay holds a CPU for seconds (about 30 s for an hour of a 4-engine fleet), under the GIL that
# ingest shares: one at a time; another asked meanwhile is told to come back.
_BUSY = threading.Lock()


@router.get(
    "/whatif",
    response_model=None,
    responses={200: {"model": WhatIf}, **errors.responses(*errors.AUTH, 404, 408, 409, 422, 429)},
)
def whatif(
    store: StoreDep,
    reads: ReadsDep,
    settings: SettingsDep,
    set: list[str] = Query(
        [],
        max_length=MAX_CANDIDATES,
        description="a setting to replay, key=value[,key=value]; repeat for several",
    ),
    sweep: str | None = Query(None, max_length=2000, description="one setting per value: key=v1,v2,..."),
    policy: str | None = Query(None, max_length=32, description="fcfs, priority or kv-idle: every setting"),
    recorded: str | None = Query(
        None, max_length=2000, description="the engine's settings in the window, key=value[,...]"
    ),
    model: str | None = Query(None, min_length=1, max_length=256, description="served model (sources.model)"),
    source_id: str | None = Query(None, min_length=1, max_length=128, description="one engine source"),
    since: str | None = Query(None, max_length=64, description="unix seconds, ISO 8601, or an age: 15m, 2h"),
    until: str | None = Query(None, max_length=64),
    long_prompt_tokens: int | None = Query(None, ge=1, le=10_000_000, description="long prompts"),
    itl_target_ms: float | None = Query(None, gt=0, le=600_000, description="mark settings meeting it"),
    ttft_target_ms: float | None = Query(None, gt=0, le=3_600_000, description="short TTFT p99 target"),
    max_error: float = Query(MAX_CALIBRATION_ERROR, ge=0, le=100, description="largest calibration error"),
    force: bool = Query(False, description="answer even when the calibration error is over max_error"),
    fit_source: str | None = Query(
        None, min_length=1, max_length=128, description="fit step time on this engine's steps (a profile run)"
    ),
    fit_since: str | None = Query(None, max_length=64, description="fit step time on steps from then"),
    fit_until: str | None = Query(None, max_length=64, description="... until then"),
    attention_source: str | None = Query(
        None,
        min_length=1,
        max_length=128,
        description="fit the attention inside a chunk on this engine's steps (a profile run), the rest on "
        "the window's",
    ),
    step_noise: bool = Query(
        True,
        description="each replayed decode-only step's time times a factor from the window's own steps' "
        "spread, and each step's engine-loop time before it as the window measured it",
    ),
) -> dict[str, Any] | JSONResponse:
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
            return what_if_request(
                reads.engine,
                timeout_s=settings.whatif_timeout_s,
                set=set,
                sweep=sweep,
                policy=policy,
                recorded=recorded,
                model=model,
                source_id=source_id,
                since=since,
                until=until,
                long_prompt_tokens=long_prompt_tokens,
                itl_target_ms=itl_target_ms,
                ttft_target_ms=ttft_target_ms,
                max_error=max_error,
                force=force,
                fit_source=fit_source,
                fit_since=fit_since,
                fit_until=fit_until,
                attention_source=attention_source,
                step_noise=step_noise,
            )
    finally:
        _BUSY.release()
